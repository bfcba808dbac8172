"""``python manage.py demo [--no-serve]``: the main job, end to end, on real vLLM."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError, CommandParser
from django.core.wsgi import get_wsgi_application

from cacheadmin.env import control_plane_environment, env_int, env_str, private_file, write_private_file
from cacheadmin.mail import digests_report, mail_count
from cacheadmin.management.addresses import listen_address
from cacheadmin.management.base import ControlPlaneCommand, float_within, int_within
from cacheadmin.management.ports import (
    DASHBOARD_EXAMPLE,
    GATEWAY_EXAMPLE,
    KV_EVENTS_METRICS_EXAMPLE,
    PlannedPort,
    port_problems,
)
from cacheadmin.metrics.multiproc import multiproc_dir, multiproc_reap
from cacheadmin.models import GatewayKey, Tenant
from cacheadmin.services.accounting import accounting_scan_scheduled
from cacheadmin.services.comparison import MAX_TOKENS
from cacheadmin.services.demo import HOLD_S, TRAFFIC_RATE_PER_S, Stage, demo_run
from cacheadmin.services.demo_models import DEFAULT_DEMO_MODEL, DEMO_MODELS
from cacheadmin.services.demo_release import ApiCallFailed
from cacheadmin.services.engines import engines_stop_all
from cacheadmin.services.gateway import gateway_key_issue, gateway_key_revoke
from cacheadmin.services.workers import GatewayProcess, KvEventsProcess, WorkerProcess
from inference.child_env import die_with_parent
from inference.errors import EXIT_CONFLICT, CheckpointError
from inference.keepalive import SERVER_IDLE_S

EXIT_CHECK_FAILED = 1
EXIT_INTERRUPTED = 130


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _already_stopping(signum: int, frame: object) -> None:
    # A signal handler: a plain write, no logging machinery (it may hold a lock the interrupted code holds).
    sys.stderr.write(f"signal {signum} received while stopping: the engines, worker and server are being stopped; wait\n")


def stop_without_interruption() -> None:
    """From here on, SIGINT and SIGTERM only say that the demo is stopping.

    A second Ctrl-C (or a supervisor's SIGTERM after it) used to raise inside the
    shutdown, print a traceback, exit 130 and risk leaving engines running that
    only this shutdown stops. SIGKILL still ends the process at once.
    """
    signal.signal(signal.SIGINT, _already_stopping)
    signal.signal(signal.SIGTERM, _already_stopping)


#: Where the dashboard is served when neither ``--addr`` nor ``GUNICORN_BIND`` says.
DEFAULT_BIND = DASHBOARD_EXAMPLE


def stopped_report(engines: list[str], started: list[str]) -> str:
    """The one line that says what the demo stopped, on every way it ends (done, a failed
    step, Ctrl-C, SIGTERM): the operator need not look for leftover processes.

    Args:
        engines: names of the engines stopped (``engines_stop_all``), in its order.
        started: the helper processes the run started and has stopped, in start order
            (``celery worker``, ``KV-event consumer``, ``dashboard server``, ``gateway``).

    Returns:
        E.g. ``"stopped 2 engine(s) (a, b), the celery worker, the KV-event consumer, the dashboard
        server and the gateway"``; ``"stopped no engine (none was running), the celery worker"``.
    """
    said = f"{len(engines)} engine(s) ({', '.join(engines)})" if engines else "no engine (none was running)"
    parts = [said, *(f"the {what}" for what in started)]
    return "stopped " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0])


#: The gateway key each served demo run issues to tenant acme (and revokes from the run before).
DEMO_GATEWAY_KEY_NAME = "demo"
_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")


def bind_address(value: str, *, name: str = "--addr") -> str:
    """Check a gunicorn bind address: ``HOST:PORT`` (``[::1]:8000`` for IPv6) or ``unix:PATH``.

    Returns:
        ``value`` unchanged.

    Raises:
        ImproperlyConfigured: any other shape, or a port outside 1..65535
            (0 would bind a random port nobody is told about).
    """
    if value.startswith("unix:") and len(value) > len("unix:"):
        return value
    match = _HOST_PORT.match(value)
    if match is None or not 1 <= int(match["port"]) <= 65535:
        raise ImproperlyConfigured(f"{name}={value!r} is not HOST:PORT (port 1-65535) or unix:PATH")
    return value


@dataclass(frozen=True)
class ServerOptions:
    """gunicorn settings of the dashboard and API server.

    Attributes:
        workers: pre-forked worker processes (each a full Django process).
        threads: request threads per worker; 1 is gunicorn's ``sync`` worker,
            more switches to ``gthread`` (keep-alive, threads waiting on the
            database overlap).
        timeout_s: a worker silent for this long is killed and replaced (a
            request running longer than this dies with it).
        graceful_timeout_s: on SIGTERM, how long the workers may take to
            finish the requests in flight and exit before they are killed.
    """

    workers: int
    threads: int
    timeout_s: int
    graceful_timeout_s: int

    @classmethod
    def from_env(cls) -> ServerOptions:
        """Read ``GUNICORN_WORKERS`` (default 2 x usable CPU cores + 1, gunicorn's
        sizing rule), ``GUNICORN_THREADS`` (1), ``GUNICORN_TIMEOUT_S`` (30) and
        ``GUNICORN_GRACEFUL_TIMEOUT_S`` (30; gunicorn's defaults both).

        Raises:
            ImproperlyConfigured: a value is not an integer or below 1.
        """
        cores = len(os.sched_getaffinity(0))  # a container's CPU set, not the host's
        return cls(
            workers=env_int("GUNICORN_WORKERS", 2 * cores + 1, minimum=1),
            threads=env_int("GUNICORN_THREADS", 1, minimum=1),
            timeout_s=env_int("GUNICORN_TIMEOUT_S", 30, minimum=1),
            # Not shorter: the workers' exit alone (the interpreter's final
            # garbage collection over the whole app) took 4-7 s here, 2-5
            # workers on 2 busy cores, and a worker killed at the limit is
            # logged as if it ran out of memory.
            graceful_timeout_s=env_int("GUNICORN_GRACEFUL_TIMEOUT_S", 30, minimum=1),
        )


def gunicorn_command(bind: str, options: ServerOptions, *, access_log: bool = False) -> list[str]:
    """The command line serving ``cacheadmin.wsgi`` with gunicorn (run from ``BASE_DIR``).

    Args:
        bind: ``HOST:PORT`` or ``unix:PATH`` (checked by :func:`bind_address`).
        options: workers, threads and timeouts.
        access_log: one line per request on stdout (off for benchmarks).

    Raises:
        ImproperlyConfigured: a malformed ``bind``.
    """
    command = [
        sys.executable, "-m", "gunicorn", "cacheadmin.wsgi:application",
        "--bind", bind_address(bind),
        "--workers", str(options.workers),
        "--threads", str(options.threads),
        "--timeout", str(options.timeout_s),
        "--graceful-timeout", str(options.graceful_timeout_s),
        # Threaded workers keep idle connections open; gunicorn's default (2 s) is shorter than clients' own idle
        # times (httpx: 5 s, browsers: minutes), which then send on a connection being closed (inference.keepalive).
        # Sync workers close each connection after its answer.
        "--keep-alive", str(SERVER_IDLE_S),
        # The app is imported once in the arbiter and the workers are forked
        # from it: measured here with 5 workers on 2 cores, the first answer
        # came after ~7 s instead of ~15 s, and each worker's own memory (PSS)
        # was ~18 MB instead of ~82 MB. Safe: nothing opens a database
        # connection at import, so no connection is shared across the fork.
        "--preload",
        # gunicorn 25.1+ opens a control socket at one fixed path per user by
        # default: two servers (demo, tests, bench) would take it from each other.
        "--no-control-socket",
        # Metrics: the workers write under METRICS_MULTIPROC_DIR; a worker's exit is marked.
        "--config", "python:cacheadmin.metrics.gunicorn_config",
    ]  # fmt: skip
    if Path("/dev/shm").is_dir():
        # Workers' heartbeat files on a memory file system: a slow disk then
        # cannot make the arbiter think a busy worker hangs (gunicorn's advice).
        command += ["--worker-tmp-dir", "/dev/shm"]
    if access_log:
        command += ["--access-logfile", "-"]
    return command


def static_collect(env: dict[str, str]) -> None:
    """``manage.py collectstatic`` into ``STATIC_ROOT`` with WhiteNoise's manifest
    storage: content-hashed names plus a ``.gz`` beside each compressible file.
    Idempotent; files that did not change keep their names.

    Raises:
        RuntimeError: collectstatic failed (its last output lines included),
            e.g. node_modules missing because ``scripts/setup`` did not run.
    """
    done = subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput", "--verbosity", "0"],
        cwd=settings.BASE_DIR,
        env={**env, "DJANGO_STATIC_MANIFEST": "1"},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"collectstatic failed (exit {done.returncode}):\n{tail}")


class DashboardServer:
    """gunicorn serving the pages, the API and (through WhiteNoise) the static
    files, as a child process that dies with its parent.

    Args:
        bind: ``HOST:PORT`` or ``unix:PATH``.
        log_path: file receiving gunicorn's log (and the access log, if on).
        options: workers, threads, timeouts; :meth:`ServerOptions.from_env` if None.
        env: extra environment (e.g. ``DATABASE_URL`` of a test database);
            ``DJANGO_STATIC_MANIFEST=1`` is always added.
        access_log: log one line per request.

    Raises:
        ImproperlyConfigured: a malformed ``bind`` or server variable.
    """

    def __init__(
        self,
        bind: str,
        *,
        log_path: Path,
        options: ServerOptions | None = None,
        env: dict[str, str] | None = None,
        access_log: bool = False,
    ) -> None:
        self.options = options or ServerOptions.from_env()
        self.command = gunicorn_command(bind, self.options, access_log=access_log)
        self.bind = bind
        self.log_path = log_path
        # An allowlist, not this process's environment (cacheadmin.env.control_plane_environment);
        # its workers write their metrics where the control plane's /metrics reads them.
        self.env = control_plane_environment(
            {"PROMETHEUS_MULTIPROC_DIR": str(multiproc_dir(settings.METRICS_MULTIPROC_DIR)), **(env or {}),
             "DJANGO_STATIC_MANIFEST": "1"}
        )  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0  # where this server's own lines start in a shared log

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT`` to reach the server (a wildcard host is reached on loopback)."""
        if self.bind.startswith("unix:"):
            return "http://localhost"
        host, _, port = self.bind.rpartition(":")
        host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
        return f"http://{host}:{port}"

    def client(self, **kwargs: Any) -> httpx.Client:
        """An HTTP client of this server (over the socket file for ``unix:`` binds)."""
        if self.bind.startswith("unix:"):
            kwargs.setdefault("transport", httpx.HTTPTransport(uds=self.bind[len("unix:") :]))
        return httpx.Client(base_url=self.base_url, **kwargs)

    def start(self, *, ready_timeout_s: float = 60.0, collect_static: bool = True) -> None:
        """Collect the static files (unless ``collect_static`` is false: they are
        already), start gunicorn and wait until it answers HTTP.

        Ready means any HTTP answer to ``GET /healthz``: a 400 (a host name
        outside ``DJANGO_ALLOWED_HOSTS``) or a 503 (a busy database) still
        comes from a serving process.

        Raises:
            RuntimeError: collectstatic failed, or gunicorn exited or did not
                answer within ``ready_timeout_s`` (the log's tail included).
        """
        if collect_static:
            static_collect(self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command,
                cwd=settings.BASE_DIR,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + ready_timeout_s
        # Connecting fails fast until gunicorn listens; reading may wait while
        # the workers boot, and is not retried (a timed-out request would
        # still be served later, by a worker with nobody listening).
        with self.client(timeout=httpx.Timeout(2.0, read=ready_timeout_s)) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"gunicorn exited with {self.proc.returncode}:\n{self.tail()}")
                try:
                    client.get("/healthz")
                    return
                except httpx.TransportError:
                    time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"gunicorn did not answer on {self.bind} within {ready_timeout_s:.0f} s:\n{self.tail()}")

    def alive(self) -> bool:
        """True while the gunicorn master runs."""
        return self.proc is not None and self.proc.poll() is None

    def wait(self) -> int:
        """Block until gunicorn exits; its exit status."""
        assert self.proc is not None, "start() first"
        return self.proc.wait()

    def stop(self) -> int | None:
        """Graceful stop (SIGTERM: requests in flight finish), SIGKILL if it
        outlasts the graceful timeout by 5 s. Its exit status, None if never started."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=self.options.graceful_timeout_s + 5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines this server wrote to its log."""
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as fh:
            fh.seek(self._log_offset)
            return "\n".join(fh.read().decode("utf-8", "replace").splitlines()[-lines:])


class Command(ControlPlaneCommand):
    help = (
        "Run the main job: v1 serves tenant acme through the gateway under steady live traffic; v2 (new weights) is "
        "released over the API (incompatible, decision new_namespace, prewarmed from live heat, gray 10 % then 100 % "
        "with shadow verification), v1 is demoted by the next sweep and a rollback restores it from the cold tier; "
        "beside it, v2 on v1's persistent tier (the unsafe upgrade) is caught by a comparison job. Serves the "
        "dashboard unless --no-serve (then prints a JSON summary). Exit codes: 0 the unsafe upgrade was caught, the "
        "safe one clean, the release reached 100 % with no shadow deceptive hit and no cross-version answer and "
        "rolled back from cold; 1 not so; 2 bad input or a failed step; 130 interrupted."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--no-serve", action="store_true", help="print a JSON summary and exit")
        parser.add_argument(
            "--addr",
            default=None,
            help=f"dashboard address HOST:PORT or unix:PATH (default GUNICORN_BIND, else {DEFAULT_BIND})",
        )
        parser.add_argument(
            "--gateway-addr",
            default=None,
            help=f"gateway address HOST:PORT (default GATEWAY_ADDR, else {settings.GATEWAY_ADDR})",
        )
        parser.add_argument(
            "--kv-events-metrics-addr",
            default=None,
            help="the KV-event consumer's metrics address HOST:PORT (default KV_EVENTS_METRICS_ADDR, else "
            f"{KV_EVENTS_METRICS_EXAMPLE}; an empty variable serves none)",
        )
        parser.add_argument(
            "--model", choices=sorted(DEMO_MODELS), default=None,
            help=f"the model the main job runs on (default DEMO_MODEL, else {DEFAULT_DEMO_MODEL}): {DEFAULT_DEMO_MODEL}, "
            "the real SmolLM2-135M-Instruct fine-tuned here into a customer-service assistant (built and trained "
            "on the first run, about 3 minutes), or tiny, two random-weight models (seconds)",
        )  # fmt: skip
        parser.add_argument(
            "--max-tokens", type=int_within(1, MAX_TOKENS), default=None,
            help="tokens generated per prompt when comparing (default the model's: 32 for the real model, 16 for tiny)",
        )  # fmt: skip
        parser.add_argument(
            "--rate", type=float_within(0.1, 50.0), default=TRAFFIC_RATE_PER_S,
            help=f"requests per second of live traffic through the gateway (default {TRAFFIC_RATE_PER_S:g})",
        )  # fmt: skip
        parser.add_argument(
            "--hold-s", type=float_within(1.0, 3600.0), default=HOLD_S,
            help=f"seconds of traffic at each gray step and after the rollback (default {HOLD_S:g})",
        )  # fmt: skip

    def handle(self, *args: Any, **opts: Any) -> None:
        # Stop cleanly (worker, dashboard server, engines) on Ctrl-C and on
        # SIGTERM from a service manager; SIGINT is reinstated because a shell
        # starting us in the background leaves it ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _raise_interrupt)
        model_key = opts["model"] or env_str("DEMO_MODEL", DEFAULT_DEMO_MODEL)
        if model_key not in DEMO_MODELS:
            raise self.bad_input(f"DEMO_MODEL must be one of {', '.join(sorted(DEMO_MODELS))}, got {model_key!r}")
        serve = not opts["no_serve"]
        addr = opts["addr"] or env_str("GUNICORN_BIND", DEFAULT_BIND)
        server: DashboardServer | None = None
        if serve:
            # Before anything else (the database, minutes of engines): a typo in the server's
            # settings fails at once and changes nothing.
            try:
                server = DashboardServer(
                    bind_address(addr, name="--addr" if opts["addr"] else "GUNICORN_BIND"),
                    log_path=settings.VAR_DIR / "logs" / "dashboard.log",
                    access_log=True,
                )
            except ImproperlyConfigured as exc:
                raise self.bad_input(str(exc)) from exc
        gateway_addr, kv_events_metrics_addr = self._ports_free(opts, server)
        if not any(settings.DEMO_MODELS_DIR.is_relative_to(root) for root in settings.MODEL_ROOTS):
            # Checked before minutes of building: a checkpoint there could not be registered.
            roots = ", ".join(str(root) for root in settings.MODEL_ROOTS)
            raise self.bad_input(f"DEMO_MODELS_DIR {settings.DEMO_MODELS_DIR} lies outside MODEL_ROOTS ({roots})")
        call_command("migrate", interactive=False, verbosity=0)
        # The demo owns its deployment's engines: an earlier run killed before it could stop them
        # (or engines started from its pages) are stopped, by pid and start time, never by name.
        reaped = engines_stop_all(actor="demo", reason="left running by an earlier run")
        if reaped:
            self.stderr.write(f"stopped {len(reaped)} engine(s) an earlier run left running: {', '.join(reaped)}")
        log = (lambda line: self.stderr.write(line)) if not serve else (lambda line: self.stdout.write(line))
        # Owners' digests go through EMAIL_BACKEND (files under VAR_DIR/mail/ by default), never across
        # the run's lines: one line after the main job says how many and where.
        mail_before = mail_count()
        # The demo starts a process group: the metrics files of an earlier run's dead processes are not this
        # run's; a live process's (a worker or a server still running on this VAR_DIR) stay, totals included.
        multiproc_reap(settings.METRICS_MULTIPROC_DIR, every_type=True)
        # The model first, before any process of the demo starts: its build and fine-tunes (minutes on the
        # first run) then share the cores with nothing; later runs reuse them.
        model = DEMO_MODELS[model_key]
        log(f"model: {model.title}")
        try:
            checkpoints = model.checkpoints(settings.DEMO_MODELS_DIR, log)
        except CheckpointError as exc:
            raise self.bad_input(f"demo failed: {exc}") from exc
        # With the beat scheduler from the start: the dashboard's schedules, engine hit ratios and
        # storage move during the run, not only after it. Nothing in the run waits for beat to be
        # off: a scheduled sweep gives owners EVICTION_NOTICE_S of notice (1 h) before it starts and
        # the run's own sweep cancels such a waiting run first; the planner keeps an open release's
        # candidate hot, so no sweep demotes the version being shipped.
        worker = WorkerProcess(settings.VAR_DIR / "logs" / "demo-worker.log", name="demo", beat=True)
        summary: dict[str, Any] | None = None
        interrupted = False
        failure: CommandError | None = None
        started: list[str] = []  # what the final line says was stopped
        try:
            worker.start()
        except RuntimeError as exc:
            raise self.bad_input(f"demo failed: {exc}") from exc
        started.append("celery worker")
        log(
            f"celery worker ready with the beat scheduler (accounting, metrics, health, eviction sweeps; broker "
            f"{settings.CELERY_BROKER_URL.split('@')[-1]}), log {worker.log_path}"
        )
        # Its metrics where deploy/prometheus/prometheus.yml's kvcp-kv-events job scrapes them.
        consumer = KvEventsProcess(
            settings.VAR_DIR / "logs" / "demo-kv-events.log", name="demo", metrics_addr=kv_events_metrics_addr
        )
        stack = contextlib.ExitStack()
        try:
            try:
                consumer.start()
            except RuntimeError as exc:
                raise self.bad_input(f"demo failed: {exc}") from exc
            started.append("KV-event consumer")
            metrics_at = f", metrics http://{consumer.metrics_addr}/metrics" if consumer.metrics_addr else ""
            log(f"KV-event consumer ready (resident tokens per namespace, isolation alarms){metrics_at}, log {consumer.log_path}")
            if server is not None:
                started.append("dashboard server")  # stopped below even when its start fails half way
                self._serve(server, log)

            def watchdog() -> None:
                if not worker.alive():
                    log("celery worker died; restarting it (it recovers the lost job)")
                    worker.start()
                if not consumer.alive():
                    log("KV-event consumer died; restarting it (it resumes from its checkpoint)")
                    consumer.start()

            gateway_log = settings.VAR_DIR / "logs" / "demo-gateway.log"
            gateway = GatewayProcess(gateway_log, env={"GATEWAY_ADDR": gateway_addr}, name="demo")
            stack.callback(gateway.stop)
            started.append("gateway")
            try:
                gateway.start()
            except RuntimeError as exc:
                raise self.bad_input(f"demo failed: {exc}") from exc
            log(f"gateway on http://{gateway_addr}/v1 (OpenAI-compatible), log {gateway.log_path}")
            # Release tooling calls the API of the served dashboard, or (serving nothing) the same
            # WSGI application in this process.
            api_client = (
                server.client(timeout=120)
                if server is not None
                else httpx.Client(transport=httpx.WSGITransport(app=get_wsgi_application()), base_url="http://127.0.0.1")
            )
            stack.callback(api_client.close)
            stage = Stage(gateway_url=f"http://{gateway_addr}", api_client=api_client)
            try:
                summary = demo_run(
                    log=log, stage=stage, watchdog=watchdog, model=model, checkpoints=checkpoints, max_tokens=opts["max_tokens"],
                    keep_serving=serve,
                    rate_per_s=opts["rate"], hold_s=opts["hold_s"],
                )  # fmt: skip
            except (ApiCallFailed, RuntimeError, CheckpointError) as exc:
                # RuntimeError: a step failed (DemoError, EngineError) or a helper process
                # the watchdog restarted did not come back.
                raise self.bad_input(f"demo failed: {exc}") from exc
            log(digests_report(mail_before))
            if server is not None:
                self._report(summary)
                scan = accounting_scan_scheduled()  # so the namespace pages show storage at once
                if scan is not None:
                    log(f"accounting scan #{scan.pk}: {scan.prefixes_seen} prefixes, {scan.bytes_total} bytes")
                serving = summary.get("serving")
                if serving:
                    log(
                        f"engine {serving['name']} (#{serving['id']}) keeps serving v1's namespace at {serving['base_url']} "
                        "behind the gateway: prewarm, compare or release against it; it stops with the demo"
                    )
                key = self._gateway_key()
                log(f"gateway: http://{gateway_addr}/v1 (tenant acme's key {key})")
                log(f"dashboard: {server.base_url}/  (Ctrl-C to stop)")
                status = server.wait()
                if status != 0:
                    raise self.bad_input(f"the dashboard server exited with {status}; see {server.log_path}")
            else:
                self.stdout.write(json.dumps(summary, indent=2))
            if not summary["ok"]:
                sys.exit(EXIT_CHECK_FAILED)
        except KeyboardInterrupt:
            stop_without_interruption()
            # Said at once: stopping engines takes seconds, and a silent terminal looks hung.
            # What was stopped is said once, when it is (below).
            log("interrupted; stopping what the demo started (this takes seconds)")
            if summary is None:  # interrupted during the main job, not while serving
                interrupted = True
        except CommandError as exc:
            # A failed step: said after the stop, on the same one line as what was stopped.
            failure = exc
        finally:
            stop_without_interruption()
            stack.close()
            worker.stop()
            consumer.stop()
            if server is not None:
                server.stop()
            # Every engine of the deployment stops with the demo: the ones it kept serving and the
            # ones started from its pages and API while it served (detached: nothing else ends them).
            stopped = engines_stop_all(actor="demo", reason="the demo stopped")
            if failure is None:
                log(stopped_report(stopped, started))
        if failure is not None:
            raise self.failed(f"{failure}; {stopped_report(stopped, started)}", failure.returncode) from failure
        if interrupted:
            sys.exit(EXIT_INTERRUPTED)

    def _ports_free(self, opts: dict[str, Any], server: DashboardServer | None) -> tuple[str, str]:
        """The gateway's address and the KV-event consumer's metrics address ("" for none), once
        every port the demo binds (the dashboard's, the gateway's, the consumer's metrics) is
        free: checked before anything is migrated or started.

        Raises:
            CommandError: (exit 2) a malformed gateway or metrics address, named with its flag or
                variable; (exit 3) a port taken or planned twice, each named with the flag or
                variable that sets it.
        """
        gateway_addr = opts["gateway_addr"] or settings.GATEWAY_ADDR
        given = opts["kv_events_metrics_addr"]
        metrics_addr = settings.KV_EVENTS_METRICS_ADDR if given is None else given
        checks = [
            (gateway_addr, "--gateway-addr" if opts["gateway_addr"] else "GATEWAY_ADDR", GATEWAY_EXAMPLE),
            (metrics_addr, "--kv-events-metrics-addr" if given is not None else "KV_EVENTS_METRICS_ADDR",
             KV_EVENTS_METRICS_EXAMPLE),
        ]  # fmt: skip
        if given == "":
            # An empty variable turns the metrics off; an empty flag is more likely a script's unset variable.
            raise self.bad_input(
                f"--kv-events-metrics-addr: must be HOST:PORT (e.g. {KV_EVENTS_METRICS_EXAMPLE}); "
                "to serve no metrics set KV_EVENTS_METRICS_ADDR empty"
            )
        for value, source, example in checks:
            if value:
                try:
                    listen_address(value, example=example)
                except ValueError as exc:
                    raise self.bad_input(f"{source}: {exc}") from exc
        planned = [PlannedPort(gateway_addr, "--gateway-addr or GATEWAY_ADDR", "gateway", GATEWAY_EXAMPLE)]
        if server is not None and not server.bind.startswith("unix:"):
            planned.insert(0, PlannedPort(server.bind, "--addr or GUNICORN_BIND", "dashboard", DASHBOARD_EXAMPLE))
        if metrics_addr:
            planned.append(
                PlannedPort(
                    metrics_addr, "--kv-events-metrics-addr or KV_EVENTS_METRICS_ADDR", "KV-event consumer metrics",
                    KV_EVENTS_METRICS_EXAMPLE,
                )
            )  # fmt: skip
        problems = port_problems(planned)
        if problems:
            raise self.failed("; ".join(problems), EXIT_CONFLICT)
        return gateway_addr, metrics_addr

    def _serve(self, server: DashboardServer, log: Any) -> None:
        password = self._ensure_admin()
        self.stdout.write(f"dashboard: {server.base_url}/  user admin, password {password}")
        # The production server from the start: the pages can be watched while
        # the main job runs, and what the demo serves is what a deployment serves.
        try:
            server.start()
        except RuntimeError as exc:
            raise self.bad_input(f"the dashboard server could not start on {server.bind}: {exc}") from exc
        o = server.options
        log(
            f"gunicorn on {server.bind}: {o.workers} workers x {o.threads} threads, static files by WhiteNoise; "
            f"log {server.log_path}"
        )

    def _gateway_key(self) -> str:
        """A gateway key of tenant acme for trying the gateway: one per demo run,
        kept in var/; the key an earlier run issued is revoked first, so only the
        kept one is valid (an earlier run's key was printed and kept too)."""
        tenant = Tenant.objects.filter(slug="acme").first()
        if tenant is None:
            return "(no tenant acme)"
        for earlier in GatewayKey.objects.filter(tenant=tenant, name=DEMO_GATEWAY_KEY_NAME, revoked_at__isnull=True):
            gateway_key_revoke(key=earlier, actor="demo")
        _, key = gateway_key_issue(tenant=tenant, name=DEMO_GATEWAY_KEY_NAME, actor="demo")
        # Owner-only even over a file an earlier run left (which may be 0644): the key is a credential.
        write_private_file(settings.VAR_DIR / "gateway-key", key)
        return key

    def _ensure_admin(self) -> str:
        path = settings.VAR_DIR / "admin-password"
        password = os.environ.get("DEMO_ADMIN_PASSWORD") or (path.read_text().strip() if path.exists() else "")
        if not password:
            password = secrets.token_urlsafe(12)
            write_private_file(path, password)
        elif path.exists():
            private_file(path)  # kept from an earlier run, perhaps written world-readable
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
                f"{kind:6} upgrade: {s['deceptive_hits']} deceptive hits, {s['cross_version_hits']} cross-version hits "
                f"/ {s['prompts']} prompts, "
                f"{s['cached_tokens']} cached tokens, TTFT cold {s['ttft_cold_ms']} ms, warm {s['ttft_warm_ms']} ms"
            )
        verdict = "caught" if summary["caught"] else "NOT caught"
        self.stdout.write(f"unsafe upgrade {verdict}; safe upgrade {'clean' if summary['clean'] else 'NOT clean'}")
        r, t = summary["release"], summary["traffic"]
        self.stdout.write(
            f"release #{r['id']} ({r['classification']}, {r['decision']}): ready before traffic {r['ready']}, reached "
            f"{r['traffic_percent']} %, rolled back from the cold tier {r['rolled_back_from_cold']}"
        )
        self.stdout.write(
            f"traffic: {t['requests']} requests; hit ratio response {t['response_cache_hit_ratio']}, semantic "
            f"{t['semantic_cache_hit_ratio']}; prefix cached-token ratio {t['prefix_cached_token_ratio']}; cost savings "
            f"{t['cost_savings_rate']}; shadow checks {t['shadow_checked']} ({t['shadow_deceptive_hits']} deceptive); "
            f"cross-version answers {t['cross_version_answers']}"
        )
        routed = ", ".join(f"{mode} {n}" for mode, n in t["routing"].items()) or "none"
        self.stdout.write(f"engine choices: {routed}; prediction accuracy {t['prediction_accuracy']}")
