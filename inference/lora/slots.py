"""Device slots: preallocated stacked LoRA weights, and the hook that adds them in the model.

Every projection of every decoder layer gets, per output slice, a stack over the slots:

    qkv_proj      slices q, k, v     A_s [max_loras, max_rank, hidden]   B_s [max_loras, n_s, max_rank]
    o_proj        slice o            A   [max_loras, max_rank, q_size]   B   [max_loras, hidden, max_rank]
    gate_up_proj  slices gate, up    A_s [max_loras, max_rank, hidden]   B_s [max_loras, inter, max_rank]
    down_proj     slice down         A   [max_loras, max_rank, inter]    B   [max_loras, hidden, max_rank]

Activating an adapter in slot k zeroes slot k of every stack and copies its A/B in at their
own rank; whatever it does not adapt (a projection, a layer) stays zero, which is exactly
"no delta" — and the kernels may read up to max_rank, so the zero padding matters.
`ranks[k]` is the adapter's rank (0: empty slot).

The model's `Linear` modules call `lora.apply(out, x)` when a `LoRAProjection` is attached;
each step the model runner sets one `LoRABatchMetadata` for all of them (`begin_step`), so
the token grouping is built once per step, not once per layer.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from kernels.lora_ops import add_lora
from kernels.metadata import LoRABatchMetadata, build_lora_metadata

# Fused projection of the model -> the PEFT modules of its output slices, in order.
PROJECTION_SLICES: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


class _StepBatch:
    """The current step's token grouping, shared by every projection."""

    meta: LoRABatchMetadata | None = None


class LoRAProjection:
    """The stacked weights of one fused projection of one layer, and its forward hook."""

    def __init__(
        self,
        layer_idx: int,
        modules: tuple[str, ...],
        in_features: int,
        output_sizes: list[int],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        batch: _StepBatch,
    ) -> None:
        self.layer_idx = layer_idx
        self.modules = modules
        self.batch = batch
        self.a = [torch.zeros(max_loras, max_rank, in_features, dtype=dtype, device=device) for _ in modules]
        self.b = [torch.zeros(max_loras, n, max_rank, dtype=dtype, device=device) for n in output_sizes]
        self.offsets = [0, *accumulate(output_sizes)][:-1]
        # Slots with weights in each slice. Only slices some resident adapter adapts are
        # multiplied: an all-q/v fleet pays nothing for k (the kernels take any slice subset).
        self._live: list[set[int]] = [set() for _ in modules]
        self._active: tuple[list[torch.Tensor], list[torch.Tensor], list[int]] | None = None

    @property
    def active(self) -> bool:
        """Some token of this step has an adapter and some resident adapter adapts this projection."""
        return self.batch.meta is not None and self._active is not None

    def apply(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out [T, out_features] += per-token LoRA delta of x [T, in_features]."""
        meta, active = self.batch.meta, self._active
        if meta is None or active is None:
            return
        add_lora(out, x, active[0], active[1], meta, active[2])

    def set_slot(self, slot: int, adapter) -> None:
        for i, module in enumerate(self.modules):
            self.a[i][slot].zero_()
            self.b[i][slot].zero_()
            w = adapter.get(self.layer_idx, module)
            if w is None:
                self._live[i].discard(slot)
                continue
            r = w.rank
            self.a[i][slot, :r].copy_(w.a, non_blocking=True)  # [r, in]
            self.b[i][slot, :, :r].copy_(w.b, non_blocking=True)  # [n_s, r], scale folded in
            self._live[i].add(slot)
        self._refresh()

    def clear_slot(self, slot: int) -> None:
        for i in range(len(self.modules)):
            if slot in self._live[i]:
                self.a[i][slot].zero_()
                self.b[i][slot].zero_()
                self._live[i].discard(slot)
        self._refresh()

    def _refresh(self) -> None:
        live = [i for i, slots in enumerate(self._live) if slots]
        # Swapped in as one tuple, so a forward reading it sees either the old set or the new.
        self._active = (
            ([self.a[i] for i in live], [self.b[i] for i in live], [self.offsets[i] for i in live])
            if live
            else None
        )

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.a + self.b)


class LoRASlots:
    """`max_loras` device slots of width `max_rank`, attached to every projection of `model`."""

    def __init__(
        self, model: torch.nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.ranks = torch.zeros(max_loras, dtype=torch.long)  # [max_loras] host-side, 0 = empty
        self._batch = _StepBatch()
        self.projections: list[LoRAProjection] = []
        for layer_idx, layer in enumerate(model.layers):
            for path, modules in PROJECTION_SLICES.items():
                linear = layer.get_submodule(path)
                proj = LoRAProjection(
                    layer_idx, modules, linear.in_features, linear.output_sizes,
                    max_loras, max_rank, dtype, device, self._batch,
                )  # fmt: skip
                linear.lora = proj
                self.projections.append(proj)

    # -- slot contents (the adapter cache's on_activate / on_deactivate) -------------------
    def activate(self, slot: int, adapter) -> None:
        if adapter.rank > self.max_rank:  # validation enforces this; a slot cannot hold more
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank} > max_lora_rank {self.max_rank}")
        for proj in self.projections:
            proj.set_slot(slot, adapter)
        self.ranks[slot] = adapter.rank

    def deactivate(self, slot: int) -> None:
        self.ranks[slot] = 0
        for proj in self.projections:
            proj.clear_slot(slot)

    # -- per step ----------------------------------------------------------------------------
    def begin_step(self, token_slots: torch.Tensor) -> None:
        """Group this step's tokens by slot once, for every projection.

        token_slots: [T] long on the CPU, -1 = base model only."""
        if not bool((token_slots >= 0).any()):
            self._batch.meta = None
            return
        self._batch.meta = build_lora_metadata(token_slots, self.ranks, device=self.device)

    def end_step(self) -> None:
        self._batch.meta = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.projections)
