"""The KV-event consumer: every engine's stream → resident blocks and tokens per
namespace, saved as a time series, with isolation alarms.

One :class:`KvEventConsumer` per fleet partition subscribes to the streams of
the engines it owns (``engine pk % partitions == partition``): it binds the
endpoint a local engine connects to, and connects to an adopted engine's bound
endpoint. Each stream is checked by sequence number: a gap is filled from the
engine's replay endpoint, or recorded (the counts are then a lower bound until
the engine clears its cache); a sequence that starts over is a new engine
process (its state is dropped); frames of another topic (an earlier
incarnation of the engine) and frames that do not decode are counted, never
applied. The state is checkpointed, so a consumer killed mid-stream resumes
where its checkpoint ends and replays the rest.

Residency is kept per namespace *and medium*, and each medium is emptied as
vLLM 0.32 empties it (paths under ``vllm/``; the full table with the offload
connectors' variants is in :mod:`inference.kv_events`):

===========================  =======  ===============  ============================  ===========
event                        GPU      CPU (offload)    STORAGE (offload file tier)   source
===========================  =======  ===============  ============================  ===========
``BlockStored``              adds     adds             adds                          per medium
``BlockRemoved``             its own  its own          its own                       per medium
``AllBlocksCleared``         all      kept             kept                          [1]
``reset_external`` (no       --       emptied,         kept                          [2]
event)                                unannounced
new engine process           all      all              all (the consumer's view)     [3]
===========================  =======  ===============  ============================  ===========

[1] ``v1/core/block_pool.py`` ``BlockPool.reset_prefix_cache`` appends it, with
no ``medium`` field, for the engine's own pool; the offloading connector's
tiers never publish it. [2] ``OffloadingConnector.reset_cache`` ->
``CPUOffloadingManager.reset_cache`` (``v1/kv_offload/cpu/manager.py``) and
``TieringOffloadingManager.reset_cache`` ("secondary tiers are intentionally
not reset"): the consumer keeps showing those CPU blocks, an overstatement. [3]
the sequence starts over, or the engine's ``generation`` changes.

So ``cleared_at`` is the last AllBlocksCleared and ``cleared_kept`` what it
left per namespace in the offloaded media; an eviction's reset is confirmed
only when it left nothing of the namespace (:func:`reset_observed`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import msgspec
import zmq
from django.conf import settings
from django.db import close_old_connections, transaction
from django.utils import timezone

from cacheadmin.metrics.catalogue import BY_NAME
from cacheadmin.models import CacheNamespace, Engine, EngineAlarm, KvEventStream, ResidentSample
from cacheadmin.services.alarms import alarm_raise
from cacheadmin.services.block_index import BlockIndexPublisher
from cacheadmin.services.namespaces import namespace_salts
from inference.engines.probes import PROBE_SALT_PREFIX, is_probe_salt
from inference.kv_events import (
    END_SEQ,
    PROBE,
    EngineResidency,
    SequenceVerdict,
    decode_for_residency,
    seq_bytes,
    seq_of,
    sequence_verdict,
)
from inference.kv_transport import TransportError, curve_client, ipc_path_is_private, key_pair

log = logging.getLogger(__name__)
ACTOR = "kv-events"

#: Seconds between reloads of the engine list from the database.
REFRESH_S = 2.0
#: Seconds between checkpoints, samples and heartbeats.
FLUSH_S = 2.0
#: A sample is written at least this often (seconds) even when nothing changed,
#: so a chart shows a flat line instead of a hole.
SAMPLE_HEARTBEAT_S = 60.0
#: Larger than any sequence number: a replay "to the end".
END_OF_STREAM = (1 << 63) - 1
#: How long a replay may take before the gap is recorded instead (seconds).
REPLAY_TIMEOUT_S = 3.0
#: Seconds between catch-up replays of a stream (what was published before the
#: subscription took, or while the consumer was down); doubles, up to
#: :data:`CATCH_UP_MAX_S`, while the engine's replay endpoint does not answer.
CATCH_UP_S = 5.0
CATCH_UP_MAX_S = 60.0
CATCH_UP_TIMEOUT_S = 1.0
#: The consumer is "running" for an engine while its heartbeat is this recent.
CONSUMER_STALE_S = 15.0


@dataclass
class Stream:
    """One engine's event stream as this consumer holds it."""

    engine_id: int
    engine_name: str
    generation: int
    endpoint: str
    replay_endpoint: str
    topic: bytes
    residency: EngineResidency
    #: The CURVE public key of the relay publishing an adopted engine's stream ("" for a local engine's IPC sockets).
    curve_key: str = ""
    sub: Any = None
    last_seq: int | None = None
    complete: bool = True
    gaps: int = 0
    garbage: int = 0
    foreign: int = 0
    replays: int = 0
    #: Frames that would have cleared state, raised an alarm or opened a gap,
    #: which the engine's own replay did not confirm: dropped, never acted on.
    unconfirmed: int = 0
    restarts_seen: int = 0
    cleared_at: Any = None
    #: ``{"<namespace id>": {medium: blocks}}`` the last AllBlocksCleared left (offloaded media).
    cleared_kept: dict[str, dict[str, int]] = field(default_factory=dict)
    last_event_at: Any = None
    dirty: bool = True
    urgent: bool = False
    sampled: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    sampled_at: float = 0.0
    base_events: int = 0
    #: When the next catch-up replay is due (monotonic seconds), and the interval after a silent one.
    catch_up_at: float = 0.0
    catch_up_every: float = CATCH_UP_S
    #: The newest sequence number received on the live socket (None before the first).
    live_seq: int | None = None
    #: ``(first, last)`` sequence numbers a replay applied that the live socket has not passed yet:
    #: a catch-up replays to the end of what the engine published, so batches still queued on the
    #: live socket arrive again afterwards; those are copies, not a publisher that started over.
    replayed: tuple[int, int] | None = None


