"""The engine on its own thread, driven from the asyncio event loop.

LLMEngine is synchronous and its add_request/abort_request/step must be called from one
thread, so one dedicated thread owns it:

    loop:  drain the command queue (adds, aborts)  →  step() if anything is unfinished
           →  hand the step's outputs to the event loop in one call_soon_threadsafe
           (idle: sleep on a condition until a command arrives; never spin)

Each client request gets a `RequestStream`: the engine request ids it submitted (n > 1 or a
list of prompts submits several) and one asyncio.Queue their outputs arrive on. Streams never
wait on each other: the event loop only moves ready outputs between queues.

The model loads on this thread too, after the HTTP server is up, so /health answers while the
weights load and /ready turns 200 once `ready` is set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inference.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from inference.engine.structured_output import StructuredOutput

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (the model failed to load or a step raised)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Gauges read on the engine thread after every iteration, so /metrics and backpressure
    never touch the scheduler from another thread. Replaced whole (an atomic assignment)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_steps: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    running_adapters: tuple[str, ...] = ()  # adapter name of each running request that has one
    waiting_adapters: tuple[str, ...] = ()
    # Prefix cache, in tokens, per adapter name ("" = the base model): looked up, found cached.
    prefix_cache_queries: tuple[tuple[str, int], ...] = ()
    prefix_cache_hits: tuple[tuple[str, int], ...] = ()
    # (tokens one step ran, steps that ran that many): vllm:iteration_tokens_total.
    iteration_tokens: tuple[tuple[int, int], ...] = ()


@dataclass(eq=False)  # compared and hashed by identity
class RequestStream:
    """The outputs of the engine requests one client request submitted, in arrival order."""

    request_ids: list[str]
    adapter_name: str | None = None  # the adapter the requests use (metrics labels); None: the base
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Requests whose final output the consumer has not taken yet.
    unfinished: set[str] = field(default_factory=set)
    # time.monotonic() of each engine request's previous output (inter-token latency).
    last_output_time: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.unfinished = set(self.request_ids)

    async def get(self) -> RequestOutput:
        """The next output; raises if the engine died."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.unfinished.clear()
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
        return item


@dataclass(frozen=True)
class StepOutput:
    output: RequestOutput
    time: float  # when the engine produced it (monotonic)


