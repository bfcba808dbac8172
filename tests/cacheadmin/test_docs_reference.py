"""The documentation site's reference pages (docs/reference/) are what the code generates, byte for byte,
and what they are generated from is complete: every environment variable the settings read is described,
every command and argument has help, every error class, route and metric family is on its page."""

from __future__ import annotations

import argparse
import json
import re
import socket
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from cacheadmin.docs_reference import REFERENCE_DIR, REGENERATE, cli, render_pages, stale_pages, write_pages
from cacheadmin.docs_reference import api as api_page
from cacheadmin.docs_reference.cli import missing_help, project_commands, walk
from cacheadmin.docs_reference.configuration import UndocumentedVariable, env_reads, undocumented
from cacheadmin.docs_reference.configuration import render as render_configuration
from cacheadmin.docs_reference.errors import gateway_errors, service_errors
from cacheadmin.docs_reference.markdown import anchor
from cacheadmin.env import READ_NAMES
from cacheadmin.env_catalogue import SECTIONS, VARIABLES
from tests.cacheadmin.test_errors import EXPECTED

COMMITTED = Path(settings.BASE_DIR) / REFERENCE_DIR
#: What the settings read at start (taken at collection: other tests read names of their own later).
STARTUP_READS = frozenset(READ_NAMES)
PAGES = ("api.md", "cli.md", "configuration.md", "errors.md", "metrics.md", "openapi.json")


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    """Every page as the code generates it now."""
    return render_pages()


def test_every_committed_page_is_what_the_code_generates(pages: dict[str, str], tmp_path: Path) -> None:
    assert sorted(pages) == list(PAGES)
    write_pages(tmp_path, pages)
    stale = [
        name
        for name in PAGES
        if not (COMMITTED / name).is_file() or (COMMITTED / name).read_bytes() != (tmp_path / name).read_bytes()
    ]
    assert stale == [], f"docs/reference is stale ({', '.join(stale)}): regenerate with {REGENERATE}"


def test_generating_twice_gives_the_same_bytes(pages: dict[str, str]) -> None:
    assert render_pages() == pages


def test_no_page_names_this_machine(pages: dict[str, str]) -> None:
    paths = [str(settings.BASE_DIR), str(settings.VAR_DIR)]
    # A host name as a word of its own; a short one ("vm") could be any word's part.
    hosts = {h for h in (settings.KVCP_HOST, socket.gethostname()) if len(h) >= 6}
    for name, text in pages.items():
        for path in paths:
            assert path not in text, (name, path)
        for host in hosts:
            assert not re.search(rf"\b{re.escape(host)}\b", text), (name, host)


def test_check_fails_naming_the_stale_pages_and_writes_nothing(pages: dict[str, str], tmp_path: Path) -> None:
    call_command("docs_reference", "--out", str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == list(PAGES)
    call_command("docs_reference", "--check", "--out", str(tmp_path))
    (tmp_path / "metrics.md").write_text("# Metrics\n", encoding="utf-8")
    (tmp_path / "errors.md").unlink()
    with pytest.raises(CommandError) as failed:
        call_command("docs_reference", "--check", "--out", str(tmp_path))
    assert failed.value.returncode == 1
    assert str(failed.value) == f"stale reference pages in {tmp_path}: errors.md, metrics.md; run: {REGENERATE}"
    assert (tmp_path / "metrics.md").read_text(encoding="utf-8") == "# Metrics\n"
    assert not (tmp_path / "errors.md").exists()
    assert stale_pages(tmp_path, pages) == ["errors.md", "metrics.md"]


def test_a_folder_the_pages_cannot_be_written_to_is_a_one_line_usage_error(tmp_path: Path) -> None:
    """--out under a file (no folder can be made there): exit 2 naming the folder and why, not a traceback."""
    (tmp_path / "a-file").write_text("", encoding="utf-8")
    with pytest.raises(CommandError) as failed:
        call_command("docs_reference", "--out", str(tmp_path / "a-file" / "reference"))
    assert failed.value.returncode == 2
    assert str(failed.value) == f"--out {tmp_path}/a-file/reference: cannot write the pages there: Not a directory"


# --- configuration.md -------------------------------------------------------------


def test_every_variable_read_is_documented_and_every_documented_one_read() -> None:
    reads = env_reads()
    assert undocumented(reads) == ([], [])
    # What this process read through the helpers at start (names built at run time included).
    assert "VAR_DIR" in STARTUP_READS and "METRICS_TOKEN" in STARTUP_READS
    assert sorted(STARTUP_READS - set(VARIABLES)) == []
    assert {v.section for v in VARIABLES.values()} == set(SECTIONS)
    assert all(v.meaning and "|" not in v.meaning for v in VARIABLES.values())


def test_a_variable_read_but_not_documented_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "settings.py").write_text(
        'from cacheadmin.env import env_int, env_str\nA = env_int("NEW_LIMIT", 3, minimum=1)\nB = env_str("VAR_DIR", "")\n',
        encoding="utf-8",
    )
    reads = env_reads(package)
    assert sorted(reads) == ["NEW_LIMIT", "VAR_DIR"]
    assert (reads["NEW_LIMIT"].helper, reads["NEW_LIMIT"].default, reads["NEW_LIMIT"].minimum) == ("env_int", "3", "1")
    assert reads["NEW_LIMIT"].files == ["pkg/settings.py"]
    missing, unread = undocumented(reads)
    assert missing == ["NEW_LIMIT"]
    assert "VAR_DIR" not in unread and "GATEWAY_ADDR" in unread
    monkeypatch.delitem(VARIABLES, "GATEWAY_BURST")
    with pytest.raises(UndocumentedVariable, match=r"read but not in cacheadmin/env_catalogue.py: GATEWAY_BURST;"):
        render_configuration()


