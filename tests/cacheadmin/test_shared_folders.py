"""Processes that share a folder under ``VAR_DIR`` never remove each other's
files: each writes files of its own, named by its pid and start time, and a
process removes only files of processes that are dead (a pid reused by a
later process does not make a dead process's file look alive)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference.checkpoints import TinyMistralSpec, build_tiny_mistral
from inference.child_env import die_with_parent
from inference.kv_transport import key_pair
from inference.metrics_files import instance_dir, reap
from inference.processes import process_started
from tests.gateway.harness import chat
from tests.helpers import PROJECT, running_gateway, subprocess_env

TOKEN = "t" * 40


def _requests_total(base: str) -> float:
    text = httpx.get(f"{base}/metrics", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvcp_gateway_requests_total" and s.labels.get("layer") == "response"
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_second_gateway_on_the_same_var_dir_keeps_the_first_ones_request_count(setup: dict[str, Any], tmp_path: Path) -> None:
    env = subprocess_env(GATEWAY_SEMANTIC="0", GATEWAY_DIR=str(tmp_path / "gw"), METRICS_TOKEN=TOKEN,
                         GATEWAY_METRICS_DIR=str(tmp_path / "metrics"))  # fmt: skip
    with running_gateway(env, tmp_path / "first.log") as first:
        for i in range(12):
            httpx.post(f"{first}/v1/chat/completions", json=chat(f"question {i}", temperature=0),
                       headers={"authorization": f"Bearer {setup['key']}"}, timeout=30)  # fmt: skip
        assert _requests_total(first) == 12
        with running_gateway(env, tmp_path / "second.log") as second:
            assert _requests_total(first) == 12
            assert _requests_total(second) == 0  # each gateway's /metrics is its own processes'
            httpx.post(f"{second}/v1/chat/completions", json=chat("another", temperature=0),
                       headers={"authorization": f"Bearer {setup['key']}"}, timeout=30)  # fmt: skip
            assert (_requests_total(first), _requests_total(second)) == (12, 1)
        assert _requests_total(first) == 12  # the second's stop removed nothing of the first's


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"], start_new_session=True, preexec_fn=die_with_parent)


def _touch(folder: Path, *names: str) -> None:
    for name in names:
        (folder / name).write_bytes(b"\0" * 8)


def test_reaping_removes_only_dead_processes_files_and_a_reused_pid_does_not_keep_them(tmp_path: Path) -> None:
    live = _sleeper()
    dead = _sleeper()
    try:
        live_token = f"{live.pid}-{process_started(live.pid)}"
        # The same pid with another start time: the file of an earlier process that had this pid.
        reused = f"{live.pid}-{process_started(live.pid) - 1}"  # type: ignore[operator]
        dead_token = f"{dead.pid}-{process_started(dead.pid)}"
        os.killpg(dead.pid, signal.SIGKILL)
        dead.wait()
        _touch(tmp_path, *(f"{kind}_{owner}.db" for kind in ("counter", "histogram", "gauge_livemax", "gauge_all")
                           for owner in (live_token, reused, dead_token)))  # fmt: skip
        _touch(tmp_path, "notes.txt", f"counter_{live.pid}.db")  # no token: not ours to judge; a bare live pid
        # Live gauges of the dead owners only (the reused pid's included); counters keep counting in totals.
        assert reap(tmp_path) == sorted([f"gauge_livemax_{reused}.db", f"gauge_livemax_{dead_token}.db"])
        assert reap(tmp_path) == []
        # A process group's start: every file of a dead process, never a live one's.
        assert reap(tmp_path, every_type=True) == sorted(
            f"{kind}_{owner}.db" for kind in ("counter", "histogram", "gauge_all") for owner in (reused, dead_token)
        )
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [f"counter_{live_token}.db", f"histogram_{live_token}.db", f"gauge_livemax_{live_token}.db",
             f"gauge_all_{live_token}.db", "notes.txt", f"counter_{live.pid}.db"]
        )  # fmt: skip
    finally:
        os.killpg(live.pid, signal.SIGKILL)
        live.wait()
    # Once the owner is gone, a bare pid's file goes too (with every_type).
    assert f"counter_{live.pid}.db" in reap(tmp_path, every_type=True)


def test_a_gateway_instance_folder_is_removed_only_once_its_owner_is_dead(tmp_path: Path) -> None:
    live = _sleeper()
    dead = _sleeper()
    try:
        live_dir = tmp_path / f"{live.pid}-{process_started(live.pid)}"
        reused_dir = tmp_path / f"{live.pid}-{process_started(live.pid) - 1}"  # type: ignore[operator]
        dead_dir = tmp_path / f"{dead.pid}-{process_started(dead.pid)}"
        os.killpg(dead.pid, signal.SIGKILL)
        dead.wait()
        for folder in (live_dir, reused_dir, dead_dir):
            folder.mkdir()
            _touch(folder, "counter_1-1.db")
        own = instance_dir(tmp_path)
        assert own == tmp_path / f"{os.getpid()}-{process_started(os.getpid())}"
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live_dir.name, own.name])
        assert [p.name for p in live_dir.iterdir()] == ["counter_1-1.db"]
    finally:
        os.killpg(live.pid, signal.SIGKILL)
        live.wait()


def test_a_process_names_its_metrics_files_by_pid_and_start_time(tmp_path: Path) -> None:
    """A worker process of a gateway (spawned: it creates its families itself) writes files of its own."""
    code = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(PROJECT)!r})
        from gateway.metrics import families
        from inference.processes import process_started
        families()["requests"].labels("ns", "response", "hit").inc()
        families()["breaker_open"].labels("e1").set(1)
        print(f"{{os.getpid()}}-{{process_started(os.getpid())}}")
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    token = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"counter_{token}.db", f"gauge_livemax_{token}.db"]
    # Its process has exited: its live gauge goes, its counter keeps counting.
    assert reap(tmp_path) == [f"gauge_livemax_{token}.db"]


BUILD = """
import sys
sys.path.insert(0, {project!r})
from pathlib import Path
from inference.checkpoints import TinyMistralSpec, build_tiny_mistral
from inference.processes import process_token
print(process_token(), flush=True)
sys.stdin.readline()  # both builders start together
build_tiny_mistral(Path({target!r}), TinyMistralSpec(seed=1))
"""


@pytest.mark.slow
def test_two_processes_building_one_checkpoint_both_succeed_and_a_dead_builders_partial_goes(tmp_path: Path) -> None:
    target = tmp_path / "tiny-v1"
    dead = _sleeper()
    dead_partial = tmp_path / f"tiny-v1.partial-{dead.pid}-{process_started(dead.pid)}"
    os.killpg(dead.pid, signal.SIGKILL)
    dead.wait()
    dead_partial.mkdir()
    code = BUILD.format(project=str(PROJECT), target=str(target))
    builders = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent,
        )  # fmt: skip
        for _ in range(2)
    ]
    for builder in builders:
        assert builder.stdout is not None and builder.stdout.readline().strip()
    for builder in builders:
        assert builder.stdin is not None
        builder.stdin.write("go\n")
        builder.stdin.flush()
    results = [builder.communicate(timeout=300) for builder in builders]
    assert [b.returncode for b in builders] == [0, 0], [err[-2000:] for _, err in results]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-v1"]
    assert (target / "model.safetensors").is_file() and (target / ".build-spec.json").is_file()


@pytest.mark.slow
def test_a_build_that_finds_the_same_spec_already_built_returns_it_and_another_spec_is_refused(tmp_path: Path) -> None:
    # What the second of two builders sees when the first renamed its build into place before it began.
    target = build_tiny_mistral(tmp_path / "tiny-v1", TinyMistralSpec(seed=1))
    weights = (target / "model.safetensors").read_bytes()
    assert build_tiny_mistral(target, TinyMistralSpec(seed=1)) == target
    assert (target / "model.safetensors").read_bytes() == weights
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        build_tiny_mistral(target, TinyMistralSpec(seed=2))
    assert (target / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-v1"]


def test_a_dead_processs_leftover_temp_file_does_not_stop_the_kv_events_key_from_being_created(tmp_path: Path) -> None:
    path = tmp_path / "kv-events-consumer.key"
    # What a process with this pid left when it died between writing its temporary file and linking it.
    (tmp_path / f".{path.name}.{os.getpid()}.tmp").write_text("left by a dead process")
    public, secret = key_pair(path)
    assert len(public) == 40 and path.read_text().strip() == secret
    assert key_pair(path) == (public, secret)
