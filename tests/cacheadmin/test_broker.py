"""The embedded default's broker transport (:mod:`cacheadmin.broker`) on real kombu connections."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from queue import Empty

import pytest
from django.conf import settings
from kombu import Connection

from cacheadmin.broker import CLAIMED_DIR, UNREADABLE_DIR, Channel, Transport
from cacheadmin.celery import app


def _connection(folder: Path) -> Connection:
    (folder / "control").mkdir(parents=True, exist_ok=True)
    return Connection(
        "filesystem://",
        transport="cacheadmin.broker:Transport",
        transport_options={
            "data_folder_in": str(folder), "data_folder_out": str(folder), "control_folder": str(folder / "control"),
        },
    )  # fmt: skip


def _queue_name(tmp_path: Path) -> str:
    # kombu keeps a transport's bindings in one state per process, whatever the folder: a queue
    # name bound in another test's folder would be taken as bound in this one too.
    return f"jobs-{tmp_path.name}"


def _messages(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".msg"))


def test_the_embedded_default_uses_this_transport() -> None:
    if settings.CELERY_BROKER_URL != "filesystem://":
        pytest.skip("a broker URL is set: this run uses that broker")
    with app.connection_for_write() as conn:
        assert type(conn.transport) is Transport


def test_a_message_is_in_its_folder_whole_and_nothing_else_is_left(tmp_path: Path) -> None:
    with _connection(tmp_path) as conn:
        queue = conn.SimpleQueue(_queue_name(tmp_path))
        queue.put({"n": 1, "pad": "x" * 100_000})
        names = [p.name for p in tmp_path.iterdir() if p.is_file()]
        assert len(names) == 1 and names[0].endswith(f".{_queue_name(tmp_path)}.msg")
        message = queue.get(timeout=1)
        assert message.payload == {"n": 1, "pad": "x" * 100_000}
        message.ack()
        assert _messages(tmp_path) == []
        assert list((tmp_path / CLAIMED_DIR).iterdir()) == []
        queue.close()


def test_an_empty_message_file_is_set_aside_and_the_next_message_still_arrives(tmp_path: Path) -> None:
    # kombu's own transport creates the file before writing into it: a reader in that moment
    # saw it empty and the worker died (celery/kombu#1551).
    with _connection(tmp_path) as conn:
        queue = conn.SimpleQueue(_queue_name(tmp_path))
        # Named older than any message kombu names (``<monotonic ms>_<uuid>``, listed in name
        # order), so the consumer meets it first.
        bad = f"0_00000000-0000-0000-0000-000000000000.{_queue_name(tmp_path)}.msg"
        (tmp_path / bad).write_bytes(b"")
        queue.put({"n": 2})
        message = queue.get(timeout=1)
        assert message.payload == {"n": 2}
        message.ack()
        assert [p.name for p in (tmp_path / UNREADABLE_DIR).iterdir()] == [bad]
        with pytest.raises(Empty):
            queue.get(timeout=0.2)
        queue.close()


def test_messages_read_while_they_are_written_arrive_whole_and_once(tmp_path: Path) -> None:
    """A producer writes while a consumer polls the folder as fast as it can: kombu's own transport
    hands the consumer files its producer is still writing (JSONDecodeError), this one never."""
    total = 400
    name = _queue_name(tmp_path)
    with _connection(tmp_path) as conn:
        conn.SimpleQueue(name).close()  # the queue and its binding exist before anything is written
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            with _connection(tmp_path) as conn:
                channel = conn.default_channel
                assert isinstance(channel, Channel)
                for n in range(total):
                    channel._put(name, {"n": n, "pad": "y" * 20_000})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    producer = threading.Thread(target=produce, daemon=True)  # a hung producer fails the test, never the run
    received: list[int] = []
    with _connection(tmp_path) as conn:
        channel = conn.default_channel
        assert isinstance(channel, Channel)
        producer.start()
        deadline = time.monotonic() + 120
        while len(received) < total and time.monotonic() < deadline and not errors:
            try:
                received.append(channel._get(name)["n"])
            except Empty:
                continue
        producer.join(30)
        other = _connection(tmp_path)
        second = other.default_channel
        assert isinstance(second, Channel)
        channel._put(name, {"n": total})
        # One message, two consumers: the rename that claims it is won once.
        assert channel._get(name) == {"n": total}
        with pytest.raises(Empty):
            second._get(name)
        other.close()
    assert errors == []
    assert sorted(received) == list(range(total))  # each once (names order by the millisecond, not within one)
    assert _messages(tmp_path) == []
    assert not (tmp_path / UNREADABLE_DIR).exists()


def test_exchange_tables_bound_from_many_threads_hold_every_queue(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def bind(i: int) -> None:
        try:
            with _connection(tmp_path) as conn:
                channel = conn.default_channel
                assert isinstance(channel, Channel)
                start.wait()
                channel._queue_bind(f"fan-{tmp_path.name}", f"key{i}", "", f"q{i}")
                assert channel.get_table(f"fan-{tmp_path.name}")  # never read empty
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=bind, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    with _connection(tmp_path) as conn:
        channel = conn.default_channel
        assert isinstance(channel, Channel)
        table = channel.get_table(f"fan-{tmp_path.name}")
    assert sorted(q.queue for q in table) == [f"q{i}" for i in range(8)]
    assert [p.name for p in (tmp_path / "control").iterdir()] == [f"fan-{tmp_path.name}.exchange"]