class AsyncEngine:
    def __init__(self, engine_factory: Callable[[], object], on_output: Callable[[StepOutput, RequestStream], None]
                 | None = None) -> None:
        """engine_factory builds the LLMEngine (runs on the engine thread); on_output is called
        on the event loop for every output before its stream sees it (metrics)."""
        self._factory = engine_factory
        self._on_output = on_output
        self.engine = None
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.snapshot = EngineSnapshot()
        self._cond = threading.Condition()
        self._commands: list[tuple] = []
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}
        # Aborted by their client: their final "abort" output still reaches on_output (metrics).
        self._abandoned: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._on_dead: Callable[[BaseException], None] | None = None

    # -- lifecycle (event loop) ---------------------------------------------------
    def start(self, on_dead: Callable[[BaseException], None] | None = None) -> None:
        """Start the thread: it loads the model, then runs the loop. on_dead runs on the event
        loop if loading fails or the loop dies."""
        self._loop = asyncio.get_running_loop()
        self._on_dead = on_dead
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def in_flight(self) -> int:
        """Engine requests submitted and not yet finished (counted on the event loop)."""
        return len(self._streams)  # one entry per unfinished engine request

    # -- requests (event loop) ----------------------------------------------------
    async def add(self, requests: list[dict]) -> RequestStream:
        """Submit engine requests (add_request keyword arguments) all or nothing; returns once
        the engine accepted them. Raises what add_request raised (ValueError naming the field,
        AdapterNotFoundError, ...) — nothing is left running then."""
        self._check_alive()
        base = f"req-{next(self._ids)}"
        ids = [base] if len(requests) == 1 else [f"{base}-{i}" for i in range(len(requests))]
        lora = requests[0].get("lora")  # add_request's: an adapter name or a LoRARequest
        stream = RequestStream(ids, adapter_name=lora if isinstance(lora, str) or lora is None else lora.name)
        for request_id in ids:  # registered first, so no output can arrive before its stream exists
            self._streams[request_id] = stream
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("add", [dict(r, request_id=i) for r, i in zip(requests, ids, strict=True)], done))
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            # Failed, or the client went away while waiting: nothing of it may stay running
            # (aborting an id the engine never saw is a no-op).
            self._send(("abort", ids))
            for request_id in ids:
                self._streams.pop(request_id, None)
            raise
        return stream

    async def check_structured_output(self, spec: StructuredOutput) -> None:
        """Compile `spec`'s grammar (or find it cached) in the grammar thread pool, off the
        engine thread. Raises StructuredOutputError (a ValueError naming the bad part of the
        request) for a bad schema or grammar, so the server answers 400 before anything is
        queued; on success the compiled grammar is cached and the request starts at once."""
        self._check_alive()
        await asyncio.wrap_future(self.engine.grammars.get(spec))

    def abort(self, stream: RequestStream) -> None:
        """Abort whatever of the stream is still running (client disconnect): KV blocks and
        adapter references are freed on the engine thread's next iteration."""
        running = [i for i in stream.request_ids if self._streams.get(i) is stream]
        if running:
            self._send(("abort", running))
            for request_id in running:
                self._abandoned[request_id] = self._streams.pop(request_id)
        stream.unfinished.clear()

    def abort_all(self, error: BaseException) -> int:
        """End every open stream with `error` (the drain's deadline): its consumer reads what
        already arrived, then get() raises `error`; the engine frees the KV on its next turn.
        Returns how many streams were ended. Unlike abort(), `unfinished` is left as it is, so
        the consumer keeps reading until it meets the error instead of ending the stream as if
        it were complete."""
        streams = set(self._streams.values())
        for stream in streams:
            running = [i for i in stream.request_ids if self._streams.get(i) is stream]
            self._send(("abort", running))
            for request_id in running:
                self._abandoned[request_id] = self._streams.pop(request_id)
            stream.queue.put_nowait(error)
        return len(streams)

    async def outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Yield the stream's outputs until every one of its requests finished; aborts the rest
        if the consumer stops early (disconnect, error)."""
        try:
            while stream.unfinished:
                yield await stream.get()
        finally:
            self.abort(stream)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}")
        if not self.ready.is_set():
            raise EngineDeadError("the model is still loading")

    def _send(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        """On the event loop: route one step's outputs to their streams."""
        for item in outputs:
            out = item.output
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted by its client already: only metrics see the end
                abandoned = self._abandoned.pop(out.request_id, None) if out.finished else None
                if abandoned is not None and self._on_output is not None:
                    self._on_output(item, abandoned)
                continue
            if self._on_output is not None:
                self._on_output(item, stream)
            stream.last_output_time[out.request_id] = item.time
            if out.finished:
                self._streams.pop(out.request_id, None)
            stream.queue.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        """On the event loop, when the engine thread died: every open stream gets the error."""
        streams = set(self._streams.values())
        self._streams.clear()
        for stream in streams:
            stream.queue.put_nowait(EngineDeadError(f"the engine stopped: {error}"))
        if self._on_dead is not None:
            self._on_dead(error)

    # -- the engine thread --------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._factory()
            self.snapshot = self._take_snapshot()
            self.ready.set()
            self._loop_forever()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting client and the process
            log.exception("engine thread stopped")
            self.error = exc
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _loop_forever(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished_requests():  # deferred work now, not on the next request's first token
                engine.do_idle_work()
            with self._cond:
                while not self._commands and not self._stopping and not engine.has_unfinished_requests():
                    self._cond.wait()
                if self._stopping:
                    engine.shutdown()  # the adapter loader's threads
                    return
                commands, self._commands = self._commands, []
            for command in commands:
                self._apply(command)
            if engine.has_unfinished_requests():
                outputs = engine.step()
                now = time.monotonic()
                self.snapshot = self._take_snapshot()
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, [StepOutput(o, now) for o in outputs])
            else:
                self.snapshot = self._take_snapshot()

    def _apply(self, command: tuple) -> None:
        engine = self.engine
        if command[0] == "abort":
            for request_id in command[1]:
                engine.abort_request(request_id)
            return
        _, requests, done = command
        if not done.set_running_or_notify_cancel():  # the client left before we got here
            return
        added: list[str] = []
        try:
            for kwargs in requests:
                added.append(engine.add_request(**kwargs))
        except Exception as exc:  # bad input (ValueError, unknown adapter): reported to the caller
            for request_id in added:
                engine.abort_request(request_id)
            done.set_exception(exc)
            return
        done.set_result(added)

    def _take_snapshot(self) -> EngineSnapshot:
        engine = self.engine
        scheduler = engine.scheduler
        stats = engine.stats
        return EngineSnapshot(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=engine.block_manager.usage,
            num_steps=stats.num_steps,
            num_preemptions=stats.num_preemptions,
            prompt_tokens=stats.prompt_tokens,
            generation_tokens=stats.generation_tokens,
            running_adapters=tuple(_adapter_name(s) for s in scheduler.running if s.adapter is not None),
            waiting_adapters=tuple(_adapter_name(s) for s in scheduler.waiting if s.adapter is not None),
            prefix_cache_queries=tuple(stats.prefix_cache_queries.items()),
            prefix_cache_hits=tuple(stats.prefix_cache_hits.items()),
            iteration_tokens=tuple(stats.iteration_tokens.items()),
        )


def _adapter_name(seq) -> str:
    # seq.adapter is the adapter manager's record of the adapter the request bound to.
    return getattr(seq.adapter, "name", "?")
