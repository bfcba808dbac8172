"""``python manage.py tenant create SLUG --name N`` and ``tenant owner NAME --email E``.

Twins of ``POST /api/tenants/`` and ``POST /api/retention-owners/``. Exit
codes: 0 done; 2 bad input or the name is taken (case and Unicode form do not
count).
"""

from __future__ import annotations

import json
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandParser

from cacheadmin.management.base import ControlPlaneCommand
from cacheadmin.models import RetentionOwner, Tenant
from cacheadmin.models.naming import NOT_DIFFERENT, name_key
from cacheadmin.services.namespaces import retention_owner_get_or_create, tenant_get_or_create

ACTOR = "cli"


class Command(ControlPlaneCommand):
    help = __doc__.split("\n\n", 1)[1].replace("\n", " ")

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        create = sub.add_parser("create", help="create a tenant")
        create.add_argument("slug")
        create.add_argument("--name", required=True)
        owner = sub.add_parser("owner", help="create a retention owner")
        owner.add_argument("name")
        owner.add_argument("--email", required=True)

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["verb"] == "create":
            if Tenant.objects.filter(slug=opts["slug"]).exists():
                raise self.bad_input(f"tenant {opts['slug']!r} already exists")
            try:
                tenant = tenant_get_or_create(slug=opts["slug"], name=opts["name"], actor=ACTOR)
            except ValidationError as exc:
                # Name the field that was refused (slug or name), with the value typed.
                field, messages = next(iter(exc.message_dict.items())) if hasattr(exc, "error_dict") else ("slug", exc.messages)
                raise self.bad_input(f"{field} {opts.get(field, '')!r}: {messages[0]}") from exc
            self.stdout.write(json.dumps({"id": tenant.pk, "slug": tenant.slug, "name": tenant.name}))
        else:
            clash = RetentionOwner.objects.filter(name_key=name_key(opts["name"])).first()
            if clash is not None:
                raise self.bad_input(f"retention owner {clash.name!r} already exists ({NOT_DIFFERENT})")
            try:
                RetentionOwner(name=opts["name"], email=opts["email"]).full_clean(exclude=["name_key"])
            except ValidationError as exc:
                raise self.bad_input("; ".join(f"{k}: {v[0]}" for k, v in exc.message_dict.items())) from exc
            owner = retention_owner_get_or_create(name=opts["name"], email=opts["email"], actor=ACTOR)
            self.stdout.write(json.dumps({"id": owner.pk, "name": owner.name, "email": owner.email}))
