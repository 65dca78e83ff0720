"""The three components of CalibrationStats (pair moments, top-k candidates, K sample), the pooling-rule
table, bit-identity of the pooled covariances against a direct float64 reference, and the stats file
format (v2 and v1 files laid out by hand still load to identical arrays)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rope_quant.calib.candidates import TopKCandidates
from rope_quant.calib.ksample import KSample
from rope_quant.calib.moments import (
    CalibrationShapeError,
    IncompatibleStatsError,
    PairMoments,
    StatsFileError,
    UnknownPoolingRuleError,
)
from rope_quant.calib.rules import POOLING, POOLING_RULES, STREAMS, PoolingRule, PoolSpec, pool_spec
from rope_quant.calib.stats import CalibrationStats, merge_all
from rope_quant.core.rope import pair_indices

L, HQ, HK, D = 2, 6, 2, 8
K = D // 2
G = HQ // HK
_STABLE = ("mean_a", "mean_b", "m2_aa", "m2_bb", "m2_ab")
_RAW = ("sum_a", "sum_b", "sum_aa", "sum_bb", "sum_ab")


def make_data(seed: int, batch: int = 3, seq: int = 10) -> dict[tuple[int, str], np.ndarray]:
    """(batch, seq, H*D) inputs per (layer, stream) with stream/head-dependent means and scales."""
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(L):
        for stream, heads in (("q", HQ), ("k", HK)):
            scale = rng.uniform(0.3, 2.0, heads * D)
            mean = rng.normal(scale=2.0, size=heads * D)
            out[layer, stream] = rng.normal(size=(batch, seq, heads * D)) * scale + mean
    return out


def feed(stats: CalibrationStats, data, seq: slice = slice(None)) -> CalibrationStats:
    for (layer, stream), x in data.items():
        stats.update(layer, stream, x[:, seq])
    return stats


def pairs(x: np.ndarray, heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Pair channels a, b of shape (N, heads, K) of (..., heads*D) inputs."""
    rows = x.reshape(-1, heads, D)
    ia, ib = pair_indices(D, "rotate_half")
    return rows[:, :, ia], rows[:, :, ib]


