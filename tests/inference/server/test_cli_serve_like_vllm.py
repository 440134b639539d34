"""A real worker started the way `vllm serve` users start one: the model as a positional argument,
`--api-key`, `--kv-cache-memory-bytes`, and no INFERENCE_ALLOW_RUNTIME_LORA_UPDATING (vLLM's
default: no runtime adapter loading); and `python -m inference generate --lora NAME=PATH`."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol import worker_api
from tests.inference.server.server_process import ROOT, ServerProcess, start_server

API_KEY = "test-api-key"
ADMIN = "test-admin-token"


@pytest.fixture(scope="module")
def keyed_server(smollm2_path, tmp_path_factory) -> ServerProcess:
    log = tmp_path_factory.mktemp("keyed") / "worker.log"
    proc = start_server([str(smollm2_path), "--served-model-name", "smollm2", "--dtype", "float32",
                         "--kv-cache-memory-bytes", "32MiB", "--api-key", API_KEY, "--admin-token", ADMIN],
                        log, env={"INFERENCE_ALLOW_RUNTIME_LORA_UPDATING": "false"})
    yield proc
    proc.stop()


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_every_api_route_needs_the_key_and_the_probes_stay_open(keyed_server):
    url = keyed_server.url
    for path in (worker_api.HEALTH, worker_api.READY, worker_api.METRICS):  # supervisor and Prometheus
        assert httpx.get(f"{url}{path}", timeout=10).status_code == 200, path
    for headers in ({}, bearer("wrong"), {"Authorization": API_KEY}):  # none, wrong, not Bearer
        answer = httpx.get(f"{url}{worker_api.MODELS}", headers=headers, timeout=10)
        assert answer.status_code == 401, headers
        assert answer.json()["error"]["code"] == worker_api.INVALID_API_KEY
        assert answer.json()["error"]["type"] == "invalid_request_error" and "API key" in answer.json()["error"]["message"]
    for path in (worker_api.MODELS, worker_api.BASE_MODEL):
        assert httpx.get(f"{url}{path}", headers=bearer(API_KEY), timeout=10).status_code == 200, path
    # The admin token passes the key check (the portal's admin calls carry only it) ...
    assert httpx.get(f"{url}{worker_api.MODELS}", headers=bearer(ADMIN), timeout=10).status_code == 200
    # ... but the API key is not an admin token.
    answer = httpx.get(f"{url}{worker_api.ADAPTERS}", headers=bearer(API_KEY), timeout=10)
    assert answer.status_code == 401 and answer.json()["error"]["code"] == worker_api.INVALID_ADMIN_TOKEN
    assert httpx.get(f"{url}{worker_api.ADAPTERS}", headers=bearer(ADMIN), timeout=10).status_code == 200


def test_the_openai_sdk_works_with_the_key_and_is_refused_without(keyed_server):
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    answer = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=2)
    assert answer.choices[0].finish_reason in ("length", "stop")
    stranger = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        stranger.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)


def test_without_the_runtime_switch_adapters_are_not_loaded_or_unloaded_at_run_time(keyed_server, tiny_lora):
    _, adapters = tiny_lora
    for path, body in ((worker_api.LOAD_ADAPTER, {"lora_name": "x", "lora_path": str(adapters["ad0"])}),
                       (worker_api.UNLOAD_ADAPTER, {"lora_name": "x"})):
        answer = httpx.post(f"{keyed_server.url}{path}", json=body, headers=bearer(ADMIN), timeout=10)
        assert answer.status_code == 404, answer.text
        error = answer.json()["error"]
        assert error["code"] == worker_api.RUNTIME_LORA_UPDATING_DISABLED
        assert "INFERENCE_ALLOW_RUNTIME_LORA_UPDATING=true" in error["message"]
    models = httpx.get(f"{keyed_server.url}{worker_api.MODELS}", headers=bearer(API_KEY), timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["smollm2"]  # nothing was loaded


def test_the_kv_cache_flag_spelled_as_vllm_sizes_the_cache(keyed_server):
    text = httpx.get(f"{keyed_server.url}/metrics", timeout=10).text
    [info] = [s for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info" for s in f.samples]
    assert info.labels["kv_cache_memory_bytes"] == str(32 << 20)


def _generate(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_")}
    return subprocess.run([sys.executable, "-m", "inference", "generate", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


def test_generate_applies_an_adapter_from_the_command_line(tiny_lora):
    base, adapters = tiny_lora
    common = ["--model", str(base), "--dtype", "float32", "--prompt", "t5 t6 t7 t8", "--max-tokens", "6"]
    plain, tuned = _generate(*common), _generate(*common, "--lora", f"ad1={adapters['ad1']}")
    assert plain.returncode == 0 and tuned.returncode == 0, plain.stderr[-2000:] + tuned.stderr[-2000:]
    assert "6 tokens" in tuned.stderr
    assert tuned.stdout.strip() and tuned.stdout != plain.stdout  # the adapter changed the greedy tokens

    for lora, needle in (("noequals", "--lora: expected NAME=PATH"), ("x=/nonexistent", "is not a directory"),
                         (f"bad={adapters['bad_nan']}", "error: ")):
        bad = _generate(*common, "--lora", lora)
        assert bad.returncode == 2 and needle in bad.stderr.strip().splitlines()[-1], bad.stderr[-2000:]
