"""Live traffic for the gateway: a seeded workload model and an open-loop runner that measures what came back.

The workload (:class:`Workload`, :func:`demo_workload`) is what the demo and
operators send while a release ships: a few prompt templates, each a long
shared system prompt (what the engines' prefix cache keeps) and short user
questions drawn by a Zipf law, so a few questions dominate. Most requests are
greedy (``temperature`` 0: repeats are answered by the gateway's response
cache), the rest sampled (never cached exactly); some popular questions are
asked in other words (the semantic cache's paraphrase hits). Every request
names one of a fixed set of simulated end users, which is what keeps a user
on one side of a gray release (:func:`gateway.routing.sticky_id`).

The runner (:class:`TrafficRunner`) sends request ``i`` at ``start + i / rate``
from a bounded pool of workers; a request due while every worker is busy is
counted as dropped, never queued, so the offered rate is what it says even on
a small host. Per answer it reads the layer that served it, the model version
the gateway routed to and that version's fingerprint, and the fingerprint of
the model state that computed the answer: a 200 answer whose two fingerprints
differ is a *cross-version answer* (the release's correctness signal).
"""

from __future__ import annotations

import bisect
import json
import math
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import httpx

from inference.keepalive import CLIENT_IDLE_S

__all__ = [
    "CROSS_VERSION_EXAMPLES",
    "DEMO_TAIL_NUMBERS",
    "FINGERPRINT_HEADER",
    "SERVED_BY_HEADER",
    "VERSION_HEADER",
    "CrossVersionAnswer",
    "TemplateSpec",
    "TrafficRunner",
    "TrafficStats",
    "Workload",
    "demo_workload",
    "format_stats_line",
]

#: Which layer answered: ``response``, ``semantic`` or ``engine`` (gateway/server.py ``SERVED_BY_HEADER``).
SERVED_BY_HEADER = "x-kvcp-served-by"
#: Label of the model version the gateway routed the request to.
VERSION_HEADER = "x-kvcp-version"
#: Fingerprint of that version (``fp_`` and 16 hex digits).
FINGERPRINT_HEADER = "x-kvcp-fingerprint"
#: How the gateway chose the engine, and the cached prompt tokens a precise choice predicted (gateway.replies).
ROUTING_HEADER, PREDICTED_HEADER = "x-kvcp-routing", "x-kvcp-predicted-cached-tokens"
#: Cross-version answers kept as examples, per phase and overall (the first ones to complete).
CROSS_VERSION_EXAMPLES = 20
#: Key of an answer without a served-by or version header.
UNKNOWN = "unknown"


# --------------------------------------------------------------------------------------------------------------------
# Workload


@dataclass(frozen=True)
class TemplateSpec:
    """One prompt template: a long shared system prompt and the short questions asked under it.

    Attributes:
        name: short identifier (``"travel"``), unique within a workload.
        system: the system prompt, the same in every request of the template.
        questions: the user questions, most popular first within the template.
        paraphrases: question -> 1 or more rewordings with the same meaning.
        slot_questions: questions about one case, with ``{n}`` where its number goes (a booking, an
            invoice, a ticket): the long tail of a workload, each number a question of its own.

    Raises:
        ValueError: empty name, system or question list, a duplicate question, or a paraphrase of a
            question the template does not ask (or an empty rewording list), a slot question without
            exactly one ``{n}``.
    """

    name: str
    system: str
    questions: tuple[str, ...]
    paraphrases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    slot_questions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or not self.system.strip() or not self.questions:
            raise ValueError(f"template {self.name!r}: name, system and questions must be non-empty")
        if len(set(self.questions)) != len(self.questions):
            raise ValueError(f"template {self.name!r}: a question is listed twice")
        for question, rewordings in self.paraphrases.items():
            if question not in self.questions or not rewordings:
                raise ValueError(f"template {self.name!r}: paraphrases of {question!r} need the question and a rewording")
        for question in self.slot_questions:
            if question.count("{n}") != 1 or question.replace("{n}", "").count("{") or "}" in question.replace("{n}", ""):
                raise ValueError(f"template {self.name!r}: slot question {question!r} needs exactly one {{n}}")