#: Tracker incident → (alarm kind, message template).
_INCIDENTS = {
    "unknown_salt": (
        EngineAlarm.Kind.UNKNOWN_SALT,
        "{blocks} blocks stored under a cache_salt that belongs to no namespace (salt digest {key})",
    ),
    "no_salt": (
        EngineAlarm.Kind.NO_SALT,
        "{blocks} blocks stored without a cache_salt on an engine that serves several namespaces",
    ),
    "foreign_namespace": (
        EngineAlarm.Kind.FOREIGN_NAMESPACE,
        "{blocks} blocks stored under the salt of namespace #{key}, which this engine does not serve",
    ),
}


class SaltIndex:
    """cache_salt → namespace id over every namespace, reloaded when a salt is
    unknown (at most once a second: a namespace created a moment ago).

    The salts never leave this process; they are compared, not handed out, so
    building the index is not a salt read in the audit trail's sense.
    """

    def __init__(self) -> None:
        self._by_salt: dict[str, int] = {}
        self._loaded = 0.0
        self.reload()

    def reload(self) -> None:
        """Recompute every namespace's salt."""
        rows = list(CacheNamespace.objects.values_list("pk", "namespace_key"))
        self._by_salt = {salt: pk for pk, salt in namespace_salts(rows).items()}
        self._keys = dict(rows)
        self._loaded = time.monotonic()

    def key_of(self, namespace_pk: int | None) -> str:
        """The ``namespace_key`` of a namespace id (a metric label), ``""`` for
        blocks of no known namespace."""
        return self._keys.get(namespace_pk, "") if namespace_pk else ""

    def __call__(self, salt: str) -> int | None:
        if salt.startswith(PROBE_SALT_PREFIX) and is_probe_salt(settings.CACHE_SALT_SECRET, salt):
            return PROBE
        found = self._by_salt.get(salt)
        if found is None and time.monotonic() - self._loaded > 1.0:
            self.reload()
            found = self._by_salt.get(salt)
        return found


def _transport_refusal(stream: Stream) -> str | None:
    """Why the consumer will not read ``stream``, or None: only the engine may
    speak for itself (:mod:`inference.kv_transport`). A local engine's sockets
    must lie in a private directory; a TCP stream must be a relay's, over CURVE."""
    if stream.endpoint.startswith("ipc://"):
        for endpoint in filter(None, (stream.endpoint, stream.replay_endpoint)):
            if not ipc_path_is_private(endpoint):
                return f"{endpoint} is not in a directory of this user with mode 0700"
        return None
    if not stream.curve_key:
        return (
            "a TCP stream is read only from a CURVE relay (python -m inference.kv_transport relay); "
            "adopt the engine again with its kv_events_key, or restart a local engine"
        )
    return None


