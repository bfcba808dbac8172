"""``manage.py demo`` checks every port it binds (the dashboard's, the gateway's, the KV-event
consumer's metrics) before it migrates or starts anything: a taken one is one line naming the
port and the flag or variable that sets it, exit 3, and the database is left untouched."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheadmin.management.commands.demo import stopped_report
from cacheadmin.management.ports import PlannedPort, port_problems
from tests.helpers import manage


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process (this test) listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def _free() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _demo(tmp_path: Path, *args: str, **env: str):  # type: ignore[no-untyped-def]
    # A fresh SQLite database under a fresh VAR_DIR: what a refused start leaves is what there is to see.
    base = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "GATEWAY_ADDR", "KV_EVENTS_METRICS_ADDR")}
    return manage("demo", *args, env={**base, "VAR_DIR": str(tmp_path), "DATABASE_URL": "", **env})


@pytest.mark.parametrize("which", ["--addr", "--gateway-addr", "--kv-events-metrics-addr", "KV_EVENTS_METRICS_ADDR"])
def test_a_taken_port_is_named_with_what_sets_it_and_nothing_is_migrated_or_started(
    tmp_path: Path, taken: int, which: str
) -> None:
    addr = f"127.0.0.1:{taken}"
    ports = {"--addr": f"127.0.0.1:{_free()}", "--gateway-addr": f"127.0.0.1:{_free()}"}
    env = {"KV_EVENTS_METRICS_ADDR": f"127.0.0.1:{_free()}"}
    if which == "KV_EVENTS_METRICS_ADDR":
        env[which] = addr
    else:
        ports[which] = addr
    what, source = {
        "--addr": ("dashboard", "--addr or GUNICORN_BIND"),
        "--gateway-addr": ("gateway", "--gateway-addr or GATEWAY_ADDR"),
        "--kv-events-metrics-addr": ("KV-event consumer metrics", "--kv-events-metrics-addr or KV_EVENTS_METRICS_ADDR"),
        "KV_EVENTS_METRICS_ADDR": ("KV-event consumer metrics", "--kv-events-metrics-addr or KV_EVENTS_METRICS_ADDR"),
    }[which]
    done = _demo(tmp_path, *(w for flag, value in ports.items() for w in (flag, value)), **env)
    assert (done.returncode, done.stdout, done.stderr) == (
        3, "", f"CommandError: port {taken} ({what}, {addr}) is taken by another process: set another with {source}\n",
    )  # fmt: skip
    assert not (tmp_path / "db.sqlite3").exists() or (tmp_path / "db.sqlite3").stat().st_size == 0
    assert not (tmp_path / "logs").exists()  # no worker, consumer, gateway or server wrote a log


def test_the_gateway_port_set_by_its_variable_is_named_both_ways_and_two_servers_on_one_port_are_refused(
    tmp_path: Path, taken: int
) -> None:
    done = _demo(tmp_path, "--no-serve", GATEWAY_ADDR=f"127.0.0.1:{taken}", KV_EVENTS_METRICS_ADDR="")
    assert (done.returncode, done.stderr) == (
        3,
        f"CommandError: port {taken} (gateway, 127.0.0.1:{taken}) is taken by another process: set another with "
        "--gateway-addr or GATEWAY_ADDR\n",
    )
    port = _free()
    both = _demo(tmp_path, "--addr", f"127.0.0.1:{port}", "--gateway-addr", f"0.0.0.0:{port}", KV_EVENTS_METRICS_ADDR="")
    assert (both.returncode, both.stderr) == (
        3,
        f"CommandError: port {port} is planned twice: dashboard (--addr or GUNICORN_BIND) and gateway (--gateway-addr "
        "or GATEWAY_ADDR); set another with --gateway-addr or GATEWAY_ADDR\n",
    )
    bad = _demo(tmp_path, "--no-serve", "--gateway-addr", "8300")
    assert (bad.returncode, bad.stderr) == (
        2, "CommandError: --gateway-addr: must be HOST:PORT (e.g. 127.0.0.1:8300 or [::1]:8300), got '8300'\n",
    )  # fmt: skip
    assert not (tmp_path / "db.sqlite3").exists() or (tmp_path / "db.sqlite3").stat().st_size == 0


def test_an_address_of_another_machine_cannot_be_bound_and_free_ports_pass() -> None:
    free = _free()
    assert port_problems([PlannedPort(f"127.0.0.1:{free}", "--addr", "dashboard", "127.0.0.1:8000")]) == []
    assert port_problems([PlannedPort("192.0.2.1:8000", "--addr", "dashboard", "127.0.0.1:8000")]) == [
        "port 8000 (dashboard, 192.0.2.1:8000) cannot be bound on this machine (Cannot assign requested address): "
        "set another with --addr"
    ]
    # Two hosts of this machine on one port do not collide; a wildcard collides with both.
    assert port_problems([PlannedPort(f"127.0.0.1:{free}", "a", "x", "e"), PlannedPort(f"127.0.0.2:{free}", "b", "y", "e")]) == []
    # A malformed address is answered with that server's own default as the example.
    assert port_problems([PlannedPort("9464", "--kv-events-metrics-addr", "KV-event consumer metrics", "127.0.0.1:9464")]) == [
        "KV-event consumer metrics address '9464' (--kv-events-metrics-addr): must be HOST:PORT "
        "(e.g. 127.0.0.1:9464 or [::1]:9464), got '9464'"
    ]


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (("--kv-events-metrics-addr", "9464"), {},
         "--kv-events-metrics-addr: must be HOST:PORT (e.g. 127.0.0.1:9464 or [::1]:9464), got '9464'"),
        (("--kv-events-metrics-addr", "::1:9464"), {},
         "--kv-events-metrics-addr: an IPv6 address goes in brackets, e.g. [::1]:9464, got '::1:9464'"),
        (("--kv-events-metrics-addr", ""), {},
         "--kv-events-metrics-addr: must be HOST:PORT (e.g. 127.0.0.1:9464); to serve no metrics set "
         "KV_EVENTS_METRICS_ADDR empty"),
        ((), {"KV_EVENTS_METRICS_ADDR": "127.0.0.1:70000"},
         "KV_EVENTS_METRICS_ADDR: port must be 1..65535, got '70000' in '127.0.0.1:70000'"),
    ],
)  # fmt: skip
def test_a_malformed_metrics_address_is_bad_input_named_with_its_flag_or_variable(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    done = _demo(tmp_path, "--no-serve", *args, **env)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"CommandError: {message}\n")
    assert not (tmp_path / "db.sqlite3").exists() or (tmp_path / "db.sqlite3").stat().st_size == 0


def test_what_the_demo_stopped_is_said_in_one_line() -> None:
    everything = ["celery worker", "KV-event consumer", "dashboard server", "gateway"]
    assert stopped_report(["v1-a", "v2-b"], everything) == (
        "stopped 2 engine(s) (v1-a, v2-b), the celery worker, the KV-event consumer, the dashboard server and the gateway"
    )
    # A step that failed before any engine started (or a --no-serve run): what there was, no more.
    assert stopped_report([], ["celery worker", "KV-event consumer", "gateway"]) == (
        "stopped no engine (none was running), the celery worker, the KV-event consumer and the gateway"
    )
    assert stopped_report([], []) == "stopped no engine (none was running)"
