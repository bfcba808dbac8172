"""``python manage.py identity_diff A B [--json]``: what differs between two identities."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandParser

from cacheadmin.management.base import ControlPlaneCommand, add_layout_arguments, layout_from_options
from cacheadmin.models import ModelVersion
from cacheadmin.services.model_versions import checkpoint_fingerprint
from inference.identity import identity_diff

EXIT_IDENTICAL = 0
EXIT_DIFFERENT = 1


class Command(ControlPlaneCommand):
    help = (
        "Compare the state identities of A and B (each a model version id or a checkpoint path; paths are "
        "fingerprinted with the layout options given). Lists the fields that differ and the files or keys behind "
        "each. Exit codes, as diff(1): 0 identical; 1 different; 2 bad input (one line on stderr)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("a", help="model version id, or checkpoint path inside MODEL_ROOTS")
        parser.add_argument("b", help="model version id, or checkpoint path inside MODEL_ROOTS")
        add_layout_arguments(parser)
        parser.add_argument("--json", action="store_true", help="print one JSON object")

    def _load(self, ref: str, opts: dict[str, Any]) -> dict[str, Any]:
        if ref.isascii() and ref.isdigit():
            version = ModelVersion.objects.filter(pk=int(ref)).first()
            if version is None:
                raise self.bad_input(f"no model version with id {ref}")
            return version.identity_view()
        _, report = checkpoint_fingerprint(path=ref, layout=layout_from_options(opts))  # CheckpointError: exit 2
        return report.as_dict()

    def handle(self, *args: Any, **opts: Any) -> None:
        diff = identity_diff(self._load(opts["a"], opts), self._load(opts["b"], opts))
        if opts["json"]:
            self.stdout.write(json.dumps(diff))
        elif diff["identical"]:
            self.stdout.write("identical")
        else:
            for name, field in diff["fields"].items():
                self.stdout.write(f"{name}: {field['a'][:12]} → {field['b'][:12]}")
                for change in field["changes"]:
                    self.stdout.write(f"  {change['change']:8} {change['key']}")
        if not diff["identical"]:
            raise SystemExit(EXIT_DIFFERENT)
