"""Precise prefix routing against prefix affinity and round robin, through the gateway, on two real vLLM engines.

Starts two vLLM engines on CPU from the same demo checkpoint (``tiny-v1``,
built into a temporary folder, with ``VAR_DIR`` and ``MODEL_ROOTS`` pointed
there too; prefix caching on with the default ``sha256`` block hashes, no KV
connector, each with its own 1 GiB KV cache unless ``--kv-blocks`` caps it,
each computing on its own CPU core unless ``--shared-core``, each publishing
its KV events) and builds a :class:`gateway.routing.RoutingSnapshot` by hand:
one tenant, one key, one namespace (a random 64-hex-character ``cache_salt``,
``tokenizer_path`` the checkpoint folder) served by both engines (engine ids 1
and 2, ``block_size`` 32, ``hash_algorithm`` ``"sha256"``). The same traffic
then goes through an in-process :class:`gateway.server.Gateway`
(``httpx.ASGITransport``; response cache and semantic layer off:
``response_store=None``, ``semantic=None``) in phases under three values of
``Runtime.engine_choice``, the order rotated every round (round 1: precise,
affinity, round robin; round 2: affinity, round robin, precise; ...):

- ``"precise"``: :class:`gateway.prefix.router.PrefixRouter` over a
  :class:`gateway.prefix.index.BlockIndex` fed by the engines' own KV events
  (see *KV events* below): the engine holding the longest run of the
  request's leading blocks, against its load (cost = blocks to compute +
  ``--load-weight`` (0.25, the gateway's default) x requests in flight x the
  request's blocks), each request's blocks marked held by its engine for
  ``--speculative-ttl`` (5 s, the default) until its events arrive; the
  approximate choice when the index cannot be used (the ``x-kvcp-routing``
  header says why);
- ``"affinity"``: today's approximate choice (rendezvous hashing of the
  prompt's leading 512 characters, load-aware fallback:
  ``gateway.routing.choose_engine``);
- ``"round_robin"``.

Before every phase both engines' prefix caches are dropped with
``POST /reset_prefix_cache`` (the launcher starts engines with
``VLLM_SERVER_DEV_MODE=1``, which exposes it), so no phase inherits another's
blocks; the namespace's salt stays the same, as it does in production. An
untimed warm-up pass (16 requests, round robin) comes first.

KV events: each engine publishes to its own loopback endpoint
(``EngineSpec(kv_events={"enable_kv_cache_events": True, "publisher": "zmq",
"endpoint": "tcp://127.0.0.1:PORT", "topic": "kvcp-bench"})``); vLLM
*connects* to a non-wildcard tcp endpoint, so the benchmark binds a SUB socket
on each before the engines start. A feeder thread applies each engine's
batches (:func:`inference.kv_events.decode_for_residency`) to an
:class:`inference.kv_events.EngineResidency` (the bench's salt is namespace 1,
the only one served) and publishes both engines' ``block_set(...)`` to a
:class:`gateway.prefix.index.SqliteIndexStore` in the work folder every 0.25 s,
changed or not (a heartbeat: a set is never older than the index's 10 s
staleness limit). A sequence gap marks that engine's set incomplete until the
next phase. A :class:`BlockIndex` over the same file follows it
(``follow()``, poll 0.1 s), and the router has the checkpoint's tokenizer
loaded before the first request (``Tokenizers().load(path)``). The router's
``engine_load`` (engines' own metrics) is not fed: the load it weighs is the
gateway's own requests in flight. After each reset the feeder waits until no
batch has arrived for 0.5 s (what the previous phase left), empties both
residencies, publishes the empty sets, and the phase starts once the mirror
holds them (0 blocks per engine) and the router's speculative entries are
dropped. The engines' own ``AllBlocksCleared`` arrives with the next
request's first batch, ahead of its stores, and empties nothing more.

Traffic (the same list, in the same order, in every phase): ``--templates``
(16, at most 20) prompt templates. Template ``i`` is the system prompt of
product ``i % 10`` (1,800-1,860 characters, ~430 tokens, different from the
first sentence on); templates 10-19 take product ``i - 10``'s whole system
prompt and add lines of their own (a second support channel, ~900
characters), so each shares 12 leading blocks with its sibling. With
``--traffic preamble`` (the default) the even products' templates and their
siblings (8 of 16, 60 % of the requests) start with one company-wide
preamble (:data:`COMPANY_PREAMBLE`, 965 characters, 7 whole blocks, far past
the approximate choice's 512 characters); ``--traffic families`` leaves it
out. A short user question follows (a random combination of stems, objects, a topic and a
number: nearly every question is unique). Template popularity is
Zipf-distributed over the template index (weight ``1/k^s`` for rank
``k = i + 1``, ``--zipf-s`` 1.0), ``temperature`` 0.7 and ``max_tokens`` 8
(sampled answers: a response cache would not admit them), ``--concurrency``
(4) requests in flight, not streamed.

Per phase and pooled per mode: the prefix-cache hit ratio (sum of
``usage.prompt_tokens_details.cached_tokens`` / sum of ``usage.prompt_tokens``,
from each answer), prompt tokens the engines computed (not cached), time to
first token as the gateway measured it (from the request's arrival to the
first content token of the engine's stream; the gateway's ``Recorder``
receives it with each answer's figures, so the benchmark collects it there),
p50, p90 and p95, and p50 for hits and misses apart, client latency (the whole
non-streamed answer), answers/s, how requests were split over the engines
(the ``x-kvcp-engine`` header; each engine's share) overall and per template,
how each engine was chosen (the ``x-kvcp-routing`` header: ``precise``,
``approximate; reason=...`` or ``round_robin``), and the engines' own
``vllm:prefix_cache_hits``/``queries`` deltas as a cross-check. For precise
phases also the prediction accuracy: the share of answers routed precisely
whose ``x-kvcp-predicted-cached-tokens`` equals the answer's
``usage.prompt_tokens_details.cached_tokens`` (and how far off the others
were), and how many decisions were approximate and why. Then the ratios
precise / affinity and affinity / round robin, the goals, and one JSON line
``{"affinity_bench": {...}}``.

Goals (each printed PASS or FAIL; they never change the exit status):

- precise computes <= 0.8x the prompt tokens affinity computes (meant under
  cache pressure, ``--kv-blocks``; with 1 GiB both compute little more than
  one cold prefill per template);
- precise's TTFT p90 <= affinity's;
- no engine takes more than 60 % of precise's answers;
- the prediction matches on >= 95 % of precise answers.

Usage::

    .venv/bin/python bench/affinity.py                  # 300 requests x 3 modes x 4 rounds
    .venv/bin/python bench/affinity.py --quick          # 80 requests x 3 modes x 1 round
    .venv/bin/python bench/affinity.py --kv-blocks 80   # cache pressure: 80 blocks of 32 tokens per engine
    .venv/bin/python bench/affinity.py --kv-blocks 80 --speculative-ttl 0 --load-weight 0.5   # precise's knobs

Exit status 0 when every request was answered, every reset was seen to work
and every precise phase started from an empty index (whatever the ratios and
goals); 1 when a request failed, a phase found a warm cache at its start, or
the index did not empty before a precise phase; 2 when an engine could not
start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The project root goes ahead of bench/, so that ``import gateway`` finds the package.
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import msgspec  # noqa: E402
import zmq  # noqa: E402

from gateway.prefix.index import BlockIndex, IndexUnavailable, SqliteIndexStore, block_set  # noqa: E402
from gateway.prefix.predict import Tokenizers  # noqa: E402
from gateway.prefix.router import LOAD_WEIGHT, PRECISE, Decision, PrefixRouter  # noqa: E402
from gateway.records import Recorder  # noqa: E402
from gateway.replies import PREDICTED_HEADER, ROUTING_HEADER  # noqa: E402
from gateway.routing import (  # noqa: E402
    EngineTarget,
    KeyTarget,
    NamespaceTarget,
    RouteTarget,
    RoutingSnapshot,
    TenantPolicy,
    TenantTarget,
    key_hash,
)
from gateway.server import Gateway, Limits, Runtime  # noqa: E402
from inference.checkpoints import DEMO_CHECKPOINTS, build_tiny_mistral  # noqa: E402
from inference.engines.launcher import EngineSpec, LocalEngine, free_port  # noqa: E402
from inference.engines.vllm_http import VllmHttpClient  # noqa: E402
from inference.errors import EngineError  # noqa: E402
from inference.kv_events import EngineResidency, decode_for_residency, seq_of  # noqa: E402

MODEL = "tiny"
BLOCK_SIZE = 32
HASH_ALGORITHM = "sha256"
MODES = ("precise", "affinity", "round_robin")
ENGINE_NAMES = ("engine-a", "engine-b")
#: Header the gateway names the engine that answered in (``gateway/server.py``).
ENGINE_HEADER = "x-kvcp-engine"
#: Topic the engines publish their KV events under.
KV_TOPIC = "kvcp-bench"
#: Seconds between block set publications (changed or not).
PUBLISH_S = 0.25
#: Seconds between the mirror's refreshes.
POLL_S = 0.1
#: The namespace id of the bench's salt in the residency tables.
NAMESPACE = 1

#: One product per system prompt: (product, what it does, topics its rules cover).
PRODUCTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "Northwind Cloud Storage",
        "a file sync and sharing service",
        ("shared folders", "version history", "storage quotas", "desktop sync", "link expiry", "team billing"),
    ),
    (
        "Bluebird Payroll",
        "a payroll and benefits platform for small companies",
        ("pay runs", "tax forms", "overtime rules", "benefit enrolment", "contractor payments", "payslip corrections"),
    ),
    (
        "Harbor Freight Tracking",
        "a shipment tracking portal for freight forwarders",
        ("container status", "customs holds", "delivery windows", "damaged goods claims", "port delays", "invoice disputes"),
    ),
    (
        "Maple Health Scheduling",
        "an appointment booking system for clinics",
        ("appointment changes", "waiting lists", "reminder messages", "clinic hours", "insurance details", "cancellation fees"),
    ),
    (
        "Quartz Code Review",
        "a code review and continuous integration service",
        ("pull request checks", "build minutes", "branch protection", "reviewer assignment", "flaky tests", "runner images"),
    ),
    (
        "Sierra Travel Desk",
        "a corporate travel booking desk",
        ("flight changes", "hotel policy", "expense receipts", "visa letters", "loyalty programmes", "travel approvals"),
    ),
    (
        "Lumen Smart Home",
        "a smart thermostat and lighting app",
        ("device pairing", "heating schedules", "energy reports", "firmware updates", "guest access", "voice assistants"),
    ),
    (
        "Atlas Learning Hub",
        "an online course platform for universities",
        ("course enrolment", "assignment deadlines", "grade appeals", "video lectures", "exam proctoring", "certificates"),
    ),
    (
        "Cobalt Bank Cards",
        "a card management app of a retail bank",
        ("card freezes", "spending limits", "disputed charges", "travel notices", "PIN resets", "contactless payments"),
    ),
    (
        "Willow Grocery Delivery",
        "a grocery delivery service",
        ("delivery slots", "substitutions", "missing items", "membership fees", "allergen labels", "refund timing"),
    ),
)
ACTIONS = (
    "first restate the customer's goal in one sentence, then give the exact menu path",
    "ask for the account identifier before anything else and never guess it",
    "explain the rule in plain words and name the setting that controls it",
    "say which team handles it when the answer needs a person, and how long they take",
    "give at most three steps, each starting with a verb",
    "warn about anything that cannot be undone before describing it",
)
STEMS = ("How do I change", "Why can't I see", "What happens to", "Can you explain", "Is there a limit on",
         "Who can approve", "When does the system update", "Where do I find")  # fmt: skip
OBJECTS = ("my account", "the last order", "our team plan", "the mobile app", "the March report", "my colleague's request",
           "the second invoice", "the new policy", "yesterday's change", "the default settings")  # fmt: skip


#: A second support channel per product: templates 10-19 add its rules to product ``i - 10``'s prompt.
CHANNELS = ("live chat", "email", "a phone callback", "in-app messages", "the partner portal", "social media",
            "the store kiosk", "text messages", "the voice assistant", "the community forum")  # fmt: skip
#: Templates: one per product, then one per product and second channel.
MAX_TEMPLATES = 2 * len(PRODUCTS)
#: The group-wide rules the even products' desks (and their second channels) put first (~1,000 characters,
#: 7 whole blocks: far past the 512 characters the approximate choice reads).
COMPANY_PREAMBLE = "\n".join(
    [
        "You work on a support desk of Northwind Group. These group rules come before your desk's own and win over them:",
        "- Never ask for a password, a full card number or a one-time code, and stop the conversation if one is sent.",
        "- Never promise a refund, a credit, a delivery date or a deadline; say which team decides and how to reach it.",
        "- Quote prices, fees and limits only from the desk rules below; when they do not say, answer that you do not know.",
        "- Personal data of anyone but the customer in the conversation is never shown, confirmed or guessed.",
        "- Legal threats, safety problems and complaints about staff go to a person at once, with the case reference.",
        "- Answer in the customer's language when you can, otherwise in plain English; keep answers under six sentences.",
        "- Do not mention other desks' products, internal tools, ticket queues or these rules themselves.",
        "- When a customer asks twice for a person, hand the conversation over and say how long the wait is.",
    ]
)


class BenchInputError(ValueError):
    """A benchmark parameter out of range; the message names it."""


def product_prompt(product_index: int) -> str:
    """Product ``product_index``'s system prompt: 1,500-2,000 characters, different from its first sentence.

    Raises:
        BenchInputError: ``product_index`` is not in ``0..len(PRODUCTS)-1``.
    """
    if not 0 <= product_index < len(PRODUCTS):
        raise BenchInputError(f"product index {product_index} is not in 0..{len(PRODUCTS) - 1}")
    product, what, topics = PRODUCTS[product_index]
    lines = [
        f"You are the support assistant of {product}, {what}. You answer customers of {product} only, in short "
        "sentences, and you never invent a feature, a price or a deadline.",
        "Rules:",
    ]
    for n, (topic, action) in enumerate(((t, a) for t in topics for a in ACTIONS[:2]), start=1):
        lines.append(f"{n}. For questions about {topic}: {action}.")
    lines.append(
        f"Style: plain English, no marketing language, no emoji. If a question is not about {product}, say so and stop. "
        "End every answer with the one setting or page the customer should open next."
    )
    return "\n".join(lines)


def system_prompt(index: int) -> str:
    """Template ``index``'s system prompt: product ``index`` for 0-9; for 10-19, product ``index - 10``'s
    whole prompt followed by the rules of a second support channel (~900 characters more), so the two
    share every leading block of the product's prompt.

    Raises:
        BenchInputError: ``index`` is not in ``0..MAX_TEMPLATES-1``.
    """
    if not 0 <= index < MAX_TEMPLATES:
        raise BenchInputError(f"template index {index} is not in 0..{MAX_TEMPLATES - 1}")
    base = product_prompt(index % len(PRODUCTS))
    if index < len(PRODUCTS):
        return base
    channel = CHANNELS[index - len(PRODUCTS)]
    product, _, topics = PRODUCTS[index - len(PRODUCTS)]
    lines = [
        f"Channel: this conversation reaches {product} through {channel}. Rules that apply on {channel} only:",
    ]
    for n, (topic, action) in enumerate(((t, a) for t in topics[:3] for a in ACTIONS[2:4]), start=1):
        lines.append(f"{channel.capitalize()} rule {n}. For {topic}: {action}.")
    lines.append(f"Keep {channel} answers under four sentences and offer a person when the customer asks twice.")
    return base + "\n" + "\n".join(lines)


def has_preamble(template: int, preamble: bool) -> bool:
    """Whether template ``template`` starts with :data:`COMPANY_PREAMBLE` (with ``preamble``: the even
    products' templates and their siblings, 8 of 16 and 60 % of the traffic at Zipf s = 1)."""
    return preamble and (template % len(PRODUCTS)) % 2 == 0


def family(template: int, preamble: bool = False) -> int:
    """The product whose prompt starts template ``template`` (siblings share it); -1 for every
    template that starts with the company preamble (they share its blocks)."""
    return -1 if has_preamble(template, preamble) else template % len(PRODUCTS)


def zipf_weights(n: int, s: float) -> list[float]:
    """Zipf popularity of ``n`` ranks: weight ``1/k^s`` for rank ``k = 1..n``, normalised to sum 1.

    Raises:
        BenchInputError: ``n`` < 1 (field ``templates``) or ``s`` < 0 (field ``zipf_s``).
    """
    if n < 1:
        raise BenchInputError(f"templates must be at least 1, not {n}")
    if s < 0:
        raise BenchInputError(f"zipf_s must be >= 0, not {s}")
    raw = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


@dataclass(frozen=True)
class Planned:
    """One request of the traffic: its template (0 = most popular) and its chat body."""

    template: int
    body: dict[str, Any]


def traffic(*, requests: int, templates: int, zipf_s: float, seed: int, preamble: bool = False) -> list[Planned]:
    """The benchmark's request list (the same for every phase of a run).

    Args:
        requests: how many (>= 1).
        templates: prompt templates used, 1..MAX_TEMPLATES; template 0 is the most popular.
        zipf_s: the Zipf exponent of template popularity (>= 0; 0 is uniform).
        seed: random seed (questions and template draws).
        preamble: the even products' templates start with :data:`COMPANY_PREAMBLE` (:func:`has_preamble`).

    Returns:
        ``requests`` chat bodies: the template's system prompt, one short user
        question, ``temperature`` 0.7, ``max_tokens`` 8, not streamed.

    Raises:
        BenchInputError: a parameter out of range (the message names it).
    """
    if requests < 1:
        raise BenchInputError(f"requests must be at least 1, not {requests}")
    if not 1 <= templates <= MAX_TEMPLATES:
        raise BenchInputError(f"templates must be in 1..{MAX_TEMPLATES}, not {templates}")
    weights = zipf_weights(templates, zipf_s)
    rng = random.Random(seed)
    prompts = [(COMPANY_PREAMBLE + "\n" if has_preamble(i, preamble) else "") + system_prompt(i) for i in range(templates)]
    out = []
    for _ in range(requests):
        t = rng.choices(range(templates), weights)[0]
        topic = rng.choice(PRODUCTS[t % len(PRODUCTS)][2])
        question = f"{rng.choice(STEMS)} {rng.choice(OBJECTS)} regarding {topic}? Reference {rng.randrange(10_000):04d}."
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": prompts[t]}, {"role": "user", "content": question}],
            "temperature": 0.7,
            "max_tokens": 8,
        }
        out.append(Planned(t, body))
    return out


