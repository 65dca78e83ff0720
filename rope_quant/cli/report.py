"""``rope-quant report`` (tables and figures of a results directory) and ``verify`` (φ* artefacts, App. A.5)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rope_quant.cli.args import CLIError
from rope_quant.cli.execute import Cells

HELP = {"report": "tables and figures from a results directory",
        "verify": "verify φ* from the artefacts of a results directory"}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("report", help=HELP["report"])
    p.add_argument("dir", metavar="DIR", help="results directory")
    p.add_argument("--check", action="store_true", help="only check completion (exit 1 if incomplete)")
    p.add_argument("--comparator", default=None, help="comparator config (default: the manifest's)")
    p.add_argument("--family", default=None, metavar="A,B,...", help="Holm family (default: manifest's)")
    p.add_argument("--level", type=float, default=0.90, help="paired CI level (default 0.90)")
    p.add_argument("--no-figures", dest="figures", action="store_false", help="skip the PNG figures")
    from rope_quant.analysis.reproduce import add_against_argument

    add_against_argument(p)  # --against OTHER: the reproducibility report (DIR may then be a claims JSON too)
    return p


def add_verify_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("verify", help=HELP["verify"])
    p.add_argument("dir", metavar="DIR", help="results directory")
    p.add_argument("--all", action="store_true",
                   help="also check φ̂ cells (averaging length = seqlen); default: φ* cells only")
    p.add_argument("--tol", type=float, default=None, help="relative excess tolerance (default 5e-5)")
    return p


def read_manifest(out: Path) -> dict[str, Any]:
    """``DIR/manifest.json``, or a :class:`CLIError` with the advice ``compare`` gives for a damaged one."""
    from rope_quant.sweep.manifest import MANIFEST_FILE, ManifestNotFoundError
    from rope_quant.sweep.manifest import read_manifest as read

    try:
        data = read(out)
    except ManifestNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CLIError(f"{out / MANIFEST_FILE} cannot be read ({exc}); rerun the sweep command that wrote it with "
                       "--force-new-manifest to replace it") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise CLIError(f"{out / MANIFEST_FILE} is not a sweep manifest (no cell list); rerun the sweep command "
                       "that wrote it with --force-new-manifest to replace it")
    return data


def run(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.analysis import report
    from rope_quant.sweep.records import status

    if args.against is not None:
        from rope_quant.analysis.reproduce import run_against

        return run_against(args.dir, args.against)
    out = Path(args.dir)
    if not 0 < args.level < 1:
        raise CLIError(f"--level must lie in (0, 1), got {args.level}")
    manifest = read_manifest(out)
    st = status(out)
    print(st.summary())
    if args.check:
        return 0 if st.done else 1
    from rope_quant.sweep.claims_sweep import is_claims_study
    from rope_quant.sweep.manifest import study_of

    if is_claims_study(study_of(manifest)):  # a `rope-quant claims` directory: the claims table
        from rope_quant.cli.claims import write_report

        rep = write_report(out)
        print(rep["markdown"])
        print("wrote " + ", ".join(str(Path(f).relative_to(out)) for f in rep["files"]))
        return 0
    family = None
    if args.family is not None:
        family = [s.strip() for s in args.family.split(",") if s.strip()]
    from rope_quant.analysis.gap_share import is_gap_share_run, write_gap_share_report

    write = write_gap_share_report if is_gap_share_run(manifest) else report.write_report  # beyond2: + gap share
    rep = write(out, comparator=args.comparator, family=family, level=args.level, figures=args.figures)
    print(rep["markdown"])
    print("wrote " + ", ".join(str(Path(f).relative_to(out)) for f in rep["files"]))
    from rope_quant.analysis.kind_reports import ReportOptions, write_kind_reports

    for part in write_kind_reports(out, ReportOptions(level=args.level, figures=args.figures)):  # static, NIAH
        print(part.markdown)
    return 0


def run_verify(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.calib import verify
    from rope_quant.io import atomic_write_json, markdown_table
    from rope_quant.sweep.manifest import ARTIFACTS_DIR, config_from_dict, run_of
    from rope_quant.sweep.records import is_complete

    out = Path(args.dir)
    data = read_manifest(out)
    rows, checked = [], 0
    for entry in data["cells"]:
        cfg = run_of(config_from_dict(entry["config"]))  # nested, or the flat form of older directories
        if not (cfg.position_average or args.all):
            continue
        art = out / ARTIFACTS_DIR / entry["key"]
        if not is_complete(out / entry["path"], entry["key"]):  # the runner's and report's predicate
            rows.append({"config": entry["name"], "seed": entry["seed"], "verified": None,
                         "worst_excess": None, "note": "cell not complete"})
            continue
        if not (art / "angles.npy").is_file():
            rows.append({"config": entry["name"], "seed": entry["seed"], "verified": None,
                         "worst_excess": None, "note": "no artefacts (cell not run?)"})
            continue
        length = cfg.average_length or cfg.seqlen
        dest = out / "verify" / entry["name"] / f"seed{entry['seed']}"
        kwargs = {"tol": args.tol} if args.tol is not None else {}
        result = verify.verify_files(art / "angles.npy", art / "stats.npz", art / "frequencies.json", length,
                                     dest, rule=cfg.estimator.value, **kwargs)
        checked += 1
        rows.append({"config": entry["name"], "seed": entry["seed"], "verified": result.verified,
                     "worst_excess": result.summary["worst_excess"], "average_length": length,
                     "artefacts": str(dest)})
    if not rows:
        raise CLIError(f"{out} has no φ* cells (use `rope-quant estimators --phi-star` or "
                       "`rope-quant run --phi-star`, or --all for φ̂ cells)")
    atomic_write_json(out / "verify" / "verify_summary.json", {"cells": rows})
    shown = [{"config": r["config"], "seed": r["seed"],
              "verdict": r.get("note") or ("yes" if r["verified"] else "no"),
              "excess": "–" if r["worst_excess"] is None else f"{r['worst_excess']:.3g}"} for r in rows]
    print(markdown_table(shown, ("config", "seed", "verdict", "excess"),
                         ("config", "seed", "φ* verified", "worst relative excess")))
    print(f"{checked} cells checked; artefacts under {out / 'verify'}")
    return 0 if checked and all(r["verified"] for r in rows) else 1
