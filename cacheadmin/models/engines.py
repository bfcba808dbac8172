"""Inference engines the control plane launched or knows about."""

from __future__ import annotations

from django.db import models

from cacheadmin.models.gateway import RoutingQuerySet


def verification_as_of(status: str, verification: str) -> str:
    """An engine's verification as it holds now: as recorded while the engine is starting or ready
    (or never verified); for a failed, stopped or lost engine ``verification stale (was verified)``,
    since a verification vouches for the process it checked, and that process is gone. The pages
    and ``manage.py engine list`` both say this."""
    if status in ("ready", "starting") or verification == "unverified":
        return verification
    return f"verification stale (was {verification})"


class Engine(models.Model):
    """One vLLM server: which model version it computes with, which namespace
    its persistent tier belongs to, and where it runs.

    ``kv_storage_path`` is the hot persistent tier (vLLM ExampleConnector
    directory) or empty for none. ``identity_override`` is set only when an
    operator deliberately served a namespace of another identity (the unsafe
    upgrade the demo reproduces); it records who allowed it and why.
    """

    class Role(models.TextChoices):
        SERVING = "serving"
        REFERENCE = "reference"

    class Status(models.TextChoices):
        STARTING = "starting"
        READY = "ready"
        STOPPED = "stopped"
        FAILED = "failed"
        #: Its host stopped answering (a Ray node declared dead, a pod gone): drained from
        #: routing, its residency dropped, its running jobs requeued. Never routed to again;
        #: a restart starts a new incarnation elsewhere or on the host once it is back.
        LOST = "lost"

    class Origin(models.TextChoices):
        #: Started by the control plane on this host; it owns the process.
        LOCAL = "local"
        #: A running server the control plane registered by URL (a GPU host,
        #: a Kubernetes service); it verifies and watches it, never starts it.
        ADOPTED = "adopted"
        #: Started by the control plane on a node of its Ray cluster, inside a named detached actor
        #: (Ray namespace ``kvcp``, actor name = the engine's name) that owns the process.
        RAY = "ray"

    class Verification(models.TextChoices):
        UNVERIFIED = "unverified"
        VERIFIED = "verified"
        #: What the engine reports differs from the model version's identity.
        REFUSED = "refused"
        #: Verified once, then a re-check found it changed (restarted on other
        #: weights or flags): out of service until it verifies again.
        DRIFTED = "drifted"
        UNREACHABLE = "unreachable"
        #: A re-check of a verified engine whose failed checks are all readings it
        #: could not take properly (a source that did not answer, metrics mixed with
        #: other processes'): nothing says the engine changed. Recorded on the
        #: verification only; the engine keeps its verified state and its traffic.
        INCONCLUSIVE = "inconclusive"

    #: Persistent tiers an engine can be started with: the namespace's disk
    #: tier (when the layout names a connector) or none (engine memory only).
    START_TIERS = (("disk", "disk"), ("none", "none"))

    class RestartPolicy(models.TextChoices):
        NEVER = "never"
        ON_FAILURE = "on_failure"

    objects = RoutingQuerySet.as_manager()
    #: Writes of these alone change no routing decision (health clocks, logs, facts).
    ROUTING_IGNORED_FIELDS = frozenset({
        "health_checked_at", "health_failures", "error", "pid", "pid_started", "next_restart_at", "restart_attempts",
        "start_seconds", "log_path", "verified_at", "verified_facts",
    })  # fmt: skip

    name = models.CharField(max_length=100, unique=True)
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.SERVING)
    model_version = models.ForeignKey("cacheadmin.ModelVersion", on_delete=models.PROTECT, related_name="engines")
    namespace = models.ForeignKey(
        "cacheadmin.CacheNamespace", null=True, blank=True, on_delete=models.PROTECT, related_name="engines"
    )
    #: More namespaces served from engine memory only, isolated by cache_salt;
    #: never on an engine whose persistent tier ignores the salt.
    attached_namespaces = models.ManyToManyField("cacheadmin.CacheNamespace", blank=True, related_name="attached_engines")
    base_url = models.CharField(max_length=200)
    pid = models.IntegerField(null=True, blank=True)
    prefix_caching = models.BooleanField(default=True)
    kv_connector = models.CharField(max_length=64, blank=True, default="")
    kv_storage_path = models.CharField(max_length=1000, blank=True, default="")
    log_path = models.CharField(max_length=1000, blank=True, default="")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.STARTING)
    identity_override = models.TextField(blank=True, default="")
    error = models.TextField(blank=True, default="")
    start_seconds = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    origin = models.CharField(max_length=16, choices=Origin.choices, default=Origin.LOCAL)
    #: ``/metrics`` of the engine; empty means ``{base_url}/metrics``.
    metrics_url = models.CharField(max_length=200, blank=True, default="")
    #: ZMQ address of the engine's KV-event stream, empty for none; the
    #: consumer connects to it. A local engine binds ``ipc://`` sockets in a
    #: private directory; an adopted one's stream comes from a CURVE relay
    #: beside it (``kv_events_key``).
    kv_events_endpoint = models.CharField(max_length=200, blank=True, default="")
    kv_events_replay_endpoint = models.CharField(max_length=200, blank=True, default="")
    kv_events_topic = models.CharField(max_length=100, blank=True, default="")
    #: For an engine on another host: the CURVE public key (Z85) of the relay
    #: that publishes its stream (inference.kv_transport); "" for a local
    #: engine, whose IPC sockets lie in a private directory.
    kv_events_key = models.CharField(max_length=40, blank=True, default="")
    #: Incremented at every start of the process: a consumer's saved state of
    #: an earlier incarnation is dropped (a new process has an empty cache).
    generation = models.PositiveIntegerField(default=0)
    #: When the process at ``pid`` started (clock ticks after boot, /proc/PID/stat
    #: field 22): a pid reused by another process is never taken for this engine's.
    pid_started = models.BigIntegerField(null=True, blank=True)
    #: Started detached from the process that asked (CLI, API worker): it
    #: outlives that process and is stopped by pid.
    detached = models.BooleanField(default=False)
    restart_policy = models.CharField(max_length=16, choices=RestartPolicy.choices, default=RestartPolicy.NEVER)
    restart_max_attempts = models.PositiveIntegerField(default=3)
    restart_backoff_s = models.PositiveIntegerField(default=10, help_text="seconds before the first restart; doubles")
    restart_attempts = models.PositiveIntegerField(default=0, help_text="restarts since the last healthy check")
    next_restart_at = models.DateTimeField(null=True, blank=True)
    health_checked_at = models.DateTimeField(null=True, blank=True)
    health_failures = models.PositiveIntegerField(default=0, help_text="consecutive health checks that failed")
    verification = models.CharField(max_length=16, choices=Verification.choices, default=Verification.UNVERIFIED)
    verified_at = models.DateTimeField(null=True, blank=True)
    #: What the engine reported when it last verified (the drift baseline).
    verified_facts = models.JSONField(null=True, blank=True)
    #: The host it runs on: this machine's name for a local engine, the Ray node's host
    #: label for a Ray engine, the pod's node or the URL's host for an adopted one.
    host = models.CharField(max_length=200, blank=True, default="", db_index=True)
    #: The Ray node (hex id) holding a Ray engine's actor; a node declared dead loses the engine.
    ray_node_id = models.CharField(max_length=64, blank=True, default="")
    #: The Kubernetes InferencePool an adopted pod came from (kept in step by the pool's sync).
    inference_pool = models.ForeignKey(
        "cacheadmin.InferencePool", null=True, blank=True, on_delete=models.SET_NULL, related_name="engines"
    )

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.name

    #: KV connectors whose persistent tier keys on token ids alone, ignoring
    #: cache_salt. Measured on vLLM 0.32: a request under tenant B's salt loaded
    #: 640 tokens of tenant A's KV from ExampleConnector's disk tier. LMCache's
    #: connectors leave the salt out of their keys too (LMCache issue #2878;
    #: vLLM 0.32 ``lmcache_integration/vllm_v1_adapter.py``; see
    #: inference/engines/gpu_spec.py).
    SALT_BLIND_CONNECTORS = frozenset({"ExampleConnector", "LMCacheConnectorV1", "LMCacheMPConnector"})
    #: KV connectors known to key their tier on vLLM's block hashes, which carry
    #: cache_salt in a request's first block (vLLM 0.32 offloading/scheduler.py
    #: ``make_offload_key(req.block_hashes…)``). An adopted engine serves a
    #: namespace only with none of them or one of these: any other is unknown.
    SALT_AWARE_CONNECTORS = frozenset({"OffloadingConnector"})

    @property
    def salt_blind_tier(self) -> bool:
        """True when this engine's persistent tier ignores cache_salt (one namespace only)."""
        return self.kv_connector in self.SALT_BLIND_CONNECTORS

    @property
    def verification_now(self) -> str:
        """:func:`verification_as_of` this engine's status and recorded verification."""
        return verification_as_of(self.status, self.verification)

    def tier_absent_reason(self) -> str:
        """Why this engine has no persistent tier (its page says it beside "engine memory only").

        An engine started with the default tier ``disk`` gets one only when its model version's
        layout names a KV connector (``engine_create``): a version registered without
        ``--kv-connector`` serves from engine memory whatever the start asked for."""
        if self.kv_connector:
            return ""
        if self.origin == self.Origin.ADOPTED:
            return "this adopted engine has no KV connector (as declared and probed when it was adopted)"
        if self.role == self.Role.REFERENCE or self.namespace_id is None:
            return "a reference engine has no prefix caching and no tier"
        if not self.model_version.kv_connector:
            return (
                f"model version {self.model_version.label}'s layout names no KV connector, so it has no disk tier "
                "to start with (a version registered with --kv-connector ExampleConnector has one)"
            )
        return "it was started with tier none"

    #: Origins whose process this control plane starts, stops and restarts.
    MANAGED_ORIGINS = frozenset({Origin.LOCAL, Origin.RAY})

    @property
    def managed(self) -> bool:
        """True when this control plane owns the engine's process (here, or in a Ray actor on another host)."""
        return self.origin in self.MANAGED_ORIGINS

    @property
    def in_service(self) -> bool:
        """Ready and verified against its model version's identity: requests may be routed to it."""
        return self.status == self.Status.READY and self.verification == self.Verification.VERIFIED

    def unusable_reason(self) -> str | None:
        """Why no job may send requests to this engine now, or None: it must be
        ready, not known to compute something other than its identity, and not
        silent at its last verification. Unverified is allowed: prewarming or
        comparing a new engine before traffic moves to it is a release step.
        Prewarm and comparison jobs (page, API, CLI) and shadow checks ask this."""
        if self.status != self.Status.READY:
            return f"engine {self.name} is {self.status}, not ready"
        if self.verification == self.Verification.UNREACHABLE:
            return (
                f"engine {self.name} did not answer its last verification: "
                f"verify it again (`engine verify {self.pk}`) once it answers"
            )
        if self.verification in (self.Verification.REFUSED, self.Verification.DRIFTED):
            return (
                f"engine {self.name} is {self.verification}: it does not compute what its identity says "
                f"(see its verification; `engine verify {self.pk}` after fixing it)"
            )
        return None

    def witness_refusal(self) -> str | None:
        """Why this engine may not judge a cache as a comparison's reference
        now, or None: it must be usable (:meth:`unusable_reason`) and, being a
        reference engine that every tenant's prompts go to, verified against
        its identity (an unverified witness could be anything behind an address)."""
        if (why := self.unusable_reason()) is not None:
            return why
        if self.role == self.Role.REFERENCE and self.verification != self.Verification.VERIFIED:
            return (
                f"reference engine {self.name} is {self.verification}: a tenant's prompts go only to a reference engine "
                f"verified against its identity (`engine verify {self.pk}`)"
            )
        return None

    @property
    def effective_metrics_url(self) -> str:
        """Where the engine's Prometheus metrics are read."""
        return self.metrics_url or f"{self.base_url.rstrip('/')}/metrics"

    def shared_reason(self) -> str | None:
        """What makes this engine shared by several tenants, or None: a
        reference engine (every tenant's comparisons and shadow checks run on
        it) or an engine serving a shared group's namespace. Only a principal
        not bound to a tenant changes a shared engine."""
        if self.role == self.Role.REFERENCE:
            return f"engine {self.name} is a reference engine, shared by every tenant"
        served = ([self.namespace] if self.namespace_id else []) + list(self.attached_namespaces.all())
        if any(ns.group_id is not None for ns in served):
            return f"engine {self.name} serves a shared group's namespace"
        return None

    def serves(self, namespace_pk: int) -> bool:
        """Whether requests of this namespace may run on this engine."""
        return namespace_pk == self.namespace_id or self.attached_namespaces.filter(pk=namespace_pk).exists()


