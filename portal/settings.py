"""Django settings: a mapping of WebConfig (portal/config.py) onto Django's names.

No decisions are made here beyond that mapping; change behaviour in WebConfig.
"""

import os

from kombu import Queue

from portal.config import REPO_ROOT, WebConfig

CONFIG = WebConfig.from_env(os.environ)

BASE_DIR = REPO_ROOT
SECRET_KEY = CONFIG.secret_key
DEBUG = CONFIG.debug
ALLOWED_HOSTS = list(CONFIG.allowed_hosts)
CSRF_TRUSTED_ORIGINS = list(CONFIG.csrf_trusted_origins)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's and Redoc's files, collected with ours
    "portal.core",
    "portal.demo",
    "portal.tenants",
    "portal.keys",
    "portal.adapters",
    "portal.evals",
    "portal.quotas",
    "portal.fleet",
    "portal.usage",
    "portal.gateway",
    "portal.console",
    "portal.playground",
    "portal.dashboards",
    "portal.rollouts",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "portal.urls"
ASGI_APPLICATION = "portal.asgi.application"
WSGI_APPLICATION = "portal.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "portal.core.context_processors.debug_banner",
                "portal.tenants.context_processors.memberships",
            ],
        },
    },
]

DATABASES = {"default": CONFIG.django_database()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# Static files: whitenoise serves them from the web process itself.
STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = CONFIG.static_root
WHITENOISE_USE_FINDERS = CONFIG.debug  # development: no collectstatic needed
STORAGES = {
    "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": CONFIG.storage_root},
    },
    "staticfiles": {
        "BACKEND": (
            "whitenoise.storage.CompressedManifestStaticFilesStorage"
            if CONFIG.is_production
            else "django.contrib.staticfiles.storage.StaticFilesStorage"
        ),
    },
}
MEDIA_ROOT = CONFIG.storage_root
STORAGE_ROOT = CONFIG.storage_root
MAX_UPLOAD_BYTES = CONFIG.max_upload_bytes
GATEWAY_MAX_BODY_BYTES = CONFIG.gateway_max_body_bytes  # /v1 request bodies (portal.gateway.asgi)
ADAPTER_MAX_LORA_RANK = CONFIG.adapter_max_lora_rank  # uploads, until a worker reports its own
ADAPTER_MAX_EXTRACTED_BYTES = CONFIG.adapter_max_extracted_bytes  # what an archive may unpack to
ADAPTER_MAX_ARCHIVE_FILES = CONFIG.adapter_max_archive_files
ADAPTER_STAGE_RETRY_SECONDS = CONFIG.adapter_stage_retry_seconds  # staging's first retry, doubling
ADAPTER_PREWARM_TOP_N = CONFIG.adapter_prewarm_top_n  # adapters kept staged on every worker
FLEET_MAX_LOAD = CONFIG.fleet_max_load  # requests in flight before routing passes a worker by
FLEET_LOAD_FACTOR = CONFIG.fleet_load_factor  # routing's relative bound: c x the fleet's mean load
QUOTA_CONCURRENCY_LEASE_SECONDS = CONFIG.quota_concurrency_lease_seconds
# The platform's own Redis keys: rate-limit counters (portal.quotas), spooled ledger rows
# (portal.usage.spool).
QUOTA_KEY_PREFIX = f"{CONFIG.redis_key_prefix}quota:"
USAGE_SPOOL_KEY = f"{CONFIG.redis_key_prefix}usage:spool"

