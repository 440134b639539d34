"""Prefix caching end to end: reusing cached KV never changes an output, on the real SmolLM2
GGUF (base model, multi-turn chat) and on a tiny checkpoint with PEFT adapters (no KV shared
across adapters, adapters evicted from their slot or unloaded). fp32, so "identical" holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.sampling_params import SamplingParams
from tests.inference.lora.peft_adapters import BASE_DIR, write_base_and_adapters

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SYSTEM = (
    "You are a careful assistant for a hardware shop. Answer in one or two short sentences. "
    "The shop sells drills, saws, hammers, screws, nails, glue, paint and ladders; it opens at "
    "eight and closes at six, except on Sundays when it is closed. Returns are accepted within "
    "thirty days with a receipt. Never invent products the shop does not sell."
)
QUESTIONS = ["Do you sell paint?", "When do you open?", "Can I return a drill?"]


def smol(path: Path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", max_loras=0, **overrides), progress=False)


@pytest.fixture(scope="module")
def cached(smollm2_path) -> LLMEngine:
    return smol(smollm2_path)


@pytest.fixture(scope="module")
def uncached(smollm2_path) -> LLMEngine:
    return smol(smollm2_path, enable_prefix_caching=False)


def complete(engine: LLMEngine, requests: list[dict], params=GREEDY) -> list:
    ids = [engine.add_request(params=params, **r) for r in requests]
    done = engine.run_until_done(ids)
    return [done[i] for i in ids]


def test_a_multi_turn_chat_reuses_each_earlier_turn_and_answers_as_without_the_cache(cached, uncached):
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        [with_cache] = complete(cached, [{"messages": list(messages)}])
        [without] = complete(uncached, [{"messages": list(messages)}])
        assert with_cache.token_ids == without.token_ids, f"turn {turn} changed"
        assert without.usage.cached_tokens == 0
        prompt = with_cache.usage.prompt_tokens
        if turn > 0:  # everything up to the last full block before this turn's question
            assert with_cache.usage.cached_tokens >= (prompt - 40) // 16 * 16 - 16
            assert with_cache.usage.cached_tokens < prompt
        messages.append({"role": "assistant", "content": with_cache.text})
    stats = cached.stats
    assert stats.prefix_cache_hits[""] > 0.5 * stats.prefix_cache_queries[""]
    assert uncached.stats.prefix_cache_queries == {}


def test_a_batch_sharing_one_system_prompt_answers_as_without_the_cache(cached, uncached):
    requests = [
        {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]}
        for q in QUESTIONS
    ]
    assert [o.token_ids for o in complete(cached, requests)] == [o.token_ids for o in complete(uncached, requests)]


def test_a_prefix_that_ends_inside_a_block_reuses_the_whole_blocks_only(cached, uncached):
    first = list(range(1000, 1037))  # 37 tokens: 2 full blocks and 5 tokens of a third
    second = first + [2000, 2001, 2002]
    complete(cached, [{"prompt": first + [3000] * 7}])
    [out] = complete(cached, [{"prompt": second}])
    assert out.usage.cached_tokens == 32
    assert out.token_ids == complete(uncached, [{"prompt": second}])[0].token_ids


def test_requests_with_different_salts_never_hit_each_others_blocks(cached):
    prompt = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}]}
    [a1] = complete(cached, [{**prompt, "cache_salt": "tenant-a"}])
    [b] = complete(cached, [{**prompt, "cache_salt": "tenant-b"}])
    [a2] = complete(cached, [{**prompt, "cache_salt": "tenant-a"}])
    assert a1.usage.cached_tokens == 0 and b.usage.cached_tokens == 0
    assert a2.usage.cached_tokens > 0.8 * a2.usage.prompt_tokens
    assert a1.token_ids == b.token_ids == a2.token_ids


@pytest.mark.parametrize("salt", ["", 7, ["x"]])
def test_a_bad_cache_salt_is_refused_naming_the_field(cached, salt):
    with pytest.raises(ValueError, match="cache_salt"):
        cached.add_request("hello", GREEDY, cache_salt=salt)


# -- adapters (tiny random checkpoint) -----------------------------------------------------------

PROMPT = [(7 * i + 3) % 250 + 3 for i in range(40)]  # 40 tokens: 2 full blocks + 8
ADAPTER_GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_base_and_adapters(tmp_path_factory.mktemp("prefix_adapters"), "ab", 20, r=8, lora_alpha=16,
                                   target_modules=["q_proj", "k_proj", "v_proj"])


def tiny(root: Path, **overrides) -> LLMEngine:
    config = dict(model=str(root / BASE_DIR), dtype="float32", max_loras=2, max_cpu_loras=4,
                  max_lora_rank=16, kv_cache_memory="8MiB")  # fmt: skip
    engine = LLMEngine(EngineConfig(**{**config, **overrides}), progress=False)
    for name in "ab":
        engine.add_adapter(name, root / name)
    return engine


def generate(engine: LLMEngine, lora: str | None, prompt=PROMPT):
    rid = engine.add_request(prompt, ADAPTER_GREEDY, lora=lora)
    return engine.run_until_done([rid])[rid]


@pytest.fixture(scope="module")
def reference(root: Path) -> dict:
    """Each adapter's (and the base's) output with the cache off."""
    engine = tiny(root, enable_prefix_caching=False)
    try:
        return {lora: generate(engine, lora).token_ids for lora in (None, "a", "b")}
    finally:
        engine.shutdown()


def test_a_prefix_shared_by_two_adapters_is_computed_for_each(root: Path, reference: dict):
    engine = tiny(root)
    try:
        assert len({tuple(t) for t in reference.values()}) == 3  # the adapters do change the output
        for lora in ("a", "b", None):
            out = generate(engine, lora)
            assert out.usage.cached_tokens == 0, f"{lora} reused another adapter's KV"
            assert out.token_ids == reference[lora]
        for lora in ("a", "b", None):
            out = generate(engine, lora)
            assert out.usage.cached_tokens == 32
            assert out.token_ids == reference[lora]
        assert engine.stats.prefix_cache_hits == {"a": 32, "b": 32, "": 32}
        assert engine.stats.prefix_cache_queries == {"a": 80, "b": 80, "": 80}
    finally:
        engine.shutdown()


def test_an_adapter_evicted_from_its_slot_still_hits_when_it_comes_back(root: Path, reference: dict):
    engine = tiny(root, max_loras=1)
    try:
        generate(engine, "a")
        assert generate(engine, "b").token_ids == reference["b"]  # takes a's only slot
        out = generate(engine, "a")
        assert out.usage.cached_tokens == 32 and out.token_ids == reference["a"]
        assert engine.lora_stats()["evictions"]["device"] >= 1
    finally:
        engine.shutdown()


def test_an_unloaded_adapters_cached_blocks_are_forgotten(root: Path, reference: dict):
    engine = tiny(root)
    try:
        generate(engine, "a")
        generate(engine, "b")
        cached_before = engine.block_manager.num_cached_blocks
        engine.remove_adapter("a")
        engine.step()  # the removal is applied between steps
        assert engine.block_manager.num_cached_blocks == cached_before - 2
        assert generate(engine, "b").usage.cached_tokens == 32  # b's blocks stay
        engine.add_adapter("a", root / "a")
        out = generate(engine, "a")
        assert out.usage.cached_tokens == 0 and out.token_ids == reference["a"]
    finally:
        engine.shutdown()


# Tiny: 3 layers x 16 tokens x 2 kv heads x 16 dims x 2 (K,V) x 4 bytes = 12,288 bytes per block.
TINY_BLOCK_BYTES = 12_288


def test_preemption_under_a_tiny_kv_budget_keeps_outputs_identical(root: Path, reference: dict):
    engine = tiny(root, kv_cache_memory=10 * TINY_BLOCK_BYTES)  # 10 blocks, 4 requests of 3-4
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        loras = [None, "a", "b", "a"]
        ids = [engine.add_request(PROMPT, params, lora=lora) for lora in loras]
        done = engine.run_until_done(ids)
        assert engine.stats.num_preemptions > 0
        for rid, lora in zip(ids, loras, strict=True):
            assert done[rid].token_ids[:8] == reference[lora]
        assert done[ids[1]].token_ids == done[ids[3]].token_ids
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.shutdown()


def test_abort_mid_prefill_frees_every_block_and_keeps_the_finished_chunks(root: Path, reference: dict):
    engine = tiny(root, max_num_batched_tokens=16)
    try:
        rid = engine.add_request(PROMPT, ADAPTER_GREEDY, lora="a")
        engine.step()
        engine.step()  # 32 of 40 prompt tokens computed: 2 full blocks cached
        assert engine.abort_request(rid)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        out = generate(engine, "a")
        assert out.usage.cached_tokens == 32 and out.token_ids == reference["a"]
    finally:
        engine.shutdown()
