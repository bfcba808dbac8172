"""Residency per medium as vLLM 0.32 resets it: vLLM's own event classes,
published on real ZMQ sockets and read by the consumer. ``AllBlocksCleared``
empties engine memory (``GPU``) only; an offloading connector's ``CPU`` and
``STORAGE`` blocks stay until their own ``BlockRemoved``, and a purge that
leaves them is not confirmed, whatever its probe answers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from cacheadmin.models import EngineAlarm, KvEventStream, ResidentSample
from cacheadmin.selectors_dashboard import chart_resident
from cacheadmin.services.eviction.common import EvictionNotConfirmed
from cacheadmin.services.eviction.probe import engine_probe
from cacheadmin.services.kv_events import KvEventConsumer, reset_observed, residency_now
from cacheadmin.services.namespaces import namespace_salt_read
from cacheadmin.services.tiers import tiers_configured

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def vllm_events() -> Any:
    """vLLM's own event classes (importing them loads vLLM: ~10 s)."""
    from vllm.distributed import kv_events

    return kv_events


def _gpu(v: Any, hashes: list[int], salt: str, parent: int | None = None) -> Any:
    """A request's blocks as the engine's block pool publishes them (v1/core/block_pool.py)."""
    return v.BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=[7] * 32 * len(hashes), block_size=32, lora_id=None,
        medium=v.MEDIUM_GPU, lora_name=None, extra_keys=[(salt,) if parent is None else None] + [None] * (len(hashes) - 1),
        group_idx=0, kv_cache_spec_kind="full_attention",
    )  # fmt: skip


def _offloaded(v: Any, medium: str, hashes: list[int], parent: int | None = None) -> Any:
    """A chunk as OffloadingConnector's self-describing events publish it
    (offloading/events.py ``_take_stored_event``): no salt in ``extra_keys``."""
    return v.BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=[7] * 32 * len(hashes), block_size=32, lora_id=None,
        medium=medium, lora_name=None, extra_keys=None, group_idx=0, kv_cache_spec_kind="full_attention",
        locality="LOCAL",
    )  # fmt: skip


@pytest.fixture
def consumer_of() -> Iterator[Callable[[Any], tuple[KvEventConsumer, Any]]]:
    """A consumer and its stream of an engine; their sockets closed after the test, passed or not."""
    made: list[KvEventConsumer] = []

    def make(engine: Any) -> tuple[KvEventConsumer, Any]:
        consumer = KvEventConsumer()
        made.append(consumer)
        consumer.refresh()
        return consumer, consumer.streams[engine.pk]

    yield make
    for consumer in made:
        consumer.ctx.destroy(linger=0)


