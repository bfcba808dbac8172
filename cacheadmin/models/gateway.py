"""The data plane's state in the control plane: gateway keys, the routing
epoch gateways watch, the cache layers' switches and policies, what the
gateways record (per namespace and layer) and live shadow verification."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from django.db import IntegrityError, models, transaction
from django.db.models import F

#: What a routing change touched, as :class:`RoutingChange` rows name it: a tenant (its entry, keys and
#: routes), a namespace (its entry), or a whole small section; ``all`` asks for a full rebuild.
SECTIONS = ("tenant", "namespace", "engines", "layers", "not_paying", "templates", "all")
#: Epochs of changes kept (the oldest are pruned every :data:`PRUNE_EVERY` epochs): a gateway further
#: behind than this rebuilds its snapshot whole.
CHANGES_KEPT, PRUNE_EVERY = 10_000, 100
#: Rows a bulk update or delete names one by one; more, and the change is recorded as ``all``.
BULK_NAMED = 100

#: Per routing model (``app_label.model_name``): the sections its rows touch, each with the field that
#: names the entry (None: the whole section). A model not listed here touches everything (``all``).
ROUTING_SCOPES: dict[str, tuple[tuple[str, str | None], ...]] = {
    "cacheadmin.tenant": (("tenant", "pk"),),
    "cacheadmin.tenantgatewaypolicy": (("tenant", "tenant_id"),),
    "cacheadmin.gatewaykey": (("tenant", "tenant_id"),),
    "cacheadmin.release": (("tenant", "tenant_id"),),
    # A namespace's own entry, and its tenant's routes (those served without a release point at it).
    "cacheadmin.cachenamespace": (("tenant", "tenant_id"), ("namespace", "pk")),
    "cacheadmin.retentionpolicy": (("namespace", "namespace_id"),),
    "cacheadmin.namespacerouting": (("namespace", "namespace_id"),),
    "cacheadmin.engine": (("engines", None),),
    "cacheadmin.engine_attached_namespaces": (("engines", None),),
    "cacheadmin.cachelayerswitch": (("layers", None),),
    "cacheadmin.layernotpaying": (("not_paying", None),),
    "cacheadmin.prompttemplate": (("templates", None),),
}

#: One change: (section, entry id or None for the whole section).
Change = tuple[str, int | None]


def routing_scope(model: type[models.Model], rows: Iterable[Any] | None) -> list[Change]:
    """The changes that writing ``rows`` of ``model`` makes (None: rows unknown, e.g. more than
    :data:`BULK_NAMED` of them): each row's entry in each section :data:`ROUTING_SCOPES` gives the
    model, ``("all", None)`` for a model it does not list. A row is an instance, or a mapping of the
    scope's fields (as ``values()`` returns)."""
    scopes = ROUTING_SCOPES.get(model._meta.label_lower)
    if scopes is None:
        return [("all", None)]
    out: set[Change] = set()
    for section, field in scopes:
        if field is None:
            out.add((section, None))
        elif rows is None:
            out.add(("all", None))  # entries not known: a full rebuild
        else:
            for row in rows:
                ref = row.get(field) if isinstance(row, dict) else getattr(row, field)
                if ref is None and field == "pk":
                    out.add(("all", None))  # a row not saved yet (no id): nothing to name it by
                elif ref is not None:
                    out.add((section, int(ref)))
    return sorted(out, key=lambda c: (c[0], -1 if c[1] is None else c[1])) or [("all", None)]


def _record_pending(changes: Sequence[Change], model: str) -> None:
    # In the writer's own transaction: committed with its data or not at all, so a change the epoch
    # never counted (its process died after the commit, or the bump's connection failed) is still
    # on record, unstamped, for the next bump or :func:`routing_changes_recover` to count.
    RoutingChange.objects.bulk_create(
        [RoutingChange(epoch=None, model=model[:64], section=section, ref=ref) for section, ref in changes]
    )


