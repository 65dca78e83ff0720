"""``report DIR --against OTHER`` (rope_quant.analysis.reproduce): numbers side by side, Δ in CI half-widths,
flipped verdicts flagged, another protocol refused with the fields that differ."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest

from rope_quant.analysis.reproduce import ReproduceError, add_against_argument, compare_against, run_against
from rope_quant.sweep.manifest import build_manifest
from rope_quant.sweep.runner import run_cells
from tests._support import FakeConfig

HADAMARD = [10.0, 10.5, 11.0]


def _results(tmp: Path, diffs: dict[str, list[float]], **base) -> Path:
    def cell(cfg: FakeConfig) -> dict:
        ppl = HADAMARD[cfg.seed] + (0.0 if cfg.r3 == "hadamard" else diffs[cfg.r3][cfg.seed])
        return {"ppl": ppl, "n_windows": 4, "n_tokens": 512}

    variants = {"hadamard": {"r3": "hadamard"}, **{n: {"r3": n} for n in diffs}}
    manifest = build_manifest(FakeConfig(**{"seqlen": 512, **base}), variants, (0, 1, 2), study="compare")
    run_cells(manifest, tmp, cell_fn=cell, log=None)
    return tmp


def test_two_directories_side_by_side_with_a_flip(tmp_path: Path) -> None:
    a = _results(tmp_path / "a", {"pairwise_only": [0.2, 0.1, 0.3], "near": [0.05, 0.06, 0.04]})
    b = _results(tmp_path / "b", {"pairwise_only": [0.25, 0.15, 0.3], "near": [0.05, -0.06, 0.04]})
    text = compare_against(a, b)
    lines = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    po = lines["pairwise_only − hadamard"]
    # a: mean 0.2, 90% CI half-width 2.92 * 0.1 / sqrt(3) = 0.1686; b: mean 0.2333 -> Δ +0.033 = +0.20 half-widths
    assert "+0.200 (+0.031, +0.369)" in po and "+0.033" in po and "+0.20" in po and "FLIPPED" not in po
    assert "**FLIPPED** (decided ↔ inconclusive) worse (CI > 0) → undecided" in lines["near − hadamard"]
    assert "1 verdict(s) flipped (0 contradiction(s)" in text


def test_another_protocol_is_refused_with_the_fields(tmp_path: Path) -> None:
    a = _results(tmp_path / "a", {"pairwise_only": [0.2, 0.1, 0.3]})
    b = _results(tmp_path / "b", {"pairwise_only": [0.2, 0.1, 0.3]}, model="other-model", seqlen=2048)
    with pytest.raises(ReproduceError, match=r"another protocol or model.*model: .*fake-model.*other-model") as exc:
        compare_against(a, b)
    assert "seqlen" in str(exc.value)
    err = io.StringIO()
    assert run_against(str(a), str(b), out=io.StringIO(), err=err) == 2
    assert err.getvalue().startswith("error: ") and err.getvalue().count("\n") == 1


def _claims(path: Path, verdict: str, mean: float, low: float, high: float, machine: dict) -> Path:
    decision = {"outcome": verdict.split(":")[0], "mean": mean, "low": low, "high": high, "n": 3}
    payload = {"claims": [{"claim": "C3", "model": "m", "verdict": verdict, "decision": decision}],
               "tables": {}, "machine": machine}
    path.write_text(json.dumps(payload))
    return path


def test_two_claims_jsons(tmp_path: Path) -> None:
    m1 = {"cpu_model": "AMD EPYC", "threads": 1, "blas": "mkl", "torch": "2.13", "transformers": "5.24",
          "float_mode": {"run": "GPTQ float32"}}
    a = _claims(tmp_path / "a.json", "holds", -1.0, -1.5, -0.5, m1)
    b = _claims(tmp_path / "b.json", "inconclusive: 9 seeds", -0.6, -1.2, 0.0, {**m1, "threads": 2})
    out = io.StringIO()
    assert run_against(str(a), str(b), out=out) == 0
    text = out.getvalue()
    assert "AMD EPYC, 1 threads" in text and "AMD EPYC, 2 threads" in text and "GPTQ float32" in text
    assert "+0.400" in text and "+0.80" in text
    assert "**FLIPPED** (decided ↔ inconclusive) holds → inconclusive: 9 seeds" in text and "CONTRADICTION" not in text


def test_opposite_decisions_are_a_contradiction(tmp_path: Path) -> None:
    """holds in one run and refuted (or fails) in the other is flagged apart from a decided ↔ inconclusive flip."""
    a = _claims(tmp_path / "a.json", "holds", -1.0, -1.5, -0.5, {})
    for outcome in ("refuted", "fails"):
        b = _claims(tmp_path / f"{outcome}.json", outcome, 0.6, 0.2, 1.0, {})
        text = compare_against(a, b)
        assert f"**CONTRADICTION** holds → {outcome}" in text and "1 verdict(s) flipped (1 contradiction(s)" in text


def test_bad_inputs(tmp_path: Path) -> None:
    a = _results(tmp_path / "a", {"pairwise_only": [0.2, 0.1, 0.3]})
    with pytest.raises(ReproduceError, match="does not exist"):
        compare_against(a, tmp_path / "missing")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ReproduceError, match="not valid JSON"):
        compare_against(tmp_path / "x.json", tmp_path / "x.json")
    c = _claims(tmp_path / "c.json", "holds", 1.0, 0.5, 1.5, {})
    with pytest.raises(ReproduceError, match="cannot compare a directory"):
        compare_against(a, c)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReproduceError, match="neither a manifest.json"):
        compare_against(tmp_path / "empty", a)


def test_a_changed_budget_is_not_a_flip_and_every_seed_claims_get_their_paired_number(tmp_path: Path) -> None:
    """Two inconclusive verdicts with different budgets are the same outcome (shown, not flagged); an every-seed
    claim without an interval (C1) is compared on the paired difference of its first two per-seed series."""
    a = _claims(tmp_path / "a.json", "inconclusive: 7 seeds", 8.1, 4.4, 11.8, {})
    b = _claims(tmp_path / "b.json", "inconclusive: no budget decides", 6.1, 0.6, 11.6, {})
    text = compare_against(a, b)
    assert "0 verdict(s) flipped" in text and "FLIPPED" not in text
    assert "inconclusive: 7 seeds → inconclusive: no budget decides" in text
    c1 = {"claim": "C1", "model": "m", "verdict": "holds", "decision": {"outcome": "holds", "mean": None},
          "numbers": {"pairwise_only": [28.0, 26.0, 26.5], "hadamard": [24.0, 23.0, 23.5], "stat": 2.7}}
    for path, shift in ((tmp_path / "c.json", 0.0), (tmp_path / "d.json", 0.5)):
        c1["numbers"]["pairwise_only"] = [x + shift for x in [28.0, 26.0, 26.5]]
        path.write_text(json.dumps({"claims": [c1], "machine": {}}))
    text = compare_against(tmp_path / "c.json", tmp_path / "d.json")
    line = next(x for x in text.splitlines() if x.startswith("| C1"))
    # this: diffs 4, 3, 3 -> mean 3.333, sd 0.577, 90% half-width 2.920 * 0.577 / sqrt(3) = 0.973; other: +0.5
    assert "(pairwise_only − hadamard)" in line and "+3.333 (+2.360, +4.307)" in line and "+0.51" in line, line


def test_a_registry_every_seed_part_gets_its_paired_number(tmp_path: Path) -> None:
    """A registry row (C1 from ``-m e2e --rq-model`` or ``rope-quant claims``) nests its per-seed series under its
    part: the part's row reads treatment − control, paired, rather than "–"."""
    part = "ppl(pairwise_only) > ppl(hadamard) every seed"
    for path, shift in ((tmp_path / "e.json", 0.0), (tmp_path / "f.json", 0.5)):
        row = {"claim": "C1 gap", "id": "C1", "model": "m", "verdict": "holds",
               "decision": {"outcome": "holds", "mean": None},
               "numbers": {part: {"treatment": [28.0 + shift, 26.0 + shift, 26.5 + shift],
                                  "control": [24.0, 23.0, 23.5], "tokens": 6132}},
               "parts": {part: {"outcome": "holds", "mean": None, "text": "holds (in every seed)"}}}
        path.write_text(json.dumps({"claims": [row], "machine": {}}))
    text = compare_against(tmp_path / "e.json", tmp_path / "f.json")
    line = next(x for x in text.splitlines() if "every seed (treatment − control)" in x)
    assert "+3.333 (+2.360, +4.307)" in line and "+3.833" in line and "+0.51" in line, line


