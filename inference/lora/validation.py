"""The engine's side of the PEFT adapter rules, which live once in protocol.adapter_format.

A bad adapter must never evict or disturb a resident one, so `load_adapter` runs every rule
first (`check_adapter`: files, config, targets, safetensors header and shapes, base name) and
checks each value as it reads the tensors (`check_finite`), returning a LoRAAdapter only when
all passed. The rules report every reason; the engine raises the first as an AdapterError whose
message is "adapter 'NAME': REASON".
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import stat
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from inference.lora import host_memory
from inference.lora.errors import AdapterError
from inference.models.config import LlamaConfig
from protocol.adapter_format import AdapterCheck, BaseShapes, check_adapter_dir
from protocol.adapter_format.files import WEIGHTS_FILE
from protocol.adapter_format.tensors import Header, TensorInfo, nonfinite, nonfinite_reason

# safetensors' names of the float dtypes an adapter's tensors may have
SAFETENSORS_DTYPES = {
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
}


def base_shapes(config: LlamaConfig, *, max_lora_rank: int = 16) -> BaseShapes:
    """The served checkpoint as the adapter rules see it (its name is the checkpoint's own)."""
    return BaseShapes(
        name=config.name,
        num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_lora_rank=max_lora_rank,
    )


def module_shapes(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection LoRA can adapt, in HF's unfused layout."""
    return base_shapes(config).module_shapes()


def check_adapter(
    adapter: str,
    directory: Path,
    config: LlamaConfig,
    *,
    max_lora_rank: int,
    strict: bool,
) -> AdapterCheck:
    """Every rule but the values' finiteness (checked as the tensors are read); raises the
    first reason as an AdapterError."""
    check = check_adapter_dir(
        directory,
        base_shapes(config, max_lora_rank=max_lora_rank),
        strict_base_match=strict,
        check_values=False,
    )
    if check.reasons:
        raise AdapterError(adapter, check.reasons[0])
    return check


def read_ahead(path: Path) -> None:
    """Ask the OS to start reading the regular file `path` into its page cache now
    (posix_fadvise WILLNEED), so that the disk works while the config, targets and header are
    judged and read_weights then finds the bytes in memory. Never blocks (a FIFO is not waited
    on), follows no symlink and reports nothing: the checks that follow judge the file."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def open_weights(adapter: str, path: Path) -> Iterator[Any]:
    """safe_open(path) into torch, a file that broke since it was checked reported as an
    AdapterError, whether found at open or while reading."""
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise AdapterError(adapter, f"{WEIGHTS_FILE} is corrupt or truncated: {e}") from None


# torch dtype of each safetensors float dtype name (the inverse of SAFETENSORS_DTYPES)
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
_UINTS = {2: np.uint16, 4: np.uint32, 8: np.uint64}  # bit patterns per item size


def read_weights(adapter: str, path: Path, header: Mapping[str, TensorInfo]) -> bytearray | mmap.mmap:
    """The whole weights file in one read, refused unless its header is still the one the rules
    judged (`header`, from check_adapter): the tensors are then views of the returned buffer at
    the judged offsets. One read syscall into memory we own (a pooled block, already faulted
    in when reused: see host_memory): no per-tensor copies, no file mapping whose pages
    another writer could change under us."""
    changed = AdapterError(adapter, f"{WEIGHTS_FILE} changed while it was being loaded")
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size != max(t.end for t in header.values()):
                raise changed
            data = host_memory.BLOCKS.take(size)  # len(data) >= size; a reused block's old bytes beyond
            view, done = memoryview(data)[:size], 0
            while done < size:
                n = f.readinto(view[done:])
                if not n:
                    raise changed
                done += n
    except OSError as e:
        raise AdapterError(adapter, f"{WEIGHTS_FILE} is corrupt or truncated: {e}") from None
    try:
        (n,) = struct.unpack_from("<Q", data)
        if isinstance(header, Header) and header.json and view[8 : 8 + n] == header.json:
            return data  # the very bytes judged: the same tensors at the same offsets
        found = json.loads(bytes(view[8 : 8 + n]))
        found.pop("__metadata__", None)
        same = found.keys() == header.keys() and all(
            TensorInfo(str(info["dtype"]), tuple(info["shape"]), 8 + n + info["data_offsets"][0],
                       8 + n + info["data_offsets"][1]) == header[key]
            for key, info in found.items()
        )  # fmt: skip
    except (struct.error, ValueError, LookupError, TypeError, AttributeError, RecursionError):
        same = False
    if not same:
        raise changed
    return data


def tensor_view(data: bytearray | mmap.mmap, info: TensorInfo) -> torch.Tensor:
    """The tensor `info` describes, as a view of `data` (no copy); its dtype as stored."""
    return host_memory.tensor_over(data, TORCH_DTYPES[info.dtype], info.shape, info.start)


def all_finite(data: bytearray | mmap.mmap, header: Mapping[str, TensorInfo]) -> bool:
    """Whether every tensor in `data` is free of NaN/Inf. One numpy pass over the data region
    when every tensor has one dtype (the usual file): 420 small calls cost more than the bytes."""
    dtypes = {t.dtype for t in header.values()}
    start, end = min(t.start for t in header.values()), max(t.end for t in header.values())
    if len(dtypes) == 1 and (end - start) % TORCH_DTYPES[next(iter(dtypes))].itemsize == 0:
        spans = [(next(iter(dtypes)), start, end)]
    else:
        spans = [(t.dtype, t.start, t.end) for t in header.values()]
    for dtype, lo, hi in spans:
        uint = _UINTS[TORCH_DTYPES[dtype].itemsize]
        count = (hi - lo) // np.dtype(uint).itemsize
        if count and nonfinite(np.frombuffer(data, dtype=uint, count=count, offset=lo), dtype):
            return False
    return True


def check_all_finite(adapter: str, data: bytearray | mmap.mmap, header: Mapping[str, TensorInfo]) -> None:
    """Refuse NaN/Inf in any tensor of `data`, naming the first bad one in name order."""
    for key in sorted(header):
        check_finite(adapter, key, tensor_view(data, header[key]))


def check_finite(adapter: str, label: str, tensor: torch.Tensor) -> None:
    """Refuse NaN/Inf in a float CPU tensor (numpy reads its memory in place; no copy)."""
    dtype = SAFETENSORS_DTYPES[tensor.dtype]
    values = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    if kind := nonfinite(values.numpy(), dtype):
        raise AdapterError(adapter, nonfinite_reason(label, kind))