def _bump_routing_epoch() -> int | None:
    """Move the epoch once over every committed change no epoch counted yet (stamping them with it).

    One transaction: the epoch and what it changed are seen together or not at all; the epoch's row
    lock orders concurrent bumps, so each epoch's rows are complete once it is visible.

    Returns:
        The new epoch, or None when nothing was pending (another bump counted these changes already:
        the epoch does not move, so no gateway sees an epoch without rows).
    """
    with transaction.atomic():
        if not RoutingEpoch.objects.filter(pk=1).update(value=F("value") + 1):
            try:
                with transaction.atomic():
                    RoutingEpoch.objects.create(pk=1, value=1)
            except IntegrityError:  # created concurrently: count this change on it
                RoutingEpoch.objects.filter(pk=1).update(value=F("value") + 1)
        epoch = RoutingEpoch.objects.filter(pk=1).values_list("value", flat=True).get()
        if not RoutingChange.objects.filter(epoch__isnull=True).update(epoch=epoch):
            transaction.set_rollback(True)
            return None
        if epoch % PRUNE_EVERY == 0:
            RoutingChange.objects.filter(epoch__lte=epoch - CHANGES_KEPT).delete()
    return epoch


def routing_changes_recover() -> int | None:
    """Count the committed routing changes whose epoch move was lost (their writer died between its
    commit and the move, or the move's connection failed): one epoch for all of them.

    Scheduled with the lost-job recovery (``jobs-recover-lost``); a bump by any later change counts them
    too. Returns the epoch they got, or None when none were waiting.
    """
    return _bump_routing_epoch()


def routing_changed(changes: Sequence[Change] = (), *, model: str = "") -> None:
    """Tell every gateway that routing may have changed: the change is recorded in the current
    transaction, and the epoch moves when it commits (at once outside one), so a gateway never
    rebuilds from a state that is rolled back, and a move lost after the commit is recovered
    (:func:`routing_changes_recover`).

    Args:
        changes: what changed (:func:`routing_scope`); none: everything (a full rebuild).
        model: the model written (``app_label.model_name``), recorded for operators.
    """
    _record_pending(list(changes) or [("all", None)], model)
    transaction.on_commit(_bump_routing_epoch)


def routing_relevant(model: type[models.Model], fields: Iterable[str] | None) -> bool:
    """Whether writing ``fields`` of ``model`` (None: every field) can change a routing decision.

    A model lists the fields that cannot in ``ROUTING_IGNORED_FIELDS``
    (an engine's health-check clock, say): writes of those alone do not make
    every gateway rebuild its snapshot.
    """
    if fields is None:
        return True
    ignored = getattr(model, "ROUTING_IGNORED_FIELDS", frozenset())
    return not set(fields) <= ignored


def _scope_fields(model: type[models.Model]) -> list[str]:
    return sorted({field for _, field in ROUTING_SCOPES.get(model._meta.label_lower, ()) if field is not None})


class RoutingQuerySet(models.QuerySet):
    """The queryset of every model a routing snapshot is built from: bulk
    updates and deletes (which send no save/delete signals) move the routing
    epoch too, so no service can change routing without the gateways hearing.
    The rows they touch are read first (up to :data:`BULK_NAMED`), so the
    gateways update those entries only."""

    def _named(self) -> list[dict[str, Any]] | None:
        fields = _scope_fields(self.model)
        if not fields:
            return []
        rows = list(self.values(*fields)[: BULK_NAMED + 1])
        return rows if len(rows) <= BULK_NAMED else None

    def _changed(self, rows: Iterable[Any] | None) -> None:
        routing_changed(routing_scope(self.model, rows), model=self.model._meta.label_lower)

    def update(self, **kwargs: Any) -> int:
        relevant = routing_relevant(self.model, kwargs)
        rows = self._named() if relevant else []
        changed = super().update(**kwargs)
        if changed and relevant:
            self._changed(rows)
        return changed

    def delete(self) -> tuple[int, dict[str, int]]:
        rows = self._named()
        deleted = super().delete()
        if deleted[0]:
            self._changed(rows)
        return deleted

    def bulk_create(self, objs: Iterable[models.Model], *args: Any, **kwargs: Any) -> list[models.Model]:
        created = super().bulk_create(objs, *args, **kwargs)
        if created:
            self._changed(created if len(created) <= BULK_NAMED else None)
        return created

    def bulk_update(self, objs: Iterable[models.Model], fields: Iterable[str], *args: Any, **kwargs: Any) -> int:
        fields, objs = list(fields), list(objs)
        changed = super().bulk_update(objs, fields, *args, **kwargs)
        if changed and routing_relevant(self.model, fields):
            self._changed(objs if len(objs) <= BULK_NAMED else None)
        return changed


