"""Prompt logprobs (vLLM's prompt_logprobs) and prefill-only requests (max_tokens 0), checked
against HF transformers on the same tiny random-weight checkpoint: whole-prompt log-softmax of
its logits, position by position, across chunked prefill and a prefix cache that already holds
the prompt."""

from __future__ import annotations

import pytest
import torch

from inference.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.sampling_params import SamplingParams
from tests.inference.models.tiny_llama import tiny_prompts
from tests.inference.server.tiny_lora import write_base

TOP = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import transformers

    path = write_base(tmp_path_factory.mktemp("tiny") / "base")
    return path, transformers.LlamaForCausalLM.from_pretrained(path).eval()


def make_engine(path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory=4 << 20, max_loras=0,
                                  **kwargs), progress=False)


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' logprobs [len(prompt) - 1, vocab]: row j predicts prompt[j + 1]."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def check(out, hf, prompt: list[int]) -> float:
    ref = reference(hf, prompt)
    scored = out.prompt_logprobs
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    worst = 0.0
    for j, lp in enumerate(scored[1:]):
        assert lp.token_id == prompt[j + 1]
        worst = max(worst, abs(lp.logprob - ref[j, prompt[j + 1]].item()))
        assert lp.rank == int((ref[j] > ref[j, prompt[j + 1]]).sum()) + 1
        assert [t for t, _ in lp.top] == ref[j].topk(TOP).indices.tolist()
    return worst


@pytest.mark.parametrize("chunk", [2048, 16])  # one prefill chunk; several chunks (40 tokens / 16)
def test_prompt_logprobs_match_transformers(checkpoint, chunk):
    path, hf = checkpoint
    engine = make_engine(path, max_num_batched_tokens=chunk)
    prompts = [p for p in tiny_prompts() if len(p) > 1]
    ids = [engine.add_request(p, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=TOP)) for p in prompts]
    done = engine.run_until_done(ids)
    worst = max(check(done[i], hf, p) for i, p in zip(ids, prompts, strict=True))
    print(f"\n[chunk {chunk}] max abs prompt logprob diff vs transformers: {worst:.3g}")
    assert worst < 1e-4
    assert all(len(done[i].token_ids) == 2 for i in ids)


def test_prompt_logprobs_ignore_the_prefix_cache(checkpoint):
    """The prompt is cached by a first request; one asking for prompt logprobs computes it all
    again (a cached prefix has no logits) and still scores every token; a plain one hits."""
    path, hf = checkpoint
    engine = make_engine(path, enable_prefix_caching=True)
    prompt = tiny_prompts()[2]  # 40 tokens: two full blocks of 16
    first = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    engine.run_until_done([first])
    scoring = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP))
    out = engine.run_until_done([scoring])[scoring]
    assert out.usage.cached_tokens == 0
    assert check(out, hf, prompt) < 1e-4
    plain = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    assert engine.run_until_done([plain])[plain].usage.cached_tokens == 32


def test_max_tokens_zero_prefills_only(checkpoint):
    path, hf = checkpoint
    engine = make_engine(path, max_num_batched_tokens=16)
    prompt = tiny_prompts()[2]
    other = engine.add_request(tiny_prompts()[1], SamplingParams(max_tokens=3, temperature=0))
    scoring = engine.add_request(prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
    done = engine.run_until_done([scoring, other])
    out = done[scoring]
    assert out.finished and out.finish_reason == "length"
    assert out.token_ids == [] and out.text == "" and out.time_to_first_token is None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 0)
    assert check_k0(out, hf, prompt) < 1e-4
    assert len(done[other].token_ids) == 3  # sharing its steps with the prefill-only one
    assert engine.stats.generation_tokens == 3
    assert not engine.has_unfinished_requests() and engine.block_manager.usage == 0


def check_k0(out, hf, prompt) -> float:
    ref = reference(hf, prompt)
    assert all(lp.top == () for lp in out.prompt_logprobs[1:])
    return max(abs(lp.logprob - ref[j, prompt[j + 1]].item()) for j, lp in enumerate(out.prompt_logprobs[1:]))


def test_one_token_prompt_has_only_the_null_entry(checkpoint):
    path, _ = checkpoint
    engine = make_engine(path)
    rid = engine.add_request([7], SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert engine.run_until_done([rid])[rid].prompt_logprobs == [None]


def test_a_preempted_request_scores_its_prompt_once(checkpoint):
    """Six KV blocks (96 tokens) for two 40-token prompts that each grow by 30: the newer one,
    asking for prompt logprobs, is preempted and recomputes prompt + output; its prompt scores
    come out once each and still match transformers."""
    path, hf = checkpoint
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory=6 * 12288, max_loras=0,
                                    max_num_batched_tokens=16), progress=False)
    assert engine.block_manager.num_blocks == 6
    first, second = tiny_prompts(seed=3)[2], tiny_prompts(seed=4)[2]
    a = engine.add_request(first, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    b = engine.add_request(second, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=TOP))
    done = engine.run_until_done([a, b])
    assert engine.stats.num_preemptions > 0
    assert len(done[b].token_ids) == 30
    assert check(done[b], hf, second) < 1e-4
