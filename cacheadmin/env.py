"""Typed readers of the environment that fail loudly on a bad value.

Every setting that comes from the environment goes through one of these, so a
typo in a deployment is a start-up error, not a silently ignored default.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import unquote, urlparse

from django.core.exceptions import ImproperlyConfigured

from inference.child_env import ENGINE_ENV_NAMES, child_environment

#: Every variable a setting was read from, set or not: what the control plane's
#: own children (worker, gateway, consumer, web server) must see as this process does.
READ_NAMES: set[str] = set()
#: Read by Django and the entry points themselves, not through this module.
_PROCESS_NAMES = ("DJANGO_SETTINGS_MODULE", "PYTHONPATH")


def _read(name: str) -> str | None:
    READ_NAMES.add(name)
    return os.environ.get(name)


def control_plane_environment(values: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a control-plane child (Celery worker, gateway, KV-event
    consumer, gunicorn, a management command): the system's names, every setting
    this process read from its environment (:data:`READ_NAMES`), Django's own,
    what the engines it may start inherit (``ENGINE_ENV_NAMES``,
    ``ENGINE_ENV_INHERIT``), and ``values`` on top; nothing else of this process's environment
    (:func:`inference.child_env.child_environment`).

    Args:
        values: names the starter sets (a test database's ``DATABASE_URL``...).
    """
    from django.conf import settings  # lazy: this module is imported by the settings themselves

    # The worker starts engines: what engines inherit passes through it too.
    engines = ENGINE_ENV_NAMES.union(settings.ENGINE_ENV_INHERIT)
    return child_environment(values, inherit=READ_NAMES.union(_PROCESS_NAMES, engines))


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str) -> str:
    """The variable's value, or ``default`` when unset."""
    value = _read(name)
    return default if value is None else value


def env_bool(name: str, default: bool) -> bool:
    """Parse a boolean (1/0, true/false, yes/no, on/off).

    Raises:
        ImproperlyConfigured: any other value.
    """
    raw = _read(name)
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
    return int(_number(name, default, int, "an integer", minimum))


def _number(name: str, default: float, parse: Callable[[str], float], what: str, minimum: float | None) -> float:
    raw = _read(name)
    if raw is None:
        return default
    try:
        value = parse(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={raw!r} is not {what}") from exc
    if value != value or value in (float("inf"), float("-inf")):
        raise ImproperlyConfigured(f"{name}={raw!r} is not a finite number")
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} is below its minimum {minimum}")
    return value


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    """Parse a finite number, optionally with a lower bound.

    Raises:
        ImproperlyConfigured: not a finite number, or below ``minimum``.
    """
    return _number(name, default, float, "a number", minimum)


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices``.

    Raises:
        ImproperlyConfigured: any other value.
    """
    raw = _read(name)
    if raw is None:
        return default
    if raw not in choices:
        raise ImproperlyConfigured(f"{name}={raw!r} is not one of {', '.join(choices)}")
    return raw


def env_paths(name: str, default: list[Path]) -> list[Path]:
    """Parse a ``:``-separated list of directories (relative ones are joined to the project by the caller).

    Raises:
        ImproperlyConfigured: an empty entry.
    """
    raw = _read(name)
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
        # A statement waits for a lock at most DATABASE_LOCK_TIMEOUT_MS and runs at most
        # DATABASE_STATEMENT_TIMEOUT_MS (0: no limit): a table another session locked is a
        # 503 with Retry-After (cacheadmin.services.db.database_busy), not a request that
        # waits until gunicorn's 30 s timeout kills its worker and answers its HTML 500.
        lock_ms = env_int("DATABASE_LOCK_TIMEOUT_MS", 5000, minimum=0)
        statement_ms = env_int("DATABASE_STATEMENT_TIMEOUT_MS", 25000, minimum=0)
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": unquote(parsed.username or ""),
            "PASSWORD": unquote(parsed.password or ""),
            "HOST": parsed.hostname or "",
            "PORT": str(parsed.port or ""),
            **persistent_connections(),
            "OPTIONS": {"options": f"-c lock_timeout={lock_ms} -c statement_timeout={statement_ms}"},
        }
    if parsed.scheme == "sqlite":
        path = url[len("sqlite:///") :]
        if not path:
            raise ImproperlyConfigured(f"DATABASE_URL {url!r} names no file")
        return sqlite_database(Path(path))
    raise ImproperlyConfigured(f"DATABASE_URL scheme {parsed.scheme!r} is not supported (postgres, sqlite)")


def persistent_connections() -> dict:
    """``CONN_MAX_AGE`` and ``CONN_HEALTH_CHECKS`` of every database: a web or
    worker process keeps its connection for ``DATABASE_CONN_MAX_AGE`` seconds
    (300; 0 opens one per request), checked before each request reuses it.

    One connection per request cost every API read ~2 ms of its worker's CPU
    (SQLite: a new connection and its PRAGMAs; PostgreSQL: a new backend), and
    on SQLite under load a connection opened while the last one closed (which
    checkpoints and removes the WAL) answered "database is locked" (503) or
    waited in SQLite's busy handler: seconds in the p99 of ``bench/load.py``.

    Raises:
        ImproperlyConfigured: ``DATABASE_CONN_MAX_AGE`` is not an integer ≥ 0.
    """
    return {"CONN_MAX_AGE": env_int("DATABASE_CONN_MAX_AGE", 300, minimum=0), "CONN_HEALTH_CHECKS": True}


def sqlite_database(path: Path) -> dict:
    """A SQLite ``DATABASES`` entry tuned for a web process and a worker at once.

    WAL lets readers run beside the worker's writes; IMMEDIATE transactions take
    the write lock up front so two writers queue instead of failing with
    "database is locked" mid-transaction (Django 5.1+ ``transaction_mode``).
    """
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(path),
        **persistent_connections(),
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


def private_file(path: Path) -> Path:
    """Make an existing file readable and writable by its owner only (0600) if
    anyone else may read it: a secret copied into place (``cp`` without ``-p``,
    an editor, a restore) comes with the umask's 0644.

    Raises:
        ImproperlyConfigured: the file cannot be tightened (another owner, a
            read-only mount); the message names the file and the fix.
    """
    try:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
    except OSError as exc:
        raise ImproperlyConfigured(
            f"{path} is readable by others and cannot be made owner-only ({exc.strerror or exc}): chmod 600 it"
        ) from exc
    return path


def write_private_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner only (0600) whether or
    not the file existed, replacing it atomically (a reader sees the old text
    or the new, never a part).

    Raises:
        OSError: the folder cannot be written (nothing is left behind).
    """
    import secrets

    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, text.encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # the temporary file's 0600 comes with it
    finally:
        tmp.unlink(missing_ok=True)