class GatewayKey(models.Model):
    """A caller's key for the gateway, ``kvgw_<prefix>_<secret>``, bound to one
    tenant; only a SHA-256 of the secret is stored, the key is shown once.

    ``rate_per_s``/``burst`` size the key's token bucket (None: the gateway's
    defaults, ``GATEWAY_RATE_PER_S`` and ``GATEWAY_BURST``).
    """

    objects = RoutingQuerySet.as_manager()

    tenant = models.ForeignKey("cacheadmin.Tenant", on_delete=models.CASCADE, related_name="gateway_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64, unique=True)
    rate_per_s = models.FloatField(null=True, blank=True)
    burst = models.PositiveIntegerField(null=True, blank=True)
    created_by = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.name} ({self.tenant.slug}, {self.prefix})"


class RoutingEpoch(models.Model):
    """One row (pk 1) whose ``value`` grows with every change that can alter a
    routing decision; each gateway process polls it and rebuilds its in-memory
    snapshot when it moved, so the hot path never queries the database."""

    value = models.BigIntegerField(default=0)
    changed_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"routing epoch {self.value}"


class RoutingChange(models.Model):
    """What one routing epoch changed: written in the changing transaction and stamped by the epoch's move, one row per
    entry (see :data:`SECTIONS`), so a gateway updates only those entries of its snapshot. Pruned to
    the last :data:`CHANGES_KEPT` epochs; a gateway that finds an epoch it missed without rows rebuilds whole.
    """

    #: None from the writer's transaction until an epoch counts the change (its writer's bump, a later
    #: bump, or :func:`routing_changes_recover`).
    epoch = models.BigIntegerField(db_index=True, null=True, blank=True)
    model = models.CharField(max_length=64, blank=True, default="")
    section = models.CharField(max_length=16)
    ref = models.BigIntegerField(null=True, blank=True)

    def __str__(self) -> str:
        return f"routing epoch {self.epoch}: {self.section} {self.ref if self.ref is not None else '(all)'}"


class CacheLayer(models.TextChoices):
    """The cache layers in front of the engines, as gateways record them."""

    RESPONSE = "response", "response cache (request level)"
    SEMANTIC = "semantic", "semantic cache"
    PREFIX = "prefix", "engine prefix cache"


class CacheLayerSwitch(models.Model):
    """The kill switch of one gateway cache layer, for every tenant: off means
    every request bypasses the layer (reason ``kill_switch``), at once."""

    objects = RoutingQuerySet.as_manager()

    layer = models.CharField(max_length=16, choices=CacheLayer.choices, unique=True)
    enabled = models.BooleanField(default=True)
    reason = models.TextField(blank=True, default="")
    changed_by = models.CharField(max_length=200, blank=True, default="")
    changed_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.layer}: {'on' if self.enabled else 'off'}"


