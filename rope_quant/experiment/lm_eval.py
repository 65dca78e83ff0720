"""lm-evaluation-harness as a client of a quantised model (optional extra ``[eval]``).

:func:`quantized_lm` builds the quantised model of a ``RunConfig`` and wraps the built instance in
lm-eval's ``HFLM`` (``pretrained=`` the model object, ``tokenizer=`` its tokenizer); :func:`as_hflm` wraps
any built model; :func:`evaluate_tasks` runs lm-eval tasks on it, offline, and returns plain JSON-able
metrics and per-document scores.

How lm-eval reaches the model (lm-eval 0.4.x ``HFLM``): every request type that scores log-likelihoods
(``loglikelihood``, ``loglikelihood_rolling``, ``multiple_choice``) ends in ``HFLM._model_call``, i.e.
``model(input_ids).logits`` -- the model's own ``forward``. That forward dispatches attention through
``config._attn_implementation``, which :func:`rope_quant.rotations.attention.install_attention` set to
``rq_sdpa``: R3 and the K/V quantisers run in every layer. The activation quantisers (and the online R4) are
forward pre-hooks on the decoder linears, which a module call always runs. Given an instance, ``HFLM``
neither reloads, re-casts nor changes the attention implementation of the model (it only reads its
``device`` and ``config``). ``generate_until`` goes through ``model.generate`` with a KV cache; the
attention function re-applies R3 and the per-token quantiser to the whole (unquantised) cache at each step,
which equals quantising each token once (see :mod:`rope_quant.rotations.attention`).

Padding: ``HFLM`` right-pads a batch of log-likelihood requests under the causal mask, and our quantisers are
token-local (per token, per head), so a request's scores do not depend on its batch-mates (up to float
summation order); ``batch_size=1`` removes even that.

Nothing is downloaded: ``HF_DATASETS_OFFLINE`` and ``HF_HUB_OFFLINE`` are set before lm-eval (and
``datasets``) are imported; tasks read the local datasets cache or local files (``dataset_path: json`` with
``dataset_kwargs: {data_files: ...}``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

INSTALL_HINT = 'pip install -e ".[eval]"'
#: Log-likelihood request types: the ones whose scores the quantised forward must produce.
LOGLIKELIHOOD_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice")
OFFLINE_VARS = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


class LmEvalError(RuntimeError):
    """lm-eval is missing, or a task could not be run as asked."""


class LmEvalMissingError(LmEvalError, ImportError):
    """lm-evaluation-harness is not installed."""


def set_offline() -> None:
    """Force offline mode for the Hugging Face hub and datasets (env vars and, if imported, their configs)."""
    for var in OFFLINE_VARS:
        os.environ[var] = "1"
    import sys

    config = getattr(sys.modules.get("datasets"), "config", None)
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        if config is not None and hasattr(config, name):
            setattr(config, name, True)


def require_lm_eval() -> Any:
    """Import ``lm_eval`` offline, or raise :class:`LmEvalMissingError` naming the install line."""
    set_offline()
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401  (fails early on a broken install)
    except ImportError as exc:
        raise LmEvalMissingError(
            f"lm-evaluation-harness is not installed ({exc}); install the extra: {INSTALL_HINT}"
        ) from exc
    set_offline()  # datasets is imported by now: set its module-level flags too
    return lm_eval


def as_hflm(model: Any, tokenizer: Any, *, batch_size: int = 1, max_length: int | None = None,
            add_bos_token: bool = False, prefix_token_id: int | None = None) -> Any:
    """Wrap a built causal LM instance (and its tokenizer) as lm-eval's ``HFLM``.

    ``add_bos_token=False``: documents are tokenised without special tokens; lm-eval prepends its prefix
    token (``prefix_token_id``, default the tokenizer's BOS, else EOS) to the first rolling window and to
    empty contexts. ``max_length`` bounds a rolling window (default: the model's ``max_position_embeddings``).
    """
    require_lm_eval()
    from lm_eval.models.huggingface import HFLM

    model.eval()
    return HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
                max_length=max_length, add_bos_token=add_bos_token, prefix_token_id=prefix_token_id)


def quantized_lm(cfg: Any, *, cache_dir: str | os.PathLike[str] | None = None, base: tuple[Any, Any] | None = None,
                 corpus: Any = None, progress: bool = False, **hflm_kwargs: Any) -> tuple[Any, Any]:
    """Build the quantised model of ``cfg`` (a ``pipeline.RunConfig``) and hand it to lm-eval.

    Returns ``(hflm, qm)``: lm-eval's ``HFLM`` over ``qm.model`` / ``qm.tokenizer`` and the
    :class:`~rope_quant.experiment.pipeline.QuantizedModel` (keep it: it owns the hooks and R3 state).
    ``hflm_kwargs`` go to :func:`as_hflm`.
    """
    require_lm_eval()
    from rope_quant.experiment import pipeline

    qm = pipeline.build_quantized_model(cfg, cache_dir=cache_dir, base=base, corpus=corpus, progress=progress)
    return as_hflm(qm.model, qm.tokenizer, **hflm_kwargs), qm


def task_manager(include_path: str | os.PathLike[str] | Sequence[str] | None = None, *,
                 include_defaults: bool = True) -> Any:
    """lm-eval's ``TaskManager`` over the built-in tasks and/or local task YAMLs in ``include_path``."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if isinstance(include_path, (str, os.PathLike)):
        include_path = [str(include_path)]
    paths = [str(p) for p in include_path] if include_path else None
    if not include_defaults and not paths:
        raise LmEvalError("include_defaults=False needs an include_path with task YAMLs")
    return TaskManager(include_path=paths, include_defaults=include_defaults)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(float(value)) else None


def _metric_name(key: str) -> str:
    """lm-eval reports ``"acc,none"``; the filter suffix is dropped."""
    return key.split(",", 1)[0]


def _sample_score(sample: Mapping[str, Any], output_type: str | None) -> dict[str, Any]:
    """What one logged sample scored: its per-document metrics and, for rolling tasks, the log-likelihood."""
    out: dict[str, Any] = {"doc_id": sample.get("doc_id")}
    for key, value in sample.items():
        if key in ("acc", "acc_norm", "exact_match"):
            num = _number(value)
            if num is not None:
                out[key] = num
    if output_type == "loglikelihood_rolling":
        resp = sample.get("filtered_resps")
        while isinstance(resp, (list, tuple)) and resp:
            resp = resp[0]
        num = _number(resp)
        if num is not None:
            out["loglikelihood"] = num
    return out


def evaluate_tasks(lm: Any, tasks: Sequence[str], *, manager: Any = None,
                   include_path: str | os.PathLike[str] | None = None, limit: int | float | None = None,
                   num_fewshot: int | None = None, log_samples: bool = True,
                   fewshot_seed: int = 1234) -> dict[str, Any]:
    """Run lm-eval ``tasks`` on ``lm`` (an ``HFLM``) offline; a JSON-able dict.

    ``{"tasks": {task: {metric: value}}, "output_types": {task: type}, "samples": {task: [{doc_id,
    acc?, acc_norm?, loglikelihood?}]}, "n_samples": {task: n}, "lm_eval_version": str}``. Metric keys drop
    lm-eval's filter suffix (``"acc,none"`` -> ``"acc"``); stderr entries end in ``_stderr``. Few-shot
    examples are drawn with the fixed ``fewshot_seed``, so every configuration sees the same prompts.
    """
    lm_eval = require_lm_eval()
    from lm_eval import evaluator

    if manager is None:
        manager = task_manager(include_path)
    res = evaluator.simple_evaluate(
        model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, task_manager=manager,
        log_samples=log_samples, bootstrap_iters=0, random_seed=0, numpy_random_seed=fewshot_seed,
        torch_random_seed=fewshot_seed, fewshot_random_seed=fewshot_seed,
    )
    if res is None:  # non-zero ranks under accelerate
        raise LmEvalError("lm-eval returned no results (not the main process?)")
    configs = res.get("configs", {})
    metrics: dict[str, dict[str, float]] = {}
    for task, values in res.get("results", {}).items():
        entry = {}
        for key, value in values.items():
            num = _number(value)
            if key != "alias" and num is not None:
                entry[_metric_name(key)] = num
        metrics[task] = entry
    output_types = {task: cfg.get("output_type") for task, cfg in configs.items()}
    samples = {task: [_sample_score(s, output_types.get(task)) for s in items]
               for task, items in (res.get("samples") or {}).items()}
    n_samples = {task: int(v.get("effective", v.get("original", 0))) if isinstance(v, Mapping) else int(v)
                 for task, v in (res.get("n-samples") or {}).items()}
    return {"tasks": metrics, "output_types": output_types, "samples": samples, "n_samples": n_samples,
            "lm_eval_version": getattr(lm_eval, "__version__", "unknown")}
