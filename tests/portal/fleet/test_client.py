"""The portal's worker client (portal.fleet.client) against a real loopback HTTP server that
answers from a script: how each call is built (route, JSON body, the admin token on admin
routes only, timeouts), how answers are read (the OpenAI error object, other bodies, transport
failures, one readable line for each), and the async face the gateway uses (lazy load, the base
model's name, completions streamed or whole, one client per event loop)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from portal.fleet import client as worker_client
from portal.fleet.client import (
    AsyncWorkerClient,
    Reply,
    StreamBroken,
    WorkerClient,
    async_worker_client,
    version_load_body,
)
from protocol import worker_api
from protocol.worker_api import ErrorObject, LoadAdapterBody

TOKEN = "fleet-admin-token"
SHA = {"adapter_config.json": "a" * 64, "adapter_model.safetensors": "b" * 64}


@dataclass
class Answer:
    status: int = 200
    body: bytes = b"{}"
    content_type: str = "application/json"
    headers: dict = field(default_factory=dict)
    declared_length: int | None = None  # a Content-Length larger than the body: the answer breaks off
    delay: float = 0.0


class ScriptedWorker:
    """Records (method, path, headers, body) of every request; answers `routes[(method, path)]`,
    else a 404 in OpenAI's shape."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict, bytes]] = []
        self.routes: dict[tuple[str, str], Answer] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self):
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                outer.requests.append((self.command, self.path, dict(self.headers.items()), raw))
                answer = outer.routes.get((self.command, self.path)) or Answer(
                    404, json.dumps(ErrorObject("no route", code="unknown_url").to_json()).encode())
                time.sleep(answer.delay)
                self.send_response(answer.status)
                self.send_header("content-type", answer.content_type)
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(answer.declared_length or len(answer.body)))
                if answer.declared_length:
                    self.send_header("connection", "close")
                self.end_headers()
                try:
                    self.wfile.write(answer.body)
                    self.wfile.flush()
                except OSError:
                    pass  # the client gave up (timeouts)
                if answer.declared_length:
                    self.close_connection = True

            do_GET = do_POST = _answer  # noqa: N815 -- http.server's names

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def answer(self, method: str, path: str, status: int = 200, body=None, **kwargs) -> None:
        raw = body if isinstance(body, bytes) else json.dumps({} if body is None else body).encode()
        self.routes[(method, path)] = Answer(status, raw, **kwargs)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def worker():
    fake = ScriptedWorker()
    yield fake
    fake.close()


@pytest.fixture
def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(autouse=True)
def admin_token(settings):
    settings.INFERENCE_ADMIN_TOKEN = TOKEN


def error_body(message: str, **fields) -> dict:
    return ErrorObject(message, **fields).to_json()


# -- building calls ------------------------------------------------------------------------------


def test_admin_calls_carry_the_token_and_the_shared_bodies(worker):
    body = LoadAdapterBody.fetched(lora_name="lora-1", lora_url="http://portal/internal/adapters/u/", files=SHA,
                                   auth_token=TOKEN)
    for method, path in [("POST", worker_api.LOAD_ADAPTER), ("POST", worker_api.UNLOAD_ADAPTER),
                         ("POST", "/v1/adapters/lora-1/pin"), ("POST", "/v1/adapters/lora-1/unpin")]:
        worker.answer(method, path, 200, {"object": "adapter"})
    with WorkerClient() as client:
        replies = [client.load_adapter(worker.url + "/", body), client.unload_adapter(worker.url, "lora-1"),
                   client.pin_adapter(worker.url, "lora-1", pinned=True),
                   client.pin_adapter(worker.url, "lora-1", pinned=False)]
    assert all(reply.ok for reply in replies)
    sent = [(method, path, headers.get("authorization"), headers.get("content-type"), json.loads(raw or b"null"))
            for method, path, headers, raw in worker.requests]
    assert sent == [
        ("POST", "/v1/load_lora_adapter", f"Bearer {TOKEN}", "application/json", body.to_json()),
        ("POST", "/v1/unload_lora_adapter", f"Bearer {TOKEN}", "application/json", {"lora_name": "lora-1"}),
        ("POST", "/v1/adapters/lora-1/pin", f"Bearer {TOKEN}", None, None),
        ("POST", "/v1/adapters/lora-1/unpin", f"Bearer {TOKEN}", None, None),
    ]


