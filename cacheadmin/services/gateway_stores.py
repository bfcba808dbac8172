"""The gateway caches' stores of this deployment, from settings: Redis at
``GATEWAY_REDIS_URL`` in scale-out, SQLite files under ``GATEWAY_DIR`` in the
embedded default. The same stores are the ``response`` and ``semantic`` hot
tiers of accounting and eviction (:mod:`cacheadmin.services.tiers`)."""

from __future__ import annotations

import json

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from gateway.response_store import RedisResponseStore, ResponseStore, SqliteResponseStore
from gateway.semantic.admission import DEFAULT_RULES, Rule, rules_from_config
from gateway.semantic.store import RedisSemanticStore, SemanticStore, SqliteSemanticStore


def response_store() -> ResponseStore:
    """The response cache's store (Redis in scale-out, SQLite in the embedded default)."""
    if settings.GATEWAY_REDIS_URL:
        # Short timeouts and no retries: a dead Redis makes the layer bypass at once, never hang a request.
        return RedisResponseStore.from_url(settings.GATEWAY_REDIS_URL)
    settings.GATEWAY_DIR.mkdir(parents=True, exist_ok=True)
    return SqliteResponseStore(settings.GATEWAY_DIR / "response-cache.sqlite3")


def semantic_store() -> SemanticStore:
    """The semantic cache's entry store (Redis in scale-out, SQLite in the embedded default)."""
    if settings.GATEWAY_REDIS_URL:
        return RedisSemanticStore.from_url(settings.GATEWAY_REDIS_URL)
    settings.GATEWAY_DIR.mkdir(parents=True, exist_ok=True)
    return SqliteSemanticStore(settings.GATEWAY_DIR / "semantic-cache.sqlite3")


def semantic_rules() -> tuple[Rule, ...]:
    """The semantic layer's admission rules of this deployment (``GATEWAY_SEMANTIC_RULES``, else the shipped ones).

    Raises:
        ImproperlyConfigured: the setting is not JSON or not a valid rule list (the message names the entry).
    """
    if not settings.GATEWAY_SEMANTIC_RULES.strip():
        return DEFAULT_RULES
    try:
        return rules_from_config(json.loads(settings.GATEWAY_SEMANTIC_RULES))
    except (ValueError, RecursionError) as exc:
        raise ImproperlyConfigured(f"GATEWAY_SEMANTIC_RULES: {exc}") from exc