# Redis: channel layer, cache and Celery broker; without it everything stays in-process.
REDIS_URL = CONFIG.redis_url
if CONFIG.redis_url:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # A receive blocks in BZPOPMIN for 5 s; redis-py >= 6 gives up on a read after 5 s
            # by default, so on a busy loop the read timed out first and the consumer died.
            "CONFIG": {"hosts": [{"address": CONFIG.redis_url, "socket_timeout": 30}]},
        },
    }
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": CONFIG.redis_url,
        },
    }
    CELERY_BROKER_URL = CONFIG.redis_url
    CELERY_TASK_ALWAYS_EAGER = False
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
    CELERY_BROKER_URL = "memory://localhost/"  # a host named: kombu warns about a bare memory://
    CELERY_TASK_ALWAYS_EAGER = True
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_IGNORE_RESULT = True  # tasks report through the database, not a result backend
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Queues: the fleet poll alone on `fleet`, so a long adapter validation never delays it; the
# adapters' validation, staging, unloads and prewarm on `adapters`; the rest (usage roll-ups, the
# usage spool replay) on the default `celery`. A worker started without -Q consumes all three
# (one box: deploy/local/run.py); deployments give `fleet` a worker of its own (deploy/compose.yaml,
# deploy/k8s/base/celery.yaml). Each queue's routing key is its name: a message goes to one queue.
# Time limits (seconds, soft then hard): the soft one raises SoftTimeLimitExceeded in the task (a
# validation then rejects the version, staging's try fails), the hard one kills the worker process.
CELERY_TASK_DEFAULT_QUEUE = "celery"
CELERY_TASK_QUEUES = tuple(Queue(name, routing_key=name) for name in ("celery", "fleet", "adapters"))
CELERY_TASK_SOFT_TIME_LIMIT = 240  # any task not listed below
CELERY_TASK_TIME_LIMIT = 300
_TASKS = {  # name: (queue, soft limit, hard limit)
    "portal.fleet.tasks.fleet_poll_task": ("fleet", 25, 30),  # every 10 s; probes time out after 2 s
    "portal.fleet.tasks.fleet_history_fold_task": ("celery", 120, 150),  # every minute: folds what is new
    # every minute: ~1-2 s on 2M rows a month; a first run (or one after migration 0007) recomputes
    # every bucket the retention keeps, ~2 min on such a ledger
    "portal.usage.tasks.usage_rollup_refresh_task": ("celery", 900, 960),
    "portal.usage.tasks.usage_rollup_prune_task": ("celery", 240, 300),  # hourly: deletes past retention
    "portal.adapters.tasks.adapter_version_validate_task": ("adapters", 600, 660),  # unpack + check GBs
    "portal.adapters.staging.version_stage_task": ("adapters", 330, 390),  # one load: up to 300 s
    "portal.adapters.staging.worker_unload_task": ("adapters", 60, 90),
    "portal.adapters.prewarm.prewarm_task": ("adapters", 120, 180),
    "portal.adapters.reconcile.fleet_reconcile_task": ("adapters", 120, 180),  # after each poll
    "portal.evals.tasks.evaluation_run_task": ("adapters", 1800, 1860),  # 2 x up to 200 cases
    "portal.usage.tasks.usage_rollup_task": ("celery", 600, 720),
    "portal.usage.tasks.usage_spool_replay_task": ("celery", 240, 300),  # its Redis lock lasts 600 s
    "portal.rollouts.tasks.canary_guard_check_task": ("celery", 50, 55),  # every minute
}
CELERY_TASK_ROUTES = {name: {"queue": queue} for name, (queue, _, _) in _TASKS.items()}
CELERY_TASK_ANNOTATIONS = {name: {"soft_time_limit": soft, "time_limit": hard}
                           for name, (_, soft, hard) in _TASKS.items()}
# Task events (sent, received, started, succeeded, failed, retried) on the broker: what the
# celery-exporter (deploy/k8s/base/celery-exporter.yaml) counts. Redis pub/sub: dropped when
# nothing listens.
CELERY_WORKER_SEND_TASK_EVENTS = True
CELERY_TASK_SEND_SENT_EVENT = True

# The REST API (/api/v1/, schema at /api/schema/): session or API-key auth, errors mapped in one place.
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "portal.adapters.api.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer", "rest_framework.renderers.BrowsableAPIRenderer"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 100,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "portal.adapters.api.exceptions.exception_handler",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    # The schema and its docs page describe every tenant route: signed-in users and API keys only.
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    "TITLE": "Loraplex API",
    "DESCRIPTION": "Tenants' adapters: create, upload versions, follow validation and staging, set deployment weights; "
    "tenants' API keys: create, list, revoke, rotate, with allow-lists, expiry and limits.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "SCHEMA_PATH_PREFIX": r"/api/v1",
    # The docs page's JavaScript and CSS from our own static files (whitenoise), not a CDN: it
    # renders offline and the browser asks no third party.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Two components have a field named "status" with different choices: name each enum.
    "ENUM_NAME_OVERRIDES": {
        "AdapterVersionStatusEnum": "portal.adapters.models.AdapterVersion.Status",
        "ApiKeyStatusEnum": ["active", "expired", "revoked"],
        "EvaluationRunStatusEnum": "portal.evals.models.EvaluationRun.Status",
    },
}

LOGIN_URL = "console:login"
LOGIN_REDIRECT_URL = "console:tenants"

INFERENCE_URLS = list(CONFIG.inference_urls)
INFERENCE_DISCOVERY = list(CONFIG.inference_discovery)  # read by portal.fleet.services (each poll)
INFERENCE_ADMIN_TOKEN = CONFIG.inference_admin_token
INFERENCE_API_KEY = CONFIG.inference_api_key  # the workers' --api-key (portal.fleet.client)
METRICS_TOKEN = CONFIG.metrics_token  # GET /metrics (portal.core.metrics_asgi)
PORTAL_INTERNAL_URL = CONFIG.portal_internal_url  # read by portal.fleet.client (the load body's lora_url)

# HTTPS. Production sits behind a TLS-terminating proxy that sets X-Forwarded-Proto (it must
# overwrite a client's own); the flags below are off in development.
SECURE_SSL_REDIRECT = CONFIG.secure_ssl_redirect
# Reached over plain HTTP inside the network, never redirected: container/Kubernetes probes
# (/healthz) and the inference workers fetching adapter files (/internal/). Patterns are matched
# against the path without its leading slash. (/v1 has its own handler without this middleware.)
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^internal/"]
SECURE_HSTS_SECONDS = CONFIG.hsts_seconds
SECURE_HSTS_INCLUDE_SUBDOMAINS = CONFIG.hsts_include_subdomains
SECURE_HSTS_PRELOAD = CONFIG.hsts_preload
if CONFIG.is_production:
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain"},
    },
    "root": {"handlers": ["console"], "level": CONFIG.log_level},
    # httpx logs every request at INFO: a line per gateway call and five per fleet poll.
    "loggers": {"httpx": {"level": "WARNING"}, "httpcore": {"level": "WARNING"}},
}
