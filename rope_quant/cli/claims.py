"""``rope-quant claims``: the paper's claims decided over one sweep directory, on any supported model.

The cells every chosen claim reads (its parts' treatment and control cells as config overrides on the
comparator, those a paired part reads each with its float-order replicate) at the seeds given become one manifest
(:mod:`rope_quant.sweep.claims_sweep`, study ``claims``), run through the one sweep path
(:func:`rope_quant.cli.execute.sweep`: resume, shards, cell claims, Slurm). C4's cells are scored on the support
windows (``--support-windows``), C7's at long context (``--long-windows`` windows per length on
``--long-corpus``), App. D's under the static control (``--static-windows``, ``--static-eval-windows``) and App. G's
on NIAH probes (``--niah-length``, ``--niah-probes``), as the pytest front scores them
(:mod:`rope_quant.sweep.claim_scoring`). Before any model loads
the plan is printed: the claims left out and why, the cells per claim, and the cost estimate of ``rope-quant plan``
(``--dry-run`` stops there). The end, and ``rope-quant report DIR`` later, write the claims table
(``DIR/claims.json``, ``DIR/claims.md``: :mod:`rope_quant.analysis.claims_report`).
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from rope_quant.cli.args import CLIError, parse_names, parse_seed_list
from rope_quant.cli.common import DEFAULT_SEEDS, base_config, check_comparator, checkpoint
from rope_quant.cli.execute import Cells, sweep
from rope_quant.cli.options import add_sweep
from rope_quant.sweep.claim_scoring import ScoringBudget

HELP = "the paper's claims: every claim's cells and float-order replicates as one sweep, then the claims table"
SOURCE = "rope-quant report"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from rope_quant.claims import registry

    ids = ", ".join(registry.active().ids())
    p = sub.add_parser("claims", help=HELP, description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--claims", default=None, metavar="ID,GROUP,...",
                   help=f"the claims to run, by id or group ({', '.join(registry.groups())}: every claim of the "
                        f"group; default: the {registry.PAPER} group's claims); ids: {ids}")
    defaults = ScoringBudget()
    p.add_argument("--support-windows", type=int, default=defaults.support_windows, metavar="N",
                   help=f"windows scored per cell of C4's block-size steps (Table M; default "
                        f"{defaults.support_windows}, as pytest's front)")
    p.add_argument("--long-windows", type=int, default=defaults.long_windows, metavar="N",
                   help=f"windows scored per length of C7's long-context cells (App. A.4; default "
                        f"{defaults.long_windows}, as pytest's front)")
    p.add_argument("--long-corpus", default=defaults.long_corpus, metavar="NAME",
                   help=f"the corpus C7's long-context cells score, its first 64 evaluation documents (App. A.4; "
                        f"default {defaults.long_corpus}, as pytest's front)")
    p.add_argument("--static-windows", type=int, default=defaults.static_windows, metavar="N",
                   help=f"App. D: windows the static scales are estimated on (A.6: up to 64; default "
                        f"{defaults.static_windows}, as pytest's front)")
    p.add_argument("--static-eval-windows", type=int, default=defaults.static_eval_windows, metavar="N",
                   help=f"App. D: windows scored per static cell (default {defaults.static_eval_windows}, as "
                        "pytest's front)")
    p.add_argument("--niah-length", type=int, default=defaults.niah_length, metavar="L",
                   help=f"App. G: the NIAH context length in tokens (default {defaults.niah_length}, as pytest's "
                        "front; the paper's lengths are 2K and longer)")
    p.add_argument("--niah-probes", type=int, default=defaults.niah_probes, metavar="N",
                   help=f"App. G: probes per needle depth, 5 depths (App. G: 20; default {defaults.niah_probes}, "
                        "as pytest's front)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the input, print the plan (claims left out, cells per claim, cost estimate) and stop: "
                        "nothing is run or written")
    return add_sweep(p)


def chosen_claims(text: str | None) -> list[Any]:
    """The claims named by ``--claims``: ids and group names (a group: every claim of it, in registration order),
    the paper's group by default (:func:`rope_quant.claims.selection.select`); an unknown name is refused."""
    from rope_quant.claims import registry, selection

    if text is None:
        return selection.select()
    return selection.select(parse_names(text, "claim", [*registry.active().ids(), *registry.groups()]))


