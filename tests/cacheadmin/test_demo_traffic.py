"""The traffic generator: the workload's determinism, Zipf shape, shares and validity for the gateway; its
paraphrases through the real semantic matching; the runner's counts against a real HTTP server that answers like
the gateway (cache layers, versions, fingerprints, 429s, streams)."""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import cacheadmin.services.demo_traffic as demo_traffic
from cacheadmin.services.demo_traffic import (
    CROSS_VERSION_EXAMPLES,
    DEMO_TAIL_NUMBERS,
    DEMO_TEMPLATES,
    CrossVersionAnswer,
    TemplateSpec,
    TrafficRunner,
    TrafficStats,
    Workload,
    demo_workload,
    format_stats_line,
)
from gateway.canonical import canonical_request, response_admission
from gateway.layers.semantic.admission import semantic_admission
from gateway.layers.semantic.embedder import default_embedder
from gateway.layers.semantic.layer import SemanticLayer
from gateway.layers.semantic.matching import DEFAULT_GUARDS, SHIPPED_THRESHOLD, match, similarity
from gateway.pii import personal_data_kinds
from gateway.pipeline import last_user_text
from gateway.replies import FINGERPRINT_HEADER, PREDICTED_HEADER, ROUTING_HEADER, SERVED_BY_HEADER, VERSION_HEADER
from gateway.routing import sticky_id
from gateway.server import check_body

N_DRAWS = 5000


def _binomial_bounds(p: float, n: int, sigmas: float = 4.0) -> tuple[float, float]:
    """Count bounds for a binomial(n, p) at ``sigmas`` standard deviations (a false failure about once in 16,000)."""
    sd = math.sqrt(n * p * (1 - p))
    return n * p - sigmas * sd, n * p + sigmas * sd


@pytest.fixture(scope="module")
def draws() -> list[dict[str, Any]]:
    """The head of the demo's workload alone (its 36 questions; the long tail has its own test)."""
    workload = demo_workload(0, tail_numbers=0)
    return [workload.draw(i) for i in range(N_DRAWS)]


# --------------------------------------------------------------------------------------------------------------------
# Workload


def test_the_same_seed_gives_the_same_bodies_and_another_seed_others() -> None:
    first, again, other = demo_workload(7), demo_workload(7), demo_workload(8)
    assert first.requests(300) == again.requests(300)
    assert first.requests(5, start=100) == again.requests(300)[100:105]
    assert first.request(42) == again.request(42)
    differing = sum(a != b for a, b in zip(first.requests(300), other.requests(300), strict=True))
    assert differing == 300  # the user alone (1 in 200 alike) makes nearly every body differ; the texts and shares too
    assert first.request(0) is not first.request(0)  # a new dict each time: a caller may change it


def test_a_body_is_exactly_what_its_draw_says() -> None:
    workload = demo_workload(0)
    d = workload.draw(3)
    body = workload.request(3)
    system = next(t.system for t in DEMO_TEMPLATES if t.name == d["template"])
    expected = {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": d["text"]}],
        "max_tokens": 8,
        "temperature": d["temperature"],
        "user": d["user"],
        "stream": d["stream"],
    }
    if d["stream"]:
        expected["stream_options"] = {"include_usage": True}
    assert body == expected


def test_items_are_ranked_by_interleaving_the_templates() -> None:
    workload = demo_workload(0, tail_numbers=0)
    assert len(workload.items) == 36
    assert workload.items[:4] == (
        ("travel", "How do I change the date of my flight booking?"),
        ("billing", "Why was I charged twice on my invoice?"),
        ("hr", "How many vacation days do I get each year?"),
        ("travel", "How much checked baggage is included in my ticket?"),
    )
    probabilities = workload.probabilities()
    assert math.isclose(sum(probabilities), 1.0, rel_tol=1e-12)
    harmonic = sum(1 / r**1.1 for r in range(1, 37))
    assert math.isclose(probabilities[0], 1 / harmonic, rel_tol=1e-9)
    assert math.isclose(probabilities[35], 36**-1.1 / harmonic, rel_tol=1e-9)


