"""Django settings for the KV cache control plane.

The embedded default needs no services: SQLite under ``var/``, Celery on
kombu's filesystem transport with a real worker, a local vLLM engine. Setting
``DATABASE_URL`` (PostgreSQL) and ``CELERY_BROKER_URL`` (Redis) scales it out
with the same code. Every environment read goes through :mod:`cacheadmin.env`.
"""

from __future__ import annotations

import hashlib
import os
import socket
from datetime import timedelta
from pathlib import Path

from kombu import Queue

from cacheadmin.env import (
    database_from_url,
    env_bool,
    env_choice,
    env_float,
    env_int,
    env_names,
    env_networks,
    env_paths,
    env_str,
    persistent_secret,
    private_dir,
    sqlite_database,
)
from inference.keepalive import SERVER_IDLE_S

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("VAR_DIR", str(BASE_DIR / "var"))).resolve()
private_dir(VAR_DIR)

SECRET_KEY = persistent_secret("secret-key", "DJANGO_SECRET_KEY", VAR_DIR)
#: Key of the HMAC that turns a namespace id into its vLLM ``cache_salt``.
CACHE_SALT_SECRET = persistent_secret("cache-salt-secret", "CACHE_SALT_SECRET", VAR_DIR)
DEBUG = env_bool("DJANGO_DEBUG", False)

# --- TLS and cookies (a deployment behind HTTPS sets these; `manage.py check
# --deploy` is clean with DJANGO_HTTPS=1 and DJANGO_HSTS_SECONDS set) -------
#: Served over HTTPS: secure cookies, and plain HTTP redirected to HTTPS.
HTTPS = env_bool("DJANGO_HTTPS", False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = HTTPS
SECURE_SSL_REDIRECT = env_bool("DJANGO_SECURE_SSL_REDIRECT", HTTPS)
SESSION_COOKIE_HTTPONLY = True
#: HSTS max-age in seconds (0: off). Once browsers have seen it, they refuse
#: plain HTTP for that long: set it when HTTPS is there to stay.
SECURE_HSTS_SECONDS = env_int("DJANGO_HSTS_SECONDS", 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("DJANGO_HSTS_PRELOAD", False)
#: Behind a TLS-terminating proxy that sets this header (e.g. X-Forwarded-Proto).
if env_str("DJANGO_SECURE_PROXY_SSL_HEADER", ""):
    SECURE_PROXY_SSL_HEADER = (f"HTTP_{env_str('DJANGO_SECURE_PROXY_SSL_HEADER', '').upper().replace('-', '_')}", "https")
CSRF_TRUSTED_ORIGINS = [o for o in env_str("DJANGO_CSRF_TRUSTED_ORIGINS", "").split(",") if o]
ALLOWED_HOSTS = [h for h in env_str("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver").split(",") if h]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_celery_beat",
    "axes",
    "cacheadmin",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Static files answer right after the security headers: no session, login
    # or database query for an asset (WhiteNoise's required position).
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # Every page needs a login (the health view opts out); /api/ has its own auth.
    "cacheadmin.middleware.PageLoginRequiredMiddleware",
    "cacheadmin.middleware.ApiBodyLimitMiddleware",
    "cacheadmin.middleware.DatabaseBusyMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes requires: answers a locked-out sign-in.
    "axes.middleware.AxesMiddleware",
]

# Sign-in throttling (django-axes): after AXES_FAILURE_LIMIT failed sign-ins for
# one username from one address, that pair is locked out for the cool-off time.
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("LOGIN_COOLOFF_MINUTES", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True

ROOT_URLCONF = "cacheadmin.urls"
WSGI_APPLICATION = "cacheadmin.wsgi.application"
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

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
            ],
        },
    },
]

