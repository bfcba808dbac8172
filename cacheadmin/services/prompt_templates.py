"""Prompt templates: create, delete, analyse prefix reuse per model version,
fingerprint for the gateways, and the per-minute counts they send back.

Template syntax: Python format-style placeholders. ``{customer}`` is a
variable (a Python identifier; no positional ``{}``, no format spec or
conversion), ``{{`` and ``}}`` are literal braces. The template's text is the
text of a conversation's first message (or a completion's prompt).

Why the analysis: vLLM's prefix cache reuses whole KV blocks of identical
leading tokens (block size 32 tokens or a multiple on CPU, see DESIGN.md), so
a prompt reuses what comes before its first varying part only. A template
that puts a per-request value early (a customer name in the first line)
shares few blocks; the same template with its variable parts at the end
shares every block of its fixed text.
"""

from __future__ import annotations

import re
import string
import threading
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F, Q, Sum
from django.utils import timezone

from cacheadmin.models import CacheNamespace, ModelVersion, PromptTemplate, TemplateStat, Tenant
from cacheadmin.models.gateway import routing_changed
from cacheadmin.services.audit import audit_record
from cacheadmin.services.quotas import quota_check
from gateway.templates import CHUNK_CHARS, TemplateIndex, fingerprint
from inference.corpus import Conversation
from inference.errors import CheckpointError, InvalidField
from inference.strict_json import loads_unique
from inference.tokenization import ChatEncodingError, ChatTokenizer, load_chat_tokenizer

#: Template names: they are metric label values, so bounded and plain (matched whole:
#: ``$`` would let a trailing newline through).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: Unpaired surrogates: a JSON ``"\\ud800"`` escape decodes to one; it is no character.
_SURROGATE = re.compile(r"[\ud800-\udfff]")
#: Samples per template: enough to see which parts vary, few enough to tokenize on a page view.
MAX_SAMPLES = 20
#: Longest template text and sample value, in characters.
MAX_TEXT_CHARS = 20_000
MAX_VALUE_CHARS = 4_000
#: Block size when a version's layout names none: vLLM's CPU default here (DESIGN.md).
DEFAULT_BLOCK_SIZE = 32
#: How far back the live hit ratio looks.
HIT_RATIO_WINDOW = timedelta(hours=1)

Parts = list[tuple[str, str | None]]


def template_parts(text: str) -> Parts:
    """``text`` as ``(literal, variable or None)`` pairs in order (literal braces unescaped).

    Raises:
        InvalidField: ``text`` is not a valid template (unbalanced braces, a
            positional ``{}``, a name that is not an identifier, a format spec or conversion).
    """
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise InvalidField("text", f"{exc} (write {{{{ and }}}} for literal braces)") from None
    parts: Parts = []
    for literal, name, spec, conversion in parsed:
        if name is not None:
            if not name.isidentifier():
                raise InvalidField("text", f"variable {{{name}}} must be a name (letters, digits, _), e.g. {{customer}}")
            if spec or conversion:
                raise InvalidField("text", f"variable {{{name}}} takes no format spec or conversion")
        parts.append((literal, name))
    return parts


def template_variables(parts: Parts) -> list[str]:
    """Variable names in order of first appearance."""
    seen: list[str] = []
    for _, name in parts:
        if name is not None and name not in seen:
            seen.append(name)
    return seen


def fixed_leading_text(parts: Parts) -> str:
    """The literal text before the first variable (the whole text when there is none)."""
    out = []
    for literal, name in parts:
        out.append(literal)
        if name is not None:
            break
    return "".join(out)


def template_render(parts: Parts, values: Mapping[str, str]) -> str:
    """The template with each variable replaced by its value."""
    return "".join(literal + (values[name] if name is not None else "") for literal, name in parts)


def template_render_moved(parts: Parts, values: Mapping[str, str], moved: Sequence[str]) -> str:
    """The template with the variables in ``moved`` taken out of their place and
    appended at the end, one ``name: value`` line each (the rest rendered in place)."""
    body = "".join(literal + (values[name] if name is not None and name not in moved else "") for literal, name in parts)
    tail = "".join(f"\n{name}: {values[name]}" for name in moved)
    return body + ("\n" + tail if tail else "")


