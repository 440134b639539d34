"""LoRALinear: a Linear whose output takes, per token, the delta of that token's adapter.

    y[t] = x[t]·Wᵀ (+ b) + Σ_s (x[t]·A_s[slot]ᵀ)·B_s[slot]ᵀ      slot = the token's adapter slot
                                                              (none: the base product alone)

Per output slice s (q, k, v of qkv_proj; gate, up of gate_up_proj; the one slice of o_proj and
down_proj) the layer holds a stack over the device slots, zero beyond each adapter's rank:

    A_s [max_loras, max_rank, in_features]     B_s [max_loras, n_s, max_rank]   (scale in B)

On the CPU both are views of the kernels' CpuStacks (kernels/cpu_stacks.py): every slice's Aᵀ
in one rank-major tensor and each slice's Bᵀ contiguous,

    A_t [max_loras, in_features, max_rank·S]   A_s = A_t[:, :, s::S]ᵀ      B_s = B_t[s]ᵀ

so one shrink reads x once for every slice of a fused projection (q/k/v, gate/up) and no
product takes a transposed operand. The stacks' dtype is the plan's LoRA dtype
(fp32 where this CPU multiplies fp32 faster: converted once when a slot fills, never per step).
Where the plan runs the fused kernel on bf16 stacks and this CPU's build has its AVX512-BF16
path, the stacks keep their rows in pairs as that path multiplies them (CpuStacks.paired): then
lora_a / lora_b are 4-D views, and `slice_rows` reads a slot's rows back as copies.

Until `create_slots` runs (the engine does when LoRA is enabled) there are no stacks and it
is a plain Linear. Filling and clearing slots is the LoRA slot manager's job
(inference/lora/slots.py); which tokens use which slot arrives with each forward as the step's
`LoRABatchMetadata`, built once per step for every layer. All adapters of a step are added
in one `add_lora` call per projection (kernels/lora_ops.py).

The stacks are plain attributes, not parameters or buffers: they are not checkpoint weights
(the state dict and its loaders never see them) and are counted apart in memory stats.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import torch

from inference.layers.linear import Linear, upcasts_to_fp32
from inference.layers.matmul_plan import FUSED_KERNELS, linear_fp32
from kernels import cpu_fused
from kernels.cpu_stacks import CpuStacks, cpu_stacks, pairs_rows
from kernels.lora_ops import add_lora, add_lora_cpu, add_lora_cpu_fused
from kernels.metadata import LoRABatchMetadata

# (a [r, in_features], b [n_s, r] with the scale folded in) for one slice, or None: not adapted
SliceWeights = tuple[torch.Tensor, torch.Tensor] | None
# (source, dtype) -> a contiguous copy of the source in dtype (a HostArena's copy)
CopyOut = Callable[[torch.Tensor, torch.dtype], torch.Tensor]
Empty = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # memory to copy into (contents undefined)


class LoRALinear(Linear):
    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        *,
        slice_names: Sequence[str],
        bias: bool = False,
    ) -> None:
        """slice_names: the PEFT module of each output slice, e.g. ("q_proj", "k_proj", "v_proj")."""
        super().__init__(in_features, output_sizes, bias=bias)
        if len(slice_names) != len(self.output_sizes):
            raise ValueError(
                f"slice_names: {len(slice_names)} names for {len(self.output_sizes)} output slices"
            )
        self.slice_names = tuple(slice_names)
        self.slice_offsets = [0, *accumulate(self.output_sizes)][:-1]
        self.lora_a: list[torch.Tensor] = []  # per slice [max_loras, max_rank, in_features]
        self.lora_b: list[torch.Tensor] = []  # per slice [max_loras, n_s, max_rank]
        # Slots with weights in each slice. Only slices some resident adapter adapts are
        # multiplied: an all-q/v fleet pays nothing for k (the kernels take any slice subset).
        self._cpu_stacks: CpuStacks | None = None  # CPU: the memory lora_a / lora_b view
        self._filled: list[set[int]] = []
        # The filled slices' stacks (see _Live); None: nothing to add.
        self._live: _Live | None = None
        self._live_index: list[int] = []  # the slices _live holds

    # -- slots (the slot manager, on the engine's step thread) ------------------------------
    def create_slots(
        self, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Preallocate zeroed stacks for `max_loras` adapters of rank up to `max_rank`, in `dtype`
        (the LoRA compute dtype)."""
        if device.type == "cpu":
            paired = self.plan.lora_kernel in FUSED_KERNELS and pairs_rows(dtype, self.in_features, max_rank)
            tile_rows = self.plan.lora_tile_rows if paired and cpu_fused.tiles_bf16() else 0
            self._cpu_stacks, self.lora_a, self.lora_b = cpu_stacks(
                max_loras, max_rank, self.in_features, self.output_sizes, dtype, paired, tile_rows
            )
        else:  # the Triton kernels take one contiguous stack per slice
            self._cpu_stacks = None
            self.lora_a = [
                torch.zeros(max_loras, max_rank, self.in_features, dtype=dtype, device=device)
                for _ in self.output_sizes
            ]
            self.lora_b = [
                torch.zeros(max_loras, n, max_rank, dtype=dtype, device=device)
                for n in self.output_sizes
            ]
        self._filled = [set() for _ in self.output_sizes]
        self._live = None  # new stacks: nothing of the old ones' views is kept
        self._refresh()

    def set_slot(self, slot: int, weights: Sequence[SliceWeights]) -> None:
        """Put one adapter's matrices (one entry per slice, in slice_names order) in `slot`."""
        if len(weights) != len(self.output_sizes):
            raise ValueError(f"weights: {len(weights)} entries for {len(self.output_sizes)} slices")
        if self._cpu_stacks is not None:  # either of its layouts (see CpuStacks.write_slot)
            self._cpu_stacks.write_slot(slot, weights)
        else:
            self._set_device_slot(slot, weights)
        for i, w in enumerate(weights):
            if w is None:
                self._filled[i].discard(slot)
            else:
                self._filled[i].add(slot)
        self._refresh()

    def _set_device_slot(self, slot: int, weights: Sequence[SliceWeights]) -> None:
        for i, w in enumerate(weights):
            if w is None:
                self.lora_a[i][slot].zero_()
                self.lora_b[i][slot].zero_()
            else:  # each element written once: the adapter's rows, then zeros past its rank
                a, b = w
                r = a.shape[0]
                self.lora_a[i][slot, :r].copy_(a, non_blocking=True)  # [r, in]
                self.lora_b[i][slot, :, :r].copy_(b, non_blocking=True)  # [n_s, r]
                if r < self.lora_a[i].shape[1]:
                    self.lora_a[i][slot, r:].zero_()
                    self.lora_b[i][slot, :, r:].zero_()

    def clear_slot(self, slot: int, *, zero: bool = True) -> None:
        """Empty `slot`: its delta is no longer added. zero=False leaves its rows as they are,
        for `zero_slot` later or for `set_slot` to overwrite: an empty slot is never read (no
        token maps to it) and set_slot writes every element of a slot, so an eviction that
        refills the slot at once skips a pass over it."""
        for filled in self._filled:
            filled.discard(slot)
        self._refresh()
        if zero:
            self.zero_slot(slot)

    def zero_slot(self, slot: int) -> None:
        """Zero every row of an empty `slot` (what `clear_slot(zero=False)` left)."""
        if any(slot in filled for filled in self._filled):
            raise RuntimeError(f"slot {slot} holds an adapter: clear it first")
        stacks = self._cpu_stacks
        if stacks is not None:  # the slot's rows in one pass per stack, not one per slice
            stacks.a_t[slot].zero_()
            for b in stacks.b_t:
                b[slot].zero_()
        else:
            for stack in (*self.lora_a, *self.lora_b):
                stack[slot].zero_()

    def copy_slot(
        self, slot: int, rank: int, dtype: torch.dtype, copy: CopyOut, empty: Empty | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every slice's rows of `slot` at `rank`, copied out in `dtype` by `copy`: per slice
        (A [rank, in], B [n_s, rank]), views of one copy of the CPU stacks' slot (one contiguous
        pass for A and one per slice for B, not one strided copy per slice; paired stacks in
        bf16: one pass of the kernels' library into memory from `empty`, CpuStacks.read_slot;
        else slice by slice, copy_slice). None where that copy would hold more than those views
        show (not on the CPU, or `rank` beyond the stacks')."""
        stacks = self._cpu_stacks
        if stacks is None or not 1 <= rank <= stacks.max_rank:
            return None
        n = stacks.num_slices
        if stacks.paired:  # no view shows a paired row as [rank, in]
            read = stacks.read_slot(slot, rank, empty) if empty is not None and dtype == torch.bfloat16 else None
            return read or [self.copy_slice(s, slot, rank, dtype, copy) for s in range(n)]
        a_t = copy(stacks.a_t[slot, :, : rank * n], dtype)  # [in, rank·S], rank-major
        return [(a_t[:, s::n].T, copy(stacks.b_t[s][slot, :rank], dtype).T) for s in range(n)]

    @property
    def rows_are_views(self) -> bool:
        """Whether `slice_rows` hands out views of the stacks (not where they pair their rows)."""
        return self._cpu_stacks is None or not self._cpu_stacks.paired

    def copy_slice(
        self, i: int, slot: int, rank: int, dtype: torch.dtype, copy: CopyOut
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slice i's rows of `slot` at `rank`, (A [rank, in], B [n_s, rank]), copied out in `dtype`
        by `copy`: one copy each, paired bf16 rows at an even rank too (copied as int32 pairs)."""
        stacks = self._cpu_stacks
        if stacks is not None and stacks.paired and dtype == torch.bfloat16 and rank % 2 == 0:
            return tuple(copy(t, torch.int32).view(dtype) for t in stacks.slice_pairs(i, slot, rank))
        a, b = self.slice_rows(i, slot, rank)  # paired: copies already (an odd rank, another dtype)
        return copy(a, dtype), copy(b, dtype)

    def slice_rows(self, i: int, slot: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slice i's rows in `slot` at `rank`: (A [rank, in], B [n_s, rank]) in the stacks' dtype,
        views of the stacks (rows_are_views) or copies."""
        if self._cpu_stacks is not None:
            return self._cpu_stacks.slice_rows(i, slot, rank)
        return self.lora_a[i][slot, :rank], self.lora_b[i][slot, :, :rank]

    def _refresh(self) -> None:
        live = [i for i, filled in enumerate(self._filled) if filled]
        if self._live is not None and live == self._live_index:
            return  # same slices as before: the stacks' views are the same tensors
        self._live_index = live
        # Swapped in as one tuple, so a forward reading it sees either the old set or the new.
        self._live = (
            (
                [self.lora_a[i] for i in live],
                [self.lora_b[i] for i in live],
                [self.slice_offsets[i] for i in live],
                None if self._cpu_stacks is None else self._cpu_stacks.with_index(live),
            )
            if live
            else None
        )

    @property
    def adapted(self) -> bool:
        """Some slot holds an adapter that adapts this projection."""
        return self._live is not None

    @property
    def lora_nbytes(self) -> int:
        stacks = self._cpu_stacks
        if stacks is not None:
            return stacks.a_t.nbytes + sum(t.nbytes for t in stacks.b_t)
        return sum(t.nbytes for t in self.lora_a) + sum(t.nbytes for t in self.lora_b)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, lora_meta: LoRABatchMetadata | None = None) -> torch.Tensor:
        # x [T, in] -> [T, out]; lora_meta None: no token of this step has an adapter
        live = self._live
        if lora_meta is None or live is None:
            return super().forward(x)
        if self.packed is None and upcasts_to_fp32(x, self.plan):
            x32 = x.float()  # [T, in]
            out32 = linear_fp32(x32, self.weight, self.bias, self.weight32)  # [T, out] fp32
            if live[0][0].dtype == x.dtype:
                # Stacks in the model dtype (the plan found the fused kernel faster on them, at
                # half fp32's bytes): the delta as the plan timed it, on x as it is, added to the
                # rounded product as on the native path (fp32 x would widen every weight).
                out = out32.to(x.dtype)
                _add_delta(live, out, x, lora_meta, self.plan.lora_kernel)
                return out
            # fp32 stacks: the delta added to the fp32 product, in place, and rounded once (no
            # second upcast of x, no [T, out] temporary).
            _add_delta(live, out32, x32, lora_meta, self.plan.lora_kernel)
            return out32.to(x.dtype)
        out = self.base_product(x)  # [T, out]: native (or a quantised weight's product)
        _add_delta(live, out, x, lora_meta, self.plan.lora_kernel)
        return out


    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, slice_names={self.slice_names}"


# (A stacks, B stacks, column offsets, CPU stacks) of a LoRALinear's adapted slices
_Live = tuple[list[torch.Tensor], list[torch.Tensor], list[int], CpuStacks | None]


def _add_delta(
    live: _Live, out: torch.Tensor, x: torch.Tensor, lora_meta: LoRABatchMetadata, kernel: str
) -> None:
    a, b, offsets, stacks = live
    if stacks is None:
        add_lora(out, x, a, b, lora_meta, offsets)
    elif kernel not in FUSED_KERNELS or not add_lora_cpu_fused(out, x, stacks, lora_meta):
        # CPU: the layout add_lora_cpu multiplies fastest, with the plan's kernel
        add_lora_cpu(out, x, stacks, lora_meta, kernel)
