"""``python manage.py job prewarm|compare|cancel|show``: background jobs from the CLI.

Twins of ``POST /api/prewarm-jobs/``, ``POST /api/comparison-jobs/``,
``POST /api/{kind}-jobs/{id}/cancel/`` and ``GET`` of a job. A started job runs
in a Celery worker; ``--wait`` blocks until it ends. Exit codes: 0 done (or
started); 1 the waited-for job failed; 2 bad input; 4 refused (engine not
ready, namespace not served by the engine, job already ended).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from django.core.management.base import CommandParser

from cacheadmin.management.base import ControlPlaneCommand, cli_actor, get_or_bad_input, positive_int
from cacheadmin.models import CacheNamespace, ComparisonJob, Engine, JobStatus, PrewarmJob, RegistrationJob
from cacheadmin.services.comparison import comparison_job_create
from cacheadmin.services.jobs import job_cancel
from cacheadmin.services.prewarm import prewarm_job_create

ACTOR = cli_actor()
KINDS = {"prewarm": PrewarmJob, "comparison": ComparisonJob, "registration": RegistrationJob}
EXIT_JOB_FAILED = 1


class Command(ControlPlaneCommand):
    help = __doc__.split("\n\n", 1)[1].replace("\n", " ")

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        prewarm = sub.add_parser("prewarm", help="fill a namespace's caches on an engine and verify")
        prewarm.add_argument("--namespace", type=positive_int, required=True, help="namespace id")
        prewarm.add_argument("--engine", type=positive_int, required=True, help="engine id serving the namespace")
        prewarm.add_argument("--corpus", default="diagnostic", help="bundled corpus: diagnostic, northwind or northwind-sample")
        compare = sub.add_parser("compare", help="with-cache vs reference comparison")
        compare.add_argument("--engine", type=positive_int, required=True, help="engine id answering with cache")
        compare.add_argument("--reference", type=positive_int, required=True, help="engine id answering without cache")
        compare.add_argument("--namespace", type=positive_int, required=True, help="namespace id")
        compare.add_argument("--corpus", default="diagnostic", help="bundled corpus: diagnostic, northwind or northwind-sample")
        compare.add_argument("--max-tokens", type=positive_int, default=16, help="tokens generated per prompt (greedy)")
        cancel = sub.add_parser("cancel", help="cancel a queued or running job")
        cancel.add_argument("kind", choices=sorted(KINDS), help="job kind")
        cancel.add_argument("id", type=positive_int, help="job id")
        cancel.add_argument("--reason", default="", help="why, for the audit trail")
        show = sub.add_parser("show", help="print a job")
        show.add_argument("kind", choices=sorted(KINDS), help="job kind")
        show.add_argument("id", type=positive_int, help="job id")
        for p in (prewarm, compare):
            p.add_argument("--wait", action="store_true", help="block until the job ends")
            p.add_argument("--timeout", type=positive_int, default=1800, help="seconds to wait at most")

    def handle(self, *args: Any, **opts: Any) -> None:
        job = getattr(self, f"verb_{opts['verb']}")(opts)
        if opts.get("wait"):
            deadline = time.monotonic() + opts["timeout"]
            while job.status in (JobStatus.QUEUED, JobStatus.RUNNING) and time.monotonic() < deadline:
                time.sleep(1.0)
                job.refresh_from_db()
        self.stdout.write(json.dumps(self._summary(job)))
        if job.status == JobStatus.FAILED:
            sys.exit(EXIT_JOB_FAILED)

    @staticmethod
    def _summary(job: Any) -> dict[str, Any]:
        fields = ("id", "status", "progress_done", "progress_total", "attempts", "error")
        out = {f: getattr(job, f) for f in fields}
        out["kind"] = type(job).__name__
        for extra in ("deceptive_hits", "cross_version_hits", "cached_tokens", "ttft_cold_ms", "ttft_warm_ms", "verified"):
            if hasattr(job, extra):
                out[extra] = getattr(job, extra)
        return out

    def verb_prewarm(self, opts: dict[str, Any]) -> PrewarmJob:
        namespace = get_or_bad_input(self, CacheNamespace, opts["namespace"], "namespace")
        engine = get_or_bad_input(self, Engine, opts["engine"], "engine")
        return prewarm_job_create(namespace=namespace, engine=engine, corpus=opts["corpus"], actor=ACTOR)

    def verb_compare(self, opts: dict[str, Any]) -> ComparisonJob:
        return comparison_job_create(
            engine=get_or_bad_input(self, Engine, opts["engine"], "engine"),
            reference_engine=get_or_bad_input(self, Engine, opts["reference"], "engine"),
            namespace=get_or_bad_input(self, CacheNamespace, opts["namespace"], "namespace"),
            corpus=opts["corpus"],
            max_tokens=opts["max_tokens"],
            actor=ACTOR,
        )

    def verb_cancel(self, opts: dict[str, Any]) -> Any:
        job = get_or_bad_input(self, KINDS[opts["kind"]], opts["id"], f"{opts['kind']} job")
        return job_cancel(job=job, actor=ACTOR, reason=opts["reason"])

    def verb_show(self, opts: dict[str, Any]) -> Any:
        return get_or_bad_input(self, KINDS[opts["kind"]], opts["id"], f"{opts['kind']} job")
