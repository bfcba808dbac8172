"""Prompt templates on the hot path: which named template a request follows,
and how many of its requests were served warm or cold.

A prompt template (``cacheadmin.models.PromptTemplate``) is recognised by its
*fixed leading text*: the text before its first variable. The gateway sees a
request's leading text as the text of its first message (chat) or its prompt
(completions), and takes the template with the longest fixed leading text that
the request starts with.

Matching costs a handful of hashes per request whatever the number of
templates: each template is filed under the digest of its fixed text cut to a
whole number of :data:`CHUNK_CHARS` chunks; a request's leading text is hashed
chunk by chunk (one running BLAKE2b, a copy per chunk boundary) and each digest
is looked up in a dict, longest first. A candidate is confirmed by the digest
of its whole fixed text, so two templates sharing their first chunks are told
apart. No regular expression runs per template, and the snapshot carries
digests only, never the templates' text.

Counts go two ways: the Prometheus counter
``kvcp_gateway_template_requests_total{namespace,template,result}`` and
per-minute increments (:class:`TemplateCounts`) that the control plane writes
for its pages.
"""

from __future__ import annotations

import contextvars
import hashlib
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

#: Characters per chunk of leading text. A template needs at least this much
#: fixed text before its first variable to be recognised (shorter openings,
#: "Hi {name}", would match almost any request).
CHUNK_CHARS = 32
#: Chunks of leading text looked at, at most: a fixed opening longer than
#: 4,096 characters is matched on its first 4,096.
MAX_CHUNKS = 128