def applicable(claims: Sequence[Any], model: Any, seq_len: int,
               requested: Collection[str] | None = None) -> tuple[list[Any], dict[str, str]]:
    """The claims that run on ``model`` (each as :func:`rope_quant.claims.premises.adapt` runs it there: a
    refused R1 becomes ``r1=identity``, named in its title; model-dependent values resolved; a claim at equal
    bits per key element checked at T = ``seq_len``, the evaluation windows' length), and claim id → why the
    others are left out: their cells are scored where this sweep cannot (llama.cpp), or the model lacks a
    premise. Read from the model's
    config alone (``model``: its name, or its :class:`~rope_quant.claims.premises.ModelFacts` already read); a
    config that cannot be read is left to the model checks. Unequal bits of a ``requested`` claim (default: every
    claim) stop the run (:class:`CLIError` naming the cells and their bits); any other claim they leave out with
    that reason, so a claim nobody asked for never stops the table of those asked for."""
    from rope_quant.claims import selection
    from rope_quant.claims.premises import read_checkpoint
    from rope_quant.claims.registry import ClaimError

    facts = read_checkpoint(model) if isinstance(model, str) else model
    try:
        table = selection.table(claims, facts, seq_len, plain_only=True, requested=requested)
    except ClaimError as exc:
        raise CLIError(str(exc)) from None
    kept = [got for got in table.values() if not isinstance(got, selection.LeftOut)]
    return kept, {cid: str(why) for cid, why in table.items() if isinstance(why, selection.LeftOut)}


def directory_claims(store: Any, facts: Any = None) -> tuple[list[Any], dict[str, str]]:
    """The claims a claims directory's table reads: every registered claim whose cells its manifest plans (a planned
    cell not yet computed reads inconclusive, naming it), adapted to its model at its evaluation windows' T; claim
    id → why the others are left out (a premise the model lacks, a claim that cannot be adapted to it; a claim of
    the paper the sweep did not plan). Only the claims the sweep was asked for (:func:`requested_claims`) can stop
    the table. ``facts``: the model's :class:`~rope_quant.claims.premises.ModelFacts` where the caller has read
    them."""
    from rope_quant.claims import registry
    from rope_quant.sweep.cellkind import run_of
    from rope_quant.sweep.claims_decide import planned_claims
    from rope_quant.sweep.claims_sweep import requested_claims

    comparator = run_of(store.comparator())
    model = facts if facts is not None and facts.name == str(comparator.model) else comparator.model
    kept, dropped = applicable(registry.claims(), model, comparator.budget.seqlen, requested_claims(store.manifest))
    planned, absent = planned_claims(store, kept)
    for claim in absent:
        if claim.group == registry.PAPER:  # the opt-in groups (beyond the paper, keys) are not listed
            dropped[claim.id] = (f"not in this directory (its cells or their float-order replicates are not in "
                                 f"the manifest): `rope-quant claims "
                                 f"--claims {claim.id}` into it adds them")
    return planned, dropped


def _nearest_r1(args: argparse.Namespace) -> None:
    """R1 = identity where the architecture refuses R1 and ``--r1`` is not given: the claims' nearest protocol
    (:mod:`rope_quant.claims.premises`, as pytest's front runs them; each row names the deviation)."""
    if args.r1 is None and (reason := checkpoint(args).r1_refusal) is not None:
        args.r1 = "identity"
        print(f"note: R1 set to identity for {args.model}, the claims' nearest protocol (R2, R4 and the online R3 "
              f"unchanged; each row names the deviation): {reason}", flush=True)