_database_url = env_str("DATABASE_URL", "")
DATABASES = {
    "default": database_from_url(_database_url) if _database_url else sqlite_database(VAR_DIR / "db.sqlite3"),
}
#: The namespace list's count and page run as PostgreSQL prepared statements
#: (cacheadmin.api.pagination.prepared_statements). Off by default: a prepared
#: statement lives on its connection, so it pays only with persistent connections
#: (CONN_MAX_AGE is 0 here: one connection per request), and a transaction-mode
#: pooler without prepared-statement support (PgBouncer before 1.21, or its
#: max_prepared_statements 0) refuses statements prepared on another backend.
DATABASE_PREPARED_STATEMENTS = env_bool("DATABASE_PREPARED_STATEMENTS", False)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
# htmx and Chart.js come from the npm registry at setup (package.json); never copied here.
STATICFILES_DIRS = [
    BASE_DIR / "static",
    ("vendor/htmx", BASE_DIR / "node_modules" / "htmx.org" / "dist"),
    ("vendor/chartjs", BASE_DIR / "node_modules" / "chart.js" / "dist"),
]
#: Serve the files ``collectstatic`` gathered into STATIC_ROOT under content-hashed
#: names, gzip-compressed, cached by browsers for a year (WhiteNoise). Off by
#: default so tests and development need no collectstatic: the manifest storage
#: refuses to render a page whose assets were never collected. The demo, the
#: production-server test and the load bench turn it on after collectstatic.
STATIC_MANIFEST = env_bool("DJANGO_STATIC_MANIFEST", False)
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
        if STATIC_MANIFEST
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}
# Without the manifest, WhiteNoise finds each asset in the source folders when
# it is requested (static/, node_modules): nothing to collect, nothing scanned
# when a test client loads the middleware. With it, the collected folder is
# indexed once per server process and hashed names get the long cache header.
WHITENOISE_USE_FINDERS = WHITENOISE_AUTOREFRESH = not STATIC_MANIFEST

# --- Control plane -----------------------------------------------------------
#: Directories that checkpoints must live under (symlinks resolved).
MODEL_ROOTS = [(BASE_DIR / p).resolve() for p in env_paths("MODEL_ROOTS", [VAR_DIR / "models"])]
#: Where the demo builds its checkpoints (must lie inside MODEL_ROOTS).
DEMO_MODELS_DIR = Path(env_str("DEMO_MODELS_DIR", str(VAR_DIR / "models"))).resolve()
#: Root of the hot persistent KV tier on disk; each namespace gets its own prefix below it.
KV_STORE_ROOT = Path(env_str("KV_STORE_ROOT", str(VAR_DIR / "kv"))).resolve()
#: Engine logs, one file per engine.
ENGINE_LOG_DIR = VAR_DIR / "engines"
#: Per-file digest cache of the weights fingerprint, keyed on (path, size, mtime, inode).
DIGEST_CACHE_PATH = VAR_DIR / "digest-cache.sqlite3"
#: GiB of KV cache each local CPU engine reserves (vLLM's VLLM_CPU_KVCACHE_SPACE).
ENGINE_KV_CACHE_GIB = env_float("ENGINE_KV_CACHE_GIB", 1.0, minimum=0.0625)
#: OpenMP threads of each local engine, unbound (0: vLLM's default, one bound to each core); see
#: inference/engines/launcher.py for why engines sharing cores run one each.
ENGINE_CPU_THREADS = env_int("ENGINE_CPU_THREADS", 1, minimum=0)
#: Names of the control plane's environment a local engine also gets (comma-separated,
#: e.g. CUDA_VISIBLE_DEVICES). An engine's environment is an allowlist
#: (inference/child_env.py): the system's names, these, and what its launcher sets.
ENGINE_ENV_INHERIT = env_names("ENGINE_ENV_INHERIT")
#: Seconds a local engine may take to report healthy.
ENGINE_START_TIMEOUT_S = env_int("ENGINE_START_TIMEOUT_S", 300, minimum=10)
#: Networks (CIDR, comma-separated) engines the control plane contacts may be on:
#: adoption, metrics, KV events, jobs and the gateway reach no other address.
#: Empty: loopback only. Link-local and cloud metadata addresses are refused
#: whatever this says (inference.netpolicy).
ENGINE_ALLOWED_NETWORKS = env_networks("ENGINE_ALLOWED_NETWORKS")
#: The kubeconfig file the InferencePool adopter reads the Kubernetes API from (its current
#: context); empty: the pod's in-cluster service account (cacheadmin.services.inference_pools).
KUBECONFIG = env_str("KUBECONFIG", "")
#: Where local engines bind their KV-event sockets (ipc://): a directory of this
#: user with mode 0700, so no other local user can publish or read there
#: (inference.kv_transport). A Unix socket path holds 107 bytes: a VAR_DIR too
#: deep for that gets a short folder under /tmp named after it.
_kv_socket_default = VAR_DIR / "run" / "kv-events"
if len(str(_kv_socket_default)) > 80:
    _kv_socket_default = Path("/tmp") / f"kvcp-{os.getuid()}-{hashlib.sha256(str(VAR_DIR).encode()).hexdigest()[:12]}"