@dataclass(frozen=True)
class Workload:
    """A deterministic stream of chat-completion request bodies.

    Items are the (template, question) pairs, ranked by interleaving the
    templates (rank 0 is template 0's first question, rank 1 template 1's
    first, ...), then the long tail: every slot question with each of
    ``tail_numbers`` case numbers (number by number, interleaving the
    templates' slot questions). An item is drawn with probability
    proportional to ``1 / (rank + 1) ** zipf_s``, so the head repeats (what
    the response and semantic caches answer) while the tail's questions are
    rarely asked twice (what reaches the engines, whose prefix cache still
    holds the template's system prompt). Request ``i`` depends only on
    ``seed`` and ``i`` (its own ``random.Random``), so any request can be
    rebuilt alone.

    Attributes:
        templates: at least one template.
        seed: any integer.
        zipf_s: the Zipf exponent (> 0; larger is more skewed).
        users: number of simulated end users, ``user`` ``"user-0000"`` .. drawn uniformly.
        greedy_share: probability of ``temperature`` 0; else uniform in [0.7, 1.0], two decimals.
        paraphrase_share: probability that a question with paraphrases is asked in one of them
            (uniformly chosen); questions without paraphrases are always asked as written.
        stream_share: probability of ``stream: true`` (with ``stream_options.include_usage``).
        max_tokens: the answer's length limit.
        model: the ``model`` of every request.
        tail_numbers: case numbers per slot question (0: no tail); number ``k`` is written ``1000 + k``.

    Raises:
        ValueError: no template, duplicate template names, ``zipf_s`` <= 0, ``users`` < 1,
            a share outside [0, 1], ``max_tokens`` < 1, or ``tail_numbers`` outside 0..8999.
    """

    templates: Sequence[TemplateSpec]
    seed: int
    zipf_s: float = 1.1
    users: int = 200
    greedy_share: float = 0.7
    paraphrase_share: float = 0.3
    stream_share: float = 0.2
    max_tokens: int = 8
    model: str = "tiny"
    tail_numbers: int = 0
    _items: tuple[tuple[int, int, int | None], ...] = field(init=False, repr=False, compare=False)
    _cumulative: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.templates:
            raise ValueError("a workload needs at least one template")
        if len({t.name for t in self.templates}) != len(self.templates):
            raise ValueError("template names must be unique")
        if not self.zipf_s > 0:
            raise ValueError(f"zipf_s must be > 0, got {self.zipf_s!r}")
        if self.users < 1 or self.max_tokens < 1:
            raise ValueError(f"users and max_tokens must be >= 1, got {self.users!r} and {self.max_tokens!r}")
        for name in ("greedy_share", "paraphrase_share", "stream_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)!r}")
        if not 0 <= self.tail_numbers <= 8999:  # four-digit case numbers: never read as a phone or card number
            raise ValueError(f"tail_numbers must lie in 0..8999, got {self.tail_numbers!r}")
        object.__setattr__(self, "templates", tuple(self.templates))
        longest = max(len(t.questions) for t in self.templates)
        head = [(t, q, None) for q in range(longest) for t in range(len(self.templates)) if q < len(self.templates[t].questions)]
        slots = max((len(t.slot_questions) for t in self.templates), default=0)
        tail = [
            (t, q, k)
            for k in range(self.tail_numbers)
            for q in range(slots)
            for t in range(len(self.templates))
            if q < len(self.templates[t].slot_questions)
        ]
        items = tuple(head + tail)
        weights = [1.0 / (rank + 1) ** self.zipf_s for rank in range(len(items))]
        total = math.fsum(weights)
        running, cumulative = 0.0, []
        for w in weights:
            running += w / total
            cumulative.append(running)
        cumulative[-1] = 1.0  # no draw may fall past the last item through rounding
        object.__setattr__(self, "_items", items)
        object.__setattr__(self, "_cumulative", tuple(cumulative))

    @property
    def items(self) -> tuple[tuple[str, str], ...]:
        """(template name, question as asked) of every item, by popularity rank (rank 0 first)."""
        return tuple((self.templates[t].name, self._question(t, q, k)) for t, q, k in self._items)

    def _question(self, t: int, q: int, k: int | None) -> str:
        template = self.templates[t]
        return template.questions[q] if k is None else template.slot_questions[q].replace("{n}", str(1000 + k))

    def probabilities(self) -> tuple[float, ...]:
        """The Zipf probability of each item of :attr:`items`, same order; they sum to 1."""
        previous = 0.0
        out = []
        for c in self._cumulative:
            out.append(c - previous)
            previous = c
        return tuple(out)

    def draw(self, i: int) -> dict[str, Any]:
        """What request ``i`` asks, before it becomes a body.

        Returns:
            ``{"rank", "template", "question", "text", "paraphrased", "tail", "greedy", "temperature", "stream",
            "user"}``: ``text`` is what the user message says (the question or a paraphrase of it); ``tail``
            says the question is a slot question of the long tail.

        Raises:
            ValueError: ``i`` < 0.
        """
        if i < 0:
            raise ValueError(f"request index must be >= 0, got {i}")
        # A string seed is hashed (SHA-512) by random.Random, the same on every platform and run.
        rng = random.Random(f"kvcp-traffic:{self.seed}:{i}")
        # Every draw is made whether or not it is used, so one share never shifts the others' draws.
        u_item, u_greedy, u_para, u_stream = rng.random(), rng.random(), rng.random(), rng.random()
        user = rng.randrange(self.users)
        temperature = round(rng.uniform(0.7, 1.0), 2)
        para_pick = rng.random()
        rank = min(bisect.bisect_right(self._cumulative, u_item), len(self._items) - 1)
        t, q, k = self._items[rank]
        template = self.templates[t]
        question = self._question(t, q, k)
        rewordings = tuple(template.paraphrases.get(question, ())) if k is None else ()
        paraphrased = bool(rewordings) and u_para < self.paraphrase_share
        text = rewordings[int(para_pick * len(rewordings))] if paraphrased else question
        greedy = u_greedy < self.greedy_share
        return {
            "rank": rank,
            "template": template.name,
            "question": question,
            "text": text,
            "paraphrased": paraphrased,
            "tail": k is not None,
            "greedy": greedy,
            "temperature": 0.0 if greedy else temperature,
            "stream": u_stream < self.stream_share,
            "user": f"user-{user:04d}",
        }

    def request(self, i: int) -> dict[str, Any]:
        """The ``i``-th request body for ``POST /v1/chat/completions`` (a new dict; same seed and ``i``, same body).

        Raises:
            ValueError: ``i`` < 0.
        """
        d = self.draw(i)
        template = next(t for t in self.templates if t.name == d["template"])
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "system", "content": template.system}, {"role": "user", "content": d["text"]}],
            "max_tokens": self.max_tokens,
            "temperature": d["temperature"],
            "user": d["user"],
            "stream": d["stream"],
        }
        if d["stream"]:
            body["stream_options"] = {"include_usage": True}
        return body

    def requests(self, n: int, start: int = 0) -> list[dict[str, Any]]:
        """Bodies ``start`` .. ``start + n - 1``.

        Raises:
            ValueError: ``n`` or ``start`` < 0.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return [self.request(start + k) for k in range(n)]


_TRAVEL_SYSTEM = """\
You are the virtual agent of Northwind Travel's corporate travel desk. You help employees of our client companies \
plan, book and change business trips: flights, hotels, rail tickets and rental cars.

