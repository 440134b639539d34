"""Graceful drain on SIGTERM: stop admitting, finish what is in flight, exit within a grace period.

    SIGTERM  →  Serving.draining: /ready is 503 {"status": "draining"} (the orchestrator and the
                fleet stop sending) and new completions get 503 worker_draining + Retry-After
                (the gateway retries them on another worker before any byte was sent); the port
                stays open, so a request still routed here during the switch is refused, not lost
             →  the engine keeps stepping the admitted requests to their end
             →  nothing left in flight, or the grace deadline passed (what is still running is
                cut: an SSE error event, or a 503 when nothing was sent yet, and its KV freed)
             →  uvicorn's own shutdown (listener closed, connections finish), exit status 0

SIGINT (Ctrl-C) keeps uvicorn's behaviour: stop at once. Only the main thread receives signals;
the handler just sets attributes, the work happens in `on_tick` on the event loop (every 0.1 s).
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

from inference.server.serving import Serving

log = logging.getLogger("inference.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, *, serving: Serving, grace_seconds: float) -> None:
        super().__init__(config)
        self.serving = serving
        self.grace_seconds = grace_seconds
        self.drain_deadline: float | None = None  # time.monotonic() when the drain must end
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
            return
        # Not recorded in uvicorn's captured signals: it would re-raise SIGTERM after serving
        # and the process would end "killed by signal" instead of exiting 0 after a clean drain.
        # A repeated SIGTERM changes nothing (the deadline already governs).
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.grace_seconds
            self.serving.draining = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            self._drain_step()
        return await super().on_tick(counter)

    def _drain_step(self) -> None:
        in_flight = self.serving.engine.in_flight
        if not self._announced:
            self._announced = True
            log.info("SIGTERM: draining %d request(s) in flight, up to %gs", in_flight, self.grace_seconds)
        if in_flight == 0:
            log.info("drained: nothing left in flight, shutting down")
            self.should_exit = True
        elif time.monotonic() >= self.drain_deadline:
            cut = self.serving.cut_off()
            log.warning("drain grace of %gs passed: %d request(s) cut off, shutting down", self.grace_seconds, cut)
            self.should_exit = True

