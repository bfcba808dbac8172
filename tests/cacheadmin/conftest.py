"""Fixtures of the control-plane tests: a small world of tenants, namespaces,
an engine, a job and API clients by persona.

Personas: alice holds an admin token; bob an operate token bound to tenant
acme; charlie a read token bound to tenant globex; anonymous holds nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from cacheadmin.models import CacheNamespace, Engine, ModelVersion, PrewarmJob, RetentionOwner, Tenant
from cacheadmin.services.api_tokens import api_token_issue
from cacheadmin.services.model_versions import model_version_register
from cacheadmin.services.namespaces import DEMO_POLICY, namespace_get_or_create
from inference.identity import LayoutOptions
from inference.kv_transport import local_endpoints, private_socket_dir
from tests.kv_publisher import EnginePublisher


def make_version(label: str, identity: str, weights: str = "a" * 64) -> ModelVersion:
    """A model version row with made-up digests (for tests about rows, not hashing)."""
    return ModelVersion.objects.create(
        label=label, served_name="tiny", path="/m", weights=weights, tokenizer="b" * 64, config="c" * 64, layout="d" * 64,
        adapters="e" * 64, identity=identity, inputs={"weights": {"model.safetensors": weights}, "layout": {"block_size": 32}},
    )  # fmt: skip


def token_client(tenant: Tenant | None, scope: str, name: str) -> APIClient:
    """An API client holding a new ``scope`` token of a new user ``name``, bound to ``tenant`` (None: unbound)."""
    user = User.objects.create_user(name)
    _token, key = api_token_issue(user=user, name=f"{name}-ci", scope=scope, tenant=tenant, actor="setup")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


@pytest.fixture
def world() -> dict:
    """Tenants acme and globex with a namespace each, an engine and a job of acme's, and persona clients."""
    acme = Tenant.objects.create(slug="acme", name="Acme")
    globex = Tenant.objects.create(slug="globex", name="Globex")
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    v1, v2 = make_version("v1", "1" * 64), make_version("v2", "2" * 64, weights="f" * 64)
    ns = {
        t.slug: CacheNamespace.objects.create(
            namespace_key=t.slug.ljust(64, "0"), model_version=v1, tenant=t, retention_owner=owner, storage_prefix=f"ns-{t.slug}"
        )
        for t in (acme, globex)
    }
    engine = Engine.objects.create(
        name="e-acme", model_version=v1, namespace=ns["acme"], base_url="http://127.0.0.1:1", status="ready"
    )
    job = PrewarmJob.objects.create(namespace=ns["acme"], engine=engine, status="queued", progress_total=18)
    clients = {}
    for name, scope, tenant in (("alice", "admin", None), ("bob", "operate", acme), ("charlie", "read", globex)):
        user = User.objects.create_user(name)
        token, key = api_token_issue(user=user, name=f"{name}-ci", scope=scope, tenant=tenant, actor="setup")
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
        clients[name] = client
    clients["anonymous"] = APIClient()
    return {"clients": clients, "acme": acme, "globex": globex, "v1": v1, "v2": v2, "ns": ns, "engine": engine, "job": job}


@pytest.fixture
def engine_stream(world: dict) -> Iterator[tuple[Engine, EnginePublisher]]:
    """world's engine publishing KV events as a local engine does: its PUB and
    replay sockets bound as ``ipc://`` paths in the private socket directory,
    topic ``kvcp.engine-x.1``."""
    engine = world["engine"]
    pub, replay = local_endpoints(private_socket_dir(settings.KV_EVENTS_SOCKET_DIR), engine.pk)
    Engine.objects.filter(pk=engine.pk).update(
        kv_events_endpoint=pub, kv_events_replay_endpoint=replay, kv_events_topic="kvcp.engine-x.1", generation=1
    )
    engine.refresh_from_db()
    publisher = EnginePublisher(pub, replay, b"kvcp.engine-x.1")
    try:
        yield engine, publisher
    finally:
        publisher.close()


@pytest.fixture
def real_version(world: dict, demo_checkpoints: dict) -> tuple[ModelVersion, CacheNamespace]:
    """tiny-v1 registered with its real identity (ExampleConnector layout), and acme's namespace of it."""
    version, _ = model_version_register(
        path=demo_checkpoints["tiny-v1"], label="tiny-v1", served_name="tiny",
        layout=LayoutOptions(dtype="float32", kv_connector="ExampleConnector"), actor="alice",
    )  # fmt: skip
    namespace, _ = namespace_get_or_create(
        model_version=version, tenant=world["acme"], retention_owner=world["ns"]["acme"].retention_owner,
        policy=DEMO_POLICY, actor="alice",
    )  # fmt: skip
    return version, namespace
