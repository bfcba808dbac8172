"""The fleet on real vLLM: an engine started by the CLI, restarted over the API
by a real worker, verified, watched
through its KV events by a real consumer process (killed mid-stream, resumed,
converging to what the engine stored), reset, restarted, crashed and brought
back by its restart policy; an engine the control plane did not start adopted
or refused by what it reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.test import APIClient

from cacheadmin.models import AuditEvent, Engine, EngineAlarm, EngineVerification, KvEventStream, ModelVersion, Tenant
from cacheadmin.services.addresses import engine_headers
from cacheadmin.services.api_tokens import api_token_issue
from cacheadmin.services.engine_verification import VerificationRefused
from cacheadmin.services.engines import engine_attach_namespace, engine_stop
from cacheadmin.services.fleet import _refuse_same_engine, engine_adopt, engines_health, engines_restart_due
from cacheadmin.services.kv_events import REFRESH_S, reset_observed, residency_now
from cacheadmin.services.model_versions import model_version_register
from cacheadmin.services.namespaces import (
    DEMO_POLICY,
    namespace_get_or_create,
    namespace_salt_read,
    retention_owner_get_or_create,
)
from cacheadmin.services.prewarm import JobRefused, prewarm_job_create
from cacheadmin.services.workers import WorkerProcess
from inference.child_env import die_with_parent
from inference.corpus import load_corpus
from inference.engines.launcher import EngineSpec, LocalEngine, free_port
from inference.errors import InvalidField, Refused
from inference.identity import LayoutOptions
from inference.kv_events import salt_digest
from tests.helpers import PROJECT, Forwarder, manage, subprocess_env, wait_for, worker_log

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]
LAYOUT = LayoutOptions(dtype="float32", kv_connector="ExampleConnector")
CORPUS = load_corpus("diagnostic")


def _version(demo_checkpoints, label: str) -> ModelVersion:
    return model_version_register(path=demo_checkpoints[label], label=label, served_name="tiny", layout=LAYOUT, actor="alice")[0]


def _namespace(version: ModelVersion, tenant: str):
    owner = retention_owner_get_or_create(name="platform", email="p@example.com", actor="alice")
    t = Tenant.objects.get_or_create(slug=tenant, defaults={"name": tenant.title()})[0]
    return namespace_get_or_create(model_version=version, tenant=t, retention_owner=owner, policy=DEMO_POLICY, actor="alice")[0]


def _consumer(env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
    (settings.VAR_DIR / "logs").mkdir(parents=True, exist_ok=True)
    log = (settings.VAR_DIR / "logs" / f"{name}.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "manage.py", "kv_events"],
        cwd=PROJECT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=die_with_parent,
    )


def _chat(engine: Engine, content: str, salt: str | None) -> int:
    """One greedy request of one output token; returns the blocks it stores
    (full blocks of the prompt: the output token's KV is never computed)."""
    body: dict = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    engine.refresh_from_db()  # its API key follows its incarnation
    answer = httpx.post(f"{engine.base_url}/v1/chat/completions", json=body, headers=engine_headers(engine), timeout=60).json()
    return answer["usage"]["prompt_tokens"] // 32


def _resident(engine: Engine) -> dict[int | None, int]:
    return {row["namespace"]: row["tokens"] for row in residency_now(engine)["namespaces"] if row["medium"] == "GPU"}


def _operator_key() -> str:
    user = User.objects.create_user("operator")
    return api_token_issue(user=user, name="fleet", scope="operate", tenant=None, actor="setup")[1]


def _text(n: int) -> str:
    return " ".join(f"word{n}-{i}" for i in range(40 + n))


def test_a_started_engine_is_verified_watched_reset_restarted_and_revived(demo_checkpoints) -> None:
    v1 = _version(demo_checkpoints, "tiny-v1")
    acme, globex = _namespace(v1, "acme"), _namespace(v1, "globex")
    # Started as a web worker of the control plane would start it: with the control plane's
    # metrics folder and a secret of its own in the environment.
    metrics_dir = settings.VAR_DIR / "fleet-test-metrics"
    metrics_dir.mkdir(exist_ok=True)
    env = subprocess_env(PROMETHEUS_MULTIPROC_DIR=str(metrics_dir), KVCP_PARENT_ONLY="not the engine's")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {_operator_key()}")

    # Bad input changes nothing.
    refused = manage("engine", "start", "--model-version", str(v1.pk), "--namespace", str(acme.pk), "--tier", "tape", env=env)
    assert refused.returncode == 2 and "invalid choice: 'tape'" in refused.stderr
    assert Engine.objects.count() == 0

    started = manage(
        "engine", "start", "--model-version", str(v1.pk), "--namespace", str(acme.pk), "--tier", "none",
        "--name", "acme-1", "--restart-policy", "on_failure", "--json", env=env, timeout=400,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    shown = json.loads(started.stdout)
    engine = Engine.objects.get(name="acme-1")
    try:
        assert (shown["status"], shown["verification"], shown["in_service"], shown["origin"]) == (
            "ready",
            "verified",
            True,
            "local",
        )
        assert engine.detached and engine.generation == 1 and engine.kv_connector == ""
        assert engine.kv_events_topic == f"kvcp.engine-{engine.pk}.1"
        command = Path(f"/proc/{engine.pid}/cmdline").read_bytes().split(b"\0")
        config = json.loads(command[command.index(b"--kv-events-config") + 1])
        assert config == {
            "enable_kv_cache_events": True, "endpoint": engine.kv_events_endpoint, "publisher": "zmq",
            "replay_endpoint": engine.kv_events_replay_endpoint, "topic": engine.kv_events_topic,
        }  # fmt: skip
        assert [b"--dtype", b"float32"] == command[command.index(b"--dtype") : command.index(b"--dtype") + 2]
        # Its environment is its own: none of the starter's metrics folder or secrets, and no
        # series of it in that folder (its /metrics would have read other processes' there).
        environ = dict(entry.split(b"=", 1) for entry in Path(f"/proc/{engine.pid}/environ").read_bytes().split(b"\0") if entry)
        assert b"PROMETHEUS_MULTIPROC_DIR" not in environ and b"KVCP_PARENT_ONLY" not in environ
        assert b"DATABASE_URL" not in environ and environ[b"VLLM_SERVER_DEV_MODE"] == b"1"
        assert [f.name for f in metrics_dir.iterdir() if f.name.endswith(f"_{engine.pid}.db")] == []
        verification = EngineVerification.objects.get(engine=engine)
        assert verification.outcome == "verified" and verification.trigger == "start"
        fields = [c["field"] for c in verification.checks]
        assert fields[:5] == ["served_name", "block_size", "kv_cache_dtype", "prefix_caching", "engine_version"]
        assert [f for f in fields if f.startswith("tokenizer:")] == [f"tokenizer:{c.id}" for c in CORPUS]
        assert all(c["ok"] for c in verification.checks)
        v1.refresh_from_db()
        assert v1.probe_output  # the reference answer adopted engines must give

        salt = namespace_salt_read(acme, actor="test", purpose="fleet test")
        consumer = _consumer(env, "kv-events-1")
        try:
            wait_for(lambda: KvEventStream.objects.filter(engine=engine).exists(), timeout=30, what="consumer bound")
            expected = sum(_chat(engine, _text(n), salt) for n in range(6))
            expected += _chat(engine, _text(100), None)  # no salt on a one-namespace engine: its namespace's
            wait_for(lambda: _resident(engine) == {acme.pk: expected * 32}, timeout=30, what=f"{expected} blocks resident")

            # Adopting it again behind another address for globex sends nothing into it: the
            # keyless adoption gets 401, and the sameness probe goes to adopted engines only
            # (found: every attempt cached a probe prompt here, and on a disk tier under acme's prefix).
            forwarder = Forwarder(int(engine.base_url.rsplit(":", 1)[1]))
            try:
                with pytest.raises(Refused, match="answered 401"):
                    engine_adopt(url=f"http://127.0.0.2:{forwarder.port}", model_version=v1, namespace=globex, actor="m")
                _refuse_same_engine(f"http://127.0.0.2:{forwarder.port}", v1)
            finally:
                forwarder.close()
            time.sleep(2 * 2 + 1)  # past two of the consumer's 2 s checkpoints
            assert _resident(engine) == {acme.pk: expected * 32}

            # Killed mid-stream: requests go on while it is down; it resumes from
            # its checkpoint, replays what it missed and converges.
            stop = threading.Event()
            sent: list[int] = []

            def traffic() -> None:
                n = 200
                while not stop.is_set():
                    sent.append(_chat(engine, _text(n), salt))
                    n += 1

            thread = threading.Thread(target=traffic)
            thread.start()
            wait_for(lambda: len(sent) >= 3, timeout=60, what="traffic")
            consumer.kill()
            consumer.wait()
            wait_for(lambda: len(sent) >= 8, timeout=60, what="traffic while the consumer is down")
            consumer = _consumer(env, "kv-events-2")
            wait_for(lambda: len(sent) >= 12, timeout=60, what="traffic after the restart")
            stop.set()
            thread.join()
            expected += sum(sent)
            wait_for(lambda: _resident(engine) == {acme.pk: expected * 32}, timeout=30, what="convergence")
            stream = KvEventStream.objects.get(engine=engine)
            assert stream.complete and stream.gaps == 0 and stream.replays >= 1
            assert not EngineAlarm.objects.filter(engine=engine).exists()

            # A salt of no namespace, and no salt once the engine serves two: isolation alarms.
            _chat(engine, _text(300), "forged-salt")
            engine_attach_namespace(engine=engine, namespace=globex, actor="alice")
            time.sleep(REFRESH_S + 1)  # the consumer reloads what each engine serves this often
            _chat(engine, _text(301), None)
            wait_for(
                lambda: (
                    set(EngineAlarm.objects.filter(engine=engine).values_list("kind", flat=True))
                    == {"isolation_unknown_salt", "isolation_no_salt"}
                ),
                timeout=30,
                what="two isolation alarms",
            )
            unknown = EngineAlarm.objects.get(engine=engine, kind="isolation_unknown_salt")
            assert unknown.key == salt_digest("forged-salt") and "forged-salt" not in unknown.detail
            assert EngineAlarm.objects.get(engine=engine, kind="isolation_no_salt").isolation

            # A reset shows up as AllBlocksCleared with the next scheduler step.
            since = timezone.now()
            # Every route of a local engine needs its API key (found: any local user could sleep,
            # pause, reset or salt-spoof an engine through its development routes): without it, 401.
            for method, path in (("POST", "/reset_prefix_cache"), ("POST", "/sleep"), ("POST", "/pause"),
                                 ("GET", "/server_info"), ("GET", "/metrics"), ("POST", "/tokenize"),
                                 ("POST", "/v1/completions"), ("GET", "/health")):  # fmt: skip
                assert httpx.request(method, f"{engine.base_url}{path}", timeout=30).status_code == 401, path
            printed = manage("engine", "key", str(engine.pk), env=env)
            assert printed.returncode == 0 and printed.stdout.strip() == engine_headers(engine)["Authorization"][7:]
            httpx.post(f"{engine.base_url}/reset_prefix_cache", headers=engine_headers(engine), timeout=30).raise_for_status()
            _chat(engine, "short", salt)
            assert reset_observed(engine, acme, since=since)["kv_events"] == "AllBlocksCleared"
            wait_for(lambda: _resident(engine) == {}, timeout=30, what="nothing resident after the reset")

            # Restart over the API: 202, a real worker boots the new incarnation; its old state is dropped.
            worker = WorkerProcess(worker_log("fleet-worker"), env=env, name="fleet")
            worker.start()
            try:
                answer = api.post(f"/api/engines/{engine.pk}/restart/", format="json")
                assert answer.status_code == 202 and answer.json()["status"] == "starting", answer.json()
                wait_for(lambda: Engine.objects.get(pk=engine.pk).status != "starting", timeout=400, what="worker boot")
            finally:
                worker.stop()
            engine.refresh_from_db()
            assert (engine.generation, engine.status, engine.verification) == (2, "ready", "verified")
            blocks = _chat(engine, _text(400), salt)
            wait_for(lambda: _resident(engine) == {acme.pk: blocks * 32}, timeout=30, what="new incarnation counted")

            # Crash: noticed by the health round, failed with its log tail, restarted by policy.
            os.killpg(engine.pid, signal.SIGKILL)
            wait_for(
                lambda: (
                    not Path(f"/proc/{engine.pid}").exists() or b"Z" in Path(f"/proc/{engine.pid}/stat").read_bytes().split()[2]
                ),
                timeout=30,
                what="process gone",
            )
            Engine.objects.filter(pk=engine.pk).update(restart_backoff_s=0)
            report = engines_health()
            assert report["failed"] == ["acme-1"] and report["restart_due"] == ["acme-1"]
            engine.refresh_from_db()
            assert engine.status == "failed" and engine.error.startswith("process gone (noticed by the health check")
            assert EngineAlarm.objects.filter(engine=engine, kind="health", resolved_at=None).count() == 1
            [revived] = engines_restart_due()
            assert (revived.status, revived.generation, revived.restart_attempts, revived.verification) == (
                "ready",
                3,
                1,
                "verified",
            )
        finally:
            consumer.send_signal(signal.SIGTERM)
            consumer.wait(timeout=30)
    finally:
        stopped = manage("engine", "stop", str(engine.pk), env=env)
        assert stopped.returncode == 0, stopped.stderr
        engine.refresh_from_db()
        assert engine.status == "stopped"


@pytest.fixture(scope="module")
def outside_engine(demo_checkpoints) -> Iterator[LocalEngine]:
    """tiny-v2's weights served as "tiny" by a process the control plane did not start."""
    spec = EngineSpec(
        model_path=demo_checkpoints["tiny-v2"], served_name="tiny", dtype="float32", port=free_port(),
        log_path=settings.ENGINE_LOG_DIR / "test-outside.log",
    )  # fmt: skip
    engine = LocalEngine(spec)
    engine.start()
    engine.wait_ready(settings.ENGINE_START_TIMEOUT_S)
    yield engine
    engine.stop()


def test_adoption_verifies_what_the_engine_reports(demo_checkpoints, outside_engine) -> None:
    v1, v2 = _version(demo_checkpoints, "tiny-v1"), _version(demo_checkpoints, "tiny-v2")
    # The version's reference answer, as a local engine of v1 recorded it.
    ModelVersion.objects.filter(pk=v1.pk).update(probe_output=" recorded by v1")
    v1.refresh_from_db()
    with pytest.raises(VerificationRefused) as refused:
        engine_adopt(url=outside_engine.base_url, model_version=v1, namespace=_namespace(v1, "acme"), actor="alice")
    assert set(refused.value.fields()) == {"output"}
    assert Engine.objects.count() == 0

    engine = engine_adopt(
        url=outside_engine.base_url, model_version=v2, namespace=_namespace(v2, "acme"), actor="alice", name="gpu-7"
    )
    assert (engine.origin, engine.status, engine.verification, engine.in_service) == ("adopted", "ready", "verified", True)
    assert engine.verified_facts["models"] == {"id": "tiny", "root": str(demo_checkpoints["tiny-v2"]), "max_model_len": 8192}
    assert engine.verified_facts["cache_config"]["block_size"] == "32"

    # Adopted twice: refused; restart: not ours.
    cli = manage("engine", "adopt", outside_engine.base_url, "--model-version", str(v2.pk), "--reference", env=subprocess_env())
    assert cli.returncode == 4 and "this server is already registered as a live engine (the same address and port)" in cli.stderr
    cli = manage("engine", "restart", str(engine.pk), env=subprocess_env())
    readopt = (
        f"manage.py engine adopt {outside_engine.base_url} --model-version {v2.pk} --namespace {engine.namespace_id} "
        "--name gpu-7 --kv-connector none"
    )
    assert (cli.returncode, cli.stderr) == (
        4,
        f"CommandError: engine gpu-7 was adopted: its process is not ours; stop it here (`manage.py engine stop {engine.pk}`), "
        f"restart it where it runs, then adopt it again: `{readopt}` (POST /api/engines/adopt/ with the same fields)\n",
    )

    # Drift: the same URL now answers differently (another checkpoint behind it).
    Engine.objects.filter(pk=engine.pk).update(verified_facts={**engine.verified_facts, "output": " before"})
    verified = manage("engine", "verify", str(engine.pk), env=subprocess_env())
    assert verified.returncode == 4 and "(1 of 27 checks failed): output: expected ' before', engine reports '" in verified.stderr
    engine.refresh_from_db()
    assert engine.verification == "drifted" and not engine.in_service
    assert EngineAlarm.objects.get(engine=engine, kind="verification_drift").detail.endswith(
        "Out of service until it verifies again."
    )

    # Nothing is sent to a drifted engine.
    with pytest.raises(JobRefused, match="is drifted: it does not compute what its identity says"):
        prewarm_job_create(namespace=engine.namespace, engine=engine, corpus="diagnostic", actor="alice")

    # A stopped adopted engine is only taken out of service: the process is not ours.
    engine_stop(engine=engine, actor="alice")
    assert outside_engine.alive()
    # What a refusal advises works as said: the command it names adopts the same row again, verified anew.
    refused = manage("engine", "verify", str(engine.pk), env=subprocess_env())
    assert (refused.returncode, refused.stderr) == (
        4,
        "CommandError: engine gpu-7 is stopped: only a ready engine can be verified; it was adopted: once it runs again "
        f"where it runs, adopt it again: `{readopt}` (POST /api/engines/adopt/ with the same fields)\n",
    )
    for status in ("stopped", "failed"):
        Engine.objects.filter(pk=engine.pk).update(status=status, error="health endpoint silent")
        generation = Engine.objects.get(pk=engine.pk).generation
        again = manage(*readopt.split()[1:], env=subprocess_env())
        assert again.returncode == 0, again.stderr
        row = Engine.objects.get(pk=engine.pk)
        assert (json.loads(again.stdout)["id"], row.status, row.verification, row.generation, row.error) == (
            engine.pk, "ready", "verified", generation + 1, "",
        )  # fmt: skip
        assert Engine.objects.filter(name__startswith="gpu-7").count() == 1
        assert AuditEvent.objects.filter(action="engine.readopt", object_id=str(engine.pk)).first().before == {
            "status": status, "url": outside_engine.base_url, "generation": generation,
        }  # fmt: skip
    assert EngineVerification.objects.filter(engine=engine, trigger="adopt").count() == 3
    # Under another version the name stays taken (said without whose), and nothing changes.
    engine_stop(engine=engine, actor="alice")
    with pytest.raises(InvalidField, match="^name: the name gpu-7 is taken$"):
        engine_adopt(url=outside_engine.base_url, model_version=v1, namespace=None, actor="alice", name="gpu-7")
    assert Engine.objects.get(pk=engine.pk).status == "stopped"
    # Unreachable: refused, nothing recorded.
    with pytest.raises(Exception, match="adoption refused: engine unreachable"):
        engine_adopt(url=f"http://127.0.0.1:{free_port()}", model_version=v2, namespace=None, actor="alice")
