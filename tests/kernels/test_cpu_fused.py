"""The fused C++ LoRA kernel (kernels/cpu_fused.py): built here wherever a C++ compiler is, equal
to the reference on every layout and dtype the engine uses, refusing calls that would read or
write out of bounds, and standing aside (the torch path serves) where it cannot be built."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from kernels import cpu_fused, lora_ops
from kernels.metadata import build_lora_metadata
from kernels.reference import add_lora_ref

HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None


@pytest.fixture(scope="module")
def op():
    op = cpu_fused.fused_op()
    if op is None and not HAS_COMPILER:
        pytest.skip(f"no C++ compiler here: {cpu_fused.unavailable_reason()}")
    assert op is not None, f"a C++ compiler is here but the kernel did not build: {cpu_fused.unavailable_reason()}"
    return op


def stacks_with(weights_dtype, widths=(40, 24, 17), in_features=64, ranks=(8, 16, 3, 16), seed=0, paired=False):
    """CpuStacks of random adapters (zero beyond each slot's rank) and the plain stacks they hold:
    A_s [slots, max_rank, in], B_s [slots, n_s, max_rank] per slice."""
    gen = torch.Generator().manual_seed(seed)
    max_rank = max(ranks)
    stacks, _, _ = lora_ops.cpu_stacks(len(ranks), max_rank, in_features, list(widths), weights_dtype, paired)
    plain_a = [torch.zeros(len(ranks), max_rank, in_features, dtype=weights_dtype) for _ in widths]
    plain_b = [torch.zeros(len(ranks), n, max_rank, dtype=weights_dtype) for n in widths]
    for s, n in enumerate(widths):
        for slot, r in enumerate(ranks):
            plain_a[s][slot, :r] = torch.randn(r, in_features, generator=gen) / in_features**0.5
            plain_b[s][slot, :, :r] = torch.randn(n, r, generator=gen) / r**0.5
            stacks.write_slice(s, slot, plain_a[s][slot, :r], plain_b[s][slot, :, :r])
    return stacks, plain_a, plain_b, torch.tensor(ranks)


def needs_pairs(op):
    if not cpu_fused.pairs_bf16():
        pytest.skip("this CPU's build has no AVX512-BF16 path: stacks are never paired")


LAYOUTS = {
    "decode by slot": [0] * 8 + [1] * 8 + [2] * 8 + [3] * 8,
    "scattered": [3, -1, 0, 2, 1, 3, -1, 2, 0, 1, 3, -1, 1, 3, 0],
    "prefill chunk and decode": [1] * 37 + [0, 2, -1, 3],
    "one stream": [2],
}
DTYPES = [  # (activations, stacks): what the matmul plan can pair
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.float16, torch.float16),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("x_dtype", "w_dtype"), DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("live", [(0, 1, 2), (0, 2)])
@pytest.mark.parametrize("entry", ["add_lora_cpu", "bound"])
def test_fused_kernel_equals_the_reference(op, layout, x_dtype, w_dtype, live, entry):
    stacks, a, b, ranks = stacks_with(w_dtype)
    stacks = stacks.with_index(live)
    meta = build_lora_metadata(torch.tensor(LAYOUTS[layout]), ranks)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(meta.num_tokens, stacks.in_features, generator=gen).to(x_dtype)
    out = torch.randn(meta.num_tokens, stacks.out_features, generator=gen).to(x_dtype)
    before = out.clone()
    if entry == "bound":  # LoRALinear's path: the kernel bound to the stacks, no dispatcher
        assert lora_ops.add_lora_cpu_fused(out, x, stacks, meta)
    else:
        lora_ops.add_lora_cpu(out, x, stacks, meta, kernel="fused")
    want = before.float()
    add_lora_ref(want, x.float(), [a[s].float() for s in live], [b[s].float() for s in live], meta,
                 [stacks.offsets[s] for s in live])  # fmt: skip
    tol = {"atol": 1e-5, "rtol": 1e-5} if x_dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(out.float(), want, **tol)
    no_adapter = meta.token_slots < 0
    assert torch.equal(out[no_adapter], before[no_adapter]), "a base-only row changed"
    skipped = [c for s in set(range(3)) - set(live) for c in range(stacks.offsets[s], stacks.offsets[s] + b[s].shape[1])]
    assert torch.equal(out[:, skipped], before[:, skipped]), "a slice outside index changed"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("live", [(0, 1, 2), (1,)])
@pytest.mark.parametrize("entry", ["add_lora_cpu", "bound"])
def test_paired_stacks_give_what_unpaired_ones_give_bit_for_bit(op, layout, live, entry):
    """The same dot products in the same order, whichever layout the rows lie in: odd ranks (3,
    whose last pair holds a zero), a width past the last whole vector (17), a slice subset."""
    needs_pairs(op)
    outs = []
    for paired in (False, True):
        stacks, _, _, ranks = stacks_with(torch.bfloat16, ranks=(8, 16, 3, 7), paired=paired)
        stacks = stacks.with_index(live)
        meta = build_lora_metadata(torch.tensor(LAYOUTS[layout]), ranks)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(meta.num_tokens, stacks.in_features, generator=gen).bfloat16()
        out = torch.randn(meta.num_tokens, stacks.out_features, generator=gen).bfloat16()
        if entry == "bound":
            assert lora_ops.add_lora_cpu_fused(out, x, stacks, meta)
        else:
            lora_ops.add_lora_cpu(out, x, stacks, meta, kernel="fused")
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_torch_path_serves_paired_stacks_through_an_unpaired_copy(x_dtype):
    """Where the fused kernel cannot take paired stacks (fp32 activations, the torch kernel
    forced), the torch path multiplies an unpaired copy: the same delta, the stacks unchanged."""
    stacks, a, b, ranks = stacks_with(torch.bfloat16, ranks=(8, 16, 3, 16), paired=True)
    held = [stacks.a_t.clone(), *(t.clone() for t in stacks.b_t)]
    meta = build_lora_metadata(torch.tensor(LAYOUTS["prefill chunk and decode"]), ranks)
    x = torch.randn(meta.num_tokens, stacks.in_features).to(x_dtype)
    got = torch.zeros(meta.num_tokens, stacks.out_features, dtype=x_dtype)
    if x_dtype == torch.float32:
        assert not lora_ops.add_lora_cpu_fused(got, x, stacks, meta)
    lora_ops.add_lora_cpu(got, x, stacks, meta, kernel="fused" if x_dtype == torch.float32 else "torch")
    want = torch.zeros(got.shape)
    add_lora_ref(want, x.float(), [t.float() for t in a], [t.float() for t in b], meta)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
    assert all(torch.equal(t, h) for t, h in zip([stacks.a_t, *stacks.b_t], held, strict=True))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda k: k | {"x": k["x"].float(), "out": k["out"].float()}, "paired stacks take bf16 activations"),
        (lambda k: k | {"paired": False}, "a_t"),  # paired rows read as unpaired: refused, not misread
        (lambda k: k | {"b_t": [k["b_t"][0][:, :, :63]]}, "each b_t must be"),
        (lambda k: k | {"a_t": k["a_t"][:, :, :6].contiguous()}, "even max_rank"),
    ],
)
def test_fused_kernel_refuses_paired_stacks_it_cannot_read(op, change, message):
    needs_pairs(op)
    assert_refused(op, change(one_slot_call(torch.bfloat16, paired=True)), message)


def one_slot_call(dtype, paired=False):
    """add_lora_fused's arguments for two tokens on one rank-4 slot: in 16, one slice of 32."""
    stacks, _, _, _ = stacks_with(dtype, widths=(32,), in_features=16, ranks=(4,), paired=paired)
    return {
        "out": torch.zeros(2, 32, dtype=dtype), "x": torch.randn(2, 16).to(dtype), "a_t": stacks.a_t,
        "b_t": list(stacks.b_t), "slices": [0], "offsets": [0], "token_ids": torch.tensor([0, 1]),
        "segments": torch.tensor([[0, 2, 0, 4]]), "paired": paired,
    }  # fmt: skip


def assert_refused(op, kwargs, message):
    before = kwargs["out"].clone()
    with pytest.raises(RuntimeError, match=message):
        op(**kwargs)
    assert torch.equal(kwargs["out"], before), "a refused call wrote to out"


def test_fused_kernel_rounds_a_bf16_row_once_and_keeps_nan(op):
    stacks, _, _, ranks = stacks_with(torch.float32, widths=(32,), in_features=16, ranks=(4,))
    meta = build_lora_metadata(torch.tensor([0, 0]), ranks)
    x = torch.randn(2, 16).bfloat16()
    out = torch.zeros(2, 32, dtype=torch.bfloat16)
    out[1, 5] = float("nan")
    lora_ops.add_lora_cpu(out, x, stacks, meta, kernel="fused")
    want = torch.zeros(2, 32)
    add_lora_ref(want, x.float(), [stacks.a_t[:, :, 0::1].transpose(1, 2)], [stacks.b_t[0].transpose(1, 2)], meta)
    assert torch.equal(out[0], want[0].bfloat16())  # fp32 sum, then one round to nearest even
    assert torch.isnan(out[1, 5]) and not torch.isnan(out[1, :5]).any()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda k: k | {"token_ids": torch.tensor([0, 99])}, "token id out of range"),
        (lambda k: k | {"segments": torch.tensor([[0, 2, 7, 4]])}, "slot or rank out of range"),
        (lambda k: k | {"segments": torch.tensor([[0, 2, 0, 99]])}, "slot or rank out of range"),
        (lambda k: k | {"segments": torch.tensor([[1, 2, 0, 4]])}, "segment outside token_ids"),
        (lambda k: k | {"offsets": [20]}, "slice columns outside out"),
        (lambda k: k | {"slices": [3], "offsets": [0]}, "slice index out of range"),
        (lambda k: k | {"x": k["x"].double()}, "x and out must share a dtype"),
        (lambda k: k | {"a_t": k["a_t"][:, :8]}, "a_t"),
        (lambda k: k | {"b_t": [k["b_t"][0][:, :2]]}, "each b_t must be"),
        (lambda k: k | {"token_ids": torch.tensor([0, 1], dtype=torch.int32)}, "token_ids"),
    ],
)
def test_fused_kernel_refuses_a_call_that_would_reach_outside_its_tensors(op, change, message):
    assert_refused(op, change(one_slot_call(torch.float32)), message)


