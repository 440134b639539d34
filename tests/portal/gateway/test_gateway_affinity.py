"""Adapter affinity over three real workers behind the gateway: requests for an adapter land on
the worker the last fleet poll saw holding it, even where rendezvous hashing would choose another;
once streams held open saturate that worker (FLEET_MAX_LOAD), requests go to another worker,
which loads the adapter itself and answers alike; when the streams end, traffic comes back."""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from portal.fleet.selectors import rendezvous_score
from tests.inference.server.server_process import ServerProcess, start_server
from tests.portal.gateway.conftest import (
    ADMIN_TOKEN,
    WORKER_FLAGS,
    model_path,
    sdk,
    usage_rows,
    wait_for_row,
    wait_until,
)
from tests.portal.gateway.lora_adapter import write_adapter
from tests.portal.gateway.test_gateway_lora import worker_adapters

MAX_LOAD = 2  # settings.FLEET_MAX_LOAD: two held streams saturate a worker, whatever else routing weighs
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
SHORT = {"max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
# Held streams run until the test hangs up on them, so max_tokens only bounds how long they could
# last: a stream that finished early would no longer load its worker, and on a busy 2-core box one
# short request can take 20 s. Two of 2000 tokens need ~190 MiB of fp32 KV cache: HOLDER_KV.
HOLD = {"model": "acme/bot", "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "stream": True}
HOLDER_KV = ["--kv-cache-memory", "256MiB"]


@pytest.fixture(scope="module")
def two_more(tmp_path_factory, worker):
    """Two more SmolLM2 workers beside the session's, started side by side, with room for HOLD."""

    def start(name: str) -> ServerProcess:
        log = tmp_path_factory.mktemp("worker") / f"{name}.log"
        return start_server(["--model", str(model_path()), *WORKER_FLAGS, *HOLDER_KV], log,
                            env={"INFERENCE_ADMIN_TOKEN": ADMIN_TOKEN})

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, name) for name in ("second", "third")]
    procs = [f.result() for f in futures if f.exception() is None]
    try:
        assert len(procs) == 2, [f.exception() for f in futures]
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return write_adapter(tmp_path_factory.mktemp("lora") / "bot", model_path(), seed=7)