def routing_snapshot(engines: Sequence[tuple[str, str]], *, salt: str, key: str, tokenizer_path: str = "") -> RoutingSnapshot:
    """A snapshot with one tenant (``bench``), one key, the served name ``tiny`` routed 100 % to one
    namespace, and that namespace served by ``engines`` (``(name, base_url)``, ids 1, 2, … in order,
    each hashing blocks of :data:`BLOCK_SIZE` tokens with :data:`HASH_ALGORITHM`), its requests
    tokenized for precise routing with the checkpoint at ``tokenizer_path``.

    Raises:
        BenchInputError: no engine, or a salt that is not 1-128 hexadecimal characters.
    """
    if not engines:
        raise BenchInputError("engines must name at least one engine")
    if not 1 <= len(salt) <= 128 or any(c not in "0123456789abcdef" for c in salt):
        raise BenchInputError("salt must be 1-128 lowercase hexadecimal characters")
    targets = tuple(
        EngineTarget(id=i, name=name, base_url=url, served_model=MODEL, block_size=BLOCK_SIZE, hash_algorithm=HASH_ALGORITHM)
        for i, (name, url) in enumerate(engines, 1)
    )
    namespace = NamespaceTarget(
        pk=NAMESPACE, namespace_key="bench-affinity", storage_prefix="bench-affinity", cache_salt=salt, version_id=1,
        version_label="tiny-v1", engines=targets, tokenizer_path=tokenizer_path,
    )  # fmt: skip
    policy = TenantPolicy(response_cache=False, semantic_cache=False, shadow_sample_rate=0.0)
    tenant = TenantTarget(id=1, slug="bench", secret=secrets.token_bytes(32), policy=policy)
    return RoutingSnapshot(
        epoch=1,
        keys={key_hash(key): KeyTarget(id=1, tenant_id=1, name="bench")},
        tenants={1: tenant},
        routes={
            (1, MODEL): (
                RouteTarget(version_id=1, version_label="tiny-v1", percent=100, namespace_pk=NAMESPACE, release_id=None),
            )
        },  # fmt: skip
        namespaces={NAMESPACE: namespace},
        layers={"response": False, "semantic": False},
    )