def test_a_bound_kernel_serves_its_own_stacks_and_slices(op):
    stacks, _, _, _ = stacks_with(torch.bfloat16)
    kernel = stacks.fused_kernel()
    assert kernel is not None and stacks.fused_kernel() is kernel  # bound once, then kept
    fewer = stacks.with_index((0, 2))
    assert fewer.fused_kernel() is not kernel  # other slices: a binding of their own


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda k: k | {"x": k["x"][:, :8]}, "a_t"),
        (lambda k: k | {"x": k["x"][:1]}, r"x \[T, in\] and out \[T, n\] expected"),
        (lambda k: k | {"out": k["out"][:, :20]}, "slice columns outside out"),
        (lambda k: k | {"x": k["x"].bfloat16()}, "x and out must share a dtype"),
        (lambda k: k | {"token_ids": torch.tensor([0, 99])}, "token id out of range"),
        (lambda k: k | {"segments": torch.tensor([[0, 2, 7, 4]])}, "slot or rank out of range"),
    ],
)
def test_a_bound_kernel_refuses_a_call_that_does_not_fit_its_stacks(op, change, message):
    stacks, _, _, _ = stacks_with(torch.float32, widths=(32,), in_features=16, ranks=(4,))
    kwargs = {"out": torch.zeros(2, 32), "x": torch.randn(2, 16), "token_ids": torch.tensor([0, 1]),
              "segments": torch.tensor([[0, 2, 0, 4]])}  # fmt: skip
    kwargs = change(kwargs)
    before = kwargs["out"].clone()
    with pytest.raises(RuntimeError, match=message):
        stacks.fused_kernel()(kwargs["out"], kwargs["x"], kwargs["token_ids"], kwargs["segments"])
    assert torch.equal(kwargs["out"], before)


