"""``python manage.py demo [--no-serve]``: the main job, end to end, on real vLLM."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandParser

from cacheadmin.management.base import ControlPlaneCommand
from cacheadmin.services.accounting import accounting_scan_scheduled
from cacheadmin.services.demo import DemoError, demo_run
from cacheadmin.services.workers import WorkerProcess
from inference.engines.launcher import die_with_parent
from inference.errors import CheckpointError, EngineError

EXIT_CHECK_FAILED = 1
EXIT_INTERRUPTED = 130


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class Command(ControlPlaneCommand):
    help = (
        "Run the main job: build and register two model versions that differ only in weights, prewarm v1's "
        "namespace on a real vLLM engine, then upgrade to v2 unsafely (v1's storage prefix) and safely (its own "
        "namespace), with a comparison job for each. Serves the dashboard unless --no-serve. "
        "Exit codes: 0 unsafe upgrade caught and safe one clean; 1 not so; 2 bad input or a failed step; 130 interrupted."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--no-serve", action="store_true", help="print a JSON summary and exit")
        parser.add_argument("--addr", default="127.0.0.1:8000", help="dashboard address (default 127.0.0.1:8000)")
        parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt when comparing")

    def handle(self, *args: Any, **opts: Any) -> None:
        # Stop cleanly (worker, dashboard server, engines) on Ctrl-C and on
        # SIGTERM from a service manager; SIGINT is reinstated because a shell
        # starting us in the background leaves it ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _raise_interrupt)
        call_command("migrate", interactive=False, verbosity=0)
        serve = not opts["no_serve"]
        log = (lambda line: self.stderr.write(line)) if not serve else (lambda line: self.stdout.write(line))
        worker = WorkerProcess(settings.VAR_DIR / "logs" / "demo-worker.log", name="demo")
        server: subprocess.Popen[bytes] | None = None
        summary: dict[str, Any] | None = None
        worker.start()
        log(f"celery worker ready (broker {settings.CELERY_BROKER_URL.split('@')[-1]}), log {worker.log_path}")
        try:
            if serve:
                server = self._serve(opts["addr"])

            def watchdog() -> None:
                if not worker.alive():
                    log("celery worker died; restarting it (it recovers the lost job)")
                    worker.start()

            try:
                summary = demo_run(log=log, watchdog=watchdog, max_tokens=opts["max_tokens"])
            except (DemoError, EngineError, CheckpointError) as exc:
                raise self.bad_input(f"demo failed: {exc}") from exc
            ok = summary["caught"] and summary["clean"]
            if serve:
                self._report(summary)
                # While the dashboard is served, the scheduled accounting scans,
                # metric scrapes and eviction sweeps run too (not during the
                # main job: they would share its two cores with the TTFT measurements).
                worker.stop()
                worker = WorkerProcess(settings.VAR_DIR / "logs" / "demo-worker.log", name="demo", beat=True)
                worker.start()
                log("celery worker restarted with the beat scheduler (accounting, metrics, eviction sweeps)")
                scan = accounting_scan_scheduled()  # so the namespace pages show storage at once
                if scan is not None:
                    log(f"accounting scan #{scan.pk}: {scan.prefixes_seen} prefixes, {scan.bytes_total} bytes")
                log(f"dashboard: http://{opts['addr']}/  (Ctrl-C to stop)")
                assert server is not None
                server.wait()
            else:
                self.stdout.write(json.dumps(summary, indent=2))
            if not ok:
                sys.exit(EXIT_CHECK_FAILED)
        except KeyboardInterrupt:
            if summary is None:  # interrupted during the main job, not while serving
                log("interrupted; engines, worker and server stopped")
                sys.exit(EXIT_INTERRUPTED)
        finally:
            worker.stop()
            if server is not None and server.poll() is None:
                server.terminate()
                server.wait(timeout=10)

    def _serve(self, addr: str) -> subprocess.Popen[bytes]:
        password = self._ensure_admin()
        self.stdout.write(f"dashboard: http://{addr}/  user admin, password {password}")
        # Django's server is enough for one operator on one machine; --insecure
        # serves static files (htmx from node_modules) without DEBUG.
        server = subprocess.Popen(
            [sys.executable, "manage.py", "runserver", addr, "--noreload", "--insecure"],
            cwd=settings.BASE_DIR,
            env=os.environ.copy(),
            preexec_fn=die_with_parent,
        )
        time.sleep(1.0)
        if server.poll() is not None:
            raise self.bad_input(f"the dashboard server could not start on {addr} (exit {server.returncode})")
        return server

    def _ensure_admin(self) -> str:
        path = settings.VAR_DIR / "admin-password"
        password = os.environ.get("DEMO_ADMIN_PASSWORD") or (path.read_text().strip() if path.exists() else "")
        if not password:
            password = secrets.token_urlsafe(12)
            path.touch(mode=0o600)
            path.write_text(password)
        user_model = get_user_model()
        user, _ = user_model.objects.get_or_create(username="admin", defaults={"is_staff": True, "is_superuser": True})
        user.is_staff = user.is_superuser = True
        user.set_password(password)
        user.save()
        return password

    def _report(self, summary: dict[str, Any]) -> None:
        for kind in ("unsafe", "safe"):
            s = summary[kind]
            self.stdout.write(
                f"{kind:6} upgrade: {s['deceptive_hits']} deceptive hits / {s['prompts']} prompts, "
                f"{s['cached_tokens']} cached tokens, TTFT cold {s['ttft_cold_ms']} ms, warm {s['ttft_warm_ms']} ms"
            )
        verdict = "caught" if summary["caught"] else "NOT caught"
        self.stdout.write(f"unsafe upgrade {verdict}; safe upgrade {'clean' if summary['clean'] else 'NOT clean'}")
