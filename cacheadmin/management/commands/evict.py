"""``python manage.py evict plan|approve|cancel|show|sweep``: eviction runs from the CLI.

Twins of ``POST /api/eviction-runs/``, ``…/approve/``, ``…/cancel/`` and
``GET …/actions/``. A plan is a dry run: it prints every action with the
bytes it frees and touches nothing. An approved run executes in a Celery
worker; ``approve --wait`` blocks until it ends. ``sweep`` does now what the
scheduled sweep does (resume due runs, start runs past their notice, plan an
auto-approved run). Exit codes: 0 done; 1 the waited-for run failed; 2 bad
input; 3 a tier needed for planning is unreachable; 4 refused (a held
namespace, a run not awaiting approval, another scheduled run open).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from django.core.management.base import CommandParser

from cacheadmin.management.base import ControlPlaneCommand, cli_actor, get_or_bad_input, positive_int
from cacheadmin.models import CacheNamespace, EvictionRun, JobStatus
from cacheadmin.services.eviction import eviction_plan, eviction_run_approve, eviction_sweep
from cacheadmin.services.jobs import job_cancel

ACTOR = cli_actor()
EXIT_RUN_FAILED = 1


class Command(ControlPlaneCommand):
    help = __doc__.split("\n\n", 1)[1].replace("\n", " ")

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        plan = sub.add_parser("plan", help="plan a run (dry run) and print its actions")
        plan.add_argument(
            "--namespace", type=positive_int, action="append", default=None, help="only this namespace (repeatable)"
        )
        plan.add_argument("--purge", type=positive_int, action="append", default=[], help="drop this namespace (repeatable)")
        plan.add_argument("--no-orphans", action="store_true", help="leave prefixes without a namespace alone")
        plan.add_argument("--reason", default="", help="why, for the audit trail")
        approve = sub.add_parser("approve", help="approve a planned run")
        approve.add_argument("id", type=positive_int, help="eviction run id")
        approve.add_argument("--reason", required=True, help="why, for the audit trail")
        approve.add_argument("--wait", action="store_true", help="block until the run ends")
        approve.add_argument("--timeout", type=positive_int, default=3600, help="with --wait: seconds to wait")
        cancel = sub.add_parser("cancel", help="cancel a planned, queued or running run")
        cancel.add_argument("id", type=positive_int, help="eviction run id")
        cancel.add_argument("--reason", default="", help="why, for the audit trail")
        show = sub.add_parser("show", help="print a run and its actions")
        show.add_argument("id", type=positive_int, help="eviction run id")
        sub.add_parser("sweep", help="what the scheduled sweep does, now")

    def handle(self, *args: Any, **opts: Any) -> None:
        out = getattr(self, f"verb_{opts['verb']}")(opts)
        self.stdout.write(json.dumps(out, default=str))
        if isinstance(out, dict) and out.get("status") == JobStatus.FAILED:
            sys.exit(EXIT_RUN_FAILED)

    @staticmethod
    def _run(run: EvictionRun, *, actions: bool = False) -> dict[str, Any]:
        fields = (
            "id", "status", "trigger", "reason", "approved_by", "not_before", "bytes_planned", "bytes_freed",
            "progress_done", "progress_total", "attempts", "error",
        )  # fmt: skip
        out: dict[str, Any] = {f: getattr(run, f) for f in fields}
        if actions:
            out["actions"] = list(
                run.actions.order_by("seq").values(
                    "seq",
                    "kind",
                    "tier",
                    "namespace",
                    "storage_prefix",
                    "bytes_planned",
                    "bytes_freed",
                    "status",
                    "reason",
                    "confirmation",
                    "error",
                )  # fmt: skip
            )
        return out

    def _namespaces(self, ids: list[int]) -> list[CacheNamespace]:
        return [get_or_bad_input(self, CacheNamespace, i, "namespace") for i in ids]

    def verb_plan(self, opts: dict[str, Any]) -> dict[str, Any]:
        only = self._namespaces(opts["namespace"]) if opts["namespace"] is not None else None
        purge = self._namespaces(opts["purge"])
        run = eviction_plan(actor=ACTOR, only=only, purge=purge, include_orphans=not opts["no_orphans"], reason=opts["reason"])
        return self._run(run, actions=True)

    def verb_approve(self, opts: dict[str, Any]) -> dict[str, Any]:
        run = get_or_bad_input(self, EvictionRun, opts["id"], "eviction run")
        run = eviction_run_approve(run=run, actor=ACTOR, reason=opts["reason"])
        if opts["wait"]:
            deadline = time.monotonic() + opts["timeout"]
            while run.status in (JobStatus.QUEUED, JobStatus.RUNNING) and time.monotonic() < deadline:
                time.sleep(1.0)
                run.refresh_from_db()
        return self._run(run)

    def verb_cancel(self, opts: dict[str, Any]) -> dict[str, Any]:
        run = get_or_bad_input(self, EvictionRun, opts["id"], "eviction run")
        return self._run(job_cancel(job=run, actor=ACTOR, reason=opts["reason"]))

    def verb_show(self, opts: dict[str, Any]) -> dict[str, Any]:
        return self._run(get_or_bad_input(self, EvictionRun, opts["id"], "eviction run"), actions=True)

    def verb_sweep(self, opts: dict[str, Any]) -> dict[str, Any]:
        return eviction_sweep(actor=ACTOR)
