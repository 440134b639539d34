"""The web process's configuration: one frozen dataclass read from the environment.

Every setting has a safe default so the portal runs with nothing but Python (SQLite,
in-memory channel layer, Celery tasks in-process). Bad values raise ConfigError naming the
variable; the entry points (manage.py, portal/asgi.py, portal/celery.py) turn it into one
line on stderr and exit status 2 via `load_config_or_exit`.

This module imports nothing from Django so it can run before settings exist.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import dj_database_url

REPO_ROOT = Path(__file__).resolve().parent.parent

# Visibly insecure on purpose: production refuses to start with it.
DEVELOPMENT_SECRET_KEY = "dev-insecure-secret-key-DO-NOT-USE-IN-PRODUCTION"

ENVIRONMENTS = ("development", "production")
DATABASE_SCHEMES = ("postgres", "postgresql", "sqlite")
REDIS_SCHEMES = ("redis", "rediss", "unix")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

DEFAULT_DATABASE_PATH = REPO_ROOT / "var" / "db.sqlite3"
DEFAULT_STORAGE_ROOT = REPO_ROOT / "var" / "storage"
DEFAULT_STATIC_ROOT = REPO_ROOT / "var" / "staticfiles"
DEFAULT_INFERENCE_URLS = ("http://127.0.0.1:8001",)
DEFAULT_DEV_ALLOWED_HOSTS = ("localhost", "127.0.0.1", "[::1]")
DEFAULT_MAX_UPLOAD_BYTES = 512 * 1024 * 1024  # LoRA adapters at high rank reach hundreds of MB


class ConfigError(ValueError):
    """A setting read from the environment is missing or malformed."""

    def __init__(self, variable: str, message: str):
        super().__init__(f"{variable}: {message}")
        self.variable = variable
        self.message = message


# The web process's pool: connections are held only for each database step of a request (the
# gateway closes them around every step), so this bounds concurrent steps, not streams.
WEB_DATABASE_POOL_SIZE = 32
_web_process = False


def mark_web_process() -> None:
    """Called by portal.asgi before settings load: DATABASE_POOL_SIZE then defaults to
    WEB_DATABASE_POOL_SIZE. Celery's forked workers and manage.py commands keep no pool."""
    global _web_process
    _web_process = True


@dataclass(frozen=True)
class WebConfig:
    environment: str  # "development" | "production"
    debug: bool
    secret_key: str
    allowed_hosts: tuple[str, ...]
    csrf_trusted_origins: tuple[str, ...]
    database_url: str
    # PostgreSQL connection pool (psycopg_pool, up to this many connections); 0: none. The web
    # process (portal.asgi) turns it on; Celery's forked workers and commands leave it off.
    database_pool_size: int
    redis_url: str | None  # None: in-memory channel layer, eager Celery, local-memory cache
    inference_urls: tuple[str, ...]
    inference_admin_token: str | None
    storage_root: Path
    static_root: Path
    log_level: str
    max_upload_bytes: int

    @property
    def is_production(self) -> bool:
        return self.environment == "production"

    @property
    def database_backend(self) -> str:
        """'postgresql' or 'sqlite', as reported by /healthz."""
        return "sqlite" if self.database_url.startswith("sqlite:") else "postgresql"

    def django_database(self) -> dict[str, Any]:
        """The DATABASES['default'] entry for Django."""
        database = dj_database_url.parse(self.database_url, conn_health_checks=True)
        if database["ENGINE"] == "django.db.backends.sqlite3":
            database["NAME"] = str(_under_repo_root(database["NAME"]))
        elif self.database_pool_size:
            # Under ASGI each request's sync code runs on a fresh thread: without a pool every
            # request opened a new connection (several ms of the gateway's added latency).
            database.setdefault("OPTIONS", {})["pool"] = {
                "min_size": min(2, self.database_pool_size), "max_size": self.database_pool_size, "timeout": 10}
        return database

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> WebConfig:
        env = {key: value for key, value in environ.items() if value != ""}
        environment = _parse_environment(env)
        production = environment == "production"

        debug = _parse_bool("DEBUG", env.get("DEBUG"), default=not production)
        secret_key = env.get("SECRET_KEY", DEVELOPMENT_SECRET_KEY)
        if production and debug:
            raise ConfigError("DEBUG", "must be off in production (set DEBUG=false)")
        if production and secret_key == DEVELOPMENT_SECRET_KEY:
            raise ConfigError(
                "SECRET_KEY",
                "the development secret key cannot be used in production; set a long random value",
            )

        allowed_hosts = _parse_list(env.get("ALLOWED_HOSTS"))
        if not allowed_hosts:
            if production:
                raise ConfigError(
                    "ALLOWED_HOSTS", "required in production (comma-separated host names)"
                )
            allowed_hosts = DEFAULT_DEV_ALLOWED_HOSTS

        return cls(
            environment=environment,
            debug=debug,
            secret_key=secret_key,
            allowed_hosts=allowed_hosts,
            csrf_trusted_origins=tuple(
                _parse_http_url("CSRF_TRUSTED_ORIGINS", origin)
                for origin in _parse_list(env.get("CSRF_TRUSTED_ORIGINS"))
            ),
            database_url=_parse_database_url(env.get("DATABASE_URL")),
            database_pool_size=_parse_non_negative_int(
                "DATABASE_POOL_SIZE", env.get("DATABASE_POOL_SIZE"), default=WEB_DATABASE_POOL_SIZE if _web_process else 0),
            redis_url=_parse_redis_url(env.get("REDIS_URL")),
            inference_urls=_parse_inference_urls(env.get("INFERENCE_URLS")),
            inference_admin_token=env.get("INFERENCE_ADMIN_TOKEN"),
            storage_root=_under_repo_root(env.get("STORAGE_ROOT", str(DEFAULT_STORAGE_ROOT))),
            static_root=_under_repo_root(env.get("STATIC_ROOT", str(DEFAULT_STATIC_ROOT))),
            log_level=_parse_log_level(env.get("LOG_LEVEL")),
            max_upload_bytes=_parse_positive_int(
                "MAX_UPLOAD_BYTES", env.get("MAX_UPLOAD_BYTES"), default=DEFAULT_MAX_UPLOAD_BYTES
            ),
        )


