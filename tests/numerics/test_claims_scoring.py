"""``rope-quant claims`` on the claims scored otherwise than at the evaluation windows: C4's block-size steps on
the support windows and C7 at long context (App. A.4), with a stand-in cell function.

The sweep plans C4-ppl's cells as run cells at ``--support-windows`` and C7's as long-context cells, one length
each, at ``--long-windows`` on ``--long-corpus`` (the pytest front's sizes by default); it runs each once, with
its float-order replicate; ``claims.json`` has their rows, read by the engine over the directory; a killed run
resumes computing only the missing cells; ``decide DIR`` adds seeds to them. The real pipeline's numbers for such
cells, read back by the directory store, are the pytest front's (tests/numerics/test_claims_fronts_agree.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rope_quant import cli
from rope_quant.claims import engine, registry
from rope_quant.sweep.cellkind import run_of
from rope_quant.sweep.claim_scoring import SCORING_META, ScoringBudget
from rope_quant.sweep.claim_store import DirectoryStore
from rope_quant.sweep.decide_plan import REPLICATE_SUFFIX
from rope_quant.sweep.kinds.long_context import LongContextConfig
from rope_quant.sweep.manifest import read_manifest
from tests.numerics.test_claims_cli import Cells as PlainCells
from tests.numerics.test_claims_cli import whip_fit

TINY = ["--seqlen", "64", "--calib-windows", "1", "--eval-windows", "1", "--quiet"]
BLOCKS = (2, 4, 8, 16, 32, 64)


def _ident(cfg) -> tuple:
    f = run_of(cfg).flat()
    length = cfg.lengths[0] if isinstance(cfg, LongContextConfig) else None
    return f["seed"], f["r3"], f["r3_block"], f["eval_windows"], length, f["gptq"].float64


def ppl(cfg) -> float:
    """A seed effect shared by the seed's cells, a small own noise, pairwise_only 0.5 above hadamard, a block
    Hadamard's gap shrinking with its block size b (none at b = d_h = 64); long context 6 PPL higher."""
    f = run_of(cfg).flat()
    seed, r3, block, length, f64 = f["seed"], f["r3"], f["r3_block"], _ident(cfg)[4], f["gptq"].float64
    shared = np.random.default_rng(seed).normal(0, 0.4)
    own = np.random.default_rng([seed, len(r3), int(block or 0), int(length or 0), int(f64)]).normal(0, 0.02)
    gap = 0.5 * (r3 == "pairwise_only") + (0.2 * np.log2(64 / block) if r3 == "block_hadamard" else 0.0)
    return float(14.0 + 6.0 * (length is not None) + shared + own + gap)


class Cells(PlainCells):
    """The stand-in cell function of both kinds (a run cell, a long-context cell of one length)."""

    def result(self, cfg) -> dict:
        value = ppl(cfg)
        windows = run_of(cfg).eval_windows
        if isinstance(cfg, LongContextConfig):
            (length,) = cfg.lengths
            return {"lengths": {str(length): {"ppl": value, "n_tokens": windows * (length - 1), "seqlen": length}}}
        return {"ppl": value, "n_tokens": windows * 63, "k_range_mean": value / 4, "k_rel_err": value / 100,
                **whip_fit(cfg)}


def _claims(out: Path, *flags: str, cells: Cells | None = None) -> int:
    return cli.main(["claims", "--out", str(out), *TINY, *flags], cell_fn=cells or Cells())


def _expected(seeds: tuple[int, ...], support: int = 3, long: int = 1) -> set[tuple]:
    """Per seed: the comparator (hadamard at the evaluation windows), C4's seven support cells and C7's four long
    cells, in both float orders those a paired part reads (not C4's hadamard: only its margin's comparator)."""
    out = {(s, "hadamard", None, 1, None, False) for s in seeds}
    for s in seeds:
        out.add((s, "hadamard", None, support, None, False))
        for f64 in (False, True):
            out |= {(s, "block_hadamard", b, support, None, f64) for b in BLOCKS}
            out |= {(s, r3, None, long, length, f64) for r3 in ("hadamard", "pairwise_only") for length in (1024, 4096)}
    return out


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[Path, Cells]:
    out, cells = tmp_path_factory.mktemp("scored") / "c47", Cells()
    assert _claims(out, "--claims", "C4-ppl,C7", "--seeds", "0,1", cells=cells) == 0
    return out, cells


