"""The gateway caches' stores of this deployment, from settings: Redis at
``GATEWAY_REDIS_URL`` in scale-out, SQLite files under ``GATEWAY_DIR`` in the
embedded default. The same stores are the ``response`` and ``semantic`` hot
tiers of accounting and eviction (:mod:`cacheadmin.services.tiers`)."""

from __future__ import annotations

from django.conf import settings

from cacheadmin.env import private_dir
from gateway.layers.response.redis_store import RedisResponseStore
from gateway.layers.response.sqlite_store import SqliteResponseStore
from gateway.layers.response.store import ResponseStore
from gateway.layers.semantic.redis_store import RedisSemanticStore
from gateway.layers.semantic.sqlite_store import SqliteSemanticStore
from gateway.layers.semantic.store import SemanticStore


def response_store() -> ResponseStore:
    """The response cache's store (Redis in scale-out, SQLite in the embedded default)."""
    if settings.GATEWAY_REDIS_URL:
        # Short timeouts and no retries: a dead Redis makes the layer bypass at once, never hang a request.
        return RedisResponseStore.from_url(settings.GATEWAY_REDIS_URL)
    # Owner-only, as VAR_DIR is (GATEWAY_DIR may lie outside it): the entries are tenants' prompts and answers.
    private_dir(settings.GATEWAY_DIR)
    return SqliteResponseStore(settings.GATEWAY_DIR / "response-cache.sqlite3")


def semantic_store() -> SemanticStore:
    """The semantic cache's entry store (Redis in scale-out, SQLite in the embedded default)."""
    if settings.GATEWAY_REDIS_URL:
        return RedisSemanticStore.from_url(settings.GATEWAY_REDIS_URL)
    private_dir(settings.GATEWAY_DIR)
    return SqliteSemanticStore(settings.GATEWAY_DIR / "semantic-cache.sqlite3")
