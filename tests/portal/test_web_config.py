"""WebConfig built from explicit environments: defaults, real services, and every bad value."""

from pathlib import Path

import pytest

from portal.config import (
    DEFAULT_INFERENCE_URLS,
    DEVELOPMENT_SECRET_KEY,
    REPO_ROOT,
    ConfigError,
    WebConfig,
)
from tests.web_process import PRODUCTION

POSTGRES_URL = "postgres://postgres@127.0.0.1:5432/loraplex"
REDIS_URL = "redis://127.0.0.1:6379/15"


@pytest.fixture(autouse=True)
def not_the_web_process(monkeypatch):
    """Config as Celery and commands parse it; importing portal.asgi (other tests do, in this
    process) marks the process as the web one, whose pool default the subprocess test covers."""
    monkeypatch.setattr("portal.config._web_process", False)


def test_empty_environment_gives_embedded_development_defaults():
    config = WebConfig.from_env({})

    assert config.environment == "development"
    assert config.debug is True
    assert config.secret_key == DEVELOPMENT_SECRET_KEY
    assert config.allowed_hosts == ("localhost", "127.0.0.1", "[::1]")
    assert config.database_backend == "sqlite"
    assert config.django_database()["ENGINE"] == "django.db.backends.sqlite3"
    assert config.django_database()["NAME"] == str(REPO_ROOT / "var" / "db.sqlite3")
    assert config.redis_url is None
    assert config.inference_urls == DEFAULT_INFERENCE_URLS
    assert config.storage_root == REPO_ROOT / "var" / "storage"
    assert config.log_level == "INFO"
    assert config.inference_admin_token is None
    assert config.portal_internal_url == "http://127.0.0.1:8000"
    # No HTTPS enforcement in development (runserver and `make run` speak plain HTTP).
    assert config.secure_ssl_redirect is False
    assert (config.hsts_seconds, config.hsts_include_subdomains, config.hsts_preload) == (0, False, False)


def test_empty_strings_count_as_unset():
    assert WebConfig.from_env(
        {"DATABASE_URL": "", "REDIS_URL": "", "DEBUG": ""}
    ) == WebConfig.from_env({})


def test_real_services_from_urls():
    config = WebConfig.from_env({"DATABASE_URL": POSTGRES_URL, "REDIS_URL": REDIS_URL})

    database = config.django_database()
    assert config.database_backend == "postgresql"
    assert database["ENGINE"] == "django.db.backends.postgresql"
    assert (database["HOST"], database["PORT"], database["NAME"]) == ("127.0.0.1", 5432, "loraplex")
    assert config.redis_url == REDIS_URL


@pytest.mark.parametrize("scheme", ["postgres", "postgresql"])
def test_both_postgres_schemes_are_accepted(scheme):
    config = WebConfig.from_env({"DATABASE_URL": f"{scheme}://u:p@db:5433/portal?sslmode=require"})

    database = config.django_database()
    assert database["ENGINE"] == "django.db.backends.postgresql"
    assert database["OPTIONS"] == {"sslmode": "require"}


def test_relative_sqlite_and_storage_paths_are_under_the_repo_root():
    config = WebConfig.from_env(
        {"DATABASE_URL": "sqlite:///var/other.sqlite3", "STORAGE_ROOT": "var/s2"}
    )

    assert config.django_database()["NAME"] == str(REPO_ROOT / "var" / "other.sqlite3")
    assert config.storage_root == REPO_ROOT / "var" / "s2"


def test_absolute_paths_are_kept(tmp_path):
    config = WebConfig.from_env(
        {"DATABASE_URL": f"sqlite:///{tmp_path}/x.db", "STORAGE_ROOT": str(tmp_path / "s")}
    )

    assert Path(config.django_database()["NAME"]) == tmp_path / "x.db"
    assert config.storage_root == tmp_path / "s"