def test_add_against_argument() -> None:
    parser = add_against_argument(argparse.ArgumentParser())
    assert parser.parse_args(["--against", "OTHER"]).against == "OTHER"
    assert parser.parse_args([]).against is None


def test_compare_report_carries_the_budget_to_decide_the_sign(tmp_path: Path) -> None:
    from rope_quant.analysis import report

    out = _results(tmp_path, {"pairwise_only": [0.2, 0.1, 0.3], "open": [0.3, -0.2, 0.1]})
    md = report.write_report(out, figures=False)["markdown"]
    assert "budget to decide the sign" in md
    open_line = next(line for line in md.splitlines() if line.startswith("| open |") and "seeds" in line)
    pw_line = next(line for line in md.splitlines() if line.startswith("| pairwise_only |") and "≡" not in line
                   and "yes" not in line and "no" in line)
    assert "seeds" not in pw_line  # decided: CI (+0.031, +0.369) clear of 0
    seeds = int(open_line.split("seeds")[0].split("|")[-1].strip())
    assert seeds > 3
    # and as tokens per cell at today's 3 seeds (each cell scored 512 tokens)
    tokens = int(open_line.split(" tokens/cell")[0].split(" or ")[-1].strip())
    assert tokens > 512
    assert report.summarize(out, write=False)["paired"]["open"]["tokens"] == 512