def test_popularity_follows_the_zipf_law(draws: list[dict[str, Any]]) -> None:
    ranks = Counter(d["rank"] for d in draws)
    p = demo_workload(0, tail_numbers=0).probabilities()
    low, high = _binomial_bounds(p[0], N_DRAWS)
    assert low <= ranks[0] <= high
    top_tenth = math.ceil(0.1 * len(p))  # 4 of 36 items
    share = sum(p[:top_tenth])
    low, high = _binomial_bounds(share, N_DRAWS)
    assert low <= sum(ranks[r] for r in range(top_tenth)) <= high
    # The exact counts of this seed: a change to the drawing shows here first.
    assert [ranks[r] for r in range(6)] == [1344, 691, 394, 313, 227, 179]
    assert len(ranks) == 36


def test_greedy_paraphrase_and_stream_shares(draws: list[dict[str, Any]]) -> None:
    greedy = sum(d["greedy"] for d in draws)
    low, high = _binomial_bounds(0.7, N_DRAWS)
    assert low <= greedy <= high
    stream = sum(d["stream"] for d in draws)
    low, high = _binomial_bounds(0.2, N_DRAWS)
    assert low <= stream <= high
    paraphrasable = [d for d in draws if any(d["question"] in t.paraphrases for t in DEMO_TEMPLATES)]
    paraphrased = sum(d["paraphrased"] for d in paraphrasable)
    low, high = _binomial_bounds(0.3, len(paraphrasable))
    assert low <= paraphrased <= high
    assert all(not d["paraphrased"] for d in draws if d not in paraphrasable)
    assert all(d["temperature"] == 0.0 for d in draws if d["greedy"])
    sampled = [d["temperature"] for d in draws if not d["greedy"]]
    assert min(sampled) >= 0.7 and max(sampled) <= 1.0 and all(t == round(t, 2) for t in sampled)
    assert (greedy, stream, paraphrased, len(paraphrasable)) == (3494, 960, 1125, 3877)


def test_shares_follow_the_workload_settings() -> None:
    workload = demo_workload(3, greedy_share=1.0, paraphrase_share=0.0, stream_share=1.0)
    draws = [workload.draw(i) for i in range(200)]
    assert all(d["greedy"] and d["stream"] and not d["paraphrased"] for d in draws)
    workload = demo_workload(3, greedy_share=0.0, paraphrase_share=1.0, stream_share=0.0)
    draws = [workload.draw(i) for i in range(200)]
    assert not any(d["greedy"] or d["stream"] for d in draws)
    assert all(d["paraphrased"] == (d["question"] != d["text"]) for d in draws)
    assert all(d["paraphrased"] for d in draws if any(d["question"] in t.paraphrases for t in DEMO_TEMPLATES))


def test_every_body_is_valid_for_the_gateway() -> None:
    workload = demo_workload(0)
    for i, body in enumerate(workload.requests(1000)):
        check_body(body)
        canonical = canonical_request("chat", body)
        assert "unknown_parameters" not in canonical, i
        assert personal_data_kinds(canonical) == frozenset(), i  # else the semantic layer would be bypassed
        d = workload.draw(i)
        assert last_user_text(body) == d["text"]
        admission = response_admission(canonical)
        assert (admission.admitted, admission.reason) == ((True, "greedy") if d["greedy"] else (False, "sampling"))


def test_a_paraphrase_shares_its_question_s_semantic_partition() -> None:
    # Everything but the last message goes into the partition: a greedy paraphrase must differ only there.
    workload = demo_workload(0, greedy_share=1.0, stream_share=0.0)
    pairs = {}
    for i in range(400):
        d = workload.draw(i)
        pairs.setdefault((d["question"], d["paraphrased"]), workload.request(i))
    question = "How do I cancel my subscription?"
    plain, reworded = pairs[(question, False)], pairs[(question, True)]
    a, b = canonical_request("chat", plain), canonical_request("chat", reworded)
    assert a["messages"][:-1] == b["messages"][:-1] and a["messages"][-1] != b["messages"][-1]
    assert {k: v for k, v in a.items() if k != "messages"} == {k: v for k, v in b.items() if k != "messages"}


