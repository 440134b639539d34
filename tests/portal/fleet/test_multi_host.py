"""The platform as deployed, over several hosts: every process real, each on a loopback address
of its own, talking only over HTTP, PostgreSQL and Redis.

    127.0.0.2   the web process (uvicorn portal.asgi:application, production settings):
                REST API, gateway, /internal/adapters/ (the files the workers fetch)
    127.0.0.3   inference worker `python -m inference serve` (SmolLM2), its own adapter cache
    127.0.0.4   another one
    -           a Celery worker with embedded beat (`celery -A portal.celery:app worker -B`):
                validation, staging, the fleet poll every 10 s

A tenant's API key uploads a PEFT zip over REST -> the Celery worker validates it -> both
workers are asked to stage it, and each fetches the files from the web process itself -> it is
made always-warm (pinned on both) -> the gateway serves it -> the worker it tries first is killed
(SIGKILL) -> the gateway moves on to the other, no client sees an error -> the killed worker is
restarted on the same address and port with an empty disk -> without anyone asking, the
platform stages its deployed always-warm adapter there again (fetched and pinned) -> with the
other worker killed too, the gateway serves it from the restarted one.

The processes see only committed rows: the module's fixtures commit theirs before any test
transaction begins and flush the tables when the module is done (what `transactional_db` does
per test; here the rows must outlive one test).
Each test prints the processes' logs when it ends; pytest shows them only when it fails.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import httpx
import openai
import pytest

from portal.adapters.validation import SMOLLM2_135M
from tests.inference.server.server_process import ServerProcess, free_port, start_server
from tests.portal.adapters.peft_files import peft_config, write_peft, zip_dir
from tests.portal.gateway.conftest import (
    ADMIN_TOKEN,
    WORKER_FLAGS,
    model_path,
    wait_for_row,
    wait_until,
)
from tests.web_process import (
    WebProcess,
    collect_static,
    forwarded_https_client,
    production_env,
    start_web,
)

pytestmark = [
    pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs Redis (Celery broker, quotas)"),
    # The tests only read (ledger, fleet rows: each query sees the processes' latest commits);
    # the module's rows are committed by its fixtures and flushed at the end.
    pytest.mark.django_db,
]

ROOT = Path(__file__).resolve().parents[3]
WEB_HOST = "127.0.0.2"
WORKER_HOSTS = ("127.0.0.3", "127.0.0.4")
SLUG, ADAPTER = "fleetco", "support-bot"
MODEL = f"{SLUG}/{ADAPTER}"
PROMPT = "Hello"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
POLL_SECONDS = 10  # portal.fleet.tasks.POLL_EVERY_SECONDS: beat's fleet poll
# After a restarted worker is ready: up to one poll interval until beat's poll notices it came
# up, then the staging tasks; the rest is slack for a loaded 2-core machine.
RESTAGE_SECONDS = 4 * POLL_SECONDS


@dataclass
class Platform:
    web: WebProcess
    workers: dict[str, ServerProcess]  # by URL
    cache_dirs: dict[str, Path]  # each worker's INFERENCE_ADAPTER_CACHE_DIR, by URL
    celery: subprocess.Popen
    celery_log: Path
    key: str  # the tenant's API key (plaintext)
    version: dict = field(default_factory=dict)  # the uploaded version as the REST API shows it

    def api(self) -> httpx.Client:
        return forwarded_https_client(self.web, timeout=60, headers={"authorization": f"Bearer {self.key}"})

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.web.url}/v1", api_key=self.key, max_retries=0, timeout=120)

    def logs(self) -> str:
        parts = [("web", self.web.log_path), ("celery", self.celery_log)]
        parts += [(url, w.log_path) for url, w in self.workers.items()]
        return "\n".join(f"----- {name} log (tail) -----\n{_tail(path)}" for name, path in parts)


def _tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def _start_worker(host: str, port: int, web_url: str, cache_dir: Path, log: Path) -> ServerProcess:
    env = {"INFERENCE_ADMIN_TOKEN": ADMIN_TOKEN, "INFERENCE_PORTAL_ORIGINS": web_url,
           "INFERENCE_ADAPTER_CACHE_DIR": str(cache_dir), "PYTHONUNBUFFERED": "1"}  # its access log, live
    return start_server(["--model", str(model_path()), *WORKER_FLAGS], log, env=env, host=host, port=port)


def _start_web(env: dict, port: int, log: Path) -> WebProcess:
    collect_static(env)
    # start_web takes a free port of its own; this one was chosen first, for the workers' origin.
    with mock.patch("tests.web_process.free_port", lambda host: port):
        return start_web(env, host=WEB_HOST, log_path=log)


def _start_celery(env: dict, tmp: Path) -> tuple[subprocess.Popen, Path]:
    """The Celery worker with embedded beat; no -Q: it consumes every queue the app declares.
    The queues are emptied first: earlier tests in this session (gateway tests with REDIS_URL
    set, where nothing consumes) may have left tasks for rows and workers long gone."""
    from portal.celery import app

    app.control.purge()
    log = tmp / "celery.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "portal.celery:app", "worker", "-B", "-s", str(tmp / "beat-schedule"),
             "--pool=solo", "-l", "info", "--without-heartbeat", "--without-gossip", "--without-mingle"],
            cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=out, stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while " ready." not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the Celery worker did not start:\n{_tail(log)}")
        time.sleep(0.2)
    return proc, log


def _committed_caller() -> str:
    """A tenant on a plan with always-warm slots, a member, and an API key the member created."""
    from django.contrib.auth import get_user_model

    from portal.keys.services import api_key_create
    from portal.tenants.models import Membership
    from portal.tenants.services import membership_create, tenant_create

    tenant = tenant_create(slug=SLUG, name="Fleet Co")
    tenant.plan = "enterprise"
    tenant.save(update_fields=["plan"])
    user = get_user_model().objects.create_user(username="maya", password=uuid.uuid4().hex)
    membership_create(tenant=tenant, user=user, role=Membership.Role.MEMBER)
    return api_key_create(tenant=tenant, name="ci", created_by=user)[1]


@pytest.fixture(scope="module")
def platform(django_db_setup, django_db_blocker, tmp_path_factory):
    from django.conf import settings
    from django.core.management import call_command

    from tests.web_process import test_database_url

    tmp = tmp_path_factory.mktemp("multi-host")
    web_port = free_port(WEB_HOST)
    web_url = f"http://{WEB_HOST}:{web_port}"
    ports = {host: free_port(host) for host in WORKER_HOSTS}
    urls = [f"http://{host}:{port}" for host, port in ports.items()]
    cache_dirs = {url: tmp / f"cache-{host}" for url, host in zip(urls, WORKER_HOSTS, strict=True)}
    env = production_env(database_url=test_database_url(), redis_url=settings.REDIS_URL, static_root=tmp / "static",
                         storage_root=tmp / "storage", inference_urls=urls, admin_token=ADMIN_TOKEN,
                         REDIS_KEY_PREFIX=f"test:multi-host:{uuid.uuid4().hex}:", PORTAL_INTERNAL_URL=web_url)
    started, platform = [], None
    with django_db_blocker.unblock():
        try:
            key = _committed_caller()
            with ThreadPoolExecutor(4) as pool:
                web = pool.submit(_start_web, env, web_port, tmp / "web.log")
                workers = {url: pool.submit(_start_worker, host, ports[host], web_url, cache_dirs[url],
                                            tmp / f"worker-{host}.log")
                           for url, host in zip(urls, WORKER_HOSTS, strict=True)}
                celery = pool.submit(_start_celery, env, tmp)
                futures = [web, celery, *workers.values()]
                for future in futures:  # collect every process that started, even when one did not
                    if future.exception() is None:
                        started.append(future.result())
                for future in futures:
                    future.result()
            platform = Platform(web=web.result(), workers={url: f.result() for url, f in workers.items()},
                                cache_dirs=cache_dirs, celery=celery.result()[0], celery_log=tmp / "celery.log",
                                key=key)
            yield platform
        finally:
            workers_now = [p.proc for p in started if isinstance(p, ServerProcess)]
            if platform is not None:
                workers_now += [w.proc for w in platform.workers.values()]  # restarted ones are new processes
            others = [p[0] if isinstance(p, tuple) else p.proc for p in started if not isinstance(p, ServerProcess)]
            for proc in workers_now:
                proc.kill()  # a drain would only cost time here
            for proc in others:
                proc.terminate()  # uvicorn's shutdown; Celery's warm shutdown (and beat's)
            for proc in workers_now + others:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            call_command("flush", verbosity=0, interactive=False)


@pytest.fixture(autouse=True)
def show_logs_on_failure(platform):
    yield
    print(platform.logs())  # captured: pytest shows it only for a failed test


def _version_status(platform: Platform) -> dict:
    with platform.api() as api:
        r = api.get(f"/api/v1/tenants/{SLUG}/adapters/{ADAPTER}/versions/{platform.version['number']}/status/")
    assert r.status_code == 200, r.text
    return r.json()


def _wait_for_staging(platform: Platform, *, pinned: bool, timeout: float = 60) -> dict:
    """The version's status once staging says staged (and pinned, if asked) on every worker."""
    deadline = time.monotonic() + timeout
    while True:
        status = _version_status(platform)
        entries = [status["staging"].get(url, {}) for url in platform.workers]
        if status["status"] == "ready" and all(
                e.get("status") == "staged" and (e.get("pinned") or not pinned) for e in entries):
            return status
        assert status["status"] in ("uploaded", "validating", "ready"), status
        assert all(e.get("status") != "failed" for e in entries), status
        assert time.monotonic() < deadline, f"not staged{' and pinned' * pinned} on both workers: {status}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def deployed(platform, tmp_path_factory) -> dict:
    """Uploaded over REST by the tenant's key, validated and staged on both workers, then made
    always-warm (pinned on both); returns the version as the REST API shows it."""
    directory = write_peft(tmp_path_factory.mktemp("upload") / ADAPTER, SMOLLM2_135M, rank=4,
                           config=peft_config(r=4, base_model_name_or_path=SMOLLM2_135M.name))
    with platform.api() as api:
        r = api.post(f"/api/v1/tenants/{SLUG}/adapters/", json={"name": ADAPTER})
        assert r.status_code == 201, r.text
        r = api.post(f"/api/v1/tenants/{SLUG}/adapters/{ADAPTER}/versions/",
                     files={"files": (f"{ADAPTER}.zip", zip_dir(directory), "application/zip")})
        assert r.status_code == 202, r.text
        platform.version = r.json()
        _wait_for_staging(platform, pinned=False)
        r = api.put(f"/api/v1/tenants/{SLUG}/adapters/{ADAPTER}/deployment/", json={"always_warm": True})
        assert r.status_code == 200 and r.json()["always_warm"] is True, r.text
        _wait_for_staging(platform, pinned=True)
        r = api.get(f"/api/v1/tenants/{SLUG}/adapters/{ADAPTER}/versions/{platform.version['number']}/")
        assert r.status_code == 200, r.text
        platform.version = r.json()
    return platform.version


