"""Which kernel multiplies weight-only quantised weights (--weights-dtype int8/int4) on this CPU,
measured at start-up: torch's or the fused C++ one (inference/layers/quantized.py says how each
computes).

They differ by CPU: torch's widens every weight to float (on an AVX2-only AMD EPYC it ran
the model's int4 projections at ~5-7 GB/s with the weights in cache, compute-bound); the fused
one quantises the activations to int8 and multiplies in integers (1.5x faster there at one token;
alike at 64). Where AVX-512 widens torch's kernels the order may flip, so "auto" times both on
the first layer's own projections for one decode token (what quantised weights are for: a step
reads every weight for a few tokens) and takes the faster; the fused kernel must win by
SWITCH_FACTOR, since it also rounds the activations to int8 (llama.cpp's Q8 activations: bench/
single_stream.py prints greedy agreement and perplexity beside the speed). "fused" or "torch"
forces one (`--quant-kernel`, env INFERENCE_QUANT_KERNEL). The choice is the matmul plan's
`quant_kernel`: logged, in /v1/base_model and in loraplex:matmul_plan_info{shape_class=
"quant_kernel"}; apply_plan gives it to every quantised weight.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from torch import nn

from inference.layers.matmul_plan import FUSED_KERNEL, TORCH_KERNEL, MatmulPlan, race
from inference.layers.quantized import PackedWeight, packed_weights
from kernels import cpu_fused

QUANT_KERNEL_CHOICES = ("auto", FUSED_KERNEL, TORCH_KERNEL)
SWITCH_FACTOR = 0.9  # the fused kernel replaces torch's when it takes under this share of its time


def with_quant_kernel(plan: MatmulPlan, requested: str, model: nn.Module, dtype: torch.dtype) -> MatmulPlan:
    """`plan` with its quantised-weight kernel: "torch"; "fused" (RuntimeError where it cannot be
    built here, the reason given); "auto": the faster (see module doc), torch where the fused one
    is unavailable. A model without quantised weights keeps torch (nothing runs either)."""
    if requested not in QUANT_KERNEL_CHOICES:
        raise ValueError(f"quant kernel must be one of {', '.join(QUANT_KERNEL_CHOICES)}, got {requested!r}")
    packs = packed_weights(model)
    if requested == TORCH_KERNEL or not packs:
        return replace(plan, quant_kernel=TORCH_KERNEL)
    op = cpu_fused.fused_op()  # builds (or loads) the library that holds the quantised ops
    if op is None:
        if requested == FUSED_KERNEL:
            raise RuntimeError(f"quant kernel fused: cannot be built here ({cpu_fused.unavailable_reason()})")
        return replace(plan, quant_kernel=TORCH_KERNEL)
    if not all(w.can_use(FUSED_KERNEL) for w in packs):  # already repacked for torch's kernel
        if requested == FUSED_KERNEL:
            raise RuntimeError("quant kernel fused: the weights are already packed for torch's kernel")
        return replace(plan, quant_kernel=TORCH_KERNEL)
    if requested == FUSED_KERNEL:
        return replace(plan, quant_kernel=FUSED_KERNEL)
    sample = _first_layer(model, packs)
    seconds = race({kernel: _decode_token(sample, kernel, dtype) for kernel in (TORCH_KERNEL, FUSED_KERNEL)})
    best = FUSED_KERNEL if seconds[FUSED_KERNEL] < SWITCH_FACTOR * seconds[TORCH_KERNEL] else TORCH_KERNEL
    return replace(plan, quant_kernel=best, timings={**plan.timings, "quant_kernel": seconds})


def _first_layer(model: nn.Module, packs: list[PackedWeight]) -> list[PackedWeight]:
    layers = getattr(model, "layers", None)
    if layers is not None and len(layers):
        first = packed_weights(layers[0])
        if first:
            return first
    return packs[:1]


def _decode_token(sample: list[PackedWeight], kernel: str, dtype: torch.dtype):
    """One token through copies of `sample` on `kernel` (the model's own weights are repacked
    only once the choice is made): a callable."""
    weights = []
    for weight in sample:
        twin = copy.copy(weight)  # shares the tensors; use_kernel rebinds, never writes them
        twin.use_kernel(kernel)
        weights.append(twin)
    inputs = [torch.randn(1, w.in_features).to(dtype) for w in weights]

    def run() -> None:
        for w, x in zip(weights, inputs, strict=True):
            w.linear(x)

    return run