class HeldStreams:
    """Streaming requests kept open (read up to their first token, then left running) until
    close() hangs up on them, as a client that stops listening would."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.headers = url, {"authorization": f"Bearer {key}"}
        self.request_ids: list[str] = []
        # Each stream's line iterator, kept: httpx closes the connection of an iterator that is
        # garbage-collected half-read, and the held stream with it.
        self._lines = []
        self._stack = contextlib.ExitStack()
        self._http = self._stack.enter_context(httpx.Client(timeout=120))

    def open(self) -> None:
        response = self._stack.enter_context(self._http.stream("POST", self.url, json=HOLD, headers=self.headers))
        assert response.status_code == 200, response.read()
        self.request_ids.append(response.headers["x-request-id"])
        lines = response.iter_lines()
        self._lines.append(lines)
        for line in lines:  # up to the first token: the worker accepted it and is generating
            if line.startswith("data: ") and json.loads(line[6:]).get("choices"):
                return
        raise AssertionError("the held stream ended before its first token")

    def close(self) -> None:
        self._stack.close()


@pytest.fixture
def no_staging_tasks():
    """No re-staging after the test's polls: fleet_poll's reconcile (portal.adapters.reconcile)
    would ask for every deployed version on every worker, which would blur which worker holds
    the adapter. Its receiver is disconnected for the test, so nothing is sent anywhere."""
    from portal.adapters.reconcile import on_fleet_polled
    from portal.fleet.signals import fleet_polled

    fleet_polled.disconnect(on_fleet_polled, dispatch_uid="adapters.reconcile")
    yield
    fleet_polled.connect(on_fleet_polled, dispatch_uid="adapters.reconcile")


def test_adapter_traffic_stays_on_its_holder_until_it_is_saturated(acme, worker, two_more, live, settings,
                                                                    adapter_dir, no_staging_tasks):
    from portal.adapters.models import Adapter, AdapterVersion
    from portal.adapters.staging import STAGED, version_stage_once
    from portal.fleet.services import fleet_poll
    from portal.gateway.resolve import base_model_forget

    workers = {w.url: w for w in (worker, *two_more)}
    settings.INFERENCE_URLS = list(workers)
    settings.FLEET_MAX_LOAD = MAX_LOAD
    base_model_forget()
    bot = Adapter.objects.create(tenant=acme.tenant, name="bot")
    version = AdapterVersion.objects.create(adapter=bot, number=1, source_path=str(adapter_dir))
    name = version.worker_name

    # Staged on a worker rendezvous hashing does not rank first for this adapter (the lower of
    # the two with room for HOLD): only the poll's residency can send its traffic there.
    by_hash = sorted(workers, key=lambda url: rendezvous_score(name, url), reverse=True)
    holder = [url for url in by_hash if url != worker.url][-1]
    assert by_hash.index(holder) > 0
    others = [url for url in workers if url != holder]
    assert version_stage_once(version_id=version.pk, worker_url=holder, attempts=1, final=True) == STAGED
    polled = fleet_poll()
    assert sorted(w.url for w in polled if w.healthy) == sorted(workers)
    assert [w.url for w in polled if w.has_resident(name)] == [holder]

    client = sdk(live, acme.key)

    def ask():
        """One short request for the adapter: (its answer's text, the worker its ledger row names)."""
        raw = client.chat.completions.with_raw_response.create(model="acme/bot", messages=MESSAGES, **SHORT)
        assert raw.status_code == 200
        answer = raw.parse()
        assert answer.model == "acme/bot" and len(answer.choices) == 1
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 4
        row = wait_for_row(raw.headers["x-request-id"])  # written after the in-flight count drops
        assert row.status_code == 200 and row.error == "" and row.completion_tokens == 4
        assert row.adapter_version_id == version.pk
        return answer.choices[0].message.content, row.worker_url

    # 1. Unloaded fleet: every request goes to the holder.
    served = [ask() for _ in range(3)]
    assert [url for _, url in served] == [holder] * 3
    [text] = {text for text, _ in served}
    assert all(name not in worker_adapters(workers[url]) for url in others)

    # 2. Hold streams open on the holder until a request goes elsewhere: that must happen by the
    # time it holds FLEET_MAX_LOAD of them (the hard cap; a relative bound under it may say sooner).
    held = HeldStreams(f"{live.url}/v1/chat/completions", acme.key)
    try:
        while True:
            held.open()
            assert workers[holder].metric("vllm:num_requests_running") == len(held.request_ids)
            probe_text, probe_url = ask()
            if probe_url != holder:
                break
            assert len(held.request_ids) < MAX_LOAD, f"{holder} served a request with {MAX_LOAD} streams in flight"
        spill = probe_url
        assert spill in others
        assert probe_text == text  # the same adapter's greedy answer on the other worker
        assert workers[holder].metric("vllm:num_requests_running") == len(held.request_ids)  # still held
        assert name in worker_adapters(workers[spill])  # loaded there on demand, and only there
        assert all(name not in worker_adapters(workers[url]) for url in others if url != spill)
    finally:
        held.close()

    # 3. The streams are over (their ledger rows written, the holder idle): back to the holder.
    holding = wait_until(lambda: len(rows := usage_rows(request_id__in=held.request_ids)) == len(held.request_ids)
                         and rows, timeout=60)
    assert {(r.worker_url, r.status_code, r.client_disconnected) for r in holding} == {(holder, 200, True)}
    wait_until(lambda: workers[holder].metric("vllm:num_requests_running") == 0, timeout=60)  # aborted there
    assert [ask() for _ in range(2)] == [(text, holder)] * 2

    rows = usage_rows(tenant=acme.tenant)
    probes = len(held.request_ids)  # one probe per held stream; the last went elsewhere
    assert len(rows) == 3 + len(held.request_ids) + probes + 2
    assert [r.worker_url for r in rows].count(spill) == 1
    assert [r.worker_url for r in rows].count(holder) == len(rows) - 1
