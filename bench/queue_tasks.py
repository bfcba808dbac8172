"""Tasks of ``bench/queue_wait.py``, registered on the control plane's Celery app
(its queues, routes and broker settings): a stand-in for a shadow check (busy for
a fixed time) and a probe that records when a release-critical job would start."""

from __future__ import annotations

import time
from pathlib import Path

from cacheadmin.celery import app

__all__ = ["app", "prewarm_probe", "shadow_load"]


@app.task(name="bench.shadow_load")
def shadow_load(seconds: float) -> None:
    """Occupy the worker for ``seconds`` (a shadow check's engine calls)."""
    time.sleep(seconds)


@app.task(name="bench.prewarm_probe")
def prewarm_probe(path: str) -> None:
    """Write the wall-clock time (``time.time()``, seconds) this task started to ``path``."""
    Path(path).write_text(repr(time.time()), encoding="utf-8")
