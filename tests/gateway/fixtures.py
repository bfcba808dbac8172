"""Fixtures that run the gateway against the database: a pytest plugin of
tests/conftest.py, so the gateway's tests and the control plane's reach them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx2
import pytest

from cacheadmin.models import CacheNamespace, Engine, RetentionOwner, Tenant
from cacheadmin.services.gateway import gateway_key_issue, routing_snapshot_build
from cacheadmin.services.gateway_stores import response_store as deployment_response_store
from cacheadmin.services.gateway_stores import semantic_store as deployment_semantic_store
from gateway.layers import build_layers
from gateway.layers.semantic.embedder import default_embedder
from gateway.layers.semantic.layer import SemanticLayer
from gateway.pipeline import Pipeline
from gateway.records import Recorder
from gateway.server import Gateway, Limits, Runtime
from tests.cacheadmin.conftest import make_version
from tests.gateway.harness import FakeEngine


@pytest.fixture
def setup(tmp_path: Path) -> dict[str, Any]:
    acme = Tenant.objects.create(slug="acme", name="Acme")
    globex = Tenant.objects.create(slug="globex", name="Globex")
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    v1 = make_version("v1", "1" * 64)
    v1.status = "active"
    v1.save()
    ns = CacheNamespace.objects.create(
        namespace_key="a" * 64, model_version=v1, tenant=acme, retention_owner=owner, storage_prefix="ns-acme"
    )
    engine = Engine.objects.create(
        name="e1", model_version=v1, namespace=ns, base_url="http://127.0.0.1:18001", status="ready", verification="verified"
    )
    _, key = gateway_key_issue(tenant=acme, name="app", actor="test")
    _, globex_key = gateway_key_issue(tenant=globex, name="other", actor="test")
    fake = FakeEngine()
    store = deployment_response_store()
    for prefix in ("ns-acme", "ns-acme-v2"):  # the scale-out store is shared by the run's tests
        store.delete_prefix(prefix)
    holder = {"snap": routing_snapshot_build()}
    runtime = Runtime(
        snapshot=lambda: holder["snap"], response_store=store, semantic=None, recorder=Recorder(),
        transport=httpx2.MockTransport(fake), limits=Limits(rate_per_s=1000, burst=1000),
    )  # fmt: skip
    gateway = Gateway(runtime)
    return {"acme": acme, "ns": ns, "engine": engine, "key": key, "globex_key": globex_key, "fake": fake, "store": store,
            "holder": holder, "gateway": gateway, "runtime": runtime, "v1": v1}  # fmt: skip


@pytest.fixture
def semantic_setup(setup: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """The same gateway with the semantic layer: the real embedding model and the deployment's entry store
    (SQLite in the embedded default, Redis in scale-out)."""

    store = deployment_semantic_store()
    store.delete_prefix("ns-acme")
    setup["runtime"].semantic = SemanticLayer(store, default_embedder())
    setup["runtime"].semantic.load()  # as the gateway does at its start: no request waits for the model's load
    rebuild_layers(setup)
    setup["semantic_store"] = store
    return setup


def rebuild_layers(setup: dict[str, Any]) -> None:
    """Build the gateway's layers again from its runtime, after a test changed the runtime's stores."""
    runtime = setup["runtime"]
    layers = runtime.layers if runtime.layers is not None else build_layers(runtime)
    setup["gateway"].pipeline = Pipeline(layers, runtime.recorder)