def test_users_spread_over_the_simulated_population(draws: list[dict[str, Any]]) -> None:
    users = Counter(d["user"] for d in draws)
    assert len(users) == 200
    assert sorted(users) == [f"user-{k:04d}" for k in range(200)]
    # Uniform: 25 each on average; the extremes of this seed, well inside Poisson spread.
    assert (min(users.values()), max(users.values())) == (11, 40)
    workload = demo_workload(0)
    assert sticky_id(workload.request(0)) == "user:" + workload.draw(0)["user"]


def test_templates_are_long_distinct_operator_prompts() -> None:
    assert [t.name for t in DEMO_TEMPLATES] == ["travel", "billing", "hr"]
    for template in DEMO_TEMPLATES:
        assert 1500 <= len(template.system) <= 2500, template.name
        lines = [line for line in template.system.splitlines() if line.strip()]
        assert len(lines) == len(set(lines)), template.name
        assert len(template.questions) == 12
        assert 4 <= len(template.paraphrases) and all(1 <= len(p) <= 2 for p in template.paraphrases.values())
    assert len({t.system for t in DEMO_TEMPLATES}) == 3
    assert len({q for t in DEMO_TEMPLATES for q in t.questions}) == 36


def test_bad_workloads_are_refused() -> None:
    with pytest.raises(ValueError, match="paraphrases of"):
        TemplateSpec("x", "system", ("q?",), {"other?": ("o?",)})
    with pytest.raises(ValueError, match="listed twice"):
        TemplateSpec("x", "system", ("q?", "q?"))
    with pytest.raises(ValueError, match="at least one template"):
        Workload(templates=(), seed=0)
    with pytest.raises(ValueError, match="unique"):
        Workload(templates=(DEMO_TEMPLATES[0], DEMO_TEMPLATES[0]), seed=0)
    with pytest.raises(ValueError, match="greedy_share"):
        demo_workload(0, greedy_share=1.5)
    with pytest.raises(ValueError, match="zipf_s"):
        demo_workload(0, zipf_s=0)
    with pytest.raises(ValueError, match=">= 0"):
        demo_workload(0).request(-1)


# --------------------------------------------------------------------------------------------------------------------
# Paraphrases through the gateway's own semantic matching


def test_paraphrases_hit_and_distinct_questions_do_not() -> None:
    embedder = default_embedder()
    # The layer's defaults are what the gateway applies when a tenant sets no threshold.
    layer = SemanticLayer(store=None, embedder=embedder)  # type: ignore[arg-type]
    assert (layer.threshold, layer.guards) == (SHIPPED_THRESHOLD, DEFAULT_GUARDS)
    texts = sorted({x for t in DEMO_TEMPLATES for x in (*t.questions, *itertools.chain(*t.paraphrases.values()))})
    vectors = dict(zip(texts, embedder.embed(texts), strict=True))

    def verdict(query: str, cached: str) -> str:
        # The decision SemanticLayer.lookup makes on each candidate.
        v = match(query, cached, similarity(vectors[query], vectors[cached]), threshold=layer.threshold,
                  guards=layer.guards, embed=embedder.embed)  # fmt: skip
        return v.reason

    for text in texts:
        assert layer.admission(text, personal_data=False) == (True, "admitted"), text
        assert semantic_admission(text) == (True, "admitted"), text
    pairs = [(q, p) for t in DEMO_TEMPLATES for q, ps in t.paraphrases.items() for p in ps]
    assert len(pairs) == 16
    assert [(p, verdict(p, q)) for q, p in pairs] == [(p, "hit") for q, p in pairs]
    for template in DEMO_TEMPLATES:
        for a, b in itertools.permutations(template.questions, 2):
            assert verdict(a, b) != "hit", (a, b)
        # A paraphrase must not be taken for another question either.
        for question, rewordings in template.paraphrases.items():
            for p, other in itertools.product(rewordings, template.questions):
                if other != question:
                    assert verdict(p, other) != "hit", (p, other)


