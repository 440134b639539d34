"""How decode rows and prefill chunks attend, chosen at start-up (inference/layers/attention_plan.py): forced by the
flag, raced on the model's own heads under auto, torch wherever the fused kernel cannot serve
(not built here, heads it does not take, CUDA), and the engine's steps then run on the choice."""

from __future__ import annotations

import json

import pytest
import torch

from inference.config import ATTENTION_KERNEL_CHOICES, ConfigError, EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.sampling_params import SamplingParams
from inference.layers import attention_plan
from inference.layers.attention_plan import fused_unsupported, with_attention_kernel
from inference.layers.matmul_plan import NATIVE, forced_plan
from kernels import cpu_fused
from tests.inference.models.tiny_llama import write_tiny_checkpoint, write_word_tokenizer

CPU = torch.device("cpu")
PLAN = forced_plan(NATIVE, torch.bfloat16)
HEADS = (4, 2, 64)  # query heads, kv heads, head size: what the kernel takes on every x86 build


def test_the_config_and_its_variable_know_every_attention_kernel():
    assert ATTENTION_KERNEL_CHOICES == ("auto", "fused", "torch") and EngineConfig().attention_kernel == "auto"
    assert EngineConfig.from_env({"INFERENCE_ATTENTION_KERNEL": "torch"}).attention_kernel == "torch"
    with pytest.raises(ConfigError, match="INFERENCE_ATTENTION_KERNEL: expected one of auto, fused, torch"):
        EngineConfig.from_env({"INFERENCE_ATTENTION_KERNEL": "sdpa"})


KINDS = ("attention_kernel", "prefill_attention_kernel")  # decode rows, prefill chunks


def test_forced_kernels_are_taken_and_auto_takes_the_faster_by_the_switch_margin():
    for kernel in ("torch", "fused"):
        forced = with_attention_kernel(PLAN, kernel, *HEADS, torch.bfloat16, CPU)
        assert (forced.attention_kernel, forced.prefill_attention_kernel) == (kernel, kernel)
    auto = with_attention_kernel(PLAN, "auto", *HEADS, torch.bfloat16, CPU)
    described = json.loads(json.dumps(auto.describe()))
    for kind in KINDS:  # each raced on its own
        timed = auto.timings[kind]
        assert set(timed) == {"torch", "fused"}
        fused_wins = timed["fused"] < attention_plan.SWITCH_FACTOR * timed["torch"]
        assert getattr(auto, kind) == described[kind] == ("fused" if fused_wins else "torch")


@pytest.mark.parametrize(
    ("heads", "dtype", "why"),
    [((4, 2, 20), torch.bfloat16, "head size 20"), ((6, 4, 64), torch.bfloat16, "6 query heads over 4 kv heads"),
     ((34, 2, 64), torch.float32, "34 query heads over 2 kv heads"), ((4, 2, 64), torch.float64, "dtype torch.float64")],
)  # fmt: skip
def test_heads_the_kernel_cannot_take_run_on_torch_and_forcing_fused_says_why(heads, dtype, why):
    assert why in fused_unsupported(*heads, dtype)
    auto = with_attention_kernel(PLAN, "auto", *heads, dtype, CPU)
    assert (auto.attention_kernel, auto.prefill_attention_kernel) == ("torch", "torch")
    with pytest.raises(RuntimeError, match=f"attention kernel fused: {why}"):
        with_attention_kernel(PLAN, "fused", *heads, dtype, CPU)


def test_without_the_kernels_auto_takes_torch_fused_says_why_and_cuda_keeps_its_own(monkeypatch):
    with pytest.raises(ValueError, match="attention kernel must be one of auto, fused, torch"):
        with_attention_kernel(PLAN, "fastest", *HEADS, torch.bfloat16, CPU)
    cuda = with_attention_kernel(PLAN, "auto", *HEADS, torch.bfloat16, torch.device("cuda"))
    assert (cuda.attention_kernel, cuda.prefill_attention_kernel) == ("torch", "torch")
    monkeypatch.setattr(cpu_fused, "_state", {"error": "RuntimeError: no C++ compiler (c++) on PATH"})
    assert cpu_fused.attention_op() is None and cpu_fused.prefill_attention_op() is None
    auto = with_attention_kernel(PLAN, "auto", *HEADS, torch.bfloat16, CPU)
    assert (auto.attention_kernel, auto.prefill_attention_kernel) == ("torch", "torch")
    with pytest.raises(RuntimeError, match=r"attention kernel fused: cannot be built here \(RuntimeError: no C\+\+"):
        with_attention_kernel(PLAN, "fused", *HEADS, torch.bfloat16, CPU)


def test_the_engine_decodes_alike_on_either_kernel(tmp_path):
    """Greedy tokens of a batch whose prompts prefill and then decode at different lengths, fp32
    (the kernels differ only in summation order): the same on both, and the steps carry the
    plan's choices."""
    hf = write_tiny_checkpoint(tmp_path)
    write_word_tokenizer(tmp_path, hf.config.vocab_size)
    prompts = [[5, 17, 3], list(range(2, 40)), [9] * 70, [11, 12]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {}
    for kernel in ("fused", "torch"):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", attention_kernel=kernel, max_loras=0,
                                        kv_cache_memory="4MiB"), progress=False)  # fmt: skip
        assert engine.matmul_plan.attention_kernel == kernel and engine.runner.decode_kernel == kernel
        assert engine.matmul_plan.prefill_attention_kernel == kernel and engine.runner.prefill_kernel == kernel
        done = engine.run_until_done([engine.add_request(p, params) for p in prompts])
        tokens[kernel] = [list(o.token_ids) for o in done.values()]
    assert tokens["fused"] == tokens["torch"]
