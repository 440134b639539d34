"""Test helper: one streaming OpenAI request read to its end on a thread (every SSE event, and
whether [DONE] came), so a test can act (SIGTERM a worker) while several streams run.
Import as `tests.sse_stream`."""

from __future__ import annotations

import json
import threading

import httpx


class SseStream(threading.Thread):
    def __init__(self, url: str, body: dict, headers: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, body, headers or {}
        self.events: list[dict] = []
        self.done = False
        self.started = threading.Event()  # set at the first event (or on a failure)
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=self.headers, timeout=120) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        self.started.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc
            self.started.set()

    @property
    def errors(self) -> list[dict]:
        return [e["error"] for e in self.events if "error" in e]

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events for c in e.get("choices", []) if c.get("finish_reason")]
