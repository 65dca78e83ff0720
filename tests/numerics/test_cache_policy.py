"""The default cache keeps only what resuming needs (rope_quant.sweep.cache_policy)."""

from __future__ import annotations

from dataclasses import dataclass

from rope_quant.sweep.cache_policy import CachePruner, policy_lines, usage


@dataclass(frozen=True)
class _Cfg:
    seed: int
    r3: str

    def weight_key(self) -> str:
        return f"w{self.seed}"

    def stats_key(self) -> str:
        return f"s{self.seed}"


def _cache(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    for seed in (0, 1):
        (cache / f"weights-w{seed}-fp.pt").write_bytes(b"x" * 1000)
        (cache / f"stats-s{seed}-fp-data.npz").write_bytes(b"x" * 100)
        (cache / f"r1-whip-r{seed}-fp-data.pt").write_bytes(b"x" * 10)
    return cache


def test_a_seed_is_pruned_only_when_all_its_cells_are_complete(tmp_path):
    cache = _cache(tmp_path)
    cells = [(r3, _Cfg(seed, r3)) for seed in (0, 1) for r3 in ("identity", "hadamard")]
    done: set[int] = set()
    pruner = CachePruner(cache, cells, lambda i: i in done)
    done.add(0)
    assert pruner.after_cell(0) == []  # seed 0's hadamard cell still needs its weights
    assert (cache / "weights-w0-fp.pt").exists()
    done.add(1)
    removed = pruner.after_cell(1)
    assert sorted(p.name for p in removed) == ["stats-s0-fp-data.npz", "weights-w0-fp.pt"]
    assert (cache / "weights-w1-fp.pt").exists() and (cache / "r1-whip-r0-fp-data.pt").exists()
    assert pruner.freed == 1100
    done.add(2)  # seed 1 half done (e.g. interrupted): resume still finds its weights
    assert pruner.after_cell(2) == [] and (cache / "stats-s1-fp-data.npz").exists()
    assert usage(cache) == {"quantised weights": (1, 1000), "calibration statistics": (1, 100),
                            "whip R1 fits": (2, 20)}


def test_policy_lines_say_what_is_kept_where_how_big_and_how_to_clear(tmp_path):
    cache = _cache(tmp_path)
    pruner = CachePruner(cache, [("a", _Cfg(0, "a"))], lambda i: True)
    pruner.after_cell(0)
    text = "\n".join(policy_lines(cache, pruner))
    assert f"{cache} holds 0.0 MB" in text and "whip R1 fits 2 file(s)" in text
    assert "2 file(s), 0.0 MB freed" in text and "--keep-cache" in text and f"rm -r {cache}" in text
    assert "everything is kept" in "\n".join(policy_lines(cache, None))


def test_a_file_removed_by_another_shard_is_not_an_error(tmp_path):
    cache = _cache(tmp_path)
    pruner = CachePruner(cache, [("a", _Cfg(0, "a"))], lambda i: True)
    (cache / "weights-w0-fp.pt").unlink()
    assert [p.name for p in pruner.after_cell(0)] == ["stats-s0-fp-data.npz"]


def test_compare_prunes_each_finished_seed_from_the_default_cache_only(tmp_path):
    """Through the CLI: seeds' weights/statistics go once their cells are done; --keep-cache and --cache-dir keep."""
    from rope_quant import cli
    from rope_quant.sweep.manifest import load_manifest

    def fake(cfg):
        return {"ppl": 12.0 + cfg.seed, "n_windows": 1, "n_tokens": 10, "k_range_mean": 1.0, "k_range_max": 2.0,
                "delta_mean": 0.1, "k_rel_err": 0.01}

    argv = ["compare", "--no-figures", "--seeds", "0,1", "--configs", "hadamard,identity", "--quiet"]
    for extra, pruned in (([], True), (["--keep-cache"], False), (["--cache-dir", "CACHE"], False)):
        out = tmp_path / f"o{len(extra)}"
        assert cli.main([*argv, "--out", str(out), "--force-new-manifest"], cell_fn=fake) == 0
        cache = tmp_path / "shared" if extra[:1] == ["--cache-dir"] else out / "cache"
        cache.mkdir(parents=True, exist_ok=True)
        files = []
        for _, cfg in load_manifest(out).cells:
            files += [cache / f"weights-{cfg.weight_key()}-fp.pt", cache / f"stats-{cfg.stats_key()}-fp-d.npz"]
        for f in files:
            f.write_bytes(b"x")
        (cache / "r1-whip-k-fp-d.pt").write_bytes(b"x")
        extra = [str(cache) if e == "CACHE" else e for e in extra]
        assert cli.main([*argv, "--out", str(out), "--no-resume", *extra], cell_fn=fake) == 0
        assert all(f.exists() != pruned for f in files), extra
        assert (cache / "r1-whip-k-fp-d.pt").exists()


@dataclass(frozen=True)
class _LongContext:
    """Like LongContextConfig: its own weight_key(), the statistics key only through ``run``."""

    run: _Cfg

    def weight_key(self) -> str:
        return self.run.weight_key()


def test_long_context_cells_prune_through_their_run_config(tmp_path):
    cache = _cache(tmp_path)
    pruner = CachePruner(cache, [("lc", _LongContext(_Cfg(1, "hadamard")))], lambda i: True)
    assert sorted(p.name for p in pruner.after_cell(0)) == ["stats-s1-fp-data.npz", "weights-w1-fp.pt"]
