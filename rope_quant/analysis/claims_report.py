"""The claims table of a claims directory (``rope-quant claims``; read by ``report DIR`` and ``decide DIR``).

Each claim of the registry is decided by :func:`rope_quant.claims.engine.evaluate` over the directory's records
(:class:`~rope_quant.sweep.claim_store.DirectoryStore`) and written by the pytest plugin's writer, in its schema
(:mod:`rope_quant.claims_json`: ``DIR/claims.json``, ``DIR/claims.md``; docs/verdicts.md, "The claims JSON"): one
row per claim with the plugin's keys (``test`` and ``outcome`` are None: no pytest test ran) and the engine's
(``id``, ``section``, ``statement``, ``seeds``, ``rule``). The payload also names the model and its content
fingerprint, the protocol (seeds, windows, calibration tokens), the device (:func:`describe_run`, the keys the
plugin writes for a registry front's run: :data:`RUN_KEYS`, and ``runs``), the machine the cells ran on
(``DIR/env.json``) and the claims left out with the reason. A claim whose cell has no complete record reads
inconclusive, the missing cell and seed named.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rope_quant.claims.engine import ClaimResult
from rope_quant.claims.registry import Claim
from rope_quant.claims_json import (  # noqa: F401 (the names this module has always given)
    BUDGET_COLUMN,
    CLAIMS_JSON,
    CLAIMS_MD,
    CLAIMS_SCHEMA,
    COLUMNS,
    RUN_KEYS,
    claims_markdown,
)
from rope_quant.claims_json import write as write_claims  # noqa: F401 (the name this module has always given)
from rope_quant.io import json_text
from rope_quant.sweep.claims_decide import claim_seeds, evaluate

if TYPE_CHECKING:
    from rope_quant.sweep.claim_store import DirectoryStore

def evaluate_directory(store: DirectoryStore, claims: Sequence[Claim]) -> list[ClaimResult]:
    """Every claim at its seeds in the directory, by the fixed-n rule."""
    return [evaluate(c, store, claim_seeds(c, store)) for c in claims]


def row(result: ClaimResult, model: str | None, **extra: Any) -> dict[str, Any]:
    """A claims JSON row: the engine's row plus the plugin's ``test`` and ``outcome`` (None: no pytest test)."""
    out = result.to_dict(model=model)
    out.update(test=None, outcome=None)
    if result.claim.outside:
        out["outside"] = result.claim.outside
    out.update(extra)
    return json.loads(json_text(out))


def left_out_lines(left_out: Mapping[str, str]) -> list[str]:
    """One line per claim left out: ``left out: ID: reason``."""
    return [f"left out: {cid}: {why}" for cid, why in left_out.items()]


def _env(out: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((out / "env.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _fingerprint(run: Any) -> str | None:
    """The model's content hash: the manifest's ``model_id``, else computed from its files when they are here."""
    if getattr(run, "model_id", None):
        return str(run.model_id)
    try:
        from rope_quant.experiment.identity import model_identity

        return model_identity(run.model)
    except Exception:  # noqa: BLE001 - a model no longer on this machine: no fingerprint, not a failed report
        return None


#: How the claims JSON's model fingerprint is computed (both fronts write it).
FINGERPRINT_BASIS = "SHA-256 of the model files (rope_quant.experiment.identity)"
def describe_run(run: Any, seeds: Sequence[int], comparator: str, device: Mapping[str, Any] | None = None,
                 fingerprint: str | None = None, name: str = "rope-quant claims") -> dict[str, Any]:
    """The ``model`` (name, fingerprint of its files), ``protocol`` and ``device`` of a claims table whose cells are
    ``run`` (a ``RunConfig``: the comparator's) with each claim's overrides, at ``seeds``. ``device``: the device's
    description (``envinfo.device_description``); ``fingerprint``: the model's content hash when known (default:
    ``run.model_id``, else computed from the model's files when they are here); ``name``: where the protocol
    comes from (the claims sweep's flags, or a pytest front's protocol: ``paper``)."""
    evals = run.eval_windows
    return {
        "model": {"name": run.model, "fingerprint": fingerprint or _fingerprint(run),
                  "fingerprint_basis": FINGERPRINT_BASIS},
        "protocol": {"name": name, "seeds": [int(s) for s in seeds], "corpus": run.corpus, "corpus_id": run.corpus_id,
                     "seqlen": run.seqlen, "calib_windows": run.calib_windows,
                     "calibration_tokens": run.calib_windows * run.seqlen, "eval_windows": evals,
                     "eval_tokens": None if evals is None else evals * run.seqlen,
                     "bits": f"W{run.w_bits}A{run.a_bits}K{run.k_bits}V{run.v_bits}", "weights": str(run.weights),
                     "comparator": comparator, "dtype": str(run.dtype)},
        "device": {"requested": str(run.device), **(device or {})},
    }


def describe_directory(out: str | os.PathLike[str], store: DirectoryStore) -> dict[str, Any]:
    """The payload's ``model``, ``protocol``, ``device`` and ``machine`` of a claims directory."""
    from rope_quant.sweep.cellkind import run_of

    env = _env(Path(out))
    about = describe_run(run_of(store.comparator()), store.seeds(), store.manifest.comparator,
                         (env or {}).get("device"))
    return {**about, "machine": env}


def payload(out: str | os.PathLike[str], store: DirectoryStore, results: Sequence[ClaimResult],
            left_out: Mapping[str, str], source: str, row_extra: Mapping[str, Mapping[str, Any]] | None = None,
            **extra: Any) -> dict[str, Any]:
    """The claims JSON of a claims directory (the plugin's schema-2 payload plus its description); ``row_extra``:
    claim id → keys added to its row."""
    from rope_quant.sweep.cellkind import run_of

    about = describe_directory(out, store)
    model = run_of(store.comparator()).model
    rows = [row(r, model, **(row_extra or {}).get(r.id, {})) for r in results]
    return {"schema": CLAIMS_SCHEMA, "source": source, "claims": rows, "tables": {},
            **about, "runs": [{k: about[k] for k in RUN_KEYS}],
            "left_out": [{"id": cid, "reason": why} for cid, why in left_out.items()], **extra}

