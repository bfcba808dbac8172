"""``manage.py docs_reference [--check] [--out DIR]``: write the documentation
site's reference pages (``docs/reference/``) from the code, or check them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import CommandParser

from cacheadmin.docs_reference import REFERENCE_DIR, REGENERATE, render_pages, stale_pages, write_pages
from cacheadmin.docs_reference.configuration import UndocumentedVariable
from cacheadmin.management.base import ControlPlaneCommand
from inference.errors import EXIT_CONFLICT


class Command(ControlPlaneCommand):
    help = (
        "Write the reference pages of the documentation site (configuration, command line, REST API and its "
        "OpenAPI schema, metrics, errors) from the code; --check writes nothing and fails on a stale page."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--check",
            action="store_true",
            help="write nothing; exit 1 naming every page that differs from what the code generates",
        )
        parser.add_argument(
            "--out",
            type=Path,
            default=None,
            help="the folder of the pages (default: docs/reference in the project folder)",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        directory: Path = opts["out"] or Path(settings.BASE_DIR) / REFERENCE_DIR
        try:
            pages = render_pages()
        except UndocumentedVariable as exc:
            raise self.failed(f"cannot generate configuration.md: {exc}", EXIT_CONFLICT) from exc
        if opts["check"]:
            stale = stale_pages(directory, pages)
            if stale:
                raise self.failed(f"stale reference pages in {directory}: {', '.join(stale)}; run: {REGENERATE}", 1)
            self.stdout.write(f"{len(pages)} reference pages up to date in {directory}")
            return
        try:
            written = write_pages(directory, pages)
        except OSError as exc:
            # A folder that cannot be made or written (a missing parent, /proc, no permission): one line, nothing else.
            raise self.bad_input(f"--out {directory}: cannot write the pages there: {exc.strerror or exc}") from exc
        self.stdout.write(
            f"wrote {len(written)} of {len(pages)} reference pages in {directory}: {', '.join(written) or 'none changed'}"
        )