def test_the_long_tail_asks_about_cases_by_number_and_never_as_a_cached_neighbour() -> None:
    workload = demo_workload(0)
    items = workload.items
    assert len(items) == 36 + 6 * DEMO_TAIL_NUMBERS
    assert items[36:43] == (
        ("travel", "Which seat is assigned on booking 1000?"),
        ("billing", "Why was invoice 1000 not paid?"),
        ("hr", "Who approves expense report 1000?"),
        ("travel", "Is breakfast included in hotel reservation 1000?"),
        ("billing", "Which items are billed on invoice 1000?"),
        ("hr", "Where is the form for leave request 1000?"),
        ("travel", "Which seat is assigned on booking 1001?"),
    )
    assert items[-1] == ("hr", f"Where is the form for leave request {1000 + DEMO_TAIL_NUMBERS - 1}?")
    tail_share = math.fsum(workload.probabilities()[36:])
    draws = [workload.draw(i) for i in range(N_DRAWS)]
    tail = [d for d in draws if d["tail"]]
    low, high = _binomial_bounds(tail_share, N_DRAWS)
    assert low <= len(tail) <= high
    assert (len(tail), len({d["text"] for d in tail})) == (2301, 1372)  # this seed's exact counts
    assert all(not d["paraphrased"] and d["rank"] >= 36 for d in tail)
    assert all(not d["tail"] for d in draws if d["rank"] < 36)
    # Two cases are two questions: the number guard keeps the semantic cache from answering one with the other.
    embedder = default_embedder()
    layer = SemanticLayer(store=None, embedder=embedder)  # type: ignore[arg-type]
    for template in DEMO_TEMPLATES:
        for slot in template.slot_questions:
            a, b = slot.replace("{n}", "1042"), slot.replace("{n}", "1043")
            va, vb = embedder.embed([a, b])
            v = match(a, b, similarity(va, vb), threshold=layer.threshold, guards=layer.guards, embed=embedder.embed)
            assert v.reason != "hit", (a, b, v)
            assert semantic_admission(a) == (True, "admitted"), a
    with pytest.raises(ValueError, match="tail_numbers must lie in 0..8999"):
        demo_workload(0, tail_numbers=9000)
    with pytest.raises(ValueError, match=r"needs exactly one \{n\}"):
        TemplateSpec(name="x", system="s", questions=("q?",), slot_questions=("No number here?",))


# --------------------------------------------------------------------------------------------------------------------
# The runner against a server that answers like the gateway


FP = {"v1": "fp_00000000000000a1", "v2": "fp_00000000000000b2"}


