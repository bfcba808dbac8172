"""A gateway process of this deployment: Django settings and the control
plane's database behind a :class:`gateway.server.Gateway`.

Two threads keep the database off the request path: one polls the routing
epoch every ``GATEWAY_EPOCH_POLL_MS`` and, when it moved, swaps in a snapshot
with the entries that changed read again (the engines' addresses are resolved
again every ``GATEWAY_SNAPSHOT_MAX_AGE_S``), one writes
the recorded figures, prefix heat and shadow samples every ``GATEWAY_FLUSH_S``.
A database outage leaves the last snapshot serving and keeps the figures for
the next flush.

``uvicorn --factory gateway.asgi:create_app`` (what ``manage.py gateway`` runs).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from starlette.applications import Starlette

from gateway import connections
from gateway.metrics import routing_epoch_gauge
from gateway.prefix.index import BlockIndex
from gateway.prefix.load import EngineLoadPoller
from gateway.prefix.router import PrefixRouter
from gateway.records import Recorder
from gateway.routing import RoutingSnapshot
from gateway.server import Gateway, Limits, Runtime, ShadowSample

log = logging.getLogger("gateway")


def in_thread(fn: Any) -> Any:
    """Run ``fn()`` on a thread of its own and wait for it: uvicorn builds the
    app and runs its lifespan inside the event loop, where Django refuses
    database calls (``SynchronousOnlyOperation``)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


class SnapshotHolder:
    """The current snapshot and the thread that keeps it current.

    The snapshot is built whole once, at start; after that only what a change named is read
    again (``update``), and only when the epoch moved, so a process whose routing did not change
    reads one row per poll. A full build happens again only when ``update`` cannot tell what
    changed (returns None: an epoch whose changes were pruned, a change of everything).

    Args:
        build: everything read whole: parts with an ``epoch`` and a ``snapshot()``
            (``cacheadmin.services.gateway.routing_snapshot_parts``).
        update: parts → the parts brought to the current epoch (the same object when it did
            not move), or None when only a full build can tell (``routing_snapshot_update``).
        poll_s: seconds between two reads of the epoch.
        recheck: parts → the parts with the engines' addresses resolved again (the same object
            when none moved), run every ``recheck_s`` seconds: DNS answers change with no row
            changing (``routing_addresses_recheck``); None: never.
        recheck_s: seconds between two rechecks.
    """

    def __init__(self, build: Callable[[], Any], update: Callable[[Any], Any], *, poll_s: float,
                 recheck: Callable[[Any], Any] | None = None, recheck_s: float = 10.0) -> None:  # fmt: skip
        self._build, self._update, self._recheck = build, update, recheck
        self.poll_s, self.recheck_s = poll_s, recheck_s
        self.parts = in_thread(build)
        self.snapshot = self.parts.snapshot()
        self.rechecked_at = time.monotonic()
        #: Full builds (the first included) and incremental updates this process made.
        self.full_builds, self.updates = 1, 0
        self._stop = threading.Event()
        self._published()

    def _published(self) -> None:
        # Which epoch this process routes by: operators (and tests) see when a change reached every process.
        routing_epoch_gauge().set(self.snapshot.epoch)

    def current(self) -> Any:
        """The snapshot requests are routed by now."""
        return self.snapshot

    def refresh_if_moved(self) -> bool:
        """Bring the snapshot to the current epoch (and recheck the engines' addresses when due);
        True when a new snapshot was swapped in."""
        parts = self._update(self.parts)
        if parts is None:
            parts = self._build()
            self.full_builds += 1
        elif parts is not self.parts:
            self.updates += 1
        if self._recheck is not None and time.monotonic() - self.rechecked_at > self.recheck_s:
            self.rechecked_at = time.monotonic()
            parts = self._recheck(parts)
        if parts is self.parts:
            return False
        self.parts = parts
        self.snapshot = parts.snapshot()
        self._published()
        return True

    def run(self) -> None:
        """Poll until stopped; errors (a database outage) keep the last snapshot."""
        from django.db import close_old_connections

        while not self._stop.wait(self.poll_s):
            try:
                self.refresh_if_moved()
            except Exception:  # noqa: BLE001 - any failure keeps the last good snapshot serving
                log.exception("routing snapshot not renewed; the last one keeps serving")
                close_old_connections()

    def stop(self) -> None:
        """End :meth:`run`."""
        self._stop.set()


