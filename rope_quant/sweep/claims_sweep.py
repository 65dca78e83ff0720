"""The claims study (``rope-quant claims``): one manifest holding every cell the chosen claims read.

A claim's cell (``rope_quant/claims/registry.py``: flat config overrides and how it is scored) at a seed is the
comparator's config at that seed with the cell's overrides, scored as the pytest front scores it
(:func:`~rope_quant.sweep.claim_scoring.scored_config`: a plain run cell at the evaluation windows, one at the support
windows for C4, a long-context cell at its length for C7), as :class:`~rope_quant.sweep.claim_store.DirectoryStore`
reads it; a cell whose weights are GPTQ gets its float-order replicate, ``NAME`` +
:data:`~rope_quant.sweep.decide_plan.REPLICATE_SUFFIX` (:func:`~rope_quant.sweep.decide_plan.replicate_config`, the
cells ``rope-quant decide`` adds). A cell is named by what sets it apart from the comparator
(``pairwise_only+estimator=k_only``, ``block_hadamard+eval_windows=3+r3_block=2``, ``hadamard+eval_windows=1+L=1024``),
so one config has one name whichever claims ask for it, and a later run with other claims or seeds is the same
study. The study's manifest says ``"study": "claims"`` (:data:`STUDY`) and keeps its scoring budget in its ``meta``
(:data:`~rope_quant.sweep.claim_scoring.SCORING_META`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rope_quant.claims.registry import Claim, Override
from rope_quant.claims.selection import paired_cells
from rope_quant.defaults import DEFAULT_COMPARATOR
from rope_quant.sweep.cellkind import SweepError, kind_of, run_of, with_overrides
from rope_quant.sweep.claim_scoring import SCORING_META, ScoringBudget, long_length, scored_config, scored_length
from rope_quant.sweep.decide_plan import REPLICATE_SUFFIX, replicate_config
from rope_quant.sweep.manifest import Manifest

STUDY = "claims"
"""The study name of a claims directory's manifest (``report`` and ``decide`` read it to take the claims path)."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_.=-]")


def is_claims_study(study: str) -> bool:
    """Whether a manifest's study is a claims study."""
    return study == STUDY


def cell_name(cfg: Any, comparator: Any) -> str:
    """A config's name in the study: its R3 (``fp`` for NIAH's unquantised reference), then each flat field that
    differs from the comparator's (sorted); a long-context cell's length last (``+L=1024``), a static or NIAH cell's
    kind and length (``+static_L=512``, ``+niah_L=256``)."""
    a, b = run_of(cfg).flat(), run_of(comparator).flat()
    extra = [f"{k}={_safe(a[k])}" for k in sorted(a) if k not in ("seed", "r3") and a[k] != b.get(k)]
    if (length := long_length(cfg)) is not None:
        extra.append(f"L={length}")
    elif (length := scored_length(cfg)) is not None:
        extra.append(f"{kind_of(cfg).name}_L={length}")
    head = "fp" if getattr(cfg, "fp", False) else _safe(a["r3"])
    return "+".join([head, *extra])


def _safe(value: Any) -> str:
    return _UNSAFE.sub("_", str(value)) or "_"


def claim_cells(claim: Claim, comparator: Any, scoring: ScoringBudget | None = None) -> list[tuple[str, Any]]:
    """The cells ``claim`` reads at the comparator's seed (scored by ``scoring``, default the e2e budget's sizes),
    each read by a paired part followed by its float-order replicate when one exists (a GPTQ cell; the pytest
    front's and the cost plan's rule, :func:`rope_quant.claims.selection.paired_cells`): ``(name, config)`` in the
    claim's order, each config once."""
    paired = paired_cells(claim)
    out: dict[str, tuple[str, Any]] = {}
    for cell_id in claim.cell_names():
        cfg = config_of(claim.cells[cell_id], comparator, scoring)
        name = cell_name(cfg, comparator)
        out.setdefault(cfg.key(), (name, cfg))
        rep = replicate_config(cfg) if cell_id in paired else None
        if rep is not None:
            out.setdefault(rep.key(), (name + REPLICATE_SUFFIX, rep))
    return list(out.values())


def config_of(cell: Mapping[str, Override], comparator: Any, scoring: ScoringBudget | None = None) -> Any:
    """The config of a claim cell: the comparator's with the cell's overrides, scored by ``scoring``
    (DirectoryStore's convention)."""
    return scored_config(cell, comparator, scoring or ScoringBudget())


def comparator_at(base: Any, seed: int, comparator: str = DEFAULT_COMPARATOR) -> Any:
    """The comparator's config at ``seed``: ``base`` with that seed and R3."""
    return with_overrides(base, seed=int(seed), r3=comparator)


def claims_manifest(base: Any, claims: Sequence[Claim], seeds: Sequence[int],
                    comparator: str = DEFAULT_COMPARATOR, scoring: ScoringBudget | None = None) -> Manifest:
    """The study: per seed, the comparator (the base every claim cell overrides), then each claim's cells and
    replicates (scored by ``scoring``), every config once. ``meta[name]``: the claims that read it (a replicate:
    ``replicate_of``); ``meta[SCORING_META]``: the scoring budget."""
    if not seeds:
        raise SweepError("no seeds given")
    if not claims:
        raise SweepError("no claims given")
    scoring = scoring or ScoringBudget()
    cells: list[tuple[str, Any]] = []
    meta: dict[str, dict[str, Any]] = {SCORING_META: scoring.to_dict()}
    for seed in seeds:
        cells += cells_at(comparator_at(base, seed, comparator), claims, meta)
    return Manifest(cells=cells, study=STUDY, comparator=comparator, meta=meta)


def cells_at(comp: Any, claims: Iterable[Claim], meta: dict[str, dict[str, Any]] | None = None
             ) -> list[tuple[str, Any]]:
    """The comparator ``comp`` and every cell the claims read at its seed, each config once (``meta`` filled; the
    cells scored by the budget in ``meta[SCORING_META]``, the defaults where none)."""
    meta = {} if meta is None else meta
    scoring = ScoringBudget.from_meta(meta)
    name = cell_name(comp, comp)
    found: dict[str, tuple[str, Any]] = {comp.key(): (name, comp)}
    meta.setdefault(name, {"r3": run_of(comp).r3, "claims": []})
    for claim in claims:
        for cname, cfg in claim_cells(claim, comp, scoring):
            found.setdefault(cfg.key(), (cname, cfg))
            if cname.endswith(REPLICATE_SUFFIX):
                meta.setdefault(cname, {"replicate_of": cname[: -len(REPLICATE_SUFFIX)]})
                continue
            entry = meta.setdefault(cname, {"r3": run_of(cfg).r3, "claims": []})
            if claim.id not in entry["claims"]:
                entry["claims"].append(claim.id)
    return list(found.values())


def requested_claims(manifest: Manifest) -> set[str]:
    """The ids of the claims a claims study was run for (its cells' ``meta[name]["claims"]``)."""
    return {str(cid) for entry in manifest.meta.values() for cid in entry.get("claims", ())}


def cells_per_claim(claims: Sequence[Claim], comp: Any, scoring: ScoringBudget | None = None) -> dict[str, list[str]]:
    """Claim id → the names of the cells it reads at one seed (replicates included), for the printed plan."""
    return {c.id: [name for name, _ in claim_cells(c, comp, scoring)] for c in claims}
