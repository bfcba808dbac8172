"""Typed readers of the environment that fail loudly on a bad value.

Every setting that comes from the environment goes through one of these, so a
typo in a deployment is a start-up error, not a silently ignored default.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str) -> str:
    """The variable's value, or ``default`` when unset."""
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    """Parse a boolean (1/0, true/false, yes/no, on/off).

    Raises:
        ImproperlyConfigured: any other value.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    """Parse an integer, optionally with a lower bound.

    Raises:
        ImproperlyConfigured: not an integer, or below ``minimum``.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from exc
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} is below its minimum {minimum}")
    return value


def env_paths(name: str, default: list[Path]) -> list[Path]:
    """Parse a ``:``-separated list of directories (relative ones are joined to the project by the caller).

    Raises:
        ImproperlyConfigured: an empty entry.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    parts = raw.split(":")
    if any(not p.strip() for p in parts):
        raise ImproperlyConfigured(f"{name}={raw!r} has an empty path")
    return [Path(p).expanduser() for p in parts]


def database_from_url(url: str) -> dict:
    """Turn ``DATABASE_URL`` into a Django ``DATABASES`` entry.

    Accepts ``postgres://user:pass@host:port/name`` (psycopg 3) and
    ``sqlite:///relative/path`` or ``sqlite:////absolute/path``.

    Raises:
        ImproperlyConfigured: another scheme, or no database name.
    """
    parsed = urlparse(url)
    if parsed.scheme in {"postgres", "postgresql"}:
        name = unquote(parsed.path.lstrip("/"))
        if not name:
            raise ImproperlyConfigured(f"DATABASE_URL {url!r} names no database")
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": unquote(parsed.username or ""),
            "PASSWORD": unquote(parsed.password or ""),
            "HOST": parsed.hostname or "",
            "PORT": str(parsed.port or ""),
            "CONN_MAX_AGE": 0,
        }
    if parsed.scheme == "sqlite":
        path = url[len("sqlite:///") :]
        if not path:
            raise ImproperlyConfigured(f"DATABASE_URL {url!r} names no file")
        return sqlite_database(Path(path))
    raise ImproperlyConfigured(f"DATABASE_URL scheme {parsed.scheme!r} is not supported (postgres, sqlite)")


def sqlite_database(path: Path) -> dict:
    """A SQLite ``DATABASES`` entry tuned for a web process and a worker at once.

    WAL lets readers run beside the worker's writes; IMMEDIATE transactions take
    the write lock up front so two writers queue instead of failing with
    "database is locked" mid-transaction (Django 5.1+ ``transaction_mode``).
    """
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(path),
        "OPTIONS": {
            "timeout": 30,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        },
        "TEST": {"NAME": str(path.with_name(path.stem + "-test.sqlite3"))},
    }
