"""A real Prometheus server for tests (Debian's ``prometheus`` package):
started on a free port with a temporary config and data folder, scraping the
given targets every second with a bearer credentials file, and queried over
its HTTP API."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from inference.child_env import die_with_parent

PROMETHEUS_BIN = Path("/usr/bin/prometheus")


def free_port() -> int:
    """A TCP port free on the loopback now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Prometheus:
    """A running server: ``base`` is its URL; :meth:`query` and :meth:`wait` read its API."""

    def __init__(self, base: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
        self.base, self.process, self.log_path = base, process, log_path

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>`` → its ``data``.

        Raises:
            OSError: the server does not answer (yet).
            AssertionError: it answered an error.
        """
        url = f"{self.base}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector: ``[{"metric": {...}, "value": [t, "v"]}, ...]``."""
        return self.api("query", query=expr)["result"]

    def wait(self, check: Callable[[Prometheus], Any], what: str, *, timeout_s: float = 60.0) -> Any:
        """Poll ``check(self)`` until it returns something true; fail with the log's tail after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.process.returncode}:\n{self.tail()}")
            try:
                last = check(self)
            except OSError:
                last = None
            if last:
                return last
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last: {last}\n{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        """The last lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@contextmanager
def prometheus_running(folder: Path, config: dict[str, Any]) -> Iterator[Prometheus]:
    """Run ``/usr/bin/prometheus`` with ``config`` (written to ``folder/prometheus.yml``,
    data and log in ``folder``) on a free loopback port; stopped on exit.

    Raises:
        AssertionError: ``/usr/bin/prometheus`` is missing (``scripts/setup --test`` installs it).
    """
    if not PROMETHEUS_BIN.exists():
        raise AssertionError(f"{PROMETHEUS_BIN} missing: scripts/setup --test installs Debian's prometheus package")
    # JSON is YAML: no YAML writer needed.
    (folder / "prometheus.yml").write_text(json.dumps(config))
    port = free_port()
    log_path = folder / "prometheus.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(PROMETHEUS_BIN), f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
        )  # fmt: skip
    server = Prometheus(f"http://127.0.0.1:{port}", process, log_path)
    try:
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def prometheus_scraping(
    targets: Sequence[str], *, folder: Path, token: str, job: str = "kvcp", rule_files: Sequence[Path] = ()
) -> Iterator[Prometheus]:
    """Run a Prometheus that scrapes ``targets`` (``HOST:PORT``, path ``/metrics``)
    every second with ``Authorization: Bearer <token>`` read from a credentials file.

    Args:
        folder: where its config, credentials file, data and log go.
        job: the scrape job's name (label ``job``).
        rule_files: rule files to load (evaluated every second).

    Raises:
        AssertionError: ``/usr/bin/prometheus`` is missing (``scripts/setup --test`` installs it).
    """
    credentials = folder / "metrics-token"
    credentials.write_text(token)
    credentials.chmod(0o600)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {
                "job_name": job,
                "metrics_path": "/metrics",
                "authorization": {"type": "Bearer", "credentials_file": str(credentials)},
                "static_configs": [{"targets": list(targets)}],
            }
        ],
    }
    with prometheus_running(folder, config) as server:
        yield server
