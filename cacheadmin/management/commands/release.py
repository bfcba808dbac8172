"""``python manage.py release plan|evidence|decide|status|ready|traffic|rollback``: the release workflow for pipelines.

Twins of ``POST /api/releases/`` (plan), ``…/evidence/``, ``…/decide/``,
``GET /api/releases/{id}/`` (status), ``…/ready/``, ``…/traffic/`` and ``…/rollback/``.
``plan`` without ``--from`` is a first deployment (ready at once, 100 % on the
tenant's existing namespace of ``--to``). Every verb prints one JSON object
(``--json`` is accepted for symmetry; ``from_version`` is null for a first deployment).
Exit codes: 0 ready (or rolled back); 2 bad input; 3 a decision is required;
4 refused (not allowed for the classification, missing evidence, nothing to
roll back to, a concurrent decision won); 5 preparing (prewarm or purge still
running; ``status --wait`` waits); 1 failed.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from django.core.management.base import CommandParser

from cacheadmin.management.base import ControlPlaneCommand, cli_actor, get_or_bad_input, int_within, positive_int
from cacheadmin.models import ComparisonJob, Engine, ModelVersion, Tenant
from cacheadmin.models.releases import Release
from cacheadmin.services.releases import (
    release_collect_tokenization_evidence,
    release_create,
    release_decide,
    release_mark_ready,
    release_rollback,
    release_set_traffic,
)

ACTOR = cli_actor()
EXIT = {
    Release.Status.READY: 0,
    Release.Status.ROLLED_BACK: 0,
    Release.Status.FAILED: 1,
    Release.Status.DECISION_REQUIRED: 3,
    Release.Status.PREPARING: 5,
}


class Command(ControlPlaneCommand):
    help = __doc__.split("\n\n", 1)[1].replace("\n", " ")

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        plan = sub.add_parser("plan", help="create a release and print its classification")
        plan.add_argument("--served-name", required=True, help="the model name clients ask for")
        plan.add_argument("--tenant", required=True, help="tenant slug")
        plan.add_argument(
            "--from", dest="from_version", type=positive_int, default=None,
            help="model version id it leaves; omitted: a first deployment (the pair's first version)",
        )  # fmt: skip
        plan.add_argument("--to", dest="to_version", type=positive_int, required=True, help="model version id it brings")
        evidence = sub.add_parser("evidence", help="collect the tokenization evidence (corpus token ids under both versions)")
        evidence.add_argument("id", type=positive_int, help="release id")
        decide = sub.add_parser("decide", help="take the invalidation decision")
        decide.add_argument("id", type=positive_int, help="release id")
        decide.add_argument(
            "--decision", required=True, choices=["verified_reuse", "new_namespace", "purge"], help="the invalidation decision"
        )
        decide.add_argument("--reason", required=True, help="why, for the audit trail")
        decide.add_argument("--comparison-job", type=positive_int, help="evidence (b) for verified_reuse")
        decide.add_argument("--engine", type=positive_int, help="engine to prewarm the new namespace on (new_namespace)")
        status = sub.add_parser("status", help="print a release (and its timeline)")
        status.add_argument("id", type=positive_int, help="release id")
        status.add_argument("--wait", action="store_true", help="wait while it is preparing")
        status.add_argument("--timeout", type=positive_int, default=1800, help="with --wait: seconds to wait")
        ready = sub.add_parser("ready", help="mark ready (refused, exit 4, while it is not)")
        ready.add_argument("id", type=positive_int, help="release id")
        traffic = sub.add_parser("traffic", help="gray release: percent of traffic on the new version")
        traffic.add_argument("id", type=positive_int, help="release id")
        traffic.add_argument("--percent", type=int_within(0, 100), required=True, help="share of traffic on the new version")
        rollback = sub.add_parser("rollback", help="route back to the old version's namespace")
        rollback.add_argument("id", type=positive_int, help="release id")
        rollback.add_argument("--reason", required=True, help="why, for the audit trail")
        for p in (plan, evidence, decide, status, ready, traffic, rollback):
            p.add_argument("--json", action="store_true", help="(default) one JSON object")

    def handle(self, *args: Any, **opts: Any) -> None:
        release = getattr(self, f"verb_{opts['verb']}")(opts)
        out = {
            f: getattr(release, f)
            for f in ("id", "served_name", "classification", "status", "decision", "decided_by", "traffic_percent", "error")
        }
        out.update(
            from_version=release.from_version.label if release.from_version_id else None, to_version=release.to_version.label,
            differing=release.diff.get("differing", []), non_kv=sorted(release.diff.get("non_kv", {})),
            timeline=[{"kind": e.kind, "actor": e.actor, "detail": e.detail} for e in release.events.order_by("at", "id")],
        )  # fmt: skip
        if release.tokenization_evidence:
            out["tokenization_identical"] = release.tokenization_evidence["identical"]
        self.stdout.write(json.dumps(out, default=str))
        sys.exit(EXIT[release.status])

    def _release(self, pk: int) -> Release:
        return get_or_bad_input(self, Release, pk, "release")

    def verb_plan(self, opts: dict[str, Any]) -> Release:
        return release_create(
            served_name=opts["served_name"],
            tenant=get_or_bad_input(self, Tenant, opts["tenant"], "tenant", slug=opts["tenant"]),
            from_version=(
                get_or_bad_input(self, ModelVersion, opts["from_version"], "model version") if opts["from_version"] else None
            ),
            to_version=get_or_bad_input(self, ModelVersion, opts["to_version"], "model version"),
            actor=ACTOR,
        )

    def verb_evidence(self, opts: dict[str, Any]) -> Release:
        release = self._release(opts["id"])
        release_collect_tokenization_evidence(release=release, actor=ACTOR)
        release.refresh_from_db()
        return release

    def verb_decide(self, opts: dict[str, Any]) -> Release:
        release = self._release(opts["id"])
        job = get_or_bad_input(self, ComparisonJob, opts["comparison_job"], "comparison job") if opts["comparison_job"] else None
        engine = get_or_bad_input(self, Engine, opts["engine"], "engine") if opts["engine"] else None
        return release_decide(
            release=release, decision=opts["decision"], actor=ACTOR, reason=opts["reason"], comparison_job=job, engine=engine
        )

    def verb_status(self, opts: dict[str, Any]) -> Release:
        # Read only: a release moves on its job's end (or the recovery sweep), never on a read.
        release = self._release(opts["id"])
        deadline = time.monotonic() + opts["timeout"]
        while opts["wait"] and release.status == Release.Status.PREPARING and time.monotonic() < deadline:
            time.sleep(1.0)
            release = self._release(opts["id"])
        return release

    def verb_ready(self, opts: dict[str, Any]) -> Release:
        return release_mark_ready(release=self._release(opts["id"]), actor=ACTOR)

    def verb_traffic(self, opts: dict[str, Any]) -> Release:
        return release_set_traffic(release=self._release(opts["id"]), percent=opts["percent"], actor=ACTOR)

    def verb_rollback(self, opts: dict[str, Any]) -> Release:
        return release_rollback(release=self._release(opts["id"]), actor=ACTOR, reason=opts["reason"])
