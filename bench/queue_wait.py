"""A prewarm's queue wait under a full shadow backlog: the control plane's queues
(release-critical jobs ahead of shadow checks) against one queue for everything.

A real Celery worker (``-c 1``, the control plane's app and settings, on the
filesystem broker in a scratch ``VAR_DIR``, or ``--broker redis://...``) gets, in
each mode, ``--backlog`` shadow stand-ins (each busy ``--shadow-ms``: the bound
``SHADOW_BACKLOG_MAX`` is the most that can wait), then, once the first has
started, one prewarm probe. The wait is from the probe's send to its start.

- ``queues``: each task where ``CELERY_TASK_ROUTES`` sends its real counterpart
  (``cacheadmin.shadow_check`` → shadow, ``cacheadmin.prewarm_job`` → release);
- ``one queue``: both to ``default`` (as before the queues).

Usage (from the project root)::

    .venv/bin/python bench/queue_wait.py                       # filesystem broker
    .venv/bin/python bench/queue_wait.py --broker redis://127.0.0.1:6379/9 --backlog 200 --shadow-ms 50

The Redis database must be empty (the bench refuses another's data) and is
emptied at the end. Prints each mode's wait (seconds) and their ratio, then one
JSON line. Exit status: 0; 2 when the Redis database holds keys, the worker did
not start or a probe never ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.child_env import die_with_parent  # noqa: E402 - after the path above


def main() -> int:
    """Run both modes against one worker; print the waits."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default="", help="a Redis broker URL (a database of its own); default: filesystem")
    parser.add_argument("--backlog", type=int, default=None, help="shadow tasks queued (default SHADOW_BACKLOG_MAX)")
    parser.add_argument("--shadow-ms", type=float, default=50.0, help="how long each shadow stand-in keeps the worker")
    args = parser.parse_args()
    var_dir = Path(tempfile.mkdtemp(prefix="kvcp-bench-queues-"))
    os.environ.update({"DJANGO_SETTINGS_MODULE": "cacheadmin.settings", "VAR_DIR": str(var_dir)})
    for name in ("DATABASE_URL", "CELERY_BROKER_URL"):
        os.environ.pop(name, None)
    if args.broker:
        import redis

        held = redis.Redis.from_url(args.broker).dbsize()
        if held:
            print(f"{args.broker} holds {held} keys: give the bench a Redis database of its own", file=sys.stderr)
            return 2
        os.environ["CELERY_BROKER_URL"] = args.broker
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command

    from bench.queue_tasks import app, prewarm_probe, shadow_load

    call_command("migrate", verbosity=0)
    backlog = args.backlog or settings.SHADOW_BACKLOG_MAX
    routes = settings.CELERY_TASK_ROUTES
    modes = {
        "queues": (routes["cacheadmin.shadow_check"]["queue"], routes["cacheadmin.prewarm_job"]["queue"]),
        "one queue": ("default", "default"),
    }
    log = (var_dir / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "bench.queue_tasks", "worker", "-c", "1", "--loglevel=INFO",
         "-Q", ",".join(q.name for q in settings.CELERY_TASK_QUEUES)],
        cwd=ROOT, env=os.environ.copy(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=die_with_parent,
    )  # fmt: skip
    waits: dict[str, float] = {}
    try:
        for mode, (shadow_queue, release_queue) in modes.items():
            with app.connection_for_write() as conn:
                for queue in {q.name for q in settings.CELERY_TASK_QUEUES}:
                    app.amqp.queues[queue].bind(conn.default_channel).purge()
            first = var_dir / f"first-{mode}"
            prewarm_probe.apply_async((str(first),), queue=shadow_queue)  # marks the backlog as being worked on
            for _ in range(backlog):
                shadow_load.apply_async((args.shadow_ms / 1000,), queue=shadow_queue)
            deadline = time.monotonic() + 120
            while not first.exists():
                if worker.poll() is not None or time.monotonic() > deadline:
                    print(f"the worker did not start (log: {var_dir / 'worker.log'})", file=sys.stderr)
                    return 2
                time.sleep(0.05)
            probe = var_dir / f"probe-{mode}"
            sent = time.time()
            prewarm_probe.apply_async((str(probe),), queue=release_queue)
            # Generous: a task costs the filesystem broker's polling on top of its own time.
            deadline = time.monotonic() + 60 + backlog * (args.shadow_ms / 1000 + 1.0)
            while not probe.exists():
                if worker.poll() is not None or time.monotonic() > deadline:
                    print(f"the prewarm probe never ran in mode {mode!r}", file=sys.stderr)
                    return 2
                time.sleep(0.02)
            time.sleep(0.05)  # the file is written whole by then
            waits[mode] = float(probe.read_text(encoding="utf-8")) - sent
            print(
                f"{mode:10} prewarm waited {waits[mode]:7.2f} s behind {backlog} shadow checks of {args.shadow_ms:g} ms",
                flush=True,
            )
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(var_dir, ignore_errors=True)
        if args.broker:
            import redis

            redis.Redis.from_url(args.broker).flushdb()  # it was empty: what is there now is the bench's queues
    broker = "redis" if args.broker else "filesystem"
    ratio = waits["one queue"] / waits["queues"] if waits["queues"] > 0 else float("inf")
    print(f"{broker} broker, shadow checks of {args.shadow_ms:g} ms: the queues cut a prewarm's wait {ratio:.1f}x")
    print(json.dumps({"queue_wait_bench": {"broker": broker, "backlog": backlog, "shadow_ms": args.shadow_ms, "waits_s": waits}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