class TenantGatewayPolicy(models.Model):
    """How a tenant's traffic uses the gateway's cache layers (defaults apply
    to a tenant without a row; see :data:`DEFAULTS`)."""

    objects = RoutingQuerySet.as_manager()

    tenant = models.OneToOneField("cacheadmin.Tenant", on_delete=models.CASCADE, related_name="gateway_policy")
    response_cache = models.BooleanField(default=True)
    #: Seeded sampling is reused only where the tenant's engines guarantee it
    #: (vLLM does not promise batch invariance by default).
    allow_seeded = models.BooleanField(default=False)
    #: Any sampled answer may be reused (one sample stands for all).
    allow_sampling = models.BooleanField(default=False)
    #: An answer cut at ``max_tokens`` (finish reason ``length``) is kept by the cache layers
    #: too; by default only answers that finished by themselves are (``gateway.answers``).
    admit_length = models.BooleanField(
        default=False, help_text="keep answers cut at max_tokens (finish_reason length) in the cache layers"
    )
    semantic_cache = models.BooleanField(default=True)
    #: Similarity a semantic hit needs, on the scale of ``gateway.layers.semantic.matching`` (0..1).
    semantic_threshold = models.FloatField(null=True, blank=True, help_text="empty: the shipped threshold")
    #: Share of requests that reported cached tokens replayed by shadow verification (0..1).
    shadow_sample_rate = models.FloatField(default=0.05)
    #: The same share for the canary of a gray release (the new version while it carries
    #: some of the traffic but not all): the fewer of its requests, the more of them are
    #: replayed, so a small step is judged soon. The higher of the two rates applies.
    canary_shadow_sample_rate = models.FloatField(
        default=0.5, help_text="share of a gray release's canary requests with cached tokens replayed (0..1)"
    )
    #: A deceptive hit on live traffic stops routing the namespace until an operator decides.
    suspend_on_deceptive_hit = models.BooleanField(default=True)
    #: What is kept of a request holding personal data (gateway.pii.gate): ``skip``
    #: keeps nothing of it anywhere; ``redact`` keeps it redacted where it is
    #: replayed as input (prefix heat, shadow samples), never in a cache served verbatim.
    personal_data = models.CharField(
        max_length=8, choices=[("skip", "skip"), ("redact", "redact")], default="skip",
        help_text="skip: keep nothing of a request with personal data; redact: keep heat and shadow samples redacted",
    )  # fmt: skip
    #: A layer whose benefit ratio (``gateway.records.layer_figures``) stays under this floor
    #: over ``benefit_window_minutes``, with at least ``benefit_min_requests`` lookups of it there,
    #: is bypassed for the namespace (reason ``not_paying``) but for a measuring sample.
    benefit_floor = models.FloatField(default=1.0)
    benefit_window_minutes = models.PositiveIntegerField(default=10)
    benefit_min_requests = models.PositiveIntegerField(default=200)
    updated_by = models.CharField(max_length=200, blank=True, default="")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(shadow_sample_rate__gte=0) & models.Q(shadow_sample_rate__lte=1),
                name="gateway_policy_shadow_rate_0_1",
            ),
            models.CheckConstraint(
                condition=models.Q(canary_shadow_sample_rate__gte=0) & models.Q(canary_shadow_sample_rate__lte=1),
                name="gateway_policy_canary_rate_0_1",
            ),
            models.CheckConstraint(
                condition=models.Q(benefit_floor__gte=0)
                & models.Q(benefit_window_minutes__gte=1)
                & models.Q(benefit_window_minutes__lte=1440)
                & models.Q(benefit_min_requests__gte=1),
                name="gateway_policy_benefit_bounds",
            ),
            models.CheckConstraint(
                condition=models.Q(semantic_threshold__isnull=True)
                | (models.Q(semantic_threshold__gte=0) & models.Q(semantic_threshold__lte=1)),
                name="gateway_policy_threshold_0_1",
            ),
        ]

    def __str__(self) -> str:
        return f"gateway policy of {self.tenant.slug}"