def test_reads_carry_the_token_only_to_the_adapter_listing(worker, settings):
    with WorkerClient() as client:
        client.get(worker.url, worker_api.READY)
        client.get(worker.url, worker_api.METRICS)
        client.get(worker.url, worker_api.ADAPTERS, admin=True)
    assert [(path, headers.get("authorization")) for _, path, headers, _ in worker.requests] == [
        ("/ready", None), ("/metrics", None), ("/v1/adapters", f"Bearer {TOKEN}")]
    settings.INFERENCE_ADMIN_TOKEN = None  # no token configured: none is sent
    with WorkerClient() as client:
        client.get(worker.url, worker_api.ADAPTERS, admin=True)
    assert "authorization" not in worker.requests[-1][2]


def test_with_the_workers_api_key_every_other_call_carries_it(worker, settings):
    """A worker started with --api-key refuses calls without it; the admin token stands in for it
    on the admin routes (one Authorization header per call)."""
    settings.INFERENCE_API_KEY = "workers-api-key"
    worker.answer("POST", worker_api.CHAT_COMPLETIONS, 200, {"choices": []})
    with WorkerClient() as client:
        client.get(worker.url, worker_api.MODELS)
        client.get(worker.url, worker_api.ADAPTERS, admin=True)
        client.unload_adapter(worker.url, "lora-1")

    async def relay() -> None:
        http = AsyncWorkerClient()
        reply, stream = await http.open_completion(worker.url, path=worker_api.CHAT_COMPLETIONS, content=b"{}")
        assert reply.ok and await stream.answer() == {"choices": []}
        await http.base_model_name(worker.url)

    asyncio.run(relay())
    assert [(path, headers.get("authorization")) for _, path, headers, _ in worker.requests] == [
        ("/v1/models", "Bearer workers-api-key"), ("/v1/adapters", f"Bearer {TOKEN}"),
        ("/v1/unload_lora_adapter", f"Bearer {TOKEN}"), ("/v1/chat/completions", "Bearer workers-api-key"),
        ("/v1/models", "Bearer workers-api-key")]


def test_a_timeout_override_bounds_every_call(worker):
    worker.answer("GET", "/ready", 200, {"status": "ready"}, delay=1.0)
    start = time.monotonic()
    with WorkerClient(timeout=httpx.Timeout(0.2)) as client:
        reply = client.get(worker.url, worker_api.READY)
    assert time.monotonic() - start < 0.9
    assert reply.status is None and isinstance(reply.exception, httpx.ReadTimeout)
    assert reply.describe() == "timed out (ReadTimeout)"


def test_the_load_body_of_a_version(settings):
    @dataclass
    class Version:  # what the client needs of portal.adapters.models.AdapterVersion
        uid: uuid.UUID
        worker_name: str
        source_path: str = ""
        file_sha256: dict = field(default_factory=dict)

    uid = uuid.uuid4()
    settings.PORTAL_INTERNAL_URL = "http://portal.internal:8000/"
    assert version_load_body(version=Version(uid, "lora-x", file_sha256=SHA)) == LoadAdapterBody.fetched(
        lora_name="lora-x", lora_url=f"http://portal.internal:8000/internal/adapters/{uid}/", files=SHA,
        auth_token=TOKEN)
    assert version_load_body(version=Version(uid, "lora-x", source_path="/models/a")).to_json() == {
        "lora_name": "lora-x", "lora_path": "/models/a"}
    settings.INFERENCE_ADMIN_TOKEN = ""
    assert version_load_body(version=Version(uid, "lora-x", file_sha256=SHA)).auth_token is None