class EngineVerification(models.Model):
    """One check of what an engine reports against its model version's identity.

    ``checks`` is a list of ``{"field", "source", "expected", "observed", "ok"}``
    in a fixed order (see :mod:`inference.engines.verify`); ``outcome`` is
    ``verified`` when every check passed.
    """

    engine = models.ForeignKey(Engine, on_delete=models.CASCADE, related_name="verifications")
    outcome = models.CharField(max_length=16, choices=Engine.Verification.choices)
    trigger = models.CharField(max_length=32, help_text="start, adopt, manual, schedule")
    identity = models.CharField(max_length=64, help_text="the model version's identity it was checked against")
    checks = models.JSONField(default=list)
    error = models.TextField(blank=True, default="")
    actor = models.CharField(max_length=200)
    checked_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-checked_at", "-id"]

    def __str__(self) -> str:
        return f"verification of engine {self.engine_id}: {self.outcome}"

    @property
    def failed_checks(self) -> list[dict]:
        """The checks that did not pass."""
        return [c for c in self.checks if not c.get("ok")]


class EngineAlarm(models.Model):
    """Something about an engine an operator must look at, open until resolved.

    One open row per (engine, kind, key): a repeat raises ``count`` and
    ``last_seen_at``. ``key`` separates occurrences of one kind (a digest of
    an unknown salt, never the salt itself).
    """

    class Kind(models.TextChoices):
        #: Blocks stored under a cache_salt that belongs to no namespace.
        UNKNOWN_SALT = "isolation_unknown_salt"
        #: Blocks stored without a salt on an engine serving several namespaces.
        NO_SALT = "isolation_no_salt"
        #: Blocks stored under the salt of a namespace this engine does not serve.
        FOREIGN_NAMESPACE = "isolation_foreign_namespace"
        #: A re-verification found the engine changed.
        DRIFT = "verification_drift"
        #: The process died or the health endpoint went silent.
        HEALTH = "health"
        #: The engine's host was lost (its Ray node declared dead): the engine was drained.
        HOST_LOST = "host_lost"
        #: Sequence numbers skipped and replay could not fill the gap.
        KV_EVENTS_GAP = "kv_events_gap"
        #: Frames that are not vLLM KV-event batches.
        KV_EVENTS_GARBAGE = "kv_events_garbage"
        #: Shadow verification of live traffic: a reported cache hit whose
        #: answer diverged from a reference engine's beyond the control's noise.
        DECEPTIVE_HIT = "deceptive_hit"

    ISOLATION_KINDS = frozenset({Kind.UNKNOWN_SALT, Kind.NO_SALT, Kind.FOREIGN_NAMESPACE})

    engine = models.ForeignKey(Engine, on_delete=models.CASCADE, related_name="alarms")
    kind = models.CharField(max_length=40, choices=Kind.choices)
    key = models.CharField(max_length=64, blank=True, default="")
    detail = models.TextField(blank=True, default="")
    count = models.PositiveIntegerField(default=1)
    first_seen_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField(auto_now_add=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        ordering = ["-last_seen_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["engine", "kind", "key"], condition=models.Q(resolved_at__isnull=True), name="engine_alarm_one_open"
            )
        ]

    def __str__(self) -> str:
        return f"{self.kind} on engine {self.engine_id}"

    @property
    def isolation(self) -> bool:
        """An isolation alarm (pages): another namespace's or nobody's KV in this engine."""
        return self.kind in self.ISOLATION_KINDS