def _worker_name(version: dict) -> str:
    return f"lora-{uuid.UUID(version['uid']).hex}"  # AdapterVersion.worker_name


def _listed(worker_url: str, name: str) -> dict | None:
    """The worker's own account of the adapter (GET /v1/adapters, admin token), or None."""
    try:
        r = httpx.get(f"{worker_url}/v1/adapters", headers=ADMIN, timeout=10)
    except httpx.TransportError:
        return None
    if r.status_code != 200:
        return None
    return next((a for a in r.json()["data"] if a["name"] == name), None)


def _fetched_by(platform: Platform, worker_url: str, version: dict) -> None:
    """The worker holds both files in its own cache, with the sha256 the portal recorded: it
    downloaded them itself (the caches are separate directories)."""
    cached = platform.cache_dirs[worker_url] / _worker_name(version)
    assert sorted(p.name for p in cached.iterdir()) == sorted(version["file_sha256"]), worker_url
    for name, sha256 in version["file_sha256"].items():
        assert hashlib.sha256((cached / name).read_bytes()).hexdigest() == sha256, (worker_url, name)


def _fetch_lines(worker: ServerProcess, platform: Platform, version: dict) -> int:
    """The worker's own log lines for downloading the version's weights from the web process
    (its HTTP client logs each request)."""
    url = f"{platform.web.url}/internal/adapters/{version['uid']}/adapter_model.safetensors"
    return worker.log.count(f'GET {url} "HTTP/1.1 200 OK"')


