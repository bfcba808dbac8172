"""``python manage.py accounting scan|orphans|metrics``: what every tier holds, and who owns it.

``scan`` records bytes, entries, oldest/newest entry and last access per
namespace and tier (twin of ``POST /api/accounting-scans/``, but run here,
in this process); ``orphans`` prints what nobody owns (twin of
``GET /api/orphans/``); ``metrics`` scrapes every ready engine's /metrics.
Exit codes: 0 done; 1 the scan could not read a tier (named on stderr; the
other tiers were recorded), or an engine gave no metrics.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import CommandParser

from cacheadmin.management.base import ControlPlaneCommand, cli_actor
from cacheadmin.models import AccountingScan, JobStatus
from cacheadmin.services.accounting import accounting_scan_run, engine_metrics_scrape, orphans_report


class Command(ControlPlaneCommand):
    help = __doc__.split("\n\n", 1)[1].replace("\n", " ")

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        sub.add_parser("scan", help="scan every tier now")
        sub.add_parser("orphans", help="prefixes, namespaces and adapters nobody owns any more")
        sub.add_parser("metrics", help="scrape the /metrics of every ready engine")

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["verb"] == "scan":
            scan = AccountingScan.objects.create(created_by=cli_actor(), corpus="")
            accounting_scan_run(scan_id=scan.pk)
            scan.refresh_from_db()
            fields = ("id", "status", "prefixes_seen", "orphan_prefixes", "bytes_total", "error")
            self.stdout.write(json.dumps({f: getattr(scan, f) for f in fields}))
            if scan.status != JobStatus.SUCCEEDED:
                self.stderr.write(f"CommandError: {scan.error}")
                sys.exit(1)
        elif opts["verb"] == "orphans":
            self.stdout.write(json.dumps(orphans_report(), default=str))
        else:
            rows = engine_metrics_scrape()
            fields = ("ok", "error", "hit_rate", "kv_cache_usage")
            self.stdout.write(json.dumps([{"engine": r.engine.name, **{f: getattr(r, f) for f in fields}} for r in rows]))
            failed = [r.engine.name for r in rows if not r.ok]
            if failed:
                self.stderr.write(f"CommandError: no metrics from {', '.join(failed)}")
                sys.exit(1)
