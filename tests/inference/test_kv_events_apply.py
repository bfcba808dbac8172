"""``EngineResidency.apply`` (by runs and chains) against ``apply_each`` (event by event, block by block)
on seeded random batches: the resulting state must be the same, to the byte of the checkpoint."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from inference.kv_events import (
    PROBE,
    UNKNOWN_PARENT,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineResidency,
    KVEventBatch,
    decode_for_residency,
    encode_batch,
)

SALTS: dict[str, int] = {"salt-a": 1, "salt-b": 2, "salt-c": 3, "probe-salt": PROBE}
#: Media with their group indices, as vLLM may publish them (None: the engine's own medium, group 0).
TIERS: list[tuple[str | None, int | None]] = [("GPU", 0), (None, None), ("GPU", 1), ("CPU", 0), ("STORAGE", None)]


def needs_confirmation_each(r: EngineResidency, batch: Any) -> bool:
    """The per-event form of ``needs_confirmation``: a clear, or a chain start that is an incident."""
    for event in batch.events:
        if type(event) is AllBlocksCleared:
            return True
        if type(event) is not BlockRemoved and event.parent_block_hash is None and r._chain_start(event)[1] is not None:
            return True
    return False


def random_batch(rng: random.Random, pool: list[int], seen: list[int], step: int) -> KVEventBatch:
    """1-12 events over a small hash space, so chains meet held blocks, repeat hashes, continue
    removed or unknown parents, and removals hit held, gone and never-seen blocks."""
    events: list[Any] = []
    for _ in range(rng.randint(1, 12)):
        roll = rng.random()
        medium, group = rng.choice(TIERS) if rng.random() < 0.4 else TIERS[0]
        if roll < 0.03:
            events.append(AllBlocksCleared())
        elif roll < 0.45:
            n = rng.choice([0, 1, 1, 2, 3, 5, 8])
            hashes = [rng.choice(pool) if pool and rng.random() < 0.2 else rng.getrandbits(20) for _ in range(n)]
            if n > 2 and rng.random() < 0.1:
                hashes[-1] = hashes[0]  # a hash twice in one chain
            parent = None
            if seen and rng.random() < 0.6:
                parent = rng.choice(seen)
            elif rng.random() < 0.1:
                parent = rng.getrandbits(20)  # a parent never seen
            lora = "lora-x" if rng.random() < 0.1 else None
            salt = rng.choice([*SALTS, "forged", None])
            first: tuple[Any, ...] | None = tuple(k for k in (lora, salt) if k is not None) or None
            if first is not None and rng.random() < 0.1:
                first = (*first, ("mm", 0))  # a multimodal pair beside the salt
            extra = [first] + [None] * (n - 1) if n and rng.random() < 0.9 else None
            events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=[7] * (16 * n),
                    block_size=rng.choice([16, 32]),
                    lora_id=None,
                    medium=medium,
                    lora_name=lora,
                    extra_keys=extra,
                    group_idx=group,
                )  # fmt: skip
            )
            seen.extend(hashes)
            pool.extend(hashes)
        else:
            k = rng.choice([1, 1, 1, 2, 4])
            hashes = [rng.choice(pool) if pool and rng.random() < 0.85 else rng.getrandbits(20) for _ in range(k)]
            events.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))
    if len(seen) > 400:
        del seen[:200]
    return KVEventBatch(ts=float(step), events=events, data_parallel_rank=0)


def state(r: EngineResidency) -> dict[str, Any]:
    """Everything the residency holds, with the order of its tables (the checkpoint's bytes follow it).

    Not ``longest_prefixes``: it is a function of ``blocks`` alone (each block's parent), and the reused hashes
    here can link parents into a cycle, which vLLM's hashes of the prefix cannot."""
    return {
        "blocks": [(tier, list(table.items())) for tier, table in r.blocks.items()],
        "incidents": list(r.incidents),
        "cleared": r.cleared,
        "kept_at_clear": r.kept_at_clear,
        "events": r.events,
        "totals": r.totals(),
        "snapshot": r.snapshot(),
    }


def make(served: frozenset[int]) -> EngineResidency:
    return EngineResidency(namespace_of_salt=SALTS.get, served=served)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("served", [frozenset({1, 2}), frozenset({1}), frozenset()])
def test_apply_by_runs_equals_event_by_event(seed: int, served: frozenset[int]) -> None:
    rng = random.Random(seed)
    pool: list[int] = []
    seen: list[int] = []
    batched, each, lite = make(served), make(served), make(served)
    applied = {"removed": 0, "stored": 0, "cleared": 0, "confirm": 0}
    for step in range(300):
        batch = random_batch(rng, pool, seen, step)
        decoded = decode_for_residency(encode_batch(batch))
        confirm = needs_confirmation_each(each, batch)
        assert batched.needs_confirmation(batch) is confirm
        assert lite.needs_confirmation(decoded) is confirm
        applied["confirm"] += confirm
        batched.apply(batch)
        lite.apply(decoded)  # what the consumer decodes: no token ids
        each.apply_each(batch)
        for event in batch.events:
            applied[{BlockRemoved: "removed", AllBlocksCleared: "cleared", BlockStored: "stored"}[type(event)]] += 1
        if step % 25 == 0 or step == 299:
            want = state(each)
            assert state(batched) == want
            assert state(lite) == want
    # The batches met every case: clears, incidents, chains continued, blocks evicted while held.
    assert min(applied.values()) > 0 and each.cleared == applied["cleared"]
    assert each.take_incidents() and sum(map(len, each.blocks.values())) > 0


def test_apply_from_a_checkpoint_without_parents() -> None:
    """A checkpoint written before chains were kept restores blocks without parents: both forms go on alike."""
    rng = random.Random(99)
    pool: list[int] = []
    seen: list[int] = []
    warm = make(frozenset({1, 2}))
    for step in range(60):
        warm.apply_each(random_batch(rng, pool, seen, step))
    rows = [
        [medium, group, [[h, ns, size] for h, (ns, size, _) in table.items()]] for (medium, group), table in warm.blocks.items()
    ]
    old = msgspec.msgpack.encode(rows)
    batched, each = make(frozenset({1, 2})), make(frozenset({1, 2}))
    batched.restore(old)
    each.restore(old)
    held = [entry for table in each.blocks.values() for entry in table.values()]
    assert held and all(parent == UNKNOWN_PARENT for _, _, parent in held)
    for step in range(60, 200):
        batch = random_batch(rng, pool, seen, step)
        batched.apply(batch)
        each.apply_each(batch)
    assert state(batched) == state(each)


def test_a_run_of_removals_over_media_and_a_store_after_it() -> None:
    """Removals of several media in one run, then a chain whose parent only the removed medium held:
    the store sees the removal (unattributed), as event by event."""
    batched, each = make(frozenset({1, 2})), make(frozenset({1, 2}))
    first = KVEventBatch(
        ts=0,
        events=[
            BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[], block_size=32, lora_id=None,
                        medium="GPU", lora_name=None, extra_keys=[("salt-a",), None]),
            BlockStored(block_hashes=[3], parent_block_hash=None, token_ids=[], block_size=32, lora_id=None,
                        medium="CPU", lora_name=None, extra_keys=[("salt-b",)]),
        ],
    )  # fmt: skip
    second = KVEventBatch(
        ts=1,
        events=[
            BlockRemoved(block_hashes=[2], medium="GPU"),
            BlockRemoved(block_hashes=[3, 4], medium="CPU"),
            BlockRemoved(block_hashes=[1], medium=None, group_idx=None),
            BlockStored(block_hashes=[5], parent_block_hash=2, token_ids=[], block_size=32, lora_id=None,
                        medium="CPU", lora_name=None),
        ],
    )  # fmt: skip
    for apply in (batched.apply, each.apply_each):
        apply(first)
        apply(second)
    assert state(batched) == state(each)
    assert batched.blocks == {("GPU", 0): {}, ("CPU", 0): {5: (0, 32, 2)}}
    assert batched.events == 6