class KvEventStream(models.Model):
    """The KV-event consumer's view of one engine's stream, saved every few seconds.

    ``state`` is the consumer's checkpoint (msgpack, :mod:`inference.kv_events`):
    resident blocks by hash with their namespace, so a restarted consumer
    resumes from ``last_seq`` and replays the rest from the engine.
    """

    engine = models.OneToOneField(Engine, on_delete=models.CASCADE, related_name="kv_stream")
    generation = models.PositiveIntegerField(default=0, help_text="the engine incarnation this state belongs to")
    last_seq = models.BigIntegerField(null=True, blank=True)
    events = models.BigIntegerField(default=0, help_text="events applied since this incarnation started")
    gaps = models.PositiveIntegerField(default=0)
    unconfirmed = models.PositiveIntegerField(
        default=0, help_text="batches dropped because the engine's replay did not confirm them (a clear, an alarm, a jump)"
    )
    garbage = models.PositiveIntegerField(default=0, help_text="frames that did not decode")
    replays = models.PositiveIntegerField(default=0)
    restarts_seen = models.PositiveIntegerField(default=0, help_text="sequence resets seen (engine restarts)")
    #: False after a gap no replay could fill: counts are a lower bound until
    #: the engine clears its cache.
    complete = models.BooleanField(default=True)
    cleared_at = models.DateTimeField(
        null=True, blank=True, help_text="last AllBlocksCleared seen (it empties engine memory, GPU, only)"
    )
    #: What that AllBlocksCleared left resident: ``{"<namespace id or 0>": {medium: blocks}}`` of
    #: the offloaded media (CPU, STORAGE), which vLLM keeps across a reset (inference/kv_events.py).
    cleared_kept = models.JSONField(
        default=dict, blank=True, help_text="blocks per namespace and medium the last AllBlocksCleared did not drop"
    )
    last_event_at = models.DateTimeField(null=True, blank=True)
    consumer = models.CharField(max_length=200, blank=True, default="", help_text="host:pid of the consumer")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    state = models.BinaryField(null=True, blank=True)

    def __str__(self) -> str:
        return f"KV events of engine {self.engine_id}"