def test_a_reset_empties_engine_memory_and_offloaded_blocks_stay_until_removed(
    world, engine_stream, vllm_events, consumer_of
) -> None:
    v = vllm_events
    engine, publisher = engine_stream
    acme, globex = world["ns"]["acme"], world["ns"]["globex"]
    engine.attached_namespaces.add(globex)  # two namespaces: a salt-less block is nobody's by default
    salt_a = namespace_salt_read(acme, actor="test", purpose="reset media test")
    salt_g = namespace_salt_read(globex, actor="test", purpose="reset media test")
    consumer, stream = consumer_of(engine)
    a, g = acme.pk, globex.pk

    def step(*events: Any) -> dict:
        consumer.handle(stream, publisher.frames(*events))
        return stream.residency.totals()

    assert step(_gpu(v, [1, 2], salt_a), _gpu(v, [3], salt_a, parent=2), _gpu(v, [10], salt_g)) == {
        ("GPU", a): (3, 96), ("GPU", g): (1, 32),
    }  # fmt: skip
    # Offloaded copies carry no salt: attributed by their hash in engine memory, no alarm.
    assert step(_offloaded(v, v.MEDIUM_CPU, [1, 2]), _offloaded(v, v.MEDIUM_CPU, [10])) == {
        ("GPU", a): (3, 96), ("GPU", g): (1, 32), ("CPU", a): (2, 64), ("CPU", g): (1, 32),
    }  # fmt: skip
    # A chunk whose parent is offloaded in another tier only (held in GPU).
    assert step(_offloaded(v, v.MEDIUM_STORAGE, [3], parent=2)) == {
        ("GPU", a): (3, 96), ("GPU", g): (1, 32), ("CPU", a): (2, 64), ("CPU", g): (1, 32), ("STORAGE", a): (1, 32),
    }  # fmt: skip
    before = timezone.now()
    # The engine's reset: GPU emptied, the offload tiers untouched.
    assert step(v.AllBlocksCleared()) == {("CPU", a): (2, 64), ("CPU", g): (1, 32), ("STORAGE", a): (1, 32)}
    assert stream.cleared_at is not None and stream.cleared_kept == {str(a): {"CPU": 2, "STORAGE": 1}, str(g): {"CPU": 1}}
    # A new request after the reset: GPU again, its chain attributed by salt.
    assert step(_gpu(v, [1, 2], salt_a)) == {
        ("GPU", a): (2, 64), ("CPU", a): (2, 64), ("CPU", g): (1, 32), ("STORAGE", a): (1, 32),
    }  # fmt: skip
    # Each offloaded block goes with its own BlockRemoved, in its own medium only.
    assert step(v.BlockRemoved(block_hashes=[1, 2], medium=v.MEDIUM_CPU, group_idx=0)) == {
        ("GPU", a): (2, 64), ("CPU", g): (1, 32), ("STORAGE", a): (1, 32),
    }  # fmt: skip
    assert step(v.BlockRemoved(block_hashes=[3], medium=v.MEDIUM_STORAGE, group_idx=0)) == {
        ("GPU", a): (2, 64), ("CPU", g): (1, 32),
    }  # fmt: skip
    consumer.flush(force=True)
    assert not EngineAlarm.objects.filter(engine=engine).exists()
    assert stream.unconfirmed == 0 and stream.residency.cleared == 1
    saved = KvEventStream.objects.get(engine=engine)
    assert saved.cleared_kept == {str(a): {"CPU": 2, "STORAGE": 1}, str(g): {"CPU": 1}}
    now = residency_now(engine)
    assert now["cleared_kept"] == saved.cleared_kept
    assert {(r["namespace"], r["medium"]): (r["blocks"], r["tokens"]) for r in now["namespaces"]} == {
        (a, "GPU"): (2, 64), (g, "CPU"): (1, 32),
    }  # fmt: skip
    # The clear left acme's offloaded blocks: not a complete reset of acme, nor of globex.
    at = stream.cleared_at.isoformat()
    assert reset_observed(engine, acme, since=before, timeout_s=0) == {
        "kv_events": "AllBlocksCleared", "at": at, "kept": {"CPU": 2, "STORAGE": 1},
    }  # fmt: skip
    assert reset_observed(engine, globex, since=before, timeout_s=0) == {
        "kv_events": "AllBlocksCleared", "at": at, "kept": {"CPU": 1},
    }  # fmt: skip
    # The engine page says what the clear left.
    page = Client()
    page.force_login(User.objects.create_user("viewer"))
    live = page.get(f"/engines/{engine.pk}/live").content.decode()
    assert "it empties engine KV cache memory only" in live and "offloaded blocks of 2 namespaces stayed" in live
    # The consumer restarts from its checkpoint with the same view.
    again, resumed = consumer_of(engine)
    assert resumed.residency.totals() == stream.residency.totals() and resumed.cleared_kept == stream.cleared_kept


def test_a_zero_sample_in_one_medium_is_not_a_reset_of_the_namespace(world, engine_stream, vllm_events, consumer_of) -> None:
    """Without an AllBlocksCleared, the namespace's blocks removed from GPU while
    its offloaded copy stays is no reset; removed everywhere, it is."""
    v = vllm_events
    engine, publisher = engine_stream
    acme = world["ns"]["acme"]
    salt = namespace_salt_read(acme, actor="test", purpose="reset media test")
    consumer, stream = consumer_of(engine)
    consumer.handle(stream, publisher.frames(_gpu(v, [1], salt), _offloaded(v, v.MEDIUM_CPU, [1])))
    consumer.flush(force=True)
    since = timezone.now()
    consumer.handle(stream, publisher.frames(v.BlockRemoved(block_hashes=[1], medium=v.MEDIUM_GPU, group_idx=0)))
    consumer.flush(force=True)
    assert ResidentSample.objects.filter(engine=engine, namespace=acme, medium="GPU", blocks=0).count() == 1
    assert reset_observed(engine, acme, since=since, timeout_s=0) is None
    consumer.handle(stream, publisher.frames(v.BlockRemoved(block_hashes=[1], medium=v.MEDIUM_CPU, group_idx=0)))
    consumer.flush(force=True)
    removed = reset_observed(engine, acme, since=since, timeout_s=0)
    assert removed is not None and removed["kv_events"] == "blocks removed" and "kept" not in removed