class KvEventConsumer:
    """Subscribes to the KV-event streams of one fleet partition.

    Args:
        partition, partitions: this consumer owns engines with
            ``pk % partitions == partition``.
        metrics: optional prometheus-client metrics (see :func:`consumer_metrics`).
    """

    def __init__(
        self, *, partition: int = 0, partitions: int = 1, metrics: dict[str, Any] | None = None,
        index: BlockIndexPublisher | None = None,
    ) -> None:  # fmt: skip
        if partitions < 1 or not 0 <= partition < partitions:
            raise ValueError(f"partition {partition} of {partitions}: need 0 <= partition < partitions")
        self.partition, self.partitions = partition, partitions
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.streams: dict[int, Stream] = {}
        self.by_socket: dict[Any, Stream] = {}
        self.salts = SaltIndex()
        self.metrics = metrics or {}
        #: Publishes each engine's resident blocks for the gateways' precise routing (:mod:`gateway.prefix.index`).
        self.index = index or BlockIndexPublisher(failures=self.metrics.get("index_failures"))
        #: engine id → the label sets of its resident-token gauge now shown.
        self._resident_shown: dict[int, set[tuple[str, str, str]]] = {}
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self._refreshed = 0.0
        self._flushed = 0.0
        self._keys: tuple[str, str] | None = None
        #: When the burst of frames being drained arrived (None outside run()).
        self.burst_at: Any = None

    # -- engines -----------------------------------------------------------
    def refresh(self) -> None:
        """Open streams of new engines, close those of engines no longer running,
        start over for a new incarnation, and update what each engine serves."""
        rows = {
            e.pk: e
            for e in Engine.objects.filter(status__in=[Engine.Status.STARTING, Engine.Status.READY])
            .exclude(kv_events_endpoint="")
            .prefetch_related("attached_namespaces")
            if e.pk % self.partitions == self.partition
        }
        gone = [pk for pk in self.streams if pk not in rows]
        for pk in Engine.objects.filter(pk__in=gone, status=Engine.Status.LOST).values_list("pk", flat=True):
            # Lost with its host: nothing it held is there any more. Its last flush records that (zero
            # samples, an empty state), not what it held, so nothing of it is counted when the host comes back.
            lost = self.streams[pk]
            lost.residency.clear()
            lost.complete, lost.dirty = False, True
        for pk in list(self.streams):
            row = rows.get(pk)
            if row is None or (row.kv_events_endpoint, row.kv_events_key) != (
                self.streams[pk].endpoint,
                self.streams[pk].curve_key,
            ):
                self._close(self.streams.pop(pk))
        for pk, row in rows.items():
            served = frozenset(([row.namespace_id] if row.namespace_id else []) + [n.pk for n in row.attached_namespaces.all()])
            stream = self.streams.get(pk)
            if stream is None:
                stream = self._open(row)
                if stream is None:
                    continue
            elif stream.generation != row.generation:
                # A new process of the engine: nothing it held survives; its
                # stream carries the new incarnation's topic from now on.
                stream.residency.clear()
                stream.generation, stream.topic = row.generation, row.kv_events_topic.encode()
                stream.last_seq, stream.complete, stream.dirty, stream.base_events = None, True, True, 0
                stream.residency.events = 0
            stream.residency.served = served
        self._refreshed = time.monotonic()

    def _open(self, row: Engine) -> Stream | None:
        stream = Stream(
            engine_id=row.pk,
            engine_name=row.name,
            generation=row.generation,
            endpoint=row.kv_events_endpoint,
            replay_endpoint=row.kv_events_replay_endpoint,
            topic=row.kv_events_topic.encode(),
            residency=EngineResidency(namespace_of_salt=self.salts),
            curve_key=row.kv_events_key,
        )
        why = _transport_refusal(stream)
        if why is not None:
            log.warning("engine %s: its KV events are not read: %s", row.name, why)
            return None
        saved = KvEventStream.objects.filter(engine_id=row.pk).first()
        if saved is not None and saved.generation == row.generation and saved.state is not None:
            try:
                stream.residency.restore(bytes(saved.state))
                stream.last_seq, stream.complete = saved.last_seq, saved.complete
                stream.gaps, stream.garbage, stream.replays = saved.gaps, saved.garbage, saved.replays
                stream.unconfirmed = saved.unconfirmed
                stream.restarts_seen, stream.cleared_at = saved.restarts_seen, saved.cleared_at
                stream.cleared_kept = saved.cleared_kept or {}
                stream.base_events = saved.events
            except (msgspec.DecodeError, ValueError, TypeError):
                log.warning("checkpoint of engine %s unreadable; starting from the engine's replay", row.name)
                stream.residency.clear()
        try:
            sub = self._socket(stream, zmq.SUB)
        except TransportError as exc:
            log.warning("engine %s: its KV events are not read: %s", row.name, exc)
            return None
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sub.connect(stream.endpoint)
        except zmq.ZMQError as exc:
            sub.close()
            log.warning("engine %s: cannot connect to %s: %s", row.name, stream.endpoint, exc)
            return None
        stream.sub = sub
        self.poller.register(sub, zmq.POLLIN)
        self.by_socket[sub] = stream
        self.streams[row.pk] = stream
        log.info("engine %s: connected to %s%s", row.name, stream.endpoint, " (CURVE)" if stream.curve_key else "")
        return stream

    def _socket(self, stream: Stream, kind: int) -> Any:
        """A socket for ``stream``: a CURVE client of its relay when it has one.

        Raises:
            TransportError: the consumer's key file is unusable.
        """
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if stream.curve_key:
            if self._keys is None:
                self._keys = key_pair(settings.KV_EVENTS_KEY_FILE)
            public, secret = self._keys
            curve_client(sock, server_key=stream.curve_key, public=public, secret=secret)
        return sock

    def _close(self, stream: Stream) -> None:
        self._flush_stream(stream)
        self.index.drop(stream.engine_id)
        self.poller.unregister(stream.sub)
        self.by_socket.pop(stream.sub, None)
        stream.sub.close(linger=0)

    # -- frames ------------------------------------------------------------
    def handle(self, stream: Stream, frames: list[bytes], *, replaying: bool = False) -> None:
        """Apply one ``(topic, seq, payload)`` message to its stream."""
        if len(frames) != 3:
            self._garbage(stream, f"a message of {len(frames)} frames, not 3")
            return
        topic, seq_frame, payload = frames
        if stream.topic and topic != stream.topic:
            stream.foreign += 1  # an earlier incarnation of the engine, or another publisher
            return
        try:
            seq = seq_of(seq_frame)
            batch = decode_for_residency(payload)
        except (ValueError, msgspec.DecodeError) as exc:
            self._garbage(stream, f"undecodable frame: {exc}")
            return
        if not replaying:
            live_before, stream.live_seq = stream.live_seq, seq
            if stream.replayed is not None:
                first, upto = stream.replayed
                if first <= seq <= upto and (live_before is None or seq > live_before):
                    return  # a replay applied it already: its live copy, still queued, came after
                if seq > upto:
                    stream.replayed = None  # the live stream is past what was replayed
        last = stream.last_seq
        # The next batch in order, nearly every batch: what sequence_verdict answers, without the call.
        in_order = last is not None and seq == last + 1
        verdict = SequenceVerdict.APPLY if in_order else sequence_verdict(last, seq, replaying=replaying)
        if verdict == SequenceVerdict.DUPLICATE:
            return
        if verdict == SequenceVerdict.RESTART:
            stream.residency.clear()
            stream.restarts_seen += 1
            stream.last_seq, stream.complete, stream.base_events = None, True, 0
            stream.residency.events = 0
            stream.replayed = None
            verdict = sequence_verdict(None, seq)
        if verdict == SequenceVerdict.GAP and not replaying:
            if not self.fill_gap(stream, upto=seq):
                return  # the engine never published it: not applied, no gap recorded
        elif verdict == SequenceVerdict.GAP:
            return
        if stream.last_seq is not None and seq <= stream.last_seq:
            return  # the replay covered it
        if not replaying and stream.residency.needs_confirmation(batch):
            # A clear or an alarm is acted on only as the engine itself confirms it.
            confirmed = self._confirmed(stream, seq)
            if confirmed is None:
                self._unconfirmed(stream, seq, "a clear or an isolation incident")
                return
            batch = confirmed
        cleared = stream.residency.cleared
        stream.residency.apply(batch)
        stream.last_seq = seq
        if replaying:
            stream.replayed = (seq if stream.replayed is None else min(stream.replayed[0], seq), seq)
        # One clock reading per drained burst (run() sets it): per batch it cost 3 % of the consumer's time.
        stream.last_event_at = now = self.burst_at or timezone.now()
        stream.dirty = True
        if stream.residency.cleared != cleared:
            stream.cleared_at = now
            stream.cleared_kept = {str(ns): media for ns, media in stream.residency.kept_at_clear.items()}
            stream.urgent = True  # a purge waits for this: save it now
        if stream.residency.incidents:
            stream.urgent = True

    def _garbage(self, stream: Stream, why: str) -> None:
        stream.garbage += 1
        stream.dirty = True
        if stream.garbage == 1 or stream.garbage % 1000 == 0:
            alarm_raise(
                engine=stream.engine_id, kind=EngineAlarm.Kind.KV_EVENTS_GARBAGE, actor=ACTOR,
                detail=f"{stream.garbage} frames that are not vLLM KV-event batches on {stream.endpoint}; last: {why[:300]}",
            )  # fmt: skip

    def catch_up(self, stream: Stream) -> None:
        """Apply what the engine published since the last batch applied, from its replay.

        The engine binds its publisher and the consumer connects: batches sent
        before a new subscription takes (a consumer just started or restarted)
        reach no one, and without a later batch no gap would show. So every
        :data:`CATCH_UP_S` the consumer asks the engine's replay for what
        follows its last batch (nothing, usually: one round trip). A start
        the engine's buffer no longer holds is a gap the engine confirms.
        """
        start = 0 if stream.last_seq is None else stream.last_seq + 1
        # Briefly: the loop waits on it, and a silent endpoint is asked again later.
        replayed = self._replay(stream, start, END_OF_STREAM, timeout_s=CATCH_UP_TIMEOUT_S)
        now = time.monotonic()
        if replayed is None:
            stream.catch_up_every = min(CATCH_UP_MAX_S, stream.catch_up_every * 2)
            stream.catch_up_at = now + stream.catch_up_every
            return
        stream.catch_up_every, stream.catch_up_at = CATCH_UP_S, now + CATCH_UP_S
        if not replayed:
            return
        first = seq_of(replayed[0][1])
        if stream.last_seq is not None and first > start:
            self._record_gap(stream, start, first - 1, confirmed=True)
            stream.last_seq = first - 1
        for frames in replayed:
            self.handle(stream, frames, replaying=True)

    def _replay(self, stream: Stream, start: int, upto: int, *, timeout_s: float = REPLAY_TIMEOUT_S) -> list[list[bytes]] | None:
        """The engine's own batches ``start..upto`` from its replay endpoint, in
        order, as ``[topic, seq, payload]`` frames; None when it has no replay
        endpoint or did not answer (no end marker within ``timeout_s``)."""
        if not stream.replay_endpoint:
            return None
        stream.replays += 1
        frames: list[list[bytes]] = []
        try:
            dealer = self._socket(stream, zmq.DEALER)
        except TransportError:
            return None
        try:
            dealer.connect(stream.replay_endpoint)
            dealer.send_multipart([b"", seq_bytes(start)])
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if not dealer.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    return None
                reply = dealer.recv_multipart()
                if len(reply) != 4:
                    continue
                _, topic, seq_frame, payload = reply
                try:
                    seq = seq_of(seq_frame)
                except ValueError:
                    continue
                if seq == END_SEQ:
                    return frames
                if start <= seq <= upto:
                    frames.append([topic, seq_frame, payload])
            return None
        finally:
            dealer.close(linger=0)

    def _confirmed(self, stream: Stream, seq: int) -> Any | None:
        """Batch ``seq`` as the engine's replay holds it (decoded for residency), or None when it does not confirm one."""
        replayed = self._replay(stream, seq, seq)
        for topic, _, payload in replayed or []:
            if stream.topic and topic != stream.topic:
                continue
            try:
                return decode_for_residency(payload)
            except msgspec.DecodeError:
                return None
        return None

    def _unconfirmed(self, stream: Stream, seq: int, what: str) -> None:
        stream.unconfirmed += 1
        stream.dirty = True
        log.warning(
            "engine %s: batch %s (%s) not confirmed by the engine's replay: dropped (%s unconfirmed so far)",
            stream.engine_name, seq, what, stream.unconfirmed,
        )  # fmt: skip
        if "unconfirmed" in self.metrics:
            self.metrics["unconfirmed"].labels(engine=stream.engine_name).inc()

    def fill_gap(self, stream: Stream, *, upto: int) -> bool:
        """Replay ``last_seq + 1 .. upto - 1`` from the engine; record what cannot be.

        The batch ``upto`` that opened the gap must be in the engine's replay
        too: a forged sequence jump is dropped, not recorded as a gap.

        Returns:
            False when the engine's replay answered without batch ``upto`` (the
            frame that opened the gap is not the engine's: drop it); True otherwise.
        """
        start = 0 if stream.last_seq is None else stream.last_seq + 1
        replayed = self._replay(stream, start, upto)
        if replayed is not None:
            if not any(seq_of(f[1]) == upto for f in replayed):
                self._unconfirmed(stream, upto, f"a jump from {start - 1} to {upto}")
                return False
            earlier = [f for f in replayed if seq_of(f[1]) < upto]
            # Applied only from the gap's start on: a buffer that no longer holds it leaves the gap open.
            if earlier and seq_of(earlier[0][1]) == start:
                for frames in earlier:
                    self.handle(stream, frames, replaying=True)
        if stream.last_seq is None or stream.last_seq < upto - 1:
            missing_from = start if stream.last_seq is None else stream.last_seq + 1
            self._record_gap(stream, missing_from, upto - 1, confirmed=replayed is not None)
            # Continue from here: later blocks whose chain began in the gap are unattributed.
            stream.last_seq = upto - 1
        return True

    def _record_gap(self, stream: Stream, first: int, last: int, *, confirmed: bool) -> None:
        """Mark the stream incomplete; alarm only when the engine's replay confirmed the gap."""
        stream.gaps += 1
        stream.complete = False
        stream.dirty = stream.urgent = True
        if "gaps" in self.metrics:
            self.metrics["gaps"].labels(engine=stream.engine_name).inc()
        if not confirmed:
            why = "no replay endpoint" if not stream.replay_endpoint else "the replay endpoint did not answer"
            log.warning("engine %s: batches %s..%s missed (%s; unconfirmed, no alarm)", stream.engine_name, first, last, why)
            return
        alarm_raise(
            engine=stream.engine_id, kind=EngineAlarm.Kind.KV_EVENTS_GAP, actor=ACTOR,
            detail=f"batches {first}..{last} missed (the engine's replay buffer no longer holds them); "
            "resident counts are a lower bound until the cache is cleared",
        )  # fmt: skip

    # -- saving ------------------------------------------------------------
    def flush(self, *, force: bool = False) -> None:
        """Checkpoint dirty streams, write samples that changed (or are due),
        raise alarms for incidents, and beat the heartbeat."""
        for stream in list(self.streams.values()):
            self._flush_stream(stream, force=force)
        self.index.publish()
        self._flushed = time.monotonic()

    def _flush_stream(self, stream: Stream, *, force: bool = False) -> None:
        now = timezone.now()
        incidents = stream.residency.take_incidents()
        for incident in incidents:
            kind, detail = _INCIDENTS[incident.kind]
            detail = detail.format(blocks=incident.blocks, key=incident.key)
            alarm_raise(engine=stream.engine_id, kind=kind, key=incident.key, detail=detail, count=incident.blocks, actor=ACTOR)
            if "alarms" in self.metrics:
                self.metrics["alarms"].labels(engine=stream.engine_name, kind=kind).inc(incident.blocks)
        totals = stream.residency.totals()
        heartbeat_due = time.monotonic() - stream.sampled_at > SAMPLE_HEARTBEAT_S
        with transaction.atomic():
            fields = {
                "generation": stream.generation,
                "last_seq": stream.last_seq,
                "events": stream.base_events + stream.residency.events,
                "gaps": stream.gaps,
                "unconfirmed": stream.unconfirmed,
                "garbage": stream.garbage,
                "replays": stream.replays,
                "restarts_seen": stream.restarts_seen,
                "complete": stream.complete,
                "cleared_at": stream.cleared_at,
                "cleared_kept": stream.cleared_kept,
                "last_event_at": stream.last_event_at,
                "consumer": self.name,
                "heartbeat_at": now,
            }
            if stream.dirty or force:
                fields["state"] = stream.residency.snapshot()
            KvEventStream.objects.update_or_create(engine_id=stream.engine_id, defaults=fields)
            if totals != stream.sampled or heartbeat_due:
                # A namespace whose blocks all went is written once with zero.
                keys = set(totals) | set(stream.sampled)
                ResidentSample.objects.bulk_create(
                    ResidentSample(
                        engine_id=stream.engine_id,
                        namespace_id=namespace or None,
                        medium=medium,
                        sampled_at=now,
                        blocks=totals.get((medium, namespace), (0, 0))[0],
                        tokens=totals.get((medium, namespace), (0, 0))[1],
                    )  # fmt: skip
                    for medium, namespace in sorted(keys)
                    if (medium, namespace) in totals or stream.sampled.get((medium, namespace), (0, 0))[0]
                )
                stream.sampled, stream.sampled_at = totals, time.monotonic()
        if "resident" in self.metrics:
            gauge = self.metrics["resident"]
            shown = {(stream.engine_name, self.salts.key_of(namespace), medium): tokens
                     for (medium, namespace), (_, tokens) in totals.items()}  # fmt: skip
            for labels, tokens in shown.items():
                gauge.labels(*labels).set(tokens)
            # A namespace whose blocks all went leaves the gauge, not a stale figure.
            for labels in self._resident_shown.get(stream.engine_id, set()) - set(shown):
                gauge.remove(*labels)
            self._resident_shown[stream.engine_id] = set(shown)
        self.index.stage(stream, changed=stream.dirty or force, now=now.timestamp())
        stream.dirty = stream.urgent = False

    # -- loop --------------------------------------------------------------
    def run(self, *, should_stop: Callable[[], bool], poll_ms: int = 200) -> None:
        """Consume until ``should_stop()``; saves everything before returning."""
        self.refresh()
        try:
            while not should_stop():
                if time.monotonic() - self._refreshed > REFRESH_S:
                    close_old_connections()
                    self.refresh()
                for sock, _ in self.poller.poll(poll_ms):
                    stream = self.by_socket.get(sock)
                    if stream is None:
                        continue
                    self.burst_at = timezone.now()
                    received = 0
                    recv, handle = sock.recv_multipart, self.handle
                    for received in range(1, 10_001):
                        try:
                            frames = recv(zmq.NOBLOCK)
                        except zmq.Again:
                            received -= 1
                            break
                        handle(stream, frames)
                    # Counted once per burst: per frame, the lookup and the label resolution cost more than the count.
                    if received and "events" in self.metrics:
                        self.metrics["events"].labels(engine=stream.engine_name).inc(received)
                    self.burst_at = None
                    if stream.urgent:
                        self._flush_stream(stream)
                        self.index.publish()
                now = time.monotonic()
                for stream in list(self.streams.values()):
                    if now >= stream.catch_up_at:
                        self.catch_up(stream)
                if time.monotonic() - self._flushed > FLUSH_S:
                    self.flush()
        finally:
            self.flush(force=True)
            for stream in list(self.streams.values()):
                self.poller.unregister(stream.sub)
                stream.sub.close(linger=0)
            self.streams.clear()
            self.ctx.term()


