"""The demo's shutdown is not interrupted by a second Ctrl-C or a SIGTERM after it:
both only say that it is stopping (real signals, sent to this process)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from cacheadmin.management.commands.demo import stop_without_interruption


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