def test_the_bound_path_stands_aside_where_the_kernel_cannot_serve(op, monkeypatch):
    stacks, _, _, ranks = stacks_with(torch.bfloat16)
    meta = build_lora_metadata(torch.tensor(LAYOUTS["scattered"]), ranks)
    out = torch.zeros(meta.num_tokens, stacks.out_features, dtype=torch.float16)
    x = torch.randn(meta.num_tokens, stacks.in_features).half()
    assert not lora_ops.add_lora_cpu_fused(out, x, stacks, meta)  # fp16 on bf16: not the kernel's
    assert not out.any()
    fresh, _, _, _ = stacks_with(torch.float32)
    monkeypatch.setattr(cpu_fused, "_state", {"error": "RuntimeError: no C++ compiler (c++) on PATH"})
    assert fresh.fused_kernel() is None
    assert not lora_ops.add_lora_cpu_fused(torch.zeros(meta.num_tokens, fresh.out_features),
                                           torch.randn(meta.num_tokens, fresh.in_features), fresh, meta)


def _runs_beside(call) -> int:
    """How many times another Python thread got to run while `call()` ran (its middle 60%)."""
    stamps, stop = [], threading.Event()

    def spin():
        while not stop.is_set():
            stamps.append(time.perf_counter())

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.02)
    start = time.perf_counter()
    call()
    end = time.perf_counter()
    stop.set()
    thread.join()
    margin = (end - start) * 0.2
    return sum(start + margin < t < end - margin for t in stamps)