_consumer_metrics: dict[str, Any] = {}


def consumer_metrics() -> dict[str, Any]:
    """The consumer's Prometheus families (prometheus-client's default
    registry, created once per process), by short name, named and labelled as
    ``cacheadmin/metrics/catalogue.py`` says (source ``kv_events``).

    Labels: ``engine`` is the engine's name, ``namespace`` the namespace's
    ``namespace_key`` (``""`` for blocks no namespace could be found for).
    """
    if not _consumer_metrics:
        from prometheus_client import Counter, Gauge

        def spec(name: str) -> dict[str, Any]:
            return {"name": name, "documentation": BY_NAME[name].help, "labelnames": BY_NAME[name].labels}

        _consumer_metrics.update(
            events=Counter(**spec("kvcp_kv_event_batches")),
            gaps=Counter(**spec("kvcp_kv_event_gaps")),
            unconfirmed=Counter(**spec("kvcp_kv_event_unconfirmed")),
            alarms=Counter(**spec("kvcp_isolation_alarm_blocks")),
            resident=Gauge(**spec("kvcp_kv_event_resident_tokens")),
            index_failures=Counter(**spec("kvcp_kv_event_index_publish_failures")),
        )
    return _consumer_metrics


def residency_drop(engine: Engine) -> int:
    """Record that ``engine`` holds nothing any more (its host was lost): a zero sample for every
    namespace and medium its latest samples showed blocks in, its saved stream state emptied and
    marked incomplete, and its set removed from the fleet's block index (gateways stop routing by it).
    The consumer does the same when it next sees the engine lost; both write zeros.

    Returns:
        How many zero samples were written.
    """
    now = timezone.now()
    latest: dict[tuple[int | None, str], int] = {}
    for namespace_id, medium, blocks in (
        ResidentSample.objects.filter(engine=engine)
        .order_by("-sampled_at", "-id")
        .values_list("namespace_id", "medium", "blocks")[:500]
    ):
        latest.setdefault((namespace_id, medium), blocks)
    zeros = [
        ResidentSample(engine=engine, namespace_id=namespace_id, medium=medium, sampled_at=now, blocks=0, tokens=0)
        for (namespace_id, medium), blocks in sorted(latest.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1]))
        if blocks
    ]
    with transaction.atomic():
        ResidentSample.objects.bulk_create(zeros)
        KvEventStream.objects.filter(engine=engine).update(state=None, complete=False)
    BlockIndexPublisher().drop(engine.pk)
    return len(zeros)


