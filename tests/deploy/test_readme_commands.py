"""What the README, the docs site (docs/) and deploy/ tell operators to type: every ``manage.py``
command exists; the token file is written owner-only, and the metrics page's own
command does that; the deployment page's gunicorn runs the metrics configuration
``manage.py demo`` runs."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import get_commands

from cacheadmin.management.commands.demo import ServerOptions, gunicorn_command
from tests.deploy.files import DEPLOY
from tests.docs_pages import README, docs_page, docs_pages
from tests.helpers import PROJECT

#: Every text an operator copies commands from.
TEXTS = [*docs_pages(), *sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in {".yml", ".yaml", ".md", ".py"})]
#: Where the docs tell Prometheus' operators to write the token file.
METRICS_PAGE = "deployment/monitoring.md"
#: Where the docs show the deployment's gunicorn command line.
DEPLOYMENT_PAGE = "deployment/production.md"
#: The docs write the token file in these (inline code may wrap over lines).
UMASK_TOKEN = re.compile(r"\(umask 077; (?:\.venv/bin/python )?manage\.py metrics_token > ([\w./-]+)\)")


def flat(text: str) -> str:
    """Text with every run of whitespace one space (inline code wraps over lines in the docs)."""
    return " ".join(text.split())


def test_every_manage_py_command_shown_exists() -> None:
    shown: dict[str, set[str]] = {}
    for path in TEXTS:
        for name in re.findall(r"manage\.py ([a-z_]+)", flat(path.read_text(encoding="utf-8"))):
            shown.setdefault(name, set()).add(path.relative_to(PROJECT).as_posix())
    missing = {name: sorted(paths) for name, paths in shown.items() if name not in get_commands()}
    assert missing == {}
    # The docs show the commands operators need, the metrics ones among them.
    assert {"metrics_token", "metrics_serve", "kv_events", "gateway", "demo", "migrate", "collectstatic"} <= set(shown)


def test_the_token_file_is_written_owner_only_wherever_it_is_shown() -> None:
    for path in TEXTS:
        text = flat(path.read_text(encoding="utf-8"))
        redirects = len(re.findall(r"metrics_token >", text))
        assert len(UMASK_TOKEN.findall(text)) == redirects, f"{path}: a metrics_token > FILE without (umask 077; ...)"
    # The metrics page shows it twice: where the token is explained and where Prometheus is set up.
    assert len(UMASK_TOKEN.findall(flat(docs_page(METRICS_PAGE)))) == 2


@pytest.mark.slow
def test_the_docs_token_command_creates_the_file_0600(tmp_path: Path) -> None:
    (command, *_) = [m.group(0) for m in UMASK_TOKEN.finditer(flat(docs_page(METRICS_PAGE)))]
    target = tmp_path / "kvcp-metrics-token"
    command = command.replace("deploy/prometheus/kvcp-metrics-token", shlex.quote(str(target)))
    command = command.replace(".venv/bin/python", shlex.quote(str(PROJECT / ".venv" / "bin" / "python")))
    # A umask as lax as a workstation's: the file must still come out owner-only.
    done = subprocess.run(["bash", "-c", f"umask 022; {command}; umask"], cwd=PROJECT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (0, "0022\n", "")  # the subshell's umask stayed inside it
    assert target.stat().st_mode & 0o777 == 0o600
    assert target.read_text() == settings.METRICS_TOKEN + "\n"


def test_the_deployments_gunicorn_runs_every_option_the_demo_runs() -> None:
    """The deployment page's gunicorn command line carries each option ``manage.py demo`` passes,
    the metrics configuration (``-c python:cacheadmin.metrics.gunicorn_config``) among them."""
    page = docs_page(DEPLOYMENT_PAGE)
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", page, flags=re.S) if "-m gunicorn" in b]
    line = flat(re.sub(r"\\\n", " ", block).split("-m gunicorn", 1)[1].split("\n", 1)[0])
    given = {arg for arg in shlex.split(line, comments=True) if arg.startswith("-")}
    demo = {arg for arg in gunicorn_command("127.0.0.1:8000", ServerOptions(2, 1, 30, 30)) if arg.startswith("-")}
    aliases = {"--config": "-c"}  # gunicorn's short form is what the page shows
    assert sorted({aliases.get(arg, arg) for arg in demo} - {"-m"} - given) == []
    assert "python:cacheadmin.metrics.gunicorn_config" in shlex.split(line, comments=True)


def test_the_readme_opens_with_the_two_commands_and_stays_short() -> None:
    """A clone-and-run check reads the README's first two code blocks: the demo, then the tests."""
    readme = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```[a-z]*\n(.*?)```", readme, flags=re.S)
    assert blocks[:2] == ["./scripts/setup && .venv/bin/python manage.py demo\n", "./scripts/test\n"]
    # Everything else lives in docs/ (a MkDocs site); the README links into it.
    assert len(readme.splitlines()) <= 150
    assert "docs/index.md" in readme