def _seed_count(args: argparse.Namespace) -> None:
    seeds = DEFAULT_SEEDS if args.seeds is None else parse_seed_list(args.seeds)
    if len(seeds) < 2:
        raise CLIError(f"--seeds {args.seeds}: the claims need at least 2 seeds (a paired interval needs two); "
                       "e.g. --seeds 0,1,2")


def cost_lines(args: argparse.Namespace, manifest: Any) -> list[str]:
    """The cost estimate of ``rope-quant plan`` for this sweep (:func:`rope_quant.claims.selection.cost_plan`, as
    pytest's registry fronts make it): one plan seed per weight build, the short-context cells as its evaluations,
    each long-context cell at its length (``--long-windows`` windows; config only, no weights); a line saying why
    when the plan cannot model it."""
    from rope_quant.claims.registry import Scoring
    from rope_quant.claims.selection import CellConfig, cost_plan
    from rope_quant.planning.plan import format_plan
    from rope_quant.sweep.cellkind import run_of
    from rope_quant.sweep.claim_scoring import long_length

    # a static or NIAH cell is priced as a short-context cell of its run (its scale estimation and generated
    # answers are not modelled by the plan)
    configs = [CellConfig(name, run_of(cfg), scoring=Scoring.EVAL if long_length(cfg) is None else Scoring.LONG,
                          length=long_length(cfg)) for name, cfg in manifest.cells]
    try:
        cost = cost_plan(run_of(manifest.cells[0][1]), configs, device=args.device, dtype=args.dtype,
                         whip_epochs=args.whip_epochs, long_windows=args.long_windows,
                         offload=args.offload == "cpu", config=checkpoint(args).config)
    except Exception as exc:  # noqa: BLE001 - an estimate the plan cannot make must not stop the run
        return [f"cost estimate: none ({type(exc).__name__}: {exc})"]
    lengths = sorted({c.length for c in configs if c.length})
    long = (f", {sum(1 for c in configs if c.length)} long-context cells at L = {', '.join(map(str, lengths))}"
            if lengths else "")
    return [f"cost estimate (`rope-quant plan`, {cost.builds} weight builds (seed × bits × float order) as its "
            f"seeds, ≤ {cost.plan.protocol.configs} short-context cells each as its configs{long}):",
            format_plan(cost.plan)]


def print_plan(args: argparse.Namespace, manifest: Any, claims: Sequence[Any], seeds: Sequence[int],
               dropped: Mapping[str, str]) -> None:
    """The plan on stdout, before any model loads: claims left out, cells per claim, totals and the cost."""
    from rope_quant.analysis.claims_report import left_out_lines
    from rope_quant.io import markdown_table
    from rope_quant.sweep.claims_sweep import cells_per_claim, comparator_at
    from rope_quant.sweep.decide import REPLICATE_SUFFIX

    for line in left_out_lines(dropped):
        print(line, flush=True)
    per_claim = cells_per_claim(claims, comparator_at(manifest.cells[0][1], seeds[0], args.comparator),
                                ScoringBudget.from_meta(manifest.meta))
    rows = [{"claim": c.id, "cells per seed": ", ".join(per_claim[c.id])} for c in claims]
    print(f"claims plan: {len(claims)} claims at seeds {','.join(map(str, seeds))} on {args.model} (every cell "
          f"the comparator {args.comparator}'s config with the claim's overrides)", flush=True)
    print(markdown_table(rows, ["claim", "cells per seed"]), flush=True)
    reps = sum(name.endswith(REPLICATE_SUFFIX) for name, _ in manifest.cells)
    print(f"cells: {len(manifest)} in all ({len(manifest) // len(seeds)} per seed), {reps} of them float-order "
          "replicates (GPTQ rebuilt in the other float mode)", flush=True)
    if reps == 0:
        print("note: no float-order replicate (the weights are not GPTQ): every paired part will read "
              "inconclusive; --weights gptq gives each cell its replicate", flush=True)
    for line in cost_lines(args, manifest):
        print(line, flush=True)


