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
# A /v1 request body: a 128k-token prompt is ~0.5 MB of text; JSON escaping at most doubles it.
DEFAULT_GATEWAY_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_REDIS_KEY_PREFIX = "loraplex:"
# Seconds a request waits for a pooled connection before it is answered 503 (retry later).
DEFAULT_DATABASE_POOL_TIMEOUT = 10.0
# A request's concurrency slot frees itself after this long, settled or not (a crashed gateway).
DEFAULT_QUOTA_CONCURRENCY_LEASE_SECONDS = 900
# Requests in flight on a worker beyond which routing prefers another (adapter affinity yields).
DEFAULT_FLEET_MAX_LOAD = 64
# c in routing's relative bound: no worker takes new requests once it holds c x the fleet's mean
# load (consistent hashing with bounded loads; portal.fleet.selectors.load_bound).
DEFAULT_FLEET_LOAD_FACTOR = 1.25
# The widest adapter rank uploads are validated against while no worker has said its own.
DEFAULT_ADAPTER_MAX_LORA_RANK = 16
# Entries an uploaded archive may hold (a save_pretrained directory has a handful).
DEFAULT_ADAPTER_MAX_ARCHIVE_FILES = 64
# Staging's first retry after a transient failure; doubles each time (portal.adapters.staging).
DEFAULT_ADAPTER_STAGE_RETRY_SECONDS = 2.0
# Adapters the prewarm task keeps staged on every worker, the most used first.
DEFAULT_ADAPTER_PREWARM_TOP_N = 8
# How the inference workers reach this portal's /internal/ endpoint when nothing says otherwise:
# development only (portal and worker on one host); production must name it.
DEFAULT_DEV_PORTAL_INTERNAL_URL = "http://127.0.0.1:8000"

# What Django's `check --deploy` (security.W009) calls a weak secret key.
SECRET_KEY_MIN_LENGTH = 50
SECRET_KEY_MIN_UNIQUE_CHARACTERS = 5
SECRET_KEY_INSECURE_PREFIX = "django-insecure-"
# The fleet secret guards every tenant's adapter weights (the /internal/ download endpoint).
ADMIN_TOKEN_MIN_LENGTH = 32
# HSTS in production: one year (the minimum the browsers' preload lists accept).
DEFAULT_PRODUCTION_HSTS_SECONDS = 365 * 24 * 60 * 60


