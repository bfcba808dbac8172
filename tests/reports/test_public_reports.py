"""Faults reported in public trackers of LLM serving and caching projects,
rebuilt against this product's own surfaces: the state identity
(``fingerprint_checkpoint``), the gateway over HTTP with its response and
semantic caches, the KV-event consumer and the metrics folder of a process
group. Each test names the report it rebuilds and asserts what the product
must do instead."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from django.db import transaction
from django.utils import timezone
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from cacheadmin.metrics.multiproc import ENV, multiproc_reap
from cacheadmin.models import Engine, ShadowCheck
from cacheadmin.services.gateway import namespace_routing_resume
from cacheadmin.services.kv_events import KvEventConsumer
from cacheadmin.services.namespaces import namespace_salt_read
from cacheadmin.services.retirement import answer_retirement_run
from cacheadmin.services.shadow import _deceptive
from inference.child_env import die_with_parent
from inference.identity import fingerprint_checkpoint
from inference.kv_events import AllBlocksCleared, BlockStored
from tests.cacheadmin.conftest import engine_stream, world  # noqa: F401  (fixtures)
from tests.gateway.harness import call, chat, refresh

REASONING = ["The user asks for the capital of France. ", "It is Paris."]


class ScriptedEngine:
    """An OpenAI-compatible engine at the HTTP level answering as vLLM 0.32 does
    (``message.reasoning`` / ``delta.reasoning``, ``stop_reason``:
    ``vllm/entrypoints/openai/chat_completion/protocol.py``); ``finished=False``
    makes it end its answer without a ``finish_reason`` (a generation cut short)."""

    def __init__(self, *, finished: bool = True) -> None:
        self.finished = finished
        self.received: list[dict[str, Any]] = []

    async def __call__(self, request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        self.received.append(body)
        finish = "stop" if self.finished else None
        usage = {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52}
        if not body.get("stream"):
            message = {"role": "assistant", "content": "Paris.", "reasoning": "".join(REASONING), "tool_calls": []}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            answer = {"id": "c1", "object": "chat.completion", "created": 1, "model": body["model"],
                      "choices": [choice], **({"usage": usage} if self.finished else {})}  # fmt: skip
            return httpx2.Response(200, json=answer)

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
            event = {"id": "c1", "object": "chat.completion.chunk", "model": body["model"],
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}  # fmt: skip
            return b"data: " + json.dumps(event).encode() + b"\n\n"

        chunks = [chunk({"role": "assistant", "content": ""})]
        chunks += [chunk({"reasoning": part}) for part in REASONING]
        chunks.append(chunk({"content": "Paris."}))
        if self.finished:
            chunks.append(chunk({}, "stop"))
            if (body.get("stream_options") or {}).get("include_usage"):
                event = {"id": "c1", "object": "chat.completion.chunk", "model": body["model"], "choices": [], "usage": usage}
                chunks.append(b"data: " + json.dumps(event).encode() + b"\n\n")
        chunks.append(b"data: [DONE]\n\n")

        async def stream():  # type: ignore[no-untyped-def]
            for c in chunks:
                yield c

        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=stream())


def _use(setup: dict[str, Any], engine: ScriptedEngine) -> None:
    setup["gateway"].proxy.transport = httpx2.MockTransport(engine)


def _deltas(response: httpx.Response, field: str) -> str:
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    return "".join((e["choices"][0]["delta"].get(field) or "") for e in events if e.get("choices"))


def _concurrently(
    setup: dict[str, Any], bodies: list[dict[str, Any]], *, headers: dict[str, str] | None = None
) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=setup["gateway"].app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            h = {"authorization": f"Bearer {setup['key']}", **(headers or {})}
            return await asyncio.gather(*[client.post("/v1/chat/completions", json=b, headers=h) for b in bodies])

    return asyncio.run(go())


# --- Kind 1: a file the engine reads must be in the state identity ------------------------------


def test_vllm_15281_generation_config_defaults_are_part_of_the_identity(checkpoint_copy) -> None:
    """https://github.com/vllm-project/vllm/pull/15281 (after PR #12622): vLLM loads a
    checkpoint's ``generation_config.json`` by default and its values silently become the
    default sampling parameters (``repetition_penalty 1.05, temperature 0.1…``): the same
    request gets another answer when only that file changes. The product must give the
    checkpoint another state identity when the engine's generation defaults change, so
    nothing computed under the old defaults is reused."""
    path = checkpoint_copy()
    before = fingerprint_checkpoint(path)
    (path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.3, "temperature": 0.1, "top_k": 1}))
    after = fingerprint_checkpoint(path)
    assert after.identity != before.identity


# --- Kind 2: derived config values written out must not move the identity -----------------------


#: Qwen2 as tiny-v1's shape: vLLM 0.32's ``Qwen2Attention`` always derives ``hidden_size //
#: num_heads`` (``vllm/model_executor/models/qwen2.py``), transformers' ``Qwen2Config`` has no head_dim.
QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False}


@pytest.mark.parametrize(
    ("model", "written"), [("mistral", 64), ("mistral", None), ("qwen2", 64)],
    ids=["mistral-head_dim-written-out", "mistral-head_dim-null", "qwen2-head_dim-written-out"],
)  # fmt: skip
def test_vllm_2622_head_dim_written_out_or_null_keeps_the_identity(checkpoint_copy, model, written) -> None:
    """https://github.com/vllm-project/vllm/pull/2622 (and HabanaAI/vllm-fork#1294): the engine
    reads ``head_dim`` from the config when present and otherwise derives
    ``hidden_size // num_attention_heads``; an explicit ``null`` is the derived value too.
    tiny-v1 (hidden 256, 4 heads) computes with head_dim 64 either way, as a Mistral and as a
    Qwen2 model, so a config that writes it out, writes null or leaves it out must have one
    state identity."""
    path = checkpoint_copy()
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    without = {k: v for k, v in config.items() if k != "head_dim"} | (QWEN2 if model == "qwen2" else {})
    (path / "config.json").write_text(json.dumps(without))
    derived = fingerprint_checkpoint(path)
    (path / "config.json").write_text(json.dumps({**without, "head_dim": written}))
    explicit = fingerprint_checkpoint(path)
    assert (explicit.config, explicit.identity) == (derived.config, derived.identity)


# --- Kind 3: a replayed answer must carry every field the engine returned ----------------------


@pytest.mark.django_db(transaction=True)
def test_litellm_32068_reasoning_survives_a_streamed_cache_hit(setup) -> None:
    """https://github.com/BerriAI/litellm/issues/32068: with response caching on, a reasoning
    model's streamed miss delivered ``reasoning_content`` deltas, the cache entry held it, and
    every streamed cache hit came back without it. Here the engine streams vLLM 0.32's
    ``delta.reasoning``; a streamed hit must replay the same reasoning and content, and a
    whole hit the same choice, ``reasoning`` and ``stop_reason`` included."""
    engine = ScriptedEngine()
    _use(setup, engine)
    first = call(setup, chat(temperature=0, stream=True))
    assert (first.status_code, first.headers["x-kvcp-served-by"]) == (200, "engine"), first.text
    assert (_deltas(first, "reasoning"), _deltas(first, "content")) == ("".join(REASONING), "Paris.")
    again = call(setup, chat(temperature=0, stream=True))
    assert again.headers["x-kvcp-served-by"] == "response"
    assert (_deltas(again, "reasoning"), _deltas(again, "content")) == ("".join(REASONING), "Paris.")
    whole = call(setup, chat(temperature=0))
    assert whole.headers["x-kvcp-served-by"] == "response"
    assert whole.json()["choices"][0]["message"]["reasoning"] == "".join(REASONING)
    assert whole.json()["choices"][0]["stop_reason"] is None and whole.json()["choices"][0]["finish_reason"] == "stop"
    assert len(engine.received) == 1


# --- Kind 4: an unfinished answer must never be cached ------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_gonka_1722_a_stream_ending_done_without_finish_reason_is_not_replayed(setup) -> None:
    """https://github.com/gonka-ai/gonka/issues/1722: a streamed answer that ended with
    ``data: [DONE]`` but no ``finish_reason`` (generation cut short) was stored in the
    response cache and replayed to every identical request for an hour. An answer whose
    choice never finished must not be stored: the identical request goes to the engine again."""
    engine = ScriptedEngine(finished=False)
    _use(setup, engine)
    first = call(setup, chat(temperature=0, stream=True))
    assert first.status_code == 200
    again = call(setup, chat(temperature=0, stream=True))
    assert again.headers["x-kvcp-served-by"] == "engine"
    assert len(engine.received) == 2


# --- Kind 5: a detected bad answer must not be served from a cache ------------------------------


@pytest.mark.django_db(transaction=True)
def test_kache_335_answers_of_a_namespace_caught_serving_deceptive_hits_are_not_served_again(setup) -> None:
    """https://github.com/kunobi-ninja/kache/issues/335: a cache hit that byte-verifies can
    still be a false hit; once a check finds a hit diverging from a fresh computation, the
    divergent entries must be evicted, not kept. Here shadow verification confirms a deceptive
    hit of the engine that computed the cached answer (a verified reference as witness): the
    namespace is suspended (503), and once an operator resumes it the answer that engine
    cached is gone (the engine answers again)."""
    assert call(setup, chat(temperature=0)).headers["x-kvcp-served-by"] == "engine"
    assert call(setup, chat(temperature=0)).headers["x-kvcp-served-by"] == "response"
    engine = setup["engine"]
    reference = Engine.objects.create(
        name="ref", role="reference", model_version=engine.model_version, base_url="http://127.0.0.1:4", status="ready",
        prefix_caching=False, verification="verified", verified_at=timezone.now(),
    )  # fmt: skip
    check = ShadowCheck.objects.create(namespace=setup["ns"], engine=engine, request={}, status="pending")
    with transaction.atomic():
        retirement = _deceptive(check, engine, reference, 0)
    assert retirement is not None
    answer_retirement_run(retirement=retirement, actor="shadow-verification")
    refresh(setup)
    held = call(setup, chat(temperature=0))
    assert (held.status_code, held.json()["error"]["code"]) == (503, "namespace_suspended")
    namespace_routing_resume(namespace=setup["ns"], actor="alice", reason="engine replaced")
    refresh(setup)
    after = call(setup, chat(temperature=0))
    assert (after.status_code, after.headers["x-kvcp-served-by"]) == (200, "engine")
    assert len(setup["fake"].received) == 2


# --- Kind 6: the semantic cache must not answer the opposite question ---------------------------


def _asked(content: str) -> dict[str, Any]:
    return chat(content, temperature=0, max_tokens=16)


@pytest.mark.django_db(transaction=True)
def test_semantic_router_2691_turn_off_is_not_answered_with_turn_on(semantic_setup) -> None:
    """https://github.com/vllm-project/semantic-router/issues/2691: bi-encoder cosine put
    "How to turn on dark mode?" and "How to turn off dark mode?" above the hit threshold, so
    the cache served how to enable a feature to a user asking how to disable it. The
    opposite question must reach the engine."""
    s = semantic_setup
    assert call(s, _asked("How do I turn on dark mode?")).headers["x-kvcp-served-by"] == "engine"
    opposite = call(s, _asked("How do I turn off dark mode?"))
    assert opposite.headers["x-kvcp-served-by"] == "engine"
    assert len(s["fake"].received) == 2


@pytest.mark.django_db(transaction=True)
def test_gptcache_694_a_reversed_comparison_is_not_answered_from_the_cache(semantic_setup) -> None:
    """https://github.com/zilliztech/GPTCache/issues/694: a query and its exact reversal keep
    almost every token and clear the 0.8 similarity threshold, so the cache served the answer
    to the opposite question. "Is a kilogram heavier than a pound?" and its reversal must
    each reach the engine."""
    s = semantic_setup
    assert call(s, _asked("Is a kilogram heavier than a pound?")).headers["x-kvcp-served-by"] == "engine"
    reversed_ = call(s, _asked("Is a pound heavier than a kilogram?"))
    assert reversed_.headers["x-kvcp-served-by"] == "engine"
    assert len(s["fake"].received) == 2


# --- Kind 7: concurrent identical requests must make one engine call ----------------------------


@pytest.mark.django_db(transaction=True)
def test_wuphf_823_concurrent_identical_requests_make_one_engine_call_in_each_cache_layer(semantic_setup) -> None:
    """https://github.com/nex-crm/wuphf/issues/823: the dedupe cache returned only completed
    entries, so identical requests arriving while the first call was in flight all missed,
    all called the provider and all were charged. Ten identical greedy requests at once,
    five streamed and five whole (one response-cache key), must make one engine call; six
    identical tagged requests at once (tagged answers skip the response cache, the semantic
    cache keeps them) must make one more, since the seventh, sent after them, is a semantic hit."""
    s = semantic_setup
    s["fake"].delay_s = 0.3
    answers = _concurrently(s, [chat(temperature=0, stream=True)] * 5 + [chat(temperature=0)] * 5)
    assert [a.status_code for a in answers] == [200] * 10
    assert len(s["fake"].received) == 1
    assert [_deltas(a, "content") for a in answers[:5]] == ["Paris is the capital."] * 5
    assert {a.json()["choices"][0]["message"]["content"] for a in answers[5:]} == {"Paris is the capital."}
    tagged = {"x-cache-tags": "topic:password"}
    asked = _asked("How do I reset my password?")
    answers = _concurrently(s, [asked] * 6, headers=tagged)
    assert [a.status_code for a in answers] == [200] * 6
    assert call(s, asked, headers=tagged).headers["x-kvcp-served-by"] == "semantic"
    assert len(s["fake"].received) == 2


# --- Kind 8: a reset of one medium must leave the other's blocks accounted ----------------------


def _stored(hashes: list[int], salt: str, medium: str) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=[1] * 32 * len(hashes), block_size=32, lora_id=None,
        medium=medium, lora_name=None, extra_keys=[(salt,)] + [None] * (len(hashes) - 1),
    )  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_vllm_57727_a_prefix_cache_reset_leaves_the_cpu_offload_tier_resident(world, engine_stream) -> None:  # noqa: F811
    """https://github.com/vllm-project/vllm/issues/57727: ``POST /reset_prefix_cache`` cleared
    the GPU prefix cache but left the CPU offload tier populated; the next request was served
    from that tier. The consumer of the engine's KV events must therefore keep the CPU
    blocks a namespace holds after an ``AllBlocksCleared`` and drop only the GPU ones."""
    engine, publisher = engine_stream
    salt = namespace_salt_read(world["ns"]["acme"], actor="test", purpose="reset per medium")
    consumer = KvEventConsumer()
    consumer.refresh()
    stream = consumer.streams[engine.pk]
    acme = world["ns"]["acme"].pk
    consumer.handle(stream, publisher.frames(_stored([1, 2], salt, "GPU")))
    consumer.handle(stream, publisher.frames(_stored([1, 2], salt, "CPU")))
    assert stream.residency.totals() == {("GPU", acme): (2, 64), ("CPU", acme): (2, 64)}
    consumer.handle(stream, publisher.frames(AllBlocksCleared()))
    try:
        assert stream.residency.totals() == {("CPU", acme): (2, 64)}
    finally:
        consumer.ctx.destroy(linger=0)


# --- Kind 9: one process group must not delete another's files ----------------------------------

WRITER = """
import sys, time
from prometheus_client import Counter
Counter("kvcp_report_requests", "requests").inc(7)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_prometheus_client_1167_a_second_group_starting_keeps_a_running_groups_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """https://github.com/prometheus/client_python/pull/1167 (issue #931): the advice is to
    wipe ``PROMETHEUS_MULTIPROC_DIR`` before a group starts; where two groups share the
    folder, the second one's start deletes the files of the first one's live processes and
    their counters drop to nothing. A running process's files must survive another group's
    start (a group's start reaps the folder: ``multiproc_reap(..., every_type=True)``) and still count."""
    folder = tmp_path / "metrics"
    folder.mkdir()
    monkeypatch.setenv(ENV, str(folder))  # restored after the test: multiproc_use sets it
    running = subprocess.Popen(
        [sys.executable, "-c", WRITER],
        env={**os.environ, ENV: str(folder)},
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_parent,
    )
    try:
        assert running.stdout is not None and running.stdout.readline().strip() == "ready"
        assert (folder / f"counter_{running.pid}.db").is_file()
        multiproc_reap(folder, every_type=True)
        assert (folder / f"counter_{running.pid}.db").is_file()
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(folder))
        assert registry.get_sample_value("kvcp_report_requests_total") == 7.0
    finally:
        running.kill()
        running.wait(timeout=10)