#: Prometheus family (see ``cacheadmin/metrics/catalogue.py``); results ``warm`` and ``cold``.
METRIC_NAME = "kvcp_gateway_template_requests"


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass(frozen=True)
class TemplateFingerprint:
    """How the gateway knows one template, without its text.

    Attributes:
        name: the template's name (a metric label: operators choose it, it is bounded).
        fixed_chars: length of its fixed leading text, in characters (>= :data:`CHUNK_CHARS`).
        chunk_digest: BLAKE2b-128 of the fixed text's first ``fixed_chars // CHUNK_CHARS`` chunks (capped at :data:`MAX_CHUNKS`).
        fixed_digest: BLAKE2b-128 of the whole fixed text (capped likewise).
    """

    name: str
    fixed_chars: int
    chunk_digest: bytes
    fixed_digest: bytes

    @property
    def chunks(self) -> int:
        """Whole chunks of its fixed text the index files it under."""
        return min(self.fixed_chars // CHUNK_CHARS, MAX_CHUNKS)


def fingerprint(name: str, fixed_text: str) -> TemplateFingerprint:
    """The fingerprint of a template whose text before its first variable is ``fixed_text``.

    Raises:
        ValueError: ``fixed_text`` is shorter than :data:`CHUNK_CHARS` characters.
    """
    if len(fixed_text) < CHUNK_CHARS:
        raise ValueError(
            f"the fixed text before the first variable has {len(fixed_text)} characters; at least {CHUNK_CHARS} are needed"
        )
    fixed = fixed_text[: MAX_CHUNKS * CHUNK_CHARS]
    chunks = len(fixed) // CHUNK_CHARS
    return TemplateFingerprint(name, len(fixed), _digest(fixed[: chunks * CHUNK_CHARS]), _digest(fixed))


@dataclass(frozen=True)
class TemplateIndex:
    """A tenant's templates (its own and the global ones) by chunk digest.

    ``by_chunk`` maps a chunk digest to its candidates, longest fixed text first.
    """

    by_chunk: Mapping[bytes, tuple[TemplateFingerprint, ...]] = field(default_factory=dict)
    max_chunks: int = 0

    @classmethod
    def of(cls, fingerprints: Sequence[TemplateFingerprint]) -> TemplateIndex:
        """Index ``fingerprints``; for two with the same fixed text, the first given wins."""
        by_chunk: dict[bytes, list[TemplateFingerprint]] = {}
        for fp in fingerprints:
            by_chunk.setdefault(fp.chunk_digest, []).append(fp)
        return cls(
            {k: tuple(sorted(v, key=lambda f: -f.fixed_chars)) for k, v in by_chunk.items()},
            max((fp.chunks for fp in fingerprints), default=0),
        )

    def match(self, text: str) -> str | None:
        """The name of the template with the longest fixed text that ``text`` starts with, or None."""
        if not self.by_chunk or len(text) < CHUNK_CHARS:
            return None
        chunks = min(len(text) // CHUNK_CHARS, self.max_chunks)
        running = hashlib.blake2b(digest_size=16)
        digests: list[bytes] = []
        for i in range(chunks):
            running.update(text[i * CHUNK_CHARS : (i + 1) * CHUNK_CHARS].encode("utf-8", "surrogatepass"))
            digests.append(running.copy().digest())
        for n in range(chunks, 0, -1):
            for fp in self.by_chunk.get(digests[n - 1], ()):
                if fp.fixed_chars <= len(text) and _digest(text[: fp.fixed_chars]) == fp.fixed_digest:
                    return fp.name
        return None


def leading_text(body: Mapping[str, Any]) -> str:
    """A request's leading text as templates are matched against it: the text
    of a chat request's first message (its text parts joined), or a completion's
    prompt (the first of a list); empty when there is none."""
    messages = body.get("messages")
    if isinstance(messages, list):
        first = messages[0] if messages else None
        content = first.get("content") if isinstance(first, Mapping) else None
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
        return content if isinstance(content, str) else ""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else ""
    return prompt if isinstance(prompt, str) else ""


# --- counting ------------------------------------------------------------------

#: One drained row: (template name, namespace pk, minute, requests, warm).
Row = tuple[str, int, datetime, int, int]


class TemplateCounts:
    """Thread-safe per-(template, namespace, minute) counts of requests and
    warm requests, drained off the hot path by the flush."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cells: Counter[tuple[str, int, datetime, str]] = Counter()

    def add(self, template: str, namespace_pk: int, *, warm: bool, now: float | None = None) -> None:
        """Count one answered request of ``template`` in a namespace."""
        moment = datetime.now(UTC) if now is None else datetime.fromtimestamp(now, UTC)
        minute = moment.replace(second=0, microsecond=0)
        with self._lock:
            self._cells[(template, namespace_pk, minute, "requests")] += 1
            if warm:
                self._cells[(template, namespace_pk, minute, "warm")] += 1

    def drain(self) -> list[Row]:
        """Take every count so far, as :data:`Row` tuples sorted by template, namespace and minute."""
        with self._lock:
            cells, self._cells = self._cells, Counter()
        keys = sorted({(t, ns, m) for t, ns, m, _ in cells})
        return [(t, ns, m, cells[(t, ns, m, "requests")], cells[(t, ns, m, "warm")]) for t, ns, m in keys]

    def restore(self, rows: Sequence[Row]) -> None:
        """Put back rows a failed flush drained."""
        with self._lock:
            for t, ns, m, requests, warm in rows:
                self._cells[(t, ns, m, "requests")] += requests
                self._cells[(t, ns, m, "warm")] += warm


_counter: Any = None
_counter_lock = threading.Lock()
_children: dict[tuple[str, str, str], Any] = {}


def template_counter() -> Any:
    """The Prometheus counter ``kvcp_gateway_template_requests_total``, created
    on first use (prometheus-client registers a family once per process; a
    gateway that never classifies a request exports none)."""
    global _counter
    if _counter is None:
        with _counter_lock:
            if _counter is None:
                from prometheus_client import Counter as PromCounter

                _counter = PromCounter(
                    METRIC_NAME,
                    "requests of a named prompt template; result is warm when prompt tokens came from cache, cold otherwise",
                    ("namespace", "template", "result"),
                )
    return _counter


@dataclass(frozen=True)
class Classified:
    """The template a request in flight follows, and where it is served."""

    template: str
    namespace_pk: int
    namespace_key: str


#: The current request's template. A context variable because the answer is
#: known (warm or cold) deep in the request path, in the response's stream,
#: and each request runs in its own task (contexts are copied per task).
current: contextvars.ContextVar[Classified | None] = contextvars.ContextVar("kvcp_template", default=None)


def classify(indexes: Mapping[int | None, TemplateIndex], tenant_id: int, namespace_pk: int, namespace_key: str,
             body: Mapping[str, Any]) -> str | None:  # fmt: skip
    """Match the request against its tenant's templates and remember the
    result for :func:`count` (None when no template matches).

    Args:
        indexes: the snapshot's templates: tenant id → index for tenants with
            templates of their own, None → the global templates' index for the others.
    """
    index = indexes.get(tenant_id) or indexes.get(None)
    name = index.match(leading_text(body)) if index is not None else None
    current.set(Classified(name, namespace_pk, namespace_key) if name is not None else None)
    return name


def count(counts: TemplateCounts | None, *, warm: bool) -> None:
    """Count the current request's answer (warm: any prompt token came from a
    cache) against its template, if it has one; at most once per request."""
    classified = current.get()
    if classified is None:
        return
    current.set(None)
    labels = (classified.namespace_key, classified.template, "warm" if warm else "cold")
    child = _children.get(labels)
    if child is None:
        # Kept per label set: ``labels()`` validates and locks on every call (the sets are bounded).
        child = _children.setdefault(labels, template_counter().labels(*labels))
    child.inc()
    if counts is not None:
        counts.add(classified.template, classified.namespace_pk, warm=warm)
