"""The gateway's processes under uvicorn's supervisor, as operators run them
(``manage.py gateway --workers 2``): a process that leaves the supervisor's
health ping unanswered for longer than uvicorn's own default (5 s), as one
does while a C extension holds the GIL on a loaded machine, keeps serving its
connections; one silent past ``GATEWAY_WORKER_HEALTHCHECK_S`` is replaced, and
the gateway log says so. A stopped process (SIGSTOP) stands in for the busy one:
it answers nothing for exactly as long as the test chooses."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers import running_gateway, subprocess_env, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

HEALTHCHECK_S = 10


def _gateway_processes(port: int) -> tuple[int, list[int]]:
    """(the supervisor's pid, its worker pids) of the gateway listening on ``port``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gateway" in argv and f"127.0.0.1:{port}".encode() in argv:
            pid = int(entry.name)
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            # uvicorn's supervisor also starts multiprocessing's resource tracker: its workers run the app.
            workers = [int(c) for c in children if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
            return pid, sorted(workers)
    raise AssertionError(f"no gateway process listens on port {port}")


def _silent_for(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        with contextlib.suppress(ProcessLookupError):  # replaced (killed) meanwhile
            os.kill(pid, signal.SIGCONT)


def test_a_process_busy_past_uvicorns_default_is_kept_and_one_silent_past_the_setting_is_replaced(tmp_path: Path) -> None:
    env = subprocess_env(
        GATEWAY_SEMANTIC="0", GATEWAY_DIR=str(tmp_path), GATEWAY_METRICS_DIR=str(tmp_path / "metrics"),
        GATEWAY_WORKER_HEALTHCHECK_S=str(HEALTHCHECK_S),
    )  # fmt: skip
    log = tmp_path / "gateway.log"
    with running_gateway(env, log, workers=2) as base:
        port = int(base.rsplit(":", 1)[1])
        wait_for(lambda: len(_gateway_processes(port)[1]) == 2, timeout=30, what="both gateway processes")
        supervisor, workers = _gateway_processes(port)
        _silent_for(workers[0], 7)  # past uvicorn's default of 5 s
        time.sleep(1)  # the supervisor's next round (every 0.5 s) has pinged it again
        assert _gateway_processes(port) == (supervisor, workers)
        assert "died" not in log.read_text()

        _silent_for(workers[0], HEALTHCHECK_S + 4)
        wait_for(lambda: f"Child process [{workers[0]}] died" in log.read_text(), timeout=30, what="the replacement")
        wait_for(lambda: len(_gateway_processes(port)[1]) == 2, timeout=30, what="a new process")
        after = _gateway_processes(port)[1]
        assert workers[0] not in after and workers[1] in after
