"""`make run`: prepare a development install and start every process of the platform.

Steps: fetch the default model (offline from any model hub), migrate, collect static
files, create the demo staff user / tenant / API key, then run the processes under
honcho (one coloured log stream, Ctrl-C stops them all).

With REDIS_URL unset everything runs on embedded defaults (SQLite, in-memory channel
layer, Celery tasks in-process, periodic tasks from `manage.py run_schedule`), so nothing but
Python is needed; with REDIS_URL set a Celery worker (with its beat scheduler) runs as its own
process.

The processes share one fleet secret, INFERENCE_ADMIN_TOKEN: the portal hands it to the
inference worker with each adapter to load and the worker presents it to download the adapter's
files from the portal's /internal/ endpoint, which serves nothing without it. When it is not set
a random one is made for this run (never printed). The worker fetches adapters only from this
portal's origin (INFERENCE_PORTAL_ORIGINS), the address the portal tells it (PORTAL_INTERNAL_URL).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from honcho.manager import Manager

from portal.config import DEFAULT_DEV_ALLOWED_HOSTS

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
WEB_HOST = os.environ.get("WEB_HOST", "127.0.0.1")
WEB_PORT = os.environ.get("WEB_PORT", "8000")
# The inference worker: the web side finds it through INFERENCE_URLS (default http://127.0.0.1:8001).
# INFERENCE_WORKERS=N starts N of them on consecutive ports from 8001 (a fleet on one box: adapter
# affinity, spill-over, a worker stopped while the others serve); each loads its own copy of the model.
INFERENCE_HOST = "127.0.0.1"
INFERENCE_PORT = "8001"
MAX_LOCAL_WORKERS = 8
# Bound to every interface, the web process is still reached by the local worker on loopback.
ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}


def local_environment(environ: dict[str, str], *, web_host: str = WEB_HOST, web_port: str = WEB_PORT) -> dict[str, str]:
    """The environment every step and process of this run gets: `environ` plus the fleet secret
    (a fresh random one when unset), where the worker reaches the portal (PORTAL_INTERNAL_URL),
    the origin it may fetch adapters from (INFERENCE_PORTAL_ORIGINS) and the switch that lets the
    portal stage adapters on it at run time (INFERENCE_ALLOW_RUNTIME_LORA_UPDATING, off in a bare
    worker as in vLLM). Values already set win."""
    env = dict(environ)
    env.setdefault("INFERENCE_ALLOW_RUNTIME_LORA_UPDATING", "true")
    if not env.get("INFERENCE_ADMIN_TOKEN"):
        env["INFERENCE_ADMIN_TOKEN"] = secrets.token_urlsafe(32)
    if not env.get("PORTAL_INTERNAL_URL"):
        host = ANY_ADDRESS.get(web_host, web_host)
        if ":" in host and not host.startswith("["):  # a bare IPv6 address
            host = f"[{host}]"
        env["PORTAL_INTERNAL_URL"] = f"http://{host}:{web_port}"
    if not env.get("INFERENCE_PORTAL_ORIGINS"):
        env["INFERENCE_PORTAL_ORIGINS"] = origin_of(env["PORTAL_INTERNAL_URL"])
    if not env.get("ALLOWED_HOSTS"):
        # The web process answers only the host names it knows; in development those are the
        # localhost names, so a WEB_HOST such as 127.0.0.9 (which the worker then fetches adapters
        # from, and the browser opens) is added, or every request to it is a 400.
        names = [_host_name(urlsplit(env["PORTAL_INTERNAL_URL"]).hostname or "")]
        if web_host not in ANY_ADDRESS:
            names.append(_host_name(web_host))
        extra = [name for name in names if name and name not in DEFAULT_DEV_ALLOWED_HOSTS]
        if extra:
            env["ALLOWED_HOSTS"] = ",".join(dict.fromkeys((*DEFAULT_DEV_ALLOWED_HOSTS, *extra)))
    ports = worker_ports(env)
    if len(ports) > 1 and not env.get("INFERENCE_URLS") and not env.get("INFERENCE_DISCOVERY"):
        env["INFERENCE_URLS"] = ",".join(f"http://{INFERENCE_HOST}:{port}" for port in ports)
    return env


def _host_name(host: str) -> str:
    """A host as ALLOWED_HOSTS writes it: an IPv6 address in brackets."""
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host


def worker_ports(env: dict[str, str]) -> list[int]:
    """The local workers' ports: INFERENCE_WORKERS (default 1) of them from INFERENCE_PORT."""
    value = env.get("INFERENCE_WORKERS") or "1"
    if not value.isdigit() or not 1 <= int(value) <= MAX_LOCAL_WORKERS:
        print(f"run: INFERENCE_WORKERS: {value!r} is not a number of workers from 1 to {MAX_LOCAL_WORKERS}",
              file=sys.stderr)
        sys.exit(2)
    return [int(INFERENCE_PORT) + i for i in range(int(value))]


