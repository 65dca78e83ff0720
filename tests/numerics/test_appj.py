"""App. J's long-context family: φ* (averaging length matched to L) against the branch-matched φ̂ control, per
evaluation corpus, with Holm-adjusted p-values over every (L, corpus) contrast."""

from __future__ import annotations

import json
from pathlib import Path

from rope_quant import cli
from rope_quant.sweep import presets
from rope_quant.sweep.manifest import LongContextConfig, config_from_dict, read_manifest


def _fake(cfg) -> dict:
    """φ* better than its control by 0.1·L/1024 + seed noise on shakespeare, no effect on pydoc."""
    run = cfg.run
    out = {}
    for length in cfg.lengths:
        base = 20.0 + length / 1024
        shift = (-0.1 * length / 1024 - 0.01 * run.seed if run.angle == "phi_star" and cfg.eval_corpus ==
                 "shakespeare" else 0.003 * (run.seed - 1) * (run.angle == "phi_star"))
        out[str(length)] = {"ppl": base + shift, "n_windows": 1, "n_tokens": length}
    return {"lengths": out}


def test_appj_manifest_pairs_each_phi_star_with_its_corpus_control() -> None:
    from rope_quant.experiment.config import RunConfig

    m = presets.appj_long_context_manifest(RunConfig(), (0, 1), (1024, 2048), ("shakespeare", "pydoc"))
    assert m.names() == ["phi_hat_branch_matched+shakespeare", "phi_star+shakespeare",
                         "phi_hat_branch_matched+pydoc", "phi_star+pydoc"]
    assert m.meta["phi_star+pydoc"]["control"] == "phi_hat_branch_matched+pydoc"
    star = [c for n, c in m if n == "phi_star+shakespeare"][0]
    assert isinstance(star, LongContextConfig) and star.matched_average and star.eval_corpus == "shakespeare"
    assert star.run.angle == "phi_star" and star.run.corpus == "pydoc"  # calibration stays on the base corpus
    ctrl = [c for n, c in m if n == "phi_hat_branch_matched+shakespeare"][0]
    assert ctrl.run.angle == "phi_hat_branch_matched" and not ctrl.matched_average
    assert ctrl.weight_key() == star.weight_key()  # paired: one model per seed
    again = config_from_dict(json.loads(json.dumps(star.to_dict())))
    assert again == star and again.key() == star.key()
    assert star.key() != LongContextConfig(star.run, star.lengths, matched_average=True).key()


def test_cli_appj_reports_holm_adjusted_contrasts(tmp_path: Path, capsys) -> None:
    out = tmp_path / "appj"
    argv = ["long-context", "--configs", "appj", "--lengths", "1024,2048,4096", "--seeds", "0,1,2", "--out",
            str(out), "--quiet", "--no-figures"]
    assert cli.main(argv, cell_fn=_fake) == 0
    printed = capsys.readouterr().out
    assert "eval_corpora=shakespeare,pydoc" in printed
    assert {c["name"] for c in read_manifest(out)["cells"]} == {
        "phi_hat_branch_matched+shakespeare", "phi_star+shakespeare", "phi_hat_branch_matched+pydoc",
        "phi_star+pydoc"}
    summary = json.loads((out / "summary.json").read_text())
    lc = summary["long_context"]
    assert lc["holm_family_size"] == 6  # 3 lengths x 2 corpora
    shak = lc["paired"]["4096"]["phi_star+shakespeare"]
    assert shak["comparator"] == "phi_hat_branch_matched+shakespeare" and shak["mean"] < 0
    assert shak["p_holm"] >= shak["p"]  # Holm never lowers a p-value
    ps = sorted(b["p"] for per in lc["paired"].values() for b in per.values())
    holm = sorted(b["p_holm"] for per in lc["paired"].values() for b in per.values())
    assert holm[0] == min(1.0, 6 * ps[0])  # the smallest p is multiplied by the family size
    table = (out / "tables" / "crossover.md").read_text()
    assert "p (Holm)" in table and "phi_hat_branch_matched+pydoc" in table