def test_lists_are_split_on_commas_and_trimmed():
    config = WebConfig.from_env(
        {
            "ALLOWED_HOSTS": " a.example.com, b.example.com ,",
            "CSRF_TRUSTED_ORIGINS": "https://a.example.com",
            "INFERENCE_URLS": "http://10.0.0.1:8001/, https://gpu-2.internal:8001",
        }
    )

    assert config.allowed_hosts == ("a.example.com", "b.example.com")
    assert config.csrf_trusted_origins == ("https://a.example.com",)
    assert config.inference_urls == ("http://10.0.0.1:8001", "https://gpu-2.internal:8001")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("on", True),
        ("0", False),
        ("False", False),
        ("no", False),
        ("off", False),
    ],
)
def test_debug_parses_strict_booleans(value, expected):
    assert WebConfig.from_env({"DEBUG": value}).debug is expected


def test_a_postgres_connection_pool_only_when_asked_for():
    assert "OPTIONS" not in WebConfig.from_env({"DATABASE_URL": POSTGRES_URL}).django_database()
    pooled = WebConfig.from_env({"DATABASE_URL": POSTGRES_URL, "DATABASE_POOL_SIZE": "16"}).django_database()
    assert pooled["OPTIONS"]["pool"] == {"min_size": 2, "max_size": 16, "timeout": 10}
    assert pooled["CONN_MAX_AGE"] == 0  # Django refuses persistent connections with a pool
    sqlite = WebConfig.from_env({"DATABASE_POOL_SIZE": "16"}).django_database()
    assert "OPTIONS" not in sqlite  # SQLite has no pool: the size is ignored


