"""Every environment variable the control plane reads, with what it means.

The one place variables are described: ``docs/reference/configuration.md`` is
generated from this registry and from the reads themselves (the helper of
:mod:`cacheadmin.env` each one goes through gives its type, minimum, choices
and literal default; see :mod:`cacheadmin.docs_reference.configuration`).
A test fails when the code reads a variable this registry does not describe,
or when the registry describes one nothing reads.

``default`` is set only where the code's default is not a literal (a path
under ``VAR_DIR``, a value computed at start) or where a literal would
mislead (an empty string that means "off"); otherwise the page shows the
literal from the code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Section = Literal[
    "Storage and database",
    "Web server and security",
    "REST API",
    "Engines and fleet",
    "Jobs and quotas",
    "Tiers and eviction",
    "E-mail",
    "Gateway",
    "Metrics",
    "Demo server",
    "Logging",
]

#: The page's sections, in this order.
SECTIONS: tuple[Section, ...] = (
    "Storage and database",
    "Web server and security",
    "REST API",
    "Engines and fleet",
    "Jobs and quotas",
    "Tiers and eviction",
    "E-mail",
    "Gateway",
    "Metrics",
    "Demo server",
    "Logging",
)


@dataclass(frozen=True)
class EnvVar:
    """One documented environment variable.

    Attributes:
        section: the page section it is listed under.
        meaning: what it sets, as Markdown (one paragraph, no ``|``).
        default: the default as the page shows it, Markdown; None to show the
            code's literal default.
    """

    section: Section
    meaning: str
    default: str | None = None


_S, _W, _A, _E, _J, _T, _M, _G, _P, _D, _L = SECTIONS

VARIABLES: dict[str, EnvVar] = {
    # --- Storage and database --------------------------------------------------
    "VAR_DIR": EnvVar(
        _S,
        "database, KV tiers, logs and secrets of the embedded default; made owner-only (0700) at start",
        "`var` in the project folder",
    ),
    "DATABASE_URL": EnvVar(
        _S,
        "`postgres://user:pass@host:port/name` for PostgreSQL, or `sqlite:///relative/path` / `sqlite:////absolute/path`",
        "SQLite in `VAR_DIR/db.sqlite3`",
    ),
    "DATABASE_CONN_MAX_AGE": EnvVar(
        _S,
        "seconds a web or worker process keeps its database connection (checked before each reuse); 0 opens one per request",
    ),
    "DATABASE_LOCK_TIMEOUT_MS": EnvVar(
        _S,
        "PostgreSQL: how long a statement waits for a lock (0: no limit); past it the request answers 503 "
        "`database_busy` with `Retry-After`",
    ),
    "DATABASE_STATEMENT_TIMEOUT_MS": EnvVar(
        _S,
        "PostgreSQL: how long a statement may run (0: no limit); past it the request answers 503 `database_busy`",
    ),
    "DATABASE_PREPARED_STATEMENTS": EnvVar(
        _S,
        "PostgreSQL: the namespace list's count and page run as prepared statements (not planned again on a "
        "connection that ran them). It pays only where connections persist across requests (each request opens "
        "its own here); leave it off behind a transaction-mode pooler without prepared-statement support "
        "(PgBouncer before 1.21 or `max_prepared_statements = 0`)",
    ),
    "CELERY_BROKER_URL": EnvVar(
        _S,
        "the Celery broker, e.g. `redis://127.0.0.1:6379/0`",
        "kombu's filesystem transport in `VAR_DIR/celery-broker`",
    ),
    "MODEL_ROOTS": EnvVar(
        _S,
        "`:`-separated directories checkpoints must live in (symlinks resolved; relative ones are taken from the project root)",
        "`VAR_DIR/models`",
    ),
    "DEMO_MODELS_DIR": EnvVar(_S, "where the demo builds its checkpoints (must lie inside `MODEL_ROOTS`)", "`VAR_DIR/models`"),
    # --- Web server and security -------------------------------------------------
    "DJANGO_SECRET_KEY": EnvVar(
        _W,
        "Django's signing key: at least 32 visible ASCII characters; an empty, short or non-ASCII value refuses the "
        "start with how to recover",
    ),
    "CACHE_SALT_SECRET": EnvVar(
        _W,
        "key of the HMAC that turns a namespace id into its vLLM `cache_salt`: at least 32 visible ASCII characters",
    ),
    "DJANGO_DEBUG": EnvVar(_W, "Django's debug mode; never on in a deployment"),
    "DJANGO_ALLOWED_HOSTS": EnvVar(_W, "host names served, comma-separated"),
    "DJANGO_CSRF_TRUSTED_ORIGINS": EnvVar(_W, "origins allowed to POST, comma-separated (e.g. `https://cp.example.com`)", "none"),
    "DJANGO_HTTPS": EnvVar(_W, "served over HTTPS: secure session and CSRF cookies, plain HTTP redirected to HTTPS"),
    "DJANGO_SECURE_SSL_REDIRECT": EnvVar(_W, "redirect plain HTTP to HTTPS", "`DJANGO_HTTPS`"),
    "DJANGO_HSTS_SECONDS": EnvVar(
        _W,
        "HTTP Strict Transport Security max-age in seconds (0: off); browsers that saw it refuse plain HTTP that long",
    ),
    "DJANGO_HSTS_INCLUDE_SUBDOMAINS": EnvVar(_W, "HSTS covers subdomains too"),
    "DJANGO_HSTS_PRELOAD": EnvVar(_W, "HSTS asks for browsers' preload lists"),
    "DJANGO_SECURE_PROXY_SSL_HEADER": EnvVar(
        _W,
        "behind a TLS-terminating proxy: the header it sets to `https` (e.g. `X-Forwarded-Proto`)",
        "none",
    ),
    "DJANGO_STATIC_MANIFEST": EnvVar(
        _W,
        "serve the files `collectstatic` gathered into `VAR_DIR/static` under content-hashed names, compressed, "
        "cached for a year (WhiteNoise); off: served as found in `static/` and `node_modules`",
    ),
    "LOGIN_FAILURE_LIMIT": EnvVar(
        _W, "failed sign-ins for one username from one address before that pair is locked out (429; django-axes)"
    ),
    "LOGIN_COOLOFF_MINUTES": EnvVar(_W, "minutes a locked-out username and address pair stays locked out"),
    # --- REST API ----------------------------------------------------------------
    "API_MAX_BODY_BYTES": EnvVar(_A, "largest request body accepted, in bytes"),
    "IDEMPOTENCY_TTL_S": EnvVar(_A, "seconds an `Idempotency-Key`'s recorded answer counts, from its request's start"),
    "IDEMPOTENCY_LEASE_S": EnvVar(
        _A,
        "seconds a request in flight holds its `Idempotency-Key`; past it (its worker was killed) one retry takes it over",
    ),
    "IDEMPOTENCY_EXPIRE_BATCH": EnvVar(
        _A, "expired `Idempotency-Key` rows deleted per task run; a full batch queues the next one"
    ),
    # --- Engines and fleet -------------------------------------------------------
    "ENGINE_KV_CACHE_GIB": EnvVar(_E, "KV cache of each local engine in GiB, fractions allowed (vLLM `--kv-cache-memory-bytes`)"),
    "ENGINE_CPU_THREADS": EnvVar(
        _E,
        "OpenMP threads of each local engine, unbound; 0 keeps vLLM's default of one thread bound to each core",
    ),
    "ENGINE_ENV_INHERIT": EnvVar(
        _E,
        "names of the control plane's environment a local engine also gets, comma-separated (e.g. "
        "`CUDA_VISIBLE_DEVICES`); an engine's environment is otherwise an allowlist",
        "none",
    ),
    "ENGINE_START_TIMEOUT_S": EnvVar(
        _E, "seconds a local engine may take to answer after its start (engines started together: from the batch's start)"
    ),
    "ENGINE_ALLOWED_NETWORKS": EnvVar(
        _E,
        "comma-separated networks (CIDR) engines may be contacted on (adoption, metrics, KV events, jobs, the "
        "gateway); link-local, cloud metadata, multicast and broadcast addresses are refused whatever it says",
        "none: loopback only",
    ),
    "RAY_ADDRESS": EnvVar(
        _E,
        "`ray://HEAD:10001`, the Ray Client server of the cluster engines on other hosts start on; its ports belong on "
        "a network only the cluster and the control plane reach",
        "none: engines start on this host only",
    ),
    "KVCP_HOST": EnvVar(
        _E,
        "this host's name in the fleet: local engines' host, running jobs' worker, and the queue `host.<name>` a "
        "worker beside a host's Ray engines consumes",
        "this machine's host name",
    ),
    "KUBECONFIG": EnvVar(
        _E,
        "the kubeconfig file whose current context the InferencePool adopter reads the Kubernetes API from",
        "none: the pod's in-cluster service account",
    ),
    "KV_EVENTS_SOCKET_DIR": EnvVar(
        _E,
        "where local engines bind their KV-event sockets: a folder of this user with mode 0700",
        "`VAR_DIR/run/kv-events` (a folder under `/tmp` named after `VAR_DIR` when that path is too long for a Unix socket)",
    ),
    "KV_EVENTS_KEY_FILE": EnvVar(
        _E,
        "the KV-event consumer's CURVE secret key (created once, mode 0600); relays beside remote engines admit its public key",
        "`VAR_DIR/kv-events-consumer.key`",
    ),
    "KV_EVENTS_RELAY_KEY_FILE": EnvVar(
        _E,
        "on each Ray node, the CURVE secret key of the KV-event relays beside its engines (created once there, mode "
        "0600; only its public key leaves the host)",
        "`VAR_DIR/kv-events-relay.key`",
    ),
    # --- Jobs and quotas ---------------------------------------------------------
    "PREWARM_CONCURRENCY": EnvVar(
        _J,
        "prompts a prewarm job keeps in flight at once, hottest first, on engines without a connector tier (through a "
        "connector tier: one at a time)",
    ),
    "JOB_STALE_AFTER_S": EnvVar(_J, "seconds after which a running job whose heartbeat stopped counts as lost"),
    "JOB_MAX_ATTEMPTS": EnvVar(_J, "attempts before a lost job is failed instead of retried"),
    "SHADOW_BACKLOG_MAX": EnvVar(
        _J,
        "shadow checks waiting for a worker beyond which a new live sample is dropped and counted "
        "(`kvcp_shadow_checks_dropped_total`), never queued",
    ),
    "TENANT_QUOTA_ENGINES": EnvVar(_J, "live engines serving one tenant's namespaces (0 forbids the kind)"),
    "TENANT_QUOTA_NAMESPACES": EnvVar(_J, "cache namespaces one tenant may hold (0 forbids the kind)"),
    "TENANT_QUOTA_GATEWAY_KEYS": EnvVar(_J, "gateway keys not revoked one tenant may hold (0 forbids the kind)"),
    "TENANT_QUOTA_PROMPT_TEMPLATES": EnvVar(_J, "prompt templates one tenant may hold (0 forbids the kind)"),
    "TENANT_QUOTA_JOBS": EnvVar(_J, "queued or running prewarm and comparison jobs of one tenant (0 forbids the kind)"),
    "TENANT_QUOTA_PREFIX_HEAT": EnvVar(
        _J, "distinct prompts in one namespace's prefix heat (a prompt already there still adds hits)"
    ),
    # --- Tiers and eviction ------------------------------------------------------
    "KV_STORE_ROOT": EnvVar(
        _T, "root of the hot disk tier (ExampleConnector); each namespace gets its own prefix below it", "`VAR_DIR/kv`"
    ),
    "KV_COLD_ROOT": EnvVar(
        _T, "cold tier: one compressed archive per demoted namespace; engines never read it", "`VAR_DIR/kv-cold`"
    ),
    "KV_REDIS_URL": EnvVar(_T, "Redis KV tier, e.g. `redis://127.0.0.1:6379/2`", "none: no Redis tier"),
    "EVICTION_NOTICE_S": EnvVar(_T, "seconds owners are told of a scheduled sweep before it may start"),
    "EVICTION_BATCH_ACTIONS": EnvVar(_T, "actions one task executes before it re-enqueues the run"),
    "EVICTION_ACTION_PAUSE_MS": EnvVar(_T, "pause between eviction actions in milliseconds"),
    "EVICTION_ENTRIES_PER_ACTION": EnvVar(_T, "keys listed in one `delete_entries` action"),
    "EVICTION_RETRY_S": EnvVar(_T, "seconds before a failed sweep (e.g. a tier unreachable) is resumed"),
    "ORPHAN_GRACE_S": EnvVar(
        _T, "seconds a storage prefix without a namespace must be idle before it is reported (and purged) as an orphan"
    ),
    "ADAPTER_UNUSED_DAYS": EnvVar(_T, "days an adapter no running engine used before it is reported as an orphan"),
    # --- E-mail ------------------------------------------------------------------
    "EMAIL_BACKEND": EnvVar(
        _M,
        "Django's e-mail backend for owners' digests and eviction notices (e.g. "
        "`django.core.mail.backends.smtp.EmailBackend` with `EMAIL_HOST` for real mail)",
    ),
    "EMAIL_FILE_PATH": EnvVar(_M, "where Django's file e-mail backend writes, one file per connection", "`VAR_DIR/mail`"),
    "EMAIL_HOST": EnvVar(_M, "SMTP server of the SMTP backend"),
    "EMAIL_PORT": EnvVar(_M, "SMTP port of the SMTP backend"),
    "EMAIL_HOST_USER": EnvVar(_M, "user name the SMTP backend signs in with (empty: no sign-in)"),
    "EMAIL_HOST_PASSWORD": EnvVar(_M, "password the SMTP backend signs in with"),
    "EMAIL_USE_TLS": EnvVar(_M, "the SMTP backend starts TLS on the connection (STARTTLS, usually port 587)"),
    "EMAIL_USE_SSL": EnvVar(_M, "the SMTP backend connects over implicit TLS (usually port 465)"),
    "EMAIL_TIMEOUT": EnvVar(_M, "seconds an SMTP connection may block"),
    "DEFAULT_FROM_EMAIL": EnvVar(_M, "sender of the control plane's e-mail"),
    # --- Gateway -----------------------------------------------------------------
    "GATEWAY_ADDR": EnvVar(_G, "`HOST:PORT` where `manage.py gateway` listens"),
    "GATEWAY_WORKERS": EnvVar(_G, "gateway processes (uvicorn workers); they share the caches' stores"),
    "GATEWAY_WORKER_HEALTHCHECK_S": EnvVar(
        _G,
        "seconds a gateway process may leave the supervisor's health ping unanswered before it is replaced, its open "
        "connections cut",
    ),
    "GATEWAY_REDIS_URL": EnvVar(
        _G,
        "the response and semantic caches' shared store in scale-out, a Redis database of its own (e.g. "
        "`redis://127.0.0.1:6379/3`)",
        "none: SQLite files under `GATEWAY_DIR`",
    ),
    "GATEWAY_DIR": EnvVar(_G, "the embedded default's cache stores", "`VAR_DIR/gateway`"),
    "GATEWAY_SEMANTIC": EnvVar(_G, "the semantic cache layer (each gateway process loads a ~90 MB embedding model)"),
    "GATEWAY_SEMANTIC_RULES": EnvVar(
        _G,
        'the semantic layer\'s admission rules as JSON, a list of `{"name", "pattern"}` (replaces the shipped ones; '
        "`[]`: none); a bad value stops the gateway at start",
        "the shipped rules",
    ),
    "GATEWAY_RATE_PER_S": EnvVar(_G, "a gateway key's token bucket rate (requests per second) when the key sets none"),
    "GATEWAY_BURST": EnvVar(_G, "a gateway key's token bucket burst when the key sets none"),
    "GATEWAY_ENGINE_MAX_IN_FLIGHT": EnvVar(
        _G, "requests one gateway process keeps in flight per engine; past it requests are shed with 503"
    ),
    "GATEWAY_ENGINE_CHOICE": EnvVar(
        _G,
        "how a gateway picks an engine of a namespace: `precise` (by the blocks engines hold; affinity per request "
        "where it cannot predict), `affinity` or `round_robin`",
    ),
    "GATEWAY_PREFIX_INDEX_POLL_S": EnvVar(_G, "how often (seconds) a gateway process reads the block index for changed engines"),
    "GATEWAY_PREFIX_INDEX_STALE_S": EnvVar(_G, "seconds after which an engine's published blocks are not used for routing"),
    "GATEWAY_PREFIX_SPECULATIVE_TTL_S": EnvVar(
        _G, "seconds a request's blocks count as held by the engine just chosen for it, before its KV events say so"
    ),
    "GATEWAY_ROUTING_LOAD_WEIGHT": EnvVar(
        _G, "weight of an engine's requests in flight against its cached blocks in the precise choice"
    ),
    "GATEWAY_EPOCH_POLL_MS": EnvVar(_G, "how often (milliseconds) each gateway process reads the routing epoch"),
    "GATEWAY_SNAPSHOT_MAX_AGE_S": EnvVar(
        _G,
        "seconds between two resolutions of the engines' host names by each gateway process (the routing snapshot itself "
        "changes only when the routing epoch moves)",
    ),
    "GATEWAY_FLUSH_S": EnvVar(_G, "how often (seconds) a gateway process writes its figures and prefix heat"),
    "GATEWAY_HEADER_TIMEOUT_S": EnvVar(
        _G,
        "seconds a request's headers may take from the connection's start (on a kept-alive connection, from the next "
        "request's first byte); past it: 408 and the connection closes",
    ),
    "GATEWAY_BODY_TIMEOUT_S": EnvVar(
        _G, "seconds a request's body may take after its headers; past it: 408 and the connection closes"
    ),
    "GATEWAY_KEEPALIVE_S": EnvVar(
        _G,
        "seconds a connection may stay idle between requests before the gateway closes it; keep it above clients' own "
        "idle times (httpx and OpenAI's SDK: 5 s) and a load balancer's idle timeout",
        "75 (nginx's `keepalive_timeout`)",
    ),
    "GATEWAY_CONNECTIONS_PER_CLIENT": EnvVar(
        _G,
        "open connections one client address may hold in each gateway process; the next gets 429 (0: no cap; behind "
        "a proxy, let the proxy limit)",
    ),
    # --- Metrics -----------------------------------------------------------------
    "METRICS_TOKEN": EnvVar(
        _P,
        "bearer token of every `/metrics` endpoint (at least 32 visible ASCII characters; `manage.py metrics_token` prints it)",
    ),
    "METRICS_MULTIPROC_DIR": EnvVar(
        _P,
        "prometheus-client's multiprocess folder of the control plane's processes (web and Celery workers)",
        "`VAR_DIR/metrics/control`",
    ),
    "GATEWAY_METRICS_DIR": EnvVar(
        _P,
        "prometheus-client's multiprocess folder of the gateways (one sub-folder per `manage.py gateway`)",
        "`VAR_DIR/metrics/gateway`",
    ),
    "METRICS_ADDR": EnvVar(
        _P,
        "`HOST:PORT` (`[::1]:9466` for IPv6) where `manage.py metrics_serve` serves the control plane's metrics without a token",
        "none: off",
    ),
    "KV_EVENTS_METRICS_ADDR": EnvVar(
        _P, "`HOST:PORT` where the KV-event consumer that `manage.py demo` starts serves its metrics (empty: none)"
    ),
    # --- Demo server ---------------------------------------------------------------
    "DEMO_MODEL": EnvVar(_D, "the model `manage.py demo` runs on without `--model`: `smollm2` (SmolLM2-135M-Instruct) or `tiny`"),
    "DEMO_ADMIN_PASSWORD": EnvVar(
        _D,
        "the demo's admin password; unset: the one kept in `VAR_DIR/admin-password`, created once",
        "none",
    ),
    "GUNICORN_BIND": EnvVar(_D, "where `manage.py demo` serves: `HOST:PORT` or `unix:PATH` (`--addr` overrides)"),
    "GUNICORN_WORKERS": EnvVar(_D, "gunicorn worker processes of `manage.py demo`", "2 × usable CPU cores + 1"),
    "GUNICORN_THREADS": EnvVar(_D, "request threads in each gunicorn worker (more than 1 selects the `gthread` worker)"),
    "GUNICORN_TIMEOUT_S": EnvVar(_D, "seconds a silent gunicorn worker may take before it is killed and replaced"),
    "GUNICORN_GRACEFUL_TIMEOUT_S": EnvVar(_D, "on SIGTERM, seconds gunicorn workers may take to finish their requests and exit"),
    # --- Logging -------------------------------------------------------------------
    "LOG_LEVEL": EnvVar(_L, "level of the `cacheadmin` and `inference` loggers (Python logging level names)"),
}