KV_EVENTS_SOCKET_DIR = Path(env_str("KV_EVENTS_SOCKET_DIR", str(_kv_socket_default))).resolve()
#: The KV-event consumer's CURVE secret key (created once, mode 0600); its public
#: key (`manage.py kv_events --public-key`) is what relays beside remote engines admit.
KV_EVENTS_KEY_FILE = Path(env_str("KV_EVENTS_KEY_FILE", str(VAR_DIR / "kv-events-consumer.key"))).resolve()
#: The Ray cluster engines on other hosts are started through (inference/engines/ray_backend.py):
#: ``ray://HEAD:10001``, the head's Ray Client server. Empty: engines run on this host only.
#: Ray has no authentication: its ports must sit on a network only the cluster and the control plane reach.
RAY_ADDRESS = env_str("RAY_ADDRESS", "")
#: This host's name in the fleet: what running jobs record as their worker's host, and the
#: per-host Celery queue (``host.<name>``) a worker beside this host's engines consumes.
KVCP_HOST = env_str("KVCP_HOST", socket.gethostname())
#: The CURVE secret key of the KV-event relays beside Ray engines, at this path on each node
#: (created once there, mode 0600; it never leaves its host: the relay hands back its public key).
KV_EVENTS_RELAY_KEY_FILE = Path(env_str("KV_EVENTS_RELAY_KEY_FILE", str(VAR_DIR / "kv-events-relay.key"))).resolve()
# What one tenant may hold (cacheadmin.services.quotas): each created row is a metric
# series, a polled target or a worker's time. TENANT_QUOTA_<KIND>=N; 0 forbids the kind.
TENANT_QUOTAS = {
    "engines": env_int("TENANT_QUOTA_ENGINES", 8, minimum=0),
    "namespaces": env_int("TENANT_QUOTA_NAMESPACES", 32, minimum=0),
    "gateway_keys": env_int("TENANT_QUOTA_GATEWAY_KEYS", 50, minimum=0),
    "prompt_templates": env_int("TENANT_QUOTA_PROMPT_TEMPLATES", 100, minimum=0),
    "jobs": env_int("TENANT_QUOTA_JOBS", 20, minimum=0),
    "prefix_heat": env_int("TENANT_QUOTA_PREFIX_HEAT", 10_000, minimum=1),
}
#: Prompts a prewarm job keeps in flight at once (hottest first; 1 = one at a time).
PREWARM_CONCURRENCY = env_int("PREWARM_CONCURRENCY", 4, minimum=1)
#: A running job whose heartbeat is older than this is considered lost.
JOB_STALE_AFTER_S = env_int("JOB_STALE_AFTER_S", 300, minimum=5)
#: Attempts before a lost job is failed instead of retried.
JOB_MAX_ATTEMPTS = env_int("JOB_MAX_ATTEMPTS", 3, minimum=1)

