"""``rope-quant models``: the embedded models and the per-machine model cache (location, clearing)."""

from __future__ import annotations

import argparse
from typing import Any

from rope_quant.cli.execute import Cells

HELP = "embedded models and the per-machine model cache (location, clearing)"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("models", help=HELP)
    p.add_argument("--clear-cache", action="store_true",
                   help="delete the model cache (assembled GGUFs, converted states); the next load rebuilds it")
    return p


def run(args: argparse.Namespace, cells: Cells) -> int:
    """List the embedded models and the model cache (``$ROPE_QUANT_MODEL_CACHE``); ``--clear-cache`` empties it."""
    from rope_quant.model import model_cache
    from rope_quant.model.loading import EMBEDDED_MODELS, INSTALL_HINT

    root = model_cache.cache_root()
    if args.clear_cache:
        removed = model_cache.clear_model_cache()
        print(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'} from {root}")
        return 0
    for name in EMBEDDED_MODELS:
        print(f"{name}: install with `{INSTALL_HINT[name]}`")
    entries = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
    size = sum(p.stat().st_size for p in entries)
    print(f"model cache {root} ({model_cache.CACHE_ENV}): {len(entries)} files, {size / 2 ** 20:.0f} MiB; "
          "clear it with `rope-quant models --clear-cache`")
    return 0
