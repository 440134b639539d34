"""Test helper: the web process as it is deployed — `uvicorn portal.asgi:application` in its own
process with production settings — on a loopback address of its own. Import as `tests.web_process`.

    env = production_env(database_url=test_database_url(), redis_url=..., static_root=tmp / "static",
                         storage_root=tmp / "storage", inference_urls=[worker.url], admin_token=TOKEN)
    collect_static(env)                      # production pages need the static manifest
    web = start_web(env, log_path=tmp / "web.log")
    with forwarded_https_client(web) as client:   # as the TLS proxy in front would speak to it
        client.get("/login/")
    web.stop()

Production redirects plain-HTTP page requests to https:// unless they carry
`X-Forwarded-Proto: https` (the proxy's header); /healthz, /internal/ and /v1/ are not redirected.
The web process sees only committed rows: tests that write rows for it use `transactional_db`, and
the module or session that started it stops it before the test database is dropped.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx

from portal.config import VARIABLES

ROOT = Path(__file__).resolve().parents[1]
# Other variables of the platform's processes a caller's shell may carry into the child.
OTHER_PLATFORM_VARIABLES = ("DJANGO_SETTINGS_MODULE", "DEMO_ADMIN_PASSWORD", "WEB_HOST", "WEB_PORT", "MODELS_DIR")
STOP_TIMEOUT_S = 15
# The smallest environment production settings accept (config tests start from it).
PRODUCTION = {
    "PORTAL_ENV": "production",
    "SECRET_KEY": "Kq8-vW2p_Lr5zN0xYc3mT7hJ4sB9dF6gA1eR-uI8oP2wQ5tZ7nM",
    "ALLOWED_HOSTS": "portal.example.com",
    "INFERENCE_ADMIN_TOKEN": "fleet-token-" + "7Yh2Kx9q" * 3,
    "PORTAL_INTERNAL_URL": "http://web:8000",
}


@dataclass
class WebProcess:
    url: str  # e.g. "http://127.0.0.2:41234"
    proc: subprocess.Popen
    log_path: Path
    env: dict

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM (uvicorn finishes what is in flight), then SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def production_env(
    *,
    database_url: str,
    redis_url: str,
    static_root: Path | str,
    storage_root: Path | str,
    inference_urls: Iterable[str],
    admin_token: str,
    allowed_hosts: Iterable[str] = ("127.0.0.2",),
    **extra: str,
) -> dict[str, str]:
    """A whole environment for a production web (or Celery, or manage.py) process: this process's
    environment without any of the platform's own variables, then production settings that pass
    every start-up check (a fresh strong SECRET_KEY, DEBUG off, HTTPS settings at their defaults).
    PORTAL_INTERNAL_URL is left to `start_web` (the process's own URL) unless `extra` names it;
    `extra` sets or overrides anything else (e.g. DATABASE_POOL_SIZE="0")."""
    env = {
        key: value for key, value in os.environ.items()
        if key not in VARIABLES and key not in OTHER_PLATFORM_VARIABLES and not key.startswith("INFERENCE_")
    }
    env.update(
        DJANGO_SETTINGS_MODULE="portal.settings",
        PORTAL_ENV="production",
        DEBUG="false",
        SECRET_KEY=secrets.token_urlsafe(50),
        ALLOWED_HOSTS=",".join(allowed_hosts),
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        STATIC_ROOT=str(static_root),
        STORAGE_ROOT=str(storage_root),
        INFERENCE_URLS=",".join(inference_urls),
        INFERENCE_ADMIN_TOKEN=admin_token,
        LOG_LEVEL="WARNING",
    )
    env.update(extra)
    return env


def collect_static(env: dict[str, str]) -> None:
    """`manage.py collectstatic --noinput` with that environment (production: hashed names and
    the manifest); fails with its output."""
    env = {"PORTAL_INTERNAL_URL": "http://127.0.0.1:8000", **env}  # collectstatic never uses it
    result = subprocess.run([sys.executable, "manage.py", "collectstatic", "--noinput", "--verbosity", "0"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"collectstatic exited with {result.returncode}:\n{result.stdout}{result.stderr}")


def start_web(env: dict[str, str], *, host: str = "127.0.0.2", log_path: Path, timeout: float = 60,
              healthy: bool = True) -> WebProcess:
    """Start `python -m uvicorn portal.asgi:application` on a free port of `host` (cwd: the
    repository root) and wait until GET /healthz answers 200 — or, with healthy=False, answers
    at all (to test an unhealthy process). Fails with the process's log otherwise."""
    port = free_port(host)
    url = f"http://{host}:{port}"
    env = {"PORTAL_INTERNAL_URL": url, **env}
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "portal.asgi:application", "--host", host, "--port", str(port)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    log.close()  # the child holds its own descriptor
    web = WebProcess(url=url, proc=proc, log_path=log_path, env=env)
    deadline = time.monotonic() + timeout
    status = None
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the web process exited with {proc.returncode}:\n{web.log}")
            try:
                status = client.get(f"{url}/healthz").status_code
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            if status == 200 or not healthy:
                return web
            time.sleep(0.2)
    web.stop()
    raise RuntimeError(f"/healthz of the web process not 200 in {timeout}s (last: {status}):\n{web.log}")


def forwarded_https_client(web: WebProcess, **kwargs) -> httpx.Client:
    """An httpx client speaking to the web process as the TLS proxy does: plain HTTP with
    `X-Forwarded-Proto: https`, sending back the `Secure` cookies (session, CSRF) the process
    sets, which a cookie jar otherwise keeps for https:// URLs only."""
    headers = {"x-forwarded-proto": "https", **kwargs.pop("headers", {})}
    client = httpx.Client(base_url=web.url, headers=headers, **kwargs)

    def keep_secure_cookies_on_this_hop(response: httpx.Response) -> None:
        # Runs after the client stored the response's cookies; the connection they were meant
        # for is the proxy's HTTPS one, this hop stands in for it.
        for cookie in client.cookies.jar:
            cookie.secure = False

    client.event_hooks["response"].append(keep_secure_cookies_on_this_hop)
    return client


def test_database_url() -> str:
    """The postgres:// URL of the test database pytest-django has set up (its settings after
    django_db_setup), for a web subprocess to read and write the rows the tests commit."""
    from django.conf import settings

    database = settings.DATABASES["default"]
    if database["ENGINE"] != "django.db.backends.postgresql":
        raise RuntimeError(f"a web subprocess needs the PostgreSQL test database, not {database['ENGINE']}")
    user = quote(database.get("USER") or "", safe="")
    password = quote(database.get("PASSWORD") or "", safe="")
    credentials = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = quote(database.get("HOST") or "", safe="")  # a socket directory is percent-encoded
    port = f":{database['PORT']}" if database.get("PORT") else ""
    options = {k: v for k, v in (database.get("OPTIONS") or {}).items() if isinstance(v, str)}  # e.g. sslmode
    query = "?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in options.items()) if options else ""
    return f"postgres://{credentials}{host}{port}/{quote(database['NAME'], safe='')}{query}"


test_database_url.__test__ = False  # a helper, not a test, though pytest would collect its name


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

