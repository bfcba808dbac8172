"""One SQLite file shared by every gateway process of a machine: the
connections the embedded default's cache stores use, and how SQLite's
failures become a store outage."""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


class SqliteFile:
    """Connections to one SQLite file: one per thread, and a new one after a
    fork (a connection inherited through fork must not be used by the child:
    SQLite's "How To Corrupt An SQLite Database File", 2.6), autocommit mode
    with explicit transactions, ``synchronous=NORMAL``.

    Args:
        path: the database file.
        busy_timeout_s: how long a statement waits for another process's lock, seconds.
        what: the store's name in error messages (``"SQLite response store"``).
        unavailable: the exception an outage raises (the store's ``StoreUnavailable``).
        setup: run once on a connection before its first use (journal mode, schema), or None. Not at
            construction: building a store contacts nothing, so a file locked or unwritable now fails
            the operation that uses it (inside :meth:`errors`, as an outage), not whoever built it;
            a setup that failed runs again at the next use.
    """

    def __init__(
        self, path: Path, *, busy_timeout_s: float, what: str, unavailable: type[Exception],
        setup: Callable[[sqlite3.Connection], None] | None = None,
    ) -> None:  # fmt: skip
        self.path, self.busy_timeout_s, self.what, self.unavailable = path, busy_timeout_s, what, unavailable
        self._setup = setup
        self._setup_lock = threading.Lock()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[sqlite3.Connection] = []

    def conn(self) -> sqlite3.Connection:
        """This thread's connection (opened on first use in this process, the file set up first).

        Raises:
            sqlite3.Error: the file cannot be opened or set up (use inside :meth:`errors`).
        """
        local = self._local
        pid = os.getpid()
        if getattr(local, "pid", None) != pid:
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA synchronous=NORMAL")
            local.conn, local.pid = conn, pid
            with self._lock:
                self._connections.append(conn)
        current: sqlite3.Connection = local.conn
        if self._setup is not None:
            # Every thread waits for the one setting the file up; a setup that failed stays for the next use.
            with self._setup_lock:
                if self._setup is not None:
                    self._setup(current)
                    self._setup = None
        return current

    def ready(self) -> None:
        """Open and set the file up now rather than at its first use.

        Raises:
            ``unavailable``: it cannot be opened or set up.
        """
        with self.errors("open"):
            self.conn()

    def close(self) -> None:
        """Close every connection opened in this process."""
        with self._lock:
            conns, self._connections = self._connections, []
        for conn in conns:
            conn.close()
        self._local = threading.local()

    @contextmanager
    def errors(self, doing: str) -> Iterator[None]:
        """Turn an outage (locked past the busy timeout, I/O error, disk full,
        unreadable file) into ``unavailable``; a bug (IntegrityError,
        ProgrammingError...) stays what it is."""
        try:
            yield
        except sqlite3.OperationalError as exc:
            raise self.unavailable(f"{self.what} {self.path}: {doing} failed: {exc}") from exc
        except sqlite3.DatabaseError as exc:
            if type(exc) is not sqlite3.DatabaseError:
                raise
            raise self.unavailable(f"{self.what} {self.path}: {doing} failed: {exc}") from exc

    @contextmanager
    def write(self, doing: str) -> Iterator[sqlite3.Connection]:
        """One IMMEDIATE transaction: the write lock is taken first, so the busy
        handler applies (a deferred read-then-write can fail at once); rolled
        back on any failure, a failed COMMIT included, so the connection never
        stays inside a transaction."""
        with self.errors(doing):
            conn = self.conn()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.rollback()
                raise
