"""The engine end to end on the real SmolLM2 GGUF: batching never changes a request's output.

fp32 keeps greedy decisions free of bf16 rounding ties, so "identical" can be asserted.
"""

from __future__ import annotations

import pytest

from inference.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child in two sentences.",
    "List three prime numbers.",
    "What does a compiler do?",
    "Give me a tip for sleeping better.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Answer briefly, then explain the physics of Rayleigh scattering in a few more "
    "sentences, mentioning wavelength and the size of the molecules in the atmosphere.",
]


def conversations(n: int) -> list[list[dict]]:
    """n chat prompts of mixed lengths (long ones repeat a paragraph of context)."""
    out = []
    for i in range(n):
        question = QUESTIONS[i % len(QUESTIONS)]
        context = " ".join(["Context: the quick brown fox jumps over the lazy dog."] * (i % 5) * 3)
        out.append([{"role": "user", "content": f"{context} {question}".strip()}])
    return out


GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def make_engine(path, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", **kwargs), progress=False)


@pytest.fixture(scope="module")
def engine(smollm2_path) -> LLMEngine:
    return make_engine(smollm2_path)


def run(engine: LLMEngine, convs, params=GREEDY) -> list:
    ids = [engine.add_request(messages=c, params=params) for c in convs]
    done = engine.run_until_done(ids)
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def alone(engine) -> list[list[int]]:
    """Greedy output of the first 8 conversations, each run alone."""
    return [run(engine, [c])[0].token_ids for c in conversations(8)]


def test_output_is_identical_alone_and_in_a_batch_of_16(engine, alone):
    batch = run(engine, conversations(16))
    assert {len(o.prompt_token_ids) for o in batch} != 1  # mixed lengths
    for i in range(8):
        assert batch[i].token_ids == alone[i], f"conversation {i} changed inside the batch"
    assert all(o.finish_reason in ("stop", "length") for o in batch)


def test_chunked_prefill_equals_unchunked(smollm2_path, alone):
    chunked = make_engine(smollm2_path, max_num_batched_tokens=24)
    outs = run(chunked, conversations(8))
    assert max(len(o.prompt_token_ids) for o in outs) > 24  # prompts really were split
    assert [o.token_ids for o in outs] == alone


def test_preemption_under_a_tiny_kv_budget_keeps_outputs_identical(smollm2_path, alone):
    # 30 layers x 16 tokens x 3 kv heads x 64 dims x 2 (K,V) x 4 bytes = 737,280 bytes per block.
    tight = make_engine(smollm2_path, kv_cache_memory=40 * 737_280)
    outs = run(tight, conversations(8))
    assert tight.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    conv = conversations(3)[2]
    [solo] = run(engine, [conv], seeded)
    others = [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in (1, 2)] + [
        SamplingParams(max_tokens=12, temperature=1.0)
    ]
    ids = [
        engine.add_request(messages=c, params=p)
        for c, p in zip(conversations(3), others, strict=True)
    ]
    target = engine.add_request(messages=conv, params=seeded)
    done = engine.run_until_done([*ids, target])
    assert done[target].token_ids == solo.token_ids
    [other_seed] = run(
        engine, [conv], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=99)
    )
    assert other_seed.token_ids != solo.token_ids  # the seed matters


def test_stop_string_across_a_token_boundary(engine):
    [full] = run(engine, conversations(1), SamplingParams(max_tokens=24, temperature=0.0))
    tok = engine.tokenizer
    # Pick a stop string made of the end of token 3 and the start of token 4.
    first3 = tok.decode(full.token_ids[:3])
    first4 = tok.decode(full.token_ids[:4])
    assert len(first4) - len(first3) >= 1 and len(first3) >= 2
    stop = first3[-2:] + first4[len(first3) :][:1]
    expected = full.text[: full.text.index(stop)]
    [out] = run(
        engine, conversations(1), SamplingParams(max_tokens=24, temperature=0.0, stop=[stop])
    )
    assert out.finish_reason == "stop"
    assert out.text == expected and stop not in out.text


def test_stream_deltas_concatenate_to_the_final_text_with_multibyte_characters(engine):
    params = SamplingParams(max_tokens=48, temperature=1.3, seed=7)
    rid = engine.add_request(
        messages=[{"role": "user", "content": "用中文写一首关于月亮的诗 🌙"}], params=params
    )
    deltas, final = [], None
    while final is None:
        for out in engine.step():
            if out.request_id == rid:
                deltas.append(out.delta_text)
                if out.finished:
                    final = out
    assert "".join(deltas) == final.text
    assert final.text == engine.tokenizer.decode(final.token_ids)
    assert any(ord(ch) > 0x7F for ch in final.text)  # multi-byte characters really were produced
    assert not any(d.endswith("\ufffd") for d in deltas[:-1])


def test_max_tokens_and_finish_reason_length(engine):
    [out] = run(
        engine, conversations(1), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    )
    assert out.finish_reason == "length" and out.usage.completion_tokens == 3
    assert out.usage.prompt_tokens == len(out.prompt_token_ids)


def test_abort_frees_kv_blocks_and_reports_abort(engine):
    free = engine.block_manager.num_free_blocks
    rid = engine.add_request(
        messages=conversations(1)[0], params=SamplingParams(max_tokens=64, ignore_eos=True)
    )
    engine.step()
    assert engine.block_manager.num_free_blocks < free
    assert engine.abort_request(rid)
    assert engine.block_manager.num_free_blocks == free
    [out] = [o for o in engine.step() if o.request_id == rid]
    assert out.finished and out.finish_reason == "abort"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "word " * 9000}, "prompt"),
        ({"prompt": [1, 2, 10**9]}, "prompt"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_requests_raise_a_value_error_naming_the_field_and_others_keep_running(
    engine, kwargs, field
):
    good = engine.add_request(messages=conversations(1)[0], params=GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=field):
        engine.add_request(params=GREEDY, **kwargs)
    out = engine.run_until_done([good])[good]
    assert out.finish_reason in ("stop", "length") and out.token_ids


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