class Flusher:
    """What one gateway process hands the control plane off its hot path: its figures and
    heat (:class:`gateway.records.Recorder`) and its shadow samples, flushed every few seconds.

    Args:
        recorder: the process's figures.
        write: writes figures, heat and template rows in one transaction (``gateway_flush``).
        enqueue: queues one shadow check (``shadow_check_enqueue``'s keywords).
        reconnect: drops the database connections after a failure (``close_old_connections``).
    """

    def __init__(self, recorder: Recorder, write: Callable[..., object], enqueue: Callable[..., object],
                 reconnect: Callable[[], None]) -> None:  # fmt: skip
        self.recorder, self.write, self.enqueue, self.reconnect = recorder, write, enqueue, reconnect
        self.samples: queue.Queue[ShadowSample] = queue.Queue(maxsize=1000)

    def sample(self, sample: ShadowSample) -> None:
        """Keep a live request for shadow verification (dropped when 1,000 wait: samples, not a record)."""
        try:
            self.samples.put_nowait(sample)
        except queue.Full:
            pass

    def run(self, stop: threading.Event, every_s: float) -> None:
        """Flush every ``every_s`` seconds until ``stop`` is set."""
        while not stop.wait(every_s):
            self.flush_once()

    def flush_once(self) -> None:
        """Write what was drained; a database outage loses nothing (kept for the next flush)."""
        rows, heat = self.recorder.drain()
        template_rows = self.recorder.templates.drain()
        pending = []
        while True:
            try:
                pending.append(self.samples.get_nowait())
            except queue.Empty:
                break
        try:
            self.write(rows, heat, template_rows)  # one transaction: written whole or not at all
        except Exception:  # noqa: BLE001 - a database outage must not lose the figures: they wait for the next flush
            log.exception("gateway figures not written; kept for the next flush")
            self.recorder.restore(rows, heat)
            self.recorder.templates.restore(template_rows)
            self.reconnect()
        # Apart from the figures: a sample that fails to queue must not put back figures already written.
        self._enqueue(pending)

    def _enqueue(self, pending: list[ShadowSample]) -> None:
        for at, sample in enumerate(pending):
            try:
                self.enqueue(
                    namespace_pk=sample.namespace_pk, engine_id=sample.engine_id, endpoint=sample.endpoint, body=sample.body,
                    cached_tokens=sample.cached_tokens, served=sample.served,
                )  # fmt: skip
            except Exception:  # noqa: BLE001 - kept for the next flush, as the figures are
                log.exception("shadow samples not queued; kept for the next flush")
                for kept in pending[at:]:
                    try:
                        self.samples.put_nowait(kept)
                    except queue.Full:
                        break  # the sampler's bound holds: the rest are dropped, as a full backlog drops
                self.reconnect()
                break


def _semantic_layer(on: bool) -> Any:
    """The deployment's semantic layer, or None when it is off here."""
    if not on:
        return None
    # Lazy: the embedding model's runtime loads only where the semantic layer is on.
    from django.conf import settings

    from cacheadmin.services.gateway import semantic_rules
    from cacheadmin.services.gateway_stores import semantic_store
    from gateway.layers.semantic.embedder import default_embedder
    from gateway.layers.semantic.layer import SemanticLayer

    embedder = default_embedder(onnx_dir=settings.GATEWAY_EMBEDDER_DIR)
    return SemanticLayer(semantic_store(), embedder, rules=semantic_rules())


def _prefix_router(settings: Any) -> PrefixRouter:
    """The precise choice's router: this process's mirror of the deployment's block index."""
    from cacheadmin.services.block_index import block_index_store  # the control plane's: after django.setup()

    index = BlockIndex(block_index_store(), stale_s=settings.GATEWAY_PREFIX_INDEX_STALE_S,
                       speculative_ttl_s=settings.GATEWAY_PREFIX_SPECULATIVE_TTL_S)  # fmt: skip
    return PrefixRouter(index, load_weight=settings.GATEWAY_ROUTING_LOAD_WEIGHT)


