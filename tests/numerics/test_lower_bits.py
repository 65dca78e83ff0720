"""``compare --configs lower-bits`` (App. F): cells, bits and the per-setting pairing, with an injected cell."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rope_quant import cli
from rope_quant.defaults import LOWER_BIT_SETTINGS
from rope_quant.sweep import presets


def bits_cell(cfg) -> dict:
    """ppl rises as bits fall; pairwise_only pays 1 PPL per missing bit (in A, K and W), pairwise+H nothing."""
    missing = (4 - cfg.w_bits) + (4 - cfg.a_bits) + (4 - cfg.k_bits)
    ppl = 10.0 + 3.0 * missing + 0.1 * cfg.seed + (1.0 + missing if cfg.r3 == "pairwise_only" else 0.0)
    return {"ppl": ppl, "n_windows": 1, "n_tokens": 10, "k_range_mean": 1.0, "k_range_max": 1.0,
            "delta_mean": 0.0, "k_rel_err": 0.0}


def test_lower_bits_pairs_each_setting_with_its_own_hadamard(tmp_path: Path) -> None:
    out = tmp_path / "lb"
    assert cli.main(["compare", "--configs", "lower-bits", "--seeds", "0,1,2", "--out", str(out)],
                    cell_fn=bits_cell) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["configs"]) == 9
    paired = summary["paired"]
    assert set(paired) == {f"{r3}+{s}" for r3 in ("pairwise_only", "pairwise_plus_hadamard")
                           for s in LOWER_BIT_SETTINGS}
    # paired within the setting: the 3·missing offset cancels, the pairwise_only penalty remains
    assert paired["pairwise_only+W4A4KV4"]["mean"] == pytest.approx(1.0)
    assert paired["pairwise_only+W4A3KV4"]["mean"] == pytest.approx(2.0)
    assert paired["pairwise_only+W3A3KV3"]["mean"] == pytest.approx(4.0)
    assert paired["pairwise_plus_hadamard+W3A3KV3"]["mean"] == pytest.approx(0.0)
    assert paired["pairwise_only+W3A3KV3"]["comparator"] == "hadamard+W3A3KV3"
    assert "vs hadamard+W3A3KV3: +4.000" in (out / "summary.md").read_text()


def test_lower_bits_cells_carry_their_bits(tmp_path: Path) -> None:
    seen = []

    def record(cfg) -> dict:
        seen.append((cfg.r3, cfg.w_bits, cfg.a_bits, cfg.k_bits, cfg.v_bits))
        return bits_cell(cfg)

    assert cli.main(["compare", "--configs", "lower-bits", "--seeds", "0", "--out", str(tmp_path / "o")],
                    cell_fn=record) == 0
    assert ("pairwise_only", 4, 3, 4, 4) in seen and ("hadamard", 3, 3, 3, 3) in seen
    assert len(seen) == 9 and len(set(seen)) == 9


def test_lower_bits_refuses_explicit_bits_and_unknown_settings(tmp_path: Path, capsys) -> None:
    assert cli.main(["compare", "--configs", "lower-bits", "--a-bits", "8", "--out", str(tmp_path / "o")],
                    cell_fn=bits_cell) == 2
    assert "--a-bits 8" in capsys.readouterr().err
    with pytest.raises(presets.SweepError, match="W2A2KV2"):
        presets.lower_bits_manifest(object(), [0], settings=("W2A2KV2",))
