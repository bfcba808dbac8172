"""The KV-event consumer publishes each engine's blocks to the block index the
gateways route by (:mod:`cacheadmin.services.block_index`): real ZMQ frames in,
the deployment's store (SQLite under GATEWAY_DIR here, Redis in scale-out)
out, read back by a gateway process's mirror."""

from __future__ import annotations

import time

import pytest

from cacheadmin.models import Engine
from cacheadmin.services.block_index import BlockIndexPublisher, block_index_store, cached_prefixes
from cacheadmin.services.kv_events import KvEventConsumer
from cacheadmin.services.namespaces import namespace_salt_read
from gateway.prefix.index import MEDIUM_BITS, BlockIndex, RedisIndexStore
from tests.kv_publisher import stored

pytestmark = pytest.mark.django_db(transaction=True)
GPU, CPU = MEDIUM_BITS["GPU"], MEDIUM_BITS["CPU"]


def test_the_consumer_publishes_blocks_per_medium_beats_and_drops_a_stopped_engine(world, engine_stream) -> None:
    engine, publisher = engine_stream
    salt = namespace_salt_read(world["ns"]["acme"], actor="test", purpose="block index test")
    consumer = KvEventConsumer()
    consumer.refresh()
    stream = consumer.streams[engine.pk]
    consumer.handle(stream, publisher.frames(stored([11, 12], salt)))
    consumer.handle(stream, publisher.frames(stored([12, 13], medium="CPU", parent=11)))
    consumer.flush()
    index = BlockIndex(block_index_store())
    index.refresh()
    entry = index.engines[engine.pk]
    assert (entry.masks, entry.generation, entry.complete, entry.version) == ({11: GPU, 12: GPU | CPU, 13: CPU}, 1, True, 1)
    assert index.usable(engine.pk) is None
    assert index.held(engine.pk, [11, 12, 13, 14]) == [GPU, GPU | CPU, CPU]

    # Nothing changed: a heartbeat, not a new version.
    before = entry.published_at
    time.sleep(0.01)
    consumer.flush()
    index.refresh()
    assert (index.engines[engine.pk].version, index.engines[engine.pk].published_at > before) == (1, True)

    # The engine stops: the consumer stops following it and its set goes.
    Engine.objects.filter(pk=engine.pk).update(status=Engine.Status.STOPPED)
    consumer.refresh()
    index.refresh()
    assert index.engines == {}
    consumer.ctx.destroy(linger=0)


def test_a_store_that_is_down_costs_the_consumer_nothing_and_loses_no_set(world, engine_stream) -> None:
    engine, publisher = engine_stream
    down = BlockIndexPublisher(RedisIndexStore.from_url("redis://127.0.0.1:1/0", timeout_s=0.2))
    consumer = KvEventConsumer(index=down)
    consumer.refresh()
    stream = consumer.streams[engine.pk]
    consumer.handle(stream, publisher.frames(stored([21])))
    consumer.flush()  # logged, not raised
    assert list(down._sets) == [engine.pk]  # staged again at the next flush
    # The store is back: the staged set goes out with the next flush, though nothing changed since.
    down._store = block_index_store()
    consumer.flush()
    index = BlockIndex(block_index_store())
    index.refresh()
    assert set(index.engines[engine.pk].masks) == {21}
    consumer.ctx.destroy(linger=0)


def test_the_engine_page_shows_the_largest_prefixes_it_holds_per_namespace(world, engine_stream, admin_client) -> None:
    engine, publisher = engine_stream
    salt = namespace_salt_read(world["ns"]["acme"], actor="test", purpose="prefixes test")
    consumer = KvEventConsumer()
    consumer.refresh()
    stream = consumer.streams[engine.pk]
    # A trunk of 3 blocks with branches of 2 and 1 more: prefixes of 5 and 4 blocks; a chain whose start
    # never came is none.
    consumer.handle(stream, publisher.frames(stored([31, 32, 33], salt)))
    consumer.handle(stream, publisher.frames(stored([34, 35], parent=33)))
    consumer.handle(stream, publisher.frames(stored([36], parent=33)))
    consumer.handle(stream, publisher.frames(stored([51, 52], parent=50)))
    consumer.flush(force=True)
    found = cached_prefixes(engine.pk)
    assert found == {"too_large": False, "namespaces": [{
        "namespace": world["ns"]["acme"].pk, "namespace_key": world["ns"]["acme"].namespace_key,
        "model_version": world["ns"]["acme"].model_version.label,
        "prefixes": [{"medium": "GPU", "blocks": 5, "tokens": 160}, {"medium": "GPU", "blocks": 4, "tokens": 128}],
    }]}  # fmt: skip
    page = admin_client.get(f"/engines/{engine.pk}/live")
    html = page.content.decode()
    assert page.status_code == 200 and "Largest cached prefixes" in html
    table = html[html.index('id="engine-prefixes"') :].split("</table>")[0]
    assert table.count("<tr><td>") == 2 and "<td>160</td>" in table and "<td>128</td>" in table
    consumer.ctx.destroy(linger=0)


def test_a_gap_makes_the_engine_unusable_for_routing_and_a_restart_empties_its_set(world, engine_stream) -> None:
    engine, publisher = engine_stream
    salt = namespace_salt_read(world["ns"]["acme"], actor="test", purpose="gap test")
    consumer = KvEventConsumer()
    consumer.refresh()
    stream = consumer.streams[engine.pk]
    consumer.handle(stream, publisher.frames(stored([61, 62], salt)))
    # Batches 1..2 never arrive and the engine's replay no longer holds them: the stream has a gap.
    publisher.buffer = type(publisher.buffer)(publisher.buffer, maxlen=1)
    publisher.frames(stored([63], salt, parent=62))
    publisher.frames(stored([64], salt, parent=63))
    consumer.handle(stream, publisher.frames(stored([65], parent=64)))
    consumer.flush()
    index = BlockIndex(block_index_store())
    index.refresh()
    assert (index.usable(engine.pk), set(index.engines[engine.pk].masks)) == ("incomplete", {61, 62, 65})
    # The engine process started over: nothing it held survives, and the new stream is whole again.
    publisher.seq = 0
    consumer.handle(stream, publisher.frames(stored([71], salt)))
    consumer.flush()
    index.refresh()
    assert (index.usable(engine.pk), index.engines[engine.pk].masks) == (None, {71: GPU})
    consumer.ctx.destroy(linger=0)
