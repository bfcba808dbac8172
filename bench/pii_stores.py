"""The personal data every store holds after the labelled corpus ran through a real gateway.

Each corpus string is sent through the gateway app (in-process, real routing
snapshot from a fresh SQLite database, the deployment's SQLite response and
semantic stores, the real embedder) as a user message, greedy twice (so the
second reports cached tokens and would be sampled for shadow verification at
rate 1.0) and sampled twice (the semantic layer's turn), to an engine emulated
at the HTTP level that echoes the message in its answer (the worst case: every
answer holds the request's personal data too). Then the gateway's figures and
heat are flushed into the database and its shadow samples recorded as the
deployment records them.

Every store is then read whole: every text and blob column of every table of
the control plane's database and of every SQLite file under the gateway's
folder, and everything the gateway and control plane logged. Each labelled
span of the corpus (its text as written and in NFKC form) is searched in each
store; the count of spans found must be 0.

Used by ``bench/pii.py`` (``--stores``); Django is set up here on a temporary
``VAR_DIR`` so nothing of the run stays.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import sqlite3
import sys
import tempfile
import time
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _setup_django(var_dir: Path) -> None:
    os.environ["VAR_DIR"] = str(var_dir)
    os.environ.pop("DATABASE_URL", None)
    os.environ.pop("GATEWAY_REDIS_URL", None)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _echo_engine() -> Any:
    import httpx2

    seen: set[str] = set()

    async def handler(request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        text = body["messages"][-1]["content"]
        cached = 32 if text in seen else 0
        seen.add(text)
        answer = f"Noted: {text}"
        usage = {"prompt_tokens": 64, "completion_tokens": 8, "total_tokens": 72,
                 "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
        if not body.get("stream"):  # the gateway asks a non-streamed request's answer whole
            message = {"role": "assistant", "content": answer}
            return httpx2.Response(200, json={"id": "c", "object": "chat.completion", "model": body["model"],
                                              "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                                              "usage": usage})  # fmt: skip
        chunks = [
            {"id": "c", "object": "chat.completion.chunk", "model": body["model"],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": answer}, "finish_reason": None}]},
            {"id": "c", "object": "chat.completion.chunk", "model": body["model"],
             "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {"id": "c", "object": "chat.completion.chunk", "model": body["model"], "choices": [],
             "usage": usage},
        ]  # fmt: skip

        async def stream():  # type: ignore[no-untyped-def]
            for chunk in chunks:
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=stream())

    return httpx2.MockTransport(handler)


def _texts_of_sqlite(path: Path) -> Iterable[str]:
    with sqlite3.connect(path) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            for row in db.execute(f'SELECT * FROM "{table}"'):  # noqa: S608 - names read from the file itself
                for value in row:
                    if isinstance(value, str):
                        yield value
                    elif isinstance(value, bytes):
                        yield value.decode("utf-8", "ignore")


def run(texts: Sequence[tuple[str, Sequence[str]]], *, policy: str = "skip") -> dict[str, Any]:
    """Send each ``(text, labelled span texts)`` through a gateway; count the spans found in each store.

    Returns:
        ``{"policy", "requests", "seconds", "stores": {store: spans found}, "found": [(store, span)...] (first 20)}``.
    """
    var_dir = Path(tempfile.mkdtemp(prefix="kvcp-pii-stores-"))
    _setup_django(var_dir)
    import httpx
    from django.conf import settings

    from cacheadmin.models import CacheNamespace, Engine, ModelVersion, RetentionOwner, Tenant
    from cacheadmin.services.gateway import (
        gateway_flush,
        gateway_key_issue,
        routing_snapshot_build,
        tenant_gateway_policy_update,
    )
    from cacheadmin.services.gateway_stores import response_store, semantic_store
    from cacheadmin.services.shadow import shadow_check_enqueue
    from gateway.layers.semantic.embedder import default_embedder
    from gateway.layers.semantic.layer import SemanticLayer
    from gateway.records import Recorder
    from gateway.server import Gateway, Limits, Runtime

    logs = io.StringIO()
    handler = logging.StreamHandler(logs)
    for name in ("gateway", "cacheadmin", "inference"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.DEBUG)
    acme = Tenant.objects.create(slug="acme", name="Acme")
    owner = RetentionOwner.objects.create(name="platform", email="owner@platform.invalid")
    version = ModelVersion.objects.create(
        label="v1", served_name="tiny", path="/m", weights="a" * 64, tokenizer="b" * 64, config="c" * 64, layout="d" * 64,
        adapters="e" * 64, identity="1" * 64, inputs={"layout": {"block_size": 32}}, status="active",
    )  # fmt: skip
    namespace = CacheNamespace.objects.create(
        namespace_key="a" * 64, model_version=version, tenant=acme, retention_owner=owner, storage_prefix="ns-acme"
    )
    Engine.objects.create(
        name="e1", model_version=version, namespace=namespace, base_url="http://127.0.0.1:18001", status="ready",
        verification="verified",
    )  # fmt: skip
    tenant_gateway_policy_update(tenant=acme, actor="bench", changes={"shadow_sample_rate": 1.0, "personal_data": policy})
    _, key = gateway_key_issue(tenant=acme, name="bench", actor="bench")
    recorder, samples = Recorder(), []
    runtime = Runtime(
        snapshot=routing_snapshot_build, response_store=response_store(),
        semantic=SemanticLayer(semantic_store(), default_embedder()), recorder=recorder, shadow=samples.append,
        transport=_echo_engine(), limits=Limits(rate_per_s=100_000, burst=100_000),
    )  # fmt: skip
    snapshot = routing_snapshot_build()
    runtime.snapshot = lambda: snapshot  # type: ignore[method-assign]
    gateway = Gateway(runtime)

    async def send_all() -> int:
        sent = 0
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app), base_url="http://gw") as client:
            for text, _ in texts:
                for temperature in (0, 0, 0.7, 0.7):
                    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "temperature": temperature}
                    answer = await client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
                    if answer.status_code != 200:
                        raise RuntimeError(f"the gateway answered {answer.status_code}: {answer.text[:200]}")
                    sent += 1
        return sent

    started = time.perf_counter()
    sent = asyncio.run(send_all())
    rows, heat = recorder.drain()
    gateway_flush(rows, heat, recorder.templates.drain())
    for sample in samples:
        shadow_check_enqueue(
            namespace_pk=sample.namespace_pk, engine_id=sample.engine_id, endpoint=sample.endpoint, body=sample.body,
            cached_tokens=sample.cached_tokens,
        )  # fmt: skip
    seconds = time.perf_counter() - started
    from django.db import connection

    connection.close()
    stores = {
        "database": list(_texts_of_sqlite(Path(settings.DATABASES["default"]["NAME"]))),
        "gateway stores": [t for f in sorted(settings.GATEWAY_DIR.glob("*.sqlite3")) for t in _texts_of_sqlite(f)],
        "logs": [logs.getvalue()],
    }
    found: list[tuple[str, str]] = []
    for store, values in stores.items():
        blob = "\n".join(values)
        for _, spans in texts:
            for span in spans:
                if span in blob or unicodedata.normalize("NFKC", span) in blob:
                    found.append((store, span))
    counts = {store: sum(1 for s, _ in found if s == store) for store in stores}
    return {"policy": policy, "requests": sent, "seconds": round(seconds, 1), "stores": counts, "found": found[:20]}


def main() -> int:
    """``python bench/pii_stores.py [--policy skip|redact]``: one JSON line of :func:`run` over the corpus."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--policy", choices=["skip", "redact"], default="skip")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    corpus = ROOT / "gateway" / "pii" / "data" / "corpus.jsonl"
    entries = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = [(e["text"], [s["text"] for s in e["spans"]]) for e in entries]
    print(json.dumps(run(texts, policy=args.policy)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
