"""The semantic cache as the gateway uses it: admission, lookup (embed, search
the request's partition, judge candidates on the one similarity scale with
the guards) and storing an answer."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal

import numpy as np

from gateway.canonical import canonical_bytes
from gateway.layers.base import Lookup, Provenance, StoreUnavailable
from gateway.layers.response.store import ResponseStore
from gateway.layers.semantic.admission import DEFAULT_RULES, Rule, semantic_admission
from gateway.layers.semantic.entries import Candidate, SemanticEntry
from gateway.layers.semantic.language import REASON_LANGUAGE, REASON_SYMBOLS, check_languages, outside, unreadable
from gateway.layers.semantic.language import load as load_languages
from gateway.layers.semantic.matching import DEFAULT_GUARDS, SHIPPED_THRESHOLD, match, normalize_text, template_parts
from gateway.layers.semantic.store import SemanticStore
from gateway.protection import (
    FillResult,
    FlightStart,
    Lead,
    SingleFlight,
    fill_once,
    flight_key,
    in_process,
    lead_or_join,
    shared_failure,
)

if TYPE_CHECKING:
    from gateway.pipeline import RequestContext


#: Rounds of joining a flight whose leader ends without an answer (as the response layer's).
_JOIN_ROUNDS: Final = 3


class SemanticLayer:
    """One process's semantic layer over a shared store.

    Args:
        store: the entry store (shared by every gateway process).
        embedder: an object with ``embed(texts, *, scope) -> ndarray (n, dim)`` (L2-normalized rows; ``scope``
            the cache scope of :meth:`gateway.layers.semantic.embedder.Embedder.embed`) and ``model_id``.
        threshold: the similarity a hit needs when the tenant's policy sets none (0..1).
        rules: admission rules (answers that depend on time, comparison, prediction bypass).
        guards: the guards every candidate must pass.
        k: candidates judged per lookup, best first.
        languages: ISO 639-1 codes of the questions the layer admits
            (:mod:`gateway.layers.semantic.language`); default the embedder's ``languages`` (the
            bundled model's :data:`~gateway.layers.semantic.embedder.MODEL_LANGUAGES`; an embedder
            without one admits any); None admits any.

    Raises:
        LanguageConfigError: ``languages`` names a code the detector does not know.
    """

    #: What the gateway catches to bypass the layer when the store is down.
    Unavailable = StoreUnavailable

    def __init__(
        self, store: SemanticStore, embedder: Any, *, threshold: float = SHIPPED_THRESHOLD,
        rules: Sequence[Rule] = DEFAULT_RULES, guards: Sequence[str] = DEFAULT_GUARDS, k: int = 4,
        languages: Collection[str] | None | Literal["embedder"] = "embedder",
    ) -> None:  # fmt: skip
        if languages == "embedder":
            languages = getattr(embedder, "languages", None)
        self.languages = None if languages is None else check_languages(languages)
        self.entries, self.embedder, self.threshold, self.rules, self.guards, self.k = (
            store,
            embedder,
            threshold,
            tuple(rules),
            tuple(guards),
            k,
        )

    def load(self) -> None:
        """Load the embedding model and, where languages are judged, the language detector (the
        gateway runs this on a thread at start: the first semantic request would wait for both)."""
        self.embedder.embed(["warm up"])
        if self.languages is not None:
            load_languages()

    def admission(self, text: str, *, personal_data: bool) -> tuple[bool, str]:
        """(admitted, reason) of a question (see :func:`gateway.layers.semantic.admission.semantic_admission`);
        a question outside :attr:`languages` is refused with ``language_unsupported`` once personal data
        is ruled out (:func:`gateway.layers.semantic.language.outside`), and one an embedder cannot read
        whole with ``symbols_unsupported`` (:func:`gateway.layers.semantic.language.unreadable`)."""
        admitted, reason = semantic_admission(text, rules=self.rules, personal_data=personal_data)
        if admitted and unreadable(text):
            return False, REASON_SYMBOLS
        if admitted and self.languages is not None and outside(text, self.languages):
            return False, REASON_LANGUAGE
        return admitted, reason

    def lookup(self, prefix: str, partition: str, text: str, threshold: float | None) -> tuple[np.ndarray, dict[str, Any] | None]:
        """Embed ``text`` and look for an answer to the same question in its partition.

        Returns:
            (its vector, for storing the answer on a miss; the cached record of the first
            candidate that matches, or None).

        Raises:
            StoreUnavailable: the store is down.
        """
        vector, candidate = self.lookup_candidate(prefix, partition, text, threshold)
        return vector, json.loads(candidate.entry.response) if candidate is not None else None

    def lookup_candidate(
        self, prefix: str, partition: str, text: str, threshold: float | None
    ) -> tuple[np.ndarray, Candidate | None]:
        """:meth:`lookup`, with the entry that matched (its id, the text it answered) instead of its record.

        Every text is embedded in the partition's scope of the embedder's cache
        (:class:`gateway.layers.semantic.embedder.EmbeddingCache`): the partition is an HMAC under the
        tenant's secret, so whether a text's embedding was cached (a faster lookup) says nothing about
        another tenant's questions, nor about another namespace's or conversation's of the same tenant.

        Raises:
            StoreUnavailable: the store is down.
        """
        embed = partial(self.embedder.embed, scope=partition)
        vector = embed([text])[0]
        limit = self.threshold if threshold is None else threshold
        candidates = self.entries.search(prefix, partition, self.embedder.model_id, vector, k=self.k)
        self._prefetch_template_parts(text, candidates, limit, embed)
        for candidate in candidates:
            verdict = match(text, candidate.entry.text, candidate.similarity, threshold=limit, guards=self.guards, embed=embed)
            if verdict.hit:
                return vector, candidate
        return vector, None

    def _prefetch_template_parts(
        self, text: str, candidates: Sequence[Candidate], limit: float, embed: Callable[[Sequence[str]], np.ndarray]
    ) -> None:
        """Embed, in one forward pass, the template guard's parts of every candidate that would reach it.

        :func:`match` runs the guards candidate by candidate and the template guard
        embeds its two parts in a call of its own: with several template-shaped
        candidates (one template, several cached questions) a lookup made that
        many forward passes. Here the candidates :func:`match` would examine (up to
        the first that hits without the template guard) and whose text passes the
        other guards and is template-shaped have their parts embedded together; the
        embedder's cache then answers the guard's calls. Verdicts are unchanged (the
        same texts are embedded, batched differently: float rounding only, ~1e-7).
        Nothing is done for fewer than two such candidates (the guard's own call is
        then the one forward pass) or an embedder without a cache.
        """
        cache = getattr(self.embedder, "cache", None)
        if "template" not in self.guards or not getattr(cache, "max_entries", 0) or not 0.0 < limit < 1.0:
            return
        others = tuple(g for g in self.guards if g != "template")
        query = normalize_text(text)
        parts: list[str] = []
        shaped = 0
        for candidate in candidates:
            if query == normalize_text(candidate.entry.text):
                break  # an exact hit: match() stops here
            if (
                candidate.similarity < limit
                or not match(text, candidate.entry.text, candidate.similarity, threshold=limit, guards=others).hit
            ):
                continue
            pair = template_parts(text, candidate.entry.text)
            if pair is None:
                break  # hits without the template guard: match() stops here
            parts.extend(pair)
            shaped += 1
        if shaped >= 2:
            embed(list(dict.fromkeys(parts)))

    def store_answer(
        self, prefix: str, tenant: str, partition: str, vector: np.ndarray, text: str, value: bytes, tags: Sequence[str],
        *, ttl_s: float | None, max_bytes: int | None, provenance: Provenance | None = None,
    ) -> None:  # fmt: skip
        """Keep an answer for later paraphrases of ``text`` (expires after ``ttl_s``; the namespace's budget
        applies), with its provenance (the engine that computed it, when) beside it.

        Raises:
            StoreUnavailable: the store is down.
        """
        now = time.time()
        entry = SemanticEntry(
            entry_id=secrets.token_hex(16), prefix=prefix, partition=partition, tenant=tenant, model_id=self.embedder.model_id,
            text=text, vector=np.asarray(vector, dtype=np.float32), response=value, tags=tuple(tags), created_at=now,
            expires_at=now + ttl_s if ttl_s else None,
        )  # fmt: skip
        self.entries.add(entry, max_bytes=max_bytes, provenance=provenance)

    def store(
        self, ns: Any, tenant: Any, partition: str, vector: np.ndarray, text: str, value: bytes, tags: Sequence[str],
        provenance: Provenance | None = None,
    ) -> None:  # fmt: skip
        """:meth:`store_answer` for a namespace and tenant target of the routing snapshot."""
        self.store_answer(
            ns.storage_prefix, str(tenant.id), partition, vector, text, value, tags, ttl_s=ns.ttl_s, max_bytes=ns.max_bytes,
            provenance=provenance,
        )  # fmt: skip


#: Why a request bypasses the semantic cache, besides the reproducibility rule's refusals
#: (:data:`gateway.canonical.ADMISSION_REASONS`), the admission rules' own
#: (:mod:`gateway.layers.semantic.admission`) and ``store_unavailable``; ``not_paying`` is
#: decided for every layer by the pipeline (:func:`gateway.pipeline.bypass_reason`).
BYPASS_REASONS: Final = ("kill_switch", "tenant_policy", "not_configured", "not_a_user_question", "n_choices", "not_paying")


def semantic_partition(tenant: Any, namespace: Any, endpoint: str, canonical: Mapping[str, Any]) -> str:
    """The partition a semantic lookup is confined to, before any similarity:
    the tenant, the namespace, and everything of the request but its last
    message's text (parameters, system prompt, earlier turns), keyed with the
    tenant's secret (64 lowercase hex digits)."""
    context = dict(canonical)
    context["messages"] = list(canonical.get("messages", []))[:-1]
    payload = b"\0".join([namespace.namespace_key.encode("ascii"), endpoint.encode("ascii"), canonical_bytes(context)])
    return hmac.new(tenant.secret, b"semantic\0" + payload, hashlib.sha256).hexdigest()


