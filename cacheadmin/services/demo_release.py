"""The main job's release under live traffic: release tooling's side of it (the
REST API, as a pipeline calls it) and what the run measured (the control
plane's gateway figures, shadow checks and the release's own timeline).

The steps themselves are in :mod:`cacheadmin.services.demo`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx
from django.contrib.auth import get_user_model

from cacheadmin.models import ApiToken, CacheNamespace, ShadowCheck
from cacheadmin.models.releases import Release
from cacheadmin.services.api_tokens import api_token_issue
from cacheadmin.services.gateway import STAT_COUNTERS, gateway_figures
from gateway.layers import LAYERS as CACHE_LAYERS
from gateway.records import layer_figures

#: The service account release tooling acts as (no password: it signs in with its API token only).
TOOLING_USER = "release-tooling"
#: Layers whose figures the traffic summary adds up.
LAYERS = (*CACHE_LAYERS, "prefix")


class ApiCallFailed(RuntimeError):
    """A call to the control plane's API did not answer as expected: the
    message has the method, path, status and the error envelope's message."""


class ControlPlaneApi:
    """The control plane's REST API as release tooling calls it: bearer token,
    an ``Idempotency-Key`` per state change (reused on a retry of the same
    change), errors read from the one error envelope.

    Args:
        client: an ``httpx.Client`` whose ``base_url`` is the control plane
            (a served dashboard, or the WSGI application in process).
        token: an API token (``kvcp_…``) of scope ``admin`` or ``operate``.
    """

    def __init__(self, client: httpx.Client, token: str) -> None:
        self.client = client
        self.headers = {"authorization": f"Bearer {token}"}

    def get(self, path: str) -> Any:
        """``GET path`` → the decoded JSON body.

        Raises:
            ApiCallFailed: any status but 200.
        """
        return self._check("GET", path, self.client.get(path, headers=self.headers), (200,))

    def post(self, path: str, body: dict[str, Any] | None = None, *, expect: tuple[int, ...] = (200, 201)) -> Any:
        """``POST path`` with a JSON body and a fresh ``Idempotency-Key`` → the decoded JSON body.

        A transport error is retried once with the same key: the API runs a
        keyed change at most once, so a lost answer cannot apply it twice.

        Raises:
            ApiCallFailed: a status outside ``expect`` (the envelope's code and message in the text).
        """
        headers = {**self.headers, "idempotency-key": uuid.uuid4().hex}
        try:
            answer = self.client.post(path, json=body or {}, headers=headers)
        except httpx.TransportError:
            answer = self.client.post(path, json=body or {}, headers=headers)
        return self._check("POST", path, answer, expect)

    @staticmethod
    def _check(method: str, path: str, answer: httpx.Response, expect: tuple[int, ...]) -> Any:
        if answer.status_code in expect:
            return answer.json()
        try:
            error = answer.json()["error"]
            what = f"{error['code']}: {error['message']}"
        except (ValueError, KeyError, TypeError):
            what = answer.text[:500]
        raise ApiCallFailed(f"{method} {path} answered {answer.status_code} ({what})")


def tooling_token(*, actor: str) -> str:
    """A fresh admin-scope API token of the :data:`TOOLING_USER` service account
    (created without a password on first use). One per run; each is audited.

    Returns:
        The plain token (shown once, stored hashed).
    """
    user, created = get_user_model().objects.get_or_create(username=TOOLING_USER)
    if created:
        user.set_unusable_password()
        user.save()
    _, token = api_token_issue(
        user=user, name=f"demo release {uuid.uuid4().hex[:6]}", scope=ApiToken.Scope.ADMIN, tenant=None, actor=actor
    )
    return token


