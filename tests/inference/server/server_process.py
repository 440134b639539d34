"""Test helper: a real `python -m inference serve` process on a free loopback port.
Import as `tests.inference.server.server_process`."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log_path: Path
    # What the start-up showed: /health answered 200 while /ready was still 503.
    saw_health_before_ready: bool = False
    env: dict = field(default_factory=dict)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (the first whose labels include `labels`)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            m = re.match(r"^([^\s{]+)(?:\{(.*)\})? (\S+)$", line)
            if not m or m.group(1) != name:
                continue
            found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(m.group(3))
        raise KeyError(f"{name}{labels} not in /metrics")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(args: list[str], log_path: Path, timeout: float = 240, env: dict | None = None) -> ServerProcess:
    """Start the server and wait until /ready is 200; fails with the server's log otherwise."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_")}
    environ.update(env or {})
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "inference", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=environ,
    )
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path, env=environ)
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log}")
            try:
                health = client.get(f"{server.url}/health").status_code
                ready = client.get(f"{server.url}/ready").status_code
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            if health == 200 and ready == 503:
                server.saw_health_before_ready = True
            if ready == 200:
                return server
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"server not ready in {timeout}s:\n{server.log}")
