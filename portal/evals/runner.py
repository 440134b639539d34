"""Sending a set's cases to the inference workers for one version, the way the gateway does:
the routing order (portal.fleet.selectors.route_candidates), tried in turn when a worker cannot
be reached or answers 5xx/404/408/429; a worker that does not hold the version loads it
(lazy load, as the gateway's relay) and is asked again once; any other 4xx is the case's own
(the worker refused it: verdict error). Greedy (temperature 0), the case's max_tokens.

The requests go straight to the workers through portal.fleet.client, not through /v1: they are
the platform's own, not the tenant's traffic, so they are neither billed, nor counted against
quotas, nor mixed into the live per-version comparison the ledger feeds.

Threads only speak HTTP (no database): the caller stores each CaseOutcome as it comes back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from portal.adapters.models import AdapterVersion
from portal.fleet.client import WorkerClient, completion_call, version_load_body
from portal.fleet.selectors import route_candidates
from portal.tenants.plans import plan_for
from protocol import worker_api

CONCURRENCY = 4  # cases in flight per version: the worker batches them
OUTPUT_CHARS = 20_000  # of an output kept (max_tokens <= 256 makes this a backstop)


class WorkerGone(Exception):
    """No worker answered a case: the run cannot go on (its message says which case and why)."""


@dataclass(frozen=True)
class CaseOutcome:
    index: int
    output: str
    latency_ms: float
    error: str = ""  # the worker refused the case (a 4xx): its message
    completion_tokens: int | None = None
    finish_reason: str = ""


def case_body(case: dict, *, version: AdapterVersion) -> tuple[str, dict]:
    """(worker path, JSON body) of one case for one version."""
    tenant = version.adapter.tenant
    body: dict = {
        "model": version.worker_name, "max_tokens": case["max_tokens"], "temperature": 0, "stream": False,
        "tenant": tenant.slug, "tenant_weight": plan_for(tenant.plan).scheduling_weight,
        # The gateway's prefix-cache namespace for this tenant (portal.gateway.relay.tenant_cache_salt).
        worker_api.CACHE_SALT: f"tenant-{tenant.pk}",
    }
    if case.get("messages") is not None:
        return worker_api.CHAT_COMPLETIONS, {**body, "messages": case["messages"]}
    return worker_api.COMPLETIONS, {**body, "prompt": case["prompt"]}


def run_cases(*, version: AdapterVersion, cases: list[dict], skip: set[int] = frozenset(),
              concurrency: int = CONCURRENCY) -> Iterator[CaseOutcome]:
    """Each case's outcome on `version` as it completes (order not kept). Raises WorkerGone when
    a case finds no worker; outcomes already yielded stand."""
    pending = [(i, case) for i, case in enumerate(cases) if i not in skip]
    if not pending:
        return
    targets = [w.url.rstrip("/") for w in route_candidates(lora_name=version.worker_name)]
    if not targets:
        raise WorkerGone("no inference worker is configured")
    with WorkerClient() as client:
        send = _Sender(client, targets, version)
        # The first case alone: it loads the version where it is missing, once, before the rest
        # arrive together.
        first_index, first_case = pending[0]
        yield send(first_index, first_case)
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="eval") as pool:
            futures: set[Future] = set()
            queue = iter(pending[1:])
            try:
                for index, case in queue:
                    futures.add(pool.submit(send, index, case))
                    if len(futures) >= concurrency:
                        yield from _drain(futures, FIRST_COMPLETED)
                yield from _drain(futures, ALL_COMPLETED)
            finally:
                for future in futures:
                    future.cancel()


def _drain(futures: set[Future], return_when: str) -> Iterator[CaseOutcome]:
    done, _ = wait(futures, return_when=return_when)
    for future in done:
        futures.discard(future)
        yield future.result()  # WorkerGone propagates


class _Sender:
    """One case to the first worker that takes it (Callable for the thread pool)."""

    def __init__(self, client: WorkerClient, targets: list[str], version: AdapterVersion):
        self.client, self.targets, self.version = client, targets, version

    def __call__(self, index: int, case: dict) -> CaseOutcome:
        path, body = case_body(case, version=self.version)
        content = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        failures: list[str] = []
        for url in self.targets:
            loaded = False
            while True:
                started = time.monotonic()
                reply = self.client.send(url, completion_call(path, content))
                latency_ms = (time.monotonic() - started) * 1000
                if reply.ok:
                    return _outcome(index, reply.body, latency_ms, chat=path == worker_api.CHAT_COMPLETIONS)
                if reply.status is None or reply.exception is not None:
                    failures.append(f"{url}: {reply.describe()}")
                    break
                error = reply.error
                if reply.status == 404 and not loaded and error.code == worker_api.MODEL_NOT_FOUND:
                    why = self._load(url)
                    if why:
                        failures.append(f"{url}: {why}")
                        break
                    loaded = True
                    continue
                if reply.status >= 500 or reply.status in (404, 408, 429):
                    failures.append(f"{url}: {reply.describe()}")
                    break
                return CaseOutcome(index, "", latency_ms, error=f"HTTP {reply.status}: {error.message}".strip())
        raise WorkerGone(f"case {case['name']!r} (line {case['line']}) on {self.version.public_id}: no worker "
                         f"answered: {'; '.join(failures)}")

    def _load(self, url: str) -> str:
        reply = self.client.load_adapter(url, version_load_body(version=self.version))
        return "" if reply.ok else f"loading {self.version.public_id} failed: {reply.describe()}"


def _outcome(index: int, raw: bytes, latency_ms: float, *, chat: bool) -> CaseOutcome:
    try:
        answer = json.loads(raw)
        choice = answer["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise WorkerGone(f"a worker answered something that is not a completion: {raw[:200]!r}") from None
    usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
    tokens = usage.get("completion_tokens")
    return CaseOutcome(index, (text or "")[:OUTPUT_CHARS], latency_ms,
                       completion_tokens=tokens if isinstance(tokens, int) else None,
                       finish_reason=str(choice.get("finish_reason") or ""))

