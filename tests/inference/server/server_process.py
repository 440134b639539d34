"""Test helper: a real `python -m inference serve` process on a free loopback port (127.0.0.1
unless `host` names another loopback address, e.g. 127.0.0.3 for a multi-host test), restartable
on the same address and port. Import as `tests.inference.server.server_process`.

    worker = start_server(["--model", path, ...], tmp / "w.log", host="127.0.0.3", env={...})
    worker.proc.kill()                        # a crash
    worker = worker.restart(tmp / "w2.log")   # same URL, same arguments and environment
"""

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
LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log_path: Path
    # What the start-up showed: /health answered 200 while /ready was still 503.
    saw_health_before_ready: bool = False
    env: dict = field(default_factory=dict)  # the process's whole environment
    argv: list = field(default_factory=list)  # its whole command line (restart() runs it again)

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

    def restart(self, log_path: Path | None = None, timeout: float = 240) -> ServerProcess:
        """Stop this process if it still runs, then start the same command line with the same
        environment on the same address and port (what a supervisor does after a crash); waits
        until /ready is 200. Returns the new process's ServerProcess."""
        self.stop()
        return _launch(self.argv, self.env, self.url, log_path or self.log_path, timeout, append=True)


def start_server(args: list[str], log_path: Path, timeout: float = 240, env: dict | None = None, *,
                 host: str = LOOPBACK, port: int | None = None) -> ServerProcess:
    """Start the server on `host` (a loopback address) and `port` (default: a free one) and wait
    until /ready is 200; fails with the server's log otherwise."""
    if port is None:
        # Called without arguments for the default host: some tests replace free_port with a
        # function that takes none, to choose the port themselves.
        port = free_port() if host == LOOPBACK else free_port(host)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_")}
    # Tests stage adapters at run time, as the portal does (a bare worker has no load route, as in
    # vLLM); a test passes INFERENCE_ALLOW_RUNTIME_LORA_UPDATING=false to see that.
    environ["INFERENCE_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    environ.update(env or {})
    argv = [sys.executable, "-m", "inference", "serve", "--host", host, "--port", str(port), *args]
    return _launch(argv, environ, f"http://{host}:{port}", log_path, timeout)


def _launch(argv: list[str], environ: dict, url: str, log_path: Path, timeout: float, *,
            append: bool = False) -> ServerProcess:
    log = open(log_path, "ab" if append else "wb")  # a restart may write on after the crashed process's log
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=environ)
    log.close()  # the child holds its own descriptor
    server = ServerProcess(url, proc, log_path, env=environ, argv=argv)
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
