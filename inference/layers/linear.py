"""Linear: y = x·Wᵀ (+ b), computed the way this machine's matmul plan says (matmul_plan.py).

Every projection and the LM head go through `linear`. On the CPU a bf16/fp16 product takes the
path the plan names for its row count: native (F.linear in the model dtype), fp32-upcast (the
weight upcast a slab at a time) or fp32-cached (an fp32 copy of the weight kept beside it);
both fp32 paths accumulate in fp32 and round the result to the model dtype once. fp32 inputs
and CUDA always take F.linear. `apply_plan` hands a model its plan (the engine calls it once,
after calibrating) and makes the fp32 copies the plan needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference.layers.matmul_plan import NATIVE, MatmulPlan, capability_plan, linear_fp32

DEFAULT_PLAN = capability_plan()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    plan: MatmulPlan = DEFAULT_PLAN,
    weight32: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, in] @ weight [out, in].T (+ bias) -> [T, out] in x's dtype, on the plan's path."""
    if upcasts_to_fp32(x, plan):
        return linear_fp32(x.float(), weight, bias, weight32).to(x.dtype)
    return F.linear(x, weight, bias)


def upcasts_to_fp32(x: torch.Tensor, plan: MatmulPlan = DEFAULT_PLAN) -> bool:
    """Whether the plan computes this bf16/fp16 CPU input in fp32 (and rounds once at the end)."""
    return (
        x.dtype != torch.float32
        and x.device.type == "cpu"
        and plan.path_for(x.shape[0]) != NATIVE
    )


class Linear(nn.Module):
    """y = x·Wᵀ (+ b), weight [out_features, in_features].

    A fused projection lists its slices in `output_sizes` (qkv_proj: [q, k, v]; gate_up_proj:
    [gate, up]); LoRALinear places one adapter matrix per slice by them.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.plan = DEFAULT_PLAN
        # fp32 copy of the weight when the plan has an fp32-cached class; not a checkpoint tensor
        self.weight32: torch.Tensor | None = None
        # --weights-dtype int8/int4: the quantised weight (inference/layers/quantized.py) that
        # replaces `weight` (then freed); None: dense
        self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return self.base_product(x)

    def base_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> x·Wᵀ (+ b) [T, out] in x's dtype: packed, or on the plan's path."""
        if self.packed is not None:
            out = self.packed.linear(x)
            return out if self.bias is None else out.add_(self.bias)
        return linear(x, self.weight, self.bias, plan=self.plan, weight32=self.weight32)

    def set_plan(self, plan: MatmulPlan) -> None:
        self.plan = plan
        if self.packed is not None:
            self.packed.use_kernel(plan.quant_kernel)
        wants_copy = plan.caches_fp32 and self.packed is None and self.weight.dtype != torch.float32
        self.weight32 = self.weight.detach().float() if wants_copy else None

    def drop_dense_weight(self) -> None:
        """Free the dense weight once `packed` holds it in another form: [0, in], so nothing is
        held and a forward that ignored `packed` would fail on the shape at once."""
        self.weight = nn.Parameter(
            torch.empty(0, self.in_features, dtype=self.weight.dtype, device=self.weight.device),
            requires_grad=False,
        )

    @property
    def weight32_nbytes(self) -> int:
        return 0 if self.weight32 is None else self.weight32.nbytes

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, output_sizes={self.output_sizes}, bias={self.bias is not None}"
        )


def apply_plan(model: nn.Module, plan: MatmulPlan) -> None:
    """Give every Linear of `model` the plan (and the fp32 weight copies it needs); the model's
    own `plan` attribute serves products outside a Linear (a tied LM head)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.set_plan(plan)
    head = getattr(model, "lm_head_packed", None)
    if head is not None:
        head.use_kernel(plan.quant_kernel)
    model.plan = plan
