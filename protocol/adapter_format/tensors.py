"""adapter_model.safetensors: the file well-formed, every tensor the lora_A / lora_B of a
targeted projection with this base's shapes, every value finite.

    read_header    safetensors' own parser judges the file (header length and JSON, dtypes,
                   offsets covering the data exactly: a truncated or padded file is refused); never
                   unpickled, no data read
    check_tensors  names, layers, modules, pairs, float dtypes, shapes
                   A [r, in_features], B [out_features, r]
    nonfinite      NaN / Inf in an array of a tensor's values (numpy; BF16 as its bit patterns)
    scan_values    nonfinite over the file itself, through memory maps in bounded chunks, for a
                   caller that does not read the tensors anyway (the engine checks those it reads)
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from protocol.adapter_format.files import CONFIG_FILE, WEIGHTS_FILE
from protocol.adapter_format.shapes import (
    SUPPORTED_MODULES,
    SUPPORTED_TEXT,
    BaseShapes,
    module_parent,
    module_path,
)
from protocol.adapter_format.targets import Targets

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors dtype names
SCAN_ELEMENTS = 1 << 20  # scan_values reads this many elements of a tensor at a time

# PEFT writes "base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight"; some versions
# keep the adapter name ("lora_A.default.weight"); a bare LlamaModel base drops one "model.".
TENSOR_KEY = re.compile(
    r"base_model\.model\.(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>[^.]+)\.(?P<module>[^.]+)"
    r"\.lora_(?P<ab>[AB])(?:\.(?P<infix>[^.]+))?\.weight"
)

Pairs = dict[tuple[int, str], tuple[str, str]]  # (layer, module) -> (key of A, key of B)
# what reading a header that changed since safetensors judged it may raise
_REREAD_ERRORS = (
    OSError,
    struct.error,
    ValueError,
    RecursionError,
    LookupError,
    TypeError,
    AttributeError,
)


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    start: int  # absolute file offsets of its data
    end: int


class Header(dict[str, TensorInfo]):
    """{tensor name: TensorInfo}, with the header's JSON bytes as the file held them (`json`):
    a reader of the whole file can tell that the header it finds is this one by comparing bytes,
    without parsing it again."""

    json: bytes = b""


def read_header(path: Path) -> tuple[Header | None, list[str]]:
    """{tensor name: TensorInfo} without reading any data, or None and why."""

    def corrupt(why: object) -> tuple[None, list[str]]:
        return None, [f"{WEIGHTS_FILE} is corrupt or truncated: {why}"]

    try:
        with safe_open(path, framework="numpy"):
            pass  # opening is the check: safetensors validates the whole layout
    except (SafetensorError, OSError) as e:
        return corrupt(e)
    try:  # the judged header, read for the data offsets safetensors does not expose
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            raw = f.read(n)
            header = json.loads(raw)
        header.pop("__metadata__", None)
        tensors = Header({
            key: TensorInfo(
                str(info["dtype"]),
                tuple(int(d) for d in info["shape"]),
                8 + n + int(info["data_offsets"][0]),
                8 + n + int(info["data_offsets"][1]),
            )
            for key, info in header.items()
        })
        tensors.json = raw
    except _REREAD_ERRORS as e:
        return corrupt(f"it changed while it was being read ({e!r})")
    if not tensors:
        return None, [f"{WEIGHTS_FILE} holds no tensors (empty adapter)"]
    return tensors, []


def check_tensors(
    header: Mapping[str, TensorInfo], targets: Targets | None, base: BaseShapes
) -> tuple[Pairs | None, list[str]]:
    """Pair every tensor with the A or B of a targeted projection of `base`, or None and every
    reason one does not fit. Targeted projections without tensors are fine (the adapter skips
    them). Without `targets` (the config was refused) what the config does not decide is still
    checked: names, layers in range, modules, pairs, dtypes, features (whatever the rank)."""
    reasons: list[str] = []
    halves = _halves(header, targets, base.num_hidden_layers, reasons)
    shapes = base.module_shapes()
    pairs: Pairs = {}
    for (layer, module), half in sorted(halves.items()):
        path = module_path(layer, module)
        missing = [ab for ab in "AB" if ab not in half]
        if missing:
            other = half["B" if missing[0] == "A" else "A"]
            reasons.append(f"{path} has {other!r} but no lora_{missing[0]} weight")
            continue
        in_features, out_features = shapes[module]
        shape_a = header[half["A"]].shape
        if targets is not None:
            rank = targets[(layer, module)][0]
        else:  # the config was refused: check the features, whatever the rank
            rank = shape_a[0] if len(shape_a) == 2 else None
        want = {"A": (rank, in_features), "B": (out_features, rank)}
        for ab, (rows, cols) in want.items():
            got = header[half[ab]].shape
            if rank is None or got != (rows, cols):
                layout = (
                    f"[r={rank}, in_features={in_features}]"
                    if ab == "A"
                    else f"[out_features={out_features}, r={rank}]"
                )
                reasons.append(
                    f"tensor {half[ab]!r} has shape {list(got)}; {path} of the base model needs "
                    f"{[rows, cols]} {layout}"
                )
        pairs[(layer, module)] = (half["A"], half["B"])
    return (None, reasons) if reasons else (pairs, [])


def _halves(
    header: Mapping[str, TensorInfo], targets: Targets | None, num_layers: int, reasons: list[str]
) -> dict[tuple[int, str], dict[str, str]]:
    """{(layer, module): {"A": key, "B": key}} of the tensors whose names fit, in name order."""
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for key in sorted(header):
        m = TENSOR_KEY.fullmatch(key)
        if m is None:
            reasons.append(
                f"unexpected tensor {key!r}: not the lora_A/lora_B weight of a decoder layer's projection"
            )
            continue
        layer, module = int(m["layer"]), m["module"]
        if layer >= num_layers:
            reasons.append(
                f"tensor {key!r} is for layer {layer}; the base model has {num_layers} layers "
                f"(0-{num_layers - 1})"
            )
            continue
        if module not in SUPPORTED_MODULES or m["parent"] != module_parent(module):
            reasons.append(
                f"tensor {key!r} is for module {m['parent']}.{module}, which the base model does "
                f"not have as a LoRA target (supported: {SUPPORTED_TEXT})"
            )
            continue
        if targets is not None and (layer, module) not in targets:
            reasons.append(
                f"tensor {key!r} is for {module_path(layer, module)}, which {CONFIG_FILE} does "
                "not target (target_modules / exclude_modules / layers_to_transform)"
            )
            continue
        half = halves.setdefault((layer, module), {})
        if m["ab"] in half:
            reasons.append(f"tensors {half[m['ab']]!r} and {key!r} are the same weight")
            continue
        half[m["ab"]] = key
        if header[key].dtype not in FLOAT_DTYPES:
            reasons.append(
                f"tensor {key!r} has dtype {header[key].dtype}; expected one of {FLOAT_DTYPES}"
            )
    return halves


# --- values ------------------------------------------------------------------------------------

# Each float format's exponent field (all ones: Inf when the mantissa is 0, else NaN) and
# mantissa field, and the unsigned integer type its bit patterns are read as.
_SPECIAL_BITS = {
    "BF16": (np.uint16, 0x7F80, 0x007F),
    "F16": (np.uint16, 0x7C00, 0x03FF),
    "F32": (np.uint32, 0x7F80_0000, 0x007F_FFFF),
    "F64": (np.uint64, 0x7FF0_0000_0000_0000, 0x000F_FFFF_FFFF_FFFF),
}


def nonfinite(values: np.ndarray, dtype: str) -> str | None:
    """ "NaN" (when there is one), else "Inf" (when there is one), else None, for the values of a
    tensor of safetensors dtype `dtype` (F16 / BF16 / F32 / F64). `values` may be the floats
    themselves or any array of the same item size holding their bytes (numpy has no bfloat16)."""
    uint, exponent, mantissa = _SPECIAL_BITS[dtype]
    bits = values.view(uint)
    # The usual all-finite array in one masked max (a third faster than selecting the specials)
    if bits.size == 0 or np.bitwise_and(bits, uint(exponent)).max() != exponent:
        return None
    special = bits[(bits & exponent) == exponent]
    return "NaN" if (special & mantissa).any() else "Inf"


def nonfinite_reason(label: str, kind: str) -> str:
    return f"tensor {label!r} contains {kind} values"


def scan_values(path: Path, header: Mapping[str, TensorInfo]) -> list[str]:
    """A reason for every float tensor in the file holding NaN or Inf, in name order, read
    through a memory map SCAN_ELEMENTS at a time (bounded memory, whatever the file's size)."""
    reasons = []
    for key in sorted(header):
        t = header[key]
        if t.dtype not in _SPECIAL_BITS:
            continue
        uint = np.dtype(_SPECIAL_BITS[t.dtype][0]).newbyteorder("<")
        count = (t.end - t.start) // uint.itemsize
        if count == 0:
            continue
        data = np.memmap(path, dtype=uint, mode="r", offset=t.start, shape=(count,))
        try:
            for i in range(0, count, SCAN_ELEMENTS):
                if kind := nonfinite(data[i : i + SCAN_ELEMENTS], t.dtype):
                    reasons.append(nonfinite_reason(key, kind))
                    break
        finally:
            del data
    return reasons
