"""The documentation tests read: README.md and the MkDocs site's pages under docs/.

Django-free, so any test may import it."""

from __future__ import annotations

from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
README = PROJECT / "README.md"
DOCS = PROJECT / "docs"


def docs_page(relative: str) -> str:
    """The text of ``docs/<relative>`` (a path such as ``"deployment/monitoring.md"``).

    Raises:
        FileNotFoundError: no such page (it moved: follow it, do not skip).
    """
    return (DOCS / relative).read_text(encoding="utf-8")


def docs_pages() -> list[Path]:
    """README.md and every Markdown page under docs/, in path order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def section(text: str, heading: str) -> str:
    """The body of the Markdown section ``heading`` (a whole heading line, e.g. ``"## Key"``): from the line after
    it up to the next heading of the same or a higher level, or the end of ``text``. Lines inside fenced code
    blocks are not headings (a shell comment is not one).

    Raises:
        ValueError: ``text`` has no such heading line.
    """
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.split("\n")
    start = lines.index(heading) + 1
    fenced = False
    for end in range(start, len(lines)):
        line = lines[end]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        hashes = len(line) - len(line.lstrip("#"))
        if not fenced and 0 < hashes <= level and line[hashes : hashes + 1] == " ":
            return "\n".join(lines[start:end])
    return "\n".join(lines[start:])
