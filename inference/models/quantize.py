"""--weights-dtype int8 / int4: the model's projections as weight-only quantised weights.

    quantize_model(model, checkpoint, "int4")

Every projection of every layer (qkv, o, gate_up, down) gets a `packed` weight
(inference/layers/quantized.py) and its dense `weight` is freed; the LM head (the tied
embedding or lm_head) gets `model.lm_head_packed`. The embedding lookup keeps its dense
table (a lookup reads one row per token).

    int8  every projection and the head: int8 per output row, requantised from the dense weight
    int4  projections: int4 per group of 32, taken as they are from a GGUF file's Q4_0/Q4_1
          blocks (no requantising), else requantised from the dense weight (min/max per group);
          the head stays int8: its error goes straight into the logits (llama.cpp's 4-bit files
          keep it at 6-8 bits too)
"""

from __future__ import annotations

import torch
from torch import nn

from inference.layers.linear import Linear
from inference.layers.quantized import (
    Int4Weight,
    Int8Weight,
    PackedWeight,
    int4_fits,
    packed_weights,
)
from inference.models.llama import LlamaForCausalLM

WEIGHTS_DTYPES = ("auto", "int8", "int4")  # auto: dense weights in the engine's dtype


def quantize_model(model: LlamaForCausalLM, checkpoint: object, weights_dtype: str) -> None:
    """In place. `checkpoint` may offer `read_int4_groups(name)` (GGUF files do)."""
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype: expected one of {', '.join(WEIGHTS_DTYPES)}, got {weights_dtype!r}")
    if weights_dtype == "auto":
        return
    read_groups = getattr(checkpoint, "read_int4_groups", None)
    for name, module in model.layers.named_modules(prefix="layers"):
        if not isinstance(module, Linear):
            continue
        packed: PackedWeight | None = None
        if weights_dtype == "int4" and int4_fits(module.out_features, module.in_features):
            groups = read_groups(f"{name}.weight") if read_groups else None
            packed = Int4Weight(*groups) if groups else Int4Weight.quantize(module.weight)
        module.packed = Int8Weight.quantize(module.weight) if packed is None else packed
        module.drop_dense_weight()
    head = model.lm_head
    model.lm_head_packed = Int8Weight.quantize(
        model.embed_tokens.weight if head is None else head.weight
    )
    if head is not None:
        head.drop_dense_weight()


def packed_nbytes(model: nn.Module) -> int:
    """Bytes held by quantised weights (not parameters, so `model.parameters()` misses them)."""
    return sum(p.nbytes for p in packed_weights(model))