# --- Tiers, accounting, eviction -------------------------------------------
#: Redis KV tier (keys ``<storage prefix>:<entry>``); empty: no Redis tier.
KV_REDIS_URL = env_str("KV_REDIS_URL", "")
#: Cold tier: one compressed archive per demoted namespace; engines never read it.
KV_COLD_ROOT = Path(env_str("KV_COLD_ROOT", str(VAR_DIR / "kv-cold"))).resolve()
#: Owners are told of a scheduled sweep this long before it may start (seconds).
EVICTION_NOTICE_S = env_int("EVICTION_NOTICE_S", 3600, minimum=0)
#: Actions one task executes before it re-enqueues the run (bounded batches).
EVICTION_BATCH_ACTIONS = env_int("EVICTION_BATCH_ACTIONS", 50, minimum=1)
#: Pause between actions (milliseconds), to keep a sweep's I/O off the engines' backs.
EVICTION_ACTION_PAUSE_MS = env_int("EVICTION_ACTION_PAUSE_MS", 0, minimum=0)
#: Keys listed in one ``delete_entries`` action.
EVICTION_ENTRIES_PER_ACTION = env_int("EVICTION_ENTRIES_PER_ACTION", 1000, minimum=1)
#: A storage prefix without a namespace is reported (and purged) only once its newest entry is this old.
ORPHAN_GRACE_S = env_int("ORPHAN_GRACE_S", 3600, minimum=0)
#: An adapter no running engine has used for this many days is reported as an orphan.
ADAPTER_UNUSED_DAYS = env_int("ADAPTER_UNUSED_DAYS", 30, minimum=1)
#: Seconds before a failed sweep (e.g. a tier unreachable) is resumed.
EVICTION_RETRY_S = env_int("EVICTION_RETRY_S", 300, minimum=1)
#: Owners' digests go through Django's mail backend: by default its file backend, one file per
#: connection under EMAIL_FILE_PATH (never mixed into a command's or the demo's output); set
#: EMAIL_BACKEND=django.core.mail.backends.smtp.EmailBackend and EMAIL_HOST etc. for real mail.
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.filebased.EmailBackend")
EMAIL_FILE_PATH = env_str("EMAIL_FILE_PATH", str(VAR_DIR / "mail"))
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = env_bool("EMAIL_USE_SSL", False)
#: Seconds an SMTP connection may block (Django's default: no limit).
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT", 30, minimum=1)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "kv-cache-control-plane@localhost")