# -- reading answers -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "message", "code", "described"),
    [
        (400, error_body("adapter 'lora-1': sha256 mismatch", param="files", code="adapter_checksum_mismatch"),
         "adapter 'lora-1': sha256 mismatch", "adapter_checksum_mismatch",
         "HTTP 400: adapter 'lora-1': sha256 mismatch"),
        (503, {"status": "dead", "error": "CUDA error: out of memory"}, '{"status": "dead", "error": "CUDA error: out of memory"}',
         None, "HTTP 503: dead - CUDA error: out of memory"),
        (502, b"<html>502 Bad Gateway</html>", "<html>502 Bad Gateway</html>", None,
         "HTTP 502: <html>502 Bad Gateway</html>"),
        (500, b"x" * 1000, "x" * 500, None, "HTTP 500: " + "x" * 300),
        (500, b"", "", None, "HTTP 500"),
        (404, {"error": {"message": 7, "code": ["not", "a", "string"]}}, "7", None, "HTTP 404: 7"),
    ],
)
def test_every_answer_reads_as_one_error_object_and_one_line(worker, status, body, message, code, described):
    worker.answer("POST", worker_api.LOAD_ADAPTER, status, body)
    with WorkerClient() as client:
        reply = client.load_adapter(worker.url, LoadAdapterBody.local(lora_name="lora-1", lora_path="/a"))
    assert not reply.ok and reply.status == status and reply.exception is None
    assert (reply.error.message, reply.error.code) == (message, code)
    assert reply.describe() == described


def test_no_answer_is_a_reply_that_says_so(dead_url):
    with WorkerClient() as client:
        reply = client.unload_adapter(dead_url, "lora-1")
    assert reply.status is None and not reply.ok and isinstance(reply.exception, httpx.ConnectError)
    assert reply.describe().startswith("cannot connect (ConnectError: ")


def test_retry_after_and_json_objects(worker):
    worker.answer("GET", "/v1/models", 429, error_body("busy"), headers={"retry-after": "7"})
    worker.answer("GET", "/metrics", 200, [1, 2])
    worker.answer("GET", "/ready", 200, b"<p>hi</p>", content_type="text/html")
    with WorkerClient() as client:
        assert client.get(worker.url, "/v1/models").retry_after == 7
        assert client.get(worker.url, "/metrics").retry_after is None
        with pytest.raises(ValueError, match="expected a JSON object, got list"):
            client.get(worker.url, "/metrics").json_object()
        with pytest.raises(ValueError, match="not JSON: '<p>hi</p>'"):
            client.get(worker.url, "/ready").json_object()


def test_a_reply_whose_answer_broke_off_says_both():
    reply = Reply("/v1/completions", 503, exception=httpx.ReadError("connection reset"))
    assert not reply.ok and reply.describe() == "HTTP 503, then the answer broke off: ReadError: connection reset"


@pytest.mark.parametrize(
    ("data", "outcome"),
    [
        ([{"id": "smollm2", "parent": None}, {"id": "lora-1", "parent": "smollm2"}], ("smollm2", ["lora-1"])),
        ([{"id": "lora-1", "parent": "smollm2"}], "no base model listed"),
        ([{"id": 3}], "no 'data' list of models with ids"),
        ("smollm2", "no 'data' list of models with ids"),
    ],
)
def test_the_models_list_names_the_base_and_the_adapters(data, outcome):
    if isinstance(outcome, tuple):
        assert worker_client.models_from_json({"data": data}) == outcome
    else:
        with pytest.raises(ValueError, match=outcome):
            worker_client.models_from_json({"data": data})


# -- the async face --------------------------------------------------------------------------------


async def test_the_async_load_carries_the_token_and_reads_the_refusal(worker):
    worker.answer("POST", worker_api.LOAD_ADAPTER, 400,
                  error_body("lora_url: not one of the portal origins", code=worker_api.ADAPTER_SOURCE_FORBIDDEN))
    client = AsyncWorkerClient()
    reply = await client.load_adapter(worker.url, LoadAdapterBody.local(lora_name="lora-1", lora_path="/a"))
    assert reply.status == 400 and reply.error.code in worker_api.WORKER_SIDE_LOAD_ERRORS
    [(_, _, headers, raw)] = worker.requests
    assert headers["authorization"] == f"Bearer {TOKEN}" and json.loads(raw) == {"lora_name": "lora-1",
                                                                               "lora_path": "/a"}


