"""The header of a GGUF file (llama.cpp's format): its metadata and tensor table, read and
checked before any tensor data is, so that a damaged, truncated or foreign file is refused with
one line. `gguf.py` turns a target's header and data into an mlx-lm model, `gguf_drafter.py` a
DSpark drafter's."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CheckpointError

MAGIC = b"GGUF"

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS.update({11: "<q", 12: "<d"})
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?"}
_NUMPY.update({10: "<u8", 11: "<i8", 12: "<f8"})
_STRING, _ARRAY = 8, 9


@dataclass
class TensorInfo:
    name: str
    type: str  # GGML type name (Q4_1, F32, ...)
    shape: tuple[int, ...]  # row-major, as MLX returns it (GGML lists dimensions reversed)
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class Header:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped key: get("block_count") reads "<arch>.block_count"."""
        return self.metadata.get(f"{self.arch}.{key}", default)


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf: mmap.mmap, name: str) -> None:
        self.buf, self.pos, self.name = buf, 0, name

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise CheckpointError(f"{self.name} is truncated (its header runs past the end)")
        self.pos += n
        return start

    def scalar(self, fmt: str) -> Any:
        start = self.take(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self.take(n)
        try:
            return bytes(self.buf[start : start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.name} has a metadata string that is not UTF-8") from None

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _NUMPY:
                dtype = np.dtype(_NUMPY[etype])
                start = self.take(count * dtype.itemsize)
                return np.frombuffer(self.buf, dtype, count, start).copy()
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            raise CheckpointError(f"{self.name} has a metadata array of value type {etype}")
        raise CheckpointError(f"{self.name} has a metadata value of unknown type {vtype}")


def read_header(path: Path) -> Header:
    """The file's metadata and tensor table, checked: GGUF v2/v3, every tensor's data inside
    the file. Cached per (path, size, mtime): config and weights both need it."""
    path = Path(path)
    st = path.stat()
    return _read_header(str(path), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4)
def _read_header(path_str: str, size: int, mtime: int) -> Header:
    import gguf  # gguf-py: llama.cpp's own tables of type ids and block sizes

    path = Path(path_str)
    name = path.name
    with path.open("rb") as f:
        if size < 24:
            raise CheckpointError(f"{name} is not a GGUF file (only {size} bytes)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        cur = _Cursor(buf, name)
        magic = bytes(buf[:4])
        if magic != MAGIC:
            raise CheckpointError(f"{name} is not a GGUF file (starts with {magic!r})")
        cur.take(4)
        version = cur.scalar("<I")
        if version not in (2, 3):
            what = "a big-endian GGUF" if version > 0xFFFF else f"GGUF version {version}"
            raise CheckpointError(f"{name} is {what}; outrider reads little-endian GGUF v2/v3")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            tname = cur.string()
            ndim = cur.scalar("<I")
            dims = [cur.scalar("<Q") for _ in range(ndim)]
            infos.append((tname, dims, cur.scalar("<I"), cur.scalar("<Q")))
        align = int(metadata.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise CheckpointError(f"{name} has an invalid general.alignment ({align})")
        data_start = -(-cur.pos // align) * align
    finally:
        buf.close()
    header = Header(path, metadata)
    for tname, dims, type_id, rel in infos:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise CheckpointError(
                f"{name}: tensor {tname!r} has unknown type id {type_id}"
            ) from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims)) if dims else 1
        nbytes = count // block * type_size
        start = data_start + rel
        if start + nbytes > size:
            raise CheckpointError(
                f"{name} is truncated: tensor {tname!r} ends at byte {start + nbytes:,} "
                f"but the file has {size:,} bytes"
            )
        shape = tuple(int(d) for d in reversed(dims))
        header.tensors[tname] = TensorInfo(tname, qtype.name, shape, start, nbytes)
    return header