def _check_characters(field: str, value: str) -> None:
    """Refuse what no database column or JSON answer carries: NUL (PostgreSQL
    refuses it in text and jsonb) and unpaired surrogates (a ``"\\ud800"``
    JSON escape; not a character, no UTF-8 encoding)."""
    if "\x00" in value:
        raise InvalidField(field, "must not contain the NUL character (U+0000)")
    if (lone := _SURROGATE.search(value)) is not None:
        raise InvalidField(field, f"must not contain the unpaired surrogate U+{ord(lone[0]):04X}, which is not a character")


def prompt_template_samples_parse(raw: str) -> Any:
    """A form's ``samples`` text as JSON, read as the API's parser reads a body:
    a key written twice in one object, NaN or ±Infinity is refused (not the last
    value silently kept). Empty text is None (refused by :func:`prompt_template_create`).

    Raises:
        InvalidField: ``samples`` is not such JSON.
    """
    if not raw.strip():
        return None
    try:
        return loads_unique(raw)
    except RecursionError:
        raise InvalidField("samples", "not JSON: nested too deeply") from None
    except ValueError as exc:
        raise InvalidField("samples", f"not JSON: {exc}") from None


def _check_samples(samples: Any, variables: list[str]) -> list[dict[str, str]]:
    if not isinstance(samples, list) or not samples:
        raise InvalidField("samples", 'must be a non-empty JSON list of objects, e.g. [{"customer": "Ada"}]')
    if len(samples) > MAX_SAMPLES:
        raise InvalidField("samples", f"at most {MAX_SAMPLES} samples, got {len(samples)}")
    out = []
    for i, sample in enumerate(samples):
        if not isinstance(sample, dict):
            raise InvalidField(f"samples.{i}", "must be a JSON object of variable → text")
        missing = [v for v in variables if v not in sample]
        extra = sorted(set(sample) - set(variables))
        if missing:
            raise InvalidField(f"samples.{i}", f"no value for {', '.join(missing)}")
        if extra:
            raise InvalidField(f"samples.{i}", f"{', '.join(extra)} is not a variable of the template")
        for name in variables:
            value = sample[name]
            if not isinstance(value, str):
                raise InvalidField(f"samples.{i}.{name}", f"must be a string, got {type(value).__name__}")
            if len(value) > MAX_VALUE_CHARS:
                raise InvalidField(f"samples.{i}.{name}", f"at most {MAX_VALUE_CHARS} characters")
            _check_characters(f"samples.{i}.{name}", value)
        out.append({name: sample[name] for name in variables})
    return out


def _scope(template: PromptTemplate, tenant: Tenant | None) -> str:
    """Where ``template`` applies, as told to someone creating one for ``tenant``;
    only called for templates that caller may see (its tenant's or a global one)."""
    if template.tenant_id is None:
        return "for all tenants"
    return f"for {tenant.slug}" if tenant is not None else "for one tenant"


def _clash(*, name: str, tenant: Tenant | None, digest: str, first_variable: str) -> InvalidField | None:
    """What a new template would clash with (name taken anywhere; the same fixed
    text as a template of the same precedence), or None.

    A name taken by another tenant's template is only "taken": nothing says by
    whom, so a tenant-bound caller learns nothing about other tenants."""
    taken = PromptTemplate.objects.filter(name=name).only("tenant_id").first()
    if taken is not None:
        visible = taken.tenant_id is None or (tenant is not None and taken.tenant_id == tenant.pk)
        where = f" {_scope(taken, tenant)}" if visible else ""
        return InvalidField(
            "name",
            f"a template named {name!r} already exists{where}: names are unique across every tenant "
            "(the name is the template label of the gateway's metrics, which carry no tenant)",
        )
    same_text = PromptTemplate.objects.filter(tenant=tenant, fixed_digest=digest).only("name", "tenant_id").first()
    if same_text is not None:
        return InvalidField(
            "text",
            f"template {same_text.name!r} ({_scope(same_text, tenant)}) has the same fixed text before "
            f"{{{first_variable}}}: the gateway could not tell which of the two a request follows "
            f"(change the opening, or delete {same_text.name!r} first)",
        )
    return None