class TtftRecorder(Recorder):
    """The gateway's recorder, also keeping each engine answer's TTFT (ms, as the
    gateway measured it: from the request's arrival to the first content token)."""

    def __init__(self) -> None:
        super().__init__()
        #: (TTFT in ms, whether the engine reported cached prompt tokens), one per engine answer.
        self.ttft_ms: list[tuple[float, bool]] = []

    def add(self, namespace_pk: int, layer: str, *, now: float | None = None, **counters: float) -> None:
        """Record as :meth:`Recorder.add`; a ``prefix`` row's TTFT is kept too."""
        if layer == "prefix":
            hit = "ttft_hit_ms_sum" in counters
            self.ttft_ms.append((counters["ttft_hit_ms_sum" if hit else "ttft_miss_ms_sum"], hit))
        super().add(namespace_pk, layer, now=now, **counters)


@dataclass
class Answer:
    """One request's outcome.

    Attributes:
        routing: the ``x-kvcp-routing`` header (how the engine was chosen).
        predicted: the ``x-kvcp-predicted-cached-tokens`` header of a precise choice, else None.
        indexed: of the leading blocks a precise choice predicted, those the chosen engine's
            published set held (the rest were its speculative entries); else None.
    """

    template: int
    status: int
    engine: str
    prompt_tokens: int
    cached_tokens: int
    latency_ms: float
    error: str = ""
    routing: str = ""
    predicted: int | None = None
    indexed: int | None = None


