"""Device slots: `max_loras` adapters resident in the model's LoRA-aware projections at once.

The model declares which projections take adapters (its LoRALinear modules, each naming the
PEFT modules of its output slices); `LoRASlots` preallocates their stacks and fills them:

    qkv_proj      slices q, k, v     A_s [max_loras, max_rank, hidden]   B_s [max_loras, n_s, max_rank]
    o_proj        slice o            A   [max_loras, max_rank, q_size]   B   [max_loras, hidden, max_rank]
    gate_up_proj  slices gate, up    A_s [max_loras, max_rank, hidden]   B_s [max_loras, inter, max_rank]
    down_proj     slice down         A   [max_loras, max_rank, inter]    B   [max_loras, hidden, max_rank]

Activating an adapter in slot k zeroes slot k of every stack and copies its A/B in at their
own rank; whatever it does not adapt (a projection, a layer) stays zero, which is exactly
"no delta" — and the kernels may read up to max_rank, so the zero padding matters.
`ranks[k]` is the adapter's rank (0: empty slot).

On a CPU the host tier's copy of a resident adapter is redundant (host and "device" are the
same memory): `share` frees the adapter's own A/B memory (its tensors become views of its slot
rows), `unshare` copies the rows back out before the slot is cleared or reused. Read through
`slot_weights`, the one place that knows where an adapter's rows lie in the stacks.

Each step, `batch_metadata(token_slots)` groups the step's tokens by slot once; the model
runner passes the result down the model's forward to every projection.
"""

from __future__ import annotations

import torch

from inference.layers.lora_linear import LoRALinear
from inference.lora.adapter import LoRAAdapter
from inference.lora.host_memory import HostArena
from kernels.metadata import LoRABatchMetadata, build_lora_metadata


class LoRASlots:
    def __init__(
        self,
        model: torch.nn.Module,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self.ranks = torch.zeros(max_loras, dtype=torch.long)  # [max_loras] host-side, 0 = empty
        # (decoder layer index, projection) for every LoRA-aware projection of the model
        self.projections: list[tuple[int, LoRALinear]] = [
            (layer_idx, module)
            for layer_idx, layer in enumerate(model.layers)
            for module in layer.modules()
            if isinstance(module, LoRALinear)
        ]
        for _, projection in self.projections:
            projection.create_slots(max_loras, max_rank, dtype, device)
        # (layer, PEFT module) -> (projection, slice index) holding that module's rows
        self._where: dict[tuple[int, str], tuple[LoRALinear, int]] = {
            (layer_idx, name): (projection, i)
            for layer_idx, projection in self.projections
            for i, name in enumerate(projection.slice_names)
        }

    # -- slot contents (the adapter cache's on_activate / on_deactivate) -------------------
    def activate(self, slot: int, adapter: LoRAAdapter) -> None:
        if adapter.rank > self.max_rank:  # validation enforces this; a slot cannot hold more
            raise ValueError(
                f"adapter {adapter.name!r} has rank {adapter.rank} > max_lora_rank {self.max_rank}"
            )
        for layer_idx, projection in self.projections:
            weights = [adapter.get(layer_idx, name) for name in projection.slice_names]
            projection.set_slot(slot, [None if w is None else (w.a, w.b) for w in weights])
        self.ranks[slot] = adapter.rank

    def deactivate(self, slot: int, *, zero: bool = True) -> None:
        """Empty `slot`. zero=False leaves its rows for `activate` to overwrite (it writes every
        element) or for `zero` later: see LoRALinear.clear_slot."""
        self.ranks[slot] = 0
        for _, projection in self.projections:
            projection.clear_slot(slot, zero=zero)

    def zero(self, slot: int) -> None:
        """Zero the rows an empty `slot` still holds after `deactivate(slot, zero=False)`."""
        if self.ranks[slot]:
            raise RuntimeError(f"slot {slot} holds an adapter: deactivate it first")
        for _, projection in self.projections:
            projection.zero_slot(slot)

    # -- the host tier sharing slot memory (CPU) ----------------------------------------------
    def slot_weights(self, slot: int, key: tuple[int, str], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Module `key` = (layer, PEFT module)'s rows in `slot`, at `rank`: (A [rank,
        in_features], B [n_s, rank]), in the stacks' dtype: views of the stacks, or copies where
        they pair their rows (LoRALinear.slice_rows)."""
        projection, i = self._where[key]
        return projection.slice_rows(i, slot, rank)

    def share(self, slot: int, adapter: LoRAAdapter) -> None:
        """After `activate(slot, adapter)`: free the adapter's own A/B memory, in place (every
        holder of the adapter object sees it). Stacks in the adapter's dtype: its tensors become
        views of its slot rows (same values). Stacks in another dtype (fp32 compute for a bf16
        adapter), or with their rows paired (no view shows them as [rank, in]): they become
        one-element placeholders of their shape, not to be read until `unshare`; nothing reads
        a resident adapter's host tensors (the slot is what runs)."""
        for key, w in adapter.weights.items():
            projection, i = self._where[key]
            if projection.rows_are_views and projection.lora_a[i].dtype == w.a.dtype == w.b.dtype:
                a, b = self.slot_weights(slot, key, w.rank)
                w.a.set_(a)  # [r, in]
                w.b.set_(b)  # [out, r], strided (the stack is max_rank wide)
            else:
                w.a.set_(w.a.new_zeros(1).expand(w.a.shape))
                w.b.set_(w.b.new_zeros(1).expand(w.b.shape))

    def unshare(self, slot: int, adapter: LoRAAdapter) -> None:
        """Before `slot` is cleared or reused: give a shared adapter's A/B memory of their own
        again, the slot rows copied out in the adapter's dtype (exact: they were converted from
        it), so the host tier still holds it. A projection whose every slice the adapter adapts
        at one rank is copied whole (a few contiguous copies: an eviction costs ~1 ms instead
        of ~8 for one strided copy per module, 9 MiB adapter, 2-core AMD EPYC); the others
        module by module, so the copy holds nothing the adapter does not. All in one HostArena
        block."""
        # One block for the whole copy (see host_memory: fresh memory faults page by page)
        arena = HostArena(HostArena.nbytes_for(
            [(tuple(t.shape), t.dtype) for w in adapter.weights.values() for t in (w.a, w.b)]
        ))  # fmt: skip
        for layer_idx, projection in self.projections:
            found = [adapter.weights.get((layer_idx, name)) for name in projection.slice_names]
            whole = None
            if (
                all(w is not None for w in found)
                and len({w.rank for w in found}) == 1
                and len({t.dtype for w in found for t in (w.a, w.b)}) == 1
            ):
                whole = projection.copy_slot(slot, found[0].rank, found[0].a.dtype, arena.copy, arena.empty)
            for i, w in enumerate(found):
                if w is None:
                    continue
                if whole is not None:
                    a, b = whole[i]
                else:
                    a, b = projection.copy_slice(i, slot, w.rank, adapter.dtype, arena.copy)
                w.a.set_(a)  # [r, in]
                w.b.set_(b)  # [n_s, r]

    # -- per step ----------------------------------------------------------------------------
    def batch_metadata(self, token_slots: torch.Tensor) -> LoRABatchMetadata | None:
        """This step's tokens grouped by slot, for every projection; None when no token has an
        adapter (the projections skip the delta).

        token_slots: [T] long on the CPU, -1 = base model only."""
        if not bool((token_slots >= 0).any()):
            return None
        return build_lora_metadata(token_slots, self.ranks, device=self.device)

    @property
    def nbytes(self) -> int:
        return sum(projection.lora_nbytes for _, projection in self.projections)
