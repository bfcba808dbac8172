"""scripts/junit_recap.py: what scripts/test prints last, so a CI log cut in its middle still shows
every failure's message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import PROJECT

RECAP = PROJECT / "scripts" / "junit_recap.py"


def _recap(*args: str) -> str:
    done = subprocess.run([sys.executable, str(RECAP), *args], capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def test_each_failure_and_error_is_named_with_its_message_and_a_passing_part_prints_nothing(tmp_path: Path) -> None:
    tests = tmp_path / "test_sample.py"
    tests.write_text(
        "import pytest\n"
        "@pytest.fixture\n"
        "def broken():\n"
        "    raise RuntimeError('fixture down')\n"
        "def test_passes():\n"
        "    assert True\n"
        "def test_fails():\n"
        "    pytest.fail('tiny-v1-1: 3 sent, 1 answered\\n  errors: {\\'transport:ReadTimeout\\': 2}', pytrace=False)\n"
        "def test_errors(broken):\n"
        "    pass\n"
    )
    failing, passing = tmp_path / "SQLite_part.xml", tmp_path / "passing.xml"
    # A plain pytest outside the project: no Django settings, no plugins or options of ours, and not in "CI"
    # mode (pytest shows whole diffs when CI or BUILD_NUMBER is set, so a message would depend on where it ran).
    outside = {"DJANGO_SETTINGS_MODULE", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "CI", "BUILD_NUMBER"}
    env = {k: v for k, v in os.environ.items() if k not in outside}
    run = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:django", "-q", "-c", "/dev/null"]
    for report, target in ((failing, str(tests)), (passing, f"{tests}::test_passes")):
        subprocess.run([*run, "--rootdir", str(tmp_path), f"--junitxml={report}", target], cwd=tmp_path, env=env,
                       capture_output=True, timeout=120)  # fmt: skip

    assert _recap(str(failing), str(passing), str(tmp_path / "*.xml")).splitlines() == [
        "== failures of SQLite_part:",
        "FAILED test_sample::test_fails",
        "    Failed: tiny-v1-1: 3 sent, 1 answered",
        "      errors: {'transport:ReadTimeout': 2}",
        "ERROR test_sample::test_errors",
        '    failed on setup with "RuntimeError: fixture down"',
    ]
    assert _recap(str(passing)) == "\n"


def test_a_missing_report_is_named_and_the_rest_still_recapped(tmp_path: Path) -> None:
    out = _recap(str(tmp_path / "gone.xml")).splitlines()
    assert len(out) == 1 and out[0].startswith("== gone.xml: unreadable ([Errno 2] No such file or directory")