def origin_of(url: str) -> str:
    """scheme://host:port of a URL (the worker compares origins, not paths)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    return f"{parts.scheme}://{host}:{port}"


def step(title: str, *cmd: str) -> None:
    print(f"==> {title}", flush=True)
    result = subprocess.run(cmd, cwd=ROOT)
    if result.returncode == 2:  # a configuration error: its one line is already printed
        sys.exit(2)
    if result.returncode != 0:
        print(f"run: '{title}' failed (exit {result.returncode}); nothing was started", file=sys.stderr)
        sys.exit(result.returncode)


def ensure_postgres_database() -> None:
    """Create the PostgreSQL database DATABASE_URL names if the server lacks it (first run)."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres://", "postgresql://")):
        return
    import dj_database_url
    import psycopg
    from psycopg import sql

    db = dj_database_url.parse(url)
    params = {k: v for k, v in (("host", db["HOST"]), ("port", db["PORT"]), ("user", db["USER"]),
                                ("password", db["PASSWORD"])) if v}
    try:
        with psycopg.connect(dbname="postgres", autocommit=True, connect_timeout=5, **params) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db["NAME"],)).fetchone():
                return
            print(f"==> creating PostgreSQL database {db['NAME']!r}", flush=True)
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db["NAME"])))
    except psycopg.Error as exc:
        print(f"run: DATABASE_URL: cannot prepare database {db['NAME']!r}: {exc}".strip(), file=sys.stderr)
        sys.exit(2)


def processes() -> dict[str, str]:
    procs = {"web": f"{PY} -m uvicorn portal.asgi:application --host {WEB_HOST} --port {WEB_PORT}"}
    ports = worker_ports(dict(os.environ))
    for i, port in enumerate(ports, start=1):
        # Engine settings come from INFERENCE_* variables (the model: INFERENCE_MODEL or the fetched default).
        name = "inference" if len(ports) == 1 else f"inference-{i}"
        procs[name] = f"{PY} -m inference serve --host {INFERENCE_HOST} --port {port}"
    if os.environ.get("REDIS_URL"):
        procs["worker"] = f"{PY} -m celery -A portal.celery worker --beat --schedule var/celerybeat-schedule --loglevel INFO --concurrency 2"
    else:
        # No broker, so no beat: the periodic tasks (fleet poll, roll-ups, prewarm) run here.
        procs["schedule"] = f"{PY} manage.py run_schedule"
    return procs


def main() -> int:
    # Every step below and every process inherits it (the token stays out of command lines and output).
    os.environ.update(local_environment(dict(os.environ)))
    step("checking the configuration", PY, "manage.py", "check")
    step("fetching the default model", PY, "-m", "inference.models", "fetch")
    ensure_postgres_database()
    step("applying database migrations", PY, "manage.py", "migrate", "--noinput")
    step("collecting static files", PY, "manage.py", "collectstatic", "--noinput", "--verbosity", "0")
    step("creating the demo user, tenant and API key", PY, "manage.py", "bootstrap_demo")

    base = f"http://{WEB_HOST}:{WEB_PORT}"
    print(
        "\nStarting the platform (Ctrl-C stops every process):\n"
        f"  portal     {base}/\n"
        f"  admin      {base}/admin/   (demo staff user: admin)\n"
        f"  health     {base}/healthz\n"
        + "".join(f"  inference  http://{INFERENCE_HOST}:{port}/v1  (OpenAI API, no auth; /ready once the model is loaded)\n"
                  for port in worker_ports(dict(os.environ))),
        flush=True,
    )
    manager = Manager()
    for name, cmd in processes().items():
        manager.add_process(name, cmd, env=dict(os.environ), cwd=str(ROOT))  # with the fleet token
    manager.loop()
    return manager.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
