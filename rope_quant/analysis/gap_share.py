"""The share of a baseline's gap that each R3 closes (``compare --configs beyond2``).

With paired perplexities per seed s, the baseline B (``pairwise_only``) and the comparator C (``hadamard``),
the share of B's gap that transform X closes is

    share(X) = mean_s (B_s − X_s) / mean_s (B_s − C_s)

(1 = X matches C, 0 = no better than B, > 1 = better than C). Its CI is the seeded percentile bootstrap over
seeds (resampling whole seeds keeps the pairing); with fewer than 3 common seeds, or a non-positive baseline gap
in the data, the CI is left empty. ``foldable``: the transform commutes with RoPE (folds into W_Q/W_K).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rope_quant.analysis.tables import Table, fmt
from rope_quant.core.verdict import LEVEL

__all__ = ["BOOTSTRAP", "gap_share", "gap_share_table", "is_gap_share_run", "plot_gap_share", "write_gap_share_report"]

#: Bootstrap resamples and seed of the share's CI.
BOOTSTRAP, BOOTSTRAP_SEED = 4000, 0


def gap_share(x: Any, base: Any, comp: Any, level: float = LEVEL) -> dict[str, float | None]:
    """share, CI (percentile bootstrap over seeds) and n for aligned per-seed ppl lists ``x``, ``base``, ``comp``."""
    x, b, c = (np.asarray(v, dtype=np.float64) for v in (x, base, comp))
    n = x.size
    gap = (b - c).mean() if n else np.nan
    out: dict[str, float | None] = {"share": None, "low": None, "high": None, "n": float(n),
                                    "baseline_gap": float(gap) if n else None}
    if n == 0 or not np.isfinite(gap) or gap <= 0:
        return out
    out["share"] = float((b - x).mean() / gap)
    if n >= 3:
        rng = np.random.default_rng(BOOTSTRAP_SEED)
        idx = rng.integers(0, n, size=(BOOTSTRAP, n))
        num, den = (b - x)[idx].mean(axis=1), (b - c)[idx].mean(axis=1)
        ok = den > 0
        shares = num[ok] / den[ok]
        if shares.size >= BOOTSTRAP // 2:
            tail = (1 - level) / 2 * 100
            out["low"], out["high"] = (float(v) for v in np.percentile(shares, [tail, 100 - tail]))
    return out


def _folds(per_seed: Any, commutes: bool | None) -> bool | None:
    """Folds into this model: every seed's cell says so (any refusal: False); records without the check fall
    back to the registry's ``commutes``."""
    known = [v for v in (per_seed or []) if v is not None]
    return all(known) if known else commutes


def _commutes(r3: str) -> bool | None:
    from rope_quant.core import transforms

    try:
        return transforms.spec(r3).commutes_with_rope
    except transforms.TransformError:
        return None


def gap_share_table(summary: Mapping[str, Any], baseline: str = "pairwise_only",
                    level: float = LEVEL) -> Table | None:
    """Per config (not the comparator or the baseline): K range, K error, ppl and the share of the baseline's
    gap it closes, with its CI. None when the summary lacks the baseline or the comparator."""
    configs, comp = summary.get("configs") or {}, summary.get("comparator")
    if baseline not in configs or comp not in configs:
        return None
    meta = summary.get("meta") or {}
    by_seed = {name: dict(zip(cfg["seeds"], cfg["ppl"], strict=True)) for name, cfg in configs.items()}
    columns = ["config", "r3", "commutes", "foldable", "ppl", "k_range_mean", "k_rel_err", "share", "share_low",
               "share_high", "n", "equivalent", "equivalence_budget_seeds", "equivalence_budget_tokens"]
    margin = _margin(configs[comp]["mean"])
    rows, md_rows = [], []
    for name, cfg in configs.items():
        if name == comp:
            continue
        seeds = [s for s in cfg["seeds"] if s in by_seed[baseline] and s in by_seed[comp]]
        g = gap_share([by_seed[name][s] for s in seeds], [by_seed[baseline][s] for s in seeds],
                      [by_seed[comp][s] for s in seeds], level)
        r3 = (meta.get(name) or {}).get("r3", name)
        k_range = [v for v in cfg.get("k_range_mean", []) if v is not None]
        k_err = [v for v in cfg.get("k_rel_err", []) if v is not None]
        commutes = _commutes(r3)
        row = {"config": name, "r3": r3, "commutes": commutes, "foldable": _folds(cfg.get("r3_folds"), commutes),
               "ppl": cfg["mean"],
               "k_range_mean": float(np.mean(k_range)) if k_range else None,
               "k_rel_err": float(np.mean(k_err)) if k_err else None, "share": g["share"],
               "share_low": g["low"], "share_high": g["high"], "n": len(seeds)}
        eq = _equivalence([by_seed[name][s] - by_seed[comp][s] for s in seeds], margin,
                          (summary.get("paired", {}).get(name) or {}).get("tokens"))
        row.update({"equivalent": eq.outcome.value, "equivalence_budget_seeds": eq.budget.seeds if eq.budget else None,
                    "equivalence_budget_tokens": eq.budget.tokens if eq.budget else None})
        rows.append(row)
        low, high = g["low"], g["high"]
        ci = f" [{100 * low:.0f}%, {100 * high:.0f}%]" if low is not None and high is not None else ""
        md_rows.append({"config": name, "commutes": fmt(commutes), "folds here": fmt(row["foldable"]),
                        "ppl": fmt(row["ppl"]),
                        "K range": fmt(row["k_range_mean"]), "K rel. err": fmt(row["k_rel_err"], 4),
                        f"share of {baseline}'s gap [CI]": ("–" if g["share"] is None else
                                                            f"{100 * g['share']:.0f}%") + ci,
                        "n": str(len(seeds)), f"≡ {comp} (±{margin.value:.3f})": _equivalence_text(eq)})
    return Table("gap-share", f"Share of {baseline}'s gap to {comp} that each R3 closes", columns, rows,
                 ["config", "commutes", "folds here", "ppl", "K range", "K rel. err",
                  f"share of {baseline}'s gap [CI]", "n", f"≡ {comp} (±{margin.value:.3f})"],
                 md_rows, notes=[f"share = mean(ppl {baseline} − ppl config) / mean(ppl {baseline} − ppl {comp}) "
                                 f"over paired seeds; {int(level * 100)}% percentile bootstrap over seeds "
                                 f"({BOOTSTRAP} resamples, seed {BOOTSTRAP_SEED}); commutes: with RoPE (the "
                                 "registry's declaration); folds here: the cells' fold check on this model "
                                 "(rotations.fold_r3.fold_refusal: a q/k norm between the projection and RoPE "
                                 "lets a rotation through only where its weight is tied within each pair), "
                                 "the registry's 'commutes' for records that predate the check.",
                                 f"≡ {comp}: the suite's rule (rope_quant.core.verdict, TOST form, no numerical "
                                 f"replicate in a compare run) on ppl(config) − ppl({comp}) with the margin "
                                 f"{margin.basis}; an inconclusive row carries the budget that decides it at 80% "
                                 "power."])


