"""The lag a gateway process reports for an engine's block index
(``kvcp_gateway_prefix_index_lag_seconds``, alert KvcpPrefixIndexLagging):
measured when a set brings a newer event, 0 once a set is republished without
one (a restarted consumer on an idle engine is caught up), unknown at first
sight. On a real SQLite block index store, as the consumer and the gateway
processes open it."""

from __future__ import annotations

import time
from pathlib import Path

from gateway.prefix.index import BlockIndex, SqliteIndexStore, block_set

ENGINE = 4


def _publish(store: SqliteIndexStore, last_event_at: float) -> None:
    """The consumer's publication of the engine's one GPU block, its newest event at ``last_event_at``."""
    store.publish([block_set(ENGINE, 1, {("GPU", 0): {11: None}}, complete=True, last_event_at=last_event_at)])


def test_a_republished_set_without_a_newer_event_reads_no_lag(tmp_path: Path) -> None:
    store = SqliteIndexStore(tmp_path / "blocks.sqlite3")
    gateway = BlockIndex(store)
    # The engine's last event an hour ago: this process first reads the set now, so when the
    # index came to hold that event is unknown (not an hour of lag).
    idle_since = time.time() - 3600.0
    _publish(store, idle_since)
    gateway.refresh()
    assert gateway.engines[ENGINE].lag_s is None
    # The consumer restarts and publishes from its checkpoint: the same newest event, a new version.
    _publish(store, idle_since)
    gateway.refresh()
    assert (gateway.engines[ENGINE].version, gateway.engines[ENGINE].lag_s) == (2, 0.0)
    # A process started after the restart knows no earlier set: unknown, never the event's age.
    later = BlockIndex(store)
    later.refresh()
    assert (later.engines[ENGINE].version, later.engines[ENGINE].lag_s) == (2, None)


def test_a_newer_event_is_measured_then_the_idle_republish_clears_it(tmp_path: Path) -> None:
    store = SqliteIndexStore(tmp_path / "blocks.sqlite3")
    gateway = BlockIndex(store)
    _publish(store, time.time() - 600.0)
    gateway.refresh()
    # Traffic: an event emitted 12 s before the index held it (a consumer behind).
    before = time.time()
    emitted = before - 12.0
    _publish(store, emitted)
    gateway.refresh()
    after = time.time()
    lag = gateway.engines[ENGINE].lag_s
    assert lag is not None and before - emitted <= lag <= after - emitted
    # Heartbeats alone (nothing changed) keep the figure of the last change.
    store.heartbeat({ENGINE: (time.time(), True)})
    gateway.refresh()
    assert gateway.engines[ENGINE].lag_s == lag
    # The consumer restarts with the engine idle since: the set comes again with that same event.
    _publish(store, emitted)
    gateway.refresh()
    assert (gateway.engines[ENGINE].version, gateway.engines[ENGINE].lag_s) == (3, 0.0)


def test_a_set_without_any_event_has_no_lag(tmp_path: Path) -> None:
    store = SqliteIndexStore(tmp_path / "blocks.sqlite3")
    gateway = BlockIndex(store)
    _publish(store, 0.0)
    gateway.refresh()
    _publish(store, 0.0)
    gateway.refresh()
    assert (gateway.engines[ENGINE].version, gateway.engines[ENGINE].lag_s) == (2, None)