async def test_the_base_models_name_or_none(worker, dead_url):
    client = AsyncWorkerClient()
    worker.answer("GET", "/v1/models", 200, {"data": [{"id": "smollm2", "parent": None}]})
    assert await client.base_model_name(worker.url) == "smollm2"
    for status, body in [(200, {"data": []}), (200, b"not json"), (503, error_body("loading"))]:
        worker.answer("GET", "/v1/models", status, body)
        assert await client.base_model_name(worker.url) is None
    assert await client.base_model_name(dead_url) is None


def sse(*events) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


async def test_a_streamed_completion_yields_its_json_objects_up_to_done(worker):
    chunks = [{"choices": [{"delta": {"content": "Hi"}}]}, error_body("engine failed", type="server_error")]
    worker.answer("POST", "/v1/chat/completions", 200,
                  b": keep-alive\n\n" + sse(chunks[0], "{not json", "[1]", chunks[1], "[DONE]", {"late": True}),
                  content_type="text/event-stream")
    reply, stream = await AsyncWorkerClient().open_completion(worker.url, path=worker_api.CHAT_COMPLETIONS,
                                                              content=b'{"model":"m"}')
    assert reply.ok and stream is not None
    assert [chunk async for chunk in stream.chunks()] == chunks
    await stream.aclose()
    [(method, path, headers, raw)] = worker.requests
    assert (method, path, raw, headers["content-type"]) == ("POST", "/v1/chat/completions", b'{"model":"m"}',
                                                            "application/json")
    assert "authorization" not in headers  # completions are not an admin route


async def test_a_stream_without_done_or_cut_short_is_broken(worker):
    client = AsyncWorkerClient()
    worker.answer("POST", "/v1/completions", 200, sse({"choices": []}), content_type="text/event-stream")
    _, stream = await client.open_completion(worker.url, path=worker_api.COMPLETIONS, content=b"{}")
    with pytest.raises(StreamBroken) as info:
        [chunk async for chunk in stream.chunks()]
    assert info.value.ended and "without [DONE]" in str(info.value)

    body = sse({"choices": []})
    worker.answer("POST", "/v1/completions", 200, body, content_type="text/event-stream",
                  declared_length=len(body) + 100)
    _, stream = await client.open_completion(worker.url, path=worker_api.COMPLETIONS, content=b"{}")
    with pytest.raises(StreamBroken) as info:
        [chunk async for chunk in stream.chunks()]
    assert not info.value.ended and info.value.kind == "RemoteProtocolError"
    await stream.aclose()


async def test_a_whole_answer_is_decoded_or_broken(worker):
    client = AsyncWorkerClient()
    worker.answer("POST", "/v1/completions", 200, {"choices": [{"text": "ok"}]})
    _, stream = await client.open_completion(worker.url, path=worker_api.COMPLETIONS, content=b"{}")
    assert await stream.answer() == {"choices": [{"text": "ok"}]}
    worker.answer("POST", "/v1/completions", 200, b"{truncated")
    _, stream = await client.open_completion(worker.url, path=worker_api.COMPLETIONS, content=b"{}")
    with pytest.raises(StreamBroken) as info:
        await stream.answer()
    assert info.value.kind == "JSONDecodeError"


async def test_a_refused_completion_is_read_and_released(worker, dead_url):
    client = AsyncWorkerClient()
    worker.answer("POST", "/v1/completions", 404, error_body("The model `lora-1` does not exist.", param="model",
                                                             code=worker_api.MODEL_NOT_FOUND))
    reply, stream = await client.open_completion(worker.url, path=worker_api.COMPLETIONS, content=b"{}")
    assert stream is None and reply.status == 404 and reply.error.code == "model_not_found"
    reply, stream = await client.open_completion(dead_url, path=worker_api.COMPLETIONS, content=b"{}")
    assert stream is None and reply.status is None and isinstance(reply.exception, httpx.ConnectError)
    with pytest.raises(ValueError, match="not a completion route"):
        await client.open_completion(worker.url, path=worker_api.LOAD_ADAPTER, content=b"{}")


async def test_one_async_client_per_event_loop():
    first = async_worker_client()
    assert async_worker_client() is first

    def other_loop():
        async def get():
            return async_worker_client()

        return asyncio.run(get())

    assert await asyncio.to_thread(other_loop) is not first