def _margin(comparator_ppl: float):
    from rope_quant.core.verdict import equivalence_margin

    return equivalence_margin(float(comparator_ppl))


def _equivalence_text(v: Any) -> str:
    """The verdict column; a refuted equivalence says on which side of the comparator the config lies."""
    if v.outcome.value == "refuted":
        return f"refuted ({'worse' if v.mean > 0 else 'better'}: {v.mean:+.3f} [{v.low:+.3f}, {v.high:+.3f}])"
    return v.text()


def _equivalence(diffs: list[float], margin: Any, tokens: Any):
    """The TOST verdict (a foldable R3's question: the paired CI against the comparator inside the margin), with its
    budget, on the per-seed differences (:func:`rope_quant.claims.values.decide_diffs`); tokens per cell make the
    budget also read in tokens."""
    from rope_quant.claims.values import decide_diffs
    from rope_quant.core.verdict import Form

    return decide_diffs(Form.EQUIVALENT, diffs, margin=margin.value, tokens=int(tokens) if tokens else None)


def plot_gap_share(table: Table, path: str | os.PathLike[str], title: str = "") -> Path:
    """Horizontal bars: the share of the baseline's gap each config closes, with its CI; foldable bars filled,
    non-foldable hatched; 0% and 100% marked."""
    from rope_quant.analysis.figures import pyplot, save_png

    plt = pyplot()
    rows = [r for r in table.rows if r["share"] is not None]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(rows) + 1.6))
    for i, r in enumerate(rows):
        err = None
        if r["share_low"] is not None:
            err = [[100 * (r["share"] - r["share_low"])], [100 * (r["share_high"] - r["share"])]]
        ax.barh(i, 100 * r["share"], xerr=err, capsize=3, color="tab:blue" if r["foldable"] else "white",
                edgecolor="tab:blue", hatch=None if r["foldable"] else "//")
    ax.set_yticks(range(len(rows)), [r["config"] for r in rows], fontsize=8)
    undefined = [r["config"] for r in table.rows if r["share"] is None]
    if undefined:  # the baseline is not worse than the comparator here, so no share is defined: say so
        ax.text(0.5, 0.5 if not rows else 0.02, "no share defined (the baseline's gap is not positive) for:\n"
                + ", ".join(undefined), transform=ax.transAxes, ha="center", va="center" if not rows else "bottom",
                fontsize=8, color="dimgrey", wrap=True)
    for x in (0, 100):
        ax.axvline(x, color="grey", lw=0.8, ls="--" if x else "-")
    ax.set_xlabel("share of the baseline's gap closed (%), 90% CI")
    ax.set_title((title or table.title) + "\nfilled: folds into this model's W_Q/W_K (or q/k norms); hatched: online "
                 "only", fontsize=9)
    out = save_png(fig, Path(path))
    plt.close(fig)
    return out


def is_gap_share_run(manifest: Mapping[str, Any]) -> bool:
    """A results directory written by ``compare --configs beyond2`` (its cells name the preset)."""
    from rope_quant.sweep.presets import FOLDABLE_R3_TAG

    return any((m or {}).get("preset") == FOLDABLE_R3_TAG for m in (manifest.get("meta") or {}).values())


def write_gap_share_report(results_dir: str | os.PathLike[str], *, comparator: str | None = None,
                           figures: bool = True, **report_options: Any) -> dict[str, Any]:
    """``compare --configs beyond2``'s report: :func:`~rope_quant.analysis.report.write_report`, then the gap-share
    table (``tables/gap-share.{csv,md}``) and, with ``figures``, ``figures/gap_share.png``."""
    from rope_quant.analysis.report import write_report
    from rope_quant.analysis.titles import describe
    from rope_quant.io import atomic_write_text

    root = Path(results_dir)
    rep = write_report(root, comparator=comparator, figures=figures, **report_options)
    table = gap_share_table(rep["summary"])
    if table is None:
        return rep
    files = list(rep["files"])
    for suffix, text in (("csv", table.csv()), ("md", table.markdown())):
        path = root / "tables" / f"gap-share.{suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
        files.append(str(path))
    if figures:
        title = describe(root).title() + "\nshare of pairwise_only's gap to the comparator that each R3 closes"
        files.append(str(plot_gap_share(table, root / "figures" / "gap_share.png", title=title)))
    return {**rep, "markdown": rep["markdown"].rstrip("\n") + "\n\n" + table.markdown(), "files": files}