def test_the_free_fields_of_a_real_run_config() -> None:
    from rope_quant.analysis.reproduce import _flatten, _free
    from rope_quant.experiment.pipeline import RunConfig

    fields = _flatten(RunConfig.from_flat(model="smollm2-135m", seed=3, device="cpu").to_dict())
    free = sorted(k for k in fields if _free(k))
    assert free == ["quant.w.gptq.float64", "runtime.device", "seed"]
    assert "model" in fields and not _free("model") and not _free("budget.seqlen")


def test_claims_jsons_of_the_replicated_rule_and_of_the_legacy_one(tmp_path: Path) -> None:
    """A schema-2 claims JSON (written by the plugin: each decision's ``rule`` and ``float_order``) reads beside
    another and beside a legacy one; the header names the rule, and says when the two differ."""
    from rope_quant.core.verdict import RULE_REPLICATES, Form, paired_claim

    def write(path: Path, shift: float) -> Path:
        v = paired_claim(Form.LESS, [9.0, 9.2, 8.9], [10.0, 10.1, 10.2], replicates={0: (9.0 + shift, 10.0),
                                                                                     1: (9.2, 10.1 - shift)})
        claim = {"claim": "C3", "model": "m", "verdict": v.text(), "decision": v.to_dict()}
        path.write_text(json.dumps({"schema": 2, "claims": [claim], "machine": {}}))
        return path

    a, b = write(tmp_path / "a.json", 0.05), write(tmp_path / "b.json", 0.4)
    text = compare_against(a, b)
    assert f"- rule: {RULE_REPLICATES}" in text and "k=2: σ" in text and "bias" in text, text
    legacy = _claims(tmp_path / "old.json", "holds", -1.0, -1.5, -0.5, {})
    text = compare_against(a, legacy)
    assert "**different decision rules**" in text and "0.1.x" in text, text