@dataclass
class Script:
    """What the fake gateway does with its k-th request (by arrival), and the tally of what it answered."""

    delay_s: float = 0.0
    count: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    served_by: Counter[str] = field(default_factory=Counter)
    versions: Counter[str] = field(default_factory=Counter)
    cross: int = 0
    streams: int = 0
    routing: Counter[str] = field(default_factory=Counter)
    predictions: Counter[str] = field(default_factory=Counter)
    connections: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def decide(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            k = self.count
            self.count += 1
            version = "v1" if int(body["user"][-4:]) % 2 == 0 else "v2"
            if k % 10 == 3:
                self.statuses["429:rate_limited"] += 1
                return {"status": 429, "code": "rate_limited"}
            if k % 10 == 7:
                self.statuses["503"] += 1
                return {"status": 503, "code": None}
            layer = "semantic" if k % 10 == 5 else ("response" if body["temperature"] == 0 and k % 2 == 0 else "engine")
            # k % 10 == 9: an answer computed by the other version; k % 20 == 1: no system_fingerprint at all.
            answer_fp = FP["v2" if version == "v1" else "v1"] if k % 10 == 9 else FP[version]
            if k % 20 == 1:
                answer_fp = None
            self.statuses["200"] += 1
            self.served_by[layer] += 1
            self.versions[version] += 1
            self.cross += answer_fp != FP[version]
            self.streams += bool(body.get("stream"))
            routing: dict[str, str] = {}
            if layer == "engine":
                # Engine answers say how their engine was chosen: every 4th by affinity (the index stale), the
                # others precise, predicting the 384 cached tokens reported, or 416 (one block more) every 4th.
                if k % 4 == 0:
                    routing = {"x-kvcp-routing": "approximate; reason=index:stale"}
                    self.routing["approximate:index:stale"] += 1
                else:
                    predicted = 416 if k % 4 == 3 else 384
                    routing = {"x-kvcp-routing": "precise", "x-kvcp-predicted-cached-tokens": str(predicted)}
                    self.routing["precise"] += 1
                    self.predictions["over" if predicted == 416 else "exact"] += 1
            return {"status": 200, "layer": layer, "version": version, "fp": answer_fp, "routing": routing}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: with Nagle's algorithm the body waits for the client's delayed ACK
    # (40 ms on Linux), which would make every keep-alive answer slow.
    disable_nagle_algorithm = True
    script: Script

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def setup(self) -> None:
        super().setup()
        with self.script.lock:
            self.script.connections += 1

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        assert self.path == "/v1/chat/completions" and self.headers["authorization"] == "Bearer sk-test"
        if self.script.delay_s:
            time.sleep(self.script.delay_s)
        d = self.script.decide(body)
        if d["status"] != 200:
            payload = b"upstream unavailable" if d["code"] is None else json.dumps(
                {"error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": d["code"]}}
            ).encode()  # fmt: skip
            self._send(d["status"], payload, "application/json", {})
            return
        headers = {"x-kvcp-served-by": d["layer"], "x-kvcp-version": d["version"], "x-kvcp-fingerprint": FP[d["version"]],
                   **d["routing"]}  # fmt: skip
        usage = {"prompt_tokens": 400, "completion_tokens": 8, "prompt_tokens_details": {"cached_tokens": 384}}
        fp_field = {} if d["fp"] is None else {"system_fingerprint": d["fp"]}
        if not body.get("stream"):
            message = {"role": "assistant", "content": "Hello"}
            answer = {
                "id": "c", "object": "chat.completion", "model": body["model"], **fp_field, "usage": usage,
                "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
            }  # fmt: skip
            self._send(200, json.dumps(answer).encode(), "application/json", headers)
            return
        right = {"system_fingerprint": FP[d["version"]]}
        chunks = [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], **right},
            {"choices": [{"index": 0, "delta": {"content": "Hel"}}], **right},
            {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}], **right},
            # Only the last chunk says which state computed the answer when it differs: any chunk counts.
            {"choices": [], "usage": usage, **fp_field},
        ]
        payload = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
        self._send(200, payload, "text/event-stream", headers)

    def _send(self, status: int, payload: bytes, content_type: str, headers: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(payload)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def fake_gateway() -> Iterator[tuple[str, Script]]:
    script = Script()
    handler = type("Handler", (_Handler,), {"script": script})
    # The default listen backlog (5) makes a burst of new keep-alive connections wait for SYN retries (1 s).
    server = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 64})(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", script
    finally:
        server.shutdown()
        server.server_close()


def test_the_runner_counts_exactly_what_the_gateway_answered(fake_gateway: tuple[str, Script]) -> None:
    url, script = fake_gateway
    lines: list[str] = []
    workload = demo_workload(0, stream_share=0.3)
    runner = TrafficRunner(url, "sk-test", workload, rate_per_s=100, max_in_flight=16, log=lines.append, max_requests=80)
    runner.start()
    assert runner.wait(60)
    stats = runner.stop()
    assert stats.sent + stats.dropped == 80
    assert stats.sent == script.count == stats.answered + stats.error_count
    assert stats.answered == script.statuses["200"]
    assert stats.errors == {k: v for k, v in sorted(script.statuses.items()) if k != "200"}
    # Arrival k decides the answer, so the counts are a function of the number sent.
    sent = range(stats.sent)
    assert stats.errors.get("429:rate_limited", 0) == sum(k % 10 == 3 for k in sent)
    assert stats.errors.get("503", 0) == sum(k % 10 == 7 for k in sent)
    assert stats.served_by == dict(sorted(script.served_by.items()))
    assert stats.served_by.get("semantic", 0) == sum(k % 10 == 5 for k in sent)
    assert stats.by_version == dict(sorted(script.versions.items()))
    assert stats.cross_version == script.cross == sum(k % 10 == 9 or k % 20 == 1 for k in sent)
    assert script.streams > 0
    assert len(stats.cross_version_examples) == min(stats.cross_version, CROSS_VERSION_EXAMPLES)
    for example in stats.cross_version_examples:
        assert example.routed_fingerprint == FP[example.version]  # type: ignore[index]
        assert example.answer_fingerprint != example.routed_fingerprint
        assert workload.request(example.index)["user"][-4:] in {f"{u:04d}" for u in range(200)}
        assert int(workload.request(example.index)["user"][-4:]) % 2 == (0 if example.version == "v1" else 1)
    assert stats.prompt_tokens == 400 * stats.answered and stats.cached_tokens == 384 * stats.answered
    assert stats.completion_tokens == 8 * stats.answered
    assert stats.engine_prompt_tokens == 400 * stats.served_by.get("engine", 0)
    assert stats.prefix_cached_token_ratio == 384 / 400
    assert stats.response_hit_ratio == stats.served_by["response"] / stats.answered
    assert stats.semantic_hit_ratio == stats.served_by["semantic"] / stats.answered
    assert {k: v["count"] for k, v in stats.latency_ms.items()} == stats.served_by
    assert all(0 < v["p50"] <= v["p95"] for v in stats.latency_ms.values())
    assert lines[-1] == format_stats_line(stats)
    assert json.loads(json.dumps(stats.as_dict()))["cross_version"] == stats.cross_version
    # How engines were chosen, and the precise choices' predictions against the cached tokens reported.
    assert stats.routing == dict(sorted(script.routing.items())) and sum(stats.routing.values()) == stats.served_by["engine"]
    assert stats.predictions == dict(sorted(script.predictions.items()))
    assert stats.prediction_accuracy == script.predictions["exact"] / sum(script.predictions.values())


def test_phases_split_the_run(fake_gateway: tuple[str, Script]) -> None:
    url, script = fake_gateway
    runner = TrafficRunner(url, "sk-test", demo_workload(1), rate_per_s=50, max_requests=60)
    runner.start("steady")
    deadline = time.monotonic() + 30
    # Mark once 20 requests were due (sent or dropped), or at the end if the schedule is already through.
    while (lambda s: s.sent + s.dropped)(runner.stats()) < 20:
        assert time.monotonic() < deadline, "the runner scheduled nothing for 30 s"
        time.sleep(0.005)
    runner.mark("release")
    assert runner.wait(60)
    whole = runner.stop()
    assert runner.phases == ("steady", "release")
    parts = [runner.stats("steady"), runner.stats("release")]
    assert [p.phase for p in parts] == ["steady", "release"] and whole.phase is None
    due = [p.sent + p.dropped for p in parts]
    assert due[0] >= 20 and sum(due) == 60
    for name in ("sent", "answered", "dropped", "cross_version", "prompt_tokens"):
        assert sum(getattr(p, name) for p in parts) == getattr(whole, name), name
    for name in ("errors", "served_by", "by_version"):
        assert sum((Counter(getattr(p, name)) for p in parts), Counter()) == Counter(getattr(whole, name)), name
    assert whole.sent == script.count
    with pytest.raises(KeyError):
        runner.stats("nope")


def test_the_most_recently_used_client_sends_next_so_its_connection_is_reused(fake_gateway: tuple[str, Script]) -> None:
    url, script = fake_gateway
    # Requests 0.2 s apart, answered in milliseconds: one client's kept-alive connection serves them all. Taken in
    # turn, 8 clients would each open one and sit idle 1.6 s between uses (at the demo's 2/s: 4 s, racing the
    # server's idle close). At most 2: a request slower than 0.2 s on a loaded machine takes a second client.
    runner = TrafficRunner(url, "sk-test", demo_workload(3), rate_per_s=5, max_in_flight=8, max_requests=10)
    runner.start()
    assert runner.wait(60)
    stats = runner.stop()
    assert (stats.sent, stats.answered + stats.error_count, script.count) == (10, 10, 10)
    assert 1 <= script.connections <= 2, script.connections


def test_a_busy_gateway_makes_the_runner_drop_not_queue(fake_gateway: tuple[str, Script]) -> None:
    url, script = fake_gateway
    script.delay_s = 0.5
    runner = TrafficRunner(url, "sk-test", demo_workload(2), rate_per_s=20, max_in_flight=1, max_requests=8)
    runner.start()
    assert runner.wait(60)
    stats = runner.stop()
    assert stats.dropped > 0
    assert stats.sent + stats.dropped == 8
    assert stats.sent == script.count == stats.answered + stats.error_count


def test_an_unreachable_gateway_is_counted_as_transport_errors() -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), _Handler) as probe:
        port = probe.server_address[1]  # free once closed
    runner = TrafficRunner(f"http://127.0.0.1:{port}", "sk-test", demo_workload(0), rate_per_s=50, max_requests=3)
    runner.start()
    assert runner.wait(60)
    stats = runner.stop()
    assert (stats.sent, stats.answered, stats.errors, stats.dropped) == (3, 0, {"transport:ConnectError": 3}, 0)
    assert stats.served_by == {} and stats.latency_ms == {}