How to answer:
- Be brief and practical. Give the steps the traveller has to take, in order, and say which screen of the booking \
portal they are on (My Trips, Profile, Expenses or Help).
- Quote the travel policy of the traveller's company only as it appears in the policy excerpt of the conversation; \
never invent fares, allowances or fees. If a rule is not in the excerpt, say that the travel coordinator of their \
company decides.
- Flights: economy class for trips under six hours, premium economy above, business class only with written approval \
of a director. Changes to a ticket go through the desk so that the company's negotiated fare is kept.
- Hotels: book within the nightly cap of the destination city. Reservations made through the portal can be cancelled \
without a fee until the hotel's stated deadline; later cancellations are charged by the hotel.
- Ground transport: rail is preferred for journeys under four hours. Rental cars are compact category unless three \
or more colleagues travel together.
- Documents: travellers are responsible for passports and visas. Point them to the embassy of the destination \
country and offer the visa service partner, whose fee is paid by the company.
- Safety: if a traveller reports an emergency, give the 24-hour assistance line shown in the portal's Help screen \
first and only then anything else.

Tone: friendly and calm, like a colleague who has booked a thousand trips. Do not use marketing language, do not \
upsell, and do not discuss destinations as holiday suggestions. Keep every answer under 120 words unless the \
traveller asks for detail. Answer in the language of the question.
"""

_BILLING_SYSTEM = """\
You are the billing support assistant of Fabrikam Cloud, a software-as-a-service product for small teams. You answer \
account owners' questions about plans, invoices, payments, taxes and refunds.

Ground rules:
1. You can explain how billing works and where things are in the Billing section of the dashboard, but you cannot \
see or change a customer's account. For anything that needs an account change, tell the customer which button to \
use or to open a ticket with the billing team from the dashboard.
2. Plans are billed per seat. Monthly plans renew on the same day each month; annual plans are paid up front and \
carry a discount of two months. Seats added during a period are charged pro rata on the next invoice.
3. Invoices are issued as PDF documents under Billing, Invoices. Each invoice lists the plan, the seats, the period, \
the tax and the payment method. Customers can set the company name, tax number and billing address printed on them.
4. Payments: cards and bank transfer for annual plans. A failed card payment is retried three times over a week \
before the account is paused; explain how to update the card and retry at once.
5. Taxes: sales tax or VAT is added according to the billing address; customers with a valid business tax number \
in a reverse-charge country are not charged VAT.
6. Refunds: the billing team decides. Explain the policy (unused time on annual plans is refunded pro rata within \
thirty days of renewal; monthly plans are not refunded) and how to ask.
7. Never ask for card numbers, security codes or passwords, and tell the customer never to paste them into the chat.

Style: plain sentences, no jargon, at most five short steps. If the question is not about billing, say so politely \
and point to the general help center.
"""

_HR_SYSTEM = """\
You are the HR policy desk of Contoso Manufacturing. Employees ask you about leave, working arrangements, pay \
administration, benefits, conduct and training. You answer from the employee handbook, whose relevant sections \
are summarised here.

Leave: full-time employees accrue paid vacation monthly; part-time employees accrue it in proportion to their \
contracted hours. Vacation is requested in the HR portal and approved by the line manager. Sickness is reported to \
the line manager before the start of the shift and recorded in the portal on return. Parental leave follows the \
statutory scheme, topped up by the company as described in the handbook's family section.

Working arrangements: office and plant roles have fixed shifts. Office roles may work remotely up to the number of \
days agreed with the manager, recorded in the portal. Safety footwear and protective equipment are required on the \
plant floor; the office dress code is business casual.

Pay and expenses: payslips are in the portal. Expenses are submitted with receipts through the expense form and \
approved by the manager; the finance team reimburses them with the next payroll.

Benefits: health insurance enrolment happens in the first month of employment or after a qualifying life event. \
The training budget covers courses related to the employee's role, approved by the manager.

Conduct: concerns about harassment, discrimination or safety can be raised with the manager, with HR business \
partners, or anonymously through the ethics hotline listed in the portal. Retaliation is never tolerated.