def test_a_claim_of_parts_is_compared_part_by_part(tmp_path: Path) -> None:
    """A claim whose parts the test named (C7's lengths) gets one row per part: the combined decision of one run
    may come from L = 1024 and the other's from L = 4096, so only the parts compare like with like."""

    def part(outcome: str, mean: float, low: float, high: float) -> dict:
        return {"outcome": outcome, "mean": mean, "low": low, "high": high, "n": 3, "text": outcome}

    def claims(path: Path, short: dict, long: dict, first: dict) -> Path:
        c7 = {"claim": "C7", "model": "m", "verdict": first["text"], "decision": first,
              "parts": {"L=1024": short, "L=4096": long}, "numbers": {}}
        path.write_text(json.dumps({"claims": [c7], "machine": {}}))
        return path

    a_short, a_long = part("inconclusive", 3.5, -1.2, 8.1), part("holds", 5.6, 1.3, 9.9)
    b_short, b_long = part("holds", 5.1, 4.4, 5.7), part("inconclusive", 8.1, -1.3, 12.3)
    text = compare_against(claims(tmp_path / "a.json", a_short, a_long, a_short),
                           claims(tmp_path / "b.json", b_short, b_long, b_long))
    rows = {x.split("|")[1].strip(): x for x in text.splitlines() if x.startswith("| C7")}
    assert set(rows) == {"C7 [m]", "C7 [m] · L=1024", "C7 [m] · L=4096"}, rows
    assert "+3.500 (−1.200, +8.100)".replace("−", "-") in rows["C7 [m] · L=1024"]
    assert "+1.600" in rows["C7 [m] · L=1024"] and "+2.500" in rows["C7 [m] · L=4096"]
    assert "FLIPPED" in rows["C7 [m] · L=1024"] and "FLIPPED" in rows["C7 [m] · L=4096"]
    assert "2 verdict(s) flipped" in text  # the parts flip; the combined claim (inconclusive both) does not
    older = tmp_path / "older.json"  # a run from before parts were recorded: its parts rows read (absent)
    older.write_text(json.dumps({"claims": [{"claim": "C7", "model": "m", "verdict": "inconclusive",
                                             "decision": a_short, "numbers": {}}], "machine": {}}))
    rows = {x.split("|")[1].strip(): x for x in compare_against(tmp_path / "a.json", older).splitlines()
            if x.startswith("| C7")}
    assert "(absent)" in rows["C7 [m] · L=4096"] and "| holds |" in rows["C7 [m] · L=4096"]


def _model_table(path: Path, name: str, fingerprint: str, seqlen: int, rows: list[dict]) -> Path:
    """A claims JSON of one model, as both fronts write it (``model``, ``protocol``, ``device``, ``runs``)."""
    run = {"model": {"name": name, "fingerprint": fingerprint, "fingerprint_basis": "SHA-256"},
           "protocol": {"name": "paper", "seeds": [0, 1, 2], "seqlen": seqlen, "calib_windows": 128,
                        "eval_windows": None, "bits": "W4A4K4V4", "weights": "gptq"},
           "device": {"requested": "cuda", "cuda_name": "NVIDIA H100"}}
    path.write_text(json.dumps({"schema": 2, "claims": rows, "tables": {}, "machine": {}, **run, "runs": [run]}))
    return path


def _row(cid: str, title: str, model: str, outcome: str, mean: float | None = None, low: float | None = None,
         high: float | None = None, **extra) -> dict:
    decision = {"outcome": outcome, "mean": mean, "low": low, "high": high, "n": 3, "text": outcome}
    return {"claim": title, "id": cid, "model": model, "verdict": outcome, "decision": decision, **extra}