def _snapshot_holder(settings: Any) -> SnapshotHolder:
    """This process's routing snapshot, built whole now and kept current from the routing epoch's changes."""
    # The control plane's: after django.setup().
    from cacheadmin.services.gateway import routing_addresses_recheck, routing_snapshot_parts, routing_snapshot_update

    return SnapshotHolder(routing_snapshot_parts, routing_snapshot_update, poll_s=settings.GATEWAY_EPOCH_POLL_MS / 1000,
                          recheck=routing_addresses_recheck, recheck_s=settings.GATEWAY_SNAPSHOT_MAX_AGE_S)  # fmt: skip


def _index_gauges(snapshot: Callable[[], RoutingSnapshot], recorder: Recorder, index: BlockIndex) -> None:
    """The block index gauges of this process, per engine in service (by name; an engine gone leaves them)."""
    if recorder.metrics is None:
        return
    names = {e.id: e.name for ns in snapshot().namespaces.values() for e in ns.engines}
    now = time.time()
    for engine, entry in list(index.engines.items()):
        name = names.get(engine)
        if name is not None:
            recorder.metrics.index_state(name, len(entry.masks), now - entry.published_at, entry.lag_s)


def create_app() -> Starlette:
    """The ASGI application of one gateway process (Django set up here)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")
    import django

    django.setup()
    # Below django.setup(): the control plane's modules need the app registry loaded.
    from django.conf import settings
    from django.db import close_old_connections

    from cacheadmin.services.gateway import gateway_flush
    from cacheadmin.services.gateway_stores import response_store
    from cacheadmin.services.shadow import shadow_check_enqueue

    # This process's read deadlines and per-address cap (the protocol reads them per connection).
    connections.limits = connections.ConnectionLimits(
        header_timeout_s=settings.GATEWAY_HEADER_TIMEOUT_S, body_timeout_s=settings.GATEWAY_BODY_TIMEOUT_S,
        per_client=settings.GATEWAY_CONNECTIONS_PER_CLIENT,
    )  # fmt: skip
    holder = _snapshot_holder(settings)
    recorder = Recorder()
    flusher = Flusher(recorder, gateway_flush, shadow_check_enqueue, close_old_connections)
    semantic = _semantic_layer(settings.GATEWAY_SEMANTIC)
    limits = Limits(rate_per_s=float(settings.GATEWAY_RATE_PER_S), burst=settings.GATEWAY_BURST,
                    engine_max_in_flight=settings.GATEWAY_ENGINE_MAX_IN_FLIGHT)  # fmt: skip
    router = _prefix_router(settings) if settings.GATEWAY_ENGINE_CHOICE == "precise" else None
    runtime = Runtime(snapshot=holder.current, response_store=response_store(), semantic=semantic, recorder=recorder,
                      shadow=flusher.sample, limits=limits, engine_choice=settings.GATEWAY_ENGINE_CHOICE,
                      router=router)  # fmt: skip
    gateway = Gateway(runtime)
    gateway.metrics_token = settings.METRICS_TOKEN
    stop = threading.Event()

    def start() -> None:
        threading.Thread(target=holder.run, name="routing-snapshot", daemon=True).start()
        threading.Thread(target=flusher.run, args=(stop, settings.GATEWAY_FLUSH_S), name="gateway-flush", daemon=True).start()
        if router is not None:
            gauges = partial(_index_gauges, holder.current, recorder)
            threading.Thread(target=router.index.follow, args=(stop, settings.GATEWAY_PREFIX_INDEX_POLL_S, gauges),
                             name="block-index", daemon=True).start()  # fmt: skip
            # The engines' own queues: every gateway's requests, not only this process's.
            poller = EngineLoadPoller(holder.current, router.engine_load)
            threading.Thread(target=poller.run, args=(stop,), name="engine-load", daemon=True).start()
        if semantic is not None:
            # Load the embedding model and the language detector now, not on the first semantic request.
            threading.Thread(target=semantic.load, name="semantic-load", daemon=True).start()

    def shutdown() -> None:
        holder.stop()
        stop.set()
        in_thread(flusher.flush_once)
        # This process's live gauges (breakers) stop counting among the group's.
        from cacheadmin.metrics.multiproc import mark_process_dead

        mark_process_dead(os.getpid())

    gateway.on_start.append(start)
    gateway.on_stop.append(shutdown)
    gateway.holder = holder  # type: ignore[attr-defined]
    return gateway.app