# Every variable WebConfig.from_env reads (tests start processes without the caller's values).
VARIABLES = (
    "PORTAL_ENV", "DJANGO_ENV", "DEBUG", "SECRET_KEY", "ALLOWED_HOSTS", "CSRF_TRUSTED_ORIGINS",
    "DATABASE_URL", "DATABASE_POOL_SIZE", "REDIS_URL", "INFERENCE_URLS", "INFERENCE_DISCOVERY", "INFERENCE_ADMIN_TOKEN",
    "INFERENCE_API_KEY",
    "PORTAL_INTERNAL_URL", "STORAGE_ROOT", "STATIC_ROOT", "LOG_LEVEL", "MAX_UPLOAD_BYTES",
    "SECURE_SSL_REDIRECT", "SECURE_HSTS_SECONDS", "SECURE_HSTS_INCLUDE_SUBDOMAINS", "SECURE_HSTS_PRELOAD",
    "GATEWAY_MAX_BODY_BYTES", "REDIS_KEY_PREFIX", "DATABASE_POOL_TIMEOUT",
    "QUOTA_CONCURRENCY_LEASE_SECONDS", "FLEET_MAX_LOAD", "FLEET_LOAD_FACTOR", "ADAPTER_MAX_LORA_RANK", "ADAPTER_MAX_EXTRACTED_BYTES",
    "ADAPTER_MAX_ARCHIVE_FILES", "ADAPTER_STAGE_RETRY_SECONDS", "ADAPTER_PREWARM_TOP_N", "METRICS_TOKEN",
)


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
    # DNS names whose address records are workers, re-resolved on every fleet poll
    # ("dns://inference-headless:8001": a Kubernetes headless Service); see portal.fleet.discovery.
    inference_discovery: tuple[str, ...]
    inference_admin_token: str | None
    # The workers' --api-key (INFERENCE_API_KEY, the same variable the workers read): sent on every
    # call to a worker that is not an admin call (those carry the admin token, which a worker with
    # an API key accepts as well). None: the workers run without one.
    inference_api_key: str | None
    # The bearer token Prometheus presents to GET /metrics (portal.core.metrics_asgi); None: /metrics
    # is open in development and absent (404) in production.
    metrics_token: str | None
    storage_root: Path
    static_root: Path
    log_level: str
    max_upload_bytes: int
    # Where the inference workers fetch adapter files from (this portal's /internal/ endpoint,
    # over the internal network); handed to them in every load request.
    portal_internal_url: str
    # HTTPS (production defaults; the TLS proxy in front sets X-Forwarded-Proto): plain-HTTP
    # requests are redirected except /healthz and /internal/ (probes and workers inside the network).
    secure_ssl_redirect: bool
    hsts_seconds: int
    hsts_include_subdomains: bool
    hsts_preload: bool
    # The largest /v1 request body, checked before it is read (portal.gateway.asgi).
    gateway_max_body_bytes: int
    # Prefix of the platform's own Redis keys (rate-limit counters, the usage spool): deployments
    # sharing one Redis keep theirs apart.
    redis_key_prefix: str
    database_pool_timeout: float  # seconds a step waits for a pooled connection (then a 503)
    quota_concurrency_lease_seconds: int
    fleet_max_load: int
    fleet_load_factor: float  # >= 1
    adapter_max_lora_rank: int
    adapter_max_extracted_bytes: int  # the most an uploaded archive may unpack to
    adapter_max_archive_files: int
    adapter_stage_retry_seconds: float
    adapter_prewarm_top_n: int  # 0: prewarm nothing

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
                "min_size": min(2, self.database_pool_size), "max_size": self.database_pool_size,
                "timeout": self.database_pool_timeout}
        return database

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> WebConfig:
        env = {key: value for key, value in environ.items() if value != ""}
        environment = _parse_environment(env)
        production = environment == "production"
        return cls(
            environment=environment,
            **_identity_settings(env, production),
            **_service_settings(env, production),
            **_https_settings(env, production),
            **_limit_settings(env),
        )


def _identity_settings(env: Mapping[str, str], production: bool) -> dict[str, Any]:
    """Who this portal is and what it trusts: debug, secret, hosts, the fleet token."""
    debug = _parse_bool("DEBUG", env.get("DEBUG"), default=not production)
    if production and debug:
        raise ConfigError("DEBUG", "must be off in production (set DEBUG=false)")
    secret_key = env.get("SECRET_KEY", DEVELOPMENT_SECRET_KEY)
    if production:
        _check_production_secret_key(secret_key)
    allowed_hosts = _parse_list(env.get("ALLOWED_HOSTS"))
    if not allowed_hosts:
        if production:
            raise ConfigError("ALLOWED_HOSTS", "required in production (comma-separated host names)")
        allowed_hosts = DEFAULT_DEV_ALLOWED_HOSTS
    if production:
        _check_production_allowed_hosts(allowed_hosts)
    inference_admin_token = env.get("INFERENCE_ADMIN_TOKEN")
    if production:
        _check_production_admin_token(inference_admin_token)
    metrics_token = env.get("METRICS_TOKEN")
    if production and metrics_token is not None:
        _check_production_metrics_token(metrics_token)
    return dict(
        debug=debug,
        secret_key=secret_key,
        allowed_hosts=allowed_hosts,
        csrf_trusted_origins=tuple(
            _parse_http_url("CSRF_TRUSTED_ORIGINS", origin) for origin in _parse_list(env.get("CSRF_TRUSTED_ORIGINS"))
        ),
        inference_admin_token=inference_admin_token,
        inference_api_key=(env.get("INFERENCE_API_KEY") or "").strip() or None,
        metrics_token=metrics_token,
        log_level=_parse_log_level(env.get("LOG_LEVEL")),
    )