def prompt_template_create(*, name: str, tenant: Tenant | None, text: str, samples: Any, actor: str) -> PromptTemplate:
    """Register a prompt template (the gateways pick it up at their next snapshot).

    The page, the API and the admin create through here: one set of rules.

    Args:
        name: :data:`NAME_PATTERN`, unique across the global templates and every
            tenant's (it is the ``template`` label of the gateway's metrics).
        tenant: the tenant whose requests it classifies, or None for every tenant.
        text: the template (module docstring for the syntax), at most
            :data:`MAX_TEXT_CHARS` characters, no NUL or unpaired surrogate; at
            least one variable, and at least :data:`gateway.templates.CHUNK_CHARS`
            characters before the first. Its fixed text (before the first
            variable, as the gateway matches it) must differ from that of every
            template of the same precedence: the other global ones for a global
            template, the tenant's own for a tenant's (a tenant's own template
            may repeat a global one's: it wins for that tenant).
        samples: a list of ``{variable: value}`` objects (1..:data:`MAX_SAMPLES`),
            every variable given, strings only (at most :data:`MAX_VALUE_CHARS`
            characters, no NUL or unpaired surrogate). From a form, read it
            with :func:`prompt_template_samples_parse`.

    Raises:
        InvalidField: any of the above is violated (``name`` for a taken name,
            ``text`` for a fixed text taken, naming the other template). The
            uniqueness holds under concurrent creates (database constraints).
    """
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidField("name", "1-64 characters: letters, digits, '.', '_' or '-', starting with a letter or digit")
    if not isinstance(text, str) or not text.strip():
        raise InvalidField("text", "must not be empty")
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidField("text", f"at most {MAX_TEXT_CHARS} characters")
    _check_characters("text", text)
    parts = template_parts(text)
    variables = template_variables(parts)
    if not variables:
        raise InvalidField(
            "text",
            "a template needs at least one {variable}: write one where each request's own text goes, "
            "e.g. {question} (the gateway recognises a template by the fixed text before its first variable)",
        )
    fixed = fixed_leading_text(parts)
    if len(fixed) < CHUNK_CHARS:
        raise InvalidField(
            "text",
            f"the gateway recognises a template by the text before its first variable: {len(fixed)} characters here, "
            f"at least {CHUNK_CHARS} needed",
        )
    clean = _check_samples(samples, variables)
    digest = fingerprint(name, fixed).fixed_digest.hex()
    if (clash := _clash(name=name, tenant=tenant, digest=digest, first_variable=variables[0])) is not None:
        raise clash
    try:
        with transaction.atomic():
            quota_check(tenant=tenant, kind="prompt_templates")
            template = PromptTemplate.objects.create(
                name=name, tenant=tenant, text=text, samples=clean, fixed_chars=len(fixed), fixed_digest=digest,
                created_by=actor,
            )  # fmt: skip
            audit_record(
                actor=actor, action="prompt_template.create", obj=template, after={"name": name, "fixed_chars": len(fixed)}
            )
            routing_changed([("templates", None)], model="cacheadmin.prompttemplate")
    except IntegrityError:
        # Created by someone else since the check above: the constraints said no; say which.
        raise _clash(name=name, tenant=tenant, digest=digest, first_variable=variables[0]) or InvalidField(
            "name", f"a template named {name!r} or with this fixed text was created meanwhile"
        ) from None
    return template


def prompt_template_delete(*, template: PromptTemplate, actor: str) -> None:
    """Delete a template and its counts (the gateways stop classifying by it at their next snapshot)."""
    with transaction.atomic():
        audit_record(actor=actor, action="prompt_template.delete", obj=template, before={"name": template.name})
        template.delete()
        routing_changed([("templates", None)], model="cacheadmin.prompttemplate")


# --- the gateways' side ------------------------------------------------------------


def template_indexes() -> dict[int | None, TemplateIndex]:
    """The indexes gateway requests are classified by (one query): tenant id →
    its own templates then the global ones (its own win over a global one with
    the same fixed text), for tenants that have templates of their own; None →
    the global ones alone, for every other tenant (absent when there are none)."""
    own: dict[int, list[Any]] = {}
    shared: list[Any] = []
    for template in PromptTemplate.objects.order_by("name", "id").only("name", "tenant_id", "text"):
        fp = fingerprint(template.name, fixed_leading_text(template_parts(template.text)))
        (own.setdefault(template.tenant_id, []) if template.tenant_id else shared).append(fp)
    indexes: dict[int | None, TemplateIndex] = {pk: TemplateIndex.of([*fps, *shared]) for pk, fps in own.items()}
    if shared:
        indexes[None] = TemplateIndex.of(shared)
    return indexes


