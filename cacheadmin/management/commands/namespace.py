"""``python manage.py namespace create|policy|salt|list``: cache namespaces from the CLI.

Twins of ``POST /api/namespaces/``, ``PUT /api/namespaces/{id}/policy/``,
``GET /api/namespaces/{id}/cache-salt/`` and ``POST /api/namespaces/{id}/prefix-heat/``. Exit codes: 0 done; 2 bad input (one
line on stderr); 4 refused (e.g. the derived namespace belongs to another
tenant, or the salt of a superseded shared-group namespace).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from django.core.management.base import CommandParser

from cacheadmin.management.base import ControlPlaneCommand, cli_actor, get_or_bad_input, positive_int
from cacheadmin.models import CacheNamespace, ModelVersion, RetentionOwner, SharedGroup, Tenant
from cacheadmin.models.naming import name_key
from cacheadmin.services.heat import prefix_heat_record
from cacheadmin.services.namespaces import (
    RetentionPolicySpec,
    namespace_get_or_create,
    namespace_policy_update,
    namespace_salt_read,
)
from inference.strict_json import loads_unique

ACTOR = cli_actor()


def _limit(value: str) -> int | None:
    """argparse type: a positive integer, or "none" for no limit."""
    return None if value.strip().lower() == "none" else positive_int(value)


def _non_negative(value: str) -> int:
    """argparse type: 0 or a positive integer."""
    return 0 if value.strip() == "0" else positive_int(value)


def _add_policy(parser: CommandParser) -> None:
    parser.add_argument("--max-age-s", type=_limit, required=True, help="seconds without a hit before eviction, or 'none'")
    parser.add_argument("--max-bytes", type=_limit, required=True, help="bytes per tier, or 'none'")
    parser.add_argument("--versions-kept", type=positive_int, required=True, help="versions of the served model kept hot")
    parser.add_argument("--cold-versions-kept", type=_non_negative, default=1, help="versions after those kept archived (cold)")
    parser.add_argument("--lru-k", type=positive_int, default=2, help="K of LRU-K within the byte budget")
    parser.add_argument("--pin", action="store_true", help="legal hold: never evicted while held")
    parser.add_argument("--hold-by", default="", help="with --pin: who placed the legal hold")
    parser.add_argument("--hold-reason", default="", help="with --pin: why the namespace is held")


def _policy(opts: dict[str, Any]) -> RetentionPolicySpec:
    return RetentionPolicySpec(
        max_age_since_last_hit_s=opts["max_age_s"],
        max_bytes=opts["max_bytes"],
        versions_kept=opts["versions_kept"],
        cold_versions_kept=opts["cold_versions_kept"],
        lru_k=opts["lru_k"],
        pinned=opts["pin"],
        hold_by=opts["hold_by"],
        hold_reason=opts["hold_reason"],
    )


class Command(ControlPlaneCommand):
    help = __doc__.split("\n\n", 1)[1].replace("\n", " ")

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        create = sub.add_parser("create", help="create (or return) the namespace of a model version and tenant")
        create.add_argument("--model-version", type=positive_int, required=True, help="model version id")
        boundary = create.add_mutually_exclusive_group(required=True)
        boundary.add_argument("--tenant", help="tenant slug")
        boundary.add_argument("--group", help="shared group slug (prefixes shared by its members)")
        create.add_argument("--owner", required=True, help="retention owner name")
        _add_policy(create)
        policy = sub.add_parser("policy", help="replace a namespace's retention policy")
        policy.add_argument("id", type=positive_int, help="namespace id")
        _add_policy(policy)
        policy.add_argument("--reason", required=True, help="why, for the audit trail")
        policy.add_argument("--release-hold", action="store_true", help="lift the namespace's legal hold on purpose")
        salt = sub.add_parser("salt", help="print the namespace's vLLM cache_salt (audited)")
        salt.add_argument("id", type=positive_int, help="namespace id")
        sub.add_parser("list", help="list namespaces")
        heat = sub.add_parser("heat", help="report a hot conversation (JSON file: messages, tools)")
        heat.add_argument("id", type=positive_int, help="namespace id")
        heat.add_argument("file", help='JSON object {"messages": [...], "tools": [...]?}; "-" reads stdin')
        heat.add_argument("--hits", type=positive_int, default=1, help="hits to add to the conversation's heat")
        for p in (create, policy):
            p.add_argument("--json", action="store_true", help="print the namespace as JSON")

    def handle(self, *args: Any, **opts: Any) -> None:
        getattr(self, f"verb_{opts['verb']}")(opts)

    def _print(self, namespace: CacheNamespace, as_json: bool) -> None:
        policy = namespace.policy
        out = {
            "id": namespace.pk,
            "namespace_key": namespace.namespace_key,
            "storage_prefix": namespace.storage_prefix,
            "tenant": namespace.tenant.slug if namespace.tenant_id else None,
            "group": namespace.group.slug if namespace.group_id else None,
            "model_version": namespace.model_version.label,
            "retention_owner": namespace.retention_owner.name,
            "policy": {
                k: getattr(policy, k)
                for k in (
                    "max_age_since_last_hit_s",
                    "max_bytes",
                    "versions_kept",
                    "cold_versions_kept",
                    "lru_k",
                    "pinned",
                    "hold_by",
                    "hold_reason",
                )  # fmt: skip
            },
        }
        self.stdout.write(json.dumps(out) if as_json else f"{namespace.pk} {namespace.namespace_key} {namespace.storage_prefix}")

    def verb_create(self, opts: dict[str, Any]) -> None:
        version = get_or_bad_input(self, ModelVersion, opts["model_version"], "model version")
        if opts["tenant"] is not None:
            boundary = {"tenant": get_or_bad_input(self, Tenant, opts["tenant"], "tenant", slug=opts["tenant"])}
        else:
            boundary = {"group": get_or_bad_input(self, SharedGroup, opts["group"], "shared group", slug=opts["group"])}
        owner = get_or_bad_input(self, RetentionOwner, opts["owner"], "retention owner", name_key=name_key(opts["owner"]))
        namespace, _ = namespace_get_or_create(
            model_version=version, retention_owner=owner, policy=_policy(opts), actor=ACTOR, **boundary
        )
        self._print(namespace, opts["json"])

    def verb_policy(self, opts: dict[str, Any]) -> None:
        namespace = get_or_bad_input(self, CacheNamespace, opts["id"], "namespace")
        namespace_policy_update(
            namespace=namespace, policy=_policy(opts), actor=ACTOR, reason=opts["reason"], release_hold=opts["release_hold"]
        )
        namespace.refresh_from_db()
        self._print(CacheNamespace.objects.select_related("policy").get(pk=namespace.pk), opts["json"])

    def verb_heat(self, opts: dict[str, Any]) -> None:
        namespace = get_or_bad_input(self, CacheNamespace, opts["id"], "namespace")
        try:
            text = sys.stdin.read() if opts["file"] == "-" else Path(opts["file"]).read_text(encoding="utf-8")
            body = loads_unique(text)
        except (OSError, ValueError) as exc:
            raise self.bad_input(f"{opts['file']}: {exc}") from exc
        if not isinstance(body, dict) or set(body) - {"messages", "tools"}:
            raise self.bad_input('the file must hold a JSON object with "messages" (and optionally "tools")')
        row = prefix_heat_record(namespace=namespace, messages=body.get("messages"), tools=body.get("tools"), hits=opts["hits"])
        self.stdout.write(json.dumps({"digest": row.digest, "hits": row.hits}))

    def verb_salt(self, opts: dict[str, Any]) -> None:
        namespace = get_or_bad_input(self, CacheNamespace, opts["id"], "namespace")
        salt = namespace_salt_read(namespace, actor=ACTOR, purpose="cli")
        self.stdout.write(salt)

    def verb_list(self, opts: dict[str, Any]) -> None:
        for ns in CacheNamespace.objects.select_related("tenant", "group", "model_version").order_by("id"):
            self.stdout.write(
                f"{ns.pk}  {ns.namespace_key[:16]}  {ns.boundary_label:16} {ns.model_version.label:20} "
                f"{ns.storage_prefix} {ns.residency}"
            )
