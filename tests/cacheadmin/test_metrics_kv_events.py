"""The KV-event consumer's own metrics (source ``kv_events``): live resident
tokens per engine and namespace key, isolation blocks and batches, fed by real
frames through the consumer and read back from prometheus-client's registry."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, generate_latest

from cacheadmin.metrics.catalogue import METRICS
from cacheadmin.models import Engine
from cacheadmin.services.kv_events import KvEventConsumer, consumer_metrics
from cacheadmin.services.namespaces import namespace_salt_read
from inference.kv_events import AllBlocksCleared, BlockStored

pytestmark = pytest.mark.django_db(transaction=True)


def _stored(hashes: list[int], salt: str | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=[1] * 32 * len(hashes), block_size=32, lora_id=None,
        medium="GPU", lora_name=None, extra_keys=[(salt,) if salt else None] + [None] * (len(hashes) - 1),
    )  # fmt: skip


def test_resident_tokens_and_isolation_blocks_by_namespace_key(world, engine_stream) -> None:
    engine, publisher = engine_stream
    Engine.objects.filter(pk=engine.pk).update(name="e-metrics")
    salt = namespace_salt_read(world["ns"]["acme"], actor="test", purpose="consumer metrics test")
    key = world["ns"]["acme"].namespace_key
    resident = {"engine": "e-metrics", "namespace": key, "medium": "GPU"}
    alarm = {"engine": "e-metrics", "kind": "isolation_unknown_salt"}
    alarms_before = REGISTRY.get_sample_value("kvcp_isolation_alarm_blocks_total", alarm) or 0
    consumer = KvEventConsumer(metrics=consumer_metrics())
    try:
        consumer.refresh()
        stream = consumer.streams[engine.pk]
        consumer.handle(stream, publisher.frames(_stored([1, 2, 3], salt), _stored([7, 8], "not-a-namespace-salt")))
        consumer.flush()
        assert REGISTRY.get_sample_value("kvcp_kv_event_resident_tokens", resident) == 96
        assert REGISTRY.get_sample_value("kvcp_isolation_alarm_blocks_total", alarm) - alarms_before == 2
        text = generate_latest(REGISTRY).decode()
        assert salt not in text and "kvcp_resident_tokens{" not in text  # the control plane's name stays its own
        consumer.handle(stream, publisher.frames(AllBlocksCleared()))
        consumer.flush()
        # Gone from the engine: gone from the gauge, not left at its last figure.
        assert REGISTRY.get_sample_value("kvcp_kv_event_resident_tokens", resident) is None
    finally:
        consumer.ctx.destroy(linger=0)
    assert consumer_metrics() is consumer_metrics()  # one set of families per process


def test_the_consumer_families_are_the_catalogue_s() -> None:
    families = consumer_metrics()
    ours = {m._name: tuple(m._labelnames) for m in families.values()}
    assert ours == {m.name: m.labels for m in METRICS if m.source == "kv_events"}
