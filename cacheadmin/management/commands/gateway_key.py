"""``python manage.py gateway_key issue|revoke|list``: callers' keys for the gateway."""

from __future__ import annotations

import argparse
import json
from typing import Any

from django.core.management.base import CommandParser

from cacheadmin.management.base import ControlPlaneCommand, cli_actor, positive_int
from cacheadmin.models import GatewayKey, Tenant
from cacheadmin.services.gateway import KEY_HEAD, gateway_key_issue, gateway_key_revoke

ACTOR = cli_actor()


def _positive_float(value: str) -> float:
    """argparse type: a positive finite number."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value[:40]!r}") from None
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value[:40]!r}")
    return number


class Command(ControlPlaneCommand):
    help = (
        "Issue, revoke or list gateway keys (each bound to one tenant). 'issue' prints the key once; only its hash is "
        "stored. Exit codes: 0 done; 2 bad input (one line on stderr)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        issue = sub.add_parser("issue", help="create a key and print it (once)")
        issue.add_argument("--tenant", required=True, help="tenant slug the key's traffic belongs to")
        issue.add_argument("--name", required=True, help="what the key is for, e.g. support-bot")
        issue.add_argument("--rate", type=_positive_float, default=None, help="requests per second (default: GATEWAY_RATE_PER_S)")
        issue.add_argument("--burst", type=positive_int, default=None, help="requests at once (default: GATEWAY_BURST)")
        issue.add_argument("--json", action="store_true", help="print the key and its row as JSON")
        revoke = sub.add_parser("revoke", help="revoke a key by its prefix (gateways refuse it within a second)")
        revoke.add_argument("prefix", help="the key's prefix (or the whole key)")
        listing = sub.add_parser("list", help="list keys (never the keys themselves)")
        listing.add_argument("--tenant", default=None, help="only this tenant's keys (slug)")
        listing.add_argument("--json", action="store_true", help="print the keys as JSON")

    def handle(self, *args: Any, **opts: Any) -> None:
        verb = opts["verb"]
        if verb == "issue":
            tenant = Tenant.objects.filter(slug=opts["tenant"]).first()
            if tenant is None:
                raise self.bad_input(f"no tenant {opts['tenant'][:63]!r}")
            key, plain = gateway_key_issue(
                tenant=tenant, name=opts["name"], actor=ACTOR, rate_per_s=opts["rate"], burst=opts["burst"]
            )
            out = {"id": key.pk, "prefix": key.prefix, "tenant": tenant.slug, "name": key.name, "key": plain}
            self.stdout.write(json.dumps(out) if opts["json"] else plain)
        elif verb == "revoke":
            prefix = opts["prefix"]
            if prefix.startswith(f"{KEY_HEAD}_"):  # the whole key, as issue printed it: its prefix is the second part
                prefix = prefix.split("_")[1] if prefix.count("_") >= 2 else ""
            key = GatewayKey.objects.filter(prefix=prefix).select_related("tenant").first()
            if key is None:
                raise self.bad_input(f"no gateway key with prefix {prefix[:16]!r} (the 12 characters after {KEY_HEAD}_)")
            # Idempotent, like the API: revoking a revoked key changes nothing and says so.
            already = key.revoked_at is not None
            gateway_key_revoke(key=key, actor=ACTOR)
            self.stdout.write(f"{'already revoked' if already else 'revoked'} {key.prefix}")
        else:
            keys = GatewayKey.objects.select_related("tenant").order_by("id")
            if opts["tenant"] is not None:
                if not Tenant.objects.filter(slug=opts["tenant"]).exists():
                    raise self.bad_input(f"no tenant {opts['tenant'][:63]!r}")
                keys = keys.filter(tenant__slug=opts["tenant"])
            rows = [
                {
                    "id": k.pk,
                    "prefix": k.prefix,
                    "tenant": k.tenant.slug,
                    "name": k.name,
                    "rate_per_s": k.rate_per_s,
                    "burst": k.burst,
                    "revoked": k.revoked_at is not None,
                }  # fmt: skip
                for k in keys
            ]
            if opts["json"]:
                self.stdout.write(json.dumps(rows))
                return
            for r in rows:
                self.stdout.write(f"{r['prefix']}  {r['tenant']:12} {'revoked' if r['revoked'] else 'live':8} {r['name']}")