def test_configuration_page_rows(pages: dict[str, str]) -> None:
    rows = dict(re.findall(r"^\| `([A-Z0-9_]+)` \| ([^|]+?) \|", pages["configuration.md"], re.M))
    assert sorted(rows) == sorted(VARIABLES)
    assert rows["GATEWAY_ENGINE_CHOICE"] == "one of `precise`, `affinity`, `round_robin`"
    assert rows["ENGINE_KV_CACHE_GIB"] == "number, at least 0.0625"
    line = next(x for x in pages["configuration.md"].splitlines() if x.startswith("| `IDEMPOTENCY_TTL_S` |"))
    assert line.split(" | ")[2] == "86400"


# --- cli.md -----------------------------------------------------------------------


def test_every_command_and_argument_has_help() -> None:
    assert missing_help() == []


def test_an_argument_or_subcommand_without_help_is_named(monkeypatch: pytest.MonkeyPatch) -> None:

    class Undocumented(BaseCommand):
        help = "a command"

        def add_arguments(self, parser: argparse.ArgumentParser) -> None:
            parser.add_argument("--quiet-flag", action="store_true")
            sub = parser.add_subparsers(dest="verb")
            run = sub.add_parser("run")
            run.add_argument("target", help="what to run")
            run.add_argument("--count", type=int, default=2)

    command = Undocumented()
    monkeypatch.setattr(cli, "project_commands", lambda: ["undocumented"])
    monkeypatch.setattr(cli, "command_parser", lambda name: (command, command.create_parser("manage.py", name)))
    assert missing_help() == ["undocumented --quiet-flag", "undocumented run", "undocumented run --count"]


def test_every_command_and_subcommand_has_a_section(pages: dict[str, str]) -> None:
    headings = re.findall(r"^#{2,4} manage\.py (.+)$", pages["cli.md"], re.M)
    expected = [" ".join(entry.words) for name in project_commands() for entry in walk(name)]
    assert headings == expected
    assert "engine start" in headings and "docs_reference" in headings


# --- api.md and openapi.json ------------------------------------------------------


def test_every_operation_and_schema_is_on_the_api_page(pages: dict[str, str]) -> None:
    schema = json.loads(pages["openapi.json"])
    assert schema == api_page.openapi_schema()
    operations = sorted(
        f"{method.upper()} {path}" for path, item in schema["paths"].items() for method in item if method in api_page.METHODS
    )
    assert sorted(re.findall(r"^### ((?:GET|POST|PUT|PATCH|DELETE) /\S*)$", pages["api.md"], re.M)) == operations
    assert sorted(re.findall(r"^### (\w+) \(schema\)$", pages["api.md"], re.M)) == sorted(schema["components"]["schemas"])
    assert "| `code` | string | yes |" in pages["api.md"]


# --- errors.md and metrics.md -----------------------------------------------------


def test_every_error_class_is_on_the_errors_page(pages: dict[str, str]) -> None:
    rows = re.findall(r"^\| `([a-z_]+)` \| (\d+) \| (\d) \| `(\w+)` \|", pages["errors.md"], re.M)
    assert {cls: (int(status), code, int(exit_code)) for code, status, exit_code, cls in rows} == EXPECTED
    assert len(rows) == len(service_errors()) == len(EXPECTED)


def test_the_gateways_codes_are_on_the_errors_page(pages: dict[str, str]) -> None:
    found = gateway_errors()
    assert (found["request_timeout"].statuses, found["request_timeout"].types) == ({"408"}, {"invalid_request_error"})
    assert (found["rate_limit_exceeded"].statuses, found["rate_limit_exceeded"].types) == ({"429"}, {"rate_limit_error"})
    assert found["model_not_found"].sources == {"gateway/routing.py"}
    gateway_section = pages["errors.md"].split("\n## Gateway errors\n", 1)[1]
    assert re.findall(r"^\| `([a-z_]+)` \|", gateway_section, re.M) == list(found)


# --- every page -------------------------------------------------------------------


@pytest.mark.parametrize("name", [p for p in PAGES if p.endswith(".md")])
def test_anchors_are_unique_and_every_link_resolves(pages: dict[str, str], name: str) -> None:
    text = pages[name]
    outside_fences = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    anchors = [anchor(h) for h in re.findall(r"^#{1,6} (.+)$", outside_fences, re.M)]
    assert len(anchors) == len(set(anchors)), sorted(a for a in anchors if anchors.count(a) > 1)
    for target in re.findall(r"\]\(([^)\s]+)\)", outside_fences):
        page, _, fragment = target.partition("#")
        if page:
            assert page in PAGES, (name, target)
        if fragment:
            assert not page and fragment in anchors, (name, target)


def test_anchors_are_the_ones_mkdocs_gives(pages: dict[str, str]) -> None:
    from markdown.extensions.toc import slugify  # type: ignore[import-untyped]

    headings = [h for name in pages if name.endswith(".md") for h in re.findall(r"^#{1,6} (.+)$", pages[name], re.M)]
    assert len(headings) > 300
    assert [anchor(h) for h in headings] == [slugify(h, "-") for h in headings]