def test_two_models_claims_tables_compared_claim_by_claim(tmp_path: Path, capsys) -> None:
    """``report A --against B`` on two models' claims JSONs: one row per claim (and part), matched by claim id
    across the models' names and deviations; flips and contradictions flagged; the header names each model with
    its fingerprint, protocol and device, and the protocol fields that differ."""
    from rope_quant import cli

    c1, c3, c7 = "C1 (Table 1) pairwise_only vs hadamard", "C3 (App. L) k_only vs rows", "C7 (long context)"
    dev = " [deviation: R1 refused by the architecture (sandwich norms): every cell runs with r1=identity]"
    parts = {"L=1024": {"outcome": "holds", "mean": 2.0, "low": 1.0, "high": 3.0, "n": 3, "text": "holds"}}
    a = _model_table(tmp_path / "llama.json", "/ckpt/llama", "aaaa1111", 2048, [
        _row("C1", c1, "/ckpt/llama", "holds", numbers={"pairwise_only": [9.0, 9.1, 9.2], "hadamard": [8, 8, 8]}),
        _row("C3", c3, "/ckpt/llama", "holds", -0.4, -0.6, -0.2),
        _row("C7", c7, "/ckpt/llama", "holds", 2.0, 1.0, 3.0, parts=parts),
        _row("C4-ppl", "C4 (Table M)", "/ckpt/llama", "holds")])
    b = _model_table(tmp_path / "gemma.json", "/ckpt/gemma", "bbbb2222", 1024, [
        _row("C1", c1 + dev, "/ckpt/gemma", "fails", numbers={"pairwise_only": [7, 7, 7], "hadamard": [8, 8, 8]}),
        _row("C3", c3 + dev, "/ckpt/gemma", "inconclusive", -0.1, -0.5, 0.3),
        _row("C7", c7 + dev, "/ckpt/gemma", "holds", 1.0, 0.5, 1.5,
             parts={"L=1024": {**parts["L=1024"], "outcome": "inconclusive", "text": "inconclusive"}})])
    assert cli.main(["report", str(a), "--against", str(b)]) == 0
    text = capsys.readouterr().out
    rows = {x.split("|")[1].strip(): x for x in text.splitlines() if x.startswith("| C")}
    assert set(rows) == {f"{c1} (pairwise_only − hadamard)", c3, c7, f"{c7} · L=1024", "C4 (Table M)"}, set(rows)
    assert "**CONTRADICTION** holds → fails" in rows[f"{c1} (pairwise_only − hadamard)"]
    assert "**FLIPPED** (decided ↔ inconclusive) holds → inconclusive" in rows[c3] and "+0.300" in rows[c3]
    assert "FLIPPED" not in rows[c7] and "**FLIPPED**" in rows[f"{c7} · L=1024"]
    assert "(absent)" in rows["C4 (Table M)"] and "none → R1 refused by the architecture" in rows[c3]
    assert "3 verdict(s) flipped (1 contradiction(s)" in text
    assert ("**two models**, rows matched by claim id: this /ckpt/llama (fingerprint aaaa1111); protocol paper: "
            "W4A4K4V4, gptq, 128 x 2048 calibration, every eval windows, seeds [0, 1, 2]; device NVIDIA H100; "
            "other /ckpt/gemma (fingerprint bbbb2222);") in text
    assert "protocol fields that differ: seqlen: 2048 vs 1024" in text
    same = compare_against(a, _model_table(tmp_path / "again.json", "/ckpt/llama", "aaaa1111", 2048, []))
    assert "two models" not in same and f"{c3} [/ckpt/llama]" in same  # one model: the reproducibility report


