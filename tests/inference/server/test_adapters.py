"""Adapters over HTTP on a tiny random Llama: vLLM's load/unload routes behind the admin token,
pin/unpin and the listing, /v1/models with `parent`, requests by adapter name, bad adapters as
400s with the reason, and 32 concurrent streams over 8 adapters (more than the device slots and
the host tier hold) whose texts equal the offline engine's greedy output."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from protocol.worker_api import BaseModelInfo
from tests.inference.server.conftest import ADMIN_TOKEN, TINY, TINY_ENGINE
from tests.inference.server.tiny_lora import ADAPTERS, word_prompt

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _admin(server, path: str, body: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **{"headers": AUTH, **kwargs})


def _load(server, name: str, path) -> httpx.Response:
    return _admin(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


@pytest.fixture(scope="module")
def sdk(lora_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_startup_adapter_is_listed_with_the_base_as_parent(sdk):
    models = {m.id: m for m in sdk.models.list().data}
    assert models[TINY].parent is None
    assert models["ad0"].parent == TINY


def test_adapter_routes_need_the_admin_token(lora_server, tiny_lora):
    _, adapters = tiny_lora
    body = {"lora_name": "ad1", "lora_path": str(adapters["ad1"])}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_TOKEN}):
        r = httpx.post(f"{lora_server.url}/v1/load_lora_adapter", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{lora_server.url}/v1/adapters").status_code == 401


def test_load_use_and_unload_by_name(lora_server, tiny_lora, sdk):
    _, adapters = tiny_lora
    r = _load(lora_server, "ad1", adapters["ad1"])
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "ad1" and r.json()["rank"] == ADAPTERS["ad1"]["r"]
    assert "ad1" in [m.id for m in sdk.models.list().data]

    prompt = word_prompt(1, 12)
    kwargs = dict(prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    with_adapter = sdk.completions.create(model="ad1", **kwargs).choices[0].text
    base = sdk.completions.create(model=TINY, **kwargs).choices[0].text
    assert with_adapter and with_adapter != base

    assert _admin(lora_server, "/v1/unload_lora_adapter", {"lora_name": "ad1"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as e:
        sdk.completions.create(model="ad1", **kwargs)
    assert e.value.code == "model_not_found"
    r = _admin(lora_server, "/v1/unload_lora_adapter", {"lora_name": "ad1"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


@pytest.mark.parametrize(("which", "needle"), [("bad_nan", "nan"), ("missing", "")])
def test_a_bad_adapter_is_400_with_the_reason_and_never_registered(lora_server, tiny_lora, sdk, which, needle):
    _, adapters = tiny_lora
    path = adapters.get(which, adapters["ad0"].parent / "does-not-exist")
    r = _load(lora_server, "broken", path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "lora_path" and "broken" in error["message"] and needle in error["message"].lower()
    assert "broken" not in [m.id for m in sdk.models.list().data]
    # The adapter already resident still serves.
    assert sdk.completions.create(model="ad0", prompt="t5 t6", max_tokens=2, temperature=0).choices[0].text


def test_adapter_bodies_are_validated(lora_server):
    r = _admin(lora_server, "/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = _admin(lora_server, "/v1/load_lora_adapter", {"lora_name": TINY, "lora_path": "/x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"


def test_pin_unpin_and_the_listing(lora_server, tiny_lora):
    _, adapters = tiny_lora
    r = _admin(lora_server, "/v1/adapters/ad0/pin")
    assert r.status_code == 200 and r.json()["pinned"] is True
    listing = httpx.get(f"{lora_server.url}/v1/adapters", headers=AUTH).json()["data"]
    ad0 = next(a for a in listing if a["name"] == "ad0")
    assert set(ad0) >= {"tier", "bytes", "hits", "last_used", "load_seconds", "rank", "pinned", "id"}
    assert ad0["pinned"] and ad0["tier"] in ("device", "host") and ad0["bytes"] > 0
    assert _admin(lora_server, "/v1/adapters/nope/pin").status_code == 404
    # At most max_loras - 1 = 2 pins: a third is refused with the reason.
    for name in ("ad2", "ad3"):
        assert _load(lora_server, name, adapters[name]).status_code == 200
    assert _admin(lora_server, "/v1/adapters/ad2/pin").status_code == 200
    r = _admin(lora_server, "/v1/adapters/ad3/pin")
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_pinned", r.text
    for name in ("ad0", "ad2"):
        assert _admin(lora_server, f"/v1/adapters/{name}/unpin").json()["pinned"] is False


def _offline(base, adapters, prompts, routes, max_tokens) -> list[str]:
    from inference.config import EngineConfig
    from inference.engine.llm_engine import LLMEngine
    from inference.engine.sampling_params import SamplingParams
    from inference.lora.request import LoRARequest

    engine = LLMEngine(EngineConfig(model=str(base), **{**TINY_ENGINE, "max_loras": 8, "max_cpu_loras": 8}),
                       progress=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params, lora=None if r == TINY else LoRARequest(r, adapters[r]))
           for p, r in zip(prompts, routes, strict=True)]
    done = engine.run_until_done(ids)
    engine.shutdown()
    return [done[i].text for i in ids]


async def test_32_concurrent_streams_over_8_adapters_equal_offline_greedy(lora_server, tiny_lora):
    base, adapters = tiny_lora
    for name in ADAPTERS:
        assert _load(lora_server, name, adapters[name]).status_code == 200
    routes = [([*ADAPTERS, TINY])[i % 9] for i in range(32)]
    prompts = [word_prompt(10 + i, 3 + (i * 7) % 40) for i in range(32)]
    expected = _offline(base, adapters, prompts, routes, max_tokens=8)

    client = openai.AsyncOpenAI(base_url=f"{lora_server.url}/v1", api_key="x", max_retries=0, timeout=120)

    async def stream(prompt: str, model: str) -> str:
        chunks = await client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    got = await asyncio.gather(*(stream(p, r) for p, r in zip(prompts, routes, strict=True)))
    assert list(got) == expected

    metrics = httpx.get(f"{lora_server.url}/metrics").text
    for name in ("vllm:lora_requests_info", "loraplex:adapter_resident", "loraplex:adapter_bytes",
                 "loraplex:lora_cache_hits_total", "loraplex:lora_cache_misses_total",
                 "loraplex:adapter_load_seconds_bucket", "loraplex:memory_bytes"):
        assert f"\n{name}" in metrics, name
    assert lora_server.metric("loraplex:adapter_resident", adapter="ad0", tier="device") in (0.0, 1.0)
    assert lora_server.metric("loraplex:memory_bytes", kind="base_weights") > 0
    assert lora_server.metric("loraplex:lora_cache_loads_total") >= 8


def test_base_model_route_describes_what_an_adapter_must_match(lora_server):
    body = httpx.get(f"{lora_server.url}/v1/base_model", timeout=30).json()
    assert body["name"] == TINY and body["num_hidden_layers"] == 3 and body["hidden_size"] == 64
    assert body["max_lora_rank"] >= 1 and body["max_loras"] >= 1
    assert {"intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"} <= set(body)
    # How this worker multiplies (an fp32 model: nothing to choose), also as a metric per class.
    assert body["matmul_plan"]["source"] == "fixed"
    assert body["matmul_plan"]["paths"] == {"decode": "native", "batch": "native", "prefill": "native"}
    for shape_class in ("decode", "batch", "prefill"):
        assert lora_server.metric("loraplex:matmul_plan_info", shape_class=shape_class, path="native") == 1
    assert lora_server.metric("loraplex:matmul_plan_info", shape_class="lora", path="float32") == 1
    # ... and which kernel adds the LoRA delta (measured: the fused C++ one or torch ops)
    kernel = body["matmul_plan"]["lora_kernel"]
    assert kernel in ("fused", "torch")  # fp32 stacks: never amx's tiles
    assert lora_server.metric("loraplex:matmul_plan_info", shape_class="lora_kernel", path=kernel) == 1
    assert body["matmul_plan"]["lora_tile_rows"] == 0
    assert lora_server.metric("loraplex:matmul_plan_info", shape_class="lora_tile_rows", path="0") == 1
    # ... and how decode rows attend (the fused paged kernel or torch's gather + SDPA)
    attention = body["matmul_plan"]["attention_kernel"]
    assert attention in ("fused", "torch")
    assert lora_server.metric("loraplex:matmul_plan_info", shape_class="attention_kernel", path=attention) == 1
    # ... and what multiplies quantised weights (dense weights here: torch's, nothing to race)
    assert body["matmul_plan"]["quant_kernel"] == "torch"
    assert lora_server.metric("loraplex:matmul_plan_info", shape_class="quant_kernel", path="torch") == 1
    # What the portal reads back (protocol.worker_api): every field, none dropped as mistyped.
    assert BaseModelInfo.from_json(body).to_json() == body
