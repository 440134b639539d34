"""Fuzzed request bodies never get a 5xx: valid bodies with one or more fields replaced by
values of random types and sizes, random JSON documents, and broken bytes — from a seeded
generator of our own (odd values picked by hand) and from hypothesis (JSON values it shrinks to
a minimal failing body if one ever gets a 5xx)."""

from __future__ import annotations

import json
import random

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.inference.server.conftest import SERVED

ODD_VALUES = [None, True, False, 0, -1, 1, 2, 3, 21, 129, 10**20, -(10**20), 0.0, 0.5, -0.5, 1.5, 2.5, 1e308,
              "", "x", "0.5", "\u0000", "\ud7ff" * 3, "🦙" * 5, [], [1], [-1], [10**12], ["a"], [""], [[1, 2]],
              [["a"]], {}, {"a": 1}, {"include_usage": True}, {"role": "user"}, [{}], [{"role": "user"}],
              [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
              [{"role": "user", "content": [{"type": "image_url"}]}], [{"role": "tool", "content": "x"}]]
CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
               "stop", "stream", "stream_options", "logprobs", "top_logprobs", "presence_penalty",
               "frequency_penalty", "user", "tenant", "tenant_weight", "top_k", "min_p", "repetition_penalty",
               "ignore_eos", "stop_token_ids", "tools", "tool_choice", "response_format", "logit_bias", "cache_salt"]
COMPLETION_FIELDS = ["prompt", "logprobs", "echo", "suffix", "best_of", *CHAT_FIELDS[2:]]


def _mutate(rng: random.Random, base: dict, fields: list[str]) -> dict:
    body = dict(base)
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(fields)
        if rng.random() < 0.15:
            body.pop(field, None)
        else:
            body[field] = rng.choice(ODD_VALUES)
    # Keep generation short whatever else happened: the fuzz is about input handling.
    if not isinstance(body.get("max_tokens"), int) or body.get("max_tokens", 0) > 2:
        body["max_tokens"] = rng.choice([1, 2, 0, "2"])
    body.pop("max_completion_tokens", None) if rng.random() < 0.7 else None
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 3:
        body["n"] = 3 if rng.random() < 0.5 else 200
    body.pop("ignore_eos", None)
    return body


def test_fuzzed_bodies_never_get_a_5xx(server):
    rng = random.Random(20240501)
    chat = {"model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    completion = {"model": SERVED, "prompt": "Hello", "max_tokens": 2}
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for i in range(120):
            kind = i % 4
            if kind == 0:
                path, content = "/v1/chat/completions", json.dumps(_mutate(rng, chat, CHAT_FIELDS))
            elif kind == 1:
                path, content = "/v1/completions", json.dumps(_mutate(rng, completion, COMPLETION_FIELDS))
            elif kind == 2:  # any JSON document at all
                path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/load_lora_adapter",
                                   "/v1/unload_lora_adapter"])
                content = json.dumps(rng.choice(ODD_VALUES))
            else:  # a valid body cut short or with a byte flipped
                raw = json.dumps(_mutate(rng, chat, CHAT_FIELDS)).encode()
                cut = rng.randrange(len(raw))
                content = raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:] if rng.random() < 0.5 else raw[:cut]
                path = "/v1/chat/completions"
            r = http.post(path, content=content, headers={"content-type": "application/json"})
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
            assert r.status_code < 500, f"{r.status_code} for {path} {content!r}: {r.text}"
            if r.status_code >= 400:
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, r.text
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    assert statuses.get(200, 0) >= 5 and statuses.get(400, 0) >= 40, statuses


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    endpoint=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    overrides=st.dictionaries(st.sampled_from(CHAT_FIELDS + ["prompt", "echo", "best_of"]), JSON_VALUES, max_size=4),
)
def test_hypothesis_bodies_never_get_a_5xx(server, endpoint, overrides):
    body = {"model": SERVED, "max_tokens": 1}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if endpoint.endswith("chat/completions")
                else {"prompt": "Hello"})  # fmt: skip
    body.update(overrides)
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] > 2:  # keep generation short
        body["max_tokens"] = 1
    body.pop("max_completion_tokens", None)
    if isinstance(body.get("n"), int) and body["n"] > 3:
        body["n"] = 3
    r = httpx.post(f"{server.url}{endpoint}", json=body, timeout=120)
    assert r.status_code < 500, f"{r.status_code} for {body!r}: {r.text}"
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