def cov_ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(3, K) biased covariance (s11, s22, s12) of rows (n, K) by np.cov, float64."""
    out = np.empty((3, a.shape[1]))
    for k in range(a.shape[1]):
        c = np.cov(np.stack([a[:, k], b[:, k]]), bias=True)
        out[:, k] = c[0, 0], c[1, 1], c[0, 1]
    return out


def reference(data, rule: str) -> np.ndarray:
    """The pooled covariance of ``rule`` computed directly from the rows: (3, L, K) or (3, L, HK, K)."""
    out = []
    for layer in range(L):
        qa, qb = pairs(data[layer, "q"], HQ)
        ka, kb = pairs(data[layer, "k"], HK)
        if rule == "rows":
            out.append(cov_ref(np.concatenate([qa.reshape(-1, K), ka.reshape(-1, K)]),
                               np.concatenate([qb.reshape(-1, K), kb.reshape(-1, K)])))
        elif rule == "k_only":
            out.append(cov_ref(ka.reshape(-1, K), kb.reshape(-1, K)))
        elif rule == "balanced":
            m = [(a.reshape(-1, K), b.reshape(-1, K)) for a, b in ((qa, qb), (ka, kb))]
            m1a = sum(a.mean(0) for a, _ in m) / 2
            m1b = sum(b.mean(0) for _, b in m) / 2
            m2aa = sum((a * a).mean(0) for a, _ in m) / 2
            m2bb = sum((b * b).mean(0) for _, b in m) / 2
            m2ab = sum((a * b).mean(0) for a, b in m) / 2
            out.append(np.stack([m2aa - m1a * m1a, m2bb - m1b * m1b, m2ab - m1a * m1b]))
        else:
            heads = []
            for h in range(HK):
                a = np.concatenate([qa[:, h * G:(h + 1) * G].reshape(-1, K), ka[:, h]])
                b = np.concatenate([qb[:, h * G:(h + 1) * G].reshape(-1, K), kb[:, h]])
                heads.append(cov_ref(a, b))
            out.append(np.stack(heads, axis=1))
    return np.stack(out, axis=1)


def as_array(cov) -> np.ndarray:
    return np.stack([np.asarray(v) for v in cov])


@pytest.fixture(scope="module")
def data():
    return make_data(0)


@pytest.fixture(scope="module")
def stats(data):
    return feed(CalibrationStats(L, HQ, HK, D, topk=7, topk_streams=("q", "k"), sample_rows=12, sample_seed=5), data)


# ----------------------------------------------------------------------------- the pooling-rule table


def test_pooling_table_names_every_rule_once():
    assert tuple(POOLING) == tuple(PoolingRule)
    assert POOLING_RULES == ("rows", "k_only", "balanced", "per_head")
    assert all(isinstance(spec, PoolSpec) for spec in POOLING.values())
    assert pool_spec("balanced") is POOLING[PoolingRule.BALANCED] and pool_spec(PoolingRule.ROWS).streams == STREAMS
    with pytest.raises(TypeError):
        POOLING["median"] = PoolSpec(("k",))  # read-only
    with pytest.raises(ValueError):
        PoolSpec(("k",), equal_stream_weights=True)  # equal weights need two streams


@pytest.mark.parametrize("method", ["pooled", "pooled_raw", "pooled_mean"])
@pytest.mark.parametrize("rule", ["median", "ROWS", None, ["rows"]])
def test_unknown_rules_raise_naming_the_known_ones(stats, method, rule):
    with pytest.raises(UnknownPoolingRuleError, match=r"expected one of \('rows', 'k_only', 'balanced', 'per_head'\)"):
        getattr(stats, method)(rule)


@pytest.mark.parametrize("rule", list(PoolingRule))
def test_enum_members_and_names_pool_identically(stats, rule):
    assert np.array_equal(as_array(stats.pooled(rule)), as_array(stats.pooled(rule.value)))
    assert np.array_equal(as_array(stats.pooled_raw(rule)), as_array(stats.pooled_raw(str(rule))))


# ----------------------------------------------------------------------------- pooled covariances


@pytest.mark.parametrize("rule", POOLING_RULES)
def test_pooled_equals_direct_float64_reference(data, stats, rule):
    ref = reference(data, rule)
    for method in ("pooled", "pooled_raw"):
        got = as_array(getattr(stats, method)(rule))
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12, err_msg=method)


@pytest.mark.parametrize("rule", POOLING_RULES)
def test_save_load_pooled_is_bit_identical(tmp_path, stats, rule):
    back = CalibrationStats.load(stats.save(tmp_path / "s.npz"))
    for method in ("pooled", "pooled_raw", "pooled_mean"):
        a, b = as_array(getattr(stats, method)(rule)), as_array(getattr(back, method)(rule))
        assert a.dtype == b.dtype == np.float64 and a.tobytes() == b.tobytes(), method


def test_save_load_keeps_every_component(tmp_path, stats):
    back = CalibrationStats.load(stats.save(tmp_path / "s.npz"))
    assert back.config() == stats.config()
    for layer in range(L):
        assert np.array_equal(back.candidates(layer), stats.candidates(layer))
        for got, want in zip(back.k_sample(layer), stats.k_sample(layer), strict=True):
            assert np.array_equal(got, want)
    for st in STREAMS:
        for key, arr in stats.raw_moments(st).items():
            assert np.array_equal(back.raw_moments(st)[key], arr)


# ----------------------------------------------------------------------------- pair moments


def moments_of(data, seq: slice = slice(None)) -> PairMoments:
    m = PairMoments(L, HQ, HK, K)
    for (layer, stream), x in data.items():
        m.update(layer, stream, *pairs(x[:, seq], HQ if stream == "q" else HK))
    return m


def test_pair_moments_array_round_trip(data):
    m = moments_of(data)
    back = PairMoments(L, HQ, HK, K)
    back.load_arrays(m.to_arrays())
    assert back.to_arrays().keys() == m.to_arrays().keys()
    for key, arr in m.to_arrays().items():
        assert np.array_equal(back.to_arrays()[key], arr), key
    for rule in POOLING_RULES:
        assert as_array(back.pooled(rule)).tobytes() == as_array(m.pooled(rule)).tobytes()
    with pytest.raises(StatsFileError, match=r"q_n has shape \(2,\), expected \(3,\)"):
        PairMoments(L + 1, HQ, HK, K).load_arrays(m.to_arrays())


def test_pair_moments_merge_equals_one_pass(data):
    whole = moments_of(data)
    merged = moments_of(data, slice(0, 3)).merge(moments_of(data, slice(3, 4))).merge(moments_of(data, slice(4, None)))
    for st in STREAMS:
        assert np.array_equal(merged.n_rows(st), whole.n_rows(st))
    for rule in POOLING_RULES:
        np.testing.assert_allclose(as_array(merged.pooled(rule)), as_array(whole.pooled(rule)), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(as_array(merged.pooled_raw(rule)), as_array(whole.pooled_raw(rule)),
                                   rtol=1e-12, atol=1e-12)
    with pytest.raises(IncompatibleStatsError):
        whole.merge(PairMoments(L, HQ, HK, K + 1))
    with pytest.raises(IncompatibleStatsError):
        whole.merge(TopKCandidates(L, K))


def test_pair_moments_check_their_geometry():
    with pytest.raises(CalibrationShapeError, match="multiple"):
        PairMoments(L, 5, 2, K)
    with pytest.raises(CalibrationShapeError, match="n_layers"):
        PairMoments(0, HQ, HK, K)


# ----------------------------------------------------------------------------- top-k candidates


def candidates_of(data, seq: slice = slice(None), topk: int = 5) -> TopKCandidates:
    c = TopKCandidates(L, K, topk, ("q", "k"))
    for (layer, stream), x in data.items():
        c.update(layer, stream, *pairs(x[:, seq], HQ if stream == "q" else HK))
    return c


def test_candidates_array_round_trip_and_merge(data):
    whole = candidates_of(data)
    back = TopKCandidates(L, K, 5, ("q", "k"))
    back.load_arrays(whole.to_arrays())
    merged = candidates_of(data, slice(0, 4)).merge(candidates_of(data, slice(4, None)))
    for layer in range(L):
        assert np.array_equal(back.candidates(layer), whole.candidates(layer))
        assert np.array_equal(merged.candidates(layer), whole.candidates(layer))
    with pytest.raises(IncompatibleStatsError):
        whole.merge(TopKCandidates(L, K, 6, ("q", "k")))
    with pytest.raises(ValueError):
        TopKCandidates(L, K, 6).load_arrays(whole.to_arrays())


def test_candidates_ignore_streams_they_do_not_keep(data):
    c = TopKCandidates(L, K, 5)  # K stream only
    c.update(0, "q", *pairs(data[0, "q"], HQ))
    assert c.candidates(0).shape == (0, K, 2)


# ----------------------------------------------------------------------------- K sample


def sample_of(data, seq: slice = slice(None), size: int = 12, seed: int = 0) -> KSample:
    s = KSample(L, HK, D, size, seed)
    for layer in range(L):
        x = data[layer, "k"][:, seq]
        s.update(layer, x.shape, x.reshape(-1, HK, D))
    return s


def test_k_sample_array_round_trip(data):
    s = sample_of(data)
    back = KSample(L, HK, D, 12)
    back.load_arrays(s.to_arrays())
    for layer in range(L):
        rows, positions = back.sample(layer)
        assert np.array_equal(rows, s.sample(layer)[0]) and np.array_equal(positions, s.sample(layer)[1])
        assert rows.shape == (12, HK, D) and positions.max() < 10
    assert KSample(L, HK, D).to_arrays() == {}
    with pytest.raises(StatsFileError, match="sample_0_rows"):
        KSample(L, HK + 1, D, 12).load_arrays(s.to_arrays())


def test_k_sample_merge_keeps_the_smallest_keys_of_the_union(data):
    left, right = sample_of(data, slice(0, 5), seed=1), sample_of(data, slice(5, None), seed=2)
    keys = {layer: np.concatenate([left._sample[layer][0], right._sample[layer][0]]) for layer in range(L)}
    merged = left.merge(right)
    for layer in range(L):
        assert np.array_equal(np.sort(merged._sample[layer][0]), np.sort(keys[layer])[:12])
    with pytest.raises(IncompatibleStatsError):
        merged.merge(KSample(L, HK, D, 13))


def test_copy_continues_the_sample_key_stream(data):
    a = feed(CalibrationStats(L, HQ, HK, D, sample_rows=6, sample_seed=3), data, slice(0, 5))
    b = a.copy()
    feed(a, data, slice(5, None))
    feed(b, data, slice(5, None))
    for layer in range(L):
        assert np.array_equal(a.k_sample(layer)[0], b.k_sample(layer)[0])


def test_calibration_stats_merge_is_the_component_merges(data, stats):
    kw = {"topk": 7, "topk_streams": ("q", "k"), "sample_rows": 12}
    parts = [feed(CalibrationStats(L, HQ, HK, D, **kw, sample_seed=i), data, seq)
             for i, seq in enumerate((slice(0, 6), slice(6, None)))]
    merged = merge_all(parts)
    for layer in range(L):
        assert np.array_equal(merged.candidates(layer), stats.candidates(layer))
        assert merged.k_sample(layer)[0].shape == (12, HK, D)
    for rule in POOLING_RULES:
        np.testing.assert_allclose(as_array(merged.pooled(rule)), as_array(stats.pooled(rule)), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- file format v2 / v1


def legacy_arrays(version: int, seed: int = 0, sample_rows: int = 3) -> dict[str, np.ndarray]:
    """A statistics file laid out key by key as format v2 (v1: no K sample, no sample fields in meta)."""
    rng = np.random.default_rng(seed)
    topk = 4
    meta = {"version": version, "n_layers": L, "n_q_heads": HQ, "n_kv_heads": HK, "head_dim": D,
            "layout": "rotate_half", "topk": topk, "topk_streams": ["k"]}
    if version >= 2:
        meta |= {"sample_rows": sample_rows, "sample_seed": 9}
    arrays = {"meta": np.array(json.dumps(meta)), "cand": rng.normal(size=(L, topk, K, 2)),
              "cand_count": np.array([topk, 2], dtype=np.int64)}
    if version >= 2:
        for layer in range(L):
            arrays[f"sample_{layer}_keys"] = np.sort(rng.random(sample_rows))
            arrays[f"sample_{layer}_pos"] = rng.integers(0, 50, sample_rows)
            arrays[f"sample_{layer}_rows"] = rng.normal(size=(sample_rows, HK, D)).astype(np.float32)
    for st, heads in (("q", HQ), ("k", HK)):
        arrays[f"{st}_n"] = np.array([30, 40], dtype=np.int64)
        for key in _STABLE + _RAW:
            arrays[f"{st}_{key}"] = rng.uniform(1.0, 2.0, size=(L, heads, K))
    return arrays


@pytest.mark.parametrize("version", [1, 2])
def test_legacy_files_load_to_identical_arrays(tmp_path, version):
    arrays = legacy_arrays(version)
    path = tmp_path / f"v{version}.npz"
    np.savez(path, **arrays)
    back = CalibrationStats.load(path)
    assert back.sample_rows == (3 if version == 2 else 0) and back.topk == 4 and back.topk_streams == ("k",)
    section = back.moments.to_arrays()
    for st in STREAMS:
        assert np.array_equal(back.n_rows(st), arrays[f"{st}_n"])
        for key in _STABLE + _RAW:
            assert section[f"{st}_{key}"].tobytes() == arrays[f"{st}_{key}"].tobytes(), (st, key)
    assert np.array_equal(back.candidates(0), arrays["cand"][0]) and np.array_equal(back.candidates(1),
                                                                                      arrays["cand"][1, :2])
    for layer in range(L if version == 2 else 0):
        rows, positions = back.k_sample(layer)
        assert np.array_equal(rows, arrays[f"sample_{layer}_rows"].astype(np.float64))
        assert np.array_equal(positions, arrays[f"sample_{layer}_pos"])
    # and what it writes back is the same layout, array for array
    with np.load(back.save(tmp_path / "again.npz")) as again:
        expect = {k: v for k, v in arrays.items() if k != "meta"}
        assert sorted(k for k in again.keys() if k != "meta") == sorted(expect)
        for key, arr in expect.items():
            assert again[key].tobytes() == np.asarray(arr).tobytes(), key


def test_bad_legacy_files_raise_stats_file_errors(tmp_path):
    arrays = legacy_arrays(2)
    arrays["k_m2_ab"] = arrays["k_m2_ab"][:, :1]
    np.savez(tmp_path / "shape.npz", **arrays)
    with pytest.raises(StatsFileError, match=r"shape\.npz: k_m2_ab has shape"):
        CalibrationStats.load(tmp_path / "shape.npz")
    arrays = legacy_arrays(2)
    del arrays["sample_1_pos"]
    np.savez(tmp_path / "missing.npz", **arrays)
    with pytest.raises(StatsFileError, match="sample_1_pos"):
        CalibrationStats.load(tmp_path / "missing.npz")
    arrays = legacy_arrays(2)
    arrays["meta"] = np.array(json.dumps({**json.loads(str(arrays["meta"])), "version": 3}))
    np.savez(tmp_path / "v3.npz", **arrays)
    with pytest.raises(StatsFileError, match="unknown statistics format version"):
        CalibrationStats.load(tmp_path / "v3.npz")