How to answer: cite the handbook section you rely on by its title, keep answers short and neutral, do not give legal \
advice, and for individual cases (a specific salary, a dispute, a medical situation) refer the employee to their \
HR business partner.
"""

#: The demo's templates: three tenants' assistants with distinct system prompts and question sets.
DEMO_TEMPLATES: tuple[TemplateSpec, ...] = (
    TemplateSpec(
        name="travel",
        system=_TRAVEL_SYSTEM,
        questions=(
            "How do I change the date of my flight booking?",
            "How much checked baggage is included in my ticket?",
            "Can I get a refund if I cancel my hotel reservation?",
            "Do I need a visa for a business trip abroad?",
            "How do I request a seat upgrade?",
            "What documents should I show at the check-in desk?",
            "How do I book a rental car for my trip?",
            "Are pets allowed in the cabin?",
            "How do I file a claim for lost luggage?",
            "Can a child travel with me on a business trip?",
            "How do I add my frequent flyer number to a booking?",
            "What happens if I miss my connecting flight?",
        ),
        paraphrases={
            "How do I change the date of my flight booking?": (
                "How can I change the date of my flight booking?",
                "How do I change my flight booking's date?",
            ),
            "How much checked baggage is included in my ticket?": ("How much checked baggage does my ticket include?",),
            "Can I get a refund if I cancel my hotel reservation?": ("If I cancel my hotel reservation, can I get a refund?",),
            "Do I need a visa for a business trip abroad?": ("Is a visa required for a business trip abroad?",),
        },
        slot_questions=(
            "Which seat is assigned on booking {n}?",
            "Is breakfast included in hotel reservation {n}?",
        ),
    ),
    TemplateSpec(
        name="billing",
        system=_BILLING_SYSTEM,
        questions=(
            "Why was I charged twice on my invoice?",
            "How do I update the payment card on my account?",
            "How do I download a copy of my invoice?",
            "How do I cancel my subscription?",
            "Can I switch to annual billing?",
            "What payment methods do you accept?",
            "How is tax calculated on my bill?",
            "Can I get a refund for an unused month?",
            "Why did my card payment fail?",
            "How do I change the billing address printed on invoices?",
            "Do you offer discounts for nonprofits?",
            "How do I apply a promo code?",
        ),
        paraphrases={
            "Why was I charged twice on my invoice?": ("Why does my invoice show that I was charged twice?",),
            "How do I update the payment card on my account?": (
                "How can I update the payment card on my account?",
                "How do I update my account's payment card?",
            ),
            "How do I download a copy of my invoice?": ("How can I download a copy of my invoice?",),
            "How do I cancel my subscription?": (
                "How can I cancel my subscription?",
                "What are the steps to cancel my subscription?",
            ),
        },
        slot_questions=(
            "Why was invoice {n} not paid?",
            "Which items are billed on invoice {n}?",
        ),
    ),
    TemplateSpec(
        name="hr",
        system=_HR_SYSTEM,
        questions=(
            "How many vacation days do I get each year?",
            "How do I report a sick day?",
            "What is the parental leave policy?",
            "Can I work from home?",
            "How do I submit an expense report?",
            "How do I request time off for a family event?",
            "What is the dress code in the office?",
            "How does the performance review process work?",
            "Who do I contact about a harassment concern?",
            "How do I enroll in the health insurance plan?",
            "Is there a budget for training courses?",
            "How do I update my emergency contact details?",
        ),
        paraphrases={
            "How many vacation days do I get each year?": (
                "How many days of vacation do I get each year?",
                "How many vacation days do I get per year?",
            ),
            "How do I report a sick day?": ("How should I report a sick day?",),
            "What is the parental leave policy?": ("What does the parental leave policy say?",),
            "Can I work from home?": ("Am I able to work from home?",),
        },
        slot_questions=(
            "Who approves expense report {n}?",
            "Where is the form for leave request {n}?",
        ),
    ),
)


#: Case numbers per slot question in the demo's workload: 6 slot questions x 2,000 numbers give a tail of
#: 12,000 items, which a Zipf law (s = 1.1) over the 12,036 items draws 46 % of the time; over the first
#: 800 requests of seed 0, 401 ask something not asked before (the engines' share of a warm gateway).
DEMO_TAIL_NUMBERS = 2000


def demo_workload(seed: int = 0, **overrides: Any) -> Workload:
    """The demo's workload: :data:`DEMO_TEMPLATES` (travel desk, billing support, HR policy desk) at the defaults,
    with a long tail of :data:`DEMO_TAIL_NUMBERS` case numbers per slot question.

    Args:
        seed: the workload's seed.
        overrides: any other :class:`Workload` field (``greedy_share=0.9``, ``model="tiny-v2"``, ...).

    Raises:
        ValueError: as :class:`Workload`.
    """
    return Workload(templates=DEMO_TEMPLATES, seed=seed, **{"tail_numbers": DEMO_TAIL_NUMBERS, **overrides})


# --------------------------------------------------------------------------------------------------------------------
# Statistics


@dataclass(frozen=True)
class CrossVersionAnswer:
    """A 200 answer computed by another model state than the version it was routed to.

    Attributes:
        index: the request's index in the workload.
        version: ``x-kvcp-version`` (the routed version's label), or None when absent.
        routed_fingerprint: ``x-kvcp-fingerprint``, or None.
        answer_fingerprint: the body's ``system_fingerprint`` (a stream's first differing one), or None.
        served_by: ``x-kvcp-served-by``, or None.
    """

    index: int
    version: str | None
    routed_fingerprint: str | None
    answer_fingerprint: str | None
    served_by: str | None


@dataclass(frozen=True)
class TrafficStats:
    """What came back over one phase (or the whole run). A snapshot: later answers do not change it.

    Attributes:
        phase: the phase's name, None for the whole run.
        sent: requests sent (each ends answered or as an error, once it completes).
        answered: 200 answers that could be read.
        dropped: requests due while every worker was busy (never sent).
        errors: ``"<status>"`` or ``"<status>:<OpenAI error code>"`` for HTTP errors, ``"transport:<exception>"``
            for a failed connection or timeout, ``"client:<exception>"`` for anything else reading the answer raised,
            ``"unreadable"`` for a 200 whose body could not be parsed -> count.
        served_by: layer (``x-kvcp-served-by``; ``unknown`` without it) -> 200 answers.
        by_version: routed version label (``x-kvcp-version``; ``unknown`` without it) -> 200 answers.
        cross_version: 200 answers whose ``system_fingerprint`` differs from ``x-kvcp-fingerprint`` or lacks either.
        cross_version_examples: the first :data:`CROSS_VERSION_EXAMPLES` of those, in completion order.
        prompt_tokens, cached_tokens, completion_tokens: sums of ``usage`` over 200 answers (``cached_tokens`` is
            ``usage.prompt_tokens_details.cached_tokens``).
        engine_prompt_tokens, engine_cached_tokens: the same two sums over answers served by the engine.
        latency_ms: layer -> ``{"count", "p50", "p95"}`` in milliseconds (nearest-rank percentiles); the time to the
            whole answer, or to a stream's first content chunk.
        duration_s: seconds from the phase's start to its end (or to the snapshot while it runs).
        rate_per_s: ``sent / duration_s`` (0 for a zero duration).
        routing: engine answers by how their engine was chosen: ``precise``, or ``approximate:<reason>``.
        predictions: precise choices by how the engine's reported cached tokens compared with the prediction:
            ``exact``, ``over`` (fewer cached than predicted), ``under`` (more).
    """

    phase: str | None
    sent: int
    answered: int
    dropped: int
    errors: dict[str, int]
    served_by: dict[str, int]
    by_version: dict[str, int]
    cross_version: int
    cross_version_examples: tuple[CrossVersionAnswer, ...]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    engine_prompt_tokens: int
    engine_cached_tokens: int
    latency_ms: dict[str, dict[str, float]]
    duration_s: float
    rate_per_s: float
    routing: dict[str, int] = field(default_factory=dict)
    predictions: dict[str, int] = field(default_factory=dict)

    @property
    def error_count(self) -> int:
        """All errors together."""
        return sum(self.errors.values())

    @property
    def response_hit_ratio(self) -> float:
        """Share of 200 answers served by the response cache (0 without answers)."""
        return self.served_by.get("response", 0) / self.answered if self.answered else 0.0

    @property
    def semantic_hit_ratio(self) -> float:
        """Share of 200 answers served by the semantic cache (0 without answers)."""
        return self.served_by.get("semantic", 0) / self.answered if self.answered else 0.0

    @property
    def prediction_accuracy(self) -> float | None:
        """Share of precise choices whose engine reported exactly the predicted cached tokens (None: no precise choice)."""
        total = sum(self.predictions.values())
        return self.predictions.get("exact", 0) / total if total else None

    @property
    def prefix_cached_token_ratio(self) -> float:
        """Share of the engine's prompt tokens its prefix cache already held (0 without engine prompt tokens)."""
        return self.engine_cached_tokens / self.engine_prompt_tokens if self.engine_prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, the examples as objects, and the three ratios and ``error_count``."""
        out: dict[str, Any] = {
            "phase": self.phase,
            "sent": self.sent,
            "answered": self.answered,
            "dropped": self.dropped,
            "errors": dict(self.errors),
            "error_count": self.error_count,
            "served_by": dict(self.served_by),
            "by_version": dict(self.by_version),
            "cross_version": self.cross_version,
            "cross_version_examples": [vars(e).copy() for e in self.cross_version_examples],
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "engine_prompt_tokens": self.engine_prompt_tokens,
            "engine_cached_tokens": self.engine_cached_tokens,
            "latency_ms": {k: dict(v) for k, v in self.latency_ms.items()},
            "duration_s": self.duration_s,
            "rate_per_s": self.rate_per_s,
            "response_hit_ratio": self.response_hit_ratio,
            "semantic_hit_ratio": self.semantic_hit_ratio,
            "prefix_cached_token_ratio": self.prefix_cached_token_ratio,
            "routing": dict(self.routing),
            "predictions": dict(self.predictions),
            "prediction_accuracy": self.prediction_accuracy,
        }
        return out


def _nearest_rank(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-quantile of an ascending, non-empty sequence."""
    return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])


