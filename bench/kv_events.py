"""KV-event consumer throughput against a bare decoding subscriber, and end-to-end lag.

Part 1, throughput (unless ``--lag-only``). A publisher in its own process replays at least
``--events`` (default 1,000,000) KV events in vLLM 0.32's wire format: ZMQ
multipart ``(topic, 8-byte big-endian seq, msgpack KVEventBatch)`` from a
socket that *connects* to the subscriber's bound ``tcp://127.0.0.1:PORT``
endpoint, as vLLM's ``ZmqEventPublisher`` does for a non-wildcard endpoint.
The batches are built and msgpack-encoded before anything is timed, one batch
per simulated scheduler step:

- 1-3 ``BlockStored`` per batch, chains of 2-8 blocks of 32 tokens (token ids
  of a 32,768-token vocabulary, 64-bit block hashes, ``medium="GPU"``,
  ``group_idx=0``). 40 % start a prompt (``parent_block_hash`` None, the
  namespace's ``cache_salt`` in the first block's ``extra_keys``, as vLLM
  publishes it), 60 % continue an earlier, still resident chain;
- a ``BlockRemoved`` of one hash per evicted block (vLLM emits one event per
  evicted block) once ``--capacity`` blocks are resident, oldest first;
- an ``AllBlocksCleared`` every ``--clear-every`` batches.

Each run alternates (bare, consumer, bare, consumer, ... ``--rounds`` each):

- bare: a SUB socket binds the endpoint and calls
  :func:`inference.kv_events.decode_batch` on each payload, nothing else;
- consumer: the real :class:`cacheadmin.services.kv_events.KvEventConsumer`
  (Django, a scratch SQLite database in a temporary ``VAR_DIR``) owns an
  ``Engine`` row whose ``kv_events_endpoint`` it binds, and runs
  ``run(should_stop=...)`` until the last batch is applied: sequence checks,
  ``EngineResidency.apply``, and its checkpoint/sample flush every 2 s (part of the
  real cost) all run inside the timed window.

The publisher (``zmq.XPUB``, wire-identical to PUB for a subscriber) waits for
the subscription to arrive before sending, so no batch is lost to a late join,
and uses vLLM's high-water mark (100,000) with ``XPUB_NODROP`` so that a slow
subscriber slows the publisher instead of losing batches; losses would still
show as sequence gaps and are reported. Time runs from the publisher's first
send to the subscriber's last applied batch (``time.monotonic``, one clock for
the whole host). Reported: events/s per run, median per method, the ratio
consumer/bare (goal >= 0.8x), how long the publisher itself took to send (a
bare rate close to it is publisher-bound), an in-process breakdown without
sockets (decode only, decode + ``EngineResidency.apply``, ``KvEventConsumer.handle``),
and a check that the consumer's final residency, its checkpoint in the
database and its latest samples equal what a pure ``EngineResidency`` fed the same
batches computes.

Part 2, end-to-end lag (``--engine``). Starts a real vLLM engine on the demo
checkpoint ``tiny-v1`` with ``--kv-events-config`` pointing at a consumer
endpoint, keeps ``--clients`` concurrent chat requests under a namespace's
salt running, and alternates phases of ``--phase-s`` seconds: the consumer
(``handle`` wrapped to time each live batch) and the bare subscriber, binding
the same endpoint in turn. Lag of a batch = wall clock when it was received
(or applied) minus ``batch.ts`` (the engine's ``time.time()`` when its
scheduler step made it; same host, same clock). Prints p50/p99/max per
method, and how long the consumer's checkpoint/sample writes and engine-list
reloads took (a batch that arrives during one waits for it). The first batch
of each consumer phase is left out (and counted): the engine published while
the bare subscriber held the endpoint, so the consumer meets a sequence gap
there and records it, which a consumer that runs all along does not.

``--profile`` adds a consumer run under cProfile and prints where the time goes.

Usage::

    .venv/bin/python bench/kv_events.py                       # 1,000,000 events, 3 rounds
    .venv/bin/python bench/kv_events.py --events 2000000 --rounds 5 --profile
    .venv/bin/python bench/kv_events.py --engine               # + lag with a real engine (~1 min start-up)
    .venv/bin/python bench/kv_events.py --lag-only             # the lag part alone

Exit status 0 whatever the ratio (read ``goal_pass`` in the JSON line); 1 when
the residency check fails or batches were lost; 2 when a run could not start.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import math
import os
import pstats
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "out"

import zmq  # noqa: E402

from bench import cli  # noqa: E402
from inference.child_env import die_with_parent  # noqa: E402
from inference.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineResidency,
    KVEventBatch,
    decode_batch,
    decode_for_residency,
    encode_batch,
    seq_of,
)
from inference.kv_transport import private_socket_dir  # noqa: E402

BLOCK_SIZE = 32
#: Vocabulary of the demo checkpoints' tokenizer (SentencePiece v3): token ids fit msgpack uint16, as real ones do.
VOCAB = 32_768
#: vLLM 0.32 ``ZmqEventPublisher`` default high-water mark of its PUB socket.
VLLM_HWM = 100_000
TOPIC = "kvcp.bench"
GOAL = 0.8
#: How long a subscriber waits for the next batch before the run counts as lost.
IDLE_TIMEOUT_S = 30.0


class BenchError(Exception):
    """A run could not start or finish (the message says why)."""


# -- workload ---------------------------------------------------------------


@dataclass
class Workload:
    """Pre-encoded batches and what they hold."""

    payloads: list[bytes]
    events: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    blocks_stored: int = 0

    @property
    def nbytes(self) -> int:
        """Payload bytes in all."""
        return sum(len(p) for p in self.payloads)


def build_workload(salts: list[str], *, events: int, capacity: int, clear_every: int, seed: int = 7) -> Workload:
    """Batches of at least ``events`` events, as an engine under load would publish them.

    Salts are drawn with Zipf-like weights (a few namespaces are hot). Block
    hashes are random 64-bit integers (vLLM publishes the low 64 bits of its
    block hash); token ids come from a pool of 1,024 random blocks, so the
    payloads have real token-id sizes without generating 30 million random ints.
    """
    rng = random.Random(seed)
    pool = [[rng.randrange(VOCAB) for _ in range(BLOCK_SIZE)] for _ in range(1024)]
    weights = [1.0 / (i + 1) for i in range(len(salts))]
    resident: set[int] = set()
    order: deque[int] = deque()  # insertion order: eviction takes the oldest first
    tails: list[int] = []  # last block of each chain that a later step may extend
    work = Workload(payloads=[])
    ts = 1_790_000_000.0
    step = 0
    while work.events < events:
        step += 1
        ts += 0.02
        batch: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        if clear_every and step % clear_every == 0:
            batch.append(AllBlocksCleared())
            resident.clear()
            order.clear()
            tails.clear()
            work.cleared += 1
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(2, 8)
            parent: int | None = None
            if tails and rng.random() < 0.6:
                i = rng.randrange(len(tails))
                tail = tails[i]
                tails[i] = tails[-1]
                tails.pop()
                if tail in resident:  # else evicted since: this request starts a prompt instead
                    parent = tail
            hashes = [rng.getrandbits(64) for _ in range(n)]
            extra: list[tuple[Any, ...] | None] = [None] * n
            if parent is None:
                extra[0] = (rng.choices(salts, weights)[0],)
            batch.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=list(itertools.chain.from_iterable(pool[rng.randrange(1024)] for _ in range(n))),
                    block_size=BLOCK_SIZE,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=extra,
                    group_idx=0,
                )
            )
            resident.update(hashes)
            order.extend(hashes)
            tails.append(hashes[-1])
            if len(tails) > 512:  # old conversations are not continued any more
                tails[0] = tails[-1]
                tails.pop()
            work.stored += 1
            work.blocks_stored += n
        while len(resident) > capacity:
            oldest = order.popleft()
            if oldest in resident:
                resident.discard(oldest)
                batch.append(BlockRemoved(block_hashes=[oldest], medium="GPU", group_idx=0))
                work.removed += 1
        work.events += len(batch)
        work.payloads.append(encode_batch(KVEventBatch(ts=ts, events=batch, data_parallel_rank=0)))
    return work


def write_payloads(path: Path, payloads: list[bytes]) -> None:
    """Length-prefixed payloads in one file, for the publisher process."""
    with path.open("wb") as f:
        for p in payloads:
            f.write(struct.pack(">I", len(p)))
            f.write(p)


def read_payloads(path: Path) -> list[bytes]:
    """The payloads :func:`write_payloads` wrote."""
    data = path.read_bytes()
    out: list[bytes] = []
    pos = 0
    while pos < len(data):
        (n,) = struct.unpack_from(">I", data, pos)
        out.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return out


# -- publisher process ------------------------------------------------------


def publish(path: Path, endpoint: str, topic: str) -> int:
    """Publisher process: send every payload of ``path`` once the subscription is in.

    Prints one JSON line: ``t0`` (monotonic time of the first send), ``t1``
    (after the last send returned), ``batches``.
    """
    payloads = read_payloads(path)
    ctx = zmq.Context()
    # XPUB sends exactly what PUB sends and, unlike PUB, hands us the
    # subscriber's subscription: the start handshake, with no probe frames.
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, VLLM_HWM)
    pub.setsockopt(zmq.XPUB_NODROP, 1)  # block at the high-water mark instead of dropping
    pub.bind(endpoint)  # vLLM binds an ipc:// endpoint; its consumer connects
    if not pub.poll(60_000):
        print(json.dumps({"error": "no subscription within 60 s"}), flush=True)
        return 2
    pub.recv()
    topic_bytes = topic.encode()
    send = pub.send_multipart
    t0 = time.monotonic()
    for seq, payload in enumerate(payloads):
        send((topic_bytes, seq.to_bytes(8, "big"), payload))
    t1 = time.monotonic()
    # Closed only once the subscriber has gone (its unsubscription arrives when it closes, after the
    # last batch or its idle timeout): a bound socket closed while batches are still queued lost the
    # last few of them now and then here, lingering or not.
    if pub.poll(int((IDLE_TIMEOUT_S + 60) * 1000)):
        pub.recv()
    pub.close(linger=0)
    ctx.term()
    print(json.dumps({"t0": t0, "t1": t1, "batches": len(payloads)}), flush=True)
    return 0


def start_publisher(path: Path, endpoint: str, topic: str) -> subprocess.Popen[str]:
    """This script in publisher mode, as a separate process (its own interpreter and GIL)."""
    return subprocess.Popen(
        [sys.executable, __file__, "--publish", str(path), "--endpoint", endpoint, "--topic", topic],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_parent,
    )


def publisher_result(proc: subprocess.Popen[str], timeout: float = 180.0) -> dict[str, Any]:
    """The publisher's JSON line.

    Raises:
        BenchError: it failed or printed nothing.
    """
    out, _ = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": f"publisher exited {proc.returncode} with no result"}
    if "error" in result:
        raise BenchError(f"publisher: {result['error']}")
    return result


# -- runs -------------------------------------------------------------------


@dataclass
class RunResult:
    """One timed run."""

    method: str
    events: int
    batches: int
    seconds: float
    publisher_s: float
    lost_events: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        """Events per second."""
        return self.events / self.seconds


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_endpoints = itertools.count()


def ipc_endpoint(var_dir: Path) -> str:
    """A fresh ``ipc://`` endpoint in a directory of this user with mode 0700: where a local engine
    publishes, and the only kind of plain endpoint the consumer reads (:mod:`inference.kv_transport`)."""
    sockets = private_socket_dir(var_dir / "sockets")
    return f"ipc://{sockets}/kv-{os.getpid()}-{next(_endpoints)}.sock"


def run_bare(path: Path, work: Workload, var_dir: Path) -> RunResult:
    """Bare subscriber: connect, receive, ``decode_batch``, count events."""
    endpoint = ipc_endpoint(var_dir)
    proc = start_publisher(path, endpoint, TOPIC)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, int(IDLE_TIMEOUT_S * 1000))
    sub.connect(endpoint)  # ZMQ retries until the publisher has bound
    last = len(work.payloads) - 1
    events = batches = 0
    expected = 0
    gaps = 0
    try:
        recv = sub.recv_multipart
        while True:
            try:
                frames = recv()
            except zmq.Again:
                gaps += 1
                break
            events += len(decode_batch(frames[2]).events)
            batches += 1
            seq = seq_of(frames[1])
            if seq != expected:
                gaps += 1
            expected = seq + 1
            if seq == last:
                break
        end = time.monotonic()
    finally:
        sub.close(linger=0)
        ctx.term()
    pub = publisher_result(proc)
    return RunResult("bare", events, batches, end - pub["t0"], pub["t1"] - pub["t0"], work.events - events, {"gaps": gaps})


@dataclass
class World:
    """The control-plane rows the consumer needs."""

    version: Any
    namespaces: list[Any]
    salt_of: dict[int, str]

    @property
    def namespace_of_salt(self) -> dict[str, int]:
        """cache_salt → namespace id."""
        return {salt: pk for pk, salt in self.salt_of.items()}


def make_world(namespaces: int) -> World:
    """A model version, a retention owner, ``namespaces`` tenants with a namespace each, and their salts."""
    from cacheadmin.models import CacheNamespace, ModelVersion, RetentionOwner, Tenant
    from cacheadmin.services.namespaces import namespace_salt_read

    version = ModelVersion.objects.create(
        label="bench-kv", served_name="tiny", path="/m", weights="a" * 64, tokenizer="b" * 64, config="c" * 64,
        layout="d" * 64, adapters="e" * 64, identity="1" * 64,
        inputs={"weights": {"model.safetensors": "a" * 64}, "layout": {"block_size": BLOCK_SIZE}},
    )  # fmt: skip
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    # One namespace per (version, tenant): a tenant each.
    rows = [
        CacheNamespace.objects.create(
            namespace_key=f"{i:064x}",
            model_version=version,
            tenant=Tenant.objects.create(slug=f"bench-{i}", name=f"Bench {i}"),
            retention_owner=owner,
            storage_prefix=f"ns-bench-{i}",
        )
        for i in range(1, namespaces + 1)
    ]
    salts = {ns.pk: namespace_salt_read(ns, actor="bench", purpose="kv-events bench") for ns in rows}
    return World(version, rows, salts)


def make_engine(world: World, name: str, endpoint: str, topic: str, base_url: str = "http://127.0.0.1:1") -> Any:
    """A ready engine row serving every namespace, whose stream the consumer binds."""
    from cacheadmin.models import Engine

    # Every other engine row is stopped, so the consumer opens this stream only.
    Engine.objects.exclude(status=Engine.Status.STOPPED).update(status=Engine.Status.STOPPED)
    engine = Engine.objects.create(
        name=name, model_version=world.version, namespace=world.namespaces[0], base_url=base_url,
        status=Engine.Status.READY, kv_events_endpoint=endpoint, kv_events_topic=topic,
    )  # fmt: skip
    # Served: every namespace, so no stored chain is a foreign-namespace incident.
    engine.attached_namespaces.set(world.namespaces[1:])
    return engine


def reference_residency(world: World, payloads: list[bytes]) -> EngineResidency:
    """A pure ``EngineResidency`` fed the same batches, in order, event by event
    (``apply_each``, the reference the consumer's batched ``apply`` must equal)."""
    ref = EngineResidency(namespace_of_salt=world.namespace_of_salt.get, served=frozenset(world.salt_of))
    for p in payloads:
        ref.apply_each(decode_batch(p))
    return ref


def run_consumer(
    path: Path, work: Workload, world: World, index: int, var_dir: Path, *, profile: cProfile.Profile | None = None
) -> tuple[RunResult, Any, Any]:
    """The real consumer, from the publisher's first send to its last batch applied.

    Returns:
        The result, the consumer's ``Stream`` (its residency as it ended) and
        the engine row.
    """
    from cacheadmin.models import Engine
    from cacheadmin.services.kv_events import KvEventConsumer

    endpoint = ipc_endpoint(var_dir)
    topic = f"{TOPIC}.{index}"
    engine = make_engine(world, f"bench-kv-{index}", endpoint, topic)
    proc = start_publisher(path, endpoint, topic)
    consumer = KvEventConsumer()
    last = len(work.payloads) - 1
    state: dict[str, Any] = {"deadline": time.monotonic() + 600.0, "idle_check": 0.0, "seen": -1}

    def should_stop() -> bool:
        stream = consumer.streams.get(engine.pk)
        if stream is not None and stream.last_seq == last:
            state["end"], state["stream"] = time.monotonic(), stream
            return True
        now = time.monotonic()
        if now > state["idle_check"]:  # a publisher that died, or batches that never come
            state["idle_check"] = now + IDLE_TIMEOUT_S
            seen = stream.last_seq if stream is not None and stream.last_seq is not None else -1
            if (seen == state["seen"] and state.get("started")) or proc.poll() not in (None, 0) or now > state["deadline"]:
                state["end"], state["stream"], state["stalled"] = now, stream, True
                return True
            state["seen"], state["started"] = seen, True
        return False

    if profile is not None:
        profile.runcall(consumer.run, should_stop=should_stop)
    else:
        consumer.run(should_stop=should_stop)
    flushed = time.monotonic()
    pub = publisher_result(proc)
    stream = state["stream"]
    engine.status = Engine.Status.STOPPED
    engine.save(update_fields=["status"])
    applied = stream.residency.events if stream is not None else 0
    result = RunResult(
        "consumer",
        applied,
        (stream.last_seq + 1) if stream is not None and stream.last_seq is not None else 0,
        state["end"] - pub["t0"],
        pub["t1"] - pub["t0"],
        work.events - applied,
        {
            "final_flush_s": flushed - state["end"],
            "gaps": stream.gaps if stream else None,
            "stalled": state.get("stalled", False),
        },
    )
    return result, stream, engine


def check_residency(work: Workload, ref: EngineResidency, stream: Any, engine: Any) -> list[str]:
    """What differs between the consumer (in memory, checkpoint, samples) and the pure reference.

    Returns:
        One line per difference; empty when everything agrees.
    """
    from cacheadmin.models import KvEventStream
    from cacheadmin.services.kv_events import residency_now

    problems: list[str] = []
    if stream is None:
        return ["the consumer never opened the stream"]
    mem = stream.residency
    if mem.events != work.events:
        problems.append(f"applied {mem.events:,} events, published {work.events:,}")
    if mem.blocks != ref.blocks:
        problems.append(f"resident blocks differ: {sum(map(len, mem.blocks.values()))} vs {sum(map(len, ref.blocks.values()))}")
    if mem.totals() != ref.totals():
        problems.append(f"totals differ: {mem.totals()} vs {ref.totals()}")
    if mem.cleared != ref.cleared:
        problems.append(f"clears: {mem.cleared} vs {ref.cleared}")
    saved = KvEventStream.objects.filter(engine=engine).first()
    if saved is None:
        return [*problems, "no checkpoint saved"]
    if (saved.events, saved.last_seq, saved.gaps, saved.complete) != (work.events, len(work.payloads) - 1, 0, True):
        problems.append(
            f"checkpoint row: events {saved.events}, last_seq {saved.last_seq}, gaps {saved.gaps}, complete {saved.complete}"
        )
    restored = EngineResidency(namespace_of_salt=lambda salt: None)
    restored.restore(bytes(saved.state))
    if restored.blocks != ref.blocks:
        problems.append("the saved checkpoint does not restore the reference blocks")
    sampled = {(row["medium"], row["namespace"] or 0): row["tokens"] for row in residency_now(engine)["namespaces"]}
    wanted = {key: tokens for key, (_, tokens) in ref.totals().items()}
    if sampled != wanted:
        problems.append(f"latest samples {sampled} vs reference {wanted}")
    return problems


def in_process(work: Workload, world: World) -> dict[str, float]:
    """Events/s without sockets, one process: ``decode_batch`` (what the bare subscriber decodes);
    ``decode_for_residency`` (the consumer's decoder); that + ``EngineResidency.apply`` (by runs and
    chains); that + ``apply_each`` (event by event, the reference); ``KvEventConsumer.handle``
    (sequence check, decode, confirmation check, apply, bookkeeping)."""
    from cacheadmin.services.kv_events import KvEventConsumer, Stream

    payloads = work.payloads
    rates: dict[str, float] = {}

    def timed(name: str, step: Callable[[bytes], Any]) -> None:
        started = time.perf_counter()
        for p in payloads:
            step(p)
        rates[name] = work.events / (time.perf_counter() - started)

    timed("decode_events_per_s", decode_batch)
    timed("decode_lite_events_per_s", decode_for_residency)
    for name, method in (("decode_lite_apply_events_per_s", "apply"), ("decode_lite_apply_each_events_per_s", "apply_each")):
        ref = EngineResidency(namespace_of_salt=world.namespace_of_salt.get, served=frozenset(world.salt_of))
        apply = getattr(ref, method)
        timed(name, lambda p, apply=apply: apply(decode_for_residency(p)))  # type: ignore[misc]
    consumer = KvEventConsumer()
    stream = Stream(
        engine_id=0, engine_name="in-process", generation=0, endpoint="", replay_endpoint="",
        topic=TOPIC.encode(), residency=EngineResidency(namespace_of_salt=consumer.salts, served=frozenset(world.salt_of)),
    )  # fmt: skip
    topic = TOPIC.encode()
    frames = [[topic, seq.to_bytes(8, "big"), p] for seq, p in enumerate(payloads)]
    started = time.perf_counter()
    for f in frames:
        consumer.handle(stream, f)
    rates["handle_events_per_s"] = work.events / (time.perf_counter() - started)
    consumer.ctx.term()
    return rates


#: Functions whose cumulative time says where the consumer's time goes.
PROFILE_OF_INTEREST = (
    ("kv_events.py", "run"),
    ("kv_events.py", "handle"),
    ("kv_events.py", "apply"),
    ("kv_events.py", "_stored"),
    ("kv_events.py", "_removed"),
    ("kv_events.py", "_namespace_of_chain"),
    ("kv_events.py", "decode_batch"),
    ("kv_events.py", "sequence_verdict"),
    ("kv_events.py", "flush"),
    ("kv_events.py", "_flush_stream"),
    ("kv_events.py", "snapshot"),
    ("kv_events.py", "refresh"),
    ("kv_events.py", "<genexpr>"),
    ("socket.py", "recv_multipart"),
    ("poll.py", "poll"),
    ("timezone.py", "now"),
)


def profile_report(prof: cProfile.Profile, seconds: float) -> dict[str, Any]:
    """Cumulative and own time of the consumer's main functions, and the top functions by own time."""
    stats = pstats.Stats(prof)
    table: dict[str, dict[str, float]] = {}
    for (filename, _, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        for suffix, wanted in PROFILE_OF_INTEREST:
            if name == wanted and filename.endswith(suffix):
                where = f"{Path(filename).parent.name}/{Path(filename).name}:{name}"
                table[where] = {"calls": calls, "own_s": round(own, 3), "cumulative_s": round(cumulative, 3)}
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
    return {"wall_s": round(seconds, 3), "functions": table, "top_by_own_time": text.getvalue()}


# -- end-to-end lag with a real engine ----------------------------------------

#: Columns of the lag table: received = at ``handle`` entry / after ``recv``; applied = after it returns / after decoding.
LAG_HEADERS = ("recv p50", "recv p99", "appl p50", "appl p99", "appl max")
#: A shared system prompt (cached after the first request) and a long, unique
#: user part, so every request stores new blocks and the stream keeps flowing.
LAG_SYSTEM = "You are a support assistant for a cloud storage product. " * 8


class ChatLoad:
    """``clients`` threads sending greedy chat requests under one salt until stopped."""

    def __init__(self, base_url: str, *, salt: str, clients: int, max_tokens: int) -> None:
        self.base_url, self.salt, self.clients, self.max_tokens = base_url, salt, clients, max_tokens
        self.stop_event = threading.Event()
        self.requests = 0
        self.errors = 0
        self._counter = itertools.count()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]

    def start(self) -> None:
        """Start every client."""
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop and join every client."""
        self.stop_event.set()
        for t in self._threads:
            t.join(timeout=130)

    def _loop(self) -> None:
        import httpx

        with httpx.Client(base_url=self.base_url, timeout=120) as http:
            while not self.stop_event.is_set():
                n = next(self._counter)
                user = f"Ticket {n}: " + " ".join(f"file{n}-{i}.dat" for i in range(60)) + " cannot be opened. Why?"
                body = {
                    "model": "tiny",
                    "messages": [{"role": "system", "content": LAG_SYSTEM}, {"role": "user", "content": user}],
                    "max_tokens": self.max_tokens,
                    "temperature": 0.0,
                    "cache_salt": self.salt,
                }
                try:
                    ok = http.post("/v1/chat/completions", json=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.requests += 1
                self.errors += 0 if ok else 1


@dataclass
class ConsumerPhase:
    """What one consumer phase of the lag measurement saw."""

    #: Per live batch ``(received, applied, events)``, lags in seconds.
    lags: list[tuple[float, float, int]]
    #: Batches left out: each phase's first batch finds a sequence gap (see :func:`lag_consumer`).
    gap_batches: int
    #: Wall seconds of each checkpoint/sample write (``_flush_stream``) and each engine-list reload (``refresh``).
    flush_s: list[float]
    refresh_s: list[float]


def lag_consumer(seconds: float) -> ConsumerPhase:
    """The consumer for ``seconds``, its ``handle``, ``_flush_stream`` and ``refresh`` timed.

    The first batch of a phase finds a sequence gap (the engine published
    while the other subscriber held the endpoint); its gap handling (an alarm
    written to the database) is a cost of this bench's alternation, not of a
    consumer that runs all along, so that batch is counted, not timed.
    """
    from cacheadmin.services.kv_events import KvEventConsumer

    consumer = KvEventConsumer()
    handle, flush_stream, refresh = consumer.handle, consumer._flush_stream, consumer.refresh
    seen: list[tuple[float, float, bytes]] = []
    phase = ConsumerPhase([], 0, [], [])

    def timed_handle(stream: Any, frames: list[bytes], *, replaying: bool = False) -> None:
        received = time.time()
        gaps = stream.gaps
        handle(stream, frames, replaying=replaying)
        if replaying or len(frames) != 3:
            return
        if stream.gaps != gaps:
            phase.gap_batches += 1
        else:
            seen.append((received, time.time(), frames[2]))

    def timed_flush_stream(stream: Any, *, force: bool = False) -> None:
        started = time.perf_counter()
        flush_stream(stream, force=force)
        phase.flush_s.append(time.perf_counter() - started)

    def timed_refresh() -> None:
        started = time.perf_counter()
        refresh()
        phase.refresh_s.append(time.perf_counter() - started)

    # run(), flush() and fill_gap() call these through self, so the instance attributes take over.
    consumer.handle = timed_handle  # type: ignore[method-assign]
    consumer._flush_stream = timed_flush_stream  # type: ignore[method-assign]
    consumer.refresh = timed_refresh  # type: ignore[method-assign]
    end = time.monotonic() + seconds
    consumer.run(should_stop=lambda: time.monotonic() > end)
    for received, applied, payload in seen:  # decoded again after the phase, so timing costs nothing inside it
        batch = decode_batch(payload)
        phase.lags.append((received - batch.ts, applied - batch.ts, len(batch.events)))
    return phase


def lag_bare(endpoint: str, seconds: float) -> list[tuple[float, float, int]]:
    """The bare subscriber on the same endpoint for ``seconds``; same tuples as :func:`lag_consumer`."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.bind(endpoint)
    out: list[tuple[float, float, int]] = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if not sub.poll(100):
                continue
            frames = sub.recv_multipart()
            received = time.time()
            batch = decode_batch(frames[2])
            applied = time.time()
            out.append((received - batch.ts, applied - batch.ts, len(batch.events)))
    finally:
        sub.close(linger=0)
        ctx.term()
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def engine_lag(args: argparse.Namespace, world: World, log: Callable[[str], None]) -> dict[str, Any]:
    """Part 2: a real engine under load, consumer and bare subscriber in alternating phases.

    Raises:
        BenchError: the engine did not start.
    """
    from inference.checkpoints import ensure_demo_checkpoints
    from inference.engines.launcher import EngineSpec, LocalEngine
    from inference.errors import EngineError

    checkpoints = ensure_demo_checkpoints(OUT / "models")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    topic = f"{TOPIC}.engine"
    http_port = free_port()
    spec = EngineSpec(
        model_path=checkpoints["tiny-v1"], served_name="tiny", dtype="float32", port=http_port,
        log_path=OUT / "kv-events-engine.log",
        # No wildcard: the engine connects to the endpoint its consumer binds, as a local engine of the fleet does.
        kv_events={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic},
    )  # fmt: skip
    make_engine(world, "bench-kv-engine", endpoint, topic, base_url=f"http://127.0.0.1:{http_port}")
    engine = LocalEngine(spec)
    log(f"starting vLLM (tiny-v1, kv events to {endpoint}); log {spec.log_path}")
    try:
        engine.start()
        ready_s = engine.wait_ready(float(os.environ.get("ENGINE_START_TIMEOUT_S", "300")))
    except EngineError as exc:
        engine.stop()
        raise BenchError(f"the engine did not start: {exc}") from exc
    log(f"engine ready in {ready_s:.1f} s; {args.clients} clients, phases of {args.phase_s:g} s")
    load = ChatLoad(engine.base_url, salt=world.salt_of[world.namespaces[0].pk], clients=args.clients, max_tokens=args.max_tokens)
    lags: dict[str, list[tuple[float, float, int]]] = {"consumer": [], "bare": []}
    skipped = 0
    flush_s: list[float] = []
    refresh_s: list[float] = []
    started = time.monotonic()
    try:
        load.start()
        time.sleep(3.0)  # every client has a request in flight before the first phase
        for r in range(args.lag_rounds):
            for method in ("consumer", "bare") if r % 2 == 0 else ("bare", "consumer"):
                if method == "consumer":
                    seen = lag_consumer(args.phase_s)
                    phase, skipped = seen.lags, skipped + seen.gap_batches
                    flush_s += seen.flush_s
                    refresh_s += seen.refresh_s
                else:
                    phase = lag_bare(endpoint, args.phase_s)
                lags[method] += phase
                log(f"lag phase {r + 1} {method}: {len(phase)} batches, {sum(e for _, _, e in phase)} events")
    finally:
        load.stop()
        engine.stop()
    result: dict[str, Any] = {
        "clients": args.clients,
        "requests": load.requests,
        "errors": load.errors,
        "requests_per_s": round(load.requests / (time.monotonic() - started), 2),
        "consumer_gap_batches_left_out": skipped,
        "consumer_flushes": len(flush_s),
        "consumer_flush_p50_ms": round(percentile(flush_s, 0.5) * 1000, 2) if flush_s else None,
        "consumer_flush_max_ms": round(max(flush_s) * 1000, 2) if flush_s else None,
        "consumer_refresh_p50_ms": round(percentile(refresh_s, 0.5) * 1000, 2) if refresh_s else None,
        "consumer_refresh_max_ms": round(max(refresh_s) * 1000, 2) if refresh_s else None,
    }
    for method, rows in lags.items():
        if not rows:
            result[method] = {"batches": 0}
            continue
        applied = [a * 1000 for _, a, _ in rows]
        received = [r * 1000 for r, _, _ in rows]
        result[method] = {
            "batches": len(rows),
            "events": sum(e for _, _, e in rows),
            "received_p50_ms": round(percentile(received, 0.5), 3),
            "received_p99_ms": round(percentile(received, 0.99), 3),
            "applied_p50_ms": round(percentile(applied, 0.5), 3),
            "applied_p99_ms": round(percentile(applied, 0.99), 3),
            "applied_max_ms": round(max(applied), 3),
        }
    return result


# -- main -------------------------------------------------------------------


def setup_django(var_dir: Path) -> None:
    """Django on a scratch SQLite database in ``var_dir``, migrated."""
    os.environ.update({"DJANGO_SETTINGS_MODULE": "cacheadmin.settings", "VAR_DIR": str(var_dir)})
    # Nothing of the caller's deployment may leak in: the consumer writes checkpoints and alarms.
    for name in ("DATABASE_URL", "CELERY_BROKER_URL", "KV_REDIS_URL", "GATEWAY_REDIS_URL", "GATEWAY_DIR"):
        os.environ.pop(name, None)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def spread(values: list[float]) -> tuple[float, float, float]:
    """``(min, median, max)`` of ``values``."""
    return min(values), statistics.median(values), max(values)


def throughput_size(
    args: argparse.Namespace, world: World, var_dir: Path, events: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Part 1 at one size: ``--rounds`` rounds of (bare, consumer) over the same pre-encoded batches,
    each consumer run checked against the event-by-event reference; the profile when asked.

    The ratio of a round is its consumer run against the bare run just before it (load that drifts
    during the bench moves both); the goal holds when every round's ratio is at least :data:`GOAL`.
    """
    work = build_workload(list(world.salt_of.values()), events=events, capacity=args.capacity, clear_every=args.clear_every)
    path = var_dir / f"payloads-{events}.bin"
    write_payloads(path, work.payloads)
    print(
        f"\n== {work.events:,} events in {len(work.payloads):,} batches ({work.events / len(work.payloads):.1f}/batch, "
        f"{work.nbytes / 1e6:.1f} MB): {work.stored:,} BlockStored ({work.blocks_stored:,} blocks), "
        f"{work.removed:,} BlockRemoved, {work.cleared} AllBlocksCleared",
        flush=True,
    )
    ref = reference_residency(world, work.payloads)
    breakdown = in_process(work, world)
    log("in process: " + ", ".join(f"{k} {v:,.0f}" for k, v in breakdown.items()))

    runs: list[RunResult] = []
    checks: list[list[str]] = []
    header = (
        ("round", 6, "<"),
        ("method", 10, "<"),
        ("events", 11, ">"),
        ("batches", 9, ">"),
        ("seconds", 9, ">"),
        ("events/s", 12, ">"),
    )
    print("".join(f"{name:{align}{width}}" for name, width, align in header) + f"{'pub send s':>12}{'lost':>6}{'ratio':>8}")
    for r in range(args.rounds):
        for method in ("bare", "consumer"):
            if method == "bare":
                res = run_bare(path, work, var_dir)
            else:
                res, stream, engine = run_consumer(path, work, world, next(_engines), var_dir)
                checks.append(check_residency(work, ref, stream, engine))
            runs.append(res)
            ratio_text = f"{res.rate / runs[-2].rate:>7.3f}x" if method == "consumer" else ""
            print(
                f"{r + 1:<6}{res.method:<10}{res.events:>11,}{res.batches:>9,}{res.seconds:>9.3f}"
                f"{res.rate:>12,.0f}{res.publisher_s:>12.3f}{res.lost_events:>6}{ratio_text}",
                flush=True,
            )
    bare = [r.rate for r in runs if r.method == "bare"]
    cons = [r.rate for r in runs if r.method == "consumer"]
    ratios = [c / b for b, c in zip(bare, cons, strict=True)]
    ok = all(not c for c in checks)
    lost = sum(r.lost_events for r in runs)
    met = min(ratios) >= GOAL
    flush_s = [round(r.extra["final_flush_s"], 3) for r in runs if r.method == "consumer"]
    lo, mid, hi = spread(ratios)
    cons_text, bare_text = (" / ".join(f"{v:,.0f}" for v in spread(rates)) for rates in (cons, bare))
    print(f"events/s min/median/max: consumer {cons_text}; bare {bare_text}")
    print(f"ratio consumer/bare per round, min/median/max: {lo:.3f}x / {mid:.3f}x / {hi:.3f}x")
    print(f"goal: consumer >= {GOAL}x bare in every round at {work.events:,} events: {'met' if met else 'missed'}")
    print(f"final forced flush after the last batch (not in the rate): {flush_s} s")
    for i, problems in enumerate(checks, 1):
        print(f"residency check, consumer run {i}: " + ("OK" if not problems else "MISMATCH: " + "; ".join(problems)))
    result: dict[str, Any] = {
        "events": work.events,
        "batches": len(work.payloads),
        "payload_mb": round(work.nbytes / 1e6, 1),
        "runs": [
            {
                "method": r.method,
                "events_per_s": round(r.rate),
                "seconds": round(r.seconds, 3),
                "publisher_send_s": round(r.publisher_s, 3),
                "lost_events": r.lost_events,
                **r.extra,
            }
            for r in runs
        ],
        "bare_events_per_s": [round(v) for v in spread(bare)],
        "consumer_events_per_s": [round(v) for v in spread(cons)],
        "ratio_min_median_max": [round(v, 3) for v in (lo, mid, hi)],
        "goal_pass": met,
        "in_process": {k: round(v) for k, v in breakdown.items()},
        "residency_check": "OK" if ok else "MISMATCH",
        "lost_events": lost,
    }
    if args.profile:
        prof = cProfile.Profile()
        res, _, _ = run_consumer(path, work, world, next(_engines), var_dir, profile=prof)
        report = profile_report(prof, res.seconds)
        print(f"profiled consumer run: {res.rate:,.0f} events/s under cProfile ({res.seconds:.2f} s)")
        print(f"{'function':<48}{'calls':>10}{'own s':>9}{'cum s':>9}")
        for name, row in sorted(report["functions"].items(), key=lambda kv: -kv[1]["cumulative_s"]):
            print(f"{name:<48}{row['calls']:>10,}{row['own_s']:>9.3f}{row['cumulative_s']:>9.3f}")
        print(report["top_by_own_time"])
        result["profile"] = {k: v for k, v in report.items() if k != "top_by_own_time"}
    path.unlink()
    return result


#: Engine rows of the consumer runs: each run has its own (its own checkpoint and topic).
_engines = itertools.count()


def throughput(args: argparse.Namespace, world: World, var_dir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Part 1 at every size of ``--sizes``: per size its rounds, ratios and goal; overall, whether the
    goal held at every size."""
    sizes = {str(events): throughput_size(args, world, var_dir, events, log) for events in args.sizes}
    return {
        "sizes": sizes,
        "goal": GOAL,
        "goal_pass": all(r["goal_pass"] for r in sizes.values()),
        "residency_check": "OK" if all(r["residency_check"] == "OK" for r in sizes.values()) else "MISMATCH",
        "lost_events": sum(r["lost_events"] for r in sizes.values()),
    }


def print_lag(lag: dict[str, Any]) -> None:
    """The lag table of :func:`engine_lag`'s result."""
    print(f"end-to-end lag, real engine, {lag['clients']} clients ({lag['requests_per_s']} requests/s, {lag['errors']} errors):")
    print(f"{'method':<10}{'batches':>9}{'events':>9}" + "".join(f"{h:>10}" for h in LAG_HEADERS) + "  (ms)")
    for method in ("bare", "consumer"):
        row = lag[method]
        if not row["batches"]:
            print(f"{method:<10}{0:>9}")
            continue
        print(
            f"{method:<10}{row['batches']:>9}{row['events']:>9}{row['received_p50_ms']:>10.2f}"
            f"{row['received_p99_ms']:>10.2f}{row['applied_p50_ms']:>10.2f}{row['applied_p99_ms']:>10.2f}"
            f"{row['applied_max_ms']:>10.2f}"
        )
    print(f"consumer batches left out (the sequence gap at each phase start): {lag['consumer_gap_batches_left_out']}")
    print(
        f"consumer stalls: {lag['consumer_flushes']} checkpoint/sample writes, p50 {lag['consumer_flush_p50_ms']} ms, "
        f"max {lag['consumer_flush_max_ms']} ms; engine-list reloads p50 {lag['consumer_refresh_p50_ms']} ms, "
        f"max {lag['consumer_refresh_max_ms']} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes", type=cli.counts, default=[200_000, 1_000_000],
        help="events to publish per run (at least), one workload per size, comma-separated (default 200000,1000000)",
    )  # fmt: skip
    parser.add_argument("--events", type=int, help="one size only (same as --sizes N)")
    parser.add_argument("--quick", action="store_true", help="--sizes 200000 --rounds 3")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (bare, consumer) per size")
    parser.add_argument("--namespaces", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=16_384, help="resident blocks before evictions start")
    # 0 by default: the consumer acts on an AllBlocksCleared only once the engine's replay confirms it,
    # and this publisher serves no replay (one would also answer the consumer's periodic catch-up).
    parser.add_argument("--clear-every", type=int, default=0, help="an AllBlocksCleared every N batches (0: never)")
    parser.add_argument("--profile", action="store_true", help="one more consumer run under cProfile")
    parser.add_argument("--engine", action="store_true", help="also measure end-to-end lag with a real vLLM engine")
    parser.add_argument("--clients", type=int, default=8, help="--engine: concurrent chat clients")
    parser.add_argument("--max-tokens", type=int, default=48, help="--engine: tokens per answer")
    parser.add_argument("--phase-s", type=float, default=20.0, help="--engine: seconds per lag phase")
    parser.add_argument("--lag-rounds", type=int, default=2, help="--engine: phases of each method")
    parser.add_argument("--lag-only", action="store_true", help="--engine without the throughput part")
    parser.add_argument("--keep", action="store_true", help="keep the scratch VAR_DIR")
    parser.add_argument("--publish", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--topic", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.publish:
        return publish(Path(args.publish), args.endpoint, args.topic)
    if args.events is not None:
        args.sizes = [args.events]
    elif args.quick:
        args.sizes = [200_000]
    if min(args.sizes) < 1 or args.rounds < 1 or args.namespaces < 1:
        parser.error("--sizes, --events, --rounds and --namespaces must be at least 1")
    if not (math.isfinite(args.phase_s) and args.phase_s > 0) or args.clients < 1 or args.max_tokens < 1 or args.lag_rounds < 1:
        parser.error("--phase-s must be a positive number of seconds, and --clients, --max-tokens and --lag-rounds at least 1")

    began = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - began:6.1f} s] {line}", file=sys.stderr, flush=True)

    var_dir = Path(tempfile.mkdtemp(prefix="kvcp-bench-kv-"))
    try:
        setup_django(var_dir)
        world = make_world(args.namespaces)
        log(f"scratch VAR_DIR {var_dir} migrated")
        result: dict[str, Any] = {}
        if not args.lag_only:
            result = throughput(args, world, var_dir, log)
        if args.engine or args.lag_only:
            result["engine_lag"] = lag = engine_lag(args, world, log)
            print_lag(lag)
        print(json.dumps({"kv_events_bench": result}))
        ok = result.get("residency_check", "OK") == "OK" and not result.get("lost_events")
        return 0 if ok else 1
    except BenchError as exc:
        print(f"kv_events bench: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            log(f"kept {var_dir}")
        else:
            shutil.rmtree(var_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