def test_the_library_s_python_functions_let_other_threads_run(op):
    """A server's threads go on while a step's kernels run (the GIL is released, as torch's own
    ops release it). Each call runs long (~0.1 s) on one thread, so the other thread gets a
    core in its middle even on a busy machine; holding the GIL it would get none."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stacks, _, _, ranks = stacks_with(torch.bfloat16, widths=(1024, 1024, 1024), in_features=1024)
        meta = build_lora_metadata(torch.arange(4096) % len(ranks), ranks)
        x, out = torch.randn(4096, 1024).bfloat16(), torch.zeros(4096, 3072, dtype=torch.bfloat16)
        kernel = stacks.fused_kernel()
        assert _runs_beside(lambda: [kernel(out, x, meta.lora_token_ids, meta.cpu_segments) for _ in range(20)]) > 0
        ops = cpu_fused.layer_ops()
        rows, weight = torch.randn(8192, 4096).bfloat16(), torch.ones(4096, dtype=torch.bfloat16)
        assert _runs_beside(lambda: [ops.rms_norm(rows, weight, 1e-5) for _ in range(2)]) > 0
    finally:
        torch.set_num_threads(threads)


def test_without_the_kernel_the_torch_path_serves(monkeypatch):
    stacks, a, b, ranks = stacks_with(torch.float32)
    meta = build_lora_metadata(torch.tensor(LAYOUTS["scattered"]), ranks)
    x = torch.randn(meta.num_tokens, stacks.in_features)
    monkeypatch.setattr(cpu_fused, "_state", {"error": "RuntimeError: no C++ compiler (c++) on PATH"})
    assert cpu_fused.fused_op() is None and cpu_fused.layer_ops() is None
    got = torch.zeros(meta.num_tokens, stacks.out_features)
    lora_ops.add_lora_cpu(got, x, stacks, meta, kernel="fused")
    want = torch.zeros_like(got)
    add_lora_ref(want, x, a, b, meta)
    torch.testing.assert_close(got, want)


def test_the_build_command_says_what_it_did():
    done = subprocess.run([sys.executable, "-m", "kernels.cpu_fused"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    if HAS_COMPILER:
        assert "fused CPU LoRA kernel ready" in done.stdout
    else:
        assert "not built" in done.stdout and "torch path will serve" in done.stdout


AVX2_CHECK = """
import torch
from torch.utils import cpp_extension
from kernels import cpu_fused, lora_ops
from kernels.metadata import build_lora_metadata
from kernels.reference import add_lora_ref