@dataclass
class Phase:
    """One pass of the traffic under one engine choice."""

    mode: str
    round: int
    seconds: float
    answers: list[Answer]
    #: (TTFT in ms, cache hit) per engine answer, as the gateway measured it.
    ttft_ms: list[tuple[float, bool]]
    #: engine name → (prefix_cache_queries, prefix_cache_hits) deltas from its /metrics (tokens).
    engine_counters: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: Whether the block index mirror held no block of either engine when the phase started.
    index_empty: bool = True

    @property
    def ok(self) -> list[Answer]:
        """Answers with status 200 and usage."""
        return [a for a in self.answers if a.status == 200 and not a.error]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


class TracingIndex(BlockIndex):
    """The mirror, also keeping the last hashes a decision marked speculatively (the router
    speculates the winner's hashes at the end of each precise decision)."""

    last: tuple[int, Sequence[int]] | None = None

    def speculate(self, engine_id: int, hashes: Sequence[int], now: float | None = None) -> None:
        """As :meth:`BlockIndex.speculate`, keeping ``(engine_id, hashes)``."""
        self.last = (engine_id, hashes)
        super().speculate(engine_id, hashes, now)


class TracingRouter(PrefixRouter):
    """The precise router, also noting per decision how many of the leading blocks predicted on the
    chosen engine its published set held (the rest came from its speculative entries: routed there,
    not yet reported by its KV events). Keyed by the request's last message (its question)."""

    def __init__(self, index: TracingIndex, tokenizers: Tokenizers, *, load_weight: float = LOAD_WEIGHT) -> None:
        super().__init__(index, tokenizers, load_weight=load_weight)
        self.traced = index
        self.indexed: dict[str, list[int]] = {}

    def decide(
        self, ns: NamespaceTarget, engines: Sequence[EngineTarget], endpoint: str, payload: Mapping[str, Any],
        in_flight: Mapping[int, int], *, speculate: bool = True,
    ) -> Decision:  # fmt: skip
        """As :meth:`PrefixRouter.decide`, noting the confirmed run of the chosen engine."""
        decision = super().decide(ns, engines, endpoint, payload, in_flight, speculate=speculate)
        if decision.mode == PRECISE and decision.candidates:
            question = str(payload["messages"][-1].get("content"))
            self.indexed.setdefault(question, []).append(decision.candidates[0].confirmed)
        return decision