def _fetches(platform: Platform, version: dict) -> int:
    """Downloads of the version's weights the web process served (its access log). The workers'
    requests all come from 127.0.0.1 (the kernel's source address on loopback), so the count,
    not the client address, tells how many fetches there were."""
    line = f'"GET /internal/adapters/{version["uid"]}/adapter_model.safetensors HTTP/1.1" 200'
    return platform.web.log.count(line)


def _complete(client: openai.OpenAI) -> str:
    """One completion through the gateway (no retries): must be a 200; returns the worker URL
    the ledger says served it."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert raw.status_code == 200
    completion = raw.parse()
    assert completion.model == MODEL and completion.choices[0].text is not None
    row = wait_for_row(raw.headers["x-request-id"])
    assert row.status_code == 200 and row.error == "", (row.status_code, row.error)
    return row.worker_url


def _kill(worker: ServerProcess) -> None:
    worker.proc.kill()  # SIGKILL: no drain, its connections just drop
    worker.proc.wait(15)


def _poll_just_ran(within: float = POLL_SECONDS / 3) -> None:
    """Returns once beat's fleet poll ran less than `within` seconds ago (waiting for the next
    one if need be): the next is then several seconds away."""
    from django.utils import timezone

    from portal.fleet.models import InferenceWorker

    def last_poll():
        return InferenceWorker.objects.order_by("-last_polled_at").values_list("last_polled_at", flat=True).first()

    def fresh() -> bool:
        polled = last_poll()
        return polled is not None and (timezone.now() - polled).total_seconds() < within

    wait_until(fresh, timeout=2 * POLL_SECONDS, interval=0.2)


def _first_in_line(name: str) -> str:
    """The worker the gateway tries first for _complete's request now (the same rows, the same
    code: the adapter, and the prompt's start under the tenant's cache salt)."""
    from portal.fleet.selectors import route_candidates
    from portal.gateway.relay import prompt_prefix_key, tenant_cache_salt
    from portal.tenants.models import Tenant
    from protocol.worker_api import CACHE_SALT

    salt = tenant_cache_salt(Tenant.objects.get(slug=SLUG))
    prefix = prompt_prefix_key({"prompt": PROMPT, CACHE_SALT: salt})
    return route_candidates(lora_name=name, prefix_key=prefix)[0].url


def test_an_upload_is_staged_on_both_workers_each_fetching_it_itself(platform, deployed):
    name = _worker_name(deployed)
    assert deployed["status"] == "ready" and deployed["created_by"] == "maya"
    # Staged twice on each (uploaded, then made always-warm): fetched once by each worker, the
    # second load found the files in its cache.
    assert _fetches(platform, deployed) == 2
    for url, worker in platform.workers.items():
        entry = deployed["staging"][url]
        assert entry["status"] == "staged" and entry["pinned"] is True and entry["error"] == "", entry
        listed = _listed(url, name)
        assert listed is not None and listed["pinned"] is True, (url, listed)
        assert Path(listed["path"]).parent == platform.cache_dirs[url], listed  # its own cache
        _fetched_by(platform, url, deployed)
        assert _fetch_lines(worker, platform, deployed) == 1, worker.log[-3000:]
        assert '"POST /v1/load_lora_adapter HTTP/1.1" 200' in worker.log  # asked by the Celery worker
        # Each serves it itself, by its worker-side name.
        r = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text


def test_the_gateway_serves_it_and_moves_on_when_its_worker_is_killed(platform, deployed):
    from portal.fleet.models import InferenceWorker

    name = _worker_name(deployed)
    client = platform.sdk()
    assert {_complete(client) for _ in range(2)} <= platform.workers.keys()  # either may serve it

    # Kill the worker the gateway would try first, just after a poll: until the next one its
    # row still says healthy, so the gateway picks it, is refused before any byte, and goes on.
    _poll_just_ran()
    victim = _first_in_line(name)
    (survivor,) = platform.workers.keys() - {victim}
    _kill(platform.workers[victim])
    assert _complete(client) == survivor
    assert InferenceWorker.objects.get(url=victim).healthy, "a poll came first: the gateway was not tested"
    assert _complete(client) == survivor


def test_a_restarted_worker_gets_its_deployed_adapters_back_unasked(platform, deployed):

    name = _worker_name(deployed)
    dead = [url for url, w in platform.workers.items() if w.proc.poll() is not None]
    if not dead:  # this test alone
        dead = [next(iter(platform.workers))]
        _kill(platform.workers[dead[0]])
    (url,) = dead
    (other,) = platform.workers.keys() - {url}
    shutil.rmtree(platform.cache_dirs[url], ignore_errors=True)  # a replacement host: nothing on its disk
    fetched_before = _fetches(platform, deployed)
    platform.workers[url] = platform.workers[url].restart()  # same address and port
    assert _listed(url, name) is None  # it starts knowing no adapter

    # No call from here on asks the portal for anything: beat's fleet poll notices the worker
    # came up, and the platform stages what is deployed there again (pinned: always-warm).
    try:
        listed = wait_until(lambda: (found := _listed(url, name)) and found["pinned"] and found,
                            timeout=RESTAGE_SECONDS, interval=0.5)
    except AssertionError:
        pytest.fail(f"{RESTAGE_SECONDS} s after the restarted worker {url} was ready it still lacks "
                    f"{MODEL} ({name}), deployed and always-warm; staging: {_version_status(platform)['staging']}; "
                    f"its adapters: {httpx.get(f'{url}/v1/adapters', headers=ADMIN).json()['data']}")
    assert Path(listed["path"]).parent == platform.cache_dirs[url]
    _fetched_by(platform, url, deployed)  # fetched from the web process again, by itself
    assert _fetches(platform, deployed) == fetched_before + 1
    assert _fetch_lines(platform.workers[url], platform, deployed) == 2  # its log goes on after the crash

    # Served by it through the gateway: with the other worker gone too, it is the only one left
    # (while both run, routing prefers the other's copy, already on its device).
    _kill(platform.workers[other])
    assert _complete(platform.sdk()) == url
