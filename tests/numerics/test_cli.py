"""The ``rope-quant`` CLI: parsing, error exits, sweeps through an injected cell function, and one real
smoke run of ``run`` / ``compare`` / ``verify`` on the embedded model with tiny budgets (in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rope_quant import cli
from rope_quant.analysis import report
from rope_quant.cli import CLIError, parse_int_list, parse_names
from rope_quant.sweep.loaded_models import ModelCache
from rope_quant.sweep.manifest import LongContextConfig, read_manifest
from rope_quant.sweep.records import status

TINY = ["--seqlen", "128", "--calib-windows", "2", "--eval-windows", "2", "--weights", "rtn", "--no-w-mse"]


class FakeCell:
    """Counts calls; ppl depends on (r3, block, estimator, seed) so paired statistics are non-trivial."""

    OFFSET = {"hadamard": 0.0, "pairwise_only": 0.4, "pairwise_plus_hadamard": 0.1, "identity": 1.5}

    def __init__(self) -> None:
        self.calls: list = []

    def __call__(self, cfg) -> dict:
        self.calls.append(cfg)
        if isinstance(cfg, LongContextConfig):
            lengths = {str(L): {"ppl": 10.0 + L / 256 + self.OFFSET.get(cfg.run.r3, 0.2) * (512 / L)
                                + 0.05 * cfg.seed, "n_windows": 2} for L in cfg.lengths}
            return {"lengths": lengths, "k_range_mean": 1.0, "k_rel_err": 0.01}
        ppl = 12.0 + self.OFFSET.get(cfg.r3, 0.2) + 0.1 * cfg.seed + 0.02 * (cfg.seed % 2)
        if cfg.r3_block:
            ppl += 1.0 / cfg.r3_block
        if cfg.position_average:
            ppl -= 0.05
        return {"ppl": ppl, "n_windows": cfg.eval_windows, "n_tokens": 100, "k_range_mean": 2.0,
                "k_range_max": 5.0, "delta_mean": 0.1, "k_rel_err": 0.01}


@pytest.fixture
def fake() -> FakeCell:
    """A fresh fake cell function, injected with ``cli.main(argv, cell_fn=fake)``."""
    return FakeCell()


# ----------------------------------------------------------------------------- parsing


def test_parse_int_list() -> None:
    assert parse_int_list("0,1,2", "--seeds") == (0, 1, 2)
    assert parse_int_list(" 3 , 5 ", "--seeds") == (3, 5)
    for bad in ("", "a", "0,,1", "1,1", "0.5", "1;2"):
        with pytest.raises(CLIError):
            parse_int_list(bad, "--seeds")
    with pytest.raises(CLIError, match=">= 2"):
        parse_int_list("1,4", "--blocks", minimum=2)


def test_parse_names_lists_valid_names() -> None:
    assert parse_names("a,b", "config", ["a", "b", "c"]) == ("a", "b")
    with pytest.raises(CLIError, match="valid: a, b, c"):
        parse_names("a,zzz", "config", ["a", "b", "c"])
    with pytest.raises(CLIError):
        parse_names(",", "config", ["a"])


def test_help_and_usage_errors(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert cli.main(["--help"]) == 0
    assert "compare" in capsys.readouterr().out
    assert cli.main([]) == 2
    assert cli.main(["compare"]) == 2  # --out is required
    assert "--out" in capsys.readouterr().err
    assert cli.main(["nonsense", "--out", str(tmp_path)]) == 2
    assert cli.main(["compare", "--out", str(tmp_path), "--weights", "awq"]) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--configs", "hadamard,rotate_everything"], "valid: "),
        (["--configs", "hadamard,block_hadamard"], "need a block size"),
        (["--seeds", "0,x"], "--seeds"),
        (["--seeds", "1,1"], "repeated"),
        (["--corpus", "no-such-corpus"], "unknown corpus"),
        (["--model", "no-such-model"], "no-such-model"),
        (["--k-bits", "1"], "--k-bits"),
        (["--seqlen", "0"], "--seqlen"),
        (["--shard", "4/4"], "--shard"),
        (["--device", "tpu"], "--device"),
    ],
)
def test_bad_input_exits_2(argv, message, tmp_path: Path, capsys, fake: FakeCell) -> None:
    code = cli.main(["compare", "--out", str(tmp_path / "o"), *argv], cell_fn=fake)
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err
    assert fake.calls == []  # nothing ran


def test_unknown_config_lists_registry_names(tmp_path: Path, capsys, fake: FakeCell) -> None:
    from rope_quant.core import transforms

    assert cli.main(["run", "--config", "bogus", "--out", str(tmp_path)], cell_fn=fake) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in transforms.names())


def test_run_block_validation(tmp_path: Path, capsys, fake: FakeCell) -> None:
    assert cli.main(["run", "--config", "block_hadamard", "--out", str(tmp_path)], cell_fn=fake) == 2
    assert "needs --block" in capsys.readouterr().err
    assert cli.main(["run", "--config", "hadamard", "--block", "4", "--out", str(tmp_path)], cell_fn=fake) == 2
    assert cli.main(["run", "--config", "block_hadamard", "--block", "8", "--out", str(tmp_path)], cell_fn=fake) == 0
    assert [(c.r3, c.r3_block) for c in fake.calls] == [("block_hadamard", 8)]
    assert read_manifest(tmp_path)["cells"][0]["name"] == "block_hadamard-b8"


def test_budget_defaults_per_device() -> None:
    args = cli.build_parser().parse_args(["compare", "--out", "x"])
    budget, used = cli.resolve_budget(args)
    assert budget == cli.BUDGETS["cpu"]
    assert len(used) == 5
    args = cli.build_parser().parse_args(["compare", "--out", "x", "--seqlen", "64", "--eval-windows", "0",
                                          "--weights", "gptq", "--w-mse"])
    budget, used = cli.resolve_budget(args)
    assert budget["seqlen"] == 64 and budget["eval_windows"] is None and budget["weights"] == "gptq"
    assert budget["w_mse"] is True and used == ["calib_windows=4"]
    args.device = "cuda"
    args.weights = args.w_mse = None
    budget = cli.resolve_budget(args)[0]
    assert budget["calib_windows"] == 128 and budget["weights"] == "gptq" and budget["w_mse"] is True


# ----------------------------------------------------------------------------- sweeps with a fake cell


def test_compare_writes_summary_table_and_resumes(tmp_path: Path, capsys, fake: FakeCell) -> None:
    out = tmp_path / "cmp"
    assert cli.main(["compare", "--out", str(out), "--no-figures"], cell_fn=fake) == 0
    printed = capsys.readouterr().out
    assert ("defaults used: seeds=0,1,2, seqlen=512, calib_windows=4, eval_windows=4, weights=rtn, "
            "w_mse=True") in printed
    assert ("settings: model=smollm2-135m corpus=pydoc W4A4K4V4 weights=rtn "
            "R1=whip (epochs 10, batch 64, subset 0.1, lr 0.001, cosine) R2=random_hadamard R4=hadamard "
            "estimator=rows angle=phi_hat seqlen=512") in printed
    assert "deviations from the paper's rotations" not in printed
    assert len(fake.calls) == 12
    assert {(c.r3, c.seed) for c in fake.calls} == {(n, s) for n in cli.DEFAULT_CONFIGS for s in (0, 1, 2)}
    assert all(c.seqlen == 512 and c.weights == "rtn" and c.k_bits == 4 for c in fake.calls)
    assert all(c.gptq.mse for c in fake.calls)  # CPU default: RTN with the MSE clip search
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["configs"]) == set(cli.DEFAULT_CONFIGS)
    assert set(summary["configs"]["identity"]) >= {"ppl", "k_range_mean", "k_rel_err"}
    assert summary["configs"]["identity"]["ppl"] == pytest.approx([13.5, 13.62, 13.7])
    pw = summary["paired"]["pairwise_only"]
    assert pw["comparator"] == "hadamard" and pw["n"] == 3
    assert pw["mean"] == pytest.approx(0.4) and pw["sd"] == pytest.approx(0.0, abs=1e-12)
    assert {"low", "high"} <= set(pw)
    md = (out / "summary.md").read_text()
    assert md.strip() in printed  # the table is printed to the terminal
    assert "| pairwise_only |" in md
    # resume: the same command recomputes nothing
    again = FakeCell()
    assert cli.main(["compare", "--out", str(out), "--no-figures", "--quiet"], cell_fn=again) == 0
    assert again.calls == []
    assert "12 already complete" in capsys.readouterr().out


def test_compare_failure_exit_1_and_report_check(tmp_path: Path, capsys) -> None:
    def flaky(cfg):
        if cfg.r3 == "identity" and cfg.seed == 1:
            raise RuntimeError("simulated OOM")
        return FakeCell()(cfg)

    out = tmp_path / "cmp"
    assert cli.main(["compare", "--out", str(out), "--seeds", "0,1", "--configs", "hadamard,identity",
                     "--no-figures", "--quiet"], cell_fn=flaky) == 1
    assert "Failed cells: identity/seed1" in capsys.readouterr().out
    assert cli.main(["report", str(out), "--check"]) == 1
    assert "1 failed" in capsys.readouterr().out
    assert cli.main(["compare", "--out", str(out), "--seeds", "0,1", "--configs", "hadamard,identity",
                     "--no-figures", "--quiet"], cell_fn=FakeCell()) == 0
    assert cli.main(["report", str(out), "--check"]) == 0
    assert cli.main(["report", str(out), "--no-figures", "--family", "identity"]) == 0
    assert "Holm family (alpha 0.05): identity" in capsys.readouterr().out
    assert cli.main(["report", str(tmp_path / "missing")]) == 2


def test_shards_through_the_cli(tmp_path: Path, fake: FakeCell, monkeypatch) -> None:
    out = tmp_path / "sh"
    base = ["compare", "--out", str(out), "--no-figures", "--quiet", "--seeds", "0,1,2"]
    for i in range(3):
        assert cli.main([*base, "--shard", f"{i}/3"], cell_fn=fake) == 0
    assert len(fake.calls) == 12 and len({(c.r3, c.seed) for c in fake.calls}) == 12
    assert status(out).done
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert cli.main([*base, "--out", str(tmp_path / "auto"), "--shard", "auto"], cell_fn=fake) == 0
    assert len(fake.calls) == 18  # shard 0 of 2: six of the twelve cells


def test_support_estimators_long_context(tmp_path: Path, capsys, fake: FakeCell) -> None:
    out = tmp_path / "sup"
    assert cli.main(["support", "--out", str(out), "--seeds", "0,1", "--no-figures", "--quiet"], cell_fn=fake) == 0
    printed = capsys.readouterr().out
    assert "blocks=2,4,8,16,32,64" in printed  # head_dim 64 of the embedded model
    blocks = sorted({c.r3_block for c in fake.calls if c.r3 == "block_hadamard"})
    assert blocks == [2, 4, 8, 16, 32, 64]
    assert "Mixing support" in printed

    fake.calls.clear()
    out = tmp_path / "est"
    assert cli.main(["estimators", "--out", str(out), "--seeds", "0,1", "--phi-star", "--estimator", "k_only",
                     "--no-figures", "--quiet"], cell_fn=fake) == 0
    star = [c for c in fake.calls if c.position_average]
    assert len(star) == 2 and all(c.estimator == "k_only" and c.r3 == "pairwise_only" for c in star)
    matched = [c for c in fake.calls if c.angle == "phi_hat_branch_matched"]  # App. J's control comes along
    assert len(matched) == 2 and all(c.estimator == "k_only" and c.r3 == "pairwise_only" for c in matched)
    estimators = {c.estimator for c in fake.calls if c.r3 == "pairwise_only"}
    assert sorted(estimators) == ["balanced", "k_only", "rows"]
    assert "phi_star(k_only)" in (out / "tables" / "estimators.md").read_text()

    out = tmp_path / "lc"
    assert cli.main(["long-context", "--out", str(out), "--seeds", "0,1", "--lengths", "256,512,1024",
                     "--eval-corpora", "pydoc", "--quiet"], cell_fn=fake) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["long_context"]["lengths"] == [256, 512, 1024]
    gap = summary["long_context"]["paired"]["256"]["pairwise_only"]["mean"]
    assert gap == pytest.approx((0.4 - 0.0) * 2)
    assert (out / "figures" / "crossover.png").is_file()


def test_run_single_cell_merges_into_manifest(tmp_path: Path, capsys, fake: FakeCell) -> None:
    out = tmp_path / "run"
    assert cli.main(["run", "--config", "pairwise_only", "--seed", "3", "--out", str(out)], cell_fn=fake) == 0
    printed = capsys.readouterr().out
    payload = json.loads(printed[printed.index("{"):])
    assert payload["ppl"] == pytest.approx(12.0 + 0.4 + 0.3 + 0.02) and payload["k_rel_err"] == 0.01
    assert cli.main(["run", "--config", "hadamard", "--seed", "3", "--out", str(out)], cell_fn=fake) == 0
    data = read_manifest(out)
    assert [(c["name"], c["seed"]) for c in data["cells"]] == [("pairwise_only", 3), ("hadamard", 3)]
    assert len(fake.calls) == 2
    assert cli.main(["run", "--config", "hadamard", "--seed", "3", "--out", str(out)], cell_fn=fake) == 0
    assert len(fake.calls) == 2 and "already complete" in capsys.readouterr().out
    summary = report.summarize(out)
    assert summary["paired"]["pairwise_only"]["mean"] == pytest.approx(0.4)


# ----------------------------------------------------------------------------- real pipeline smoke


def test_real_run_compare_and_verify(tmp_path: Path, capsys, embedded_model) -> None:
    """The embedded model through the real pipeline, tiny budgets, one seed (reuses the session model)."""
    models = ModelCache()  # the real pipeline over the session's model: no second load
    models.put("smollm2-135m", "cpu", embedded_model)
    out = tmp_path / "real"
    code = cli.main(["compare", "--out", str(out), "--seeds", "0", "--configs", "hadamard,pairwise_only",
                     "--no-figures", *TINY], models=models)
    printed = capsys.readouterr().out
    assert code == 0, printed
    summary = json.loads((out / "summary.json").read_text())
    for name in ("hadamard", "pairwise_only"):
        cfg = summary["configs"][name]
        assert len(cfg["ppl"]) == 1 and 1.0 < cfg["ppl"][0] < 1e4
        assert cfg["k_range_mean"][0] > 0 and 0 < cfg["k_rel_err"][0] < 1
    assert summary["paired"]["pairwise_only"]["n"] == 1
    assert "| hadamard |" in printed or "| **hadamard** |" in printed
    record = json.loads(next((out / "cells" / "pairwise_only").glob("seed0-*.json")).read_text())
    assert record["result"]["n_windows"] == 2 and record["config"]["quant"]["w"]["mode"] == "rtn"
    assert record["config"]["quant"]["w"]["gptq"]["mse"] is False
    assert record["env"]["packages"]["torch"] != "not installed"
    assert record["result"]["model_reused"] is True  # the R3 variant reconfigured the seed's model

    tiny_lc = [a if a != "2" else "1" for a in TINY]  # one window per length
    code = cli.main(["long-context", "--out", str(out / "lc"), "--seeds", "0", "--configs", "hadamard",
                     "--lengths", "64,128", "--eval-corpora", "shakespeare", "--no-figures", "--cache-dir",
                     str(out / "cache"), *tiny_lc], models=models)
    assert code == 0, capsys.readouterr()
    lc = json.loads((out / "lc" / "summary.json").read_text())["long_context"]
    assert lc["lengths"] == [64, 128]
    assert all(1.0 < v[0] < 1e4 for v in lc["configs"]["hadamard"].values())
    proto = json.loads(next((out / "lc" / "cells" / "hadamard").glob("seed0-*.json")).read_text())["result"][
        "protocol"]  # App. A.4: both corpora, the first 64 documents (all 8 plays), min(cap, N // L) windows
    assert (proto["calib_corpus"], proto["eval_corpus"], proto["n_documents"]) == ("pydoc", "shakespeare", 8)
    assert proto["windows"] == {"64": 1, "128": 1} and proto["scored_tokens"] == {"64": 63, "128": 127}
    assert proto["n_stream_tokens"] > 200_000

    code = cli.main(["run", "--config", "pairwise_only", "--phi-star", "--name", "pairwise_phi_star",
                     "--out", str(out), *TINY], models=models)
    assert code == 0, capsys.readouterr()
    assert cli.main(["verify", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| pairwise_phi_star | 0 | yes |" in printed
    assert (out / "verify" / "pairwise_phi_star" / "seed0" / "phi_star_pairs.csv").is_file()
    assert cli.main(["report", str(out)]) == 0
    assert (out / "figures" / "phi_star_excess.png").is_file()


def test_rotation_and_angle_options_reach_the_cells_and_name_deviations(tmp_path: Path, capsys,
                                                                       fake: FakeCell) -> None:
    """--r1/--r2/--angle: the paper's rotations are the default; anything else is printed as
    a deviation, R2 trained by whip as a deviation from A.8."""
    out = tmp_path / "dev"
    argv = ["compare", "--out", str(out), "--seeds", "0", "--configs", "hadamard,pairwise_only", "--r1",
            "random_hadamard", "--r2", "whip", "--angle", "phi_hat_branch_matched", "--no-figures", "--quiet"]
    assert cli.main(argv, cell_fn=fake) == 0
    printed = capsys.readouterr().out
    assert {(c.r1, c.r2, c.angle) for c in fake.calls} == {
        ("random_hadamard", "whip", "phi_hat_branch_matched")}
    assert "R1 random_hadamard instead of whip (A.1)" in printed
    assert "R2 trained with whip" in printed and "A.8" in printed
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["compare", "--out", "x", "--r1", "cayley"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["compare", "--out", "x", "--angle", "phi_dagger"])


def test_env_json_records_the_rotation_protocol(tmp_path: Path, fake: FakeCell) -> None:
    """env.json names R1/R2/R4, every whip hyper-parameter of R1 and the deviations."""
    out = tmp_path / "env"
    argv = ["compare", "--out", str(out), "--seeds", "0", "--configs", "hadamard", "--whip-epochs", "3",
            "--r2", "whip", "--no-figures", "--quiet"]
    assert cli.main(argv, cell_fn=fake) == 0
    protocol = json.loads((out / "env.json").read_text())["protocol"]
    assert (protocol["r1"], protocol["r2"], protocol["r4"]) == ("whip", "whip", "hadamard")
    assert protocol["whip"] == {"lr": 0.001, "momentum": 0.9, "epochs": 3, "batch_size": 64, "subset": 0.1,
                                "cosine": True, "tokens_per_sample": 64}
    assert any("A.8" in d for d in protocol["deviations"])
    record = json.loads(next(out.glob("cells/**/*.json")).read_text())
    assert record["config"]["rotation"]["whip"]["epochs"] == 3
