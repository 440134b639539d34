"""Triton shrink/expand (interpreted on the CPU, compiled on a GPU) and the CPU torch path,
each against the float64-accumulating references in kernels/reference.py.

Every case mixes ranks 1, 8, 16 and 64 in one batch, tokens without an adapter, an empty slot,
three output slices of different widths, and (slot, slice) pairs with no adapter (zero A/B).
Weights beyond each adapter's rank are NaN wherever the code under test promises not to read
them (Triton; the CPU shrink/expand), so reading padding poisons the result; the CPU add_lora
cases keep the documented zero padding. Shrink outputs start as NaN, so an element not
written (or written where it should not be) fails; expand outputs start random, and slot -1
rows and columns outside every slice must come back bit for bit.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernels import lora_ops, triton_lora
from kernels.metadata import LoRABatchMetadata, build_lora_metadata
from kernels.reference import add_lora_ref, lora_expand_ref, lora_shrink_ref

HAS_CUDA = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"  # cpu: Triton's interpreter (see conftest.py)

# Small blocks keep the interpreter's grid short; 577/2049 still need several masked steps.
SMALL = {"shrink": {"block_k": 256}, "expand": {"block_n": 128}}

SLOT_RANKS = [1, 8, 16, 64, 0, 8]  # slot 4 is empty, slot 5 is loaded but unused this step
TOKEN_SLOTS = [3, -1, 0, 2, 1, 3, -1, 2, 0, 1, 3, -1, 1, 3]
NO_ADAPTER = {(1, 1), (2, 2), (3, 0)}  # (slot, slice): this adapter leaves this slice alone
MAX_RANK = 64

SHRINK_TOL = {"atol": 1e-4, "rtol": 1e-4}
EXPAND_TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
}


@dataclass
class Case:
    x: torch.Tensor  # [T, in]
    a_stacked: list[torch.Tensor]  # [L, R, in] per slice
    b_stacked: list[torch.Tensor]  # [L, n_s, R] per slice
    meta: LoRABatchMetadata
    out_features: int
    offsets: list[int] | None


def make_case(
    in_features: int,
    widths: list[int],
    dtype: torch.dtype,
    device: str,
    *,
    token_slots: list[int] = TOKEN_SLOTS,
    slot_ranks: list[int] = SLOT_RANKS,
    block_m: int = 16,
    gaps: bool = False,
    seed: int = 0,
    padding: float = math.nan,
    padded_max_len: int = 32,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(token_slots), in_features, generator=gen)
    a_stacked, b_stacked = [], []
    for s, width in enumerate(widths):
        a = torch.full((len(slot_ranks), MAX_RANK, in_features), padding)
        b = torch.full((len(slot_ranks), width, MAX_RANK), padding)
        for slot, r in enumerate(slot_ranks):
            if (slot, s) in NO_ADAPTER:
                a[slot, :r], b[slot, :, :r] = 0.0, 0.0
            else:
                a[slot, :r] = torch.randn(r, in_features, generator=gen) / in_features**0.5
                b[slot, :, :r] = torch.randn(width, r, generator=gen) / max(r, 1) ** 0.5
        a_stacked.append(a.to(device, dtype))
        b_stacked.append(b.to(device, dtype))
    # With gaps, the slices sit apart: columns between them belong to no slice.
    offsets, col = [], 0
    for width in widths:
        col += 3 if gaps else 0
        offsets.append(col)
        col += width
    meta = build_lora_metadata(
        torch.tensor(token_slots),
        torch.tensor(slot_ranks),
        block_m=block_m,
        device=device,
        padded_max_len=padded_max_len,
    )
    return Case(
        x.to(device, dtype), a_stacked, b_stacked, meta, col + (5 if gaps else 0),
        offsets if gaps else None,
    )  # fmt: skip


def poisoned_y(case: Case) -> torch.Tensor:
    return torch.full(
        (len(case.a_stacked), case.meta.num_tokens, MAX_RANK), math.nan, device=case.x.device
    )


def reference_y(case: Case) -> torch.Tensor:
    """The shrink result with NaN wherever shrink does not write (padding, slot -1 rows)."""
    y = poisoned_y(case).cpu()
    lora_shrink_ref(case.x.cpu(), [a.cpu() for a in case.a_stacked], case.meta, y)
    return y.to(case.x.device)


def random_out(case: Case, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(case.meta.num_tokens, case.out_features, generator=gen)
    return out.to(case.x.device, case.x.dtype)


def assert_untouched_where_no_lora(got: torch.Tensor, before: torch.Tensor, case: Case) -> None:
    base_rows = case.meta.token_slots < 0
    assert torch.equal(got[base_rows], before[base_rows]), "a slot -1 row changed"
    covered = torch.zeros(case.out_features, dtype=torch.bool, device=got.device)
    offsets = case.offsets or [sum(b.shape[1] for b in case.b_stacked[:s]) for s in range(3)]
    for off, b in zip(offsets, case.b_stacked, strict=False):
        covered[off : off + b.shape[1]] = True
    assert torch.equal(got[:, ~covered], before[:, ~covered]), "a column outside the slices changed"


def expected_expand(case: Case, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    want = out.cpu().clone()
    b_cpu = [b.cpu() for b in case.b_stacked]
    lora_expand_ref(y.cpu(), b_cpu, case.meta, want, case.offsets)
    return want


SHAPES = [  # (in_features, slice widths): odd sizes, three slices of different widths
    pytest.param(577, [577, 193, 65], id="577"),
    pytest.param(2049, [130, 2049, 17], id="2049"),
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


# --- the Triton kernels --------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="with CUDA the kernels are compiled, not interpreted")
def test_triton_kernels_run_in_the_interpreter_on_cpu():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton_lora._lora_shrink_kernel, InterpretedFunction)
    assert isinstance(triton_lora._lora_expand_kernel, InterpretedFunction)


def test_triton_kernels_compile_for_a_gpu(tmp_path):
    # The interpreter skips Triton's compiler; this runs it (to sm_90 cubin) with no GPU.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    script = Path(__file__).with_name("compile_for_gpu.py")
    done = subprocess.run(
        [sys.executable, str(script), "90"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("cubin") == 6, done.stdout


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("in_features", "widths"), SHAPES)
def test_triton_shrink_matches_reference(in_features, widths, dtype):
    case = make_case(in_features, widths, dtype, TRITON_DEVICE)
    y = poisoned_y(case)
    triton_lora.lora_shrink(case.x, case.a_stacked, case.meta, y, **SMALL["shrink"])
    torch.testing.assert_close(y.cpu(), reference_y(case).cpu(), equal_nan=True, **SHRINK_TOL)


def test_triton_shrink_split_k_adds_partial_sums():
    case = make_case(577, [577, 193, 65], torch.float32, TRITON_DEVICE)
    y = poisoned_y(case)
    triton_lora.lora_shrink(case.x, case.a_stacked, case.meta, y, block_k=128, split_k=2)
    want = torch.zeros_like(y).cpu()  # split_k zero-fills y, then adds atomically
    lora_shrink_ref(case.x.cpu(), [a.cpu() for a in case.a_stacked], case.meta, want)
    torch.testing.assert_close(y.cpu(), want, **SHRINK_TOL)


@pytest.mark.parametrize("gaps", [False, True], ids=["packed", "gaps"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("in_features", "widths"), SHAPES)
def test_triton_expand_matches_reference(in_features, widths, dtype, gaps):
    case = make_case(in_features, widths, dtype, TRITON_DEVICE, gaps=gaps)
    y = reference_y(case)  # NaN beyond each rank and on slot -1 rows: must never be read
    out = random_out(case)
    before = out.clone()
    triton_lora.lora_expand(y, case.b_stacked, case.meta, out, case.offsets, **SMALL["expand"])
    torch.testing.assert_close(out.cpu(), expected_expand(case, y, before), **EXPAND_TOL[dtype])
    assert_untouched_where_no_lora(out, before, case)


@pytest.mark.parametrize("block_m", [16, 32])
def test_triton_segments_longer_than_a_tile(block_m):
    # 37 tokens of slot 3 (rank 64) split over tiles of block_m, around a few others.
    slots = [0, -1] + [3] * 20 + [1, -1] + [3] * 17 + [0]
    case = make_case(
        65, [40, 24, 17], torch.float32, TRITON_DEVICE, token_slots=slots, block_m=block_m
    )
    assert case.meta.num_tiles == (1 + 1 + 3 if block_m == 16 else 1 + 1 + 2)
    y = poisoned_y(case)
    triton_lora.lora_shrink(case.x, case.a_stacked, case.meta, y, block_k=64)
    torch.testing.assert_close(y.cpu(), reference_y(case).cpu(), equal_nan=True, **SHRINK_TOL)
    out = random_out(case)
    before = out.clone()
    triton_lora.lora_expand(y, case.b_stacked, case.meta, out, block_n=64)
    torch.testing.assert_close(out.cpu(), expected_expand(case, y, before), **SHRINK_TOL)
    assert_untouched_where_no_lora(out, before, case)


def test_triton_fp16_one_slice():
    case = make_case(577, [193], torch.float16, TRITON_DEVICE, token_slots=[2, -1, 0, 3, 2], seed=3)
    y = poisoned_y(case)
    triton_lora.lora_shrink(case.x, case.a_stacked, case.meta, y, block_k=256)
    torch.testing.assert_close(y.cpu(), reference_y(case).cpu(), equal_nan=True, **SHRINK_TOL)
    out = random_out(case)
    before = out.clone()
    triton_lora.lora_expand(y, case.b_stacked, case.meta, out, block_n=256)
    torch.testing.assert_close(
        out.cpu(), expected_expand(case, y, before), **EXPAND_TOL[torch.float16]
    )
    assert_untouched_where_no_lora(out, before, case)


@pytest.mark.parametrize("path", ["triton", "cpu"])
def test_row_strided_views_of_wider_buffers(path):
    # x and out may be column windows of wider buffers (row stride != width).
    device = TRITON_DEVICE if path == "triton" else "cpu"
    case = make_case(
        65, [40, 24, 17], torch.float32, device, token_slots=[3, -1, 1, 3, 0], padding=0.0
    )
    wide_x = torch.full((5, 70), math.nan, device=device)
    wide_x[:, 3:68] = case.x
    x = wide_x[:, 3:68]
    wide_out = torch.randn(5, 90, generator=torch.Generator().manual_seed(5)).to(device)
    wide_out[:, 7:88] = random_out(case)
    out = wide_out[:, 7:88]
    before = wide_out.clone()
    if path == "triton":
        y = poisoned_y(case)
        triton_lora.lora_shrink(x, case.a_stacked, case.meta, y, block_k=64)
        triton_lora.lora_expand(y, case.b_stacked, case.meta, out, block_n=64)
    else:
        lora_ops.add_lora(out, x, case.a_stacked, case.b_stacked, case.meta)
    want = before[:, 7:88].cpu().clone()
    cpu = [[t.cpu() for t in ts] for ts in (case.a_stacked, case.b_stacked)]
    add_lora_ref(want, case.x.cpu(), cpu[0], cpu[1], case.meta)
    torch.testing.assert_close(out.cpu(), want, **SHRINK_TOL)
    assert torch.equal(wide_out[:, :7], before[:, :7]) and torch.equal(
        wide_out[:, 88:], before[:, 88:]
    )
    assert_untouched_where_no_lora(out, before[:, 7:88], case)


def test_triton_batch_without_adapters_touches_nothing():
    case = make_case(65, [40, 24, 17], torch.float32, TRITON_DEVICE, token_slots=[-1, -1, -1])
    assert not case.meta.has_lora and case.meta.num_tiles == 0
    y = poisoned_y(case)
    triton_lora.lora_shrink(case.x, case.a_stacked, case.meta, y)
    assert y.isnan().all()
    out = random_out(case)
    before = out.clone()
    triton_lora.lora_expand(torch.zeros_like(y), case.b_stacked, case.meta, out)
    assert torch.equal(out, before)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 4])
def test_triton_full_size_on_gpu(dtype, split_k):
    # A realistic step: 300 tokens over 6 adapters (long and short segments), default blocks.
    gen = torch.Generator().manual_seed(7)
    slots = torch.randint(-1, 6, (300,), generator=gen)
    slots[slots == 4] = 5  # slot 4 is empty
    slots[40:200] = 3  # one long prefill chunk
    case = make_case(2049, [2049, 513, 513], dtype, "cuda", token_slots=slots.tolist(), seed=7)
    y = poisoned_y(case) if split_k == 1 else torch.zeros_like(poisoned_y(case))
    triton_lora.lora_shrink(case.x, case.a_stacked, case.meta, y, split_k=split_k)
    want_y = (poisoned_y(case) if split_k == 1 else torch.zeros_like(poisoned_y(case))).cpu()
    lora_shrink_ref(case.x.cpu(), [a.cpu() for a in case.a_stacked], case.meta, want_y)
    torch.testing.assert_close(y.cpu(), want_y, equal_nan=True, **SHRINK_TOL)
    out = random_out(case)
    before = out.clone()
    triton_lora.lora_expand(reference_y(case), case.b_stacked, case.meta, out)
    want = expected_expand(case, reference_y(case), before)
    torch.testing.assert_close(out.cpu(), want, **EXPAND_TOL[dtype])
    assert_untouched_where_no_lora(out, before, case)
    # The dispatcher takes the Triton path on CUDA.
    out2 = before.clone()
    lora_ops.add_lora(out2, case.x, case.a_stacked, case.b_stacked, case.meta)
    want2 = before.cpu().clone()
    cpu = [[t.cpu() for t in ts] for ts in (case.a_stacked, case.b_stacked)]
    add_lora_ref(want2, case.x.cpu(), cpu[0], cpu[1], case.meta)
    torch.testing.assert_close(out2.cpu(), want2, **EXPAND_TOL[dtype])


# --- the dispatcher's CPU torch path -------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("in_features", "widths"), SHAPES)
def test_cpu_shrink_matches_reference(in_features, widths, dtype):
    case = make_case(in_features, widths, dtype, "cpu")
    y = poisoned_y(case)
    lora_ops.lora_shrink(case.x, case.a_stacked, case.meta, y)
    torch.testing.assert_close(y, reference_y(case), equal_nan=True, **SHRINK_TOL)


@pytest.mark.parametrize("gaps", [False, True], ids=["packed", "gaps"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("in_features", "widths"), SHAPES)
def test_cpu_expand_matches_reference(in_features, widths, dtype, gaps):
    case = make_case(in_features, widths, dtype, "cpu", gaps=gaps)
    y = reference_y(case)
    out = random_out(case)
    before = out.clone()
    lora_ops.lora_expand(y, case.b_stacked, case.meta, out, case.offsets)
    torch.testing.assert_close(out, expected_expand(case, y, before), **EXPAND_TOL[dtype])
    assert_untouched_where_no_lora(out, before, case)


# The torch path multiplies long segments one by one (contiguous ones through views, others
# gathered) and pads shorter ones into one batch: padded_max_len 0 sends every segment down the
# first way, 8 splits these layouts between both, 32 batches all but the 34-token chunk. That
# batch runs at its largest rank, so these cases keep the documented zero padding.
LAYOUTS = [
    pytest.param(TOKEN_SLOTS, id="scattered"),
    pytest.param([0] * 5 + [-1] * 3 + [3] * 9 + [2] * 4 + [1] * 2, id="contiguous"),
    pytest.param([1, 0, -1] + [3] * 34 + [2, 0, -1, 1, 2], id="mixed"),
    # a decode step laid out by slot, as many tokens per adapter: the batch needs no padding
    pytest.param([0] * 3 + [1] * 3 + [2] * 3 + [3] * 3 + [-1] * 2, id="by-slot"),
]


@pytest.mark.parametrize("stacks", ["plain", "cpu-stacks"])
@pytest.mark.parametrize("padded_max_len", [0, 8, 32])
@pytest.mark.parametrize("token_slots", LAYOUTS)
@pytest.mark.parametrize("dtype", [*DTYPES, pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize(("in_features", "widths"), SHAPES)
def test_cpu_add_lora_matches_reference(in_features, widths, dtype, token_slots, padded_max_len, stacks):
    case = make_case(
        in_features, widths, dtype, "cpu", token_slots=token_slots, padding=0.0,
        padded_max_len=padded_max_len,
    )  # fmt: skip
    check_cpu_add_lora(case, fused=stacks == "cpu-stacks")


@pytest.mark.parametrize("token_slots", LAYOUTS)
@pytest.mark.parametrize("live", [(0, 1, 2), (0, 2), (1,)])
def test_cpu_stacks_in_fp32_under_bf16_activations_match_reference(token_slots, live):
    # The engine's layout on a CPU whose plan keeps the stacks in fp32 under a bf16 model, with
    # only the slices some adapter adapts passed (an all-q/v fleet skips k).
    case = make_case(64, [40, 24, 17], torch.float32, "cpu", token_slots=token_slots, padding=0.0)
    stacks = cpu_stacks_of(case).with_index(live)
    a, b = [case.a_stacked[s] for s in live], [case.b_stacked[s] for s in live]
    offsets = [stacks.offsets[s] for s in live]
    x = case.x.bfloat16()
    out = random_out(case).bfloat16()
    before = out.clone()
    lora_ops.add_lora_cpu(out, x, stacks, case.meta)
    want = before.float()
    add_lora_ref(want, x.float(), a, b, case.meta, offsets)
    torch.testing.assert_close(out, want.bfloat16(), **EXPAND_TOL[torch.bfloat16])
    assert torch.equal(out[case.meta.token_slots < 0], before[case.meta.token_slots < 0])


def cpu_stacks_of(case: Case) -> lora_ops.CpuStacks:
    """The case's stacks copied into the CPU layout the engine keeps (kernels/cpu_stacks.py);
    its slices back to back in the output."""
    slots, rank, in_features = case.a_stacked[0].shape
    widths = [b.shape[1] for b in case.b_stacked]
    stacks, a, b = lora_ops.cpu_stacks(slots, rank, in_features, widths, case.a_stacked[0].dtype)
    for view, src in zip(a + b, case.a_stacked + case.b_stacked, strict=True):
        view.copy_(src)
    return stacks


@pytest.mark.parametrize("padded_max_len", [0, 32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("in_features", "widths"), SHAPES)
def test_cpu_add_lora_slices_apart(in_features, widths, dtype, padded_max_len):
    case = make_case(
        in_features, widths, dtype, "cpu", gaps=True, padding=0.0, padded_max_len=padded_max_len
    )
    check_cpu_add_lora(case)


def check_cpu_add_lora(case: Case, fused: bool = False) -> None:
    out = random_out(case)
    before = out.clone()
    if fused:
        lora_ops.add_lora_cpu(out, case.x, cpu_stacks_of(case), case.meta)
    else:
        lora_ops.add_lora(out, case.x, case.a_stacked, case.b_stacked, case.meta, case.offsets)
    want = before.clone()
    add_lora_ref(want, case.x, case.a_stacked, case.b_stacked, case.meta, case.offsets)
    torch.testing.assert_close(out, want, **EXPAND_TOL[case.x.dtype])
    assert_untouched_where_no_lora(out, before, case)


def test_cpu_batch_without_adapters_touches_nothing():
    case = make_case(65, [40, 24, 17], torch.bfloat16, "cpu", token_slots=[-1, -1])
    out = random_out(case)
    before = out.clone()
    lora_ops.add_lora(out, case.x, case.a_stacked, case.b_stacked, case.meta)
    assert torch.equal(out, before)


def test_cpu_dispatcher_does_not_import_triton():
    # A CPU-only worker never pays for (or depends on) Triton: only CUDA calls import it.
    code = (
        "import sys, torch\n"
        "from kernels.lora_ops import add_lora\n"
        "from kernels.metadata import build_lora_metadata\n"
        "m = build_lora_metadata(torch.tensor([0, -1]), torch.tensor([4]))\n"
        "x = torch.randn(2, 8); a = [torch.randn(1, 4, 8)]; b = [torch.randn(1, 6, 4)]\n"
        "add_lora(torch.zeros(2, 6), x, a, b, m)\n"
        "assert 'kernels.triton_lora' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