class _EngineAfterReset:
    """The engine side of the probe: ``reset_prefix_cache`` then a chat whose
    scheduler step publishes what vLLM does (the AllBlocksCleared, then the
    probe's own blocks), read by the real consumer. The probe answers
    ``cached_tokens`` as given: zero here, so only the stream can refuse."""

    def __init__(self, consumer: KvEventConsumer, stream: Any, publisher: Any, step_events: list[Any]) -> None:
        self.consumer, self.stream, self.publisher, self.step_events = consumer, stream, publisher, step_events
        self.resets = 0

    def __enter__(self) -> _EngineAfterReset:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def reset_prefix_cache(self) -> None:
        self.resets += 1

    def chat(self, messages: Any, **kwargs: Any) -> SimpleNamespace:
        self.consumer.handle(self.stream, self.publisher.frames(*self.step_events))
        self.consumer.flush(force=True)
        return SimpleNamespace(cached_tokens=0, prompt_tokens=96)


@pytest.mark.parametrize("offloaded_left", [True, False])
def test_a_purge_with_offloaded_blocks_left_is_not_complete(
    world, engine_stream, vllm_events, consumer_of, monkeypatch, offloaded_left: bool
) -> None:
    v = vllm_events
    engine, publisher = engine_stream
    acme = world["ns"]["acme"]
    salt = namespace_salt_read(acme, actor="test", purpose="reset media test")
    consumer, stream = consumer_of(engine)
    consumer.handle(stream, publisher.frames(_gpu(v, [1, 2, 3], salt), _offloaded(v, v.MEDIUM_CPU, [1, 2, 3])))
    if not offloaded_left:
        consumer.handle(stream, publisher.frames(v.BlockRemoved(block_hashes=[1, 2, 3], medium=v.MEDIUM_CPU, group_idx=0)))
    consumer.flush(force=True)
    fake = _EngineAfterReset(consumer, stream, publisher, [v.AllBlocksCleared(), _gpu(v, [1, 2, 3], salt)])
    monkeypatch.setattr("cacheadmin.services.eviction.probe.engine_client", lambda e: fake)
    tiers = tiers_configured()  # the engine has no connector: no tier is touched
    if offloaded_left:
        with pytest.raises(EvictionNotConfirmed, match=r"left blocks of the namespace offloaded \(3 in CPU\)"):
            engine_probe(engine, acme, tiers)
    else:
        result = engine_probe(engine, acme, tiers)
        assert (result["cached_tokens"], result["kv_events"]) == (0, "AllBlocksCleared") and "kept" not in result
    assert fake.resets == 1


def test_the_dashboard_charts_resident_tokens_per_medium(world) -> None:
    """A block offloaded to CPU is also held in GPU: summing media double-counts, and a reset empties GPU alone."""
    engine, acme = world["engine"], world["ns"]["acme"]
    now = timezone.now()
    for medium, tokens in (("GPU", 64), ("CPU", 96), ("STORAGE", 32)):
        ResidentSample.objects.create(
            engine=engine, namespace=acme, medium=medium, sampled_at=now, blocks=tokens // 32, tokens=tokens
        )
    ResidentSample.objects.create(engine=engine, namespace=None, medium="GPU", sampled_at=now, blocks=1, tokens=32)
    assert chart_resident() == {
        "labels": ["acme/v1", "unattributed"],
        "datasets": [
            {"label": "engine KV cache memory tokens", "data": [64, 32]},
            {"label": "CPU offload tier tokens", "data": [96, 0]},
            {"label": "storage offload tier tokens", "data": [32, 0]},
        ],
    }
