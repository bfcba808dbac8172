"""``python manage.py kv_events [--partition K/N] [--metrics-addr HOST:PORT] [--public-key]``: the KV-event consumer.

Subscribes to the KV-event streams of the engines of its partition (engine
id mod N = K; one consumer per partition when the fleet is scaled out) and
keeps resident blocks and tokens per engine and namespace, checkpointed every
few seconds. Runs until SIGTERM or Ctrl-C; ``--seconds`` stops it after that
long. ``--public-key`` prints the consumer's CURVE public key (what a relay
beside a remote engine admits with ``--allow``) and exits. Exit codes: 0
stopped; 2 bad input (a malformed ``--metrics-addr``, or a host that is no
address); 3 the metrics address cannot be bound (taken, or not this
machine's), or the key file is unusable.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from django.conf import settings
from django.core.management.base import CommandParser

from cacheadmin.management.addresses import listen_address
from cacheadmin.management.base import ControlPlaneCommand, int_within
from cacheadmin.management.ports import KV_EVENTS_METRICS_EXAMPLE
from cacheadmin.services.kv_events import KvEventConsumer, consumer_metrics
from inference.errors import EXIT_CONFLICT
from inference.kv_transport import TransportError, key_pair


def _partition(value: str) -> tuple[int, int]:
    import argparse

    parts = value.split("/")
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{value!r} is not K/N (e.g. 0/1)")
    k, n = int(parts[0]), int(parts[1])
    if n < 1 or k >= n:
        raise argparse.ArgumentTypeError(f"{value!r}: need 0 <= K < N")
    return k, n


class Command(ControlPlaneCommand):
    help = __doc__.split("\n\n", 1)[1].replace("\n", " ")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--partition", type=_partition, default=(0, 1), help="K/N: engines whose id mod N is K")
        parser.add_argument("--metrics-addr", default="", help="serve Prometheus metrics on HOST:PORT")
        parser.add_argument("--seconds", type=int_within(1, 10**7), default=None, help="stop after this many seconds")
        parser.add_argument("--public-key", action="store_true", help="print the consumer's CURVE public key and exit")

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["public_key"]:
            try:
                self.stdout.write(key_pair(settings.KV_EVENTS_KEY_FILE)[0])
            except (TransportError, OSError) as exc:
                raise self.failed(f"KV_EVENTS_KEY_FILE: {exc}", EXIT_CONFLICT) from exc
            return
        metrics = None
        if opts["metrics_addr"]:
            if opts["metrics_addr"].startswith("unix:"):
                raise self.bad_input("--metrics-addr takes HOST:PORT (Prometheus scrapes over TCP)")
            try:
                addr = listen_address(opts["metrics_addr"], example=KV_EVENTS_METRICS_EXAMPLE)
            except ValueError as exc:
                raise self.bad_input(f"--metrics-addr: {exc}") from exc
            from prometheus_client import start_http_server

            metrics = consumer_metrics()
            try:
                start_http_server(addr.port, addr=addr.host)
            except OSError as exc:
                raise self.failed(f"--metrics-addr: cannot listen on {addr}: {exc.strerror or exc}", EXIT_CONFLICT) from exc
        stopping = {"now": False}

        def stop(signum: int, frame: object) -> None:
            stopping["now"] = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        deadline = time.monotonic() + opts["seconds"] if opts["seconds"] else None
        k, n = opts["partition"]
        consumer = KvEventConsumer(partition=k, partitions=n, metrics=metrics)
        self.stderr.write(f"kv_events consumer {consumer.name}: partition {k}/{n}")
        consumer.run(should_stop=lambda: stopping["now"] or (deadline is not None and time.monotonic() > deadline))
        self.stderr.write(f"kv_events consumer stopped; {len(consumer.streams)} streams saved")
