"""The claims study (``rope-quant claims``): one manifest holding every cell the chosen claims read.

A claim's cell (``rope_quant/claims/registry.py``: flat config overrides) at a seed is the comparator's config at
that seed with the cell's overrides, as :class:`~rope_quant.sweep.claim_store.DirectoryStore` reads it, each with
its float-order replicate where the one rule builds one (GPTQ weights), ``NAME`` +
:data:`~rope_quant.sweep.decide_plan.REPLICATE_SUFFIX` (the configs of :func:`rope_quant.claims.selection.cell_configs`,
as pytest's registry fronts plan them; the cells ``rope-quant decide`` adds). A cell is named by what
sets it apart from the comparator (``pairwise_only+estimator=k_only``), so one config has one name whichever
claims ask for it, and a later run with other claims or seeds is the same study. Claims whose cells are scored
otherwise than at the budget's evaluation windows (C4's support windows, C7's long-context protocol) are left
out with the reason (:func:`rope_quant.claims.selection.scoring_reason`). The study's manifest says
``"study": "claims"`` (:data:`STUDY`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from rope_quant.claims.registry import Claim
from rope_quant.claims.selection import cell_configs
from rope_quant.defaults import DEFAULT_COMPARATOR
from rope_quant.sweep.cellkind import SweepError, run_of, with_overrides
from rope_quant.sweep.decide_plan import REPLICATE_SUFFIX
from rope_quant.sweep.manifest import Manifest

STUDY = "claims"
"""The study name of a claims directory's manifest (``report`` and ``decide`` read it to take the claims path)."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_.=-]")


def is_claims_study(study: str) -> bool:
    """Whether a manifest's study is a claims study."""
    return study == STUDY


def cell_name(cfg: Any, comparator: Any) -> str:
    """A config's name in the study: its R3, then each flat field that differs from the comparator's (sorted)."""
    a, b = run_of(cfg).flat(), run_of(comparator).flat()
    extra = [f"{k}={_safe(a[k])}" for k in sorted(a) if k not in ("seed", "r3") and a[k] != b.get(k)]
    return "+".join([_safe(a["r3"]), *extra])


def _safe(value: Any) -> str:
    return _UNSAFE.sub("_", str(value)) or "_"


def claim_cells(claim: Claim, comparator: Any) -> list[tuple[str, Any]]:
    """The cells ``claim`` reads at the comparator's seed, each followed by its float-order replicate when one
    exists (a GPTQ cell): ``(name, config)`` in the claim's order, each config once."""
    out: dict[str, tuple[str, Any]] = {}
    name = ""
    for got in cell_configs(claim, comparator):  # a cell, then its replicate
        name = name + REPLICATE_SUFFIX if got.replicate else cell_name(got.config, comparator)
        out.setdefault(got.config.key(), (name, got.config))
    return list(out.values())


def comparator_at(base: Any, seed: int, comparator: str = DEFAULT_COMPARATOR) -> Any:
    """The comparator's config at ``seed``: ``base`` with that seed and R3."""
    return with_overrides(base, seed=int(seed), r3=comparator)


def claims_manifest(base: Any, claims: Sequence[Claim], seeds: Sequence[int],
                    comparator: str = DEFAULT_COMPARATOR) -> Manifest:
    """The study: per seed, the comparator (the base every claim cell overrides), then each claim's cells and
    replicates, every config once. ``meta[name]``: the claims that read it (a replicate: ``replicate_of``)."""
    if not seeds:
        raise SweepError("no seeds given")
    if not claims:
        raise SweepError("no claims given")
    cells: list[tuple[str, Any]] = []
    meta: dict[str, dict[str, Any]] = {}
    for seed in seeds:
        cells += cells_at(comparator_at(base, seed, comparator), claims, meta)
    return Manifest(cells=cells, study=STUDY, comparator=comparator, meta=meta)


def cells_at(comp: Any, claims: Iterable[Claim], meta: dict[str, dict[str, Any]] | None = None
             ) -> list[tuple[str, Any]]:
    """The comparator ``comp`` and every cell the claims read at its seed, each config once (``meta`` filled)."""
    meta = {} if meta is None else meta
    name = cell_name(comp, comp)
    found: dict[str, tuple[str, Any]] = {comp.key(): (name, comp)}
    meta.setdefault(name, {"r3": run_of(comp).r3, "claims": []})
    for claim in claims:
        for cname, cfg in claim_cells(claim, comp):
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


def cells_per_claim(claims: Sequence[Claim], comp: Any) -> dict[str, list[str]]:
    """Claim id → the names of the cells it reads at one seed (replicates included), for the printed plan."""
    return {c.id: [name for name, _ in claim_cells(c, comp)] for c in claims}
