"""KV-event wire format (against vLLM's own classes) and residency by namespace."""

from __future__ import annotations

import threading

import msgspec
import pytest

from inference.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineResidency,
    KVEventBatch,
    SequenceVerdict,
    decode_batch,
    decode_for_residency,
    encode_batch,
    salt_digest,
    seq_bytes,
    seq_of,
    sequence_verdict,
)

SALTS = {"salt-a": 1, "salt-b": 2}


def stored(hashes: list[int], *, parent: int | None = None, salt: str | None = None, lora: str | None = None, size: int = 32):
    first: tuple | None = None
    if lora and salt:
        first = (lora, salt)
    elif salt:
        first = (salt,)
    elif lora:
        first = (lora,)
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=list(range(size * len(hashes))), block_size=size,
        lora_id=None, medium="GPU", lora_name=lora, extra_keys=[first] + [None] * (len(hashes) - 1),
    )  # fmt: skip


def residency(served: frozenset[int] = frozenset({1, 2})) -> EngineResidency:
    return EngineResidency(namespace_of_salt=SALTS.get, served=served)


def test_vllm_classes_and_ours_read_each_others_bytes() -> None:
    from vllm.distributed import kv_events as v

    theirs = v.KVEventBatch(
        ts=12.5,
        events=[
            v.BlockStored(
                block_hashes=[1, 2], parent_block_hash=None, token_ids=[5] * 64, block_size=32, lora_id=None,
                medium="GPU", lora_name=None, extra_keys=[("salt-a",), None], group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            v.BlockRemoved(block_hashes=[2], medium="GPU"),
            v.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )  # fmt: skip
    payload = msgspec.msgpack.Encoder().encode(theirs)
    ours = decode_batch(payload)
    assert ours.ts == 12.5 and ours.data_parallel_rank == 0
    assert [type(e).__name__ for e in ours.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    first = ours.events[0]
    assert (first.block_hashes, first.parent_block_hash, first.block_size, first.extra_keys) == (
        [1, 2],
        None,
        32,
        [("salt-a",), None],
    )
    assert first.kv_cache_spec_kind == "full_attention" and len(first.token_ids) == 64
    back = msgspec.msgpack.Decoder(type=v.KVEventBatch).decode(encode_batch(ours))
    assert back == theirs
    # The consumer's decoder skips token ids and tracks the same blocks.
    lite = decode_for_residency(payload)
    assert [type(e).__name__ for e in lite.events] == ["_StoredForResidency", "BlockRemoved", "AllBlocksCleared"]
    assert not hasattr(lite.events[0], "token_ids") and lite.events[0].extra_keys == [("salt-a",), None]
    full, fast = residency(), residency()
    cut = KVEventBatch(ts=0, events=ours.events[:2])
    full.apply(cut)
    fast.apply(decode_for_residency(encode_batch(cut)))
    assert full.totals() == fast.totals() == {("GPU", 1): (1, 32)}


def test_a_chain_is_attributed_by_its_first_blocks_salt_and_followed_by_parent() -> None:
    r = residency()
    r.apply(KVEventBatch(ts=0, events=[stored([10, 11, 12], salt="salt-a"), stored([20], salt="salt-b")]))
    r.apply(KVEventBatch(ts=1, events=[stored([13, 14], parent=12)]))
    assert r.totals() == {("GPU", 1): (5, 160), ("GPU", 2): (1, 32)}
    r.apply(KVEventBatch(ts=2, events=[BlockRemoved(block_hashes=[11, 99], medium="GPU")]))
    assert r.totals() == {("GPU", 1): (4, 128), ("GPU", 2): (1, 32)}
    # A block stored twice counts once.
    r.apply(KVEventBatch(ts=3, events=[stored([20], salt="salt-b")]))
    assert r.totals()[("GPU", 2)] == (1, 32)
    r.apply(KVEventBatch(ts=4, events=[AllBlocksCleared()]))
    assert r.totals() == {} and r.cleared == 1 and r.events == 6
    assert r.take_incidents() == []


def test_lora_name_comes_before_the_salt_and_is_not_taken_for_one() -> None:
    r = residency()
    r.apply(KVEventBatch(ts=0, events=[stored([1], salt="salt-b", lora="my-lora")]))
    assert r.totals() == {("GPU", 2): (1, 32)} and r.take_incidents() == []


def test_unknown_salt_no_salt_and_foreign_namespace_are_incidents() -> None:
    r = residency(served=frozenset({1, 2}))
    r.apply(KVEventBatch(ts=0, events=[stored([1, 2], salt="forged"), stored([3], salt="forged"), stored([4])]))
    incidents = {(i.kind, i.key): i.blocks for i in r.take_incidents()}
    assert incidents == {("unknown_salt", salt_digest("forged")): 3, ("no_salt", ""): 1}
    assert r.totals() == {("GPU", 0): (4, 128)}  # unattributed
    assert r.take_incidents() == []
    only_one = residency(served=frozenset({1}))
    only_one.apply(KVEventBatch(ts=0, events=[stored([5])]))  # no salt, one namespace: its own
    only_one.apply(KVEventBatch(ts=0, events=[stored([6], salt="salt-b")]))
    assert only_one.totals() == {("GPU", 1): (1, 32), ("GPU", 2): (1, 32)}
    assert [(i.kind, i.key, i.blocks) for i in only_one.take_incidents()] == [("foreign_namespace", "2", 1)]


def test_a_chain_whose_start_was_missed_is_unattributed() -> None:
    r = residency()
    r.apply(KVEventBatch(ts=0, events=[stored([7, 8], parent=6)]))
    assert r.totals() == {("GPU", 0): (2, 64)}


def test_media_are_counted_apart() -> None:
    r = residency()
    cpu = stored([1], salt="salt-a")
    cpu.medium = "CPU"
    r.apply(KVEventBatch(ts=0, events=[stored([1], salt="salt-a"), cpu]))
    r.apply(KVEventBatch(ts=0, events=[BlockRemoved(block_hashes=[1], medium="GPU")]))
    assert r.totals() == {("CPU", 1): (1, 32)}


def test_snapshot_restores_exactly() -> None:
    r = residency()
    r.apply(KVEventBatch(ts=0, events=[stored([10, 11], salt="salt-a"), stored([12], parent=11), stored([20], salt="salt-b")]))
    copy = residency()
    copy.restore(r.snapshot())
    assert copy.totals() == r.totals() == {("GPU", 1): (3, 96), ("GPU", 2): (1, 32)}
    copy.apply(KVEventBatch(ts=1, events=[stored([13], parent=12)]))
    assert copy.totals()[("GPU", 1)] == (4, 128)
    with pytest.raises((msgspec.DecodeError, ValueError, TypeError)):
        copy.restore(b"\xc1garbage")


def test_the_longest_prefixes_held_are_whole_chains_from_a_prompts_first_block() -> None:
    r = residency()
    # Namespace 1: a trunk 10-11-12 with two branches (13-14 and 15); namespace 2: one block.
    r.apply(KVEventBatch(ts=0, events=[stored([10, 11, 12], salt="salt-a"), stored([13, 14], parent=12),
                                       stored([15], parent=12), stored([20], salt="salt-b")]))  # fmt: skip
    # A chain whose start was never seen is no prefix; an offloaded copy of the trunk counts in its medium.
    cpu = stored([10, 11], salt="salt-a")
    cpu.medium = "CPU"
    r.apply(KVEventBatch(ts=1, events=[stored([40, 41], parent=39), cpu]))
    assert r.longest_prefixes() == {
        1: [{"medium": "GPU", "blocks": 5, "tokens": 160}, {"medium": "GPU", "blocks": 4, "tokens": 128},
            {"medium": "CPU", "blocks": 2, "tokens": 64}],
        2: [{"medium": "GPU", "blocks": 1, "tokens": 32}],
    }  # fmt: skip
    assert r.longest_prefixes(limit=1)[1] == [{"medium": "GPU", "blocks": 5, "tokens": 160}]
    # A block of the trunk evicted: what hangs below it is no longer a prefix; the first block still is.
    r.apply(KVEventBatch(ts=2, events=[BlockRemoved(block_hashes=[11], medium="GPU")]))
    assert r.longest_prefixes()[1] == [{"medium": "CPU", "blocks": 2, "tokens": 64}, {"medium": "GPU", "blocks": 1, "tokens": 32}]
    # The chains survive a checkpoint; a checkpoint written before chains were kept restores without them.
    copy = residency()
    copy.restore(r.snapshot())
    assert copy.longest_prefixes() == r.longest_prefixes()
    old = residency()
    old.restore(msgspec.msgpack.encode([["GPU", 0, [[10, 1, 32], [11, 1, 32]]]]))
    assert old.totals() == {("GPU", 1): (2, 64)} and old.longest_prefixes() == {}


@pytest.mark.parametrize(
    ("last", "seq", "replaying", "verdict"),
    [
        (None, 0, False, SequenceVerdict.APPLY),
        (None, 5, False, SequenceVerdict.GAP),
        (4, 5, False, SequenceVerdict.APPLY),
        (4, 9, False, SequenceVerdict.GAP),
        (4, 0, False, SequenceVerdict.RESTART),
        (4, 4, False, SequenceVerdict.RESTART),
        (4, 3, True, SequenceVerdict.DUPLICATE),
    ],
)
def test_sequence_verdicts(last: int | None, seq: int, replaying: bool, verdict: str) -> None:
    assert sequence_verdict(last, seq, replaying=replaying) == verdict


def test_sequence_frames() -> None:
    assert seq_of(seq_bytes(258)) == 258 and seq_of(seq_bytes(-1)) == -1
    assert seq_bytes(1) == b"\x00" * 7 + b"\x01"
    with pytest.raises(ValueError, match="8 bytes, this one 3"):
        seq_of(b"abc")
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"not msgpack at all")


def test_all_blocks_cleared_empties_engine_memory_only() -> None:
    """vLLM 0.32's AllBlocksCleared comes from the engine's block pool alone
    (v1/core/block_pool.py reset_prefix_cache): offloaded media keep their blocks."""
    r = residency()
    cpu, storage = stored([1, 2], salt="salt-a"), stored([3], salt="salt-b")
    cpu.medium, storage.medium = "CPU", "STORAGE"
    r.apply(KVEventBatch(ts=0, events=[stored([1, 2], salt="salt-a"), cpu, storage]))
    r.apply(KVEventBatch(ts=1, events=[AllBlocksCleared()]))
    assert r.totals() == {("CPU", 1): (2, 64), ("STORAGE", 2): (1, 32)}
    assert (r.cleared, r.kept_at_clear) == (1, {1: {"CPU": 2}, 2: {"STORAGE": 1}})
    r.apply(KVEventBatch(ts=2, events=[BlockRemoved(block_hashes=[1, 2], medium="CPU")]))
    assert r.totals() == {("STORAGE", 2): (1, 32)}
    r.clear()  # a new engine process: nothing of the old one in any medium
    assert r.totals() == {} and r.cleared == 1


def test_parents_that_loop_are_no_prefix_and_the_count_ends() -> None:
    """No engine's hashes make a cycle, but a forged stream can name one: the count must end."""
    r = residency()
    r.apply(KVEventBatch(ts=0, events=[stored([10, 11], salt="salt-a"), stored([50], parent=52, salt="salt-a"),
                                       stored([52], parent=51), stored([51], parent=50), stored([53], parent=51)]))  # fmt: skip
    result: list[dict[int, list[dict[str, object]]]] = []
    worker = threading.Thread(target=lambda: result.append(r.longest_prefixes()), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "longest_prefixes did not end on a cycle of parents"
    assert result == [{1: [{"medium": "GPU", "blocks": 2, "tokens": 64}]}]
