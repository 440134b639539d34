"""Prompt scoring (echo, max_tokens 0, prompt_logprobs) through the gateway to a real worker:
the worker's numbers reach the client unchanged, for the base and for a tenant's adapter, and a
request that generates nothing is still in the ledger with its prompt tokens."""

from __future__ import annotations

import json

import httpx

from tests.portal.gateway.conftest import BASE, direct, model_path, wait_for_row
from tests.portal.gateway.lora_adapter import write_adapter

PROMPT = "The capital of France is"
SCORE = {"model": BASE, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}


def _post(live, key: str, body: dict) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/completions", json=body, timeout=120, headers={"authorization": f"Bearer {key}"})


def test_scoring_a_prompt_returns_the_workers_logprobs_and_is_billed(acme, worker, live):
    response = _post(live, acme.key, SCORE)
    assert response.status_code == 200, response.text
    body = response.json()
    expected = direct(worker, "/v1/completions", SCORE)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert choice["logprobs"] == expected["choices"][0]["logprobs"]
    assert choice["logprobs"]["token_logprobs"][0] is None
    prompt_tokens = expected["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens"] == prompt_tokens > 0 and body["usage"]["completion_tokens"] == 0
    row = wait_for_row(response.headers["x-request-id"])
    assert (row.prompt_tokens, row.completion_tokens) == (prompt_tokens, 0)
    assert row.status_code == 200 and row.finish_reason == "length" and row.error == ""


def test_streamed_scoring_is_billed_and_prompt_logprobs_pass_through(acme, worker, live):
    with httpx.stream("POST", f"{live.url}/v1/completions", json={**SCORE, "stream": True}, timeout=120,
                      headers={"authorization": f"Bearer {acme.key}"}) as response:
        assert response.status_code == 200
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        request_id = response.headers["x-request-id"]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts[0] == PROMPT and "".join(texts) == PROMPT
    assert all("usage" not in c or c["usage"] is None for c in chunks)  # the client did not ask for it
    row = wait_for_row(request_id)
    assert row.stream and row.completion_tokens == 0 and row.prompt_tokens > 0 and row.finish_reason == "length"

    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    relayed = _post(live, acme.key, body).json()["choices"][0]["prompt_logprobs"]
    assert relayed == direct(worker, "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    assert relayed[0] is None and len(relayed) == row.prompt_tokens


def test_an_adapter_scores_the_prompt_differently_through_the_gateway(acme, worker, live, tmp_path):
    from portal.adapters.models import Adapter, AdapterVersion

    bot = Adapter.objects.create(tenant=acme.tenant, name="scorer")
    version = AdapterVersion.objects.create(adapter=bot, number=1,
                                            source_path=str(write_adapter(tmp_path / "scorer", model_path(), seed=11)))
    base = _post(live, acme.key, SCORE).json()["choices"][0]["logprobs"]["token_logprobs"]
    response = _post(live, acme.key, {**SCORE, "model": "acme/scorer"})
    assert response.status_code == 200, response.text
    tuned = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert tuned[0] is None and len(tuned) == len(base)
    assert max(abs(a - b) for a, b in zip(base[1:], tuned[1:], strict=True)) > 1e-3
    row = wait_for_row(response.headers["x-request-id"])
    assert row.adapter_version_id == version.pk and row.completion_tokens == 0 and row.prompt_tokens == len(base)


def test_max_tokens_zero_is_refused_where_it_means_nothing(acme, live):
    without_echo = _post(live, acme.key, {**SCORE, "echo": False})
    assert without_echo.status_code == 400 and without_echo.json()["error"]["param"] == "max_tokens"
    chat = httpx.post(f"{live.url}/v1/chat/completions", timeout=60, headers={"authorization": f"Bearer {acme.key}"},
                      json={"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_tokens"
    negative = _post(live, acme.key, {**SCORE, "max_tokens": -1})
    assert negative.status_code == 400 and negative.json()["error"]["param"] == "max_tokens"
    for response in (without_echo, chat, negative):
        assert wait_for_row(response.headers["x-request-id"]).status_code == 400
