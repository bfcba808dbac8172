"""The database as a shared resource: telling a busy database from a broken
one, best-effort writes that never hold a read up, and write availability.

SQLite (the embedded default) has one writer at a time: while a worker holds
the write lock, reads go on (WAL) but any write waits, then fails with
"database is locked". PostgreSQL reports the same condition as a lock timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from django.db import OperationalError, connection, transaction

#: Seconds a client is told to wait before retrying against a busy database.
RETRY_AFTER_S = 5

_BUSY_MESSAGES = ("database is locked", "database table is locked", "lock timeout", "could not obtain lock")
#: PostgreSQL's SQLSTATEs for a statement that waited too long: ``lock_not_available``
#: (lock_timeout, NOWAIT) and ``query_canceled`` (statement_timeout)
#: (https://www.postgresql.org/docs/current/errcodes-appendix.html).
_BUSY_SQLSTATES = frozenset({"55P03", "57014"})


def database_busy(exc: BaseException) -> bool:
    """True for an error that means "the database is busy, try again", not "broken":
    SQLite's write lock, PostgreSQL's lock and statement timeouts."""
    if not isinstance(exc, OperationalError):
        return False
    if getattr(exc.__cause__, "sqlstate", None) in _BUSY_SQLSTATES:
        return True
    return any(m in str(exc).lower() for m in _BUSY_MESSAGES)


@contextmanager
def no_lock_wait() -> Iterator[None]:
    """Run the enclosed statements without waiting for another writer's lock:
    on SQLite they fail at once with a busy error instead (``busy_timeout`` 0,
    then back to the configured timeout: two statements).

    PostgreSQL needs nothing: its readers never wait for writers, and a row
    lock on the same row is held only for the other transaction's few statements.
    """
    if connection.vendor != "sqlite":
        yield
        return
    # sqlite3's own default is 5 s; Django passes OPTIONS["timeout"] through.
    restore_ms = int(float(connection.settings_dict.get("OPTIONS", {}).get("timeout", 5)) * 1000)
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA busy_timeout = 0")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"PRAGMA busy_timeout = {restore_ms}")


def best_effort_write(write: Callable[[], object]) -> bool:
    """Run ``write`` if the database takes it at once; skip it if busy.

    For bookkeeping a read may do (a token's ``last_used_at``), which must
    never turn a read into a wait or an error.

    Returns:
        True if written, False if skipped because the database was busy.
    """
    try:
        with no_lock_wait():
            write()
    except OperationalError as exc:
        if not database_busy(exc):
            raise
        return False
    return True


def database_writable() -> bool:
    """Whether a write would be taken now (without waiting for it).

    SQLite: the write lock can be had (``BEGIN IMMEDIATE``, rolled back at
    once). PostgreSQL: the server is not a read-only standby, and the lock a
    write takes on each of the app's tables can be had now (``LOCK TABLE ...
    IN ROW EXCLUSIVE MODE NOWAIT``, rolled back at once).
    """
    if connection.vendor == "sqlite":
        if connection.in_atomic_block:
            return True  # IMMEDIATE transactions hold the write lock already
        try:
            with no_lock_wait(), connection.cursor() as cursor:
                cursor.execute("BEGIN IMMEDIATE")
                cursor.execute("ROLLBACK")
        except OperationalError as exc:
            if database_busy(exc):
                return False
            raise
        return True
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_is_in_recovery()")
        (in_recovery,) = cursor.fetchone()
    if in_recovery:
        return False
    if connection.in_atomic_block:
        return True
    # The lock a write takes (ROW EXCLUSIVE) on every table of the app, without waiting:
    # another session's table lock (LOCK TABLE, a migration's ALTER) makes writes wait.
    from django.apps import apps  # lazy: the app registry is ready by the time anyone asks

    tables = sorted(m._meta.db_table for m in apps.get_app_config("cacheadmin").get_models())
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            names = ", ".join(connection.ops.quote_name(t) for t in tables)
            cursor.execute(f"LOCK TABLE {names} IN ROW EXCLUSIVE MODE NOWAIT")
            transaction.set_rollback(True)
    except OperationalError as exc:
        if database_busy(exc):
            return False
        raise
    return True
