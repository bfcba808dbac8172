"""``python manage.py api_token issue|revoke|list``: API tokens for release tooling."""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.management.base import CommandParser
from django.db import transaction

from cacheadmin.management.base import ControlPlaneCommand, cli_actor
from cacheadmin.models import ApiToken, Tenant
from cacheadmin.services.api_tokens import api_token_issue, api_token_revoke

ACTOR = cli_actor()


class Command(ControlPlaneCommand):
    help = (
        "Issue, revoke or list API tokens. 'issue' prints the key once (it is stored hashed). "
        "Exit codes: 0 done; 2 bad input (one line on stderr)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        issue = sub.add_parser("issue", help="create a token and print its key")
        issue.add_argument("--user", required=True, help="username the token acts as (created if missing)")
        issue.add_argument("--name", required=True, help="what the token is for, e.g. release-pipeline")
        issue.add_argument(
            "--scope",
            choices=ApiToken.Scope.values,
            default=ApiToken.Scope.READ,
            help="what the token may do: read, operate or admin",
        )
        issue.add_argument("--tenant", default=None, help="bind the token to this tenant slug")
        issue.add_argument("--json", action="store_true", help="print the token and its key as JSON")
        revoke = sub.add_parser("revoke", help="revoke a token by its prefix")
        revoke.add_argument("prefix", help="the token's prefix (or the whole key)")
        sub.add_parser("list", help="list tokens (never their keys)")

    def handle(self, *args: Any, **opts: Any) -> None:
        verb = opts["verb"]
        if verb == "issue":
            tenant = None
            if opts["tenant"] is not None:
                tenant = Tenant.objects.filter(slug=opts["tenant"]).first()
                if tenant is None:
                    raise self.bad_input(f"no tenant {opts['tenant']!r}")
            users = get_user_model()
            try:
                # The model field's own rules: not blank, at most 150 characters, letters, digits and @.+-_ only.
                username = users._meta.get_field(users.USERNAME_FIELD).clean(opts["user"], None)
            except ValidationError as exc:
                raise self.bad_input(f"--user {opts['user'][:60]!r}: {exc.messages[0]}") from exc
            with transaction.atomic():  # a refused token creates no user either
                user, _ = users.objects.get_or_create(**{users.USERNAME_FIELD: username})
                token, key = api_token_issue(user=user, name=opts["name"], scope=opts["scope"], tenant=tenant, actor=ACTOR)
            out = {"prefix": token.prefix, "scope": token.scope, "tenant": opts["tenant"], "key": key}
            self.stdout.write(json.dumps(out) if opts["json"] else key)
        elif verb == "revoke":
            token = ApiToken.objects.filter(prefix=opts["prefix"], revoked_at=None).first()
            if token is None:
                raise self.bad_input(f"no live token with prefix {opts['prefix']!r}")
            api_token_revoke(token=token, actor=ACTOR)
            self.stdout.write(f"revoked {token.prefix}")
        else:
            for token in ApiToken.objects.select_related("user", "tenant"):
                state = "revoked" if token.revoked_at else "live"
                self.stdout.write(
                    f"{token.prefix}  {token.scope:8} {token.tenant.slug if token.tenant else '-':12} {state:8} {token.name}"
                )
