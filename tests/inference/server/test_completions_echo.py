"""Prompt scoring over /v1/completions, as vLLM serves it to evaluation harnesses: `echo` with
`logprobs` (the prompt's tokens first, the first one without a logprob), `max_tokens: 0`
(prefill only), vLLM's `prompt_logprobs` extra, for the base and for an adapter, streaming, a
batch of prompts with n > 1, and the bad inputs (a 400 naming the parameter)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.inference.server.conftest import SERVED, TINY
from tests.inference.server.tiny_lora import word_prompt

PROMPT = word_prompt(seed=5, length=12)  # "t17 t204 ..." (one word-level token per word)


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"model": TINY, "temperature": 0, **body}, timeout=60)


def _ok(server, body: dict) -> dict:
    r = _post(server, body)
    assert r.status_code == 200, r.text
    return r.json()


def _error_param(server, body: dict) -> str:
    r = _post(server, body)
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"]


def test_echo_logprobs_start_with_the_prompt_tokens(lora_server):
    out = _ok(lora_server, {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3})
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    assert lp["tokens"][:12] == PROMPT.split(" ")
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 15
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    # as vLLM: the token itself and its 2 most likely alternatives (2 or 3 distinct entries)
    assert all(2 <= len(top) <= 3 and top[tok] == v
               for tok, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True))
    # offsets count the tokens' characters from the start of the echoed text (vLLM's rule)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(15)]
    assert out["usage"] == {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    # the echoed prompt's logprobs are the same numbers prompt_logprobs gives
    scored = _ok(lora_server, {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0})["choices"][0]
    assert [None, *(next(iter(e.values()))["logprob"] for e in scored["prompt_logprobs"][1:])] == \
        lp["token_logprobs"][:12]


def test_max_tokens_zero_with_echo_scores_the_prompt_only(lora_server):
    out = _ok(lora_server, {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0})
    choice = out["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == PROMPT.split(" ")
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert out["usage"]["prompt_tokens"] == 12 and out["usage"]["completion_tokens"] == 0
    # the same numbers as the prompt part of a generating request
    longer = _ok(lora_server, {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 2})["choices"][0]
    assert longer["logprobs"]["token_logprobs"][:12] == choice["logprobs"]["token_logprobs"]


def test_prompt_logprobs_shape_is_vllms(lora_server):
    choice = _ok(lora_server, {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2})["choices"][0]
    entries = choice["prompt_logprobs"]
    ids = [int(w[1:]) for w in PROMPT.split(" ")]
    assert len(entries) == 12 and entries[0] is None
    for token_id, entry in zip(ids[1:], entries[1:], strict=True):
        mine = entry[str(token_id)]
        assert mine["decoded_token"] == f"t{token_id}" and mine["rank"] >= 1 and mine["logprob"] <= 0
        assert {1, 2} <= {v["rank"] for v in entry.values()}  # the token itself and the 2 most likely
        assert len(entry) == (2 if mine["rank"] <= 2 else 3)
        best = next(v for v in entry.values() if v["rank"] == 1)
        assert best["logprob"] >= mine["logprob"]
    assert choice["text"] and choice["logprobs"] is None  # generation goes on as usual


def test_adapter_scores_the_prompt_differently(lora_server):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 0}
    base = _ok(lora_server, body)["choices"][0]["logprobs"]["token_logprobs"]
    adapted = _ok(lora_server, {**body, "model": "ad0"})["choices"][0]["logprobs"]["token_logprobs"]
    assert base[0] is None and adapted[0] is None
    assert max(abs(a - b) for a, b in zip(base[1:], adapted[1:], strict=True)) > 1e-3
    assert _ok(lora_server, {**body, "model": "ad0"})["choices"][0]["logprobs"]["token_logprobs"] == adapted


def test_a_cached_prompt_is_still_scored_whole(lora_server):
    prompt = word_prompt(seed=6, length=40)  # more than two 16-token blocks
    plain = _ok(lora_server, {"prompt": prompt, "max_tokens": 1})
    again = _ok(lora_server, {"prompt": prompt, "max_tokens": 1})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32 > plain["usage"]["prompt_tokens_details"]["cached_tokens"]
    scored = _ok(lora_server, {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 0})
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    values = scored["choices"][0]["logprobs"]["token_logprobs"]
    assert len(values) == 40 and values[0] is None and None not in values[1:]


def test_echo_with_several_prompts_token_ids_and_n(lora_server):
    ids = [int(w[1:]) for w in PROMPT.split(" ")]
    out = _ok(lora_server, {"prompt": [PROMPT, ids[:5]], "echo": True, "logprobs": 0, "max_tokens": 2, "n": 2,
                            "temperature": 1.0, "seed": 3})
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(c["text"].startswith(PROMPT) for c in choices[:2])
    assert all(c["text"].startswith("t" + " t".join(map(str, ids[:5]))) for c in choices[2:])
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [14, 14, 7, 7]
    assert choices[2]["logprobs"]["token_logprobs"][:5] == choices[3]["logprobs"]["token_logprobs"][:5]
    # the same 5 prompt tokens in a longer prompt: the same scores (up to fp32 batching noise)
    assert choices[0]["logprobs"]["token_logprobs"][0] is None is choices[2]["logprobs"]["token_logprobs"][0]
    assert choices[0]["logprobs"]["token_logprobs"][1:5] == pytest.approx(
        choices[2]["logprobs"]["token_logprobs"][1:5], abs=1e-5)
    assert out["usage"]["prompt_tokens"] == 12 + 5 and out["usage"]["completion_tokens"] == 8


def _stream(server, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": TINY, "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_streaming_echo_sends_the_prompt_in_the_first_chunk(lora_server, max_tokens):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": max_tokens}
    chunks = _stream(lora_server, {**body, "stream_options": {"include_usage": True}})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices[0]["text"].startswith(PROMPT) and choices[0]["logprobs"]["token_logprobs"][0] is None
    whole = _ok(lora_server, body)["choices"][0]
    assert "".join(c["text"] for c in choices) == whole["text"]
    streamed = [v for c in choices for v in c["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]
    # each chunk's offsets start where the text streamed so far ends (vLLM's rule)
    assert [c["logprobs"]["text_offset"][0] for c in choices if c["logprobs"]] == \
        [len("".join(c["text"] for c in choices[:i])) for i, c in enumerate(choices) if c["logprobs"]]
    assert choices[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": 0}, "max_tokens"),  # only with echo
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"echo": "yes"}, "echo"),
])
def test_bad_scoring_requests_are_400_naming_the_param(lora_server, body, param):
    assert _error_param(lora_server, {"prompt": PROMPT, "max_tokens": 1, **body}) == param


def test_chat_prompt_logprobs_score_the_rendered_prompt_at_the_top_level(server):
    """vLLM's chat extra: the templated prompt's logprobs, once for the response (not per choice);
    with streaming it is a 400 naming it."""
    body = {"model": SERVED, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 1,
            "temperature": 0, "n": 2, "prompt_logprobs": 1}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    scored = out["prompt_logprobs"]
    assert len(scored) == out["usage"]["prompt_tokens"] and scored[0] is None
    assert all(1 <= len(position) <= 2 for position in scored[1:])  # the prompt token and the top 1
    assert all(e["logprob"] <= 0 and e["rank"] >= 1 for position in scored[1:] for e in position.values())
    assert all("prompt_logprobs" not in choice for choice in out["choices"])

    r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
