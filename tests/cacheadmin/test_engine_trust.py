"""An engine is a thing, not a string: on a real vLLM engine, adoption refuses
the same server under another spelling of its address (``localhost`` for
``127.0.0.1``) and behind another address (a forwarder: what a Service or a
NAT puts in front of a pod), found by a probe through the live engine's prefix
cache; a namespace is refused on a tier that serves KV across salts, whatever
the length of the probe's prompt."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings

from cacheadmin.models import Engine, Tenant
from cacheadmin.services.fleet import _refuse_salt_blind_tier, engine_adopt
from cacheadmin.services.model_versions import model_version_register
from cacheadmin.services.namespaces import (
    DEMO_POLICY,
    namespace_get_or_create,
    namespace_salt_read,
    namespace_storage_path,
    retention_owner_get_or_create,
)
from inference.engines.launcher import EngineSpec, LocalEngine, free_port
from inference.engines.probes import mint_probe_salt, probe_prompt, reads_across_salts
from inference.engines.vllm_http import VllmHttpClient
from inference.errors import Refused
from inference.identity import LayoutOptions, fingerprint_checkpoint, namespace_key, storage_prefix
from tests.helpers import Forwarder

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.vllm, pytest.mark.slow]

LAYOUT = LayoutOptions(dtype="float32", kv_connector="ExampleConnector")
ACME_KEY = "c" * 32


@pytest.fixture(scope="module")
def salt_blind_engine(demo_checkpoints) -> Iterator[LocalEngine]:
    """tiny-v1 on acme's namespace with the ExampleConnector disk tier (keys KV by token ids alone)."""
    identity = fingerprint_checkpoint(demo_checkpoints["tiny-v1"], layout=LAYOUT).identity
    storage = settings.KV_STORE_ROOT / storage_prefix(namespace_key(identity, f"tenant:acme:{ACME_KEY}"))
    spec = EngineSpec(
        model_path=demo_checkpoints["tiny-v1"], served_name="tiny", dtype="float32", port=free_port(),
        prefix_caching=True, kv_storage_path=storage, log_path=settings.ENGINE_LOG_DIR / "test-trust.log",
    )  # fmt: skip
    engine = LocalEngine(spec)
    engine.start()
    engine.wait_ready(settings.ENGINE_START_TIMEOUT_S)
    yield engine
    engine.stop()


def _world(demo_checkpoints: dict[str, Any], engine: LocalEngine, origin: str = Engine.Origin.LOCAL) -> tuple[Any, Any, Engine]:
    version, _ = model_version_register(
        path=demo_checkpoints["tiny-v1"], label="tiny-v1", served_name="tiny", layout=LAYOUT, actor="alice"
    )
    tenant = Tenant.objects.get_or_create(slug="acme", defaults={"name": "Acme", "key": ACME_KEY})[0]
    owner = retention_owner_get_or_create(name="platform", email="p@example.com", actor="alice")
    namespace, _ = namespace_get_or_create(
        model_version=version, tenant=tenant, retention_owner=owner, policy=DEMO_POLICY, actor="alice"
    )
    assert namespace_storage_path(namespace) == engine.spec.kv_storage_path
    row = Engine.objects.create(
        name="v1-known", origin=origin, model_version=version, namespace=namespace, base_url=engine.base_url, pid=engine.pid,
        kv_connector="ExampleConnector", kv_storage_path=str(engine.spec.kv_storage_path), status=Engine.Status.READY,
        verification=Engine.Verification.VERIFIED,
    )  # fmt: skip
    return version, namespace, row


def test_the_same_engine_under_another_spelling_or_address_is_refused(demo_checkpoints, salt_blind_engine) -> None:
    # Known as an adopted engine: one a caller reaches without the control plane's key (the
    # engines it starts answer 401 to a keyless adoption, tests/cacheadmin/test_fleet.py).
    version, namespace, known = _world(demo_checkpoints, salt_blind_engine, origin=Engine.Origin.ADOPTED)
    port = salt_blind_engine.spec.port
    before = Engine.objects.count()
    # The example: the engine at 127.0.0.1 adopted again as localhost (and as IPv4-mapped IPv6).
    for spelling in (f"http://localhost:{port}", f"http://LOCALHOST:{port}/", f"http://[::ffff:127.0.0.1]:{port}"):
        with pytest.raises(Refused) as refused:
            engine_adopt(url=spelling, model_version=version, namespace=namespace, actor="mallory")
        assert str(refused.value) == (
            "adoption refused: this server is already registered as a live engine (the same address and port); "
            "stop that engine before adopting it again"
        ), spelling
    # Behind another address no spelling reveals: the probe through the live engine's prefix cache does.
    forwarder = Forwarder(port)
    try:
        with pytest.raises(Refused) as refused:
            engine_adopt(
                url=f"http://127.0.0.2:{forwarder.port}", model_version=version, namespace=namespace, actor="mallory",
                metrics_url=f"http://127.0.0.2:{forwarder.port}/metrics",
            )  # fmt: skip
        assert str(refused.value) == (
            "adoption refused: this server answered from a live engine's prefix cache: it is that engine under another "
            "address (or shares its KV tier); stop that engine before adopting it again"
        )
    finally:
        forwarder.close()
    assert Engine.objects.count() == before
    assert Engine.objects.get(pk=known.pk).status == Engine.Status.READY