def persistent_secret(name: str, env_name: str, folder: Path) -> str:
    """A secret from ``env_name``, else from ``folder/name``, created once.

    Creation is atomic across processes and faults: the secret is written to a
    temporary file, fsynced, then hard-linked to its name (which fails if
    another process got there first, whose secret is then read), so no
    process ever sees an empty or partial file, and two processes starting
    together agree on one secret.

    Every secret obeys one rule, whichever its source: at least
    :data:`MIN_SECRET_CHARS` characters, each one visible ASCII (``!`` to
    ``~``; surrounding whitespace is ignored). With a weak key, anyone who can
    read namespace ids could compute their salts; and a bearer token travels
    in an HTTP header, which carries ASCII only (WSGI decodes header bytes as
    Latin-1, so a UTF-8 token could never match itself).

    The folder is made owner-only (0700) and the file 0600, tightened when an
    existing one is looser.

    Raises:
        ImproperlyConfigured: the environment's value or the file's is shorter
            than :data:`MIN_SECRET_CHARS` (empty included) or holds another
            character; the file cannot be read; or the secret cannot be
            written (a full disk), leaving nothing behind. The message is one
            line that names the variable or file and says how to recover, and
            never contains the secret; or the file is readable by others and
            cannot be made owner-only (:func:`private_file`).
    """
    value = _read(env_name) or ""
    if value:
        problem = secret_problem(value.strip())
        if problem:
            raise ImproperlyConfigured(
                f"{env_name} {problem}: refusing it. Set {env_name} to {MIN_SECRET_CHARS} or more visible ASCII "
                f"characters (e.g. the output of: python -c 'import secrets; print(secrets.token_hex(32))'), "
                f"or unset it to use {folder / name}"
            )
        return value.strip()
    path = private_dir(folder) / name
    if not path.exists():
        _create_secret(path)
    private_file(path)
    try:
        stored = path.read_text(encoding="ascii").strip()
    except UnicodeDecodeError:
        stored = None
    except OSError as exc:
        raise ImproperlyConfigured(f"{path} cannot be read: {exc.strerror or exc}") from exc
    problem = "holds a character outside visible ASCII" if stored is None else secret_problem(stored, file=True)
    if problem:
        raise ImproperlyConfigured(
            f"{path} {problem}: refusing a weak secret. "
            f"Restore it from a backup, or set {env_name}; deleting it makes a new one and changes every value "
            "derived from it"
        )
    return stored


def secret_problem(value: str, *, file: bool = False) -> str | None:
    """What makes ``value`` unfit as a secret, or None when it is fit.

    Args:
        value: the secret, surrounding whitespace already removed.
        file: word the length problem as a file's content (``holds N characters``).

    Returns:
        A phrase such as ``"is shorter than 32 characters"`` or ``"holds a
        character outside visible ASCII (position 3)"``; never the secret
        itself nor the offending character.
    """
    if len(value) < MIN_SECRET_CHARS:
        if file:
            return f"holds {len(value)} characters, fewer than {MIN_SECRET_CHARS}"
        return f"is shorter than {MIN_SECRET_CHARS} characters"
    for position, char in enumerate(value, start=1):
        if not "!" <= char <= "~":
            return f"holds a character outside visible ASCII (position {position})"
    return None


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


def env_networks(name: str) -> list[str]:
    """Parse a comma-separated list of IP networks (CIDR) or addresses; empty when unset.

    Raises:
        ImproperlyConfigured: an entry that is not an address or network.
    """
    raw = _read(name) or ""
    entries = [e.strip() for e in raw.split(",") if e.strip()]
    for entry in entries:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError as exc:
            raise ImproperlyConfigured(f"{name}: {entry!r} is not an IP address or network (CIDR)") from exc
    return entries


#: An environment variable's name (POSIX: letters, digits, underscore; not a digit first).
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_names(name: str) -> tuple[str, ...]:
    """Parse a comma-separated list of environment variable names; empty when unset.

    Raises:
        ImproperlyConfigured: an entry that is not a variable name.
    """
    entries = [e.strip() for e in (_read(name) or "").split(",") if e.strip()]
    for entry in entries:
        if not _ENV_NAME.fullmatch(entry):
            raise ImproperlyConfigured(f"{name}: {entry!r} is not an environment variable name")
    return tuple(entries)
