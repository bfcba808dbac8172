"""``python manage.py register PATH --label L --served-name N [...]``: register a model version."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandParser

from cacheadmin.management.base import (
    ControlPlaneCommand,
    adapters_from_options,
    add_adapter_argument,
    add_layout_arguments,
    cli_actor,
    layout_from_options,
)
from cacheadmin.services.model_versions import model_version_register


class Command(ControlPlaneCommand):
    help = (
        "Fingerprint a checkpoint and register it as a model version (the API twin is POST /api/model-versions/, "
        "which runs it as a job). Exit codes: 0 registered or already registered with the same identity; "
        "2 bad input (one line on stderr); 3 the label is registered with another identity."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", help="checkpoint directory, inside MODEL_ROOTS")
        parser.add_argument("--label", required=True, help="unique label, e.g. llama-3-8b-2026-11")
        parser.add_argument("--served-name", required=True, help="model name clients send to the engine")
        add_layout_arguments(parser)
        add_adapter_argument(parser)
        parser.add_argument("--json", action="store_true", help="print the model version as JSON")

    def handle(self, *args: Any, **opts: Any) -> None:
        for key in ("label", "served_name"):
            if not opts[key].strip():
                raise self.bad_input(f"--{key.replace('_', '-')} must not be empty")
        # A CheckpointError exits 2 and a RegistrationConflict 3 (their classes' exit codes).
        version, created = model_version_register(
            path=opts["path"],
            label=opts["label"],
            served_name=opts["served_name"],
            layout=layout_from_options(opts),
            adapters=adapters_from_options(self, opts),
            actor=cli_actor(),
        )
        out = {"id": version.pk, "label": version.label, "created": created, "identity": version.identity}
        out.update({f: getattr(version, f) for f in version.IDENTITY_FIELDS})
        out["adapters_registered"] = {a.name: a.content for a in version.adapter_set.all()}
        self.stdout.write(
            json.dumps(out)
            if opts["json"]
            else f"{'registered' if created else 'already registered'} {version.label} {version.identity}"
        )