class ResidentSample(models.Model):
    """Resident KV blocks and tokens of one namespace in one engine's memory, at one time.

    ``namespace`` null: blocks the consumer could not attribute (their chain's
    first block was never seen, e.g. stored before a gap).
    """

    engine = models.ForeignKey(Engine, on_delete=models.CASCADE, related_name="resident_samples")
    namespace = models.ForeignKey(
        "cacheadmin.CacheNamespace", null=True, blank=True, on_delete=models.CASCADE, related_name="resident_samples"
    )
    medium = models.CharField(max_length=16, default="GPU", help_text="vLLM's medium: GPU (engine memory), CPU, STORAGE")
    sampled_at = models.DateTimeField(db_index=True)
    blocks = models.BigIntegerField()
    tokens = models.BigIntegerField()

    class Meta:
        ordering = ["-sampled_at", "-id"]
        indexes = [models.Index(fields=["engine", "-sampled_at"], name="resident_engine_time")]

    def __str__(self) -> str:
        return f"{self.tokens} tokens of namespace {self.namespace_id} on engine {self.engine_id}"


class InferencePool(models.Model):
    """A Gateway API ``InferencePool`` (``inference.networking.k8s.io/v1``) whose vLLM pods
    the control plane adopts and keeps in step: pods added are adopted and verified against
    ``model_version``, pods gone are stopped (taken out of service), on a schedule.

    The pool's controller (KServe, llm-d, a Deployment) runs the pods; the control plane
    never creates or deletes one.
    """

    k8s_namespace = models.CharField(max_length=63)
    name = models.CharField(max_length=253)
    model_version = models.ForeignKey("cacheadmin.ModelVersion", on_delete=models.PROTECT, related_name="inference_pools")
    #: The cache namespace its pods serve; None adopts them as reference engines.
    namespace = models.ForeignKey(
        "cacheadmin.CacheNamespace", null=True, blank=True, on_delete=models.PROTECT, related_name="inference_pools"
    )
    kv_connector = models.CharField(max_length=64, blank=True, default="")
    active = models.BooleanField(default=True, help_text="kept in step by the schedule")
    synced_at = models.DateTimeField(null=True, blank=True)
    #: The last sync's problem ("" when it went through): an unreachable API, a pod refused.
    sync_error = models.TextField(blank=True, default="")
    created_by = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["k8s_namespace", "name"]
        constraints = [models.UniqueConstraint(fields=["k8s_namespace", "name"], name="inference_pool_unique")]

    def __str__(self) -> str:
        return f"{self.k8s_namespace}/{self.name}"
