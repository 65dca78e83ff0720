"""What every command resolves from its flags before anything expensive: names, bits, budget, R1, the config.

Policy lives below (budgets in :mod:`rope_quant.sweep.presets`, the R1 rule in :mod:`rope_quant.model.arch`,
input checks in :mod:`rope_quant.sweep.preflight`); this module maps flags onto it and errors onto flags.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from rope_quant.cli.args import CLIError, check_name, flag, parse_names, parse_seed_list, unknown_name
from rope_quant.cli.options import KEY_QUANT_FLAGS

DEFAULT_CONFIGS = ("hadamard", "pairwise_only", "pairwise_plus_hadamard", "identity")
DEFAULT_SEEDS = (0, 1, 2)
#: Flat config fields that have a flag of the same name: errors from below name the flag instead.
FLAGGED_FIELDS = ("whip_epochs", "calib_windows", "eval_windows", "average_length", "seqlen", "w_bits", "a_bits",
                  "k_bits", "v_bits", "r3_block", "k_quant", "k_token_group", "k_residual", "k_sinks", "k_min_bits",
                  "k_max_bits", "k_avg_bits")


def flags_for_fields(message: str, fields: tuple[str, ...] = FLAGGED_FIELDS) -> str:
    """``"whip_epochs must be >= 1"`` -> ``"--whip-epochs must be >= 1"`` (config errors name the flag); ``fields``:
    the field names that have a flag of the same name."""
    names = "|".join(fields)
    return re.sub(rf"(?<![-\w])({names})(?!\w)",
                  lambda m: "--block" if m.group(1) == "r3_block" else flag(m.group(1)), message)


def valid_configs() -> list[str]:
    """R3 registry names (``transforms.names()``)."""
    from rope_quant.core import transforms

    return list(transforms.names())


def parse_configs(text: str) -> tuple[str, ...]:
    """R3 names for compare / long-context; block transforms need ``support`` (they take a block size)."""
    from rope_quant.core import transforms

    configs = parse_names(text, "config", valid_configs())
    blocky = [c for c in configs if transforms.needs_block(c)]
    if blocky:
        raise CLIError(f"{', '.join(blocky)} need a block size: use `rope-quant support --transform NAME` "
                       "or `rope-quant run --config NAME --block b`")
    return configs


def parse_configs_or_preset(text: str, command: str) -> tuple[tuple[str, ...], str | None]:
    """``(configs, None)`` or ``((), preset)``; unknown names are refused with the closest R3 names or presets
    (the preset names come from :data:`rope_quant.sweep.presets.COMMAND_PRESETS`)."""
    from rope_quant.sweep.presets import COMMAND_PRESETS, PRESET_ALIASES, preset_named

    presets = COMMAND_PRESETS.get(command, ())
    preset = preset_named(text.strip(), command)
    if preset is not None:
        return (), preset
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in valid_configs()]
    if unknown:
        old = [o for o, p in PRESET_ALIASES.items() if p in presets]
        err = unknown_name("config", unknown[0], valid_configs() + list(presets) + old)
        listed = f" (presets: {', '.join(presets)}; earlier names: {', '.join(old)})" if old else ""
        raise CLIError(f"{err}{listed}" if presets else str(err))
    return parse_configs(text), None


def check_comparator(comparator: str, configs: tuple[str, ...] | list[str]) -> None:
    """``--comparator`` must name an R3 config; a known one outside ``configs`` gets a note (no paired stats)."""
    names = list(dict.fromkeys([*configs, *valid_configs()]))
    check_name(comparator, "--comparator", names)
    if configs and comparator not in configs:
        print(f"note: comparator {comparator!r} is not among --configs: no paired statistics", file=sys.stderr)


def seeds(args: argparse.Namespace, used: list[str]) -> tuple[int, ...]:
    """``--seeds`` (the :mod:`rope_quant.seeds` grammar), else the default, recorded in ``used``."""
    if args.seeds is None:
        used.append("seeds=" + ",".join(map(str, DEFAULT_SEEDS)))
        return DEFAULT_SEEDS
    return parse_seed_list(args.seeds)


def resolve_budget(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """seqlen, windows, weights and w_mse from the flags or the device defaults; lists the defaults used."""
    from rope_quant.quant.quantizers import OFF_BITS
    from rope_quant.sweep.presets import BUDGET_FIELDS, BudgetError
    from rope_quant.sweep.presets import resolve_budget as resolve

    try:
        budget, used = resolve(args.device, {f: getattr(args, f) for f in BUDGET_FIELDS})
    except BudgetError as exc:
        raise CLIError(flag(exc.field) + str(exc)[len(exc.field):]) from None
    if args.w_bits >= OFF_BITS:  # unquantised weights: the weight quantiser's defaults are not used
        used = [u for u in used if not u.startswith(("weights=", "w_mse="))]
    return budget, used


def resolve_r1(model: str, requested: str | None, a_bits: int) -> str:
    """The R1 to use (:func:`rope_quant.rotations.r1_choice.choose_r1`); a changed default is explained on stdout, a
    refusal is a :class:`CLIError` naming the sandwich norms and the alternatives."""
    from rope_quant.quant.quantizers import OFF_BITS

    if requested == "identity":
        return requested
    from rope_quant.rotations.r1_choice import choose_r1

    try:
        choice = choose_r1(model, r1_refusal(model), requested, a_bits, off_bits=OFF_BITS)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if choice.note:
        print(f"note: {choice.note}", flush=True)  # stdout: it explains the run's R1 next to its settings
    return choice.r1


def r1_refusal(model: str) -> str | None:
    """Why the model's architecture refuses R1 (from its config alone), or None."""
    from types import SimpleNamespace

    from rope_quant.model import arch
    from rope_quant.model.loading import ModelLoadError, load_config

    try:
        return arch.rotation_refusal(SimpleNamespace(config=load_config(model)), "r1")
    except (ModelLoadError, arch.ArchitectureError):
        return None  # reported by the pipeline's own checks


