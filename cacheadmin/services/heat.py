"""Prefix heat: hot conversations routers report per namespace, and the
corpora jobs run (bundled ones, or the hottest prefixes of a namespace)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Case, F, Value, When
from django.utils import timezone

from cacheadmin.models import CacheNamespace, ComparisonJob, JobStatus, PrewarmJob, TenantGatewayPolicy
from cacheadmin.models.releases import PrefixHeat
from cacheadmin.services.jobs import job_finish
from cacheadmin.services.quotas import heat_quota_check
from gateway.pii.gate import DEFAULT_POLICY, gate
from inference.corpus import Conversation, conversation_problem, load_corpus
from inference.errors import InvalidField
from inference.identity import canonical_json, digest_frames

#: Corpus name of a namespace's hottest prefixes: ``heat:<namespace pk>``.
HEAT_CORPUS = "heat:"
#: Prompts a heat corpus holds at most (the hottest first).
HEAT_CORPUS_SIZE = 32
#: Largest count a heat row holds (signed 64-bit column); reports add up to it and stay there.
MAX_HITS = (1 << 63) - 1


def prefix_heat_record(*, namespace: CacheNamespace, messages: Any, tools: Any, hits: int) -> PrefixHeat:
    """Add ``hits`` to a conversation's heat in ``namespace`` (created on first
    report), saturating at :data:`MAX_HITS`.

    A conversation holding personal data is kept redacted or not at all, by
    the tenant's ``personal_data`` policy (:mod:`gateway.pii.gate`; a shared
    group's namespace: not at all).

    Raises:
        InvalidField: messages that :func:`inference.corpus.conversation_problem`
            refuses, tools that are not a list, hits outside
            1..MAX_HITS, a conversation with personal data the policy keeps
            none of (400 on that field, exit 2).
    """
    problem = conversation_problem(messages)
    if problem is not None:
        raise InvalidField("messages", problem)
    if tools is not None and not isinstance(tools, list):
        raise InvalidField("tools", "must be a list")
    if isinstance(hits, bool) or not isinstance(hits, int) or not 1 <= hits <= MAX_HITS:
        raise InvalidField("hits", f"must be an integer within 1..{MAX_HITS}")
    policy = (
        TenantGatewayPolicy.objects.filter(tenant_id=namespace.tenant_id).values_list("personal_data", flat=True).first()
        if namespace.tenant_id is not None
        else None
    ) or DEFAULT_POLICY
    verdict = gate("heat", {"messages": messages, "tools": tools}, policy=policy)
    if not verdict.keep:
        # Heat is read by tenants and replayed by prewarm jobs: the tenant's policy keeps no personal data there.
        raise InvalidField(
            "messages",
            f"holds personal data ({', '.join(sorted(verdict.kinds))}); the tenant's policy (personal_data: skip) keeps "
            "none of it in prefix heat",
        )
    messages, tools = verdict.value["messages"], verdict.value["tools"]
    digest = digest_frames("prefix-heat", [("messages", canonical_json(messages)), ("tools", canonical_json(tools))])
    heat_quota_check(namespace=namespace, digest=digest)
    now = timezone.now()
    try:
        with transaction.atomic():
            row, created = PrefixHeat.objects.get_or_create(
                namespace=namespace,
                digest=digest,
                defaults={"messages": messages, "tools": tools, "hits": hits, "last_hit_at": now},
            )
    except IntegrityError:  # a concurrent first report of the same prompt
        row, created = PrefixHeat.objects.get(namespace=namespace, digest=digest), False
    if not created:
        # Saturate at the column's maximum: the sum is never computed past it,
        # which PostgreSQL would refuse ("bigint out of range") and SQLite would
        # turn into a float.
        saturated = Case(When(hits__gt=MAX_HITS - hits, then=Value(MAX_HITS)), default=F("hits") + hits)
        PrefixHeat.objects.filter(pk=row.pk).update(hits=saturated, last_hit_at=now)
        row.refresh_from_db()
    return row


def corpus_load(
    name: str, *, for_namespace: CacheNamespace | None = None, digests: Sequence[str] | None = None
) -> list[Conversation]:
    """The conversations of a corpus: a bundled one by name, or ``heat:<namespace
    pk>`` for that namespace's hottest reported prompts (at most
    ``HEAT_CORPUS_SIZE``, hottest first).

    Args:
        for_namespace: the namespace a job runs the corpus in. A heat corpus is
            then only one of the same sharing boundary (the same tenant, or
            the same shared group): another tenant's prompts are never read
            into this one's engine and results. Elsewhere it answers exactly
            like a namespace with no heat.
        digests: a heat corpus pinned by :func:`corpus_pin` when its job was
            created: exactly those prompts, in that order (live traffic keeps
            changing which are hottest, and a job's results are keyed by
            position). Ignored for a bundled corpus.

    Raises:
        ValueError: unknown corpus, a heat corpus whose id is not ASCII digits,
            of another boundary, or with no reported prompt; a pinned prompt
            that is gone (deleted with its namespace).
    """
    if not name.startswith(HEAT_CORPUS):
        return load_corpus(name)
    return [_heat_conversation(r) for r in _heat_rows(name, for_namespace=for_namespace, digests=digests)]


def corpus_pin(name: str, *, for_namespace: CacheNamespace | None = None) -> tuple[list[Conversation], list[str]]:
    """The conversations of a corpus now, and what pins them for a job's later runs.

    Returns:
        ``(conversations, digests)``: for a heat corpus the full digests of its
        prompts in order (pass them to :func:`corpus_load` at run time); for a
        bundled corpus an empty list (it does not change).

    Raises:
        ValueError: as :func:`corpus_load`.
    """
    if not name.startswith(HEAT_CORPUS):
        return load_corpus(name), []
    rows = _heat_rows(name, for_namespace=for_namespace, digests=None)
    return [_heat_conversation(r) for r in rows], [r.digest for r in rows]


def job_corpus(job: PrewarmJob | ComparisonJob) -> list[Conversation] | None:
    """The conversations a claimed job runs: its corpus as pinned at creation.

    Returns:
        The conversations; None when they cannot be had (a pinned prompt is
        gone), after failing the job with the reason.
    """
    try:
        return corpus_load(job.corpus, for_namespace=job.namespace, digests=job.corpus_digests)
    except ValueError as exc:
        job_finish(job, JobStatus.FAILED, error=str(exc), line=f"corpus: {exc}")
        return None


def _heat_rows(name: str, *, for_namespace: CacheNamespace | None, digests: Sequence[str] | None) -> list[PrefixHeat]:
    raw = name[len(HEAT_CORPUS) :]
    # ASCII digits only: str.isdigit() and int() also take other scripts' digits.
    rows: list[PrefixHeat] = []
    if raw.isascii() and raw.isdigit() and len(raw) <= 18:
        heat = PrefixHeat.objects.filter(namespace_id=int(raw))
        if for_namespace is not None:
            heat = heat.filter(namespace__tenant_id=for_namespace.tenant_id, namespace__group_id=for_namespace.group_id)
        if digests:
            found = {r.digest: r for r in heat.filter(digest__in=list(digests))}
            if missing := [d for d in digests if d not in found]:
                raise ValueError(
                    f"corpus {name!r}: {len(missing)} of the {len(digests)} prompts pinned when the job was created "
                    "are no longer there (deleted with their namespace)"
                )
            return [found[d] for d in digests]
        rows = list(heat.order_by("-hits", "-last_hit_at", "id")[:HEAT_CORPUS_SIZE])
    if not rows:
        raise ValueError(f"corpus {name!r}: no prefix heat reported for namespace {raw!r}")
    return rows


def _heat_conversation(row: PrefixHeat) -> Conversation:
    return Conversation(id=f"heat-{row.digest[:12]}", messages=row.messages, tools=row.tools, note=f"{row.hits} hits")


def prewarm_corpus_for(namespace: CacheNamespace | None) -> str:
    """The corpus that prewarms a successor of ``namespace``: its hottest
    prefixes when routers reported any, else the bundled diagnostic corpus."""
    if namespace is not None and PrefixHeat.objects.filter(namespace=namespace).exists():
        return f"{HEAT_CORPUS}{namespace.pk}"
    return "diagnostic"