# --- Gateway (the data plane) -------------------------------------------------
#: Where `manage.py gateway` listens.
GATEWAY_ADDR = env_str("GATEWAY_ADDR", "127.0.0.1:8300")
#: Gateway processes (uvicorn workers); they share the caches' stores.
GATEWAY_WORKERS = env_int("GATEWAY_WORKERS", 2, minimum=1)
#: Seconds a gateway process may leave uvicorn's supervisor's health ping unanswered before it is
#: killed and replaced (with its open connections). uvicorn's default, 5, killed healthy processes
#: on a loaded 2-core machine while a C extension held the GIL (lingua's models load in one call):
#: 30 is gunicorn's worker timeout (https://docs.gunicorn.org/en/stable/settings.html#timeout).
GATEWAY_WORKER_HEALTHCHECK_S = env_int("GATEWAY_WORKER_HEALTHCHECK_S", 30, minimum=1)
#: Scale-out store of the response and semantic caches (its own Redis database:
#: the KV Redis tier treats foreign keys in its database as strays). Empty: SQLite files under GATEWAY_DIR.
GATEWAY_REDIS_URL = env_str("GATEWAY_REDIS_URL", "")
#: The embedded stores' folder.
GATEWAY_DIR = Path(env_str("GATEWAY_DIR", str(VAR_DIR / "gateway"))).resolve()
#: The semantic layer's embedding model exported to ONNX (once per host and versions; ~90 MB), reused by every gateway process.
GATEWAY_EMBEDDER_DIR = GATEWAY_DIR / "embedder"
#: The semantic cache layer in this deployment (it loads an embedding model, ~90 MB, in each gateway process).
GATEWAY_SEMANTIC = env_bool("GATEWAY_SEMANTIC", True)
#: The semantic layer's admission rules, as JSON: a list of {"name", "pattern"} (a
#: case-insensitive regular expression); empty: the shipped rules (time_dependent,
#: comparison, prediction). Checked when a gateway starts.
GATEWAY_SEMANTIC_RULES = env_str("GATEWAY_SEMANTIC_RULES", "")
#: A gateway key's token bucket when the key sets none: requests per second, and burst.
GATEWAY_RATE_PER_S = env_int("GATEWAY_RATE_PER_S", 50, minimum=1)
GATEWAY_BURST = env_int("GATEWAY_BURST", 100, minimum=1)
#: Requests one gateway process keeps in flight per engine; past it, requests are shed with 503.
GATEWAY_ENGINE_MAX_IN_FLIGHT = env_int("GATEWAY_ENGINE_MAX_IN_FLIGHT", 64, minimum=1)
#: How a gateway picks an engine of a namespace: ``precise`` (by the blocks each engine holds, as its KV
#: events say, against its load: gateway.prefix.router), or the baselines ``affinity`` (rendezvous hash of
#: the prompt's start, load-aware) and ``round_robin``. Precise falls back to affinity per request when it
#: cannot predict (and says why in x-kvcp-routing).
GATEWAY_ENGINE_CHOICE = env_choice("GATEWAY_ENGINE_CHOICE", "precise", ("precise", "affinity", "round_robin"))
#: How often (seconds) each gateway process reads the block index store for changed engines.
GATEWAY_PREFIX_INDEX_POLL_S = env_float("GATEWAY_PREFIX_INDEX_POLL_S", 0.5, minimum=0.05)
#: An engine's published blocks older than this (seconds; the consumer beats every FLUSH_S) are not used.
GATEWAY_PREFIX_INDEX_STALE_S = env_float("GATEWAY_PREFIX_INDEX_STALE_S", 10.0, minimum=1.0)
#: How long (seconds) a request's blocks count as held by the engine it was just routed to, before its events say so.
GATEWAY_PREFIX_SPECULATIVE_TTL_S = env_float("GATEWAY_PREFIX_SPECULATIVE_TTL_S", 5.0, minimum=0.0)
#: Weight of an engine's load against its cached blocks in the precise choice (gateway.prefix.router.cost).
GATEWAY_ROUTING_LOAD_WEIGHT = env_float("GATEWAY_ROUTING_LOAD_WEIGHT", 0.25, minimum=0.0)
#: How often (milliseconds) each gateway process reads the routing epoch.
GATEWAY_EPOCH_POLL_MS = env_int("GATEWAY_EPOCH_POLL_MS", 250, minimum=10)
#: A snapshot is rebuilt at least this often (seconds), whatever the epoch says.
GATEWAY_SNAPSHOT_MAX_AGE_S = env_int("GATEWAY_SNAPSHOT_MAX_AGE_S", 10, minimum=1)
#: How often (seconds) a gateway process writes its figures and prefix heat.
GATEWAY_FLUSH_S = env_int("GATEWAY_FLUSH_S", 2, minimum=1)
#: Read deadlines of a gateway request (seconds): its headers from the connection's start (on a kept-alive
#: connection, from the next request's first byte), its body from the headers. Past either: 408 and the
#: connection closes (gateway.connections).
GATEWAY_HEADER_TIMEOUT_S = env_int("GATEWAY_HEADER_TIMEOUT_S", 10, minimum=1)
GATEWAY_BODY_TIMEOUT_S = env_int("GATEWAY_BODY_TIMEOUT_S", 30, minimum=1)
#: Seconds a gateway connection may stay idle between requests before it is closed (uvicorn's
#: timeout_keep_alive): far above clients' idle times, so none sends on a connection being closed (inference.keepalive).
GATEWAY_KEEPALIVE_S = env_int("GATEWAY_KEEPALIVE_S", SERVER_IDLE_S, minimum=1)
#: Open connections one client address may hold in one gateway process (0: no cap; behind a proxy, its address).
GATEWAY_CONNECTIONS_PER_CLIENT = env_int("GATEWAY_CONNECTIONS_PER_CLIENT", 64, minimum=0)

