"""Perplexity of a GGUF model scored by llama.cpp (llama-cpp-python), with its K cache type and its online K rotation.

llama.cpp's KV cache rotates Q and K with a Sylvester Hadamard after RoPE whenever the K cache is quantised and the
head dimension is a multiple of 64 (``attn_rot_k`` in its ``src/llama-kv-cache.cpp``): the paper's ``hadamard`` R3
(§3), online, in a deployed runtime. ``LLAMA_ATTN_ROT_DISABLE=1``, read when a context is created, turns it off;
:func:`score_windows` sets it around the context's creation only and restores the environment after.

:func:`score_windows` is the one scoring function (a store calls it per cell): a GGUF path, token windows (the
evaluator's own, :func:`rope_quant.scoring.evaluate.eval_windows`), the K cache type, the rotation flag and
the thread count in; each window's NLL sum (nats, float64) and its number of scored predictions (``L - 1``) out.
The NLL is computed here from llama.cpp's logits (``llm.scores``), not by llama.cpp's perplexity tool, so it
scores exactly the predictions :func:`rope_quant.scoring.evaluate.perplexity` scores. V stays at f16.

Every check that needs no model runs first: the windows, the file, the head dimension against the rotation,
and whether llama-cpp-python is installed (the error names the ``[llamacpp]`` extra and its build flags).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "KCacheType",
    "LlamaCppError",
    "LlamaCppMissingError",
    "RotationSkippedError",
    "WindowScores",
    "INSTALL_LINE",
    "ROTATION_ENV",
    "ROTATION_MULTIPLE",
    "require",
    "gguf_geometry",
    "check_rotation",
    "rotation_env",
    "open_model",
    "score_windows",
]

#: llama.cpp's switch: set to 1 when a context is created, the K (and V) rotation is off for that context.
ROTATION_ENV = "LLAMA_ATTN_ROT_DISABLE"
#: The runtime rotates K only where the head dimension is a multiple of this (its Hadamard's smallest size).
ROTATION_MULTIPLE = 64
#: The build flags that run on our Xeon VMs (which advertise AMX; a native build dies with "Illegal instruction")
#: and on the AMD machines.
CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF "
              "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")
INSTALL_LINE = f'CMAKE_ARGS="{CMAKE_ARGS}" pip install "rope-quant[llamacpp]"'


class LlamaCppError(ValueError):
    """Bad input to a llama.cpp scoring (the message names the window, the file or the setting)."""


class LlamaCppMissingError(ImportError):
    """llama-cpp-python is not installed (the message names the extra and the install line)."""


class RotationSkippedError(LlamaCppError):
    """The runtime rotation was requested where llama.cpp skips it (head dimension not a multiple of 64)."""


class KCacheType(StrEnum):
    """The K cache types scored here (llama.cpp's ``-ctk``); the value is llama.cpp's name."""

    F16 = "f16"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    IQ4_NL = "iq4_nl"

    @property
    def ggml_type(self) -> int:
        """The ggml type id llama.cpp's ``type_k`` takes (the ``gguf`` library's numbering, which is ggml's)."""
        from gguf import GGMLQuantizationType

        return int(GGMLQuantizationType[self.name])

    @property
    def quantised(self) -> bool:
        """Whether the cache stores K quantised (then llama.cpp rotates K unless told not to)."""
        return self != KCacheType.F16


@dataclass(frozen=True)
class WindowScores:
    """Per-window NLL sums (nats, float64) and scored predictions, in the windows' order."""

    nll_sums: tuple[float, ...]
    n_tokens: tuple[int, ...]

    @property
    def nll(self) -> float:
        """Mean NLL per scored token over all windows."""
        return math.fsum(self.nll_sums) / sum(self.n_tokens)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def window_nll(self) -> tuple[float, ...]:
        """Each window's mean NLL (what :class:`rope_quant.scoring.evaluate.PPLResult` holds)."""
        return tuple(s / n for s, n in zip(self.nll_sums, self.n_tokens, strict=True))


def require() -> ModuleType:
    """The ``llama_cpp`` module, or :class:`LlamaCppMissingError` naming the extra and the build flags."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise LlamaCppMissingError(
            f"llama.cpp scoring needs llama-cpp-python (the [llamacpp] extra): {INSTALL_LINE} "
            f"(it compiles llama.cpp, about 10 min on 2 cores; without these flags a build on a CPU that "
            f"advertises AMX dies with 'Illegal instruction'). Import failed: {exc}"
        ) from exc
    return llama_cpp


@dataclass(frozen=True)
class GGUFGeometry:
    """What scoring checks before a load: the architecture, K's head dimension, the vocabulary size."""

    architecture: str
    head_dim_k: int
    n_vocab: int | None


def gguf_geometry(path: str | os.PathLike[str]) -> GGUFGeometry:
    """Read from the GGUF header only (no tensor data): ``{arch}.attention.key_length``, or
    ``embedding_length / head_count`` where the file has no key length; the vocabulary from the tokenizer."""
    from rope_quant.model.gguf_header import GGUFHeaderError, read_gguf_header

    p = Path(path)
    if not p.is_file():
        raise LlamaCppError(f"GGUF file {p} does not exist")
    try:
        meta = read_gguf_header(p).metadata
    except (GGUFHeaderError, OSError) as exc:
        raise LlamaCppError(f"cannot read the GGUF header of {p}: {exc}") from exc
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise LlamaCppError(f"{p} has no general.architecture: not a model GGUF")
    key_length = meta.get(f"{arch}.attention.key_length")
    if key_length is None:
        try:
            key_length = int(meta[f"{arch}.embedding_length"]) // int(meta[f"{arch}.attention.head_count"])
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            raise LlamaCppError(f"{p}: cannot tell the head dimension from its metadata ({exc})") from exc
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = meta.get(f"{arch}.vocab_size", len(tokens) if isinstance(tokens, list) else None)
    return GGUFGeometry(arch, int(key_length), None if n_vocab is None else int(n_vocab))


def check_rotation(head_dim: int, k_type: KCacheType, rotation: bool) -> None:
    """Refuse the runtime rotation where llama.cpp would silently skip it (a quantised K whose head dimension is
    not a multiple of 64): such a cell would measure no rotation under the name of one."""
    if rotation and k_type.quantised and head_dim % ROTATION_MULTIPLE:
        raise RotationSkippedError(
            f"head_dim {head_dim} is not a multiple of {ROTATION_MULTIPLE}: llama.cpp skips its K rotation there, "
            f"so rotation=on at K {k_type.value} would score an unrotated cache; use rotation=off")


@contextlib.contextmanager
def rotation_env(rotation: bool) -> Iterator[None]:
    """``LLAMA_ATTN_ROT_DISABLE`` set to 1 (rotation off) or removed (on) inside the block, restored after."""
    before = os.environ.get(ROTATION_ENV)
    if rotation:
        os.environ.pop(ROTATION_ENV, None)
    else:
        os.environ[ROTATION_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ROTATION_ENV, None)
        else:
            os.environ[ROTATION_ENV] = before


def _check_windows(windows: Any, n_vocab: int | None) -> list[list[int]]:
    rows = [np.asarray(w) for w in windows]
    if not rows:
        raise LlamaCppError("no window to score")
    out = []
    for i, w in enumerate(rows):
        if w.ndim != 1 or w.size < 2:
            raise LlamaCppError(f"window {i}: expected a 1-D sequence of at least 2 token ids, got shape {w.shape}")
        if not np.issubdtype(w.dtype, np.integer):
            raise LlamaCppError(f"window {i}: token ids must be integers, got dtype {w.dtype}")
        lo, hi = int(w.min()), int(w.max())
        if lo < 0 or (n_vocab is not None and hi >= n_vocab):
            raise LlamaCppError(f"window {i}: token ids must lie in [0, {n_vocab}), got range [{lo}, {hi}]")
        out.append([int(t) for t in w])
    return out


def _check_threads(n_threads: int) -> int:
    if isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads < 1:
        raise LlamaCppError(f"n_threads must be a positive integer, got {n_threads!r}")
    return n_threads


def open_model(path: str | os.PathLike[str], n_ctx: int, k_type: KCacheType = KCacheType.F16, rotation: bool = True,
               n_threads: int = 2, *, logits_all: bool = True, geometry: GGUFGeometry | None = None) -> Any:
    """A ``llama_cpp.Llama`` on ``path`` with a context of ``n_ctx`` tokens (one batch), K at ``k_type``, V at f16,
    the runtime rotation as asked (checked against the head dimension first), CPU only."""
    k_type = KCacheType(k_type)
    _check_threads(n_threads)
    geo = geometry or gguf_geometry(path)
    check_rotation(geo.head_dim_k, k_type, rotation)
    llama_cpp = require()
    with rotation_env(rotation):
        return llama_cpp.Llama(
            model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=logits_all,
            type_k=k_type.ggml_type, n_threads=n_threads, n_threads_batch=n_threads, n_gpu_layers=0,
            verbose=False,
        )


def _nll_sum(logits: np.ndarray, targets: np.ndarray, block: int = 64) -> float:
    """Sum of -log softmax(logits[i])[targets[i]] in float64, in row blocks (a vocabulary of 262K fits)."""
    total = 0.0
    for lo in range(0, logits.shape[0], block):
        z = logits[lo:lo + block].astype(np.float64)
        m = z.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
        picked = z[np.arange(z.shape[0]), targets[lo:lo + block]]
        total += float((lse - picked).sum())
    return total


def window_logits(llm: Any, tokens: Sequence[int]) -> np.ndarray:
    """llama.cpp's logits for every position of ``tokens`` (one fresh sequence: the cache is cleared first)."""
    llm.reset()
    llm.eval(list(tokens))
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def score_windows(path: str | os.PathLike[str], windows: Any, k_type: KCacheType | str = KCacheType.F16,
                  rotation: bool = True, n_threads: int = 2) -> WindowScores:
    """Each window's NLL sum over its ``L - 1`` next-token predictions, scored by llama.cpp on the GGUF ``path``.

    ``windows``: rows of token ids of the model's own tokenizer (e.g. ``eval_windows(corpus.eval_ids, 512, 8)``);
    each is one fresh sequence from position 0. ``rotation`` is llama.cpp's online K Hadamard (it acts only at a
    quantised ``k_type``; at f16 both flags score the same cache). A non-finite NLL raises, naming the window.
    """
    try:
        k_type = KCacheType(k_type)
    except ValueError:
        raise LlamaCppError(f"K cache type {k_type!r} is not one of {', '.join(t.value for t in KCacheType)}") from None
    _check_threads(n_threads)
    geo = gguf_geometry(path)
    rows = _check_windows(windows, geo.n_vocab)
    check_rotation(geo.head_dim_k, k_type, rotation)
    require()
    llm = open_model(path, max(len(r) for r in rows), k_type, rotation, n_threads, geometry=geo)
    try:
        sums, counts = [], []
        for i, row in enumerate(rows):
            logits = window_logits(llm, row)
            s = _nll_sum(logits[:-1], np.asarray(row[1:]))
            if not math.isfinite(s):
                raise LlamaCppError(f"window {i}: non-finite NLL ({s}) from llama.cpp's logits")
            sums.append(s)
            counts.append(len(row) - 1)
    finally:
        close = getattr(llm, "close", None)
        if callable(close):
            close()
    return WindowScores(tuple(sums), tuple(counts))