def test_the_log_line_and_ratios_of_a_known_stats() -> None:
    stats = TrafficStats(
        phase="canary", sent=10, answered=8, dropped=1, errors={"429:rate_limited": 2},
        served_by={"engine": 2, "response": 6}, by_version={"v1": 6, "v2": 2}, cross_version=1,
        cross_version_examples=(CrossVersionAnswer(4, "v2", "fp_b", "fp_a", "response"),),
        prompt_tokens=800, cached_tokens=700, completion_tokens=64, engine_prompt_tokens=200, engine_cached_tokens=100,
        latency_ms={"engine": {"count": 2, "p50": 412.4, "p95": 500.0}, "response": {"count": 6, "p50": 3.2, "p95": 4.0}},
        duration_s=2.0, rate_per_s=5.0,
    )  # fmt: skip
    assert format_stats_line(stats) == (
        "phase=canary rps=5.0 sent=10 ok=8 dropped=1 errors=2 served_by[engine=25% response=75%]"
        " versions[v1=75% v2=25%] p50_ms[engine=412 response=3] cross_version=1"
    )
    assert (stats.response_hit_ratio, stats.semantic_hit_ratio, stats.prefix_cached_token_ratio) == (0.75, 0.0, 0.5)
    as_dict = stats.as_dict()
    assert as_dict["cross_version_examples"] == [
        {"index": 4, "version": "v2", "routed_fingerprint": "fp_b", "answer_fingerprint": "fp_a", "served_by": "response"}
    ]
    assert as_dict["error_count"] == 2