def residency_now(engine: Engine) -> dict[str, Any]:
    """What the consumer last saved for ``engine``: per namespace and medium,
    blocks and tokens, with the stream's health.

    Returns:
        ``{"consumer_running", "complete", "last_seq", "events", "gaps",
        "heartbeat_at", "cleared_at", "cleared_kept" ({"<namespace id>":
        {medium: blocks}} the last AllBlocksCleared left), "namespaces": [{"namespace",
        "namespace_key", "medium", "blocks", "tokens", "sampled_at"}]}``.
    """
    stream = KvEventStream.objects.filter(engine=engine).first()
    latest: dict[tuple[int | None, str], ResidentSample] = {}
    for sample in ResidentSample.objects.filter(engine=engine).select_related("namespace").order_by("-sampled_at", "-id")[:500]:
        latest.setdefault((sample.namespace_id, sample.medium), sample)
    cutoff = timezone.now().timestamp() - CONSUMER_STALE_S
    return {
        "consumer_running": bool(stream and stream.heartbeat_at and stream.heartbeat_at.timestamp() > cutoff),
        "complete": stream.complete if stream else None,
        "last_seq": stream.last_seq if stream else None,
        "events": stream.events if stream else 0,
        "gaps": stream.gaps if stream else 0,
        "heartbeat_at": stream.heartbeat_at if stream else None,
        "cleared_at": stream.cleared_at if stream else None,
        "cleared_kept": (stream.cleared_kept or {}) if stream else {},
        "namespaces": [
            {
                "namespace": s.namespace_id,
                "namespace_key": s.namespace.namespace_key if s.namespace else None,
                "medium": s.medium,
                "blocks": s.blocks,
                "tokens": s.tokens,
                "sampled_at": s.sampled_at,
            }
            for (_, _), s in sorted(latest.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1]))
            if s.blocks
        ],
    }


