"""Checks of a sweep's input before any cell runs (bad input exits 2 once, not once per cell).

:func:`preflight` reads the model once, then checks what every cell will need from it:

* the model resolves and reads (config at least; with the real pipeline the base model and its corpora are
  loaded into the :class:`~rope_quant.sweep.loaded_models.ModelCache` the cells then reuse);
* the Hadamard orders of the offline rotations (R1: hidden_size, R2: head_dim, R4: intermediate_size)
  and of the R3 transform (head_dim; block sizes dividing head_dim) exist; the key quantiser fits head_dim (the
  ggml formats' blocks of 32, rope_pair_bits' widths) and llama.cpp's runtime rotation rotates it (a multiple of 64);
* the corpus holds a calibration window of ``seqlen`` tokens and at least one evaluation window of every
  evaluated length (fewer evaluation windows than requested give a note, as the evaluation uses what fits).
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rope_quant.sweep.cellkind import CellKindName, kind_of
from rope_quant.sweep.loaded_models import ModelCache
from rope_quant.sweep.manifest import Manifest, SweepError, run_of


class PreflightError(SweepError):
    """Bad input found before any cell ran: a model, geometry or corpus the cells cannot use."""


def hadamard_needs(cfg: Any, dims: Any) -> list[tuple[int, str]]:
    """``(order, what needs it)`` for the offline rotations of one cell on a model of geometry ``dims``."""
    from rope_quant.experiment.config import RotationKind

    rot = run_of(cfg).rotation
    needs = []
    # every built rotation but identity is (or, for whip, starts from) a Hadamard of that order
    built = (RotationKind.HADAMARD, RotationKind.RANDOM_HADAMARD, RotationKind.WHIP)
    if rot.r1 in built:
        needs.append((dims.hidden, f"R1 (r1={rot.r1.value}) needs hidden_size={dims.hidden}"))
    if rot.r2 in built:
        needs.append((dims.head_dim, f"R2 (r2={rot.r2.value}) needs head_dim={dims.head_dim}"))
    if rot.r4:
        needs.append((dims.intermediate, f"the online R4 (r4=on; --no-r4 turns it off) needs "
                                         f"intermediate_size={dims.intermediate}"))
    return needs


def r3_problem(name: str, cfg: Any, head_dim: int) -> str | None:
    """Why the R3 transform of cell ``name`` cannot be built at ``head_dim`` (None: it can)."""
    import numpy as np

    from rope_quant.core import transforms

    run = run_of(cfg)
    params: dict[str, Any] = {}
    if transforms.needs_angles(run.r3):
        params["angles"] = np.zeros(head_dim // 2)
    if transforms.needs_block(run.r3):
        params["block"] = run.r3_block
    try:
        transforms.build(run.r3, head_dim, **params)
    except Exception as exc:  # UnsupportedHadamardOrderError, InvalidBlockSizeError, odd head_dim ...
        block = f" block {run.r3_block}" if run.r3_block else ""
        return f"R3 {run.r3!r}{block} (config {name}) at head_dim={head_dim}: {exc}"
    return None


def key_problem(name: str, cfg: Any, head_dim: int) -> str | None:
    """Why the key quantiser or the runtime rotation of cell ``name`` cannot run at ``head_dim`` (None: they can)."""
    from rope_quant.experiment.config import PipelineError
    from rope_quant.experiment.key_quant import check_key_geometry

    try:
        check_key_geometry(run_of(cfg), head_dim)
    except PipelineError as exc:
        return f"config {name}: {exc}"
    return None


def check_geometry(manifest: Manifest, dims: Any, model: str) -> None:
    """Every Hadamard order and R3 transform the cells need exists for geometry ``dims``."""
    from rope_quant.core.hadamard import is_supported_order

    problems: list[str] = []
    missing: dict[int, list[str]] = {}
    for name, cfg in manifest.cells:
        for order, what in hadamard_needs(cfg, dims):
            if not is_supported_order(order) and what not in missing.setdefault(order, []):
                missing[order].append(what)
        for problem in (r3_problem(name, cfg, dims.head_dim), key_problem(name, cfg, dims.head_dim)):
            if problem is not None and problem not in problems:
                problems.append(problem)
    lines = [f"no Hadamard matrix of order {order} can be built (orders K·2^m: K = 1, a Paley order, or any "
             "multiple of 4 up to 256; see core.hadamard_orders): "
             + "; ".join(whats) for order, whats in missing.items()] + problems
    if lines:
        raise PreflightError(f"model {model} (head_dim={dims.head_dim}, hidden_size={dims.hidden}, "
                             f"intermediate_size={dims.intermediate}) cannot run these cells:\n  "
                             + "\n  ".join(lines))


def check_windows(corpus: Any, cells: Iterable[Any]) -> list[str]:
    """Every cell finds a calibration window and at least one evaluation window; returns notes on cells that
    get fewer evaluation windows than requested."""
    n_calib, n_eval = int(corpus.calib_ids.numel()), int(corpus.eval_ids.numel())
    errors: list[str] = []
    notes: list[str] = []
    for cfg in cells:
        run = run_of(cfg)
        seqlen, wanted = run.budget.seqlen, run.budget.eval_windows
        if n_calib < seqlen:
            errors.append(f"the calibration stream has {n_calib} tokens, fewer than one window of seqlen={seqlen}")
        lengths = kind_of(cfg).eval_lengths(cfg, (seqlen,))
        if kind_of(cfg).name == CellKindName.LONG_CONTEXT and (
                cfg.eval_docs is not None or cfg.eval_corpus not in (None, run.corpus)):
            lengths = ()  # scored on its own stream: check_eval_streams
        for length in lengths:
            fit = n_eval // length
            if fit == 0:
                errors.append(f"the evaluation stream has {n_eval} tokens, fewer than one window of {length} "
                              f"tokens (eval_windows={'all' if wanted is None else wanted})")
            elif wanted is not None and fit < wanted:
                notes.append(f"corpus {corpus.name}: only {fit} of the {wanted} evaluation windows of {length} "
                             f"tokens fit in {n_eval} tokens")
    errors = list(dict.fromkeys(errors))
    if errors:
        raise PreflightError(f"corpus {corpus.name} is too small for the requested windows:\n  "
                             + "\n  ".join(errors) + "\nlower --seqlen / --lengths or use a larger --corpus")
    return list(dict.fromkeys(notes))


def check_eval_streams(cells: Iterable[Any], tokenizer: Any) -> list[str]:
    """Long-context cells scored on their own stream (App. A.4: another corpus, the first documents) find at
    least one window of every length in it; returns notes on lengths that get fewer windows than the cap."""
    from rope_quant.scoring import evaluate, longctx

    errors: list[str] = []
    notes: list[str] = []
    streams: dict[tuple[str, int | None], int] = {}
    for cfg in cells:
        if kind_of(cfg).name != CellKindName.LONG_CONTEXT:
            continue
        run = run_of(cfg)
        corpus = cfg.eval_corpus or run.corpus
        if cfg.eval_docs is None and corpus == run.corpus:
            continue
        key = (corpus, cfg.eval_docs)
        if key not in streams:
            streams[key] = longctx.eval_stream(corpus, tokenizer, cfg.eval_docs).n_tokens
        n = streams[key]
        cap = run.budget.eval_windows or evaluate.LONG_CONTEXT_MAX_WINDOWS
        docs = "the whole evaluation split" if cfg.eval_docs is None else f"the first {cfg.eval_docs} documents"
        for length, fit in longctx.window_counts(n, cfg.lengths, cap).items():
            if fit == 0:
                errors.append(f"the long-context stream of {corpus} ({docs}) has {n} tokens, fewer than one "
                              f"window of {length} tokens")
            elif fit < cap:
                notes.append(f"corpus {corpus}: {fit} of at most {cap} windows of {length} tokens fit in its "
                             f"{n}-token long-context stream")
    errors = list(dict.fromkeys(errors))
    if errors:
        raise PreflightError("long-context evaluation stream too short:\n  " + "\n  ".join(errors)
                             + "\nlower --lengths or use a longer --eval-corpora")
    return list(dict.fromkeys(notes))


def _dims_from_config(model: str) -> Any:
    from rope_quant.model import arch
    from rope_quant.model.loading import load_config

    return arch.dims(SimpleNamespace(config=load_config(model)))


def _input_errors() -> tuple[type[BaseException], ...]:
    from rope_quant.corpora.documents import CorpusError
    from rope_quant.model.arch import ModelStructureError, UnsupportedModelTypeError
    from rope_quant.model.loading import ModelLoadError, ModelNotFoundError

    return (ModelLoadError, ModelNotFoundError, UnsupportedModelTypeError, ModelStructureError, CorpusError)


def preflight(manifest: Manifest, models: ModelCache, *, load: bool,
              configs: Mapping[str, Any] | None = None) -> list[str]:
    """Check the input of every cell of ``manifest`` before any runs; returns notes, raises
    :class:`PreflightError` naming what is wrong.

    ``load`` (the real pipeline): load each base model and corpus into ``models`` once (the cells reuse
    them) and check the corpus sizes. Otherwise the model's config is read (or the already-loaded model
    of ``models`` is used, or its config in ``configs``: model → the config the caller has read) for the geometry
    checks only.
    """
    from rope_quant.model import arch

    notes: list[str] = []
    by_source: dict[tuple[str, str], list[tuple[str, Any]]] = {}
    for name, cfg in manifest.cells:
        run = run_of(cfg)
        by_source.setdefault((run.model, run.device), []).append((name, cfg))
    for (model, device), cells in by_source.items():
        try:
            if load or (model, device) in models:
                (base, tokenizer), corpora = models.get(model, device)
                dims = arch.dims(base)
            elif (configs or {}).get(model) is not None:
                dims = arch.dims(SimpleNamespace(config=(configs or {})[model]))
            else:
                dims = _dims_from_config(model)
            check_geometry(Manifest(cells=cells, study=manifest.study), dims, model)
            if not load:
                continue
            for corpus_name in dict.fromkeys(run_of(cfg).corpus for _, cfg in cells):
                if corpus_name not in corpora:
                    from rope_quant.corpora import token_streams

                    corpora[corpus_name] = token_streams.load_corpus(corpus_name, tokenizer)
                notes += check_windows(corpora[corpus_name], [cfg for _, cfg in cells
                                                              if run_of(cfg).corpus == corpus_name])
            notes += check_eval_streams([cfg for _, cfg in cells], tokenizer)
        except _input_errors() as exc:
            raise PreflightError(f"model {model}: {exc}") from exc
    return notes


# ----------------------------------------------------------------------------- checks before the model loads


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_dir(path: str | os.PathLike[str], what: str = "--out", *, parent: bool = False) -> None:
    """``path`` is (or can become) a writable directory: not an existing file, not under a file, not on a
    read-only filesystem or in a directory this user cannot write. ``parent``: ``path``'s parent must be
    writable too (a directory written beside it and renamed into place). Creates nothing."""
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        raise PreflightError(f"{what} {path}: an existing file, not a directory; choose a directory")
    base = _nearest_existing(target.absolute().parent if parent else target.absolute())
    if not base.is_dir():
        raise PreflightError(f"{what} {path}: {base} is a file, so no directory can be created under it")
    if not os.access(base, os.W_OK | os.X_OK):
        raise PreflightError(f"{what} {path}: {base} is not writable (read-only or another user's); "
                             "choose a writable directory")
    try:  # os.access does not see a read-only mount for root, nor a full disk: probe with a real file
        fd, probe = tempfile.mkstemp(prefix=".rope-quant-probe-", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise PreflightError(f"{what} {path}: cannot write in {base}: {environment_fault(exc)}") from None


def environment_fault(exc: OSError, kept: str = "complete cells are kept and resume") -> str:
    """A one-line description of a filesystem fault (disk full, read-only, permission) with the remedy (``kept``:
    what a rerun finds)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full (errno ENOSPC); free space and rerun the same command: {kept}"
    if exc.errno == errno.EROFS:
        return "the filesystem is read-only (errno EROFS); choose a writable directory"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied ({exc.strerror}); choose a writable directory"
    return f"{type(exc).__name__}: {exc}"


ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def check_corpus_text(name: str, seqlen: int) -> None:
    """A local corpus path holds UTF-8 text and a calibration window of ``seqlen`` tokens: "corpus X: missing /
    empty / binary / not UTF-8 / shorter than one window" before any model loads (the token counts of every
    window are checked after the tokenizer loads, :func:`check_windows`). Embedded and hub names pass."""
    from rope_quant.corpora import sources
    from rope_quant.corpora.documents import CorpusError

    if name.lower() in sources.list_corpora(include_unavailable=True) or name.lower() in sources.HF_WIKITEXT_NAMES:
        return
    path = Path(name).expanduser()
    if not path.exists():
        raise PreflightError(f"corpus {name}: missing (no such file or directory)")
    if path.is_file():
        raw = _head_bytes(path)
        if not raw.strip():
            raise PreflightError(f"corpus {name}: empty")
        if b"\0" in raw:
            raise PreflightError(f"corpus {name}: binary (NUL bytes), not UTF-8 text")
    try:
        split = sources.load_text(path)
    except CorpusError as exc:
        text = str(exc)
        if "UTF-8" in text:
            raise PreflightError(f"corpus {name}: not UTF-8 text ({text})") from None
        if "no corpus files" in text:
            raise PreflightError(f"corpus {name}: a folder with no text (.txt / .jsonl / wiki.*.raw) files") from None
        if "too short" in text:
            raise PreflightError(f"corpus {name}: shorter than one window ({text})") from None
        raise PreflightError(f"corpus {name}: {text}") from None
    if not split.calib_text.strip() and not split.eval_text.strip():
        raise PreflightError(f"corpus {name}: empty")
    size = len(split.calib_text.encode("utf-8"))  # a token covers at least one byte of byte-level BPE text
    if size + 1 < seqlen:  # +1: a SentencePiece dummy prefix
        raise PreflightError(f"corpus {name}: shorter than one window: its calibration split has {size} bytes, "
                             f"fewer than the {seqlen} tokens of one window (lower --seqlen or use a longer corpus)")


def _head_bytes(path: Path) -> bytes:
    if path.name.endswith(".gz"):
        import gzip

        try:
            with gzip.open(path, "rb") as fh:
                return fh.read(1 << 16)
        except (OSError, EOFError) as exc:
            raise PreflightError(f"corpus {path}: not a readable .gz file ({exc})") from None
    with open(path, "rb") as fh:
        return fh.read(1 << 16)