def test_the_sweep_runs_each_support_and_long_cell_once(swept: tuple[Path, Cells]) -> None:
    """Every cell C4-ppl and C7 read, once each: the support cells are run cells at the support windows, the long
    cells long-context cells of one length on the long corpus's first 64 documents, one window each."""
    out, cells = swept
    assert sorted(map(_ident, cells.calls), key=repr) == sorted(_expected((0, 1)), key=repr)
    for cfg in cells.calls:
        if isinstance(cfg, LongContextConfig):
            assert (cfg.eval_corpus, cfg.eval_docs, cfg.run.eval_windows) == ("shakespeare", 64, 1)
    data = read_manifest(out)
    assert data["meta"][SCORING_META] == ScoringBudget().to_dict()
    names = {c["name"] for c in data["cells"]}
    assert {"block_hadamard+eval_windows=3+r3_block=2", "hadamard+eval_windows=3", "pairwise_only+L=4096",
            "hadamard+L=1024" + REPLICATE_SUFFIX} <= names


def test_the_plan_names_the_cells_and_prices_the_long_context(tmp_path: Path, capsys) -> None:
    out = tmp_path / "dry"
    assert _claims(out, "--claims", "C4-ppl,C7", "--seeds", "0,1", "--long-windows", "2", "--dry-run") == 0
    printed = capsys.readouterr().out
    assert "left out" not in printed
    assert "| C4-ppl | block_hadamard+eval_windows=3+r3_block=2, block_hadamard+eval_windows=3+r3_block=2" \
           ".float-order," in printed
    assert "| C7 | pairwise_only+eval_windows=2+L=1024, pairwise_only+eval_windows=2+L=1024.float-order," in printed
    assert "16 long-context cells at L = 1024, 4096" in printed
    for length in (1024, 4096):
        row = next(line for line in printed.splitlines() if line.startswith(f"| long context L={length} |"))
        assert row.endswith("| 8 |"), row  # 2 cells x 2 seeds x 2 float orders
    assert "dry run: 44 cells planned" in printed and not out.exists()


def test_claims_json_holds_their_rows_read_from_the_records(swept: tuple[Path, Cells]) -> None:
    """C4-ppl's and C7's rows are the engine's reading of the directory; their per-seed values are the stand-in's
    numbers of the support and long cells (not of the evaluation-window cells), with the long cells' tokens
    counted as the pytest front counts them (windows × L)."""
    out, _ = swept
    rows = {r["id"]: r for r in json.loads((out / "claims.json").read_text())["claims"]}
    assert set(rows) == {"C4-ppl", "C7", "C4-K", "A1-whip"}  # C4-K reads C4-ppl's cells, A1-whip the comparator
    store = DirectoryStore(out)
    for cid in ("C4-ppl", "C7"):
        direct = json.loads(json.dumps(engine.evaluate(registry.get(cid), store, (0, 1)).to_dict("smollm2-135m")))
        assert rows[cid]["numbers"] == direct["numbers"] and rows[cid]["decision"] == direct["decision"]
        assert "missing cell" not in rows[cid]["verdict"], rows[cid]["verdict"]
    by_ident = {_ident(c): ppl(c) for c in swept[1].calls}
    c7 = rows["C7"]["numbers"]["L=4096"]
    assert c7["treatment"] == [by_ident[(s, "pairwise_only", None, 1, 4096, False)] for s in (0, 1)]
    assert c7["control"] == [by_ident[(s, "hadamard", None, 1, 4096, False)] for s in (0, 1)]
    assert c7["tokens"] == 4096 and c7["replicates"] == {
        str(i): [by_ident[(s, "pairwise_only", None, 1, 4096, True)], by_ident[(s, "hadamard", None, 1, 4096, True)]]
        for i, s in enumerate((0, 1))}
    step = rows["C4-ppl"]["numbers"]["b=2→4"]
    assert step["treatment"] == [by_ident[(s, "block_hadamard", 4, 3, None, False)] for s in (0, 1)]
    assert step["tokens"] == 3 * 63
    assert rows["C4-ppl"]["parts"]["robust: gap(b=2) > gap(b=d_h)"]["outcome"] == "holds"


