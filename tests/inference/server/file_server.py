"""Test helper: a real loopback HTTP server that serves adapter files and records every request
(path, Authorization header), to prove what a worker fetched and from where.
Import as `tests.inference.server.file_server`."""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FILE_TOKEN = "portal-file-secret"
PEFT = ("adapter_config.json", "adapter_model.safetensors")


class FileServer:
    """Serves {path: bytes} on 127.0.0.1; needs `Bearer FILE_TOKEN` under /private/; records requests."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.requests: list[tuple[str, str | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 -- http.server's name
                outer.requests.append((self.path, self.headers.get("authorization")))
                if self.path.startswith("/private/") and self.headers.get("authorization") != f"Bearer {FILE_TOKEN}":
                    self.send_response(403)
                    self.end_headers()
                    return
                if self.path.startswith("/redirect/"):
                    self.send_response(302)
                    self.send_header("location", "/public/" + self.path.split("/", 2)[2])
                    self.end_headers()
                    return
                data = outer.files.get(self.path)
                if data is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                if not self.path.startswith("/chunked/"):
                    self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def publish(self, prefix: str, directory: Path) -> dict[str, str]:
        """Serve the adapter's two files under /<prefix>/; returns {filename: sha256}."""
        digests = {}
        for name in PEFT:
            data = (directory / name).read_bytes()
            self.files[f"/{prefix}/{name}"] = data
            digests[name] = hashlib.sha256(data).hexdigest()
        return digests

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