def semantic_flight_key(tenant: Any, partition: str, text: str) -> str:
    """The key of a semantic fill's flight: the request's partition (:func:`semantic_partition`:
    tenant, namespace, parameters and conversation before the last message) and its last user
    message as the layer compares texts exactly (:func:`normalize_text`), keyed with the tenant's
    secret (64 lowercase hex digits: the key of its fill lease in the response store, whose own
    keys are other HMACs of the tenant's secret).

    Requests of one key would be served each other's answer by the layer itself (texts equal after
    :func:`normalize_text` are an exact hit whatever the threshold and guards), so sharing the
    leader's answer serves nothing a lookup after it was stored would not. Paraphrases that would
    only match by similarity do not join: whether they hit depends on the threshold and guards
    judged against a stored entry, and sharing them in flight would serve answers the layer may
    refuse; each leads its own flight (a later one is then a hit)."""
    payload = b"semantic-flight\0" + partition.encode("ascii") + b"\0" + normalize_text(text).encode("utf-8")
    digest = hmac.new(tenant.secret, payload, hashlib.sha256)
    return digest.hexdigest()


@dataclass
class SemanticPending:
    """A semantic-cache miss of one request.

    Attributes:
        partition: its partition (:func:`semantic_partition`).
        text: its last user message.
        flight_key: its flight's key (:func:`semantic_flight_key`).
        vector: its embedding, for storing the answer; None when the lookup found the store unavailable.
        lead: the flight this request leads (its engine call is the fill); None: not leading.
    """

    partition: str
    text: str
    flight_key: str
    vector: np.ndarray | None = None
    lead: Lead | None = None