def load_config_or_exit(environ: Mapping[str, str]) -> WebConfig:
    """For entry points: a bad setting becomes one line on stderr and exit status 2."""
    try:
        return WebConfig.from_env(environ)
    except ConfigError as error:
        exit_with_config_error(error)


def exit_with_config_error(error: ConfigError) -> NoReturn:
    print(f"config error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _under_repo_root(path: str) -> Path:
    """Relative paths are taken from the repository root, not the current directory."""
    resolved = Path(path).expanduser()
    return resolved if resolved.is_absolute() else REPO_ROOT / resolved


def _parse_environment(env: Mapping[str, str]) -> str:
    portal_env = env.get("PORTAL_ENV")
    django_env = env.get("DJANGO_ENV")
    if portal_env and django_env and portal_env.lower() != django_env.lower():
        raise ConfigError("PORTAL_ENV", f"{portal_env!r} disagrees with DJANGO_ENV={django_env!r}")
    variable = "PORTAL_ENV" if portal_env else "DJANGO_ENV"
    value = (portal_env or django_env or "development").lower()
    if value not in ENVIRONMENTS:
        raise ConfigError(
            variable, f"unknown environment {value!r} (use development or production)"
        )
    return value


def _parse_bool(variable: str, value: str | None, *, default: bool) -> bool:
    if value is None:
        return default
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(variable, f"not a boolean: {value!r} (use 1/0, true/false, yes/no or on/off)")


def _parse_int(variable: str, value: str | None, *, default: int, minimum: int) -> int:
    if value is None:
        return default
    try:
        number = int(value.strip().replace("_", ""))
    except ValueError:
        raise ConfigError(variable, f"not an integer: {value!r}") from None
    if number < minimum:
        raise ConfigError(variable, f"must be {'positive' if minimum == 1 else f'>= {minimum}'}, got {number}")
    return number


def _parse_positive_int(variable: str, value: str | None, *, default: int) -> int:
    return _parse_int(variable, value, default=default, minimum=1)


def _parse_non_negative_int(variable: str, value: str | None, *, default: int) -> int:
    return _parse_int(variable, value, default=default, minimum=0)


def _parse_list(value: str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return tuple(item.strip() for item in value.split(",") if item.strip())


def _parse_log_level(value: str | None) -> str:
    level = (value or "INFO").strip().upper()
    if level not in LOG_LEVELS:
        raise ConfigError(
            "LOG_LEVEL", f"unknown level {value!r} (use one of {', '.join(LOG_LEVELS)})"
        )
    return level


def _parse_http_url(variable: str, value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(variable, f"not an http(s) URL: {value!r}")
    try:
        parts.port  # noqa: B018 -- raises ValueError on a non-numeric port
    except ValueError:
        raise ConfigError(variable, f"bad port in {value!r}") from None
    return value.rstrip("/")


def _parse_inference_urls(value: str | None) -> tuple[str, ...]:
    if value is None:
        return DEFAULT_INFERENCE_URLS
    urls = tuple(_parse_http_url("INFERENCE_URLS", item) for item in _parse_list(value))
    if not urls:
        raise ConfigError("INFERENCE_URLS", "no URL given (comma-separated http(s) URLs)")
    if len(set(urls)) != len(urls):
        raise ConfigError("INFERENCE_URLS", f"lists a worker twice: {value!r}")
    return urls


def _parse_database_url(value: str | None) -> str:
    if value is None:
        return f"sqlite:///{DEFAULT_DATABASE_PATH}"
    scheme = value.split("://", 1)[0] if "://" in value else ""
    if scheme not in DATABASE_SCHEMES:
        shown = scheme or value
        raise ConfigError(
            "DATABASE_URL",
            f"unsupported scheme {shown!r} (use postgres://, postgresql:// or sqlite:///PATH)",
        )
    try:
        database = dj_database_url.parse(value)
    except ValueError as error:
        raise ConfigError("DATABASE_URL", f"cannot parse: {error}") from None
    if scheme == "sqlite" and database["NAME"] in ("", ":memory:"):
        raise ConfigError("DATABASE_URL", "sqlite needs a file path, e.g. sqlite:///var/db.sqlite3")
    if scheme != "sqlite" and not database["NAME"]:
        raise ConfigError("DATABASE_URL", "no database name (postgres://USER@HOST:PORT/NAME)")
    return value


def _parse_redis_url(value: str | None) -> str | None:
    if value is None:
        return None
    parts = urlsplit(value)
    if parts.scheme not in REDIS_SCHEMES:
        raise ConfigError(
            "REDIS_URL",
            f"unsupported scheme {parts.scheme or value!r} (use redis://HOST:PORT/DB, rediss:// or unix://)",
        )
    if parts.scheme == "unix":
        if not parts.path:
            raise ConfigError("REDIS_URL", "unix:// needs a socket path")
        return value
    if not parts.hostname:
        raise ConfigError("REDIS_URL", f"no host in {value!r}")
    try:
        parts.port  # noqa: B018 -- raises ValueError on a non-numeric port
    except ValueError:
        raise ConfigError("REDIS_URL", f"bad port in {value!r}") from None
    database = parts.path.lstrip("/")
    if database and not database.isdigit():
        raise ConfigError("REDIS_URL", f"database must be a number, got {database!r}")
    return value
