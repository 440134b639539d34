"""Worker discovery from DNS (INFERENCE_DISCOVERY=dns://NAME:PORT): every address record is a
worker, re-resolved on each poll; workers that leave the answer leave routing at once; a name
that does not resolve, a resolver that hangs or answers garbage, is logged and shown, never a
reason to drop the workers that still answer.

Fake workers are real HTTP servers on distinct loopback addresses sharing one port (as pods of a
headless Service share the container port); the resolver is injected where a test needs a name
with several records (nothing here edits /etc/hosts), and the system resolver is used for the
names it can answer by itself (localhost, the reserved .invalid domain)."""

from __future__ import annotations

import logging
import socket
import threading
from datetime import timedelta

import pytest
from django.utils import timezone

from portal.config import ConfigError, WebConfig
from portal.fleet.discovery import parse_discovery, resolve_workers
from portal.fleet.models import InferenceWorker, WorkerDiscovery
from portal.fleet.selectors import route_candidates
from portal.fleet.services import fleet_poll
from tests.web_process import free_port

pytestmark = pytest.mark.django_db

SPEC = "dns://inference-headless:{port}"


class Dns:
    """A resolver with a script: `answer` is a list of addresses, or an exception to raise."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.asked: list[str] = []

    def __call__(self, host, port, type=0, **_):  # noqa: A002 -- getaddrinfo's keyword
        self.asked.append(host)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in self.answer]


@pytest.fixture
def fleet(make_fake_worker, settings):
    """Three fake workers on 127.0.0.5-7, one shared port, found through one DNS name."""
    port = free_port("127.0.0.5")
    workers = [make_fake_worker(host=f"127.0.0.{n}", port=port, running=0, waiting=0) for n in (5, 6, 7)]
    settings.INFERENCE_URLS = []
    settings.INFERENCE_ADMIN_TOKEN = None
    settings.INFERENCE_DISCOVERY = [SPEC.format(port=port)]
    return workers


def poll(dns: Dns) -> dict[str, InferenceWorker]:
    fleet_poll(resolver=dns)
    return {w.url: w for w in InferenceWorker.objects.all()}


def routed(lora_name: str | None = None) -> list[str]:
    return [t.url for t in route_candidates(lora_name=lora_name)]


# --- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize("value, reason", [
    ("http://inference:8001", "use dns://NAME:PORT"),
    ("dns://inference-headless", "port is required"),
    ("dns://inference-headless:0", "port is required"),
    ("dns://:8001", "no DNS name"),
    ("dns://inference-headless:http", "bad port"),
    ("dns://inference-headless:8001/v1", "only dns://NAME:PORT"),
    ("dns://inference-headless:8001?x=1", "only dns://NAME:PORT"),
    ("dns://a:1,dns://a:1", "lists a name twice"),
])
def test_a_bad_discovery_name_is_a_config_error_naming_the_variable(value, reason):
    with pytest.raises(ConfigError) as caught:
        WebConfig.from_env({"INFERENCE_DISCOVERY": value})
    assert caught.value.variable == "INFERENCE_DISCOVERY" and reason in caught.value.message


def test_discovery_replaces_the_default_static_worker_but_not_an_explicit_list():
    found = WebConfig.from_env({"INFERENCE_DISCOVERY": "dns://inference-headless:8001"})
    assert found.inference_discovery == ("dns://inference-headless:8001",) and found.inference_urls == ()
    both = WebConfig.from_env({"INFERENCE_DISCOVERY": "dns://a:1", "INFERENCE_URLS": "http://gpu-box:8001"})
    assert both.inference_urls == ("http://gpu-box:8001",)
    assert WebConfig.from_env({}).inference_urls == ("http://127.0.0.1:8001",)


# --- resolving ----------------------------------------------------------------------------------


def test_the_system_resolver_answers_localhost_and_refuses_a_name_that_does_not_exist():
    found = resolve_workers(parse_discovery("dns://localhost:8001"))
    assert found.ok and "http://127.0.0.1:8001" in found.urls
    missing = resolve_workers(parse_discovery("dns://no-such-worker.invalid:8001"))
    assert not missing.ok and missing.urls == ()
    assert "no-such-worker.invalid" in missing.error


def test_a_resolver_that_hangs_is_given_up_on_within_the_timeout():
    release = threading.Event()

    def hang(*args, **kwargs):
        release.wait(10)
        return []

    try:
        found = resolve_workers(parse_discovery("dns://slow:8001"), resolver=hang, timeout=0.2)
    finally:
        release.set()
    assert not found.ok and "no DNS answer within 0.2 s" in found.error


@pytest.mark.parametrize("answer, error", [
    ([("not", "a", "tuple")], "not an address"),
    ([(2, 1, 6, "", ("inference-0", 8001))], "not an address"),
    ([], "no address records"),
    (socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"), "does not resolve"),
    (UnicodeError("label too long"), "lookup failed"),
])
def test_garbage_from_the_resolver_is_an_error_not_a_worker(answer, error):
    found = resolve_workers(parse_discovery("dns://w:8001"), resolver=lambda *a, **k: _raise_or(answer))
    assert not found.ok and error in found.error


def _raise_or(answer):
    if isinstance(answer, BaseException):
        raise answer
    return answer


def test_ipv6_records_become_bracketed_urls_and_duplicates_fold():
    found = resolve_workers(parse_discovery("dns://w:8001"), resolver=Dns(["fd00::7", "10.0.0.7", "10.0.0.7"]))
    assert found.urls == ("http://10.0.0.7:8001", "http://[fd00::7]:8001")


# --- the poll -----------------------------------------------------------------------------------


def test_every_record_is_a_worker_polled_and_routed(fleet):
    dns = Dns(["127.0.0.5", "127.0.0.6"])
    rows = poll(dns)

    urls = {fleet[0].url, fleet[1].url}
    assert set(rows) == urls
    assert all(rows[u].healthy and rows[u].discovered_by == SPEC.format(port=fleet[0].url.rsplit(":", 1)[1])
               for u in urls)
    assert set(routed()) == urls
    assert fleet[2].requests == []  # not in the answer: never asked
    record = WorkerDiscovery.objects.get()
    assert record.addresses == sorted(urls) and record.last_error == "" and record.last_ok_at is not None


def test_a_scaled_up_worker_joins_and_one_that_leaves_the_answer_leaves_routing_at_once(fleet):
    dns = Dns(["127.0.0.5", "127.0.0.6"])
    poll(dns)
    dns.answer = ["127.0.0.5", "127.0.0.7"]  # .6 drained (not ready: out of the answer), .7 scaled up
    asked_before = len(fleet[1].requests)

    rows = poll(dns)

    gone = rows[fleet[1].url]
    assert not gone.healthy and gone.gone_since is not None and "left the answer of dns://" in gone.last_error
    assert len(fleet[1].requests) == asked_before  # not polled once gone
    assert rows[fleet[2].url].healthy
    assert set(routed("lora-a")) == {fleet[0].url, fleet[2].url}

    dns.answer = ["127.0.0.5", "127.0.0.6", "127.0.0.7"]  # back (the same pod, ready again)
    rows = poll(dns)
    assert rows[fleet[1].url].healthy and rows[fleet[1].url].gone_since is None
    assert set(routed()) == {w.url for w in fleet}


def test_a_name_that_stops_resolving_keeps_the_workers_that_answer_and_says_why(fleet, caplog):
    dns = Dns(["127.0.0.5", "127.0.0.6"])
    poll(dns)
    dns.answer = socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with caplog.at_level(logging.WARNING, logger="portal.fleet.services"):
        rows = poll(dns)
        poll(dns)  # the same failure is logged once, not every 10 s

    assert all(rows[w.url].healthy for w in fleet[:2])  # their own probes decide
    assert set(routed()) == {fleet[0].url, fleet[1].url}
    record = WorkerDiscovery.objects.get()
    assert "does not resolve: Name or service not known" in record.last_error
    assert record.addresses == sorted([fleet[0].url, fleet[1].url])  # the last good answer
    assert [r.getMessage() for r in caplog.records].count(
        f"fleet: discovery {record.spec} failed: {record.last_error} (its workers keep their rows)") == 1


def test_a_fleet_found_only_through_dns_has_no_static_fallback(settings):
    settings.INFERENCE_URLS = []
    settings.INFERENCE_DISCOVERY = ["dns://no-such-worker.invalid:8001"]
    assert fleet_poll() == []
    assert routed() == []  # the gateway answers its JSON 503 "no worker", never a 5xx page
    assert "does not resolve" in WorkerDiscovery.objects.get().last_error


def test_gone_rows_are_forgotten_after_an_hour_and_a_dropped_name_takes_its_workers(fleet, settings):
    dns = Dns(["127.0.0.5", "127.0.0.6"])
    poll(dns)
    InferenceWorker.objects.filter(url=fleet[1].url).update(gone_since=timezone.now() - timedelta(hours=2))
    dns.answer = ["127.0.0.5"]
    rows = poll(dns)
    assert fleet[1].url not in rows

    settings.INFERENCE_DISCOVERY = []
    rows = poll(dns)
    assert rows[fleet[0].url].gone_since is not None and "no longer configured" in rows[fleet[0].url].last_error
    assert routed() == [] and not WorkerDiscovery.objects.exists()


def test_a_static_worker_listed_by_dns_too_stays_a_static_one(fleet, settings):
    settings.INFERENCE_URLS = [fleet[0].url]
    dns = Dns(["127.0.0.6"])
    rows = poll(dns)
    assert rows[fleet[0].url].discovered_by == "" and rows[fleet[0].url].healthy
    dns.answer = ["127.0.0.5"]  # DNS now lists the static one and not .6
    rows = poll(dns)
    assert rows[fleet[0].url].gone_since is None and rows[fleet[0].url].healthy
    assert rows[fleet[1].url].gone_since is not None