# --- Prometheus metrics (README "Metrics") ------------------------------------
#: Bearer token every ``/metrics`` endpoint asks for (``manage.py metrics_token`` prints it).
METRICS_TOKEN = persistent_secret("metrics-token", "METRICS_TOKEN", VAR_DIR)
#: prometheus-client's multiprocess folder of the control plane's processes (web and Celery workers).
METRICS_MULTIPROC_DIR = Path(env_str("METRICS_MULTIPROC_DIR", str(VAR_DIR / "metrics" / "control"))).resolve()
#: prometheus-client's multiprocess folder of the gateway's processes.
GATEWAY_METRICS_DIR = Path(env_str("GATEWAY_METRICS_DIR", str(VAR_DIR / "metrics" / "gateway"))).resolve()
#: ``HOST:PORT`` where ``manage.py metrics_serve`` serves the control plane's metrics without a token (empty: off).
METRICS_ADDR = env_str("METRICS_ADDR", "")
#: ``HOST:PORT`` where the KV-event consumer ``manage.py demo`` starts serves its metrics: the
#: ``kvcp-kv-events`` target of deploy/prometheus/prometheus.yml (empty: none).
KV_EVENTS_METRICS_ADDR = env_str("KV_EVENTS_METRICS_ADDR", "127.0.0.1:9464")

# --- REST API ----------------------------------------------------------------
# Decided once for every endpoint: who may call, how lists page, one error envelope.
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "cacheadmin.api.auth.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",  # browser; enforces CSRF on writes
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated", "cacheadmin.api.auth.ScopePermission"],
    "DEFAULT_PAGINATION_CLASS": "cacheadmin.api.pagination.BoundedLimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": ["cacheadmin.api.filters.ControlPlaneFilterBackend", "rest_framework.filters.OrderingFilter"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # JSON only: release tooling sends JSON; form and multipart add surface, not features.
    "DEFAULT_PARSER_CLASSES": ["cacheadmin.api.parsers.StrictJSONParser"],
    # JSON answers only: every error under /api/ is the JSON envelope, whatever
    # the Accept header (no browsable-API HTML page; the docs are /api/docs/).
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "EXCEPTION_HANDLER": "cacheadmin.api.exceptions.api_exception_handler",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "KV cache control plane API",
    "DESCRIPTION": "Model identities, cache namespaces, engines, prewarm and comparison jobs, audit.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    # Swagger UI assets from the drf-spectacular-sidecar package: works offline.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    # Request bodies get their own components (TenantRequest, ...) without the
    # read-only fields (id, created_at, ...): generated clients can then build them.
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "JobStatusEnum": "cacheadmin.models.jobs.JobStatus",
        "ModelVersionStatusEnum": "cacheadmin.models.model_versions.ModelVersion.Status",
        "EngineStatusEnum": "cacheadmin.models.engines.Engine.Status",
        "EngineVerificationEnum": "cacheadmin.models.engines.Engine.Verification",
        "EngineStartTierEnum": "cacheadmin.models.engines.Engine.START_TIERS",
        "TierEnum": "cacheadmin.models.eviction.Tier",
    },
}
#: Largest request body accepted (bytes); the API's bodies are small JSON.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("API_MAX_BODY_BYTES", 256 * 1024, minimum=1024)
#: Seconds an Idempotency-Key's recorded answer counts (from its request's start); older
#: keys are unknown (a new request acts) and the hourly sweep deletes them.
IDEMPOTENCY_TTL_S = env_int("IDEMPOTENCY_TTL_S", 24 * 3600, minimum=60)
#: Seconds a request in flight holds its Idempotency-Key: past it (its worker was killed),
#: one retry takes the key over. Above GUNICORN_TIMEOUT_S, so a live request keeps its key.
IDEMPOTENCY_LEASE_S = env_int("IDEMPOTENCY_LEASE_S", 120, minimum=1)
#: Expired Idempotency-Key rows deleted per task run; a full batch queues the next one.
IDEMPOTENCY_EXPIRE_BATCH = env_int("IDEMPOTENCY_EXPIRE_BATCH", 1000, minimum=1)

