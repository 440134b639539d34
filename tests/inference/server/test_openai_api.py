"""The OpenAI-compatible API of a real `python -m inference serve` process (SmolLM2, fp32),
driven by the official openai SDK: chat and completions, streaming, usage, stop, seed, n,
logprobs, /v1/models, /health vs /ready, tenant fields."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai

from tests.inference.server.conftest import SERVED

HI = [{"role": "user", "content": "Hi"}]


def test_health_answers_while_the_model_loads_and_ready_after(server):
    assert server.saw_health_before_ready, "never saw /health 200 while /ready was 503"
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{server.url}/ready")
    assert ready.status_code == 200 and ready.json()["model"] == SERVED
    assert "loading model" in server.log and "model loaded in" in server.log


def test_models_lists_the_served_names(client):
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED, "alias-name"]
    assert all(m.parent is None for m in models) and all(m.max_model_len == 8192 for m in models)


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=SERVED, messages=HI, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.model == SERVED
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content.startswith("Hello")
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The alias selects the same base model.
    again = client.chat.completions.create(model="alias-name", messages=HI, max_tokens=6, temperature=0)
    assert again.choices[0].message.content == choice.message.content


def test_chat_streaming_matches_non_streaming_and_reports_usage(client):
    full = client.chat.completions.create(model=SERVED, messages=HI, max_completion_tokens=5, temperature=0)
    chunks = list(client.chat.completions.create(
        model=SERVED, messages=HI, max_completion_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streaming_and_not(client):
    r = client.completions.create(model=SERVED, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text.startswith(" Paris")
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    parts = list(client.completions.create(model=SERVED, prompt="The capital of France is", max_tokens=4,
                                           temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == r.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"


def test_completions_take_a_list_of_prompts_and_token_ids(client):
    r = client.completions.create(model=SERVED, prompt=["The capital of France is", [504, 3575, 282]],
                                  max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text.startswith(" Paris")
    assert r.usage.prompt_tokens == 5 + 3


def test_stop_strings_end_the_output(client):
    r = client.chat.completions.create(model=SERVED, messages=HI, max_tokens=4, temperature=0, stop="!")
    assert r.choices[0].message.content == "Hello" and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=SERVED, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  stop=[".", "\n"])
    assert r.choices[0].text == " Paris" and r.choices[0].finish_reason == "stop"


def test_seed_reproduces_a_sample_and_n_gives_distinct_choices(client):
    def sample(**kw):
        return client.completions.create(model=SERVED, prompt="Once upon a time", max_tokens=4, temperature=1.0,
                                         top_p=0.95, seed=1234, extra_body={"ignore_eos": True}, **kw)

    a, b = sample(), sample()
    assert a.choices[0].text == b.choices[0].text
    three = sample(n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.choices[0].text == a.choices[0].text  # choice i samples with seed + i
    assert len({c.text for c in three.choices}) > 1
    assert three.usage.completion_tokens == 12 and three.usage.prompt_tokens == a.usage.prompt_tokens


def test_n_streams_every_choice(client):
    chunks = list(client.chat.completions.create(model=SERVED, messages=HI, max_tokens=4, temperature=0.8, seed=3,
                                                 n=2, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(texts.values())
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=SERVED, messages=HI, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely
        assert t.bytes == list(t.token.encode())
    plain = client.chat.completions.create(model=SERVED, messages=HI, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(client):
    r = client.completions.create(model=SERVED, prompt="The capital of France is", max_tokens=3, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_penalties_user_and_tenant_fields_are_accepted(client):
    r = client.chat.completions.create(
        model=SERVED, messages=HI, max_tokens=4, temperature=0, presence_penalty=0.5, frequency_penalty=0.5,
        user="someone", extra_body={"tenant": "acme", "tenant_weight": 2.0, "top_k": 5},
    )
    assert r.choices[0].message.content


def test_concurrent_streams_all_complete_with_the_sequential_text(client):
    prompts = ["Name a colour.", "Say hello.", "What is 2+2?", "Hi"]
    expected = {
        p: client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": p}], max_tokens=4,
                                          temperature=0).choices[0].message.content
        for p in prompts
    }

    def stream(p: str) -> str:
        chunks = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": p}],
                                                max_tokens=4, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(stream, prompts * 2))
    assert got == [expected[p] for p in prompts * 2]


def test_metrics_use_vllm_names(server, client):
    client.completions.create(model=SERVED, prompt="Hello", max_tokens=2, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_success_total"):
        assert f"\n{name}" in text, name
    assert server.metric("vllm:request_success_total", finished_reason="length") >= 1
    assert server.metric("vllm:generation_tokens_total") >= 2


def test_sdk_sees_typed_errors(client):
    import pytest

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=HI, max_tokens=2)
    assert e.value.code == "model_not_found"