def test_the_runner_reads_the_gateway_s_own_header_names() -> None:
    names = (demo_traffic.SERVED_BY_HEADER, demo_traffic.VERSION_HEADER, demo_traffic.FINGERPRINT_HEADER,
             demo_traffic.ROUTING_HEADER, demo_traffic.PREDICTED_HEADER)  # fmt: skip
    assert names == (SERVED_BY_HEADER, VERSION_HEADER, FINGERPRINT_HEADER, ROUTING_HEADER, PREDICTED_HEADER)


def test_the_runner_refuses_bad_settings_and_misuse() -> None:
    workload = demo_workload(0)
    with pytest.raises(ValueError, match="rate_per_s"):
        TrafficRunner("http://x", "k", workload, rate_per_s=0)
    with pytest.raises(ValueError, match="max_in_flight"):
        TrafficRunner("http://x", "k", workload, rate_per_s=1, max_in_flight=0)
    runner = TrafficRunner("http://x", "k", workload, rate_per_s=1)
    with pytest.raises(RuntimeError, match="not started"):
        runner.stats()
    with pytest.raises(RuntimeError, match="before marking"):
        runner.mark("x")


def test_the_runner_logs_each_interval_and_the_whole_run(fake_gateway: tuple[str, Script]) -> None:
    url, _ = fake_gateway
    lines: list[str] = []
    runner = TrafficRunner(url, "sk-test", demo_workload(4), rate_per_s=50, log=lines.append, log_every_s=0.1, max_requests=20)
    runner.start("warm")
    assert runner.wait(60)
    stats = runner.stop()
    # The last request is due 0.38 s after the start, so the scheduler runs through at least three 0.1 s intervals.
    intervals, final = lines[:-1], lines[-1]
    assert len(intervals) >= 3
    assert all(line.startswith("phase=warm rps=") and " cross_version=" in line for line in intervals)
    assert final == format_stats_line(stats) and final.startswith("phase=all rps=")