class SemanticCacheLayer:
    """The semantic cache as a layer of the pipeline: the last user message of a chat,
    matched by meaning inside its partition (:func:`semantic_partition`).

    Concurrent misses of one question share one engine call (:meth:`fill_guard`, keyed by
    :func:`semantic_flight_key`): in this process by the layer's flight, across the processes by
    the fill lease of the response store they share (``lease_store``; the semantic store has no
    lease of its own), its waiters looking the question up again in the semantic store. Without
    a response store, or when the semantic store could not answer the lookup, the flight is this
    process's alone.

    Args:
        semantic: this process's :class:`SemanticLayer`, or None (not configured here). Only its
            admission rules are used by ``explain``: a layer built on no store serves it.
        answer_timeout_s: how long a leader's engine call may take (the upstream timeout): how long joiners wait.
        lease_store: the response store whose fill lease the flight takes across processes (None: this process only).
        fill_wait_s: the lease's TTL (renewed while the leader's engine call runs), as the response layer's.
    """

    name: ClassVar[str] = "semantic"

    def __init__(
        self, semantic: SemanticLayer | None, *, answer_timeout_s: float = 300.0, lease_store: ResponseStore | None = None,
        fill_wait_s: float = 120.0,
    ) -> None:  # fmt: skip
        self.semantic = semantic
        self.lease_store = lease_store
        self.fill_wait_s = fill_wait_s
        #: The wrapped layer's store error (a test's layer may bring its own).
        self.Unavailable: type[Exception] = semantic.Unavailable if semantic is not None else StoreUnavailable
        self.answer_timeout_s = answer_timeout_s
        #: This process's fills in flight, by :func:`semantic_flight_key`.
        self.flight: SingleFlight[FillResult] = SingleFlight()

    def bypass(self, ctx: RequestContext) -> str | None:
        """``kill_switch``, ``tenant_policy``, ``not_configured``, ``not_a_user_question``,
        ``n_choices``, a refusal of the reproducibility rule (a sampled answer served again
        would repeat one draw as if it were the only one), the admission rules' refusal
        (``time_dependent``, ``personal_data``...), or None."""
        if not ctx.snap.layers.get(self.name, True):
            return "kill_switch"
        if not ctx.tenant.policy.semantic_cache:
            return "tenant_policy"
        if self.semantic is None:
            return "not_configured"
        if ctx.user_text is None:
            return "not_a_user_question"
        if int(ctx.canonical.get("n", 1)) != 1:
            return "n_choices"
        verdict = ctx.reproducibility
        if not verdict.admitted:
            return verdict.reason
        admitted, why = self.semantic.admission(ctx.user_text, personal_data=ctx.personal)
        return None if admitted else why

    def admitted(self, ctx: RequestContext) -> str:
        """The admission rules' reason for admitting the question."""
        assert self.semantic is not None and ctx.user_text is not None
        return self.semantic.admission(ctx.user_text, personal_data=ctx.personal)[1]

    def describe(self, ctx: RequestContext) -> dict[str, Any]:
        """Nothing besides the decision."""
        return {}

    async def lookup(self, ctx: RequestContext) -> Lookup:
        """A stored answer to the same question in the request's partition; else a miss whose
        pending value is a :class:`SemanticPending` (what storing the answer and its flight need).

        Raises:
            StoreUnavailable: the store cannot answer.
        """
        assert self.semantic is not None and ctx.user_text is not None
        ns, text = ctx.namespace, ctx.user_text
        partition = semantic_partition(ctx.tenant, ns, ctx.endpoint, ctx.canonical)
        vector, found = await asyncio.to_thread(
            self.semantic.lookup_candidate, ns.storage_prefix, partition, text, ctx.tenant.policy.semantic_threshold
        )
        if found is None:
            return Lookup(None, SemanticPending(partition, text, semantic_flight_key(ctx.tenant, partition, text), vector))
        # A paraphrase's answer: what it answers is the stored question, not this request's.
        asked = None if found.entry.text == text else found.entry.text
        return Lookup(json.loads(found.entry.response), entry=found.entry.entry_id, question=asked)

    def without_store(self, ctx: RequestContext) -> SemanticPending:
        """The pending value of a request whose lookup found the store unavailable: its flight only
        (identical questions of this process share one engine call), nothing to store."""
        assert ctx.user_text is not None
        partition = semantic_partition(ctx.tenant, ctx.namespace, ctx.endpoint, ctx.canonical)
        return SemanticPending(partition, ctx.user_text, semantic_flight_key(ctx.tenant, partition, ctx.user_text))

    async def fill_guard(self, ctx: RequestContext, pending: Any) -> dict[str, Any] | None:
        """Join or lead this process's flight of the question (:func:`semantic_flight_key`): the
        answer of a request in flight that this one would be served from once stored, or None
        when this request leads (its engine call is the flight's fill until :meth:`release`).
        A leader that ends without an answer is followed by another round, up to three
        (:func:`gateway.protection.lead_or_join`).

        Raises:
            GatewayError: the leader's engine call timed out (504 ``upstream_timeout``).
        """
        asked: SemanticPending = pending
        prefix = ctx.namespace.storage_prefix
        start: FlightStart
        if asked.vector is None or self.lease_store is None:
            start = partial(in_process, self.flight, flight_key(prefix, asked.flight_key))
        else:
            read = partial(self._read, prefix, asked, ctx.tenant.policy.semantic_threshold)
            start = partial(fill_once, self.lease_store, prefix, asked.flight_key, lease_ttl_s=self.fill_wait_s,
                            wait_timeout_s=self.answer_timeout_s + self.fill_wait_s, flight=self.flight, read=read)  # fmt: skip
        got = await lead_or_join(start, answer_timeout_s=self.answer_timeout_s, rounds=_JOIN_ROUNDS)
        if isinstance(got, Lead):
            asked.lead = got
            return None
        return json.loads(got) if got is not None else None

    def _read(self, prefix: str, asked: SemanticPending, threshold: float | None) -> bytes | None:
        """The answer another process stored for ``asked`` meanwhile (a lookup again), as bytes; blocking."""
        assert self.semantic is not None
        _, record = self.semantic.lookup(prefix, asked.partition, asked.text, threshold)
        return None if record is None else json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    async def store(self, ctx: RequestContext, pending: Any, value: bytes) -> None:
        """Keep the answer with the request's tags (invalidated by any of them).

        Raises:
            StoreUnavailable: the store cannot answer.
        """
        assert self.semantic is not None
        asked: SemanticPending = pending
        assert asked.vector is not None, "stored by a request whose lookup found the store unavailable"
        await asyncio.to_thread(
            self.semantic.store,
            ctx.namespace,
            ctx.tenant,
            asked.partition,
            asked.vector,
            asked.text,
            value,
            ctx.tags,
            ctx.provenance,
        )

    def provenance(self, ctx: RequestContext, entry: str) -> Provenance | None:
        """The provenance kept with the entry of id ``entry``.

        Raises:
            StoreUnavailable: the store cannot answer.
        """
        assert self.semantic is not None
        return self.semantic.entries.provenance(entry)

    async def release(self, ctx: RequestContext, pending: Any, record: dict[str, Any] | None) -> None:
        """End the flight this request leads: its joiners get the answer (or go another round,
        or get the leader's timeout: ``ctx.failure``)."""
        asked: SemanticPending = pending
        if asked.lead is not None:
            value = None if record is None else json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            await asked.lead.end(value, shared_failure(ctx.failure))


def build(runtime: Any) -> SemanticCacheLayer:
    """The layer of a :class:`gateway.server.Runtime`: its semantic layer (None: not configured)
    and the upstream timeout (how long its flight's joiners wait for the leader)."""
    limits = runtime.limits
    return SemanticCacheLayer(runtime.semantic, answer_timeout_s=limits.upstream_timeout_s,
                              lease_store=runtime.response_store, fill_wait_s=limits.fill_wait_s)  # fmt: skip
