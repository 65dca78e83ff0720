"""The header of a GGUF file, read without its tensor data (so a checkpoint error can name the culprit).

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count u64, key-value count u64; the
key-value pairs (key string, value type u32, value); the tensor infos (name, n_dims u32, dims u64 each,
ggml type u32, offset u64 from the data start); padding to ``general.alignment`` (default 32); the data.
Reading only the header lets a file cut inside its tensor data be reported as such, naming the first tensor
that does not fit, before transformers parses anything.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["GGUFHeaderError", "GGUFTensor", "GGUFHeader", "read_gguf_header"]

# value type -> struct format of one scalar (8: string, 9: array are read apart)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 40  # a larger count can only come from a damaged header


class GGUFHeaderError(ValueError):
    """A GGUF header that cannot be read (cut short or malformed); the caller names the file."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # from the data start
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensor, ...]
    data_start: int
    file_size: int

    @property
    def data_end(self) -> int:
        """Where the last tensor's data ends (the file must be at least this long)."""
        return max((self.data_start + t.offset + t.n_bytes for t in self.tensors), default=self.data_start)

    def first_cut_tensor(self) -> GGUFTensor | None:
        """The first tensor (by offset) whose data runs past the end of the file, if any."""
        for t in sorted(self.tensors, key=lambda t: t.offset):
            if self.data_start + t.offset + t.n_bytes > self.file_size:
                return t
        return None


class _Reader:
    def __init__(self, handle: BinaryIO, path: Path) -> None:
        self.handle, self.path = handle, path

    def take(self, n: int) -> bytes:
        data = self.handle.read(n)
        if len(data) != n:
            raise GGUFHeaderError(f"the GGUF header is truncated (the file ends at byte {self.handle.tell()})")
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self) -> int:
        n = self.scalar("<Q")
        if n > _MAX_COUNT:
            raise GGUFHeaderError(f"implausible count {n} in the GGUF header (damaged file?)")
        return n

    def string(self) -> str:
        return self.take(self.count()).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.scalar("<I"), self.count()
            if etype in _SCALAR:  # read at once; kept only when short (vocabularies are skipped)
                fmt = _SCALAR[etype]
                raw = self.take(struct.calcsize(fmt) * n)
                return list(struct.unpack(f"<{n}{fmt[1]}", raw)) if n <= 64 else None
            items = [self.value(etype) for _ in range(n)]
            return items if n <= 64 else None
        raise GGUFHeaderError(f"unknown GGUF value type {vtype} in the header (damaged file?)")


def _tensor_bytes(shape: tuple[int, ...], ggml_type: int, path: Path, name: str) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError) as exc:
        raise GGUFHeaderError(f"tensor {name!r} has unknown ggml type {ggml_type} (damaged file?)") from exc
    n = 1
    for d in shape:
        n *= d
    return n // block * size


@functools.lru_cache(maxsize=8)
def _read_cached(path: Path, stamp: tuple[int, int]) -> GGUFHeader:
    with path.open("rb") as handle:
        r = _Reader(handle, path)
        if r.take(4) != b"GGUF":
            raise GGUFHeaderError("not a GGUF file (no GGUF magic)")
        version = r.scalar("<I")
        n_tensors, n_kv = r.count(), r.count()
        metadata = {}
        for _ in range(n_kv):
            key = r.string()
            metadata[key] = r.value(r.scalar("<I"))
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            shape = tuple(r.count() for _ in range(r.scalar("<I")))
            ggml_type, offset = r.scalar("<I"), r.scalar("<Q")
            tensors.append(GGUFTensor(name, shape, ggml_type, offset, _tensor_bytes(shape, ggml_type, path, name)))
        align = int(metadata.get("general.alignment") or 32)
        pos = handle.tell()
    data_start = -(-pos // align) * align
    return GGUFHeader(version, metadata, tuple(tensors), data_start, stamp[0])


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The header of the GGUF file at ``path`` (cached per size and modification time).

    Raises :class:`GGUFHeaderError` when the header itself is cut short or malformed.
    """
    p = Path(path)
    st = p.stat()
    return _read_cached(p.resolve(), (st.st_size, st.st_mtime_ns))