def template_stats_flush(rows: Iterable[tuple[str, int, datetime, int, int]]) -> int:
    """Add one gateway process's template counts to the per-minute figures.

    Args:
        rows: ``(template name, namespace pk, minute, requests, warm)``. The
            name is resolved in the namespace's tenant (its own template first,
            then a global one); rows of a deleted template or namespace are skipped.

    Returns:
        Rows written.
    """
    rows = list(rows)
    if not rows:
        return 0
    tenant_of = dict(CacheNamespace.objects.filter(pk__in={r[1] for r in rows}).values_list("pk", "tenant_id"))
    by_name: dict[tuple[int | None, str], int] = {
        (t, n): pk
        for pk, t, n in PromptTemplate.objects.filter(name__in={r[0] for r in rows}).values_list("pk", "tenant_id", "name")
    }
    written = 0
    for name, namespace_pk, minute, requests, warm in sorted(rows, key=lambda row: (row[1], row[0], row[2])):
        if namespace_pk not in tenant_of:
            continue
        template_pk = by_name.get((tenant_of[namespace_pk], name)) or by_name.get((None, name))
        if template_pk is None:
            continue
        where = {"template_id": template_pk, "namespace_id": namespace_pk, "minute": minute}
        with transaction.atomic():
            try:
                with transaction.atomic():
                    stat, _ = TemplateStat.objects.get_or_create(**where)
            except IntegrityError:  # another gateway process created this minute's row first
                stat = TemplateStat.objects.get(**where)
            TemplateStat.objects.filter(pk=stat.pk).update(requests=F("requests") + requests, warm=F("warm") + warm)
        written += 1
    return written


def template_hit_ratios(
    templates: Iterable[PromptTemplate], *, since: datetime | None = None, tenant_id: int | None = None
) -> dict[int, dict[str, Any]]:
    """Template pk → ``{"requests", "warm", "hit_ratio"}`` over the minutes from
    ``since`` (default: the last :data:`HIT_RATIO_WINDOW`); ``hit_ratio`` is
    warm / requests (0..1), None without requests. One query.

    Args:
        tenant_id: count only the requests of this tenant's own namespaces
            (for a tenant-bound reader: a global template's figures otherwise
            add up every tenant's traffic); None counts every namespace.
    """
    since = since or timezone.now() - HIT_RATIO_WINDOW
    pks = [t.pk for t in templates]
    out: dict[int, dict[str, Any]] = {pk: {"requests": 0, "warm": 0, "hit_ratio": None} for pk in pks}
    stats = TemplateStat.objects.filter(template_id__in=pks, minute__gte=since)
    if tenant_id is not None:
        stats = stats.filter(namespace__tenant_id=tenant_id)
    sums = stats.values("template_id").annotate(r=Sum("requests"), w=Sum("warm")).order_by()
    for row in sums:
        out[row["template_id"]] = {"requests": row["r"], "warm": row["w"], "hit_ratio": row["w"] / row["r"] if row["r"] else None}
    return out


def templates_visible(tenant: Tenant | None) -> Q:
    """Templates a tenant-bound reader may see: its tenant's and the global ones (everything when None)."""
    return Q() if tenant is None else Q(tenant=tenant) | Q(tenant__isnull=True)


# --- the analysis ----------------------------------------------------------------

_tokenizers: dict[tuple[str, str], ChatTokenizer] = {}
_tokenizers_lock = threading.Lock()


def _tokenizer_of(version: ModelVersion) -> ChatTokenizer:
    """The version's chat tokenizer, loaded once per (checkpoint, tokenizer digest) in this process."""
    key = (version.path, version.tokenizer)
    with _tokenizers_lock:
        held = _tokenizers.get(key)
    if held is None:
        held = load_chat_tokenizer(Path(version.path))
        with _tokenizers_lock:
            _tokenizers[key] = held
    return held


def _common_prefix(sequences: Sequence[Sequence[int]]) -> int:
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for i in range(n):
        if any(s[i] != first[i] for s in sequences[1:]):
            return i
    return n