cpu_fused._put_ninja_on_path()
flags = [f if f != "-march=native" else "-march=x86-64-v3" for f in cpu_fused.CFLAGS]
# every kernel source, not bindings.cpp: Python glue with no vector code, a third of the build's time
sources = [str(s) for s in cpu_fused.SOURCES if s.name != "bindings.cpp"]
cpp_extension.load(name="loraplex_lora_cpu_avx2_" + cpu_fused._build_key(), sources=sources,
                   extra_cflags=flags, extra_ldflags=cpu_fused.LDFLAGS, is_python_module=False)
op = torch.ops.loraplex_cpu.add_lora_fused
gen = torch.Generator().manual_seed(0)
stacks, a, b = lora_ops.cpu_stacks(3, 16, 40, [24, 8, 17], torch.bfloat16)
for view in a + b:
    view.copy_(torch.randn(view.shape, generator=gen) * 0.2)
meta = build_lora_metadata(torch.tensor([0] * 11 + [2, -1, 1, 2]), torch.tensor([16, 16, 16]))
x = torch.randn(15, 40, generator=gen).bfloat16()
out = torch.randn(15, 49, generator=gen).bfloat16()
want = out.float()
op(out, x, stacks.a_t, list(stacks.b_t), [0, 1, 2], list(stacks.offsets), meta.lora_token_ids, meta.cpu_segments)
add_lora_ref(want, x.float(), [t.float() for t in a], [t.float() for t in b], meta)
torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=1e-2)
paired = lora_ops.cpu_stacks(3, 16, 40, [24, 8, 17], torch.bfloat16, paired=True)[0]
try:  # this build has no AVX512-BF16 path: paired stacks are refused, not misread
    op(out, x, paired.a_t, list(paired.b_t), [0, 1, 2], list(paired.offsets), meta.lora_token_ids,
       meta.cpu_segments, paired=True)
except RuntimeError as exc:
    assert "AVX512-BF16" in str(exc), exc
else:
    raise AssertionError("paired stacks taken by a build without AVX512-BF16")

# the paged decode attention of the same build (8-float vectors) against the torch path
from inference.layers.attention import torch_paged_attention
from inference.layers.attention_metadata import build_attention_metadata
cpu_fused._state["op"] = op  # attention_op() serves what this process loaded
k_cache, v_cache = (torch.randn(12, 16, 2, 64, generator=gen).bfloat16() for _ in range(2))
q, k, v = (torch.randn(3, h, 64, generator=gen).bfloat16() for h in (6, 2, 2))
lens, tables = [5, 100, 33], [[3], [0, 1, 2, 4, 5, 6, 7], [8, 9, 10]]
got, want = (torch_paged_attention(q, k, v, (k_cache.clone(), v_cache.clone()),
                                   build_attention_metadata(lens, [1, 1, 1], tables, 16, decode_kernel=kernel), 0.125)
             for kernel in ("fused", "torch"))
torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
print("avx2 build ok")
"""


@pytest.mark.skipif(
    "avx2" not in cpu_fused._cpu_flags(), reason="the AVX2 build runs only on an x86 CPU with AVX2"
)
def test_the_avx2_build_equals_the_reference_too(op):
    # Built -march=native, the kernel takes its AVX-512 branch here when the CPU has AVX-512;
    # an AVX2-only machine compiles the other (8-float vectors, one column vector per pass).
    # Build that one for x86-64-v3 (AVX2) in a process of its own (one op library a process).
    done = subprocess.run([sys.executable, "-c", AVX2_CHECK], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "avx2 build ok" in done.stdout
