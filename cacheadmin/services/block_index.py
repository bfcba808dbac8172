"""The KV-event consumer's side of the fleet's block index
(:mod:`gateway.prefix.index`): at each flush, every engine's resident blocks
whose set changed are published whole, the others get a heartbeat; an engine
the consumer stops following is dropped. A store that is down costs a log
line and a metric, never the consumer: gateways see the sets age and fall
back to affinity routing (``GATEWAY_PREFIX_INDEX_STALE_S``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.conf import settings

from cacheadmin.env import private_dir
from cacheadmin.models import CacheNamespace, KvEventStream
from gateway.prefix.index import BlockSet, IndexStore, IndexUnavailable, RedisIndexStore, SqliteIndexStore, block_set
from inference.kv_events import EngineResidency

if TYPE_CHECKING:
    from cacheadmin.services.kv_events import Stream

log = logging.getLogger("cacheadmin.kv_events")


#: Largest checkpoint (bytes) whose chains a page walks: past it (some 200k blocks) the page says so instead.
PREFIXES_MAX_STATE_BYTES = 8 * 1024 * 1024


def cached_prefixes(engine_id: int, *, limit: int = 5) -> dict[str, Any]:
    """The largest prefixes an engine holds whole from a prompt's first block, per namespace, as the
    KV-event consumer last checkpointed them (``inference.kv_events.EngineResidency.longest_prefixes``).

    Returns:
        ``{"namespaces": [{"namespace", "namespace_key", "model_version", "prefixes": [{"medium", "blocks",
        "tokens"}]}], "too_large": bool}`` (namespace None: blocks attributed to none).
    """
    state = KvEventStream.objects.filter(engine_id=engine_id).values_list("state", flat=True).first()
    if state is None:
        return {"namespaces": [], "too_large": False}
    if len(state) > PREFIXES_MAX_STATE_BYTES:
        return {"namespaces": [], "too_large": True}
    residency = EngineResidency(namespace_of_salt=lambda _salt: None)
    residency.restore(bytes(state))
    found = residency.longest_prefixes(limit)
    rows = {ns.pk: ns for ns in CacheNamespace.objects.filter(pk__in=list(found)).select_related("model_version")}
    out = []
    for pk, prefixes in sorted(found.items(), key=lambda item: -item[1][0]["tokens"]):
        ns = rows.get(pk)
        out.append({"namespace": ns.pk if ns else None, "namespace_key": ns.namespace_key if ns else None,
                    "model_version": ns.model_version.label if ns else None, "prefixes": prefixes})  # fmt: skip
    return {"namespaces": out, "too_large": False}


def block_index_store() -> IndexStore:
    """This deployment's block index store: Redis at ``GATEWAY_REDIS_URL`` in scale-out (every
    host's gateways read it), else a SQLite file under ``GATEWAY_DIR`` (the embedded default)."""
    if settings.GATEWAY_REDIS_URL:
        return RedisIndexStore.from_url(settings.GATEWAY_REDIS_URL)
    private_dir(settings.GATEWAY_DIR)
    return SqliteIndexStore(settings.GATEWAY_DIR / "block-index.sqlite3")


class BlockIndexPublisher:
    """Stages streams during a flush and publishes them in one write.

    Args:
        store: where to publish (None: :func:`block_index_store`, opened on first use).
        failures: a prometheus counter of failed publications, or None.
    """

    def __init__(self, store: IndexStore | None = None, *, failures: Any = None) -> None:
        self._store, self.failures = store, failures
        self._sets: dict[int, BlockSet] = {}
        self._beats: dict[int, tuple[float, bool]] = {}

    @property
    def store(self) -> IndexStore:
        """The store (opened on first use)."""
        if self._store is None:
            self._store = block_index_store()
        return self._store

    def stage(self, stream: Stream, *, changed: bool, now: float) -> None:
        """Stage ``stream``'s set (``changed``) or its heartbeat."""
        complete = bool(stream.complete)
        if changed or stream.engine_id in self._sets:
            last = stream.last_event_at.timestamp() if stream.last_event_at is not None else 0.0
            self._sets[stream.engine_id] = block_set(
                stream.engine_id, stream.generation, stream.residency.blocks, complete=complete, last_event_at=last, now=now
            )
            self._beats.pop(stream.engine_id, None)
        else:
            self._beats[stream.engine_id] = (now, complete)

    def publish(self) -> bool:
        """Write what is staged; False (staged sets kept for the next flush) when the store is down."""
        if not self._sets and not self._beats:
            return True
        try:
            if self._sets:
                self.store.publish(list(self._sets.values()))
            if self._beats:
                self.store.heartbeat(self._beats)
        except IndexUnavailable as exc:
            log.warning("block index not published: %s", exc)
            if self.failures is not None:
                self.failures.inc()
            self._beats.clear()
            return False
        self._sets.clear()
        self._beats.clear()
        return True

    def drop(self, engine_id: int) -> None:
        """Remove an engine the consumer no longer follows (gone, or another consumer's now)."""
        self._sets.pop(engine_id, None)
        self._beats.pop(engine_id, None)
        try:
            self.store.drop([engine_id])
        except IndexUnavailable as exc:
            log.warning("block index: engine %s not dropped: %s", engine_id, exc)
