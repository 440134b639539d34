"""Bad input to the launchers and the dispatcher: a ValueError that names the argument, raised
before anything runs (the checks are shared, so each is exercised through every entry point)."""

from __future__ import annotations

import pytest
import torch

from kernels import lora_ops, triton_lora
from kernels.metadata import build_lora_metadata

T, IN, RANK, SLOTS = 3, 24, 16, 2
WIDTHS = [20, 12]


def valid(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(T, IN, generator=gen).to(dtype),
        "a": [torch.randn(SLOTS, RANK, IN, generator=gen).to(dtype) for _ in WIDTHS],
        "b": [torch.randn(SLOTS, n, RANK, generator=gen).to(dtype) for n in WIDTHS],
        "y": torch.zeros(len(WIDTHS), T, RANK),
        "out": torch.zeros(T, sum(WIDTHS), dtype=dtype),
        "meta": build_lora_metadata(torch.tensor([1, -1, 0]), torch.tensor([RANK, 4])),
        "offsets": None,
    }


def call_shrink(args, fn):
    fn(args["x"], args["a"], args["meta"], args["y"])


def call_expand(args, fn):
    fn(args["y"], args["b"], args["meta"], args["out"], args["offsets"])


def call_add_lora(args, _fn):
    lora_ops.add_lora(args["out"], args["x"], args["a"], args["b"], args["meta"], args["offsets"])


SHRINK_CASES = {
    "x float64": ("x", lambda v: v["x"].double(), "x dtype must be one of float32, bfloat16"),
    "x 1-D": ("x", lambda v: v["x"][0], "x must be 2-D"),
    "x not a tensor": ("x", lambda v: v["x"].tolist(), "x must be a torch.Tensor"),
    "x non-contiguous": ("x", lambda v: v["x"].t().contiguous().t(), "x rows must be contiguous"),
    "x rows": ("x", lambda v: v["x"][:2], "x has 2 rows but meta has 3 tokens"),
    "a dtype": ("a", lambda v: [t.half() for t in v["a"]], r"a_stacked\[0\] dtype torch.float16"),
    "x bf16, weights fp32": ("x", lambda v: v["x"].bfloat16(), r"a_stacked\[0\] dtype .* differs from x dtype"),
    "a in_features": ("a", lambda v: [t[..., :10].contiguous() for t in v["a"]],
                      "a_stacked.0. has 10 input features, x has 24"),
    "a shapes differ": ("a", lambda v: [v["a"][0], v["a"][1][:, :8].contiguous()],
                        r"a_stacked\[1\] shape \(2, 8, 24\) differs"),
    "a slots": ("a", lambda v: [t[:1] for t in v["a"]], r"has 1 slots but meta.slot_ranks has 2"),
    "a rank too small": ("a", lambda v: [t[:, :8].contiguous() for t in v["a"]],
                         "max_rank 8 is below the batch's largest rank 16"),
    "a four slices": ("a", lambda v: v["a"] * 2, "a_stacked must be a list of 1 to 3 tensors"),
    "a empty": ("a", lambda v: [], "a_stacked must be a list of 1 to 3 tensors"),
    "a tensor not list": ("a", lambda v: v["a"][0], "a_stacked must be a list"),
    "y dtype": ("y", lambda v: v["y"].half(), "y dtype must be one of float32"),
    "y shape": ("y", lambda v: v["y"][:, :, :8].contiguous(), r"y shape \(2, 3, 8\) should be"),
    "meta type": ("meta", lambda v: {"token_slots": [1, -1, 0]}, "meta must be a LoRABatchMetadata"),
    "meta device": ("meta", lambda v: build_lora_metadata(
        torch.tensor([1, -1, 0]), torch.tensor([RANK, 4]), device="meta"),
        "x is on cpu but meta is on meta"),
}  # fmt: skip