def test_a_deviation_every_row_shares_is_printed_once_above_the_table(tmp_path: Path) -> None:
    """Two runs of one model under the same deviation (Gemma 3: R1 refused): the deviation is one header line, and
    no row's title or column repeats it."""
    dev = "R1 refused by the architecture (sandwich norms): every cell runs with r1=identity"
    c3 = "C3 (App. L) k_only vs rows"
    rows = [_row("C3", f"{c3} [deviation: {dev}]", "gemma", "refuted", 2.0, 1.0, 3.0)]
    a = _model_table(tmp_path / "a.json", "gemma", "cccc3333", 512, rows)
    b = _model_table(tmp_path / "b.json", "gemma", "cccc3333", 512, rows)
    text = compare_against(a, b)
    assert f"- deviation, every claim of both runs: {dev}\n" in text and text.count(dev) == 1, text
    assert f"| {c3} [gemma] |" in text and "deviation (this" not in text


def test_claims_with_identical_per_seed_values_are_counted_and_the_others_named(tmp_path: Path) -> None:
    """Two runs of the same cells (the CLI's table against pytest's): the report counts the claims whose per-seed
    series agree value for value, matched by registry id, and names those that differ in any value."""
    def payload(path: Path, c1_last: float, model: str) -> Path:
        rows = [{"claim": "C1 title", "id": "C1", "model": model, "verdict": "holds",
                 "decision": {"outcome": "holds", "mean": None},
                 "numbers": {"pairwise_only": [28.0, 26.0, c1_last], "hadamard": [24.0, 23.0, 23.5], "stat": 2.7}},
                {"claim": "C8 title", "id": "C8", "model": model, "verdict": "holds",
                 "decision": {"outcome": "holds", "mean": None},
                 "numbers": {"hadamard": [9.6, 9.7, 9.65], "pairwise_only": [14.7, 14.8, 14.75]}}]
        path.write_text(json.dumps({"claims": rows, "machine": {}}))
        return path

    same = compare_against(payload(tmp_path / "a.json", 26.5, "m"), payload(tmp_path / "b.json", 26.5, "m"))
    assert "- per-seed values: 2 of the 2 claims in both runs identical, value for value\n" in same
    differs = compare_against(tmp_path / "a.json", payload(tmp_path / "c.json", 26.5 + 1e-9, "m"))
    assert "- per-seed values: 1 of the 2 claims in both runs identical, value for value; differing: C1" in differs


def test_a_registry_rows_per_seed_values_nested_under_its_parts_are_compared(tmp_path: Path) -> None:
    """A registry row keeps each part's treatment, control and replicate values under the part's name: a change in
    a replicate pair is a differing claim too."""
    def payload(path: Path, rep: float) -> Path:
        row = {"claim": "C3 title", "id": "C3", "model": "m", "verdict": "holds", "decision": {"outcome": "holds"},
               "numbers": {"k_only < rows": {"treatment": [13.9, 14.0, 14.1], "control": [15.0, 15.2, 15.1],
                                             "margin": 0.0, "replicates": {"0": [13.8, rep]}}}}
        path.write_text(json.dumps({"claims": [row], "machine": {}}))
        return path

    assert "1 of the 1 claims in both runs identical" in compare_against(payload(tmp_path / "a.json", 15.0),
                                                                        payload(tmp_path / "b.json", 15.0))
    assert "0 of the 1 claims in both runs identical, value for value; differing: C3" in compare_against(
        tmp_path / "a.json", payload(tmp_path / "c.json", 15.01))


def test_a_sweeps_env_names_its_cpu_model_in_the_report(tmp_path: Path) -> None:
    """``env.json`` (a sweep's machine) records the CPU model, and the report's machine line names it, as it names
    the pytest plugin's."""
    from rope_quant.analysis.reproduce import _machine_line
    from rope_quant.experiment.envinfo import cpu_model, env_info

    env = env_info("cpu")
    assert env["cpu_model"] == cpu_model() and env["cpu_model"]
    assert _machine_line(env).startswith(f"{cpu_model()}, {env['cpu_count']} CPUs, ")
    assert _machine_line({**env, "cpu_model": None}).startswith(env["platform"])