def _shares(counts: Mapping[str, int]) -> str:
    total = sum(counts.values())
    if not total:
        return "-"
    return " ".join(f"{k}={v / total:.0%}" for k, v in sorted(counts.items()))


def format_stats_line(stats: TrafficStats) -> str:
    """One log line: phase, requests/s, served-by shares, version shares, p50 per layer, cross-version count.

    Example: ``phase=canary rps=9.8 sent=98 ok=97 dropped=0 errors=1 served_by[engine=40% response=60%]
    versions[v1=90% v2=10%] p50_ms[engine=412 response=3] cross_version=0`` (one line).
    """
    p50 = " ".join(f"{k}={v['p50']:.0f}" for k, v in sorted(stats.latency_ms.items())) or "-"
    return (
        f"phase={stats.phase or 'all'} rps={stats.rate_per_s:.1f} sent={stats.sent} ok={stats.answered}"
        f" dropped={stats.dropped} errors={stats.error_count} served_by[{_shares(stats.served_by)}]"
        f" versions[{_shares(stats.by_version)}] p50_ms[{p50}] cross_version={stats.cross_version}"
    )


class _Tally:
    """Mutable counters behind one :class:`TrafficStats`; the runner's lock guards every call."""

    def __init__(self, phase: str | None, started: float) -> None:
        self.phase, self.started = phase, started
        self.ended: float | None = None
        self.sent = self.answered = self.dropped = self.cross_version = 0
        self.errors: Counter[str] = Counter()
        self.served_by: Counter[str] = Counter()
        self.by_version: Counter[str] = Counter()
        self.examples: list[CrossVersionAnswer] = []
        self.tokens: Counter[str] = Counter()
        self.latencies: dict[str, list[float]] = {}
        self.routing: Counter[str] = Counter()
        self.predictions: Counter[str] = Counter()

    def add(self, outcome: _Outcome) -> None:
        if outcome.error is not None:
            self.errors[outcome.error] += 1
            return
        self.answered += 1
        layer = outcome.served_by or UNKNOWN
        self.served_by[layer] += 1
        self.by_version[outcome.version or UNKNOWN] += 1
        self.latencies.setdefault(layer, []).append(outcome.latency_ms)
        self.tokens["prompt"] += outcome.prompt_tokens
        self.tokens["cached"] += outcome.cached_tokens
        self.tokens["completion"] += outcome.completion_tokens
        if layer == "engine":
            self.tokens["engine_prompt"] += outcome.prompt_tokens
            self.tokens["engine_cached"] += outcome.cached_tokens
            if outcome.routing is not None:
                self.routing[outcome.routing.replace("; reason=", ":")] += 1
            if outcome.predicted is not None:
                predicted, reported = outcome.predicted, outcome.cached_tokens
                self.predictions["exact" if predicted == reported else "over" if predicted > reported else "under"] += 1
        if outcome.cross is not None:
            self.cross_version += 1
            if len(self.examples) < CROSS_VERSION_EXAMPLES:
                self.examples.append(outcome.cross)

    def snapshot(self, now: float) -> TrafficStats:
        duration = max(0.0, (self.ended if self.ended is not None else now) - self.started)
        latency = {
            layer: {"count": len(v), "p50": _nearest_rank(s, 0.5), "p95": _nearest_rank(s, 0.95)}
            for layer, v in sorted(self.latencies.items())
            for s in [sorted(v)]
        }
        return TrafficStats(
            phase=self.phase, sent=self.sent, answered=self.answered, dropped=self.dropped,
            errors=dict(sorted(self.errors.items())), served_by=dict(sorted(self.served_by.items())),
            by_version=dict(sorted(self.by_version.items())), cross_version=self.cross_version,
            cross_version_examples=tuple(self.examples), prompt_tokens=self.tokens["prompt"],
            cached_tokens=self.tokens["cached"], completion_tokens=self.tokens["completion"],
            engine_prompt_tokens=self.tokens["engine_prompt"], engine_cached_tokens=self.tokens["engine_cached"],
            latency_ms=latency, duration_s=duration, rate_per_s=self.sent / duration if duration > 0 else 0.0,
            routing=dict(sorted(self.routing.items())), predictions=dict(sorted(self.predictions.items())),
        )  # fmt: skip


