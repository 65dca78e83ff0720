"""The named sets of cells behind the CLI commands: compare, beyond, support, estimators, long-context.

Each function turns a base ``RunConfig`` and the command's options into a
:class:`~rope_quant.sweep.manifest.Manifest` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rope_quant.defaults import DEFAULT_COMPARATOR, LOWER_BIT_SETTINGS
from rope_quant.experiment.config import Budget
from rope_quant.sweep.cellkind import CellKindName, kind_named, kind_of
from rope_quant.sweep.manifest import LongContextConfig, Manifest, SweepError, build_manifest, with_overrides


def compare_manifest(base: Any, configs: Sequence[str], seeds: Sequence[int],
                     comparator: str = DEFAULT_COMPARATOR) -> Manifest:
    """The main comparison: one cell per (seed, R3 name), R3 names used as config names."""
    return build_manifest(base, {name: {"r3": name} for name in configs}, seeds, study="compare",
                          comparator=comparator, family=[c for c in configs if c != comparator],
                          meta={name: {"r3": name} for name in configs})


def support_manifest(base: Any, blocks: Sequence[int], seeds: Sequence[int],
                     transform: str = "block_hadamard", comparator: str = DEFAULT_COMPARATOR) -> Manifest:
    """Mixing support: ``transform`` with block size b for each b, plus the comparator."""
    variants: dict[str, dict[str, Any]] = {comparator: {"r3": comparator, "r3_block": None}}
    meta: dict[str, dict[str, Any]] = {comparator: {"r3": comparator}}
    for b in blocks:
        name = f"{transform}-b{int(b)}"
        variants[name] = {"r3": transform, "r3_block": int(b)}
        meta[name] = {"r3": transform, "block": int(b)}
    return build_manifest(base, variants, seeds, study="support", comparator=comparator,
                          family=[n for n in variants if n != comparator], meta=meta)


def estimators_manifest(base: Any, estimators: Sequence[str], seeds: Sequence[int], *,
                        transform: str = "pairwise_only", phi_star: bool = False,
                        phi_star_estimator: str = "rows", average_length: int | None = None,
                        comparator: str = DEFAULT_COMPARATOR) -> Manifest:
    """Angle estimators (rows, k_only, balanced[, per_head]) with φ̂, and φ* when ``phi_star``."""
    variants: dict[str, dict[str, Any]] = {comparator: {"r3": comparator}}
    meta: dict[str, dict[str, Any]] = {comparator: {"r3": comparator}}
    for est in estimators:
        name = f"{transform}-{est}"
        variants[name] = {"r3": transform, "estimator": est, "angle": "phi_hat"}
        meta[name] = {"r3": transform, "estimator": est}
    if phi_star:  # φ* and its branch-matched φ̂ control (App. J): the pair isolates the finite-phase correction
        for rule in ("phi_star", "phi_hat_branch_matched"):
            name = f"{transform}-{rule}"
            variants[name] = {"r3": transform, "estimator": phi_star_estimator, "angle": rule,
                              "average_length": average_length if rule == "phi_star" else None,
                              "objective": "variance"}
            meta[name] = {"r3": transform, "estimator": f"{rule}({phi_star_estimator})"}
    return build_manifest(base, variants, seeds, study="estimators", comparator=comparator,
                          family=[n for n in variants if n != comparator], meta=meta)


def long_context_manifest(base: Any, configs: Sequence[str], seeds: Sequence[int], lengths: Sequence[int],
                          comparator: str = DEFAULT_COMPARATOR, eval_corpus: str | None = None) -> Manifest:
    """Long-context crossover: each (seed, R3 name) evaluated at every length (on ``eval_corpus`` if given,
    calibrated on ``base.corpus``). A φ* config (``base.angle == phi_star``) re-estimates φ* with its
    averaging length matched to each L (A.4), whatever the estimator."""
    cells = []
    for s in seeds:
        for name in configs:
            run = with_overrides(base, seed=int(s), r3=name)
            cells.append((name, LongContextConfig(run, tuple(lengths), matched_average=matches_length(run),
                                                  eval_corpus=eval_corpus)))
    if not cells:
        raise SweepError("no configs or seeds given")
    return Manifest(cells=cells, study="long-context", comparator=comparator,
                    family=[c for c in configs if c != comparator],
                    meta={name: {"r3": name, "lengths": list(lengths)} for name in configs})


#: The "beyond the paper" angle variants (can a RoPE-commuting R3 close the gap?): name suffix ->
#: RunConfig overrides. Every variant resets the angle fields, so the base config's own do not leak in.
BEYOND_ANGLES: dict[str, dict[str, Any]] = {
    "rows": {"estimator": "rows"},
    "k_only": {"estimator": "k_only"},
    "per_head": {"estimator": "per_head"},
    "phi_star_k_only": {"estimator": "k_only", "angle": "phi_star"},
    "range": {"estimator": "k_only", "objective": "range"},
    "range_per_head": {"estimator": "per_head", "objective": "range"},
}
BEYOND_TRANSFORMS = ("pairwise_only", "pairwise_plus_hadamard")
#: The subset evaluated at long context (the paired short-context study runs every variant).
BEYOND_LONG = ("pairwise_only-rows", "pairwise_only-phi_star_k_only", "pairwise_only-range_per_head",
               "pairwise_plus_hadamard-range_per_head")


def beyond_variants(comparator: str = DEFAULT_COMPARATOR) -> dict[str, dict[str, Any]]:
    """``{name: overrides}``: the comparator, then ``<transform>-<angles>`` for every beyond variant."""
    reset = {"r3_block": None, "estimator": "rows", "objective": "variance", "angle": "phi_hat",
             "average_length": None}
    out: dict[str, dict[str, Any]] = {comparator: {**reset, "r3": comparator}}
    for transform in BEYOND_TRANSFORMS:
        for suffix, overrides in BEYOND_ANGLES.items():
            out[f"{transform}-{suffix}"] = {**reset, "r3": transform, **overrides}
    return out


def beyond_manifest(base: Any, seeds: Sequence[int], comparator: str = DEFAULT_COMPARATOR) -> Manifest:
    """``compare --configs beyond``: every beyond variant against the comparator, paired over seeds."""
    variants = beyond_variants(comparator)
    meta = {name: {k: v for k, v in ov.items() if k in ("r3", "estimator", "objective", "angle")}
            for name, ov in variants.items()}
    return build_manifest(base, variants, seeds, study="beyond", comparator=comparator,
                          family=[n for n in variants if n != comparator], meta=meta)


def beyond_long_context_manifest(base: Any, seeds: Sequence[int], lengths: Sequence[int],
                                 comparator: str = DEFAULT_COMPARATOR) -> Manifest:
    """``long-context --configs beyond``: :data:`BEYOND_LONG` plus φ*(k_only) with the averaging length
    matched to each evaluated L (``pairwise_only-phi_star_k_only-matched``)."""
    variants = beyond_variants(comparator)
    chosen = {name: variants[name] for name in (comparator, *BEYOND_LONG)}
    cells: list[tuple[str, Any]] = []
    for seed in seeds:
        for name, overrides in chosen.items():
            run = with_overrides(base, seed=int(seed), **overrides)
            cells.append((name, LongContextConfig(run, tuple(lengths))))
        run = with_overrides(base, seed=int(seed), **variants["pairwise_only-phi_star_k_only"])
        cells.append(("pairwise_only-phi_star_k_only-matched",
                      LongContextConfig(run, tuple(lengths), matched_average=True)))
    names = [*chosen, "pairwise_only-phi_star_k_only-matched"]
    return Manifest(cells=cells, study="long-context", comparator=comparator,
                    family=[n for n in names if n != comparator],
                    meta={n: {"lengths": list(lengths)} for n in names})


#: ``compare --configs beyond2``: can a FOLDABLE R3 match the online Hadamard? name -> overrides.
#: ``pairwise_only`` (the paper's φ̂) is the baseline whose gap to the comparator the others are scored on
#: (:mod:`rope_quant.analysis.gap_share`); ``learned_orthogonal`` does not commute: the upper reference.
FOLDABLE_R3 = "foldable-r3"
BEYOND2 = FOLDABLE_R3
#: The tag this study's manifest records (its earlier preset name: a results directory keeps its study).
FOLDABLE_R3_TAG = "beyond2"
BEYOND2_BASELINE = "pairwise_only"
BEYOND2_VARIANTS: dict[str, dict[str, Any]] = {
    "pairwise_only": {"r3": "pairwise_only"},
    "pairwise_only-range_per_head": {"r3": "pairwise_only", "estimator": "per_head", "objective": "range"},
    "pairwise_scaled-range_per_head": {"r3": "pairwise_scaled", "estimator": "per_head", "objective": "range"},
    "pairwise_scaled-variance_per_head": {"r3": "pairwise_scaled", "estimator": "per_head"},
    "prerope_channel_scale": {"r3": "prerope_channel_scale"},
    "learned_orthogonal": {"r3": "learned_orthogonal"},
}


def beyond2_variants(comparator: str = DEFAULT_COMPARATOR) -> dict[str, dict[str, Any]]:
    """``{name: overrides}``: the comparator, then :data:`BEYOND2_VARIANTS` (angle fields reset, as in beyond)."""
    reset = {"r3_block": None, "estimator": "rows", "objective": "variance", "angle": "phi_hat",
             "average_length": None}
    out: dict[str, dict[str, Any]] = {comparator: {**reset, "r3": comparator}}
    out.update({name: {**reset, **ov} for name, ov in BEYOND2_VARIANTS.items() if name != comparator})
    return out


def beyond2_manifest(base: Any, seeds: Sequence[int], comparator: str = DEFAULT_COMPARATOR) -> Manifest:
    """``compare --configs beyond2``: the foldable R3 family against the comparator, paired over seeds, one Holm
    family; reported by the beyond table plus the gap-share table (:mod:`rope_quant.analysis.gap_share`)."""
    variants = beyond2_variants(comparator)
    meta = {name: {**{k: v for k, v in ov.items() if k in ("r3", "estimator", "objective", "angle")},
                   "preset": FOLDABLE_R3_TAG} for name, ov in variants.items()}
    return build_manifest(base, variants, seeds, study="beyond", comparator=comparator,
                          family=[n for n in variants if n != comparator], meta=meta)


#: App. J's long-context family: φ* (averaging length matched to each L) against its branch-matched φ̂ control.
MATCHED_PHI_STAR = "matched-phi-star"
APPJ = MATCHED_PHI_STAR


def appj_long_context_manifest(base: Any, seeds: Sequence[int], lengths: Sequence[int],
                               corpora: Sequence[str], estimator: str = "rows") -> Manifest:
    """``long-context --configs appj``: per evaluation corpus, φ* with its averaging length matched to L
    (``phi_star+<corpus>``) against the branch-matched φ̂ (``phi_hat_branch_matched+<corpus>``), calibrated on
    ``base.corpus``. Every (L, corpus) contrast is one member of a Holm family (App. J); ``report`` prints the
    Holm-adjusted p-values."""
    if not corpora:
        raise SweepError("appj needs at least one evaluation corpus")
    cells: list[tuple[str, Any]] = []
    meta: dict[str, dict[str, Any]] = {}
    angles = {"phi_hat_branch_matched": {"angle": "phi_hat_branch_matched"}, "phi_star": {"angle": "phi_star"}}
    for corpus in corpora:
        control = f"phi_hat_branch_matched+{corpus_tag(corpus)}"
        for rule in angles:
            name = f"{rule}+{corpus_tag(corpus)}"
            meta[name] = {"r3": "pairwise_only", "angle": rule, "eval_corpus": corpus, "lengths": list(lengths),
                          **({"control": control} if rule == "phi_star" else {})}
        for seed in seeds:
            for rule, overrides in angles.items():
                run = with_overrides(base, seed=int(seed), r3="pairwise_only", estimator=estimator,
                                     objective="variance", average_length=None, **overrides)
                cells.append((f"{rule}+{corpus_tag(corpus)}", LongContextConfig(run, tuple(lengths),
                                                                    matched_average=rule == "phi_star",
                                                                    eval_corpus=corpus)))
    return Manifest(cells=cells, study="long-context", comparator=f"phi_hat_branch_matched+{corpus_tag(corpora[0])}",
                    family=[f"phi_star+{corpus_tag(c)}" for c in corpora], meta=meta)


def corpus_tag(corpus: str) -> str:
    """A corpus name or path as a config-name suffix (its last path component, other characters as ``_``)."""
    import re
    from pathlib import PurePath

    return re.sub(r"[^A-Za-z0-9_.=-]", "_", PurePath(corpus).name or corpus) or "corpus"


#: ``compare --configs lower-bits`` (App. F): the lower bit settings and the W4A4KV4 reference
#: (:data:`rope_quant.defaults.LOWER_BIT_SETTINGS`).
LOWER_BITS = "lower-bits"
LOWER_BIT_CONFIGS = ("hadamard", "pairwise_plus_hadamard", "pairwise_only")


def lower_bits_manifest(base: Any, seeds: Sequence[int], settings: Sequence[str] = tuple(LOWER_BIT_SETTINGS),
                        configs: Sequence[str] = LOWER_BIT_CONFIGS, comparator: str = DEFAULT_COMPARATOR) -> Manifest:
    """App. F's tables: every R3 config at every bit setting (``<r3>+<setting>``), paired within seed against
    the same setting's comparator (``meta[name]["control"]``). The R3 statistics and the GPTQ weights of a
    seed are shared by the settings with the same weight bits."""
    unknown = [s for s in settings if s not in LOWER_BIT_SETTINGS]
    if unknown:
        raise SweepError(f"unknown bit settings {unknown}: choose from {', '.join(LOWER_BIT_SETTINGS)}")
    if comparator not in configs:
        raise SweepError(f"the comparator {comparator!r} must be one of the configs {list(configs)}")
    variants: dict[str, dict[str, Any]] = {}
    meta: dict[str, dict[str, Any]] = {}
    for setting in settings:
        w, a, k, v = LOWER_BIT_SETTINGS[setting]
        for r3 in configs:
            name = f"{r3}+{setting}"
            variants[name] = {"r3": r3, "w_bits": w, "a_bits": a, "k_bits": k, "v_bits": v}
            meta[name] = {"r3": r3, "bits": setting, "control": f"{comparator}+{setting}"}
    first = f"{comparator}+{settings[0]}"
    return build_manifest(base, variants, seeds, study="lower-bits", comparator=first,
                          family=[n for n in variants if not n.startswith(f"{comparator}+")], meta=meta)


# ----------------------------------------------------------------------------- the A.4 protocol


def matches_length(run: Any) -> bool:
    """A long-context cell of ``run`` re-estimates φ* at averaging length L: φ* angles that R3 uses."""
    from rope_quant.core import transforms

    try:
        uses = transforms.needs_angles(run.r3)
    except transforms.TransformError:
        return False
    return bool(getattr(run, "position_average", False)) and uses and getattr(run, "average_length", None) is None


def phi_star_matched_cells(base: Any, seeds: Sequence[int], lengths: Sequence[int], estimators: Sequence[str],
                           transform: str = "pairwise_only") -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """φ* (variance objective) under each estimator with its averaging length matched to every L:
    cells ``<transform>-phi_star_<estimator>`` and their meta."""
    cells: list[tuple[str, Any]] = []
    meta: dict[str, Any] = {}
    for est in estimators:
        name = f"{transform}-phi_star_{est}"
        meta[name] = {"r3": transform, "estimator": est, "angle": "phi_star", "average_length": "L",
                      "lengths": list(lengths)}
        for seed in seeds:
            run = with_overrides(base, seed=int(seed), r3=transform, estimator=est, objective="variance",
                                 angle="phi_star", average_length=None)
            cells.append((name, LongContextConfig(run, tuple(lengths), matched_average=True)))
    return cells, meta


def add_cells(manifest: Manifest, cells: Sequence[tuple[str, Any]], meta: dict[str, Any]) -> Manifest:
    """``manifest`` with ``cells`` appended (their names join the Holm family)."""
    names = list(dict.fromkeys(n for n, _ in cells))
    family = None if manifest.family is None else [*manifest.family, *[n for n in names
                                                                       if n not in manifest.family]]
    return dataclasses.replace(manifest, cells=[*manifest.cells, *cells], family=family,
                               meta={**(manifest.meta or {}), **meta})


def with_eval_docs(manifest: Manifest, eval_docs: int | None) -> Manifest:
    """Every long-context cell scores the first ``eval_docs`` evaluation documents (None: the whole split)."""
    long_context = kind_named(CellKindName.LONG_CONTEXT)
    cells = [(n, dataclasses.replace(c, eval_docs=eval_docs) if kind_of(c) is long_context else c)
             for n, c in manifest.cells]
    return dataclasses.replace(manifest, cells=cells)


def per_corpus(manifest: Manifest, corpora: Sequence[str]) -> Manifest:
    """A long-context manifest scored on each of ``corpora``: cell ``<name>+<corpus>`` evaluates ``<name>`` on
    that corpus (calibration unchanged) and is paired against ``<comparator>+<corpus>``; the Holm family
    holds every (config, corpus)."""
    if not corpora:
        raise SweepError("per_corpus needs at least one evaluation corpus")
    comp = manifest.comparator
    meta_in = manifest.meta or {}
    cells: list[tuple[str, Any]] = []
    meta: dict[str, Any] = {}
    family: list[str] = []
    for corpus in corpora:
        tag = corpus_tag(corpus)
        for name, cfg in manifest.cells:
            if kind_of(cfg) is not kind_named(CellKindName.LONG_CONTEXT):
                raise SweepError(f"per_corpus expands long-context cells only, got {type(cfg).__name__} ({name})")
            cells.append((f"{name}+{tag}", dataclasses.replace(cfg, eval_corpus=corpus)))
        for name in dict.fromkeys(n for n, _ in manifest.cells):
            entry = {**meta_in.get(name, {}), "eval_corpus": corpus}
            if name != comp:
                entry["control"] = f"{comp}+{tag}"
            meta[f"{name}+{tag}"] = entry
        base_family = manifest.family if manifest.family is not None else [
            n for n in dict.fromkeys(n for n, _ in manifest.cells) if n != comp]
        family += [f"{n}+{tag}" for n in base_family]
    return Manifest(cells=cells, study=manifest.study, comparator=f"{comp}+{corpus_tag(corpora[0])}",
                    family=family, meta=meta)


# ----------------------------------------------------------------------------- budgets and preset names

#: ``--configs`` preset name for the beyond-the-paper study (:func:`beyond_manifest`): RoPE-commuting R3s with
#: every angle estimator against the comparator.
COMMUTING_R3 = "commuting-r3"
BEYOND = COMMUTING_R3
#: The ``--configs`` presets each sweep command accepts besides R3 registry names (the single source of the
#: names the CLI lists and suggests).
COMMAND_PRESETS: dict[str, tuple[str, ...]] = {"compare": (BEYOND, BEYOND2, LOWER_BITS), "long-context": (BEYOND, APPJ)}
#: The presets' earlier names (still accepted): old name -> preset.
PRESET_ALIASES: dict[str, str] = {"beyond": COMMUTING_R3, "beyond2": FOLDABLE_R3, "appj": MATCHED_PHI_STAR}


def preset_named(name: str, command: str) -> str | None:
    """The preset ``name`` (or its earlier name) stands for under ``command``, else None."""
    preset = PRESET_ALIASES.get(name, name)
    return preset if preset in COMMAND_PRESETS.get(command, ()) else None
#: Defaults per device: window length, calibration / evaluation windows (None = every window), the weight
#: quantiser and its MSE clipping search. The CPU budget keeps the default ``compare`` (4 configs x 3 seeds)
#: within about 15 minutes on 2 cores: GPTQ with the MSE search took about 27 minutes for ONE seed at
#: 8 x 512 calibration tokens on the shared 2-core machine, so CPU defaults to RTN (``--weights gptq``
#: restores the paper's setting, as on CUDA).
BUDGETS: dict[str, dict[str, Any]] = {
    "cpu": {"seqlen": 512, "calib_windows": 4, "eval_windows": 4, "weights": "rtn", "w_mse": True},
    "cuda": {"seqlen": 2048, "calib_windows": 128, "eval_windows": None, "weights": "gptq", "w_mse": True},
}
BUDGET_FIELDS = ("seqlen", "calib_windows", "eval_windows", "weights", "w_mse")
#: Smallest value of the numeric budget fields (a window needs two tokens: one predicts the next).
BUDGET_MINIMUM = {"seqlen": Budget.MIN_SEQLEN, "calib_windows": 1, "eval_windows": 1}
LONG_CONTEXT_LENGTHS = {"cpu": (256, 512, 1024), "cuda": (2048, 4096, 8192, 16384)}


class BudgetError(SweepError):
    """A budget value below its minimum; ``field`` names it (the CLI prints the flag)."""

    def __init__(self, field: str, value: Any) -> None:
        self.field, self.value = field, value
        zero = " (0 = all)" if field == "eval_windows" else ""
        super().__init__(f"{field} must be an integer >= {BUDGET_MINIMUM[field]}{zero}, got {value}")


def device_kind(device: str) -> str:
    """``"cuda"`` for ``cuda`` / ``cuda:N``, else ``"cpu"``: the key of :data:`BUDGETS`."""
    return "cuda" if device.startswith("cuda") else "cpu"


def resolve_budget(device: str, given: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """seqlen, windows, weights and w_mse from ``given`` (None = the device default); lists the defaults used
    as ``field=value``. ``eval_windows`` 0 means every window (None)."""
    budget, used = {}, []
    for field in BUDGET_FIELDS:
        value = given.get(field)
        if value is None:
            value = BUDGETS[device_kind(device)][field]
            used.append(f"{field}={'all' if value is None else value}")
        elif field == "eval_windows" and value == 0:
            value = None
        elif field in BUDGET_MINIMUM and value < BUDGET_MINIMUM[field]:
            raise BudgetError(field, value)
        budget[field] = value
    return budget, used