def _shared(tokenizer: ChatTokenizer, texts: Sequence[str]) -> int:
    ids = [
        tokenizer.encode_chat(Conversation(id=f"sample-{i}", messages=[{"role": "user", "content": t}]))
        for i, t in enumerate(texts)
    ]
    return _common_prefix(ids)


def prompt_template_analysis(template: PromptTemplate) -> list[dict[str, Any]]:
    """How many leading tokens the template's samples share under each model
    version's tokenizer and chat format, and what moving its varying parts to
    the end would add.

    Samples are rendered as a conversation of one user message, through the
    version's chat format (mistral_common or the HF chat template, as the
    engine serves it: :func:`inference.tokenization.load_chat_tokenizer`).

    Returns:
        One dict per model version, active (serving) versions first, then the
        newest: ``version`` (label), ``version_id``, ``status``, ``tokenizer``
        (its description), ``block_size`` (tokens), ``shared_tokens`` (leading
        tokens every sample has in common), ``shared_blocks``
        (``shared_tokens // block_size``: what the prefix cache can reuse),
        ``breaking_variable`` (the first variable whose sample values differ,
        None when none does), ``break_token`` (token index where the samples
        first differ, None when they are identical), ``moved_variables``
        (the varying variables that have fixed text after them),
        ``moved_shared_tokens`` / ``moved_shared_blocks`` (the same with those
        moved to the end, one ``name: value`` line each),
        ``extra_blocks`` (``moved_shared_blocks - shared_blocks``),
        ``recommendation`` (text, or "" when moving gains no block) and
        ``error`` ("" or why this version could not be analysed: unreadable
        checkpoint, a chat format that refuses the message).
    """
    parts = template_parts(template.text)
    variables = template_variables(parts)
    samples: list[dict[str, str]] = template.samples
    varying = [v for v in variables if len({s[v] for s in samples}) > 1]
    # A varying variable with only other varying variables (or nothing) after it is already at the end.
    order = [name for _, name in parts]
    literal_after = {
        name: any(lit for lit, _ in parts[i + 1 :]) or any(n is not None and n not in varying for n in order[i + 1 :])
        for i, (_, name) in enumerate(parts)
        if name is not None
    }
    moved = [v for v in varying if literal_after.get(v)]
    versions = sorted(
        ModelVersion.objects.all(), key=lambda v: (v.status != ModelVersion.Status.ACTIVE, -v.created_at.timestamp(), -v.pk)
    )
    rows: list[dict[str, Any]] = []
    for version in versions:
        block = int((version.inputs.get("layout") or {}).get("block_size") or DEFAULT_BLOCK_SIZE)
        row: dict[str, Any] = {
            "version": version.label, "version_id": version.pk, "status": version.status, "tokenizer": "",
            "block_size": block, "shared_tokens": None, "shared_blocks": None,
            "breaking_variable": varying[0] if varying else None, "break_token": None, "moved_variables": moved,
            "moved_shared_tokens": None, "moved_shared_blocks": None, "extra_blocks": 0, "recommendation": "", "error": "",
        }  # fmt: skip
        try:
            tokenizer = _tokenizer_of(version)
            row["tokenizer"] = tokenizer.describe()
            rendered = [template_render(parts, s) for s in samples]
            shared = _shared(tokenizer, rendered)
            moved_shared = _shared(tokenizer, [template_render_moved(parts, s, moved) for s in samples]) if moved else shared
        except (CheckpointError, ChatEncodingError, OSError) as exc:
            row["error"] = str(exc)
            rows.append(row)
            continue
        identical = len(set(rendered)) == 1
        row.update(
            shared_tokens=shared, shared_blocks=shared // block, break_token=None if identical else shared,
            moved_shared_tokens=moved_shared, moved_shared_blocks=moved_shared // block,
        )  # fmt: skip
        row["extra_blocks"] = row["moved_shared_blocks"] - row["shared_blocks"]
        if row["extra_blocks"] > 0:
            names = ", ".join("{" + v + "}" for v in moved)
            row["recommendation"] = (
                f"move {names} to the end: {row['extra_blocks']} more shared "
                f"block{'s' if row['extra_blocks'] != 1 else ''} ({row['extra_blocks'] * block} tokens)"
            )
        rows.append(row)
    return rows