def reset_observed(engine: Engine, namespace: CacheNamespace, *, since: Any, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """Wait for the KV-event stream to show that ``engine`` dropped ``namespace``'s
    blocks after ``since``, in every medium.

    Shown by an ``AllBlocksCleared`` (vLLM publishes it with the scheduler step
    after the reset, i.e. with the next request) that left none of the
    namespace's blocks in an offloaded medium (it empties engine memory only:
    see the module's table), or by a sample written after ``since`` with the
    namespace at zero blocks in every medium.

    Returns:
        ``{"kv_events": "AllBlocksCleared" | "blocks removed", "at": iso}`` when
        the namespace holds nothing; the same with ``"kept": {medium: blocks}``
        when the AllBlocksCleared left offloaded blocks of it (not a complete
        reset: those go only with their own ``BlockRemoved``);
        ``{"kv_events": "not published…"}`` for an engine without a stream;
        None when the stream did not show it in ``timeout_s`` (or no consumer
        runs for the engine).
    """
    if not engine.kv_events_endpoint:
        return {"kv_events": "not published by this engine; the probe alone confirms"}
    deadline = time.monotonic() + timeout_s
    while True:
        stream = KvEventStream.objects.filter(engine=engine).first()
        seen = _clear_seen(stream, namespace, since)
        if seen is not None:
            return seen
        zero_at = _zero_in_every_medium(engine, namespace, since)
        if zero_at is not None:
            # The consumer saves the stream and its samples in one transaction:
            # a zero sample read after the stream may come from the same flush
            # as an AllBlocksCleared the first read missed. Read it again.
            seen = _clear_seen(KvEventStream.objects.filter(engine=engine).first(), namespace, since)
            return seen if seen is not None else {"kv_events": "blocks removed", "at": zero_at.isoformat()}
        if time.monotonic() > deadline:
            return None
        time.sleep(0.25)


def _clear_seen(stream: KvEventStream | None, namespace: CacheNamespace, since: Any) -> dict[str, Any] | None:
    """The AllBlocksCleared of ``stream`` after ``since`` and what it left of ``namespace``, or None."""
    if stream is None or stream.cleared_at is None or stream.cleared_at < since:
        return None
    seen: dict[str, Any] = {"kv_events": "AllBlocksCleared", "at": stream.cleared_at.isoformat()}
    kept = {medium: blocks for medium, blocks in (stream.cleared_kept or {}).get(str(namespace.pk), {}).items() if blocks}
    if kept:
        seen["kept"] = kept
    return seen


def _zero_in_every_medium(engine: Engine, namespace: CacheNamespace, since: Any) -> Any | None:
    """The first flush after ``since`` whose samples show ``namespace`` at zero
    blocks in every medium (a flush writes every medium the namespace holds
    blocks in, at one time), or None."""
    by_flush: dict[Any, bool] = {}
    for sampled_at, blocks in (
        ResidentSample.objects.filter(engine=engine, namespace=namespace, sampled_at__gte=since)
        .order_by("sampled_at")
        .values_list("sampled_at", "blocks")
    ):
        by_flush[sampled_at] = by_flush.get(sampled_at, True) and blocks == 0
    return next((at for at, zero in by_flush.items() if zero), None)


def consumer_running(engine: Engine) -> bool:
    """Whether a consumer saved this engine's stream in the last :data:`CONSUMER_STALE_S` seconds."""
    cutoff = timezone.now() - timedelta(seconds=CONSUMER_STALE_S)
    return KvEventStream.objects.filter(engine=engine, heartbeat_at__gte=cutoff).exists()