EXPAND_CASES = {
    "out float64": ("out", lambda v: v["out"].double(), "out dtype must be one of"),
    "out rows": ("out", lambda v: v["out"][:1], "out has 1 rows but meta has 3 tokens"),
    "out non-contiguous": ("out", lambda v: torch.zeros(sum(WIDTHS), T).t(),
                           "out rows must be contiguous"),
    "b dtype": ("b", lambda v: [t.bfloat16() for t in v["b"]], r"b_stacked\[0\] dtype .* differs"),
    "b rank": ("b", lambda v: [v["b"][0], v["b"][1][..., :8].contiguous()],
               r"b_stacked\[1\] shape \(2, 12, 8\): max_loras and max_rank differ"),
    "b 2-D": ("b", lambda v: [v["b"][0][0], v["b"][1]], r"b_stacked\[0\] must be 3-D"),
    "offsets overlap": ("offsets", lambda v: [0, 10], "slice_offsets .* overlap or fall outside"),
    "offsets outside": ("offsets", lambda v: [0, 25], "slice_offsets .* overlap or fall outside"),
    "offsets negative": ("offsets", lambda v: [-1, 20], "slice_offsets .* overlap or fall outside"),
    "offsets count": ("offsets", lambda v: [0], "slice_offsets must be 2 ints"),
    "offsets floats": ("offsets", lambda v: [0.0, 20.0], "slice_offsets must be 2 ints"),
    "y shape": ("y", lambda v: v["y"][:1], r"y shape \(1, 3, 16\) should be \(2, 3, 16\)"),
}  # fmt: skip


def _bad(cases: dict, key: str):
    field, change, message = cases[key]
    args = valid()
    args[field] = change(args)
    return args, message


def cpu_stacks_args():
    """valid()'s stacks copied into the CPU layout (kernels/cpu_stacks.py)."""
    args = valid()
    stacks, a, b = lora_ops.cpu_stacks(SLOTS, RANK, IN, WIDTHS, torch.float32)
    for view, src in zip(a + b, args["a"] + args["b"], strict=True):
        view.copy_(src)
    return args, stacks


def test_add_lora_cpu_adds_what_add_lora_adds():
    args, stacks = cpu_stacks_args()
    before = args["out"].clone()
    call_add_lora(args, None)
    got = before.clone()
    lora_ops.add_lora_cpu(got, args["x"], stacks, args["meta"])
    torch.testing.assert_close(got, args["out"])
    assert not torch.equal(before, got)  # something was added


def test_add_lora_cpu_rejects_calls_that_do_not_fit_the_stacks():
    args, stacks = cpu_stacks_args()
    x, out, meta = args["x"], args["out"], args["meta"]
    before = out.clone()
    for call, message in (
        (lambda: lora_ops.add_lora_cpu(out, x, [stacks.a_t], meta), "stacks must be CpuStacks"),
        (lambda: lora_ops.add_lora_cpu(out, x[:, :10], stacks, meta), r"x shape \(3, 10\) should be \(3, 24\)"),
        (lambda: lora_ops.add_lora_cpu(out[:2], x[:2], stacks, meta), r"x shape \(2, 24\) should be \(3, 24\)"),
        (lambda: lora_ops.add_lora_cpu(out[:, :20], x, stacks, meta), r"out shape \(3, 20\) should be \(3, 32\)"),
        (lambda: lora_ops.add_lora_cpu(out, x.double(), stacks, meta), "x dtype must be one of"),
        (lambda: lora_ops.add_lora_cpu(out, x.bfloat16(), stacks, meta), "out dtype torch.float32 differs"),
        (lambda: lora_ops.add_lora_cpu(out, x, stacks, "meta"), "meta must be a LoRABatchMetadata"),
        (lambda: lora_ops.add_lora_cpu(
            out, x, stacks, build_lora_metadata(torch.tensor([0, 1, 2]), torch.tensor([4, 4, 4]))),
         "stacks has 2 slots but meta.slot_ranks has 3"),  # fmt: skip
        (lambda: lora_ops.add_lora_cpu(
            out, x, lora_ops.cpu_stacks(SLOTS, 8, IN, WIDTHS, torch.float32)[0], meta),
         "stacks max_rank 8 is below the batch's largest rank 16"),  # fmt: skip
    ):
        with pytest.raises(ValueError, match=message):
            call()
        assert torch.equal(out, before)


def test_cpu_stacks_refuse_a_bad_layout():
    for kwargs, message in (
        ({"output_sizes": []}, "output_sizes must be 1 to 3 widths"),
        ({"output_sizes": [4, 4, 4, 4]}, "output_sizes must be 1 to 3 widths"),
        ({"output_sizes": [4, 0]}, "output_sizes must be 1 to 3 widths"),
        ({"max_rank": 0}, "must be >= 1"),
        ({"dtype": torch.float64}, "dtype must be float32, bfloat16 or float16"),
    ):
        args = {"max_loras": 2, "max_rank": 4, "in_features": 8, "output_sizes": [4, 4], "dtype": torch.float32}
        with pytest.raises(ValueError, match=message):
            lora_ops.cpu_stacks(**(args | kwargs))
    stacks = lora_ops.cpu_stacks(2, 4, 8, [4, 4, 4], torch.float32)[0]
    assert stacks.with_index([0, 2]).index == (0, 2)
    for index in ([], [2, 0], [0, 0], [3]):
        with pytest.raises(ValueError, match="index must name 1 to 3 distinct slices"):
            stacks.with_index(index)


