"""``python manage.py tenant create SLUG --name N`` and ``tenant owner NAME --email E``.

Twins of ``POST /api/tenants/`` and ``POST /api/retention-owners/``. Exit
codes: 0 done; 2 bad input or the name is taken (case and Unicode form do not
count).
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandParser

from cacheadmin.management.base import ControlPlaneCommand, cli_actor
from cacheadmin.services.namespaces import retention_owner_create, tenant_create

ACTOR = cli_actor()


class Command(ControlPlaneCommand):
    help = __doc__.split("\n\n", 1)[1].replace("\n", " ")

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        create = sub.add_parser("create", help="create a tenant")
        create.add_argument("slug", help="the tenant's short unique name (its slug)")
        create.add_argument("--name", required=True, help="display name")
        owner = sub.add_parser("owner", help="create a retention owner")
        owner.add_argument("name", help="the owner's name (a team or a person)")
        owner.add_argument("--email", required=True, help="where digests and eviction notices go")

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["verb"] == "create":
            tenant = tenant_create(slug=opts["slug"], name=opts["name"], actor=ACTOR)
            self.stdout.write(json.dumps({"id": tenant.pk, "slug": tenant.slug, "name": tenant.name}))
        else:
            owner = retention_owner_create(name=opts["name"], email=opts["email"], actor=ACTOR)
            self.stdout.write(json.dumps({"id": owner.pk, "name": owner.name, "email": owner.email}))