def test_a_namespace_is_refused_on_a_tier_that_serves_kv_across_salts(demo_checkpoints, salt_blind_engine) -> None:
    version, namespace, known = _world(demo_checkpoints, salt_blind_engine)
    Engine.objects.filter(pk=known.pk).update(status=Engine.Status.STOPPED)  # only the tier is under test here
    # The engine says which connector it runs (/server_info): salt-blind, refused.
    with pytest.raises(Refused) as refused:
        engine_adopt(url=salt_blind_engine.base_url, model_version=version, namespace=namespace, actor="alice")
    assert str(refused.value) == (
        "adoption refused: ExampleConnector keys KV by token ids alone and ignores cache_salt; adopt it as a "
        "reference engine, or give the namespace a tier that honours the salt"
    )
    # A declaration that contradicts what the engine reports is refused too.
    with pytest.raises(Refused, match="kv_connector is declared none, the engine reports ExampleConnector"):
        engine_adopt(
            url=salt_blind_engine.base_url, model_version=version, namespace=namespace, actor="alice", kv_connector="none"
        )
    # Where the engine cannot say (no /server_info), the probe finds what the tier does: KV of one
    # salt served under another (what a tenant would use to confirm another tenant's prompts).
    with VllmHttpClient(salt_blind_engine.base_url, "tiny") as client:
        assert reads_across_salts(client, secret=settings.CACHE_SALT_SECRET, block_size=32) >= 3 * 32
    with pytest.raises(Refused, match=r"the engine served \d+ tokens of KV computed under another cache_salt"):
        _refuse_salt_blind_tier(salt_blind_engine.base_url, version)
    # Its own namespace's traffic still gets its cached prefix: the probes changed nothing of it.
    salt = namespace_salt_read(namespace, actor="test", purpose="trust test")
    with VllmHttpClient(salt_blind_engine.base_url, "tiny") as client:
        prompt = "Acme " + " ".join(f"word{i}" for i in range(120))
        client.prompt_cached_tokens(prompt, cache_salt=salt)
        assert client.prompt_cached_tokens(prompt, cache_salt=salt) >= 96
    assert Engine.objects.filter(origin="adopted").count() == 0


def _edge_prompt(client: VllmHttpClient, length: int) -> str:
    """A fresh prompt of exactly ``length`` tokens as the engine counts them (special tokens included)."""
    special = client.prompt_usage("x", cache_salt=None)[0] - len(client.tokenize("x"))  # type: ignore[operator]
    words = probe_prompt(32).split()
    while len(client.tokenize(" ".join(words))) + special > length - 4:
        words.pop()
    fillers = iter(("a", "the", "and", "of", "x", "to", "in") * 8)  # words of a token or two each
    while len(client.tokenize(" ".join(words))) + special != length:
        filler = next(fillers)
        words.append(filler)
        if len(client.tokenize(" ".join(words))) + special > length:
            words.pop()
    prompt = " ".join(words)
    assert len(client.tokenize(prompt)) + special == length
    return prompt


def test_the_salt_blind_tier_is_found_whatever_the_probe_prompts_length(salt_blind_engine) -> None:
    with VllmHttpClient(salt_blind_engine.base_url, "tiny") as client:
        # The example: 97 tokens, one past three blocks. ExampleConnector stores its KV under three
        # blocks' hash and looks it up under two: it serves that prompt to no salt, its own included.
        edge = _edge_prompt(client, 3 * 32 + 1)
        assert client.prompt_usage(edge, cache_salt=mint_probe_salt(settings.CACHE_SALT_SECRET)) == (97, 0)
        assert client.prompt_cached_tokens(edge, cache_salt=mint_probe_salt(settings.CACHE_SALT_SECRET)) == 0
        # The probe reads the engine's count and draws another prompt: the tier is found.
        drawn = iter([_edge_prompt(client, 4 * 32 + 1), _edge_prompt(client, 3 * 32 + 16)])
        assert reads_across_salts(client, secret=settings.CACHE_SALT_SECRET, block_size=32, prompts=drawn) == 3 * 32
        assert next(drawn, None) is None
