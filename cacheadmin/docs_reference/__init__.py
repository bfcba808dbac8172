"""The documentation site's reference pages (``docs/reference/``), generated from the code.

``manage.py docs_reference`` writes them; ``manage.py docs_reference --check``
and ``tests/cacheadmin/test_docs_reference.py`` regenerate them and fail on any
difference, so a page never drifts from the code it describes. Every page is
deterministic: sorted, no timestamps, no paths or ports of the machine that
generated it.
"""

from __future__ import annotations

from pathlib import Path

from cacheadmin.docs_reference import api, cli, configuration, errors, metrics

#: Where the pages live, relative to the project root.
REFERENCE_DIR = Path("docs") / "reference"
#: The command that regenerates them (said in every failure).
REGENERATE = ".venv/bin/python manage.py docs_reference"


def render_pages() -> dict[str, str]:
    """Every page's file name (relative to :data:`REFERENCE_DIR`) → its text, sorted by name.

    Raises:
        cacheadmin.docs_reference.configuration.UndocumentedVariable: the code
            reads an environment variable ``cacheadmin/env_catalogue.py`` does not describe.
    """

    schema = api.openapi_schema()
    pages = {
        "api.md": api.render(schema),
        api.SCHEMA_FILE: api.schema_json(schema),
        "cli.md": cli.render(),
        "configuration.md": configuration.render(),
        "errors.md": errors.render(),
        "metrics.md": metrics.render(),
    }
    return dict(sorted(pages.items()))


def stale_pages(directory: Path, pages: dict[str, str]) -> list[str]:
    """The names of ``pages`` whose file in ``directory`` is missing or differs byte for byte, sorted."""
    stale = []
    for name, text in pages.items():
        path = directory / name
        if not path.is_file() or path.read_bytes() != text.encode("utf-8"):
            stale.append(name)
    return stale


def write_pages(directory: Path, pages: dict[str, str]) -> list[str]:
    """Write the pages that differ into ``directory`` (created if missing); the names written, sorted."""
    directory.mkdir(parents=True, exist_ok=True)
    written = stale_pages(directory, pages)
    for name in written:
        (directory / name).write_bytes(pages[name].encode("utf-8"))
    return written