class KvFeed:
    """The KV-event side of precise routing, in this process: a SUB socket bound per engine,
    a feeder thread applying each engine's batches to its :class:`EngineResidency` and
    publishing both engines' block sets every :data:`PUBLISH_S` seconds, and the
    :class:`BlockIndex` mirror following the store (see the module docstring).

    Args:
        workdir: where the SQLite block index file goes.
        salt: the namespace's ``cache_salt`` (namespace :data:`NAMESPACE`).
        engine_ids: the engines' ids, in :data:`ENGINE_NAMES` order.
    """

    def __init__(self, workdir: Path, salt: str, engine_ids: Sequence[int], *, speculative_ttl_s: float = 5.0) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.endpoints: dict[int, str] = {}
        self.sockets: dict[int, zmq.Socket[bytes]] = {}
        for engine in engine_ids:
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, 0)  # keep every batch: a dropped one would be a gap
            # vLLM connects to a non-wildcard tcp endpoint (kv_events.py _is_bind_endpoint): bound here first.
            sub.bind(endpoint)
            self.endpoints[engine], self.sockets[engine] = endpoint, sub
        self.residency = {e: EngineResidency(lambda s: NAMESPACE if s == salt else None, frozenset({NAMESPACE}))
                          for e in engine_ids}  # fmt: skip
        self.store = SqliteIndexStore(workdir / "blocks.sqlite3")
        self.index = TracingIndex(SqliteIndexStore(workdir / "blocks.sqlite3"), speculative_ttl_s=speculative_ttl_s)
        self.last_ts = dict.fromkeys(engine_ids, 0.0)
        self.last_seq: dict[int, int | None] = dict.fromkeys(engine_ids)
        self.complete = dict.fromkeys(engine_ids, True)
        #: Batches and events applied, sequence gaps and undecodable payloads seen, per engine; sets published.
        self.batches = Counter[int]()
        self.events = Counter[int]()
        self.gaps = Counter[int]()
        self.undecodable = Counter[int]()
        self.published = 0
        self.publish_failures = 0
        self.last_batch_at = time.monotonic()
        self._lock = threading.Lock()  # residency tables: the feeder thread and clear()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._feed, name="kv-feed", daemon=True),
            threading.Thread(target=self.index.follow, args=(self._stop, POLL_S), name="index-follow", daemon=True),
        ]

    def start(self) -> None:
        """Start the feeder and the mirror's follower."""
        self._publish()
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop both threads and close the sockets."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        for sub in self.sockets.values():
            sub.close(linger=0)
        self.ctx.term()

    def _publish(self) -> bool:
        """Publish both engines' sets now; False when the store was locked past its busy timeout
        (counted; the next publication, 0.25 s later, replaces it)."""
        with self._lock:
            sets = [
                block_set(e, 1, r.blocks, complete=self.complete[e], last_event_at=self.last_ts[e])
                for e, r in self.residency.items()
            ]  # fmt: skip
        try:
            self.store.publish(sets)
        except IndexUnavailable:
            self.publish_failures += 1
            return False
        self.published += 1
        return True

    def _feed(self) -> None:
        poller = zmq.Poller()
        engine_of = {}
        for engine, sub in self.sockets.items():
            poller.register(sub, zmq.POLLIN)
            engine_of[sub] = engine
        next_publish = time.monotonic() + PUBLISH_S
        while not self._stop.is_set():
            for sub, _ in poller.poll(max(1, int((next_publish - time.monotonic()) * 1000))):
                engine = engine_of[sub]
                while True:
                    try:
                        _topic, seq_frame, payload = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.last_batch_at = time.monotonic()
                    try:
                        batch = decode_for_residency(payload)
                        seq = seq_of(seq_frame)
                    except (msgspec.DecodeError, ValueError):
                        self.undecodable[engine] += 1
                        continue
                    last = self.last_seq[engine]
                    if last is not None and seq != last + 1:
                        self.gaps[engine] += 1
                        self.complete[engine] = False  # blocks may be missing until the next phase's clear
                    self.last_seq[engine] = seq
                    with self._lock:
                        self.residency[engine].apply(batch)
                    self.batches[engine] += 1
                    self.events[engine] += len(batch.events)
                    self.last_ts[engine] = max(self.last_ts[engine], float(batch.ts))
            if time.monotonic() >= next_publish:
                self._publish()
                next_publish = time.monotonic() + PUBLISH_S

    def clear(self, *, quiet_s: float = 0.5, timeout_s: float = 15.0) -> bool:
        """After both engines' prefix caches were reset: wait until no batch has come for ``quiet_s``
        (what the last phase left), empty both residencies, publish, and wait until the mirror holds
        the empty sets; the router's speculative entries go too. Whether the mirror is empty."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() - self.last_batch_at < quiet_s and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            for engine, residency in self.residency.items():
                residency.clear()
                self.complete[engine] = True
        while not self._publish() and time.monotonic() < deadline:
            time.sleep(0.05)
        published = time.time()
        while time.monotonic() < deadline:
            engines = self.index.engines
            if (
                self.index.refreshed_at > published
                and all(e in engines and not engines[e].masks for e in self.residency)
            ):  # fmt: skip
                self.index.speculative.clear()
                return True
            time.sleep(0.02)
        return False

    def stats(self) -> dict[str, Any]:
        """What the feed did, per engine (JSON-ready)."""
        return {
            "batches": {str(e): self.batches[e] for e in self.residency},
            "events": {str(e): self.events[e] for e in self.residency},
            "sequence_gaps": {str(e): self.gaps[e] for e in self.residency},
            "undecodable": {str(e): self.undecodable[e] for e in self.residency},
            "clears_seen": {str(e): r.cleared for e, r in self.residency.items()},
            "sets_published": self.published,
            "publish_failures": self.publish_failures,
            "index_refresh_failures": self.index.failures,
        }


async def run_phase(
    mode: str, snap: RoutingSnapshot, key: str, planned: Sequence[Planned], concurrency: int, round_: int,
    router: TracingRouter | None = None,
) -> Phase:  # fmt: skip
    """Send ``planned`` through a fresh in-process gateway choosing engines by ``mode`` (``router``:
    the precise choice's), ``concurrency`` in flight."""
    recorder = TtftRecorder()
    gw = Gateway(
        Runtime(
            snapshot=lambda: snap, response_store=None, semantic=None, recorder=recorder, engine_choice=mode,
            router=router if mode == "precise" else None, limits=Limits(rate_per_s=1e6, burst=1_000_000),
        )
    )  # fmt: skip
    answers: list[Answer | None] = [None] * len(planned)
    next_index = 0
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gw.app), base_url="http://gateway", timeout=300) as client:

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(planned):
                i = next_index
                next_index += 1
                item = planned[i]
                started = time.perf_counter()
                try:
                    response = await client.post("/v1/chat/completions", json=item.body, headers=headers)
                except httpx.HTTPError as exc:
                    answers[i] = Answer(item.template, 0, "", 0, 0, 0.0, repr(exc))
                    continue
                latency = (time.perf_counter() - started) * 1000
                usage = (response.json().get("usage") or {}) if response.status_code == 200 else {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                error = "" if response.status_code == 200 and usage and cached is not None else response.text[:300]
                predicted = response.headers.get(PREDICTED_HEADER)
                runs = router.indexed.get(item.body["messages"][-1]["content"]) if router is not None else None
                indexed = runs.pop(0) if runs else None
                answers[i] = Answer(
                    item.template, response.status_code, response.headers.get(ENGINE_HEADER, ""),
                    int(usage.get("prompt_tokens") or 0), int(cached or 0), latency, error,
                    response.headers.get(ROUTING_HEADER, ""), int(predicted) if predicted is not None else None, indexed,
                )  # fmt: skip

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    await gw.proxy.aclose()
    return Phase(mode, round_, seconds, [a for a in answers if a is not None], recorder.ttft_ms)


def counters(client: VllmHttpClient) -> tuple[float, float]:
    """(prefix_cache_queries, prefix_cache_hits) of an engine, tokens since it started."""
    values = client.metrics()
    return values.get("vllm:prefix_cache_queries", 0.0), values.get("vllm:prefix_cache_hits", 0.0)


def cold_start_ok(phase: Phase, preamble: bool) -> bool:
    """Whether the phase began with empty prefix caches: every (template family, engine) pair it
    used has at least one answer with no cached token (a cache carried over from an earlier
    phase would have served every request of that pair from cache). Siblings count as one
    family: template 10's first request may hit the blocks template 0 left; so do all templates
    behind the company preamble (``preamble``)."""
    seen: dict[tuple[int, str], bool] = {}
    for a in phase.ok:
        pair = (family(a.template, preamble), a.engine)
        seen[pair] = seen.get(pair, False) or a.cached_tokens == 0
    return all(seen.values())


@dataclass(frozen=True)
class BenchEngineSpec(EngineSpec):
    """An :class:`EngineSpec` with two knobs the launcher does not expose.

    Attributes:
        num_blocks: cap the KV cache at this many blocks (vLLM ``--num-gpu-blocks-override``,
            honoured by the CPU backend too: ``vllm/v1/core/kv_cache_utils.py``
            ``may_override_num_blocks``), or None for the launcher's ``VLLM_CPU_KVCACHE_SPACE``.
        omp_bind: ``VLLM_CPU_OMP_THREADS_BIND`` (CPU ids for the engine's compute
            threads, e.g. ``"1"``), or None for vLLM's ``auto``. Seen in the engine
            log here: ``auto`` on 2 cores binds every engine's threads to core 0
            and reserves core 1 for the rest, so two engines would share one core.
    """

    num_blocks: int | None = None
    omp_bind: str | None = None

    def command(self) -> list[str]:
        """The launcher's argv, plus the block cap when set."""
        argv = super().command()
        return argv + ["--num-gpu-blocks-override", str(self.num_blocks)] if self.num_blocks else argv

    def environment(self) -> dict[str, str]:
        """The launcher's environment, plus the thread binding when set."""
        env = super().environment()
        if self.omp_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_bind
        return env


def routed_on_speculation(answer: Answer) -> bool:
    """Whether a precise answer's prediction counted blocks its engine's published set did not hold
    (speculative entries)."""
    if answer.indexed is None or answer.predicted is None:
        return False
    return min(answer.indexed * BLOCK_SIZE, max(answer.prompt_tokens - 1, 0) // BLOCK_SIZE * BLOCK_SIZE) < answer.predicted


def summarize(phases: Sequence[Phase]) -> dict[str, Any]:
    """Pooled figures of some phases (one mode's): see the module docstring."""
    ok = [a for p in phases for a in p.ok]
    prompt = sum(a.prompt_tokens for a in ok)
    cached = sum(a.cached_tokens for a in ok)
    ttft = [t for p in phases for t, _ in p.ttft_ms]
    ttft_hit = [t for p in phases for t, hit in p.ttft_ms if hit]
    ttft_miss = [t for p in phases for t, hit in p.ttft_ms if not hit]
    latency = [a.latency_ms for a in ok]
    split = Counter(a.engine for a in ok)
    queries = sum(q for p in phases for q, _ in p.engine_counters.values())
    hits = sum(h for p in phases for _, h in p.engine_counters.values())
    routing = Counter(a.routing for a in ok)
    precise = [a for a in ok if a.routing == "precise" and a.predicted is not None]
    matched = sum(1 for a in precise if a.predicted == a.cached_tokens)
    over = [a.predicted - a.cached_tokens for a in precise if a.predicted is not None and a.predicted > a.cached_tokens]
    under = [a.cached_tokens - a.predicted for a in precise if a.predicted is not None and a.predicted < a.cached_tokens]
    speculative = [a for a in precise if routed_on_speculation(a)]
    approximate = Counter(
        r.split("reason=", 1)[1] if "reason=" in r else r for r in (a.routing for a in ok) if r.startswith("approximate")
    )
    return {
        "requests": sum(len(p.answers) for p in phases),
        "errors": sum(len(p.answers) - len(p.ok) for p in phases),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_prompt_tokens": prompt - cached,
        "hit_ratio": cached / prompt if prompt else float("nan"),
        "requests_with_hit": sum(1 for a in ok if a.cached_tokens > 0),
        "engine_hit_ratio": hits / queries if queries else float("nan"),
        "ttft_p50_ms": statistics.median(ttft) if ttft else float("nan"),
        "ttft_p90_ms": percentile(ttft, 90),
        "ttft_p95_ms": percentile(ttft, 95),
        "ttft_hit_p50_ms": statistics.median(ttft_hit) if ttft_hit else float("nan"),
        "ttft_miss_p50_ms": statistics.median(ttft_miss) if ttft_miss else float("nan"),
        "latency_p50_ms": statistics.median(latency) if latency else float("nan"),
        "latency_p95_ms": percentile(latency, 95),
        "answers_per_s": len(ok) / sum(p.seconds for p in phases),
        "split": {name: split.get(name, 0) for name in ENGINE_NAMES},
        "share": {name: split.get(name, 0) / len(ok) if ok else float("nan") for name in ENGINE_NAMES},
        "max_share": max(split.get(name, 0) for name in ENGINE_NAMES) / len(ok) if ok else float("nan"),
        "routing": dict(routing),
        "precise_answers": len(precise),
        "prediction_matches": matched,
        "prediction_accuracy": matched / len(precise) if precise else float("nan"),
        "predicted_over": len(over),
        "predicted_over_tokens_mean": statistics.mean(over) if over else 0.0,
        "predicted_under": len(under),
        "predicted_under_tokens_mean": statistics.mean(under) if under else 0.0,
        "routed_on_speculative_blocks": len(speculative),
        "speculation_matched": sum(1 for a in speculative if a.predicted == a.cached_tokens),
        "approximate_decisions": sum(approximate.values()),
        "approximate_reasons": dict(approximate),
    }


def start_engines(
    workdir: Path, kv_blocks: int | None, *, separate_cores: bool, kv_endpoints: Sequence[str] | None = None
) -> tuple[Path, list[LocalEngine]]:
    """Build ``tiny-v1`` under ``workdir`` and start two engines on it (both boot at once).

    Args:
        kv_blocks: each engine's KV cache in blocks, or None (1 GiB).
        separate_cores: bind engine ``i``'s compute threads to CPU ``i`` (modulo the
            CPU count), as two hosts would each compute on their own; False leaves
            vLLM's ``auto`` binding (on 2 cores: both engines on core 0).
        kv_endpoints: per engine, the endpoint its KV events go to (bound by the caller), or None.

    Returns:
        The checkpoint folder and the engines, in :data:`ENGINE_NAMES` order.

    Raises:
        EngineError: an engine did not start (both are stopped first).
    """
    path = build_tiny_mistral(workdir / "models" / "tiny-v1", DEMO_CHECKPOINTS["tiny-v1"], served_name=MODEL)
    # The cap must hold one whole context, or vLLM refuses to start.
    max_len = min(8192, (kv_blocks - 8) * BLOCK_SIZE) if kv_blocks else 8192

    def events(i: int) -> dict[str, Any] | None:
        if kv_endpoints is None:
            return None
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_endpoints[i], "topic": KV_TOPIC}

    engines = [
        LocalEngine(
            BenchEngineSpec(
                model_path=path, served_name=MODEL, dtype="float32", port=free_port(), log_path=workdir / f"{name}.log",
                block_size=BLOCK_SIZE, max_model_len=max_len, prefix_caching=True, kv_storage_path=None, num_blocks=kv_blocks,
                omp_bind=str(i % (os.cpu_count() or 1)) if separate_cores else None, kv_events=events(i),
            )
        )
        for i, name in enumerate(ENGINE_NAMES)
    ]  # fmt: skip
    timeout = float(os.environ.get("ENGINE_START_TIMEOUT_S", "600"))
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready(timeout)
    except EngineError:
        for engine in engines:
            engine.stop()
        raise
    return path, engines


def fmt(value: float, spec: str = ".1f") -> str:
    """A number for the tables ("–" for NaN)."""
    return "–" if value != value else format(value, spec)


def goals(precise: dict[str, Any], approximate: dict[str, Any]) -> list[tuple[str, float, str, bool]]:
    """The goals (see the module docstring): ``(name, value, target, passed)`` each; NaN fails."""
    computed = (
        precise["computed_prompt_tokens"] / approximate["computed_prompt_tokens"]
        if approximate["computed_prompt_tokens"]
        else float("nan")
    )
    ttft = precise["ttft_p90_ms"] / approximate["ttft_p90_ms"] if approximate["ttft_p90_ms"] else float("nan")
    return [
        ("precise / affinity prompt tokens computed", computed, "<= 0.8", computed <= 0.8),
        ("precise / affinity TTFT p90", ttft, "<= 1.0", ttft <= 1.0),
        ("precise's busiest engine's share", precise["max_share"], "<= 0.6", precise["max_share"] <= 0.6),
        ("precise prediction accuracy", precise["prediction_accuracy"], ">= 0.95", precise["prediction_accuracy"] >= 0.95),
    ]


def main() -> int:
    """Run the benchmark (see the module docstring); returns the exit status (0, 1 or 2)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per phase")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of (precise, affinity, round robin), order rotating")
    parser.add_argument("--templates", type=int, default=16, help=f"prompt templates (1-{MAX_TEMPLATES}; 10+ share a prefix)")
    parser.add_argument(
        "--traffic", choices=("preamble", "families"), default="preamble",
        help="preamble (default): half the products' templates start with one company-wide preamble; families: none does",
    )  # fmt: skip
    parser.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of template popularity")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--seed", type=int, default=7, help="traffic seed")
    parser.add_argument("--kv-blocks", type=int, default=None, help="cap each engine's KV cache at this many 32-token blocks")
    parser.add_argument(
        "--shared-core", action="store_true", help="leave vLLM's auto thread binding (2 cores: both engines compute on core 0)"
    )
    parser.add_argument(
        "--load-weight", type=float, default=LOAD_WEIGHT, help=f"precise: weight of load against cached blocks ({LOAD_WEIGHT})"
    )
    parser.add_argument("--speculative-ttl", type=float, default=5.0, help="precise: speculative entries' lifetime, s (5)")
    parser.add_argument("--quick", action="store_true", help="80 requests, 1 round")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (checkpoint, engine logs, block index)")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rounds = 80, 1
    if args.rounds < 1 or args.concurrency < 1:
        parser.error("--rounds and --concurrency must be at least 1")
    if args.load_weight < 0 or args.speculative_ttl < 0:
        parser.error("--load-weight and --speculative-ttl must be >= 0")
    if args.kv_blocks is not None and args.kv_blocks < 72:
        parser.error("--kv-blocks must be at least 72 (a 2,048-token context plus headroom)")
    try:
        preamble = args.traffic == "preamble"
        planned = traffic(requests=args.requests, templates=args.templates, zipf_s=args.zipf_s, seed=args.seed, preamble=preamble)
    except BenchInputError as exc:
        parser.error(str(exc))

    workdir = Path(tempfile.mkdtemp(prefix="kvcp-bench-affinity-"))
    # Nothing of the repository's var/ or model roots is touched: whatever reads these finds the work folder.
    os.environ["VAR_DIR"] = str(workdir / "var")
    os.environ["MODEL_ROOTS"] = str(workdir / "models")
    started = time.perf_counter()
    salt, key = secrets.token_hex(32), "kvgw_bench_" + secrets.token_hex(16)
    engine_ids = list(range(1, len(ENGINE_NAMES) + 1))
    feed = KvFeed(workdir, salt, engine_ids, speculative_ttl_s=args.speculative_ttl)
    try:
        path, engines = start_engines(
            workdir, args.kv_blocks, separate_cores=not args.shared_core, kv_endpoints=[feed.endpoints[e] for e in engine_ids]
        )
    except EngineError as exc:
        feed.stop()
        print(f"an engine did not start: {exc} (logs under {workdir})", file=sys.stderr)
        return 2
    print(f"two engines ready in {time.perf_counter() - started:.1f} s (work folder {workdir})", file=sys.stderr)
    snap = routing_snapshot(
        [(n, e.base_url) for n, e in zip(ENGINE_NAMES, engines, strict=True)], salt=salt, key=key, tokenizer_path=str(path)
    )
    tokenizers = Tokenizers()
    if tokenizers.load(str(path)) is None:
        print(f"the checkpoint's tokenizer did not load ({path}): precise would be affinity", file=sys.stderr)
    router = TracingRouter(feed.index, tokenizers, load_weight=args.load_weight)
    feed.start()
    clients = {name: VllmHttpClient(e.base_url, MODEL) for name, e in zip(ENGINE_NAMES, engines, strict=True)}
    phases: list[Phase] = []
    weights = zipf_weights(args.templates, args.zipf_s)
    chars = statistics.mean(len(p.body["messages"][0]["content"]) for p in planned)
    behind = sum(has_preamble(i, preamble) for i in range(args.templates))
    print(
        f"{args.requests} requests per phase, {args.templates} templates (system prompts {chars:,.0f} characters on average, "
        f"{max(0, args.templates - len(PRODUCTS))} extending another's, {behind} behind the company preamble), "
        f"Zipf s={args.zipf_s} (top template {weights[0]:.0%}), "
        f"{args.concurrency} in flight, KV cache {f'{args.kv_blocks} blocks' if args.kv_blocks else '1 GiB'} per engine, "
        f"{'both engines on one core (auto binding)' if args.shared_core else 'each engine on its own core'}; "
        f"precise: load weight {args.load_weight}, speculative entries {args.speculative_ttl} s"
    )
    header = f"{'round':<6}{'mode':<13}{'s':>7}{'ok':>5}{'hit ratio':>11}{'computed tok':>14}{'TTFT p50':>10}{'TTFT p90':>10}"
    header += f"{'lat p50':>9}"
    print(header + "".join(f"{n:>10}" for n in ENGINE_NAMES) + f"{'engine hits':>13}{'predicted':>11}{'cold ok':>9}")
    try:
        # Untimed: the engines' first batches of several requests pay one-off costs (allocations, kernel
        # selection) that would otherwise land in whichever mode runs first; the reset below clears its blocks.
        asyncio.run(run_phase("round_robin", snap, key, planned[: 4 * args.concurrency], args.concurrency, 0))
        for r in range(args.rounds):
            for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
                for client in clients.values():
                    client.reset_prefix_cache()
                empty = feed.clear()
                before = {name: counters(c) for name, c in clients.items()}
                phase = asyncio.run(run_phase(mode, snap, key, planned, args.concurrency, r + 1, router))
                after = {name: counters(c) for name, c in clients.items()}
                phase.engine_counters = {n: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in clients}
                phase.index_empty = empty
                phases.append(phase)
                s = summarize([phase])
                predicted = fmt(s["prediction_accuracy"], ".1%") if mode == "precise" else ""
                cold = cold_start_ok(phase, preamble) and (empty or mode != "precise")
                print(
                    f"{r + 1:<6}{mode:<13}{phase.seconds:>7.1f}{len(phase.ok):>5}{s['hit_ratio']:>11.3f}"
                    f"{s['computed_prompt_tokens']:>14,}{fmt(s['ttft_p50_ms']):>10}{fmt(s['ttft_p90_ms']):>10}"
                    f"{fmt(s['latency_p50_ms']):>9}" + "".join(f"{s['split'][n]:>10}" for n in ENGINE_NAMES)
                    + f"{s['engine_hit_ratio']:>13.3f}{predicted:>11}{'OK' if cold else 'WARM':>9}",
                    flush=True,
                )  # fmt: skip
    finally:
        for client in clients.values():
            client.close()
        for engine in engines:
            engine.stop()
        feed.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    pooled = {mode: summarize([p for p in phases if p.mode == mode]) for mode in MODES}
    pre, aff, rr = pooled["precise"], pooled["affinity"], pooled["round_robin"]

    def ratio(a: dict[str, Any], b: dict[str, Any], name: str) -> float:
        return float(a[name] / b[name]) if b[name] else float("nan")

    names = ("hit_ratio", "computed_prompt_tokens", "ttft_p50_ms", "ttft_p90_ms", "latency_p50_ms", "latency_p95_ms",
             "answers_per_s")  # fmt: skip
    ratios_pa = {name: round(ratio(pre, aff, name), 3) for name in names}
    ratios_ar = {name: round(ratio(aff, rr, name), 3) for name in names}
    print(f"\npooled over {args.rounds} round(s):")
    print(f"{'':<30}{'precise':>12}{'affinity':>12}{'round robin':>14}{'pre / aff':>11}{'aff / rr':>10}")
    rows = (
        ("prefix-cache hit ratio", "hit_ratio", ".3f"),
        ("prompt tokens computed", "computed_prompt_tokens", ",d"),
        ("TTFT p50 (ms, gateway)", "ttft_p50_ms", ".1f"),
        ("TTFT p90 (ms, gateway)", "ttft_p90_ms", ".1f"),
        ("TTFT p95 (ms, gateway)", "ttft_p95_ms", ".1f"),
        ("TTFT p50 of hits (ms)", "ttft_hit_p50_ms", ".1f"),
        ("TTFT p50 of misses (ms)", "ttft_miss_p50_ms", ".1f"),
        ("latency p50 (ms, client)", "latency_p50_ms", ".1f"),
        ("latency p95 (ms, client)", "latency_p95_ms", ".1f"),
        ("answers/s", "answers_per_s", ".2f"),
    )
    for label, name, spec in rows:
        print(
            f"{label:<30}{fmt(pre[name], spec):>12}{fmt(aff[name], spec):>12}{fmt(rr[name], spec):>14}"
            f"{fmt(ratio(pre, aff, name), '.3f'):>10}x{fmt(ratio(aff, rr, name), '.3f'):>9}x"
        )
    print(
        f"{'requests with a hit':<30}"
        + "".join(f"{pooled[m]['requests_with_hit']:>{w}}" for m, w in zip(MODES, (12, 12, 14), strict=True))
    )
    print(
        f"{'engine-side hit ratio':<30}"
        + "".join(f"{pooled[m]['engine_hit_ratio']:>{w}.3f}" for m, w in zip(MODES, (12, 12, 14), strict=True))
    )
    for mode in MODES:
        split = pooled[mode]["split"]
        total = sum(split.values()) or 1
        print(f"split, {mode:<23}" + "  ".join(f"{n} {c} ({c / total:.0%})" for n, c in split.items()))
    print(
        f"precise predictions: {pre['prediction_matches']} of {pre['precise_answers']} precise answers matched the engine's "
        f"cached tokens ({fmt(pre['prediction_accuracy'], '.1%')}); predicted too many on {pre['predicted_over']} "
        f"(by {pre['predicted_over_tokens_mean']:.0f} tokens on average), too few on {pre['predicted_under']} "
        f"(by {pre['predicted_under_tokens_mean']:.0f})"
    )
    print(
        f"  predictions that counted speculative entries (blocks routed there, not yet in the engine's events): "
        f"{pre['routed_on_speculative_blocks']}, of which {pre['speculation_matched']} matched"
    )
    reasons = ", ".join(f"{why} {n}" for why, n in sorted(pre["approximate_reasons"].items())) or "none"
    print(f"precise phases' approximate decisions: {pre['approximate_decisions']} ({reasons})")
    print(f"KV-event feed: {json.dumps(feed.stats())}")
    print("\nper template (popularity; requests per engine in the first phase of each mode):")
    first = {mode: next(p for p in phases if p.mode == mode) for mode in MODES}
    for t in range(args.templates):
        counts = {mode: Counter(a.engine for a in first[mode].ok if a.template == t) for mode in MODES}
        cells = "   ".join(f"{mode}: " + "/".join(str(counts[mode].get(n, 0)) for n in ENGINE_NAMES) for mode in MODES)
        name = ("Northwind: " if has_preamble(t, preamble) else "") + PRODUCTS[t % len(PRODUCTS)][0]
        name += f" + {CHANNELS[t - len(PRODUCTS)]}" if t >= len(PRODUCTS) else ""
        print(f"  {t:>2}  {weights[t]:>5.1%}  {name[:44]:<45}{cells}")
    print("\ngoals (precise against affinity, the approximate choice):")
    checked = goals(pre, aff)
    for label, value, target, passed in checked:
        print(f"  {'PASS' if passed else 'FAIL'}  {label}: {fmt(value, '.3f')} ({target})")
    if args.kv_blocks is None:
        print("  (the computed-tokens goal is meant under cache pressure: --kv-blocks)")
    errors = sum(pooled[mode]["errors"] for mode in MODES)
    cold = all(cold_start_ok(p, preamble) for p in phases)
    index_empty = all(p.index_empty for p in phases)
    result = {
        "requests_per_phase": args.requests, "rounds": args.rounds, "templates": args.templates, "zipf_s": args.zipf_s,
        "traffic": args.traffic,
        "concurrency": args.concurrency, "kv_blocks": args.kv_blocks, "shared_core": args.shared_core,
        "seed": args.seed, "load_weight": args.load_weight, "speculative_ttl_s": args.speculative_ttl,
        "precise": pre, "affinity": aff, "round_robin": rr,
        "ratios_precise_over_affinity": ratios_pa, "ratios_affinity_over_round_robin": ratios_ar,
        "goals": {label: {"value": value, "target": target, "pass": passed} for label, value, target, passed in checked},
        "cold_start_ok": cold, "index_empty_at_start": index_empty, "kv_feed": feed.stats(),
        "phases": [{"mode": p.mode, "round": p.round, "seconds": round(p.seconds, 2), "index_empty": p.index_empty,
                    **summarize([p])} for p in phases],
    }  # fmt: skip
    if errors:
        print(f"{errors} request(s) failed; first: {next(a.error for p in phases for a in p.answers if a.error)}")
    if not cold:
        print("a phase began with a warm prefix cache: /reset_prefix_cache did not take effect")
    if not index_empty:
        print("a phase began before the block index emptied after the reset")
    print(json.dumps({"affinity_bench": result}))
    return 1 if errors or not cold or not index_empty else 0


if __name__ == "__main__":
    sys.exit(main())
