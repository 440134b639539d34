"""Read a GGUF file's header quickly: its key/value metadata and where each tensor lies.

`gguf.GGUFReader` builds a numpy view for every string of every array while it opens a file:
2-5 s for SmolLM2's 49k tokens + 49k merges, before a single tensor is needed, and every
engine (every worker start, every test's engine) opened the file that way. This walks the
header once with `struct` and returns plain Python values (~0.1 s); the tensors' bytes stay
in the file, for the caller to map. The value-type codes, the tensor types and their block
sizes come from the `gguf` package; tests check the result against `GGUFReader` on the real
file.

    meta = read_gguf_metadata("model.gguf")
    meta["general.architecture"]          # 'llama'
    meta["tokenizer.ggml.tokens"][:2]     # ['<|endoftext|>', '<|im_start|>']

    header = read_gguf_header("model.gguf")
    header.tensors["blk.0.attn_q.weight"]  # GGUFTensorInfo(dims=(576, 576), type=Q4_1, offset=..., nbytes=...)
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

# Fixed-size scalar types: struct code and the numpy dtype used for arrays of them.
_SCALARS: dict[GGUFValueType, tuple[str, str]] = {
    GGUFValueType.UINT8: ("B", "u1"),
    GGUFValueType.INT8: ("b", "i1"),
    GGUFValueType.UINT16: ("H", "u2"),
    GGUFValueType.INT16: ("h", "i2"),
    GGUFValueType.UINT32: ("I", "u4"),
    GGUFValueType.INT32: ("i", "i4"),
    GGUFValueType.FLOAT32: ("f", "f4"),
    GGUFValueType.BOOL: ("?", "?"),
    GGUFValueType.UINT64: ("Q", "u8"),
    GGUFValueType.INT64: ("q", "i8"),
    GGUFValueType.FLOAT64: ("d", "f8"),
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file, or its header is truncated or malformed."""