@pytest.mark.parametrize("fn", [triton_lora.lora_shrink, lora_ops.lora_shrink],
                         ids=["triton", "dispatcher"])  # fmt: skip
@pytest.mark.parametrize("key", SHRINK_CASES)
def test_shrink_rejects(key, fn):
    args, message = _bad(SHRINK_CASES, key)
    y_before = args["y"].clone()
    with pytest.raises(ValueError, match=message):
        call_shrink(args, fn)
    assert torch.equal(args["y"], y_before)  # nothing ran


@pytest.mark.parametrize("fn", [triton_lora.lora_expand, lora_ops.lora_expand],
                         ids=["triton", "dispatcher"])  # fmt: skip
@pytest.mark.parametrize("key", EXPAND_CASES)
def test_expand_rejects(key, fn):
    args, message = _bad(EXPAND_CASES, key)
    out_before = args["out"].clone()
    with pytest.raises(ValueError, match=message):
        call_expand(args, fn)
    assert torch.equal(args["out"], out_before)


ADD_LORA_CASES = {
    k: v for k, v in {**SHRINK_CASES, **EXPAND_CASES}.items()
    # add_lora has no y argument; on the CPU its weights may be fp32 under bf16 activations
    if not k.startswith("y") and k != "x bf16, weights fp32"
}  # fmt: skip


@pytest.mark.parametrize("key", ADD_LORA_CASES)
def test_add_lora_rejects(key):
    args, message = _bad(ADD_LORA_CASES, key)
    out_before = args["out"].clone()
    with pytest.raises(ValueError, match=message):
        call_add_lora(args, None)
    assert torch.equal(args["out"], out_before)


def test_add_lora_rejects_mismatched_a_and_b():
    args = valid()
    args["b"] = args["b"][:1]
    with pytest.raises(ValueError, match="b_stacked has 1 slices but a_stacked has 2"):
        call_add_lora(args, None)
    args = valid()
    args["b"] = [t.bfloat16() for t in args["b"]]
    args["out"] = args["out"].bfloat16()
    with pytest.raises(ValueError, match="out dtype torch.bfloat16 differs from x dtype"):
        call_add_lora(args, None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_k": 100}, "block_k must be a power of two >= 16"),
        ({"block_r": 8}, "block_r must be a power of two >= 16"),
        ({"split_k": 0}, "split_k must be an int >= 1"),
    ],
)
def test_shrink_block_sizes(kwargs, message):
    args = valid()
    with pytest.raises(ValueError, match=message):
        triton_lora.lora_shrink(args["x"], args["a"], args["meta"], args["y"], **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"block_n": 48}, "block_n must be a power of two"), ({"block_r": 0}, "block_r must be")],
)
def test_expand_block_sizes(kwargs, message):
    args = valid()
    with pytest.raises(ValueError, match=message):
        triton_lora.lora_expand(args["y"], args["b"], args["meta"], args["out"], **kwargs)


def test_add_lora_on_the_cpu_takes_fp32_activations_with_bf16_weights():
    """A bf16 model's base linear runs in fp32 on the CPU; its LoRA delta joins that fp32 result
    with the slot weights left in bf16: the same sums as with the weights upcast beforehand."""
    mixed = valid()
    mixed["a"] = [t.bfloat16() for t in mixed["a"]]
    mixed["b"] = [t.bfloat16() for t in mixed["b"]]
    upcast = dict(mixed, a=[t.float() for t in mixed["a"]], b=[t.float() for t in mixed["b"]],
                  out=mixed["out"].clone())  # fmt: skip
    call_add_lora(mixed, None)
    call_add_lora(upcast, None)
    assert torch.equal(mixed["out"], upcast["out"]) and mixed["out"].abs().sum() > 0
    assert torch.equal(mixed["out"][1], torch.zeros(sum(WIDTHS)))  # slot -1 untouched
