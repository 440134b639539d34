"""A fake inference worker: a real HTTP server on loopback (stdlib http.server on a thread)
that answers the worker's routes the way `python -m inference serve` does, with knobs to make
it fail."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.db import connection

BASE = "smollm2"

# What the real worker's /metrics looks like (trimmed; vLLM's names, plus loraplex's own).
METRICS = """\
# HELP vllm:time_to_first_token_seconds Time to first token.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="smollm2"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="smollm2"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="smollm2"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="smollm2"} 0.52
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="smollm2"} 4.0
# HELP loraplex:ready 1 once the model is loaded.
# TYPE loraplex:ready gauge
loraplex:ready{model_name="smollm2"} 1.0
# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} {running}
# HELP vllm:num_requests_waiting Requests waiting to be admitted.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2"} {waiting}
# HELP vllm:kv_cache_usage_perc Fraction of KV-cache blocks in use (0..1).
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} {kv}
# HELP vllm:prompt_tokens_total Prefilled prompt tokens.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="smollm2"} 812.0
# HELP vllm:lora_requests_info Adapters of running and waiting requests (value: scrape time).
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="lora-a",waiting_lora_adapters=""} 1.7e+09
# HELP loraplex:adapter_resident 1 for the tier each adapter is in.
# TYPE loraplex:adapter_resident gauge
loraplex:adapter_resident{adapter="lora-a",tier="device"} 1.0
loraplex:adapter_resident{adapter="lora-a",tier="host"} 0.0
loraplex:adapter_resident{adapter="lora-b",tier="device"} 0.0
loraplex:adapter_resident{adapter="lora-b",tier="host"} 1.0
# HELP loraplex:adapter_bytes Adapter weights in memory (bytes).
# TYPE loraplex:adapter_bytes gauge
loraplex:adapter_bytes{adapter="lora-a"} 1.048576e+06
# HELP loraplex:lora_cache_hits_total Adapter lookups served by a tier.
# TYPE loraplex:lora_cache_hits_total counter
loraplex:lora_cache_hits_total{tier="device"} 40.0
loraplex:lora_cache_hits_total{tier="host"} 7.0
# HELP loraplex:lora_cache_evictions_total Adapters evicted from a tier.
# TYPE loraplex:lora_cache_evictions_total counter
loraplex:lora_cache_evictions_total{tier="device"} 3.0
loraplex:lora_cache_evictions_total{tier="host"} 0.0
# HELP loraplex:lora_cache_misses_total Adapter lookups that had to load from disk.
# TYPE loraplex:lora_cache_misses_total counter
loraplex:lora_cache_misses_total {misses}
# HELP loraplex:lora_cache_loads_total Adapter loads.
# TYPE loraplex:lora_cache_loads_total counter
loraplex:lora_cache_loads_total 5.0
# HELP loraplex:lora_cache_load_failures_total Adapter loads that failed.
# TYPE loraplex:lora_cache_load_failures_total counter
loraplex:lora_cache_load_failures_total 0.0
# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 4000.0
# HELP vllm:prefix_cache_hits_total Prompt tokens found in the prefix cache (not computed).
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 3000.0
# HELP loraplex:memory_bytes Memory by use (bytes).
# TYPE loraplex:memory_bytes gauge
loraplex:memory_bytes{kind="base_weights"} 2.69e+08
loraplex:memory_bytes{kind="kv_cache"} 6.7108864e+07
loraplex:memory_bytes{kind="adapter_slots"} 4.194304e+06
loraplex:memory_bytes{kind="host_adapters"} 2.097152e+06
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.5e+09
"""

ADAPTERS = [
    {"name": "lora-a", "id": "a1", "path": "/srv/a", "tier": "device", "rank": 8, "bytes": 1048576,
     "pinned": False, "hits": 3, "last_used": 1.7e9, "load_seconds": 0.01, "error": None},
    {"name": "lora-b", "id": "b1", "path": "/srv/b", "tier": "host", "rank": 4, "bytes": 524288,
     "pinned": False, "hits": 0, "last_used": None, "load_seconds": 0.01, "error": None},
    {"name": "lora-c", "id": "c1", "path": "/srv/c", "tier": "disk", "rank": 4, "bytes": None,
     "pinned": False, "hits": 0, "last_used": None, "load_seconds": None, "error": None},
]


@dataclass
class FakeWorker:
    """Knobs: set any of these between polls. `responses` overrides one path with
    (status, content type, body); `delay` sleeps before answering `delay_paths`."""

    url: str = ""
    ready: bool = True
    running: int = 2
    waiting: int = 1
    kv: float = 0.25
    misses: str = "2.0"  # a string: a test sets a bad value
    admin_token: str | None = None
    adapters: list = field(default_factory=lambda: [dict(a) for a in ADAPTERS])
    responses: dict = field(default_factory=dict)
    delay: float = 0.0
    delay_paths: tuple = ("/ready",)
    requests: list = field(default_factory=list)
    base: str = BASE  # the served base model's name
    hidden_size: int = 576

    def metrics_text(self) -> str:
        return (METRICS.replace("{running}", f"{float(self.running)}")
                .replace("{waiting}", f"{float(self.waiting)}").replace("{kv}", str(self.kv))
                .replace("{misses}", self.misses))

    def answer(self, path: str, headers) -> tuple[int, str, str]:
        self.requests.append((path, headers.get("Authorization")))
        if path in self.delay_paths and self.delay:
            time.sleep(self.delay)
        if path in self.responses:
            return self.responses[path]
        if path == "/ready":
            if not self.ready:
                return 503, "application/json", json.dumps({"status": "loading"})
            return 200, "application/json", json.dumps({"status": "ready", "model": self.base})
        if path == "/metrics":
            return 200, "text/plain; version=0.0.4; charset=utf-8", self.metrics_text()
        if path == "/v1/models":
            data = [{"id": self.base, "object": "model", "parent": None, "root": "/models/x.gguf"}]
            data += [{"id": a["name"], "object": "model", "parent": self.base, "root": a["path"]}
                     for a in self.adapters]
            return 200, "application/json", json.dumps({"object": "list", "data": data})
        if path == "/v1/base_model":
            shapes = {"name": self.base, "num_hidden_layers": 30, "hidden_size": self.hidden_size, "intermediate_size": 1536,
                      "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_lora_rank": 16}
            return 200, "application/json", json.dumps(shapes)
        if path == "/v1/adapters":
            if self.admin_token and headers.get("Authorization") != f"Bearer {self.admin_token}":
                error = {"message": "adapter routes need 'Authorization: Bearer <admin token>'",
                         "type": "authentication_error", "param": None, "code": "invalid_admin_token"}
                return 401, "application/json", json.dumps({"error": error})
            return 200, "application/json", json.dumps({"object": "list", "data": self.adapters})
        return 404, "application/json", json.dumps({"error": {"message": "Not Found"}})


def _serve(worker: FakeWorker, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 -- http.server's naming
            status, content_type, body = worker.answer(self.path, self.headers)
            payload = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            try:
                self.wfile.write(payload)
            except OSError:
                pass  # the client gave up (timeout tests)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    worker.url = f"http://{host}:{server.server_address[1]}"
    return server


@pytest.fixture
def make_fake_worker():
    servers = []

    def make(*, host: str = "127.0.0.1", port: int = 0, **knobs) -> FakeWorker:
        """A fake worker on host:port (port 0: a free one; the loopback range 127.0.0.0/8 gives
        each worker of a discovery test its own address on one shared port)."""
        worker = FakeWorker(**knobs)
        servers.append(_serve(worker, host, port))
        return worker

    yield make
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fake_worker(make_fake_worker) -> FakeWorker:
    return make_fake_worker()


@pytest.fixture
def dead_url() -> str:
    """A loopback URL nothing listens on (a port bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(params=["postgresql", "other backend"])
def each_history_backend(request, monkeypatch):
    """Runs a history test twice: on PostgreSQL's SQL, and on the ORM path portal.fleet.history
    and .selectors take on any other backend (make run's embedded SQLite), against the same
    PostgreSQL rows, so both must give the same answers."""
    if request.param != "postgresql":
        monkeypatch.setattr(connection, "vendor", "sqlite")
    return request.param
