"""Processes the project starts end with their owner, and a pid is a process only
with its start time (a reused pid is never signalled)."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from inference.engines.launcher import stop_process_group
from inference.processes import pid_alive, process_started

PROJECT = Path(__file__).resolve().parents[2]


def _session(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(list(argv), start_new_session=True)


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_process_is_its_pid_and_start_time() -> None:
    proc = _session("sleep", "60")
    try:
        started = process_started(proc.pid)
        assert isinstance(started, int) and started > 0
        assert pid_alive(proc.pid) and pid_alive(proc.pid, started)
        # The same pid with another start time is another process (the pid was reused).
        assert not pid_alive(proc.pid, started + 1)
        assert stop_process_group(proc.pid, started=started + 1, timeout_s=2) is False
        assert proc.poll() is None
        assert stop_process_group(proc.pid, started=started, timeout_s=5) is True
        proc.wait(timeout=5)  # reaped by stop_process_group already (it is our child)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert process_started(proc.pid) is None and not pid_alive(proc.pid, started)


def test_an_attached_engine_dies_with_the_process_that_started_it_even_when_killed(tmp_path: Path) -> None:
    """The launcher's attached start (the demo's engines): a SIGKILL of the starter,
    which runs no cleanup, still ends the engine (parent-death signal)."""
    starter = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(PROJECT)!r})
        from pathlib import Path
        from inference.engines.launcher import EngineSpec, LocalEngine

        class Sleeper(EngineSpec):
            def command(self):
                return [sys.executable, "-c", "import time; time.sleep(120)"]

        spec = Sleeper(model_path=Path("."), served_name="x", dtype="float32", log_path=Path({str(tmp_path / "e.log")!r}), port=1)
        engine = LocalEngine(spec)
        engine.start(detach=False)
        print(engine.pid, flush=True)
        time.sleep(120)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert owner.stdout is not None
        engine_pid = int(owner.stdout.readline())
        assert pid_alive(engine_pid)
        owner.kill()
        owner.wait(timeout=10)
        assert _gone(engine_pid), "the engine outlived the process that started it"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


#: Popen calls whose child may outlive the thread that started it, and why. Keyed by
#: file; every other process the project, its tests or its benches start carries
#: ``preexec_fn`` with the parent-death signal (``die_with_parent``).
MAY_OUTLIVE = {
    # A detached engine outlives the web worker or CLI that started it by design; its pid
    # and start time are recorded and `engine stop-all` ends it.
    "inference/engines/launcher.py": "detached engines are recorded and stopped by pid and start time",
    # These tests start processes that must outlive their starter, to prove what ends them.
    "tests/inference/test_process_lifetime.py": "the process-lifetime tests themselves",
    "tests/cacheadmin/test_child_processes.py": "stop-all's own processes and a stranger's",
}


def test_every_process_started_anywhere_dies_with_its_starter() -> None:
    """A killed test run, demo or bench leaves nothing behind (found: the tests'
    Prometheus, the gateway runner's server, the Redis server of the full-store test,
    metrics servers, the KV-event consumer of the fleet test and the disk scan's
    workers had no parent-death signal). New Popen calls are held to it too."""
    missing = []
    for folder in ("cacheadmin", "inference", "gateway", "tests", "bench", "scripts"):
        for path in sorted((PROJECT / folder).rglob("*.py")):
            relative = path.relative_to(PROJECT).as_posix()
            if relative in MAY_OUTLIVE:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call) and ast.unparse(node.func) in {"subprocess.Popen", "Popen"}:
                    preexec = {k.arg: ast.unparse(k.value) for k in node.keywords}.get("preexec_fn", "")
                    if "die_with_parent" not in preexec:
                        missing.append(f"{relative}:{node.lineno}")
    assert missing == []
