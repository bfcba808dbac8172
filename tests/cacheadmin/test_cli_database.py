"""A command run on a database that is not migrated, or not reachable: one line saying what to do,
exit 3, no traceback, nothing written."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tests.helpers import manage, subprocess_env


def test_an_unmigrated_database_is_named_with_the_command_that_fixes_it(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.sqlite3"
    done = manage("tenant", "create", "acme", "--name", "Acme", env=subprocess_env(DATABASE_URL=f"sqlite:///{fresh}"))
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line == ("CommandError: the database is not migrated (no such table: cacheadmin_tenant): run manage.py migrate")
    with sqlite3.connect(fresh) as db:  # nothing was created in it
        assert db.execute("SELECT name FROM sqlite_master").fetchall() == []


def test_a_database_that_cannot_be_reached_is_one_line(tmp_path: Path) -> None:
    done = manage(
        "tenant", "create", "acme", "--name", "Acme",
        env=subprocess_env(DATABASE_URL="postgres://postgres@127.0.0.1:9/kvcp"),  # the discard port: nothing listens
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("CommandError: the database cannot be used: connection failed") or line.startswith(
        "CommandError: the database cannot be used: connection to server at"
    ), line
