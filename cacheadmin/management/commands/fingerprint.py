"""``python manage.py fingerprint PATH [...] --json``: state identity of a checkpoint."""

from __future__ import annotations

import json
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandParser
from django.db import DatabaseError

from cacheadmin.management.base import (
    ControlPlaneCommand,
    adapters_from_options,
    add_adapter_argument,
    add_layout_arguments,
    layout_from_options,
)
from cacheadmin.models.tenancy import Tenant, slug_validator
from cacheadmin.services.model_versions import checkpoint_fingerprint, checkpoint_verify_cache
from inference.identity import namespace_key

#: Exit code when --verify found files whose cached digest was wrong.
EXIT_CACHE_MISMATCH = 3


class Command(ControlPlaneCommand):
    # It reads files and at most one tenant row: the system checks (which import every
    # URL's view) would be most of a cached fingerprint's time.
    requires_system_checks: list[str] = []
    help = (
        "Print the state identity of a checkpoint: hex digests of weights, tokenizer, config, layout, "
        "adapters, the identity, and the cache namespace id when --tenant is given. "
        "Exit codes: 0 printed; 2 bad input (one line on stderr); 3 --verify found digest-cache mismatches (corrected)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", help="checkpoint directory, inside MODEL_ROOTS")
        add_layout_arguments(parser)
        add_adapter_argument(parser)
        parser.add_argument("--verify", action="store_true", help="re-hash every weight file and report digest-cache mismatches")
        parser.add_argument("--tenant", default=None, help="tenant slug: also print the namespace id")
        parser.add_argument("--json", action="store_true", help="print one JSON object")

    def handle(self, *args: Any, **opts: Any) -> None:
        tenant = None
        if opts["tenant"] is not None:
            try:
                slug_validator(opts["tenant"])
            except ValidationError as exc:
                raise self.bad_input(f"--tenant {opts['tenant']!r}: {exc.messages[0]}") from exc
            # The id digests the tenant's immutable key, not only its slug.
            try:
                tenant = Tenant.objects.filter(slug=opts["tenant"]).first()
            except DatabaseError as exc:
                raise self.bad_input(f"--tenant needs the control plane's database ({exc}); run manage.py migrate") from exc
            if tenant is None:
                raise self.bad_input(f"--tenant {opts['tenant']!r}: no such tenant")
        # A CheckpointError is bad input: exit 2 (its class's exit code).
        adapters = adapters_from_options(self, opts)
        mismatches = checkpoint_verify_cache(path=opts["path"]) if opts["verify"] else []
        root, report = checkpoint_fingerprint(path=opts["path"], layout=layout_from_options(opts), adapters=adapters)
        out: dict[str, Any] = dict(report.digests())
        if opts["verify"]:
            out["cache_mismatches"] = mismatches
        if tenant is not None:
            out["namespace_key"] = namespace_key(report.identity, tenant.boundary)
        if opts["json"]:
            out.update(
                path=str(root), total_bytes=report.total_bytes, hashed_bytes=report.hashed_bytes, seconds=round(report.seconds, 4)
            )
            self.stdout.write(json.dumps(out))
        else:
            for key, value in out.items():
                self.stdout.write(f"{key:10} {value}")
        if mismatches:
            raise SystemExit(EXIT_CACHE_MISMATCH)