@dataclass
class _Outcome:
    """What one request came back with (``error`` set for anything but a readable 200)."""

    error: str | None = None
    served_by: str | None = None
    version: str | None = None
    latency_ms: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cross: CrossVersionAnswer | None = None
    #: How the gateway chose the engine (``x-kvcp-routing``: ``precise`` or ``approximate; reason=...``), or None.
    routing: str | None = None
    #: The cached prompt tokens a precise choice predicted (``x-kvcp-predicted-cached-tokens``), or None.
    predicted: int | None = None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _usage(usage: Any) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens of an OpenAI ``usage`` object; 0 for what is missing."""
    if not isinstance(usage, Mapping):
        return 0, 0, 0
    details = usage.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else 0
    return _int(usage.get("prompt_tokens")), cached, _int(usage.get("completion_tokens"))


def _error_key(response: httpx.Response, body: bytes) -> str:
    """``"<status>:<code>"`` from an OpenAI error body, or ``"<status>"``."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    return f"{response.status_code}:{code}" if isinstance(code, str) and code else str(response.status_code)


# --------------------------------------------------------------------------------------------------------------------
# Runner


class TrafficRunner:
    """Sends a workload to a gateway at a steady rate and keeps what came back, per phase and overall.

    Open loop: request ``i`` is due at ``start + i / rate_per_s`` whatever the
    answers' latency; ``max_in_flight`` worker threads send them (one
    keep-alive ``httpx.Client`` each). A request due while all workers are busy
    is dropped and counted, so the sender never builds a queue and the offered
    rate stays honest.

    Args:
        base_url: the gateway, e.g. ``http://127.0.0.1:8100`` (``/v1/chat/completions`` is appended).
        key: the API key sent as ``Authorization: Bearer <key>``.
        workload: the request bodies.
        rate_per_s: requests due per second (> 0).
        max_in_flight: workers, i.e. requests in flight at most (>= 1).
        timeout_s: one request's whole timeout, seconds (> 0).
        log: called with one :func:`format_stats_line` of the current phase every ``log_every_s``
            (over that interval) and with the whole run's line at :meth:`stop`; from the scheduler thread.
        log_every_s: seconds between log lines (> 0).
        max_requests: stop scheduling after this many due requests (sent or dropped); None runs until :meth:`stop`.

    Raises:
        ValueError: a bad rate, worker count, timeout, log interval or max_requests.

    Thread-safety: :meth:`mark`, :meth:`stats` and :meth:`stop` may be called from any thread.
    """

    def __init__(
        self, base_url: str, key: str, workload: Workload, *, rate_per_s: float, max_in_flight: int = 8,
        timeout_s: float = 60.0, log: Callable[[str], None] | None = None, log_every_s: float = 10.0,
        max_requests: int | None = None,
    ) -> None:  # fmt: skip
        if not rate_per_s > 0 or not timeout_s > 0 or not log_every_s > 0:
            raise ValueError("rate_per_s, timeout_s and log_every_s must be > 0")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if max_requests is not None and max_requests < 0:
            raise ValueError(f"max_requests must be >= 0 or None, got {max_requests}")
        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.key, self.workload, self.rate_per_s = key, workload, float(rate_per_s)
        self.max_in_flight, self.timeout_s, self.log, self.log_every_s = max_in_flight, timeout_s, log, log_every_s
        self.max_requests = max_requests
        self._lock = threading.Lock()
        self._slots = threading.Semaphore(max_in_flight)
        self._stop = threading.Event()
        self._scheduled = threading.Event()  # the scheduler has left its loop
        self._pool: ThreadPoolExecutor | None = None
        self._scheduler: threading.Thread | None = None
        self._futures: set[Future[None]] = set()
        # One keep-alive client per worker, made at start (a client's first use builds an SSL context: tens of ms
        # on a busy host, which would otherwise land in the first requests' latency). At most max_in_flight
        # requests run at once, so a worker always finds one idle. The most recently used first: its connection
        # is the likeliest still open (taken in turn, each of 8 clients at 2 requests/s sat idle 4 s, just under
        # its idle time, and a request on a connection the server was closing failed).
        self._clients: list[httpx.Client] = []
        self._idle: queue.LifoQueue[httpx.Client] = queue.LifoQueue()
        self._overall: _Tally | None = None
        self._phases: dict[str, _Tally] = {}
        self._current: _Tally | None = None
        self._window: _Tally | None = None

    # --- control ---------------------------------------------------------------------------------------------------

    def start(self, phase: str = "initial") -> None:
        """Start sending, in a first phase named ``phase``.

        Raises:
            RuntimeError: already started.
        """
        with self._lock:
            if self._scheduler is not None:
                raise RuntimeError("the runner was already started")
            now = time.monotonic()
            self._overall = _Tally(None, now)
            self._current = self._phases[phase] = _Tally(phase, now)
            self._window = _Tally(phase, now)
            self._pool = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix="traffic")
            for _ in range(self.max_in_flight):
                client = httpx.Client(
                    timeout=self.timeout_s, headers={"Authorization": f"Bearer {self.key}"},
                    limits=httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=CLIENT_IDLE_S),
                )  # fmt: skip
                self._clients.append(client)
                self._idle.put(client)
            self._scheduler = threading.Thread(target=self._schedule, args=(now,), name="traffic-scheduler", daemon=True)
        self._scheduler.start()

    def mark(self, phase: str) -> None:
        """End the current phase and start ``phase``: requests sent from now on count in it (answers of earlier
        requests still count in the phase they were sent in). Marking a phase seen before continues its counts.

        Raises:
            RuntimeError: not started.
        """
        with self._lock:
            if self._current is None:
                raise RuntimeError("start() the runner before marking a phase")
            now = time.monotonic()
            self._current.ended = now
            tally = self._phases.get(phase)
            if tally is None:
                tally = self._phases[phase] = _Tally(phase, now)
            tally.ended = None
            self._current = tally
            self._window = _Tally(phase, now)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until the scheduler has stopped (``max_requests`` reached, or :meth:`stop`) and every request
        it sent has completed. Returns whether that happened within ``timeout_s`` (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._scheduled.wait(timeout_s):
            return False
        with self._lock:
            futures = set(self._futures)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        _, pending = wait_futures(futures, timeout=remaining)
        return not pending

    def stop(self, timeout_s: float = 60.0) -> TrafficStats:
        """Stop scheduling, wait up to ``timeout_s`` for the requests in flight, log the run's line, and return the
        whole run's stats (a request still in flight after the wait is counted as sent, not yet answered).

        Raises:
            RuntimeError: not started.
        """
        if self._scheduler is None or self._overall is None:
            raise RuntimeError("the runner was not started")
        self._stop.set()
        self._scheduler.join()
        finished = self.wait(timeout_s)
        with self._lock:
            now = time.monotonic()
            for tally in (self._overall, *self._phases.values()):
                if tally.ended is None:
                    tally.ended = now
        if self._pool is not None:
            # Threads still blocked in a request end by their own timeout; do not wait for them twice.
            self._pool.shutdown(wait=finished, cancel_futures=True)
        if finished:
            with self._lock:
                clients, self._clients = self._clients, []
            for client in clients:
                client.close()
        stats = self.stats()
        if self.log is not None:
            self.log(format_stats_line(stats))
        return stats

    def stats(self, phase: str | None = None) -> TrafficStats:
        """A snapshot of one phase's stats, or of the whole run with None.

        Raises:
            KeyError: no phase of that name was marked.
            RuntimeError: not started.
        """
        with self._lock:
            if self._overall is None:
                raise RuntimeError("the runner was not started")
            tally = self._overall if phase is None else self._phases[phase]
            return tally.snapshot(time.monotonic())

    @property
    def phases(self) -> tuple[str, ...]:
        """Phase names in the order they were first started."""
        with self._lock:
            return tuple(self._phases)

    # --- internals -------------------------------------------------------------------------------------------------

    def _schedule(self, started: float) -> None:
        """The scheduler thread: submit each due request or count it dropped; log every ``log_every_s``."""
        i = 0
        next_log = started + self.log_every_s
        try:
            while not self._stop.is_set() and (self.max_requests is None or i < self.max_requests):
                due = started + i / self.rate_per_s
                now = time.monotonic()
                if now >= next_log:
                    self._log_window(now)
                    next_log += self.log_every_s
                    continue
                if now < due:
                    # Wake for the log line or the next request, whichever comes first; stop() ends the wait.
                    self._stop.wait(min(due, next_log) - now)
                    continue
                self._dispatch(i)
                i += 1
        finally:
            self._scheduled.set()

    def _dispatch(self, index: int) -> None:
        with self._lock:
            tallies = (self._overall, self._current, self._window)
            if not self._slots.acquire(blocking=False):
                for tally in tallies:
                    tally.dropped += 1  # type: ignore[union-attr]
                return
            for tally in tallies:
                tally.sent += 1  # type: ignore[union-attr]
            assert self._pool is not None
            future = self._pool.submit(self._send, index, tallies)  # type: ignore[arg-type]
            self._futures.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Future[None]) -> None:
        self._slots.release()
        with self._lock:
            self._futures.discard(future)

    def _log_window(self, now: float) -> None:
        """Log the interval's line and start the next interval (reset without a log too: its latencies would grow).
        An answer to a request of the closed interval that arrives later goes into no line, only into the stats."""
        with self._lock:
            assert self._window is not None
            window, self._window = self._window, _Tally(self._window.phase, now)
            line = format_stats_line(window.snapshot(now))
        if self.log is not None:
            self.log(line)

    def _send(self, index: int, tallies: tuple[_Tally, ...]) -> None:
        """One request, on a worker thread; its outcome goes into every tally it was sent under."""
        body = self.workload.request(index)
        client = self._idle.get()
        try:
            outcome = self._post(client, index, body)
        except httpx.HTTPError as exc:
            outcome = _Outcome(error=f"transport:{type(exc).__name__}")
        except Exception as exc:  # noqa: BLE001 - a request must never vanish from the counts (sent = answered + errors)
            outcome = _Outcome(error=f"client:{type(exc).__name__}")
        finally:
            self._idle.put(client)
        with self._lock:
            for tally in tallies:
                tally.add(outcome)

    def _post(self, client: httpx.Client, index: int, body: dict[str, Any]) -> _Outcome:
        started = time.perf_counter()
        with client.stream("POST", self.url, json=body) as response:
            headers = response.headers
            served_by, version, routed_fp = (
                headers.get(SERVED_BY_HEADER), headers.get(VERSION_HEADER), headers.get(FINGERPRINT_HEADER),
            )  # fmt: skip
            if response.status_code != 200:
                return _Outcome(error=_error_key(response, response.read()))
            is_stream = headers.get("content-type", "").startswith("text/event-stream")
            if is_stream:
                parsed = self._read_stream(response, started)
                if parsed is None:
                    return _Outcome(error="unreadable")
                latency, fingerprints, usage = parsed
            else:
                try:
                    answer = json.loads(response.read())
                except ValueError:
                    return _Outcome(error="unreadable")
                if not isinstance(answer, dict):
                    return _Outcome(error="unreadable")
                latency = (time.perf_counter() - started) * 1000
                fp = answer.get("system_fingerprint")
                fingerprints = [fp if isinstance(fp, str) else None]
                usage = answer.get("usage")
        prompt, cached, completion = _usage(usage)
        # A stream carries the fingerprint on every chunk; any chunk that disagrees makes the answer cross-version.
        differing = [fp for fp in fingerprints if fp != routed_fp]
        cross = None
        if routed_fp is None or not fingerprints or differing:
            shown = differing[0] if differing else (fingerprints[0] if fingerprints else None)
            cross = CrossVersionAnswer(index, version, routed_fp, shown, served_by)
        predicted = headers.get(PREDICTED_HEADER)
        return _Outcome(
            served_by=served_by, version=version, latency_ms=latency, prompt_tokens=prompt, cached_tokens=cached,
            completion_tokens=completion, cross=cross, routing=headers.get(ROUTING_HEADER),
            predicted=int(predicted) if predicted is not None and predicted.isdigit() else None,
        )  # fmt: skip

    @staticmethod
    def _read_stream(response: httpx.Response, started: float) -> tuple[float, list[str | None], Any] | None:
        """(ms to the first content chunk, or to the end without one; each chunk's fingerprint; the last usage),
        or None when a ``data:`` line is not JSON."""
        first: float | None = None
        fingerprints: list[str | None] = []
        usage: Any = None
        done = False
        # Read to the body's end, past [DONE]: a body left unread closes its kept-alive connection.
        for line in response.iter_lines():
            if done or not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                return None
            if not isinstance(chunk, dict):
                return None
            fp = chunk.get("system_fingerprint")
            fingerprints.append(fp if isinstance(fp, str) else None)
            if chunk.get("usage"):
                usage = chunk["usage"]
            if first is None:
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") if isinstance(choice, dict) else None
                    if isinstance(delta, dict) and delta.get("content"):
                        first = (time.perf_counter() - started) * 1000
                        break
        if first is None:
            first = (time.perf_counter() - started) * 1000
        return first, fingerprints, usage
