"""A gateway process of this deployment: Django settings and the control
plane's database behind a :class:`gateway.server.Gateway`.

Two threads keep the database off the request path: one polls the routing
epoch every ``GATEWAY_EPOCH_POLL_MS`` and swaps in a fresh snapshot when it
moved (or when the snapshot is ``GATEWAY_SNAPSHOT_MAX_AGE_S`` old), one writes
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
from typing import Any

from starlette.applications import Starlette

from gateway import connections
from gateway.records import Recorder
from gateway.server import Gateway, Limits, Runtime, ShadowSample

log = logging.getLogger("gateway")


def in_thread(fn: Any) -> Any:
    """Run ``fn()`` on a thread of its own and wait for it: uvicorn builds the
    app and runs its lifespan inside the event loop, where Django refuses
    database calls (``SynchronousOnlyOperation``)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


class SnapshotHolder:
    """The current snapshot and the thread that renews it."""

    def __init__(self, build: Any, epoch: Any, *, poll_s: float, max_age_s: float) -> None:
        self._build, self._epoch, self.poll_s, self.max_age_s = build, epoch, poll_s, max_age_s
        self.snapshot = in_thread(build)
        self.built_at = time.monotonic()
        self._stop = threading.Event()

    def current(self) -> Any:
        """The snapshot requests are routed by now."""
        return self.snapshot

    def refresh_if_moved(self) -> bool:
        """Rebuild when the epoch moved or the snapshot is too old; True when rebuilt."""
        moved = self._epoch() != self.snapshot.epoch
        if moved or time.monotonic() - self.built_at > self.max_age_s:
            self.snapshot = self._build()
            self.built_at = time.monotonic()
            return True
        return False

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


def create_app() -> Starlette:
    """The ASGI application of one gateway process (Django set up here)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")
    import django

    django.setup()
    # Below django.setup(): the control plane's modules need the app registry loaded.
    from django.conf import settings
    from django.db import close_old_connections

    from cacheadmin.services.gateway import gateway_flush, routing_epoch, routing_snapshot_build, semantic_rules
    from cacheadmin.services.gateway_stores import response_store, semantic_store
    from cacheadmin.services.shadow import shadow_check_enqueue

    # This process's read deadlines and per-address cap (the protocol reads them per connection).
    connections.limits = connections.ConnectionLimits(
        header_timeout_s=settings.GATEWAY_HEADER_TIMEOUT_S,
        body_timeout_s=settings.GATEWAY_BODY_TIMEOUT_S,
        per_client=settings.GATEWAY_CONNECTIONS_PER_CLIENT,
    )
    holder = SnapshotHolder(
        routing_snapshot_build,
        routing_epoch,
        poll_s=settings.GATEWAY_EPOCH_POLL_MS / 1000,
        max_age_s=settings.GATEWAY_SNAPSHOT_MAX_AGE_S,
    )
    recorder = Recorder()
    samples: queue.Queue[ShadowSample] = queue.Queue(maxsize=1000)

    def shadow(sample: ShadowSample) -> None:
        try:
            samples.put_nowait(sample)
        except queue.Full:  # shadow verification samples; dropping one under a burst is fine
            pass

    semantic = None
    if settings.GATEWAY_SEMANTIC:
        # Lazy: torch and sentence-transformers load only where the semantic layer is on.
        from gateway.layers.semantic.embedder import default_embedder
        from gateway.layers.semantic.layer import SemanticLayer

        semantic = SemanticLayer(semantic_store(), default_embedder(), rules=semantic_rules())
    runtime = Runtime(
        snapshot=holder.current,
        response_store=response_store(),
        semantic=semantic,
        recorder=recorder,
        shadow=shadow,
        limits=Limits(
            rate_per_s=float(settings.GATEWAY_RATE_PER_S),
            burst=settings.GATEWAY_BURST,
            engine_max_in_flight=settings.GATEWAY_ENGINE_MAX_IN_FLIGHT,
        ),
    )
    gateway = Gateway(runtime)
    gateway.metrics_token = settings.METRICS_TOKEN
    stop = threading.Event()

    def flush_loop() -> None:
        while not stop.wait(settings.GATEWAY_FLUSH_S):
            flush_once()

    def flush_once() -> None:
        rows, heat = recorder.drain()
        template_rows = recorder.templates.drain()
        pending = []
        while True:
            try:
                pending.append(samples.get_nowait())
            except queue.Empty:
                break
        try:
            gateway_flush(rows, heat, template_rows)  # one transaction: written whole or not at all
        except Exception:  # noqa: BLE001 - a database outage must not lose the figures: they wait for the next flush
            log.exception("gateway figures not written; kept for the next flush")
            recorder.restore(rows, heat)
            recorder.templates.restore(template_rows)
            close_old_connections()
        # Apart from the figures: a sample that fails to queue must not put back figures already written.
        for at, sample in enumerate(pending):
            try:
                shadow_check_enqueue(
                    namespace_pk=sample.namespace_pk, engine_id=sample.engine_id, endpoint=sample.endpoint, body=sample.body,
                    cached_tokens=sample.cached_tokens,
                )  # fmt: skip
            except Exception:  # noqa: BLE001 - kept for the next flush, as the figures are
                log.exception("shadow samples not queued; kept for the next flush")
                for kept in pending[at:]:
                    try:
                        samples.put_nowait(kept)
                    except queue.Full:
                        break  # the sampler's bound holds: the rest are dropped, as a full backlog drops
                close_old_connections()
                break

    def start() -> None:
        threading.Thread(target=holder.run, name="routing-snapshot", daemon=True).start()
        threading.Thread(target=flush_loop, name="gateway-flush", daemon=True).start()
        if semantic is not None:
            # Load the embedding model now, not on the first semantic request.
            threading.Thread(target=lambda: semantic.embedder.embed(["warm up"]), name="embedder-load", daemon=True).start()

    def shutdown() -> None:
        holder.stop()
        stop.set()
        in_thread(flush_once)
        # This process's live gauges (breakers) stop counting among the group's.
        from cacheadmin.metrics.multiproc import mark_process_dead

        mark_process_dead(os.getpid())

    gateway.on_start.append(start)
    gateway.on_stop.append(shutdown)
    gateway.holder = holder  # type: ignore[attr-defined]
    return gateway.app
