"""``python manage.py fingerprint PATH [...] --json``: state identity of a checkpoint."""

from __future__ import annotations

import argparse
import json
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandParser

from cacheadmin.management.base import ControlPlaneCommand
from cacheadmin.models.tenancy import slug_validator
from cacheadmin.services.model_versions import checkpoint_fingerprint
from inference.errors import CheckpointError
from inference.identity import LayoutOptions, namespace_id


def _positive(value: str) -> int:
    """argparse type: a positive integer written in ASCII digits (int() also takes other scripts' digits)."""
    if not (value.isascii() and value.strip().lstrip("+-").isdigit()):
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer")
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number} is not a positive integer")
    return number


class Command(ControlPlaneCommand):
    help = (
        "Print the state identity of a checkpoint: hex digests of weights, tokenizer, config, layout, "
        "adapters, the identity, and the cache namespace id when --tenant is given. "
        "Exit codes: 0 printed; 2 bad input (one line on stderr)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", help="checkpoint directory, inside MODEL_ROOTS")
        parser.add_argument("--dtype", default="auto", help="engine dtype; auto = the checkpoint's")
        parser.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype; auto = the dtype")
        parser.add_argument("--block-size", type=_positive, default=32, help="KV block size in tokens")
        parser.add_argument("--tensor-parallel-size", type=_positive, default=1)
        parser.add_argument("--pipeline-parallel-size", type=_positive, default=1)
        parser.add_argument("--quantization", default=None)
        parser.add_argument("--kv-connector", default=None, help="KV connector of the persistent tier, e.g. ExampleConnector")
        parser.add_argument("--tenant", default=None, help="tenant slug: also print the namespace id")
        parser.add_argument("--json", action="store_true", help="print one JSON object")

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["tenant"] is not None:
            try:
                slug_validator(opts["tenant"])
            except ValidationError as exc:
                raise self.bad_input(f"--tenant {opts['tenant']!r}: {exc.messages[0]}") from exc
        try:
            layout = LayoutOptions(
                dtype=opts["dtype"],
                kv_cache_dtype=opts["kv_cache_dtype"],
                block_size=opts["block_size"],
                tensor_parallel_size=opts["tensor_parallel_size"],
                pipeline_parallel_size=opts["pipeline_parallel_size"],
                quantization=opts["quantization"],
                kv_connector=opts["kv_connector"],
            )
            root, report = checkpoint_fingerprint(path=opts["path"], layout=layout)
        except CheckpointError as exc:
            raise self.bad_input(str(exc)) from exc
        out: dict[str, Any] = dict(report.digests())
        if opts["tenant"] is not None:
            out["namespace"] = namespace_id(report.identity, f"tenant:{opts['tenant']}")
        if opts["json"]:
            out.update(
                path=str(root), total_bytes=report.total_bytes, hashed_bytes=report.hashed_bytes, seconds=round(report.seconds, 4)
            )
            self.stdout.write(json.dumps(out))
        else:
            for key, value in out.items():
                self.stdout.write(f"{key:10} {value}")