def _service_settings(env: Mapping[str, str], production: bool) -> dict[str, Any]:
    """Where the other processes and stores are: database, Redis, workers, storage."""
    portal_internal_url = env.get("PORTAL_INTERNAL_URL")
    if portal_internal_url is None:
        if production:
            raise ConfigError(
                "PORTAL_INTERNAL_URL",
                "required in production: the URL the inference workers reach this portal at, e.g. http://web:8000",
            )
        portal_internal_url = DEFAULT_DEV_PORTAL_INTERNAL_URL
    discovery = _parse_inference_discovery(env.get("INFERENCE_DISCOVERY"))
    return dict(
        database_url=_parse_database_url(env.get("DATABASE_URL")),
        database_pool_size=_parse_non_negative_int(
            "DATABASE_POOL_SIZE", env.get("DATABASE_POOL_SIZE"), default=WEB_DATABASE_POOL_SIZE if _web_process else 0),
        database_pool_timeout=_parse_positive_float(
            "DATABASE_POOL_TIMEOUT", env.get("DATABASE_POOL_TIMEOUT"), default=DEFAULT_DATABASE_POOL_TIMEOUT),
        redis_url=_parse_redis_url(env.get("REDIS_URL")),
        redis_key_prefix=_parse_key_prefix(env.get("REDIS_KEY_PREFIX")),
        inference_urls=_parse_inference_urls(env.get("INFERENCE_URLS"), discovery=discovery),
        inference_discovery=discovery,
        portal_internal_url=_parse_http_url("PORTAL_INTERNAL_URL", portal_internal_url),
        storage_root=_under_repo_root(env.get("STORAGE_ROOT", str(DEFAULT_STORAGE_ROOT))),
        static_root=_under_repo_root(env.get("STATIC_ROOT", str(DEFAULT_STATIC_ROOT))),
    )


def _https_settings(env: Mapping[str, str], production: bool) -> dict[str, Any]:
    """Redirects and HSTS: on in production (behind the TLS proxy), off in development."""
    return dict(
        secure_ssl_redirect=_parse_bool("SECURE_SSL_REDIRECT", env.get("SECURE_SSL_REDIRECT"), default=production),
        hsts_seconds=_parse_non_negative_int(
            "SECURE_HSTS_SECONDS", env.get("SECURE_HSTS_SECONDS"),
            default=DEFAULT_PRODUCTION_HSTS_SECONDS if production else 0),
        hsts_include_subdomains=_parse_bool(
            "SECURE_HSTS_INCLUDE_SUBDOMAINS", env.get("SECURE_HSTS_INCLUDE_SUBDOMAINS"), default=production),
        hsts_preload=_parse_bool("SECURE_HSTS_PRELOAD", env.get("SECURE_HSTS_PRELOAD"), default=production),
    )


