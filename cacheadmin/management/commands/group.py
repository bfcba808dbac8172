"""``python manage.py group create|join|leave|list``: shared groups, the only way tenants share prefixes.

Twins of ``POST /api/shared-groups/``, ``POST /api/shared-groups/{id}/join/``
and ``POST /api/shared-groups/{id}/leave/``. Exit codes: 0 done; 2 bad input
(one line on stderr); 4 refused (slug taken, already a member, not a member).
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandParser

from cacheadmin.management.base import ControlPlaneCommand, cli_actor, get_or_bad_input
from cacheadmin.models import SharedGroup, Tenant
from cacheadmin.services.namespaces import shared_group_create, shared_group_join, shared_group_leave

ACTOR = cli_actor()


class Command(ControlPlaneCommand):
    help = __doc__.split("\n\n", 1)[1].replace("\n", " ")

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        create = sub.add_parser("create", help="create a shared group")
        create.add_argument("slug", help="group slug")
        create.add_argument("--name", required=True, help="display name")
        for verb, text in (("join", "add a tenant to a group"), ("leave", "remove a tenant (supersedes the group's namespaces)")):
            p = sub.add_parser(verb, help=text)
            p.add_argument("slug", help="group slug")
            p.add_argument("tenant", help="tenant slug")
            p.add_argument("--reason", required=True, help="why, for the audit trail")
        sub.add_parser("list", help="list groups with their generation and members")

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["verb"] == "create":
            group = shared_group_create(slug=opts["slug"], name=opts["name"], actor=ACTOR)
            self._print(group)
        elif opts["verb"] in ("join", "leave"):
            group = get_or_bad_input(self, SharedGroup, opts["slug"], "shared group", slug=opts["slug"])
            tenant = get_or_bad_input(self, Tenant, opts["tenant"], "tenant", slug=opts["tenant"])
            change = shared_group_join if opts["verb"] == "join" else shared_group_leave
            change(group=group, tenant=tenant, actor=ACTOR, reason=opts["reason"])
            self._print(SharedGroup.objects.get(pk=group.pk))
        else:
            for group in SharedGroup.objects.prefetch_related("members").order_by("slug"):
                self._print(group)

    def _print(self, group: SharedGroup) -> None:
        members = sorted(t.slug for t in group.members.all())
        self.stdout.write(json.dumps({"id": group.pk, "slug": group.slug, "generation": group.generation, "members": members}))