def test_a_claim_whose_replicates_another_claim_left_out_is_left_out(tmp_path: Path, capsys) -> None:
    """``--claims C4-K`` plans C4-ppl's cells without the float-order replicates its paired steps read: C4-ppl is
    left out with the command that adds them, never read as "no replicate exists"."""
    out = tmp_path / "k"
    assert _claims(out, "--claims", "C4-K", "--seeds", "0,1") == 0
    data = json.loads((out / "claims.json").read_text())
    rows = {r["id"] for r in data["claims"]}
    left = {d["id"]: d["reason"] for d in data["left_out"]}
    assert "C4-K" in rows and "C4-ppl" not in rows
    assert "float-order replicates are not in the manifest" in left["C4-ppl"] and "--claims C4-ppl" in left["C4-ppl"]
    assert _claims(out, "--claims", "C4-ppl", "--seeds", "0,1") == 0
    assert "C4-ppl" in {r["id"] for r in json.loads((out / "claims.json").read_text())["claims"]}


def test_a_killed_run_resumes_and_redoes_nothing(tmp_path: Path) -> None:
    out, first = tmp_path / "cl", Cells(kill_after=9)
    assert _claims(out, "--claims", "C4-ppl,C7", "--seeds", "0,1", cells=first) == 130
    second = Cells()
    assert _claims(out, "--claims", "C4-ppl,C7", "--seeds", "0,1", cells=second) == 0
    done = [_ident(c) for c in first.calls + second.calls]
    assert len(first.calls) == 9 and len(done) == len(set(done)) == len(_expected((0, 1)))
    table = (out / "claims.json").read_text()
    third = Cells()
    assert _claims(out, "--claims", "C4-ppl,C7", "--seeds", "0,1", cells=third) == 0
    assert third.calls == [] and json.loads((out / "claims.json").read_text())["claims"] == json.loads(table)["claims"]


def test_decide_adds_seeds_with_their_support_and_long_cells(tmp_path: Path) -> None:
    """``decide DIR``: a claim still open at two seeds gets a third, whose cells are its own support or long
    cells (with their replicates) and the comparator; no cell is computed twice."""
    out = tmp_path / "dec"
    assert _claims(out, "--claims", "C4-ppl,C7", "--seeds", "0,1", cells=Cells()) == 0
    cells = Cells()
    assert cli.main(["decide", str(out), "--max-seeds", "3"], cell_fn=cells) == 0
    rows = {r["id"]: r for r in json.loads((out / "decisions.json").read_text())["claims"]}
    assert set(rows) == {"C4-ppl", "C7", "C4-K", "A1-whip"}
    extended = [cid for cid in rows if rows[cid]["seeds"] == [0, 1, 2]]
    assert extended, {cid: r["verdict"] for cid, r in rows.items()}
    want = {i for i in _expected((2,)) if i[3] == 1 and i[4] is None}  # the comparator
    if "C7" in extended:
        want |= {i for i in _expected((2,)) if i[4] is not None}
    if "C4-ppl" in extended:
        want |= {i for i in _expected((2,)) if i[3] == 3}
    assert sorted(map(_ident, cells.calls), key=repr) == sorted(want, key=repr)


@pytest.mark.parametrize(("flags", "message"), [
    (["--support-windows", "0"], "--support-windows must be an integer >= 1, got 0"),
    (["--long-windows", "-1"], "--long-windows must be an integer >= 1, got -1"),
    (["--long-corpus", "no-such-corpus"], "unknown corpus 'no-such-corpus'"),
])
def test_bad_scoring_flags_are_refused_before_any_cell_runs(tmp_path: Path, capsys, flags: list[str],
                                                            message: str) -> None:
    out, cells = tmp_path / "cl", Cells()
    assert _claims(out, "--claims", "C7", *flags, cells=cells) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert cells.calls == [] and not out.exists()
