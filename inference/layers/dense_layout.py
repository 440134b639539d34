"""How the dense bf16/fp16 weights lie in memory on the CPU: as the checkpoint has them, or
prepacked once into oneDNN's blocked layout.

F.linear hands oneDNN a plain [out, in] weight, and oneDNN reorders (packs) it into its blocked
layout on every call: at a few rows that pass over the weight costs about as much as the
product. Packed once at start-up the decode products skip it: on a 2-core AMD EPYC (Zen 4,
capability AVX512) [32, 576] x [576, 3072] bf16 with the weights streaming from memory went
from 578 to 425 us, one row from 338 to 193 us, and a 64-request decode step over SmolLM2-135M
from ~72 to ~59 ms; a 2048-row prefill product is no faster and no slower. The packed product
is oneDNN's same kernel: bit for bit F.linear's result.

    plain    F.linear on the checkpoint's weight (what every other path reads)
    onednn   every projection's weight packed in place of the dense one (freed), and the LM
             head packed too (for a tied head a packed copy beside the embedding table, which
             the token lookup keeps reading)

"auto" times both on the first layer's projections for a decode batch and packs when that is
clearly faster (SWITCH_FACTOR), or when the matmul plan runs a shape class natively only because
native was timed on packed weights (matmul_plan.native_needs_packing); only where every shape class runs natively (an fp32 path reads
the dense weight), the weights are dense bf16/fp16 (not --weights-dtype int8/int4) and this
torch's oneDNN packs bf16 on this CPU. "onednn" / "plain" forces one (`--dense-layout`, env
INFERENCE_DENSE_LAYOUT). The choice is the matmul plan's `dense_layout`: logged, in
/v1/base_model and in loraplex:matmul_plan_info{shape_class="dense_layout"}.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from inference.layers.linear import Linear
from inference.layers.matmul_plan import NATIVE, MatmulPlan, native_needs_packing, race
from inference.layers.onednn_weight import PACK_ROWS_HINT, OneDnnWeight, packing_unavailable
from inference.layers.quantized import packed_weights

PLAIN, ONEDNN = "plain", "onednn"
DENSE_LAYOUT_CHOICES = ("auto", ONEDNN, PLAIN)
SWITCH_FACTOR = 0.9  # packing replaces the plain layout when it takes under this share of its time
RACE_ROWS = PACK_ROWS_HINT  # a decode batch: where the per-call reorder costs most of the product


def unavailable_reason(plan: MatmulPlan, model: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the weights cannot be packed here; None where they can."""
    if device.type != "cpu":
        return f"the weights are on {device.type}, oneDNN packs CPU weights"
    if packed_weights(model):
        return "the weights are quantised (--weights-dtype)"
    if any(path != NATIVE for path in plan.paths.values()):
        return "a shape class runs in fp32, which reads the dense weight"
    return packing_unavailable(dtype)


def with_dense_layout(
    plan: MatmulPlan, requested: str, model: nn.Module, dtype: torch.dtype, device: torch.device
) -> MatmulPlan:
    """`plan` with its dense weight layout: "plain"; "onednn" (RuntimeError where it cannot be
    used here, the reason given); "auto": the faster (see module doc), plain where packing is
    unavailable. Call before `pack_dense_weights`, which applies the choice."""
    if requested not in DENSE_LAYOUT_CHOICES:
        raise ValueError(f"dense layout must be one of {', '.join(DENSE_LAYOUT_CHOICES)}, got {requested!r}")
    if requested == PLAIN:
        return replace(plan, dense_layout=PLAIN)
    reason = unavailable_reason(plan, model, dtype, device)
    if reason is not None:
        if requested == ONEDNN:
            raise RuntimeError(f"dense layout onednn: {reason}")
        return replace(plan, dense_layout=PLAIN)
    if requested == ONEDNN:
        return replace(plan, dense_layout=ONEDNN)
    seconds = race(_decode_batch(model, dtype))
    # A class the plan runs natively only on packed weights settles it whatever this race says.
    best = ONEDNN if seconds[ONEDNN] < SWITCH_FACTOR * seconds[PLAIN] or native_needs_packing(plan) else PLAIN
    return replace(plan, dense_layout=best, timings={**plan.timings, "dense_layout": seconds})


def _decode_batch(model: nn.Module, dtype: torch.dtype) -> dict[str, object]:
    """RACE_ROWS rows through the first layer's projections, plain and packed: callables."""
    weights = [m.weight for m in model.layers[0].modules() if isinstance(m, Linear)]
    packed = [OneDnnWeight(w) for w in weights]
    inputs = [torch.randn(RACE_ROWS, w.shape[1]).to(dtype) for w in weights]

    def plain() -> None:
        for w, x in zip(weights, inputs, strict=True):
            torch.nn.functional.linear(x, w)

    def onednn() -> None:
        for w, x in zip(packed, inputs, strict=True):
            w.linear(x)

    return {PLAIN: plain, ONEDNN: onednn}


def pack_dense_weights(model: nn.Module) -> None:
    """In place: every Linear's weight packed (its dense weight freed), and the LM head's."""
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is None and module.weight.numel():
            module.packed = OneDnnWeight(module.weight)
            module.drop_dense_weight()
    if getattr(model, "lm_head_packed", None) is None:
        head = model.lm_head
        if head is not None:  # packed just above with the other Linears
            model.lm_head_packed = head.packed
        else:  # tied: the lookup keeps the table, the product gets a packed copy
            model.lm_head_packed = OneDnnWeight(model.embed_tokens.weight)
