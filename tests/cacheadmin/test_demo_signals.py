"""The demo's terminal: engines starting are reported while they start, and the shutdown
is not interrupted by a second Ctrl-C or a SIGTERM after it:
both only say that it is stopping (real signals, sent to this process)."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator

import pytest

from cacheadmin.management.commands.demo import stop_without_interruption
from cacheadmin.services.demo import StartProgress, _start_estimate
from tests.helpers import wait_for


@pytest.fixture
def restored_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_signals_during_the_shutdown_are_told_not_raised(restored_handlers: None, capfd: pytest.CaptureFixture[str]) -> None:
    stop_without_interruption()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):
        os.kill(os.getpid(), sig)
        time.sleep(0.05)  # delivered at the next bytecode boundary; nothing may be raised
    assert capfd.readouterr().err.splitlines() == [
        f"signal {int(s)} received while stopping: the engines, worker and server are being stopped; wait"
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGINT)
    ]


def test_engines_starting_are_reported_until_they_are_up() -> None:
    lines: list[str] = []
    estimate = "; earlier starts here took 45-60 s (engines started together share the cores)"
    with StartProgress(lines.append, 5, estimate, every_s=0.05):
        wait_for(lambda: len(lines) >= 3, timeout=10, what="three progress lines")
    count = len(lines)
    time.sleep(0.2)
    assert len(lines) == count  # nothing after the engines are up
    pattern = re.compile(r"  still starting 5 engine\(s\): \d+ s so far" + re.escape(estimate))
    assert [bool(pattern.fullmatch(line)) for line in lines] == [True] * count, lines


@pytest.mark.django_db
def test_the_start_estimate_is_what_earlier_starts_took_else_the_measured_rate(django_user_model) -> None:
    assert _start_estimate(5) == "; 5 together took about 110 s on 2 cores elsewhere"
    assert _start_estimate(2) == "; 2 together took about 44 s on 2 cores elsewhere"
