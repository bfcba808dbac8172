"""A real Celery worker and the KV-event consumer as child processes (demo and tests).

The embedded default has no service manager, so the demo starts its own worker
on the configured broker (kombu's filesystem transport by default) and stops
it when done. Nothing here runs tasks in-process: there is no eager mode.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cacheadmin.env import control_plane_environment
from inference.child_env import die_with_parent


class WorkerProcess:
    """``celery -A cacheadmin worker`` in a subprocess, logging to ``log_path``.

    Args:
        log_path: file receiving the worker's output.
        env: extra environment (e.g. ``DATABASE_URL`` of a test database).
        name: node name prefix; the pid keeps node names unique.
        beat: also run the beat scheduler inside the worker (``-B``; the
            schedules are read from the database, see ``cacheadmin.schedules``).
            One such worker per deployment: two would send every task twice.
    """

    def __init__(self, log_path: Path, *, env: dict[str, str] | None = None, name: str = "worker", beat: bool = False) -> None:
        self.log_path = log_path
        # An allowlist, not this process's environment: see cacheadmin.env.control_plane_environment.
        self.env = control_plane_environment(env)
        self.name = name
        self.beat = beat
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0  # where this start's lines begin in a log shared with earlier runs

    #: What the process logs once it is ready.
    ready_marker = b" ready."
    what = "celery worker"

    def command(self) -> list[str]:
        """The child's argv."""
        return [
            sys.executable, "-m", "celery", "-A", "cacheadmin", "worker", "--pool=solo", "--loglevel=INFO",
            "--without-gossip", "--without-mingle", "-n", f"{self.name}-{os.getpid()}-{time.monotonic_ns()}@%h",
            *(["-B"] if self.beat else []),
        ]  # fmt: skip

    def start(self, *, ready_timeout_s: float = 60.0) -> None:
        """Start the process and wait until it logs that it is ready.

        Raises:
            RuntimeError: it exited or did not become ready in time (log tail included).
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        offset = self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.what} exited with {self.proc.returncode}:\n{self.tail()}")
            with self.log_path.open("rb") as fh:
                fh.seek(offset)
                if self.ready_marker in fh.read():
                    return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{self.what} not ready after {ready_timeout_s:.0f} s:\n{self.tail()}")

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the worker, as a crash or an OOM kill would."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Warm shutdown (SIGTERM: finish the current task), SIGKILL after ``timeout_s``."""
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, lines: int = 30) -> str:
        """Last lines this start wrote to the log (not an earlier run's)."""
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(self._log_offset)
                return "\n".join(fh.read().decode("utf-8", "replace").splitlines()[-lines:])
        except OSError:
            return ""


class KvEventsProcess(WorkerProcess):
    """``manage.py kv_events`` in a subprocess: the KV-event consumer beside the worker.

    Args:
        metrics_addr: ``HOST:PORT`` it serves its Prometheus metrics on (``--metrics-addr``;
            the demo passes ``KV_EVENTS_METRICS_ADDR``); empty: no metrics endpoint.
    """

    ready_marker = b"kv_events consumer "
    what = "kv_events consumer"

    def __init__(
        self, log_path: Path, *, env: dict[str, str] | None = None, name: str = "worker", metrics_addr: str = ""
    ) -> None:
        super().__init__(log_path, env=env, name=name)
        self.metrics_addr = metrics_addr

    def command(self) -> list[str]:
        """The consumer's argv (one partition: the embedded default's whole fleet)."""
        metrics = ["--metrics-addr", self.metrics_addr] if self.metrics_addr else []
        return [sys.executable, str(Path(__file__).resolve().parents[2] / "manage.py"), "kv_events", *metrics]


class GatewayProcess(WorkerProcess):
    """``manage.py gateway`` in a subprocess: the data plane beside the dashboard."""

    ready_marker = b"gateway on "
    what = "gateway"

    def command(self) -> list[str]:
        """The gateway's argv (address and processes from settings)."""
        return [sys.executable, str(Path(__file__).resolve().parents[2] / "manage.py"), "gateway"]