def test_the_web_process_turns_the_pool_on_unless_told_otherwise():
    import os
    import subprocess
    import sys

    code = ("import os; os.environ.pop('DJANGO_SETTINGS_MODULE', None); import portal.asgi;"
            "from django.conf import settings; print(settings.DATABASES['default'].get('OPTIONS', {}).get('pool'))")
    env = {**os.environ, "DATABASE_URL": POSTGRES_URL}
    env.pop("DATABASE_POOL_SIZE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    assert "'max_size': 32" in out.stdout
    env["DATABASE_POOL_SIZE"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    assert out.stdout.strip() == "None"


def test_other_settings_are_read():
    config = WebConfig.from_env(
        {"LOG_LEVEL": "debug", "INFERENCE_ADMIN_TOKEN": "t0ken", "MAX_UPLOAD_BYTES": "1_000_000",
         "GATEWAY_MAX_BODY_BYTES": "65536", "REDIS_KEY_PREFIX": "staging:", "DATABASE_POOL_TIMEOUT": "2.5"}
    )

    assert (config.log_level, config.inference_admin_token, config.max_upload_bytes,
            config.gateway_max_body_bytes, config.redis_key_prefix, config.database_pool_timeout) == (
        "DEBUG",
        "t0ken",
        1_000_000,
        65536,
        "staging:",
        2.5,
    )


def test_body_limit_redis_prefix_and_pool_timeout_defaults():
    config = WebConfig.from_env({})

    assert config.gateway_max_body_bytes == 4 * 1024 * 1024
    assert config.redis_key_prefix == "loraplex:"
    assert config.database_pool_timeout == 10.0


@pytest.mark.parametrize(
    ("environ", "variable", "fragment"),
    [
        ({"DATABASE_URL": "mysqlx://x"}, "DATABASE_URL", "unsupported scheme 'mysqlx'"),
        ({"DATABASE_URL": "mysql://u@h/db"}, "DATABASE_URL", "unsupported scheme 'mysql'"),
        ({"DATABASE_URL": "just-a-path.db"}, "DATABASE_URL", "unsupported scheme"),
        ({"DATABASE_URL": "sqlite://"}, "DATABASE_URL", "needs a file path"),
        ({"DATABASE_URL": "postgres://h:5432"}, "DATABASE_URL", "no database name"),
        ({"REDIS_URL": "http://127.0.0.1:6379"}, "REDIS_URL", "unsupported scheme 'http'"),
        ({"REDIS_URL": "redis://"}, "REDIS_URL", "no host"),
        ({"REDIS_URL": "redis://h:port/0"}, "REDIS_URL", "bad port"),
        ({"REDIS_URL": "redis://h:6379/zero"}, "REDIS_URL", "database must be a number"),
        ({"DEBUG": "maybe"}, "DEBUG", "not a boolean: 'maybe'"),
        ({"DJANGO_ENV": "staging"}, "DJANGO_ENV", "unknown environment 'staging'"),
        ({"PORTAL_ENV": "prod"}, "PORTAL_ENV", "unknown environment 'prod'"),
        ({"PORTAL_ENV": "production", "DJANGO_ENV": "development"}, "PORTAL_ENV", "disagrees"),
        ({"INFERENCE_URLS": "127.0.0.1:8001"}, "INFERENCE_URLS", "not an http(s) URL"),
        ({"INFERENCE_URLS": "ftp://worker"}, "INFERENCE_URLS", "not an http(s) URL"),
        ({"INFERENCE_URLS": "http://w:80x"}, "INFERENCE_URLS", "bad port"),
        ({"INFERENCE_URLS": " , "}, "INFERENCE_URLS", "no URL given"),
        ({"INFERENCE_URLS": "http://a:1,http://a:1"}, "INFERENCE_URLS", "twice"),
        (
            {"CSRF_TRUSTED_ORIGINS": "portal.example.com"},
            "CSRF_TRUSTED_ORIGINS",
            "not an http(s) URL",
        ),
        ({"LOG_LEVEL": "LOUD"}, "LOG_LEVEL", "unknown level 'LOUD'"),
        ({"MAX_UPLOAD_BYTES": "1GB"}, "MAX_UPLOAD_BYTES", "not an integer"),
        ({"MAX_UPLOAD_BYTES": "0"}, "MAX_UPLOAD_BYTES", "must be positive"),
        ({"GATEWAY_MAX_BODY_BYTES": "4MiB"}, "GATEWAY_MAX_BODY_BYTES", "not an integer"),
        ({"GATEWAY_MAX_BODY_BYTES": "0"}, "GATEWAY_MAX_BODY_BYTES", "must be positive"),
        ({"REDIS_KEY_PREFIX": "two words"}, "REDIS_KEY_PREFIX", "without spaces"),
        ({"DATABASE_POOL_TIMEOUT": "soon"}, "DATABASE_POOL_TIMEOUT", "not a number"),
        ({"DATABASE_POOL_TIMEOUT": "0"}, "DATABASE_POOL_TIMEOUT", "positive number of seconds"),
        ({"DATABASE_POOL_SIZE": "-1"}, "DATABASE_POOL_SIZE", "must be >= 0"),
        ({"DATABASE_POOL_SIZE": "many"}, "DATABASE_POOL_SIZE", "not an integer"),
        ({"PORTAL_INTERNAL_URL": "web:8000"}, "PORTAL_INTERNAL_URL", "not an http(s) URL"),
        ({"SECURE_SSL_REDIRECT": "always"}, "SECURE_SSL_REDIRECT", "not a boolean"),
        ({"SECURE_HSTS_SECONDS": "1y"}, "SECURE_HSTS_SECONDS", "not an integer"),
        ({"SECURE_HSTS_SECONDS": "-1"}, "SECURE_HSTS_SECONDS", "must be >= 0"),
        ({"SECURE_HSTS_INCLUDE_SUBDOMAINS": "si"}, "SECURE_HSTS_INCLUDE_SUBDOMAINS", "not a boolean"),
        ({"SECURE_HSTS_PRELOAD": "2"}, "SECURE_HSTS_PRELOAD", "not a boolean"),
    ],
)
def test_malformed_values_raise_config_error_naming_the_variable(environ, variable, fragment):
    with pytest.raises(ConfigError) as caught:
        WebConfig.from_env(environ)

    assert caught.value.variable == variable
    assert str(caught.value).startswith(f"{variable}: ")
    assert fragment in caught.value.message


def test_production_defaults_debug_off_and_https_on():
    config = WebConfig.from_env(PRODUCTION)

    assert config.is_production and config.debug is False
    assert config.secure_ssl_redirect is True
    assert (config.hsts_seconds, config.hsts_include_subdomains, config.hsts_preload) == (31536000, True, True)
    assert config.portal_internal_url == "http://web:8000"


def test_production_https_settings_come_from_the_environment():
    config = WebConfig.from_env({**PRODUCTION, "SECURE_SSL_REDIRECT": "off", "SECURE_HSTS_SECONDS": "3600",
                                 "SECURE_HSTS_INCLUDE_SUBDOMAINS": "false", "SECURE_HSTS_PRELOAD": "no"})

    assert config.secure_ssl_redirect is False
    assert (config.hsts_seconds, config.hsts_include_subdomains, config.hsts_preload) == (3600, False, False)


@pytest.mark.parametrize(
    ("secret", "fragment"),
    [
        ("x", "too weak for production"),
        ("Kq8-vW2p_Lr5zN0xYc3mT7hJ4sB9dF6gA1eR-uI8oP2wQ5tZ7", "too weak for production"),  # 49 characters
        ("abcd" * 20, "too weak for production"),  # long, 4 different characters
        ("django-insecure-" + "Kq8-vW2p_Lr5zN0xYc3mT7hJ4sB9dF6gA1eR-uI8", "Django's placeholder"),
    ],
    ids=["one-character", "49-characters", "4-unique-characters", "django-insecure-prefix"],
)
def test_production_refuses_a_weak_secret_key(secret, fragment):
    with pytest.raises(ConfigError) as caught:
        WebConfig.from_env({**PRODUCTION, "SECRET_KEY": secret})

    assert caught.value.variable == "SECRET_KEY"
    assert fragment in caught.value.message


@pytest.mark.parametrize("hosts", ["*", "portal.example.com,*", "*.example.com"])
def test_production_refuses_wildcard_allowed_hosts(hosts):
    with pytest.raises(ConfigError, match="wildcard, refused in production") as caught:
        WebConfig.from_env({**PRODUCTION, "ALLOWED_HOSTS": hosts})
    assert caught.value.variable == "ALLOWED_HOSTS"


def test_production_accepts_a_domain_and_its_subdomains():
    config = WebConfig.from_env({**PRODUCTION, "ALLOWED_HOSTS": ".example.com,web"})

    assert config.allowed_hosts == (".example.com", "web")


@pytest.mark.parametrize(
    ("token", "fragment"),
    [(None, "required in production"), ("", "required in production"), ("t" * 31, "too short for production (31")],
    ids=["unset", "empty", "31-characters"],
)
def test_production_refuses_a_missing_or_short_admin_token(token, fragment):
    environ = {key: value for key, value in PRODUCTION.items() if key != "INFERENCE_ADMIN_TOKEN"}
    if token is not None:
        environ["INFERENCE_ADMIN_TOKEN"] = token

    with pytest.raises(ConfigError) as caught:
        WebConfig.from_env(environ)
    assert caught.value.variable == "INFERENCE_ADMIN_TOKEN"
    assert fragment in caught.value.message


def test_production_needs_the_portal_internal_url():
    environ = {key: value for key, value in PRODUCTION.items() if key != "PORTAL_INTERNAL_URL"}

    with pytest.raises(ConfigError, match="required in production") as caught:
        WebConfig.from_env(environ)
    assert caught.value.variable == "PORTAL_INTERNAL_URL"


def test_development_accepts_what_production_refuses():
    config = WebConfig.from_env({"SECRET_KEY": "x", "ALLOWED_HOSTS": "*"})

    assert (config.secret_key, config.allowed_hosts, config.inference_admin_token) == ("x", ("*",), None)


@pytest.mark.parametrize("variable", ["PORTAL_ENV", "DJANGO_ENV"])
def test_production_refuses_debug(variable):
    environ = {**PRODUCTION, "PORTAL_ENV": "", variable: "production", "DEBUG": "true"}

    with pytest.raises(ConfigError, match="must be off in production") as caught:
        WebConfig.from_env(environ)
    assert caught.value.variable == "DEBUG"


@pytest.mark.parametrize("secret", [None, DEVELOPMENT_SECRET_KEY])
def test_production_refuses_the_development_secret_key(secret):
    environ = {key: value for key, value in PRODUCTION.items() if key != "SECRET_KEY"}
    if secret is not None:
        environ["SECRET_KEY"] = secret

    with pytest.raises(ConfigError, match="development secret key") as caught:
        WebConfig.from_env(environ)
    assert caught.value.variable == "SECRET_KEY"


def test_production_requires_allowed_hosts():
    environ = {key: value for key, value in PRODUCTION.items() if key != "ALLOWED_HOSTS"}

    with pytest.raises(ConfigError) as caught:
        WebConfig.from_env(environ)
    assert caught.value.variable == "ALLOWED_HOSTS"


def test_config_is_frozen():
    config = WebConfig.from_env({})

    with pytest.raises(AttributeError):
        config.debug = False  # type: ignore[misc]