class _Cursor:
    """Reads little- or big-endian GGUF values from a buffer, advancing an offset."""

    def __init__(self, buf: memoryview | bytes, endian: str):
        self.buf = buf
        self.pos = 0
        self.endian = endian

    def scalar(self, code: str) -> Any:
        fmt = self.endian + code
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError("truncated GGUF header")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        end = self.pos + length
        if end > len(self.buf):
            raise GGUFFormatError("truncated GGUF header (string runs past the end of the file)")
        raw = bytes(self.buf[self.pos : end])
        self.pos = end
        # Some converters write tokens that are not valid UTF-8 (lone bytes of a byte-level
        # vocabulary); keep them readable rather than refusing the file.
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        try:
            vtype = GGUFValueType(value_type)
        except ValueError:
            raise GGUFFormatError(f"unknown GGUF value type {value_type}") from None
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type = self.scalar("I")
            count = self.scalar("Q")
            return self.array(item_type, count)
        return self.scalar(_SCALARS[vtype][0])

    def array(self, item_type: int, count: int) -> list[Any]:
        try:
            itype = GGUFValueType(item_type)
        except ValueError:
            raise GGUFFormatError(f"unknown GGUF array item type {item_type}") from None
        if itype in _SCALARS:
            # Numbers in bulk: one numpy view instead of `count` struct calls.
            dtype = np.dtype(_SCALARS[itype][1]).newbyteorder(self.endian)
            nbytes = dtype.itemsize * count
            if self.pos + nbytes > len(self.buf):
                raise GGUFFormatError("truncated GGUF header (array runs past the end of the file)")
            items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
            self.pos += nbytes
            return items
        if itype == GGUFValueType.STRING:
            return self.strings(count)
        return [self.value(itype) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        # The hot loop (100k vocabulary strings): no per-item method calls.
        length_of = struct.Struct(self.endian + "Q").unpack_from
        buf, pos, end_of_buf = self.buf, self.pos, len(self.buf)
        out = []
        for _ in range(count):
            if pos + 8 > end_of_buf:
                raise GGUFFormatError("truncated GGUF header (string array)")
            (length,) = length_of(buf, pos)
            pos += 8
            if pos + length > end_of_buf:
                raise GGUFFormatError("truncated GGUF header (string runs past the end of the file)")
            out.append(str(buf[pos : pos + length], "utf-8", "replace"))
            pos += length
        self.pos = pos
        return out


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor's bytes lie in its file, and what they hold."""

    dims: tuple[int, ...]  # as the file lists them: innermost (contiguous) first
    type: GGMLQuantizationType
    offset: int  # of its first byte, from the start of the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """PyTorch's order: outermost first ([out, in] for a weight)."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]  # in the file's order
    endian: str  # struct's "<" or ">"


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value pairs of a GGUF file's header, as Python values (arrays as lists)."""
    return read_gguf_header(path, tensors=False).metadata


def read_gguf_header(path: str | Path, tensors: bool = True) -> GGUFHeader:
    """The metadata and (unless `tensors` is False) every tensor's type, dims and place in the
    file. GGUFFormatError (a ValueError) names what is wrong with a malformed or truncated
    header, a tensor named twice, an unknown tensor type or a tensor running past the end."""
    path = Path(path)
    with path.open("rb") as f:
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise GGUFFormatError(f"{path}: not a GGUF file (empty)") from None
    with mapped:
        buf = memoryview(mapped)
        try:
            return _read_header(buf, path, tensors)
        finally:
            buf.release()


def _read_header(buf: memoryview, path: Path, with_tensors: bool) -> GGUFHeader:
    if len(buf) < 24 or struct.unpack_from("<I", buf, 0)[0] != GGUF_MAGIC:
        raise GGUFFormatError(f"{path}: not a GGUF file (bad magic)")
    # The version is small; if its low half reads as zero the file was written big-endian.
    version = struct.unpack_from("<I", buf, 4)[0]
    endian = ">" if version & 0xFFFF == 0 else "<"
    cursor = _Cursor(buf, endian)
    cursor.pos = 4
    version = cursor.scalar("I")
    if version < 2:
        raise GGUFFormatError(f"{path}: GGUF version {version} is too old (need 2 or later)")
    tensor_count = cursor.scalar("Q")
    kv_count = cursor.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("I"))
    if not with_tensors:
        return GGUFHeader(metadata, {}, endian)
    infos = [_tensor_info(cursor, path) for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
        raise GGUFFormatError(f"{path}: general.alignment must be a positive integer, got {alignment!r}")
    data_start = -(-cursor.pos // alignment) * alignment  # the header, padded to the alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, qtype, offset, nbytes in infos:
        if name in tensors:
            raise GGUFFormatError(f"{path}: tensor {name!r} is listed twice")
        if data_start + offset + nbytes > len(buf):
            raise GGUFFormatError(f"{path}: tensor {name!r} runs past the end of the file (truncated?)")
        tensors[name] = GGUFTensorInfo(dims, qtype, data_start + offset, nbytes)
    return GGUFHeader(metadata, tensors, endian)


def _tensor_info(cursor: _Cursor, path: Path) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]:
    """One tensor-info entry: (name, dims, type, offset from the data's start, bytes)."""
    name = cursor.string()
    n_dims = cursor.scalar("I")
    if n_dims > 8:  # GGML tensors have at most 4; a huge count is a corrupt header
        raise GGUFFormatError(f"{path}: tensor {name!r} has {n_dims} dimensions")
    dims = tuple(cursor.scalar("Q") for _ in range(n_dims))
    raw_type = cursor.scalar("I")
    try:
        qtype = GGMLQuantizationType(raw_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise GGUFFormatError(f"{path}: tensor {name!r} has an unknown type {raw_type}") from None
    offset = cursor.scalar("Q")
    n_elements = math.prod(dims)  # Python ints: a corrupt header's huge dims cannot wrap around
    if dims and dims[0] % block_size:
        raise GGUFFormatError(f"{path}: tensor {name!r}: rows of {dims[0]} are not whole {qtype.name} blocks")
    return name, dims, qtype, offset, n_elements // block_size * type_size