class NamespaceRouting(models.Model):
    """A namespace's routing hold: while ``suspended_at`` is set, gateways
    refuse its requests (503) instead of serving them; set by a deceptive
    hit on live traffic (by the tenant's policy) and lifted by an operator."""

    objects = RoutingQuerySet.as_manager()

    namespace = models.OneToOneField("cacheadmin.CacheNamespace", on_delete=models.CASCADE, related_name="routing")
    suspended_at = models.DateTimeField(null=True, blank=True)
    suspended_reason = models.TextField(blank=True, default="")
    resumed_by = models.CharField(max_length=200, blank=True, default="")
    resumed_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"routing of namespace {self.namespace_id}: {'suspended' if self.suspended_at else 'on'}"


class GatewayStat(models.Model):
    """What the gateways saw for one namespace and layer in one minute (UTC).

    Every count adds up across gateway processes (each flushes its own
    increments). Times are milliseconds summed, with their counts, so means
    come out exact. ``bypass`` maps a bounded reason to its count.
    """

    namespace = models.ForeignKey("cacheadmin.CacheNamespace", on_delete=models.CASCADE, related_name="gateway_stats")
    layer = models.CharField(max_length=16, choices=CacheLayer.choices)
    minute = models.DateTimeField()
    requests = models.BigIntegerField(default=0)
    hits = models.BigIntegerField(default=0)
    misses = models.BigIntegerField(default=0)
    bypasses = models.BigIntegerField(default=0)
    bypass = models.JSONField(default=dict)
    prompt_tokens = models.BigIntegerField(default=0)
    cached_prompt_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    #: TTFT of answers served from this layer (hits), and of those that went past it (misses).
    ttft_hit_ms_sum = models.FloatField(default=0)
    ttft_hit_count = models.BigIntegerField(default=0)
    ttft_miss_ms_sum = models.FloatField(default=0)
    ttft_miss_count = models.BigIntegerField(default=0)
    #: Time spent looking the layer up (its cost), hits and misses alike.
    lookup_ms_sum = models.FloatField(default=0)
    lookup_count = models.BigIntegerField(default=0)
    #: Time spent storing engines' answers in the layer (the rest of its cost).
    store_ms_sum = models.FloatField(default=0)
    store_count = models.BigIntegerField(default=0)
    #: Requests routed here that the gateway answered with a server error (5xx: the engine failed,
    #: timed out or was shed), counted on the prefix row.
    errors = models.BigIntegerField(default=0)
    #: TTFT of the answers this row counts, as a histogram: bound in ms
    #: (``gateway.records.TTFT_BOUNDS_MS``, then ``inf``) → requests; merged like ``bypass``.
    ttft_buckets = models.JSONField(default=dict)

    class Meta:
        ordering = ["-minute", "namespace_id", "layer"]
        constraints = [models.UniqueConstraint(fields=["namespace", "layer", "minute"], name="gateway_stat_once_per_minute")]
        indexes = [
            models.Index(fields=["minute"], name="gateway_stat_minute"),
            # A namespace's last minute with a hit in one probe, however long its history (the dashboard's staleness).
            models.Index(fields=["namespace", "-minute"], condition=models.Q(hits__gt=0), name="gateway_stat_last_hit"),
        ]

    def __str__(self) -> str:
        return f"{self.layer} of {self.namespace_id} at {self.minute:%H:%M}"


