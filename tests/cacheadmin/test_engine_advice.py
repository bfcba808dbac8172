"""Every refusal about an adopted engine names the command that brings it back, for each way
it can be asked (restart, attach, start from its page, verify): adopting again under its name
re-adopts it (tests/cacheadmin/test_fleet.py runs that command on a real engine), and an
engine of an InferencePool comes back through its pool's sync. Nothing changes on a refusal."""

from __future__ import annotations

from typing import Any

import pytest

from cacheadmin.models import AuditEvent, Engine, InferencePool
from cacheadmin.services.engine_verification import engine_readopt_advice, verify_refusal
from cacheadmin.services.engines import EngineRefused, engine_attach_namespace, engine_restart

pytestmark = pytest.mark.django_db


def _adopted(world: dict[str, Any], status: str, **fields: Any) -> Engine:
    Engine.objects.filter(pk=world["engine"].pk).update(origin="adopted", status=status, **fields)
    return Engine.objects.get(pk=world["engine"].pk)


def test_a_stopped_adopted_engine_is_brought_back_by_adopting_it_under_its_name(world: dict[str, Any]) -> None:
    engine = _adopted(world, "failed", kv_connector="OffloadingConnector")
    command = (
        f"manage.py engine adopt http://127.0.0.1:1 --model-version {world['v1'].pk} --namespace {world['ns']['acme'].pk} "
        "--name e-acme --kv-connector OffloadingConnector"
    )
    advice = f"once it runs again where it runs, adopt it again: `{command}` (POST /api/engines/adopt/ with the same fields)"
    assert engine_readopt_advice(engine) == advice
    before = (AuditEvent.objects.count(), list(Engine.objects.values_list("status", "generation")))
    with pytest.raises(EngineRefused) as restart:
        engine_restart(engine=engine, actor="alice")
    assert str(restart.value) == f"engine e-acme was adopted: its process is not ours; {advice}"
    with pytest.raises(EngineRefused) as attach:
        engine_attach_namespace(engine=engine, namespace=world["ns"]["globex"], actor="alice")
    assert str(attach.value) == f"engine e-acme is failed; it serves another namespace once it is ready: {advice}"
    assert verify_refusal(engine) == f"engine e-acme is failed: only a ready engine can be verified; it was adopted: {advice}"
    assert (AuditEvent.objects.count(), list(Engine.objects.values_list("status", "generation"))) == before


def test_a_live_adopted_engine_is_stopped_here_first_and_a_reference_one_adopted_as_such(world: dict[str, Any]) -> None:
    engine = _adopted(world, "ready", namespace=None, role="reference")
    assert engine_readopt_advice(engine) == (
        f"stop it here (`manage.py engine stop {engine.pk}`), restart it where it runs, then adopt it again: "
        f"`manage.py engine adopt http://127.0.0.1:1 --model-version {world['v1'].pk} --reference --name e-acme` "
        "(POST /api/engines/adopt/ with the same fields)"
    )


def test_an_engine_of_an_inference_pool_comes_back_through_the_pools_sync(world: dict[str, Any]) -> None:
    pool = InferencePool.objects.create(
        k8s_namespace="serving", name="tiny", model_version=world["v1"], namespace=world["ns"]["acme"], created_by="alice"
    )
    engine = _adopted(world, "stopped", inference_pool=pool)
    assert engine_readopt_advice(engine) == (
        "its InferencePool's sync adopts its pod again once the pod is Ready "
        f"(`manage.py engine pool-sync {pool.pk}`; the schedule runs it every minute)"
    )