def write_report(out: str | Path, facts: Any = None) -> dict[str, Any]:
    """The claims table of claims directory ``out``: every registered claim read over its records (fixed-n),
    written to DIR/claims.json and DIR/claims.md; ``{"markdown", "files"}`` as the sweep path prints them.
    ``facts``: its model's facts where the caller has read them (:func:`directory_claims`)."""
    from rope_quant.analysis import claims_report as cr
    from rope_quant.sweep.claim_store import DirectoryStore

    store = DirectoryStore(out)
    kept, dropped = directory_claims(store, facts)
    results = cr.evaluate_directory(store, kept)
    data = cr.payload(out, store, results, dropped, SOURCE)
    files = cr.write_claims(out, data)
    lines = [cr.claims_markdown(data["claims"]), "", *cr.left_out_lines(dropped)]
    if (Path(out) / "decisions.json").is_file():
        lines.append(f"this table reads the fixed-n rule at every seed present; the sequential decisions of "
                     f"`rope-quant decide` are in {Path(out) / 'decisions.json'}")
    return {"markdown": "\n".join(lines), "files": files}


def scoring_budget(args: argparse.Namespace, claims: Sequence[Any]) -> ScoringBudget:
    """The sizes of the support, long-context, static and NIAH cells from the flags (a bad one: :class:`CLIError`);
    the long corpus is checked only where a chosen claim scores at long context."""
    from rope_quant.claims.registry import Scoring, scoring_of
    from rope_quant.cli.validate import check_corpus
    from rope_quant.sweep.cellkind import SweepError

    sizes = {"--support-windows": args.support_windows, "--long-windows": args.long_windows,
             "--static-windows": args.static_windows, "--static-eval-windows": args.static_eval_windows,
             "--niah-length": args.niah_length, "--niah-probes": args.niah_probes}
    for flag_name, value in sizes.items():
        if value < 1 or (flag_name == "--niah-length" and value < 16):
            raise CLIError(f"{flag_name} must be an integer >= {16 if flag_name == '--niah-length' else 1}, "
                           f"got {value}")
    if any(scoring_of(c.cells[n]) is Scoring.LONG for c in claims for n in c.cell_names()):
        check_corpus(args.long_corpus)
    try:
        return ScoringBudget(args.support_windows, args.long_windows, args.long_corpus,
                             static_windows=args.static_windows, static_eval_windows=args.static_eval_windows,
                             niah_length=args.niah_length, niah_probes=args.niah_probes)
    except SweepError as exc:
        raise CLIError(str(exc)) from None


def run(args: argparse.Namespace, cells: Cells) -> int:
    from rope_quant.sweep.claims_sweep import claims_manifest

    chosen = chosen_claims(args.claims)  # an unknown id: exit 2 before anything else
    scoring = scoring_budget(args, chosen)
    _seed_count(args)
    check_comparator(args.comparator, ())
    defaulted = args.weights is None
    if defaulted:  # the rule reads each cell's float-order replicate: only GPTQ weights have one
        args.weights = "gptq"
    _nearest_r1(args)

    def build(args: argparse.Namespace, seeds: tuple[int, ...], used: list[str]) -> Any:
        if defaulted:
            used.append("weights=gptq (the claims' default on every device: the float-order replicate is GPTQ's)")
        base = base_config(args)
        kept, dropped = applicable(chosen, checkpoint(args), base.budget.seqlen)
        if not kept:
            raise CLIError(f"no claim left to run on {args.model}: "
                           + "; ".join(f"{cid}: {why}" for cid, why in dropped.items()))
        manifest = claims_manifest(base, kept, seeds, comparator=args.comparator, scoring=scoring)
        print_plan(args, manifest, kept, seeds, dropped)
        return manifest

    return sweep(args, cells, build, lambda out: write_report(out, checkpoint(args)))