def release_summary(release: Release, *, highest_percent: int, ready_before_traffic: bool) -> dict[str, Any]:
    """The ``release`` part of the main job's summary.

    Args:
        highest_percent: the largest share of traffic the new version carried
            (the release's own ``traffic_percent`` is 0 after a rollback).
        ready_before_traffic: the release was ``ready`` (prewarm verified)
            before any traffic moved to it.

    Returns:
        ``{"id", "classification", "differing", "decision", "ready",
        "traffic_percent", "status", "rolled_back_from_cold", "entries_restored"}``.
    """
    rolled = release.events.filter(kind="rolled_back").order_by("-at", "-id").first()
    how = (rolled.detail or {}).get("how") if rolled is not None else None
    return {
        "id": release.pk,
        "classification": release.classification,
        "differing": release.diff.get("differing", []),
        "decision": release.decision,
        "ready": ready_before_traffic,
        "traffic_percent": highest_percent,
        "status": release.status,
        "rolled_back_from_cold": how == "restored from the cold tier",
        "entries_restored": (rolled.detail or {}).get("entries_restored", 0) if rolled is not None else 0,
    }


def traffic_figures(namespaces: list[CacheNamespace], *, since: datetime) -> dict[str, Any]:
    """The gateway's figures for ``namespaces`` since ``since``, all layers summed
    across them, as the dashboard derives them (:func:`gateway.records.layer_figures`).

    Returns:
        ``{"response_cache_hit_ratio", "semantic_cache_hit_ratio"`` (hits over
        the layer's lookups), ``"prefix_cached_token_ratio"`` (prompt tokens the
        engines found cached over prompt tokens they were sent),
        ``"cost_savings_rate"`` (tokens not computed over tokens asked for,
        all layers), ``"layers"`` (each layer's summed counters)``}``; a ratio
        with nothing to divide by is None.
    """
    per_ns = gateway_figures(since=since, namespace_pks=[ns.pk for ns in namespaces])
    summed: dict[str, dict[str, float]] = {}
    for layers in per_ns.values():
        for layer, row in layers.items():
            into = summed.setdefault(layer, dict.fromkeys(STAT_COUNTERS, 0))
            for name in STAT_COUNTERS:
                into[name] += row.get(name, 0)
    derived = layer_figures(summed)
    prefix = summed.get("prefix", {})

    def rounded(value: float | None) -> float | None:
        return round(value, 4) if value is not None else None

    savings = [derived[layer]["cost_savings_rate"] for layer in LAYERS if layer in derived]
    return {
        "response_cache_hit_ratio": rounded(derived.get("response", {}).get("hit_ratio")),
        "semantic_cache_hit_ratio": rounded(derived.get("semantic", {}).get("hit_ratio")),
        "prefix_cached_token_ratio": rounded(
            prefix["cached_prompt_tokens"] / prefix["prompt_tokens"] if prefix.get("prompt_tokens") else None
        ),
        "cost_savings_rate": rounded(sum(s for s in savings if s is not None)) if savings else None,
        "layers": {
            layer: {k: int(v) for k, v in row.items() if k in ("requests", "hits", "misses")} for layer, row in summed.items()
        },
    }


def shadow_figures(namespaces: list[CacheNamespace], *, since: datetime) -> dict[str, int]:
    """Shadow checks of live requests in ``namespaces`` since ``since``.

    Returns:
        ``{"shadow_sampled", "shadow_checked"`` (judged: matched or deceptive),
        ``"shadow_deceptive_hits", "shadow_failed", "shadow_pending"}``.
    """
    checks = ShadowCheck.objects.filter(namespace__in=namespaces, created_at__gte=since)
    by = dict.fromkeys(ShadowCheck.Status.values, 0)
    for status in checks.values_list("status", flat=True):
        by[status] += 1
    return {
        "shadow_sampled": sum(by.values()),
        "shadow_checked": by[ShadowCheck.Status.MATCHED] + by[ShadowCheck.Status.DECEPTIVE],
        "shadow_deceptive_hits": by[ShadowCheck.Status.DECEPTIVE],
        "shadow_failed": by[ShadowCheck.Status.FAILED],
        "shadow_pending": by[ShadowCheck.Status.PENDING],
    }


def shadow_drain(namespaces: list[CacheNamespace], *, since: datetime, timeout_s: float, watchdog: Callable[[], None]) -> int:
    """Wait until the worker judged every shadow check sampled since ``since`` (or ``timeout_s`` passed).

    Returns:
        How many are still pending.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        pending = ShadowCheck.objects.filter(
            namespace__in=namespaces, created_at__gte=since, status=ShadowCheck.Status.PENDING
        ).count()
        if not pending or time.monotonic() > deadline:
            return pending
        watchdog()
        time.sleep(0.5)
