"""Test helper (no tests here): a loopback HTTP stand-in for an inference worker's adapter routes
that records every request and answers from a script. Import as
`tests.portal.adapters.test_staging_fakes`."""

from __future__ import annotations

import json
import threading
from collections import defaultdict, deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeWorker:
    """POSTs are recorded as (path, json body, authorization header). `script[path]` is a queue
    of (status, json) answers used up in order; when empty the answer is `default(path)`."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict, str | None]] = []
        self.script: dict[str, deque] = defaultdict(deque)
        self.loaded: set[str] = set()
        self.pinned: set[str] = set()
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 -- http.server's name
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else {}
                with outer.lock:
                    outer.requests.append((self.path, body, self.headers.get("authorization")))
                    queued = outer.script[self.path]
                    status, answer = queued.popleft() if queued else outer.default(self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def default(self, path: str, body: dict) -> tuple[int, dict]:
        if path == "/v1/load_lora_adapter":
            self.loaded.add(body["lora_name"])
            return 200, {"object": "adapter", "name": body["lora_name"]}
        if path == "/v1/unload_lora_adapter":
            if body["lora_name"] in self.loaded:
                self.loaded.discard(body["lora_name"])
                return 200, {"object": "adapter", "deleted": True}
            return 404, error("not registered", code="adapter_not_found")
        if path.startswith("/v1/adapters/"):
            name, action = path.split("/")[3:5]
            if name not in self.loaded:
                return 404, error("not registered", code="adapter_not_found")
            (self.pinned.add if action == "pin" else self.pinned.discard)(name)
            return 200, {"object": "adapter", "name": name, "pinned": action == "pin"}
        return 404, error("no route")

    def calls(self, path: str) -> list[dict]:
        return [body for p, body, _ in self.requests if p == path]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def error(message: str, *, code: str | None = None, status_type: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": status_type, "param": None, "code": code}}
