"""Which torch formulation of the multi-LoRA delta is fastest on this CPU?

    python bench/lora_cpu_paths.py [--runs 30] [--dtypes float32,bfloat16]
                                   [--batches decode,decode-by-slot,prefill,mixed] [--only NAME,NAME]

Times `out += per-token LoRA delta` (shrink + expand, every output slice) for the four
projection shapes of one SmolLM2-135M decoder block (qkv 576->576+192+192, o 576->576,
gate_up 576->1536+1536, down 1536->576), rank 16, 8 adapter slots, in four batches:

    decode:  64 tokens, one per sequence, adapters drawn at random over 8 slots
    decode-by-slot: the same, laid out by slot as the engine does (8 tokens per adapter)
    prefill: 1024 tokens, 4 sequences of 256 (one adapter each, contiguous)
    mixed:   a 256-token prefill chunk (slot 0) followed by 63 decode tokens over 8 slots

Candidates (all produce the same numbers as kernels.reference, checked before timing):

    segments     per slot: gather its rows, x_seg @ A[slot,:r].T @ B[slot,:,:r].T, index_add_
    sorted       rows gathered once in slot order, per-slot matmuls into one fp32 delta
                 buffer, one scatter back (contiguous segments use views, no gather)
    sorted_cat_a sorted, with the slices' A rows concatenated: one shrink product per slot
    gathered_bmm per-token weights gathered (A[slot_t], B[slot_t]) and two bmm's
    padded       every slot for every token through the stacked weights (max_rank padded),
                 masked to the token's slot, then one matmul back
    segments_addmm  segments, contiguous ones added straight into out (addmm_), no buffer
    slot_bmm     every slot's tokens padded to the longest segment: two bmm's per slice
    engine       kernels.lora_ops.add_lora_cpu on the stacks in the engine's CPU layout
                 (kernels/cpu_stacks.py): what LoRALinear calls on the CPU, torch ops
    engine_fused the same through the fused C++ kernel (kernels/cpu_fused.py; absent where
                 it cannot be built here)
    engine_paired  the fused kernel on paired stacks (bf16, where the build has AVX512-BF16)
    engine_tiles   the same with every run of tokens on AMX tiles (where the CPU has AMX-BF16)
    dispatcher   kernels.lora_ops.add_lora on plain stacks: segments_addmm for
                 segments of >= 32 tokens, slot_bmm for the shorter ones

bf16 variants: `-bf16` multiplies in bf16; `-fp32` upcasts the rows and weights it touches
(torch's bf16 GEMM is slow without AVX512-BF16/AMX). Prints ms per decoder block (the four
projections) and the ratio to the best, plus the base layers' own time for scale.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from inference.layers.linear import linear
from kernels import cpu_fused
from kernels.cpu_stacks import CpuStacks, cpu_stacks
from kernels.lora_ops import add_lora, add_lora_cpu
from kernels.metadata import LoRABatchMetadata, build_lora_metadata
from kernels.reference import add_lora_ref

HIDDEN, FFN, KV = 576, 1536, 192
PROJECTIONS = {  # name: (in_features, output slice widths)
    "qkv": (HIDDEN, [HIDDEN, KV, KV]),
    "o": (HIDDEN, [HIDDEN]),
    "gate_up": (HIDDEN, [FFN, FFN]),
    "down": (FFN, [HIDDEN]),
}
MAX_LORAS, RANK = 8, 16

AddLoRA = Callable[..., None]  # (out, x, a_list, b_list, meta, offsets) -> None


def _offsets(b_list: list[torch.Tensor]) -> list[int]:
    return [sum(b.shape[1] for b in b_list[:s]) for s in range(len(b_list))]


def segments(out, x, a_list, b_list, meta: LoRABatchMetadata, compute: torch.dtype) -> None:
    offsets = _offsets(b_list)
    for seg in meta.segments:
        xs = x.index_select(0, seg.token_ids).to(compute)  # [n, in]
        delta = torch.empty(seg.length, out.shape[1], dtype=compute)  # [n, out]
        for s, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
            ys = xs @ a[seg.slot, : seg.rank].to(compute).T  # [n, r]
            n = b.shape[1]
            delta[:, offsets[s] : offsets[s] + n] = ys @ b[seg.slot, :, : seg.rank].to(compute).T
        out.index_add_(0, seg.token_ids, delta.to(out.dtype))


def sorted_once(out, x, a_list, b_list, meta: LoRABatchMetadata, compute: torch.dtype) -> None:
    offsets = _offsets(b_list)
    n_lora = meta.num_lora_tokens
    contiguous = all(seg.token_range is not None for seg in meta.segments)
    if not contiguous:
        ids = torch.cat([seg.token_ids for seg in meta.segments])  # [n_lora]
        xs_all = x.index_select(0, ids).to(compute)  # [n_lora, in] in slot order
    delta = torch.empty(n_lora, out.shape[1], dtype=torch.float32)
    for seg in meta.segments:
        if contiguous:
            lo, hi = seg.token_range
            xs = x[lo:hi].to(compute)
        else:
            xs = xs_all[seg.start : seg.start + seg.length]
        d = delta[seg.start : seg.start + seg.length]
        for s, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
            ys = xs @ a[seg.slot, : seg.rank].to(compute).T  # [n, r]
            n = b.shape[1]
            d[:, offsets[s] : offsets[s] + n] = ys @ b[seg.slot, :, : seg.rank].to(compute).T
    if contiguous:
        for seg in meta.segments:
            lo, hi = seg.token_range
            rows = out[lo:hi]
            rows.copy_(rows.float() + delta[seg.start : seg.start + seg.length])
    else:
        rows = out.index_select(0, ids).float() + delta
        out.index_copy_(0, ids, rows.to(out.dtype))


def sorted_cat_a(out, x, a_list, b_list, meta: LoRABatchMetadata, compute: torch.dtype) -> None:
    """sorted, with one shrink product per segment for all slices (A slices concatenated)."""
    offsets = _offsets(b_list)
    delta = torch.empty(meta.num_lora_tokens, out.shape[1], dtype=torch.float32)
    for seg in meta.segments:
        if seg.token_range is not None:
            xs = x[seg.token_range[0] : seg.token_range[1]].to(compute)
        else:
            xs = x.index_select(0, seg.token_ids).to(compute)
        r = seg.rank
        a_cat = torch.cat([a[seg.slot, :r] for a in a_list]).to(compute)  # [S*r, in]
        ys = xs @ a_cat.T  # [n, S*r]
        d = delta[seg.start : seg.start + seg.length]
        for s, b in enumerate(b_list):
            n = b.shape[1]
            d[:, offsets[s] : offsets[s] + n] = (
                ys[:, s * r : (s + 1) * r] @ b[seg.slot, :, :r].to(compute).T
            )
    if all(seg.token_range is not None for seg in meta.segments):
        for seg in meta.segments:
            rows = out[seg.token_range[0] : seg.token_range[1]]
            rows.copy_(rows.float() + delta[seg.start : seg.start + seg.length])
    else:
        ids = meta.lora_token_ids
        out.index_copy_(0, ids, (out.index_select(0, ids).float() + delta).to(out.dtype))


def segments_addmm(out, x, a_list, b_list, meta: LoRABatchMetadata, compute: torch.dtype) -> None:
    """segments, adding each product straight into out (addmm_ / add_), no delta buffer."""
    offsets = _offsets(b_list)
    for seg in meta.segments:
        contiguous = seg.token_range is not None
        if contiguous:
            lo, hi = seg.token_range
            xs = x[lo:hi].to(compute)
            rows = out[lo:hi]
        else:
            xs = x.index_select(0, seg.token_ids).to(compute)
            rows = torch.empty(seg.length, out.shape[1], dtype=compute)  # delta, scattered below
        for s, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
            ys = xs @ a[seg.slot, : seg.rank].to(compute).T  # [n, r]
            bt = b[seg.slot, :, : seg.rank].to(compute).T  # [r, n_s]
            view = rows[:, offsets[s] : offsets[s] + b.shape[1]]
            if not contiguous:
                torch.matmul(ys, bt, out=view)
            elif view.dtype == compute:
                view.addmm_(ys, bt)
            else:
                view.add_(ys @ bt)
        if not contiguous:
            out.index_add_(0, seg.token_ids, rows.to(out.dtype))


def slot_bmm(out, x, a_list, b_list, meta: LoRABatchMetadata, compute: torch.dtype) -> None:
    """Every slot's tokens padded to the longest segment: two bmm's per slice over all slots
    (weights used as views; needs zero weights beyond each rank, as the adapter cache keeps)."""
    offsets = _offsets(b_list)
    loras = a_list[0].shape[0]
    max_len = max(seg.length for seg in meta.segments)
    pad_index = torch.cat(  # [n_lora]: row of each lora token in the [L * max_len] padded batch
        [torch.arange(seg.length) + seg.slot * max_len for seg in meta.segments]
    )
    ids = meta.lora_token_ids
    x_pad = torch.zeros(loras * max_len, x.shape[1], dtype=compute)
    x_pad.index_copy_(0, pad_index, x.index_select(0, ids).to(compute))
    x_pad = x_pad.view(loras, max_len, -1)  # [L, m, in]
    delta = torch.empty(meta.num_lora_tokens, out.shape[1], dtype=compute)
    for s, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
        y = torch.bmm(x_pad, a.to(compute).transpose(1, 2))  # [L, m, R]
        d = torch.bmm(y, b.to(compute).transpose(1, 2))  # [L, m, n_s]
        n = b.shape[1]
        torch.index_select(
            d.view(loras * max_len, n), 0, pad_index, out=delta[:, offsets[s] : offsets[s] + n]
        )
    if out.dtype == compute:
        out.index_add_(0, ids, delta)
    else:
        out.index_copy_(0, ids, (out.index_select(0, ids).to(compute) + delta).to(out.dtype))


def gathered_bmm(out, x, a_list, b_list, meta: LoRABatchMetadata, compute: torch.dtype) -> None:
    offsets = _offsets(b_list)
    ids = torch.cat([seg.token_ids for seg in meta.segments])  # [n_lora]
    slots = meta.token_slots.index_select(0, ids)  # [n_lora]
    ranks = meta.slot_ranks.index_select(0, slots)  # [n_lora]
    rank_mask = (torch.arange(a_list[0].shape[1]) < ranks[:, None]).to(compute)  # [n, R]
    xs = x.index_select(0, ids).to(compute).unsqueeze(1)  # [n, 1, in]
    rows = out.index_select(0, ids).float()  # [n, out]
    for s, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
        a_tok = a.index_select(0, slots).to(compute)  # [n, R, in]
        b_tok = b.index_select(0, slots).to(compute)  # [n, n_s, R]
        ys = torch.bmm(xs, a_tok.transpose(1, 2)) * rank_mask.unsqueeze(1)  # [n, 1, R]
        d = torch.bmm(ys, b_tok.transpose(1, 2)).squeeze(1)  # [n, n_s]
        rows[:, offsets[s] : offsets[s] + b.shape[1]] += d
    out.index_copy_(0, ids, rows.to(out.dtype))


def padded(out, x, a_list, b_list, meta: LoRABatchMetadata, compute: torch.dtype) -> None:
    offsets = _offsets(b_list)
    loras, max_rank = a_list[0].shape[:2]
    ids = torch.cat([seg.token_ids for seg in meta.segments])  # [n_lora]
    slots = meta.token_slots.index_select(0, ids)
    ranks = meta.slot_ranks.index_select(0, slots)
    # [n, L, R]: 1 where l is the token's slot and r < its rank
    mask = torch.zeros(ids.numel(), loras, max_rank, dtype=compute)
    mask[torch.arange(ids.numel()), slots] = (torch.arange(max_rank) < ranks[:, None]).to(compute)
    mask = mask.view(ids.numel(), loras * max_rank)
    xs = x.index_select(0, ids).to(compute)  # [n, in]
    rows = out.index_select(0, ids).float()
    for s, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
        y_all = (xs @ a.view(loras * max_rank, -1).to(compute).T) * mask  # [n, L*R]
        b_flat = b.permute(1, 0, 2).reshape(b.shape[1], loras * max_rank).to(compute)  # [n_s, L*R]
        rows[:, offsets[s] : offsets[s] + b.shape[1]] += y_all @ b_flat.T
    out.index_copy_(0, ids, rows.to(out.dtype))


def dispatcher(out, x, a_list, b_list, meta: LoRABatchMetadata, compute: torch.dtype) -> None:
    add_lora(out, x, a_list, b_list, meta)


# (id(a_list[0]), paired, tile_rows) -> its copy in the engine's layout
_ENGINE_STACKS: dict[tuple[int, bool, int], CpuStacks] = {}


def engine(
    out, x, a_list, b_list, meta: LoRABatchMetadata, compute: torch.dtype, kernel: str = "torch",
    paired: bool = False, tile_rows: int = 0,
) -> None:
    key = (id(a_list[0]), paired, tile_rows)  # the lists live as long as the run: ids stay theirs
    if key not in _ENGINE_STACKS:
        widths = [b.shape[1] for b in b_list]
        stacks, _, _ = cpu_stacks(MAX_LORAS, RANK, x.shape[1], widths, a_list[0].dtype, paired, tile_rows)
        for s, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
            for slot in range(MAX_LORAS):
                stacks.write_slice(s, slot, a[slot], b[slot])
        _ENGINE_STACKS[key] = stacks
    add_lora_cpu(out, x, _ENGINE_STACKS[key], meta, kernel)


def engine_fused(out, x, a_list, b_list, meta: LoRABatchMetadata, compute: torch.dtype) -> None:
    engine(out, x, a_list, b_list, meta, compute, kernel="fused")


def engine_paired(out, x, a_list, b_list, meta: LoRABatchMetadata, compute: torch.dtype) -> None:
    engine(out, x, a_list, b_list, meta, compute, kernel="fused", paired=True)


def engine_tiles(out, x, a_list, b_list, meta: LoRABatchMetadata, compute: torch.dtype) -> None:
    engine(out, x, a_list, b_list, meta, compute, kernel="fused", paired=True, tile_rows=1)


CANDIDATES: dict[str, Callable] = {
    "segments": segments,
    "sorted": sorted_once,
    "sorted_cat_a": sorted_cat_a,
    "segments_addmm": segments_addmm,
    "slot_bmm": slot_bmm,
    "gathered_bmm": gathered_bmm,
    "padded": padded,
    "dispatcher": dispatcher,
    "engine": engine,
    "engine_fused": engine_fused,
    "engine_paired": engine_paired,
    "engine_tiles": engine_tiles,
}
# they compute in the stacks' dtype
STACK_DTYPE_ONLY = {"dispatcher", "engine", "engine_fused", "engine_paired", "engine_tiles"}
BF16_ONLY = {"engine_paired", "engine_tiles"}  # paired stacks are bf16


def make_batch(kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "decode":
        return torch.randint(0, MAX_LORAS, (64,), generator=gen)
    if kind == "decode-by-slot":  # how the engine lays a decode step out: 8 tokens per adapter
        return torch.arange(64) * MAX_LORAS // 64
    if kind == "mixed":  # a 256-token prefill chunk, then 63 decode tokens
        decode = torch.randint(0, MAX_LORAS, (63,), generator=gen)
        return torch.cat((torch.zeros(256, dtype=torch.long), decode))
    return torch.arange(4).repeat_interleave(256)  # 4 sequences x 256 tokens, slots 0..3


def make_weights(in_features: int, widths: list[int], dtype: torch.dtype, gen: torch.Generator):
    a_list = [
        (torch.randn(MAX_LORAS, RANK, in_features, generator=gen) * in_features**-0.5).to(dtype)
        for _ in widths
    ]
    b_list = [(torch.randn(MAX_LORAS, n, RANK, generator=gen) * 0.1).to(dtype) for n in widths]
    return a_list, b_list


def interleaved(steps: dict[str, Callable[[], None]], runs: int) -> dict[str, float]:
    """Median ms per step, the candidates taking turns so that load from other processes on
    the machine falls on all of them alike."""
    for step in steps.values():
        step()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(runs):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--only", default="", help="comma-separated candidate names")
    parser.add_argument("--batches", default="decode,decode-by-slot,prefill,mixed")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    if cpu_fused.fused_op() is None:
        for name in ("engine_fused", "engine_paired", "engine_tiles"):
            CANDIDATES.pop(name)
        print(f"fused kernel not built here ({cpu_fused.unavailable_reason()}): engine_fused and the rest left out")
    else:
        if not cpu_fused.pairs_bf16():
            CANDIDATES.pop("engine_paired")
        if not cpu_fused.tiles_bf16():
            CANDIDATES.pop("engine_tiles")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, rank {RANK}, "
        f"{MAX_LORAS} slots; ms per decoder block (qkv + o + gate_up + down), median"
    )

    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        computes = [torch.float32] if dtype == torch.float32 else [torch.bfloat16, torch.float32]
        for kind in args.batches.split(","):
            slots = make_batch(kind, gen)
            meta = build_lora_metadata(slots, torch.full((MAX_LORAS,), RANK))
            tokens = slots.numel()
            shapes = []
            for in_features, widths in PROJECTIONS.values():
                x = torch.randn(tokens, in_features, generator=gen).to(dtype)
                a_list, b_list = make_weights(in_features, widths, dtype, gen)
                base_w = torch.randn(sum(widths), in_features, generator=gen).to(dtype)
                shapes.append((x, a_list, b_list, base_w))

            steps: dict[str, Callable[[], None]] = {}
            for name, fn in CANDIDATES.items():
                if (args.only and name not in args.only.split(",")) or (name in BF16_ONLY and dtype != torch.bfloat16):
                    continue
                for compute in computes if name not in STACK_DTYPE_ONLY else [None]:
                    label = name
                    if compute is not None and dtype != torch.float32:
                        label += "-bf16" if compute == torch.bfloat16 else "-fp32"
                    outs = [
                        torch.randn(tokens, w.shape[0], generator=gen).to(dtype)
                        for _, _, _, w in shapes
                    ]
                    tol = 1e-4 if dtype == torch.float32 else 3e-2
                    for (x, a_list, b_list, _), out in zip(shapes, outs, strict=True):
                        want, got = out.clone(), out.clone()
                        add_lora_ref(want, x, a_list, b_list, meta)
                        fn(got, x, a_list, b_list, meta, compute)
                        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)

                    def step(fn=fn, compute=compute, outs=outs, meta=meta, shapes=shapes):
                        for (x, a_list, b_list, _), out in zip(shapes, outs, strict=True):
                            fn(out, x, a_list, b_list, meta, compute)

                    steps[label] = step

            def base_step(shapes=shapes):  # the base layers themselves, for scale
                for x, _, _, w in shapes:
                    linear(x, w)

            steps["(base layers)"] = base_step
            results = interleaved(steps, args.runs)
            base = results.pop("(base layers)")
            best = min(results.values())
            print(
                f"\n{dtype_name} {kind}: T={tokens}, {meta.num_segments} adapters; "
                f"base layers alone {base:.3f} ms"
            )
            for label, ms in sorted(results.items(), key=lambda kv: kv[1]):
                print(
                    f"  {label:<20} {ms:8.3f} ms  x{ms / best:5.2f} of best   "
                    f"{100 * ms / base:6.1f}% of base"
                )


if __name__ == "__main__":
    main()