def _limit_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """Sizes, counts and timings of uploads, the gateway, quotas, staging and routing."""
    max_upload_bytes = _parse_positive_int("MAX_UPLOAD_BYTES", env.get("MAX_UPLOAD_BYTES"),
                                           default=DEFAULT_MAX_UPLOAD_BYTES)
    return dict(
        max_upload_bytes=max_upload_bytes,
        gateway_max_body_bytes=_parse_positive_int(
            "GATEWAY_MAX_BODY_BYTES", env.get("GATEWAY_MAX_BODY_BYTES"), default=DEFAULT_GATEWAY_MAX_BODY_BYTES),
        quota_concurrency_lease_seconds=_parse_positive_int(
            "QUOTA_CONCURRENCY_LEASE_SECONDS", env.get("QUOTA_CONCURRENCY_LEASE_SECONDS"),
            default=DEFAULT_QUOTA_CONCURRENCY_LEASE_SECONDS),
        fleet_max_load=_parse_positive_int("FLEET_MAX_LOAD", env.get("FLEET_MAX_LOAD"), default=DEFAULT_FLEET_MAX_LOAD),
        fleet_load_factor=_parse_load_factor(env.get("FLEET_LOAD_FACTOR")),
        adapter_max_lora_rank=_parse_positive_int(
            "ADAPTER_MAX_LORA_RANK", env.get("ADAPTER_MAX_LORA_RANK"), default=DEFAULT_ADAPTER_MAX_LORA_RANK),
        adapter_max_extracted_bytes=_parse_positive_int(
            "ADAPTER_MAX_EXTRACTED_BYTES", env.get("ADAPTER_MAX_EXTRACTED_BYTES"), default=2 * max_upload_bytes),
        adapter_max_archive_files=_parse_positive_int(
            "ADAPTER_MAX_ARCHIVE_FILES", env.get("ADAPTER_MAX_ARCHIVE_FILES"), default=DEFAULT_ADAPTER_MAX_ARCHIVE_FILES),
        adapter_stage_retry_seconds=_parse_positive_float(
            "ADAPTER_STAGE_RETRY_SECONDS", env.get("ADAPTER_STAGE_RETRY_SECONDS"),
            default=DEFAULT_ADAPTER_STAGE_RETRY_SECONDS),
        adapter_prewarm_top_n=_parse_non_negative_int(
            "ADAPTER_PREWARM_TOP_N", env.get("ADAPTER_PREWARM_TOP_N"), default=DEFAULT_ADAPTER_PREWARM_TOP_N),
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


def _check_production_secret_key(secret_key: str) -> None:
    """Refuse what Django's deploy check (security.W009) calls weak: sessions, password-reset
    links and signed values are only as strong as this key."""
    if secret_key == DEVELOPMENT_SECRET_KEY:
        raise ConfigError(
            "SECRET_KEY",
            "the development secret key cannot be used in production; set a long random value",
        )
    if secret_key.startswith(SECRET_KEY_INSECURE_PREFIX):
        raise ConfigError(
            "SECRET_KEY", f"a {SECRET_KEY_INSECURE_PREFIX!r} key is Django's placeholder; set a long random value"
        )
    if len(secret_key) < SECRET_KEY_MIN_LENGTH or len(set(secret_key)) < SECRET_KEY_MIN_UNIQUE_CHARACTERS:
        raise ConfigError(
            "SECRET_KEY",
            f"too weak for production (needs at least {SECRET_KEY_MIN_LENGTH} characters, "
            f"{SECRET_KEY_MIN_UNIQUE_CHARACTERS} of them different); "
            'generate one with python -c "import secrets; print(secrets.token_urlsafe(50))"',
        )


def _check_production_allowed_hosts(allowed_hosts: tuple[str, ...]) -> None:
    """A wildcard lets any Host header through: password-reset links and redirects built from
    it can then point anywhere. Django only knows `*` (everything) and `.example.com`
    (a domain and its subdomains); anything else with a `*` is a mistake too."""
    for host in allowed_hosts:
        if "*" in host:
            raise ConfigError(
                "ALLOWED_HOSTS",
                f"{host!r} is a wildcard, refused in production; list the portal's host names "
                "(.example.com allows a domain and its subdomains)",
            )


def _check_production_admin_token(token: str | None) -> None:
    """Without the fleet secret the /internal/ endpoint serves no adapter file (and the workers
    refuse to start in production), so a production portal could not serve any adapter."""
    if token is None:
        raise ConfigError(
            "INFERENCE_ADMIN_TOKEN",
            "required in production: the secret shared with the inference workers "
            "(they fetch adapter files with it); the same value goes to every worker",
        )
    if len(token) < ADMIN_TOKEN_MIN_LENGTH:
        raise ConfigError(
            "INFERENCE_ADMIN_TOKEN",
            f"too short for production ({len(token)} characters, needs at least {ADMIN_TOKEN_MIN_LENGTH}); "
            'generate one with python -c "import secrets; print(secrets.token_urlsafe(32))"',
        )


def _check_production_metrics_token(token: str) -> None:
    """The metrics name every tenant and its models: the token is held to the fleet secret's length."""
    if len(token) < ADMIN_TOKEN_MIN_LENGTH:
        raise ConfigError(
            "METRICS_TOKEN",
            f"too short for production ({len(token)} characters, needs at least {ADMIN_TOKEN_MIN_LENGTH}); "
            'generate one with python -c "import secrets; print(secrets.token_urlsafe(32))"',
        )


def _parse_key_prefix(value: str | None) -> str:
    if value is None:
        return DEFAULT_REDIS_KEY_PREFIX
    if len(value) > 100 or any(c.isspace() or not c.isprintable() for c in value):
        raise ConfigError("REDIS_KEY_PREFIX", "must be at most 100 printable characters without spaces")
    return value


def _parse_positive_float(variable: str, value: str | None, *, default: float) -> float:
    if value is None:
        return default
    try:
        number = float(value.strip())
    except ValueError:
        raise ConfigError(variable, f"not a number: {value!r}") from None
    if not 0 < number < float("inf"):
        raise ConfigError(variable, f"must be a positive number of seconds, got {value!r}")
    return number


def _parse_load_factor(value: str | None) -> float:
    if value is None:
        return DEFAULT_FLEET_LOAD_FACTOR
    try:
        number = float(value.strip())
    except ValueError:
        raise ConfigError("FLEET_LOAD_FACTOR", f"not a number: {value!r}") from None
    if not 1 <= number < float("inf"):  # under 1 the bound is under the mean: no worker might be under it
        raise ConfigError("FLEET_LOAD_FACTOR", f"must be a number >= 1 (1.25: at most 1.25x the mean load), got {value!r}")
    return number


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


def _parse_inference_urls(value: str | None, *, discovery: tuple[str, ...] = ()) -> tuple[str, ...]:
    if value is None:
        # Workers found through DNS need no static list; otherwise the local worker of `make run`.
        return () if discovery else DEFAULT_INFERENCE_URLS
    urls = tuple(_parse_http_url("INFERENCE_URLS", item) for item in _parse_list(value))
    if not urls:
        raise ConfigError("INFERENCE_URLS", "no URL given (comma-separated http(s) URLs)")
    if len(set(urls)) != len(urls):
        raise ConfigError("INFERENCE_URLS", f"lists a worker twice: {value!r}")
    return urls


@dataclass(frozen=True)
class DiscoveryName:
    """One INFERENCE_DISCOVERY entry (resolved by portal.fleet.discovery on every poll)."""

    spec: str  # as configured: "dns://inference-headless:8001"
    host: str
    port: int


def parse_discovery(spec: str) -> DiscoveryName:
    """`dns://HOST:PORT` -> DiscoveryName; ValueError with the reason otherwise."""
    value = (spec or "").strip()
    parts = urlsplit(value)
    if parts.scheme != "dns":
        raise ValueError(f"{value!r}: use dns://NAME:PORT (e.g. dns://inference-headless:8001)")
    if not parts.hostname:
        raise ValueError(f"{value!r}: no DNS name")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{value!r}: bad port") from None
    if not port:
        raise ValueError(f"{value!r}: the workers' port is required (dns://NAME:PORT)")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{value!r}: only dns://NAME:PORT, nothing else")
    return DiscoveryName(spec=value, host=parts.hostname, port=port)


def _parse_inference_discovery(value: str | None) -> tuple[str, ...]:
    specs = []
    for item in _parse_list(value):
        try:
            specs.append(parse_discovery(item).spec)
        except ValueError as error:
            raise ConfigError("INFERENCE_DISCOVERY", str(error)) from None
    if len(set(specs)) != len(specs):
        raise ConfigError("INFERENCE_DISCOVERY", f"lists a name twice: {value!r}")
    return tuple(specs)


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
