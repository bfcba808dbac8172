"""Child processes get an environment built from an allowlist, never the parent's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inference.child_env import ENGINE_ENV_NAMES, SYSTEM_NAMES, child_environment
from inference.engines.launcher import EngineSpec


def test_a_child_gets_the_system_names_what_it_inherits_and_what_is_set(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/usr/bin")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/var/metrics")
    monkeypatch.setenv("DATABASE_URL", "postgres://admin:hunter2@db/kvcp")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.delenv("TZ", raising=False)
    env = child_environment({"OMP_NUM_THREADS": "2"}, inherit=("CUDA_VISIBLE_DEVICES", "TZ"))
    assert env["PATH"] == "/usr/bin" and env["LC_ALL"] == "C.UTF-8"
    assert (env["CUDA_VISIBLE_DEVICES"], env["OMP_NUM_THREADS"]) == ("1", "2")
    assert "PROMETHEUS_MULTIPROC_DIR" not in env and "DATABASE_URL" not in env and "TZ" not in env
    assert set(env) <= SYSTEM_NAMES | {"LC_ALL", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"}


def test_an_engine_started_by_a_web_worker_gets_none_of_its_environment(tmp_path: Path, monkeypatch) -> None:
    # A gunicorn worker of the control plane holds its metrics folder, its database URL and keys.
    for name, value in {
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics"), "DATABASE_URL": "postgres://u:p@db/kvcp",
        "VLLM_API_KEY": "the-parents-key", "VLLM_KV_CACHE_LAYOUT": "HND", "DJANGO_SECRET_KEY": "s" * 50,
        "HF_HUB_OFFLINE": "0", "PYTHONPATH": "/elsewhere",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    base: dict[str, Any] = {
        "model_path": tmp_path,
        "served_name": "tiny",
        "dtype": "float32",
        "log_path": tmp_path / "log",
        "port": 1,
    }
    env = EngineSpec(**base, api_key="k-1").environment()
    own = {
        "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75",
        "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_API_KEY": "k-1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "VLLM_WORKER_MULTIPROC_METHOD": "fork",
    }  # fmt: skip
    assert {k: env[k] for k in own} == own
    assert set(env) - set(own) <= SYSTEM_NAMES | ENGINE_ENV_NAMES | {n for n in env if n.startswith("LC_")}
    assert "VLLM_API_KEY" not in EngineSpec(**base).environment()
    assert "VLLM_KV_CACHE_LAYOUT" not in EngineSpec(**base).environment()
    assert EngineSpec(**base, inherit_env=("DATABASE_URL",)).environment()["DATABASE_URL"] == "postgres://u:p@db/kvcp"
    # vLLM's own thread binding (no cpu_threads) keeps its spawned processes; spawn asked for is kept too.
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in EngineSpec(**base, cpu_threads=None).environment()
    assert EngineSpec(**base, start_method="spawn").environment()["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
