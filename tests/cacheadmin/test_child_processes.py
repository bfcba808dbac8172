"""What the control plane's own children (worker, gateway, consumer, web server) get
from its environment: the settings it read, nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cacheadmin.env import READ_NAMES, control_plane_environment
from cacheadmin.models import Engine, EngineAlarm
from cacheadmin.services import engine_verification
from cacheadmin.services.engine_verification import VerificationRefused, engine_verify
from cacheadmin.services.workers import GatewayProcess, WorkerProcess
from inference.engines.verify import DRIFT_CACHE_LABELS, drift_baseline
from inference.processes import process_started
from tests.helpers import manage, subprocess_env


def test_a_control_plane_child_gets_the_settings_read_and_nothing_else(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "web-metrics"))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-children")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the engines the worker starts keep it
    assert {"DATABASE_URL", "VAR_DIR", "CELERY_BROKER_URL", "ENGINE_ENV_INHERIT"} <= READ_NAMES
    env = control_plane_environment({"GATEWAY_ADDR": "127.0.0.1:9"})
    assert env["GATEWAY_ADDR"] == "127.0.0.1:9" and env["DJANGO_SETTINGS_MODULE"] == "cacheadmin.settings"
    assert {n: env[n] for n in ("VAR_DIR",)} == {"VAR_DIR": os.environ["VAR_DIR"]}
    assert "PROMETHEUS_MULTIPROC_DIR" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    for child in (WorkerProcess(tmp_path / "w.log"), GatewayProcess(tmp_path / "g.log", env={"GATEWAY_WORKERS": "1"})):
        assert "AWS_SECRET_ACCESS_KEY" not in child.env and "PROMETHEUS_MULTIPROC_DIR" not in child.env
    assert GatewayProcess(tmp_path / "g.log", env={"GATEWAY_WORKERS": "1"}).env["GATEWAY_WORKERS"] == "1"


@pytest.mark.django_db
def test_a_recheck_that_could_not_read_the_engine_leaves_it_verified_and_in_service(world, monkeypatch) -> None:
    """The example: an engine's /metrics mixed with other processes' read prefix_caching False.
    Only a reading that was taken and differs takes a verified engine out of service."""
    engine = world["engine"]
    cache = {"block_size": "32", "cache_dtype": "auto", "enable_prefix_caching": "True", "kv_cache_layout": "None",
             "prefix_caching_hash_algo": "sha256"}  # fmt: skip
    facts = {"models": {"id": "tiny", "root": "/m", "max_model_len": 8192}, "cache_config": cache, "version": "0.32.0",
             "server_info": {"dtype": "float32"}, "output": " Paris", "unreadable": {}}  # fmt: skip
    Engine.objects.filter(pk=engine.pk).update(verification="verified", verified_facts=drift_baseline(facts))
    now: dict[str, Any] = {}
    monkeypatch.setattr(engine_verification, "identity_checks", lambda **_: ([], now["facts"]))

    now["facts"] = {**facts, "cache_config": None, "unreadable": {"/metrics": "2 different cache configurations"}}
    row = engine_verify(engine=engine, actor="schedule", trigger="schedule")
    engine.refresh_from_db()
    assert (row.outcome, engine.verification, engine.in_service) == ("inconclusive", "verified", True)
    assert {c["field"] for c in row.checks if not c["ok"]} == {f"cache_config:{k}" for k in DRIFT_CACHE_LABELS}
    assert not EngineAlarm.objects.filter(engine=engine).exists()

    now["facts"] = {**facts, "cache_config": {**cache, "enable_prefix_caching": "False"}}
    with pytest.raises(VerificationRefused, match="cache_config:enable_prefix_caching: expected 'True', engine reports 'False'"):
        engine_verify(engine=engine, actor="schedule", trigger="schedule")
    engine.refresh_from_db()
    assert (engine.verification, engine.in_service) == ("drifted", False)
    assert EngineAlarm.objects.filter(engine=engine, kind="verification_drift").count() == 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_stop_all_ends_every_running_local_engine_and_never_a_reused_pid(world) -> None:
    """``engine stop-all``: the one command that leaves no engine of the deployment
    running, whoever started it; a pid that names another process now is left alone."""
    ours = subprocess.Popen(["sleep", "120"], start_new_session=True)
    stranger = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        v1, ns = world["v1"], world["ns"]["acme"]
        running = Engine.objects.create(
            name="left-running", model_version=v1, namespace=ns, base_url="http://127.0.0.1:5", status="ready",
            pid=ours.pid, pid_started=process_started(ours.pid), detached=True,
        )  # fmt: skip
        reused = Engine.objects.create(
            name="reused-pid", model_version=v1, namespace=ns, base_url="http://127.0.0.1:6", status="ready",
            pid=stranger.pid, pid_started=(process_started(stranger.pid) or 0) - 1,
        )  # fmt: skip
        done = manage("engine", "stop-all", env=subprocess_env())
        assert (done.returncode, done.stdout.strip()) == (0, "stopped 1 engine(s): left-running"), done.stderr
        ours.wait(timeout=30)
        assert stranger.poll() is None  # another process under a recorded engine's old pid
        assert {e.name: (e.status, e.error) for e in Engine.objects.filter(pk__in=[running.pk, reused.pk])} == {
            "left-running": ("stopped", ""),
            "reused-pid": ("stopped", "process not running (found at stop-all)"),
        }
        again = manage("engine", "stop-all", env=subprocess_env())
        assert again.stdout.strip() == "stopped 0 engine(s)"
    finally:
        for proc in (ours, stranger):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
