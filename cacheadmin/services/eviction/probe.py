"""Proof that an engine no longer serves a namespace's cached state: reset, then a probe prompt answering zero cached tokens."""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from cacheadmin.models import (
    CacheNamespace,
    Engine,
    JobStatus,
    PrewarmJob,
)
from cacheadmin.services.engines import engine_client
from cacheadmin.services.eviction.common import EvictionNotConfirmed
from cacheadmin.services.heat import corpus_load
from cacheadmin.services.kv_events import consumer_running, reset_observed
from cacheadmin.services.namespaces import namespace_salt_read
from cacheadmin.services.tiers import Tiers


def engine_probe(engine: Engine, ns: CacheNamespace, tiers: Tiers) -> dict[str, Any]:
    """Reset the engine's prefix cache, then ask for a prompt warmed before under
    the namespace's salt: it must come back with zero cached tokens, and an
    engine that publishes KV events must show the reset in its stream
    (``AllBlocksCleared``, which vLLM publishes with the probe's scheduler
    step, or the namespace's blocks removed) with none of the namespace's
    blocks left in any medium. ``AllBlocksCleared`` empties engine memory
    only: an offloading connector's CPU and storage tiers keep their blocks
    across the reset (vLLM 0.32 ``v1/core/block_pool.py`` ``reset_prefix_cache``;
    ``v1/kv_offload/tiering/manager.py`` ``reset_cache``), so blocks it left
    keep the purge unconfirmed until they are removed.

    The probe computes that prompt, so the engine caches it again, and an
    engine with a connector writes it to its persistent tier (measured with
    vLLM's ExampleConnector): when that tier is the namespace's own, the
    probe's writes are removed and the engine reset once more.

    Raises:
        EvictionNotConfirmed: the probe found cached tokens, the engine's
            KV-event stream did not show the reset (or no consumer reads it),
            or the reset left the namespace's blocks in an offloaded medium.
        EngineError: the engine did not answer.
    """
    job = PrewarmJob.objects.filter(namespace=ns, status=JobStatus.SUCCEEDED).order_by("-id").first()
    corpus_name = job.corpus if job else "diagnostic"
    index = job.results.filter(verified=True).order_by("index").values_list("index", flat=True).first() if job else None
    try:
        conversations = corpus_load(corpus_name, for_namespace=ns)
    except ValueError:  # a heat corpus whose reports were removed since
        corpus_name, conversations, index = "diagnostic", corpus_load("diagnostic"), 0
    conversation = conversations[index or 0]
    # The namespace's own salt even when superseded: this probe never leaves the control plane.
    salt = namespace_salt_read(ns, actor="eviction", purpose=f"eviction probe of engine {engine.name}", superseded_ok=True)
    removed = 0
    reset_at = timezone.now()
    with engine_client(engine) as client:
        client.reset_prefix_cache()
        result = client.chat(conversation.messages, cache_salt=salt, max_tokens=1, tools=conversation.tools)
        if engine.kv_connector and engine.namespace_id == ns.pk:
            removed = tiers.disk.delete_prefix(ns.storage_prefix)
            client.reset_prefix_cache()
    if result.cached_tokens:
        raise EvictionNotConfirmed(
            f"engine {engine.name} still served {result.cached_tokens} cached tokens of {conversation.id} after the reset"
        )
    stream = reset_observed(engine, ns, since=reset_at)
    if stream is None:
        why = "no KV-event consumer is running for it (start `manage.py kv_events`)" if not consumer_running(engine) else (
            "its KV-event stream showed no AllBlocksCleared and no removal of the namespace's blocks"
        )  # fmt: skip
        raise EvictionNotConfirmed(f"engine {engine.name}: the reset is not confirmed: {why}")
    if "kept" in stream:
        held = ", ".join(f"{blocks} in {medium}" for medium, blocks in sorted(stream["kept"].items()))
        raise EvictionNotConfirmed(
            f"engine {engine.name}: AllBlocksCleared emptied engine memory but left blocks of the namespace "
            f"offloaded ({held}); they go only with their own BlockRemoved"
        )
    return {
        "probe": conversation.id, "corpus": corpus_name, "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens, "probe_bytes_removed": removed, **stream,
    }  # fmt: skip
