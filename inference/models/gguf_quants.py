"""GGUF's 4-bit blocks read as int4 groups, for the int4 weights (inference/layers/quantized.py).

A row of a Q4_0 / Q4_1 tensor is a run of blocks of 32 weights (little-endian):

    Q4_0  d f16 | qs u8[16]            w = d·(q - 8)
    Q4_1  d f16 | m f16 | qs u8[16]    w = d·q + m

where q of weights 0..15 is the low nibble of qs[0..15] and q of weights 16..31 the high one.
Both are torch's int4 form w = (q - 8)·scale + zero with scale = d and zero = 0 (Q4_0) or
m + 8·d (Q4_1), so a block becomes one group of 32 without requantising.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

BLOCK = 32
INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}


def int4_groups(
    data: np.ndarray, qtype: GGMLQuantizationType, rows: int, cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw block bytes of a [rows, cols] tensor -> (q [rows, cols] uint8 0..15,
    scale [rows, cols/32] f32, zero [rows, cols/32] f32)."""
    if qtype not in _BLOCK_BYTES:
        raise ValueError(f"not a 4-bit block type: {qtype.name}")
    size = _BLOCK_BYTES[qtype]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // BLOCK, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nb]
    if qtype == GGMLQuantizationType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    qs = blocks[..., size - BLOCK // 2 :]  # [rows, nb, 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)  # low nibbles first
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero)
