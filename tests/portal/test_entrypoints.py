"""The real entry points in fresh processes: settings mapped both ways, bad values stop start-up cleanly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from portal.config import VARIABLES as CONFIG_VARIABLES
from tests.web_process import PRODUCTION

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

PRINT_SETTINGS = """
import json
from django.conf import settings
from portal.celery import app
print(json.dumps({
    "engine": settings.DATABASES["default"]["ENGINE"],
    "channel_layer": settings.CHANNEL_LAYERS["default"]["BACKEND"],
    "channel_hosts": settings.CHANNEL_LAYERS["default"].get("CONFIG", {}).get("hosts"),
    "cache": settings.CACHES["default"]["BACKEND"],
    "celery_eager": app.conf.task_always_eager,
    "celery_broker": app.conf.broker_url,
}))
"""


def run(args: list[str], **environ: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in CONFIG_VARIABLES}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env.update(environ)
    return subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)


def settings_in_fresh_process(**environ: str) -> dict:
    result = run(
        [sys.executable, "-c", PRINT_SETTINGS], DJANGO_SETTINGS_MODULE="portal.settings", **environ
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_settings_without_services_embed_everything():
    assert settings_in_fresh_process() == {
        "engine": "django.db.backends.sqlite3",
        "channel_layer": "channels.layers.InMemoryChannelLayer",
        "channel_hosts": None,
        "cache": "django.core.cache.backends.locmem.LocMemCache",
        "celery_eager": True,
        "celery_broker": "memory://localhost/",
    }


def test_settings_with_services_use_postgres_and_redis():
    redis_url = "redis://127.0.0.1:6379/15"

    assert settings_in_fresh_process(
        DATABASE_URL="postgres://postgres@127.0.0.1:5432/loraplex", REDIS_URL=redis_url
    ) == {
        "engine": "django.db.backends.postgresql",
        "channel_layer": "channels_redis.core.RedisChannelLayer",
        "channel_hosts": [{"address": redis_url, "socket_timeout": 30}],
        "cache": "django.core.cache.backends.redis.RedisCache",
        "celery_eager": False,
        "celery_broker": redis_url,
    }


def test_manage_py_with_bad_database_url_prints_one_line_and_exits_2():
    result = run([sys.executable, "manage.py", "check"], DATABASE_URL="mysqlx://x")

    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "config error: DATABASE_URL: unsupported scheme 'mysqlx' "
        "(use postgres://, postgresql:// or sqlite:///PATH)"
    ]
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("command", "variable", "value"),
    [
        (
            [str(BIN / "uvicorn"), "portal.asgi:application", "--port", "0"],
            "REDIS_URL",
            "http://127.0.0.1:6379",
        ),
        (
            [str(BIN / "celery"), "-A", "portal.celery:app", "worker", "--pool=solo"],
            "DEBUG",
            "maybe",
        ),
        ([sys.executable, "-c", "import portal.wsgi"], "LOG_LEVEL", "LOUD"),
    ],
    ids=["asgi-under-uvicorn", "celery-worker", "wsgi"],
)
def test_other_entry_points_stop_on_a_bad_setting(command, variable, value):
    result = run(command, **{variable: value})

    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"config error: {variable}: ")
    assert "Traceback" not in result.stdout + result.stderr


def test_production_with_debug_on_refuses_to_start():
    result = run([sys.executable, "manage.py", "check"], **PRODUCTION, DEBUG="1")

    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "config error: DEBUG: must be off in production (set DEBUG=false)"
    ]


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("SECRET_KEY", "weak-secret", "too weak for production (needs at least 50 characters, 5 of them different)"),
        ("ALLOWED_HOSTS", "*", "'*' is a wildcard, refused in production"),
        ("INFERENCE_ADMIN_TOKEN", "", "required in production"),
        ("INFERENCE_ADMIN_TOKEN", "short-token", "too short for production (11 characters, needs at least 32)"),
    ],
    ids=["short-secret", "wildcard-host", "no-admin-token", "short-admin-token"],
)
def test_production_refuses_weak_settings_with_one_line_and_exit_2(variable, value, message):
    result = run([sys.executable, "manage.py", "check"], **{**PRODUCTION, variable: value})

    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"config error: {variable}: {message}")
    if variable != "ALLOWED_HOSTS":
        assert not value or value not in line  # a secret, even a bad one, is never echoed


PRINT_SECURITY = """
import json
from django.conf import settings
print(json.dumps({name: getattr(settings, name, None) for name in (
    "SECURE_SSL_REDIRECT", "SECURE_REDIRECT_EXEMPT", "SECURE_HSTS_SECONDS", "SECURE_HSTS_INCLUDE_SUBDOMAINS",
    "SECURE_HSTS_PRELOAD", "SECURE_PROXY_SSL_HEADER", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE",
    "PORTAL_INTERNAL_URL")}))
"""


def test_https_settings_are_on_in_production_only():
    def security(**environ: str) -> dict:
        result = run([sys.executable, "-c", PRINT_SECURITY], DJANGO_SETTINGS_MODULE="portal.settings", **environ)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    assert security(**PRODUCTION) == {
        "SECURE_SSL_REDIRECT": True,
        "SECURE_REDIRECT_EXEMPT": ["^healthz$", "^internal/"],
        "SECURE_HSTS_SECONDS": 31536000,
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
        "SECURE_HSTS_PRELOAD": True,
        "SECURE_PROXY_SSL_HEADER": ["HTTP_X_FORWARDED_PROTO", "https"],
        "SESSION_COOKIE_SECURE": True,
        "CSRF_COOKIE_SECURE": True,
        "PORTAL_INTERNAL_URL": "http://web:8000",
    }
    assert security() == {
        "SECURE_SSL_REDIRECT": False,
        "SECURE_REDIRECT_EXEMPT": ["^healthz$", "^internal/"],
        "SECURE_HSTS_SECONDS": 0,
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": False,
        "SECURE_HSTS_PRELOAD": False,
        "SECURE_PROXY_SSL_HEADER": None,
        "SESSION_COOKIE_SECURE": False,
        "CSRF_COOKIE_SECURE": False,
        "PORTAL_INTERNAL_URL": "http://127.0.0.1:8000",
    }