class LayerNotPaying(models.Model):
    """A cache layer that does not pay in a namespace: its benefit ratio stayed under
    the tenant's floor over the policy's window (``TenantGatewayPolicy.benefit_*``).

    An open row (``cleared_at`` None) is both the alarm operators see and the
    decision gateways act on: the routing snapshot lists the open pairs, and
    the layer is bypassed for the namespace (reason ``not_paying``) but for a
    measuring sample of requests. The row is cleared when the sample shows the
    layer paying again; a later relapse opens a new row. Opening and clearing
    move the routing epoch (gateways rebuild their snapshot within a poll).
    """

    objects = RoutingQuerySet.as_manager()

    namespace = models.ForeignKey("cacheadmin.CacheNamespace", on_delete=models.CASCADE, related_name="layers_not_paying")
    layer = models.CharField(max_length=16, choices=CacheLayer.choices)
    #: The benefit ratio and lookups of the window that decided (opened), then of the latest check.
    benefit_ratio = models.FloatField(null=True, blank=True)
    lookups = models.BigIntegerField(default=0)
    floor = models.FloatField(default=1.0)
    opened_at = models.DateTimeField(auto_now_add=True)
    checked_at = models.DateTimeField(auto_now_add=True)
    cleared_at = models.DateTimeField(null=True, blank=True)

    #: A check rewrites these on every open row: no routing decision changes.
    ROUTING_IGNORED_FIELDS = frozenset({"benefit_ratio", "lookups", "checked_at"})

    class Meta:
        ordering = ["-opened_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["namespace", "layer"], condition=models.Q(cleared_at__isnull=True), name="layer_not_paying_one_open"
            )
        ]

    def __str__(self) -> str:
        return f"{self.layer} not paying in {self.namespace_id}{' (cleared)' if self.cleared_at else ''}"


class ShadowCheck(models.Model):
    """A live request that reported cached prompt tokens, replayed off the hot
    path greedily on its serving engine and on a reference engine without
    cache; ``deceptive`` when the two diverge beyond the control's noise."""

    class Status(models.TextChoices):
        PENDING = "pending"
        MATCHED = "matched"
        DECEPTIVE = "deceptive"
        FAILED = "failed"

    namespace = models.ForeignKey("cacheadmin.CacheNamespace", on_delete=models.CASCADE, related_name="shadow_checks")
    engine = models.ForeignKey("cacheadmin.Engine", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    reference_engine = models.ForeignKey("cacheadmin.Engine", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    #: The request replayed (no personal data: requests carrying any are never sampled).
    request = models.JSONField()
    endpoint = models.CharField(max_length=16, default="chat")
    cached_tokens = models.PositiveIntegerField(default=0, help_text="as the engine reported for the live request")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING, db_index=True)
    first_divergence = models.IntegerField(null=True, blank=True, help_text="token index, None when equal")
    noise_divergence = models.IntegerField(null=True, blank=True, help_text="the control's (cold vs cold) first divergence")
    detail = models.JSONField(default=dict)
    error = models.TextField(blank=True, default="")
    #: Where the answer the caller got came from: ``engine``, ``response`` or ``semantic`` ("" before this was kept).
    served_layer = models.CharField(max_length=16, blank=True, default="")
    #: The answer served, as served (``{"text", "completion_tokens", "finish_reason"}``): what the check
    #: judges; None when it cannot be judged token by token (then the request is replayed and that judged).
    served_answer = models.JSONField(null=True, blank=True)
    #: When ``engine`` computed the answer served, and when it was served.
    computed_at = models.DateTimeField(null=True, blank=True)
    served_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    checked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"shadow check #{self.pk} ({self.status})"


class AnswerRetirement(models.Model):
    """The gateway's cached answers of a namespace that a suspect engine computed: recorded
    (intent) with the deceptive hit that confirmed it, carried out at once in both cache
    layers, and re-run before the namespace's routing resumes (resuming waits for it).

    ``since`` is when the answer of the engine's last good check in the namespace was
    computed (None: no good check, every answer of the engine goes); answers stored without
    provenance since then go too. ``engine_ref`` is the engine's id as the stores keep it
    (kept when the engine row is deleted).
    """

    namespace = models.ForeignKey("cacheadmin.CacheNamespace", on_delete=models.CASCADE, related_name="answer_retirements")
    shadow_check = models.OneToOneField(ShadowCheck, on_delete=models.CASCADE, related_name="retirement")
    engine_ref = models.PositiveIntegerField()
    since = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    #: Set by the last run that reached every configured layer; None: not yet (a store was down).
    completed_at = models.DateTimeField(null=True, blank=True)
    #: Entries removed so far, per layer (summed over runs).
    removed = models.JSONField(default=dict)
    runs = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"retirement of engine {self.engine_ref}'s answers in {self.namespace_id}"
