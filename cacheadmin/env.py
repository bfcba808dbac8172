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


#: Shortest secret accepted (characters): 32 hex characters are 128 bits.
MIN_SECRET_CHARS = 32


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) readable by its owner only, and tighten it if it exists.

    The database, the secrets, the digest cache and the KV tiers live in such
    folders: a world-readable one would let any local user read cached KV
    state and compute every tenant's ``cache_salt``.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def persistent_secret(name: str, env_name: str, folder: Path) -> str:
    """A secret from ``env_name``, else from ``folder/name``, created once.

    Creation is atomic across processes and faults: the secret is written to a
    temporary file, fsynced, then hard-linked to its name (which fails if
    another process got there first, whose secret is then read), so no
    process ever sees an empty or partial file, and two processes starting
    together agree on one secret.

    Raises:
        ImproperlyConfigured: the environment's value or the file's is shorter
            than :data:`MIN_SECRET_CHARS` (empty included): with a weak key,
            anyone who can read namespace ids could compute their salts. The
            message says how to recover. Also raised when the secret cannot be
            written (a full disk), leaving nothing behind.
    """
    value = os.environ.get(env_name, "")
    if value:
        if len(value.strip()) < MIN_SECRET_CHARS:
            raise ImproperlyConfigured(f"{env_name} is shorter than {MIN_SECRET_CHARS} characters; refusing a weak secret")
        return value.strip()
    path = folder / name
    if not path.exists():
        _create_secret(path)
    try:
        stored = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ImproperlyConfigured(f"{path} cannot be read: {exc}") from exc
    if len(stored) < MIN_SECRET_CHARS:
        raise ImproperlyConfigured(
            f"{path} holds {len(stored)} characters, fewer than {MIN_SECRET_CHARS}: refusing a weak secret. "
            f"Restore it from a backup, or set {env_name}; deleting it makes a new one and changes every value "
            "derived from it"
        )
    return stored


def _create_secret(path: Path) -> None:
    import secrets

    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic create-if-absent: the first process wins
        except FileExistsError:
            pass
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise ImproperlyConfigured(f"cannot create the secret {path}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