# --- Celery ------------------------------------------------------------------
_broker_url = env_str("CELERY_BROKER_URL", "")
CELERY_BROKER_DIR = VAR_DIR / "celery-broker"
if _broker_url:
    CELERY_BROKER_URL = _broker_url
    # "priority": a worker takes from its queues strictly in CELERY_TASK_QUEUES order.
    CELERY_BROKER_TRANSPORT_OPTIONS: dict = {"visibility_timeout": 3600, "queue_order_strategy": "priority"}
else:
    # A real worker on kombu's filesystem transport: one folder both ways.
    CELERY_BROKER_DIR.mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_URL = "filesystem://"
    # kombu's transport with its message and exchange files written whole before any reader
    # can list them (a worker otherwise dies reading a file its producer is still writing).
    CELERY_BROKER_TRANSPORT = "cacheadmin.broker:Transport"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(CELERY_BROKER_DIR),
        "data_folder_out": str(CELERY_BROKER_DIR),
        "control_folder": str(CELERY_BROKER_DIR / "control"),
        # kombu polls a virtual transport every 1 s by default, and a worker takes one
        # message per poll: at most 1 task/s (bench/queue_wait.py: 200 tasks of 50 ms took 201 s).
        "polling_interval": 0.1,
    }
    (CELERY_BROKER_DIR / "control").mkdir(parents=True, exist_ok=True)
# Job rows carry every result the pages read; no result backend.
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "default"
#: The queues every worker consumes (unless started with -Q), in priority order: what a
#: release waits on (prewarm, comparison, registration, eviction runs, engine starts),
#: then anything unrouted, then housekeeping (scans, scrapes, sweeps, health), then shadow
#: checks. Redis serves them strictly in this order; kombu's filesystem transport (the
#: embedded default) in turn, so a release job waits behind at most one task of each other
#: queue, never behind a backlog of shadow checks.
CELERY_TASK_QUEUES = tuple(Queue(name) for name in ("release", "default", "housekeeping", "shadow"))
CELERY_TASK_ROUTES = {
    **{
        f"cacheadmin.{name}": {"queue": "release"}
        for name in ("prewarm_job", "comparison_job", "registration_job", "eviction_run", "engine_boot")
    },
    **{
        f"cacheadmin.{name}": {"queue": "housekeeping"}
        for name in (
            "accounting_scan",
            "accounting_scan_scheduled",
            "engine_metrics_scrape",
            "eviction_sweep",
            "jobs_recover_lost",
            "engines_health",
            "engines_restart_due",
            "engines_verify",
            "idempotency_keys_expire",
            "gateway_benefit_check",
            "inference_pools_sync",
        )
    },  # fmt: skip
    "cacheadmin.shadow_check": {"queue": "shadow"},
}
#: Shadow checks waiting for a worker beyond which a new sample is dropped and counted
#: (kvcp_shadow_checks_dropped_total), never queued: shadow verification samples, and a
#: backlog would only delay every other task.
SHADOW_BACKLOG_MAX = env_int("SHADOW_BACKLOG_MAX", 200, minimum=1)
CELERY_TIMEZONE = "UTC"
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Schedules live in the database (django-celery-beat); cacheadmin.schedules declares them.
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "cacheadmin": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
        # Without this, DEBUG=False sends 500 tracebacks only to mail_admins (none set).
        "django.request": {"handlers": ["console"], "level": "ERROR", "propagate": False},
        "inference": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    },
}