def head_dim(model: str) -> int:
    """head_dim of a model from its config alone (no weights loaded)."""
    from types import SimpleNamespace

    from rope_quant.model import arch
    from rope_quant.model.loading import ModelLoadError, load_config

    try:
        return arch.dims(SimpleNamespace(config=load_config(model))).head_dim
    except (ModelLoadError, arch.UnsupportedModelTypeError, arch.ModelStructureError) as exc:
        raise CLIError(f"model {model}: {exc}") from exc


def check_key_quant(cfg: Any, model: str) -> None:
    """What the key quantiser's parameters need of the model's geometry, from its config alone (rope_pair_bits:
    integer widths over head_dim/2 pairs averaging the target); a :class:`PipelineError` names the field."""
    from rope_quant.experiment.config import PipelineError
    from rope_quant.quant.keys import KeyQuantError

    option = cfg.quant.key_option()
    check = getattr(option, "check_head_dim", None)
    if check is None:
        return
    try:
        check(head_dim(model))
    except KeyQuantError as exc:
        raise PipelineError(str(exc)) from None


def base_config(args: argparse.Namespace, **overrides: Any) -> Any:
    """The ``RunConfig`` shared by every cell of the command (seed and R3 set per cell; flat names)."""
    import dataclasses

    from rope_quant.experiment import config
    from rope_quant.quant.rtn import GPTQConfig

    budget, _ = resolve_budget(args)
    w_mse = budget.pop("w_mse")
    fields = dict(model=args.model, corpus=args.corpus, w_bits=args.w_bits, a_bits=args.a_bits,
                  k_bits=args.k_bits, v_bits=args.v_bits, estimator=args.estimator, objective=args.objective,
                  angle=args.angle, r1=args.r1 or config.RotationKind.WHIP.value, r2=args.r2,
                  r4=getattr(args, "r4", True),
                  **({} if args.whip_epochs is None else {"whip_epochs": args.whip_epochs}),
                  device=args.device, dtype=args.dtype, gptq=dataclasses.replace(GPTQConfig(), mse=bool(w_mse)),
                  **budget)
    fields.update({name: getattr(args, name) for name in KEY_QUANT_FLAGS if getattr(args, name, None) is not None})
    fields.update(overrides)
    try:
        cfg = config.RunConfig.from_flat(**fields)
        check_key_quant(cfg, args.model)
    except config.PipelineError as exc:
        raise CLIError(flags_for_fields(str(exc))) from None
    from rope_quant.experiment.identity import resolve_identity

    return resolve_identity(cfg)  # keys follow the model's and the corpus's content, not their names
