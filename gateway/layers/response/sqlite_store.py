"""The response cache on one SQLite file (WAL) shared by every gateway process of a machine: the embedded default."""

from __future__ import annotations

import os
import secrets
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from gateway.sqlite_file import SqliteFile
from inference.errors import InvalidField
from inference.tiers.base import TierEntry, TierUsage, is_stray_prefix, stray_prefix

# redis-py is imported where a Redis store is built: the embedded default
# never needs it.
if TYPE_CHECKING:
    pass
from gateway.layers.base import Provenance, StoreUnavailable, check_engine_id, check_since
from gateway.layers.response.store import (
    BATCH,
    PREFIX_PATTERN,
    ResponseStore,
    _check_max_bytes,
    _check_seconds,
    _check_ttl,
    _check_value,
    _show,
    check_key,
    check_store_prefix,
)

# -- SQLite --------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS response_entries (
    prefix TEXT NOT NULL,
    key TEXT NOT NULL,
    value BLOB NOT NULL,
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    last_access_at REAL NOT NULL,
    expires_at REAL,
    PRIMARY KEY (prefix, key)
);
CREATE INDEX IF NOT EXISTS response_entries_lru ON response_entries (prefix, last_access_at);
CREATE INDEX IF NOT EXISTS response_entries_expiry ON response_entries (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS response_totals (
    prefix TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL,
    entries INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS response_entries_ins AFTER INSERT ON response_entries BEGIN
    INSERT INTO response_totals (prefix, bytes, entries) VALUES (new.prefix, new.bytes, 1)
    ON CONFLICT (prefix) DO UPDATE SET bytes = bytes + new.bytes, entries = entries + 1;
END;
CREATE TRIGGER IF NOT EXISTS response_entries_del AFTER DELETE ON response_entries BEGIN
    UPDATE response_totals SET bytes = bytes - old.bytes, entries = entries - 1 WHERE prefix = old.prefix;
    DELETE FROM response_totals WHERE prefix = old.prefix AND entries <= 0;
END;
CREATE TRIGGER IF NOT EXISTS response_entries_upd AFTER UPDATE OF bytes ON response_entries BEGIN
    UPDATE response_totals SET bytes = bytes - old.bytes + new.bytes WHERE prefix = new.prefix;
END;
CREATE TABLE IF NOT EXISTS response_provenance (
    prefix TEXT NOT NULL,
    key TEXT NOT NULL,
    engine_id INTEGER NOT NULL,
    computed_at REAL NOT NULL,
    PRIMARY KEY (prefix, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS response_provenance_engine ON response_provenance (prefix, engine_id, computed_at);
CREATE TRIGGER IF NOT EXISTS response_entries_provenance_del AFTER DELETE ON response_entries BEGIN
    DELETE FROM response_provenance WHERE prefix = old.prefix AND key = old.key;
END;
CREATE TABLE IF NOT EXISTS response_leases (
    prefix TEXT NOT NULL,
    key TEXT NOT NULL,
    token TEXT NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (prefix, key)
) WITHOUT ROWID;
"""

_LIVE = "(expires_at IS NULL OR expires_at > ?)"


def _setup(conn: sqlite3.Connection) -> None:
    # The journal mode is a property of the file: set once, every later connection reads it.
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(_SCHEMA)


class SqliteResponseStore(ResponseStore):
    """The embedded default: one SQLite file shared by every gateway process
    of the machine (stdlib ``sqlite3``, WAL journal so readers never wait for
    the writer, ``synchronous=NORMAL``).

    Times are this host's wall clock (``time.time()``, seconds since the
    epoch): every process of the machine reads the same one, and they survive
    a restart, which a monotonic clock does not. A clock step changes TTLs by
    as much. Byte totals per prefix are kept by triggers in the same
    transaction as the rows, so ``put`` reads its prefix's total in O(1).

    Thread-safe: each thread (and each process after a fork) opens its own
    connection. A write waits at most ``busy_timeout_s`` for another
    process's write (SQLite's busy handler), then raises :class:`StoreUnavailable`.

    Args:
        path: the database file (created with its tables when missing; its
            folder must exist).
        busy_timeout_s: how long a statement waits for a lock, seconds (> 0).

    Raises:
        InvalidField: ``path`` not a path, ``busy_timeout_s`` not > 0.
        StoreUnavailable: the file cannot be opened or its tables created.
    """

    access_time_source: ClassVar[str] = (
        "response-cache get hits and puts by any gateway process of the machine (the host's wall clock)"
    )

    def __init__(self, path: Path, *, busy_timeout_s: float = 1.0) -> None:
        if not isinstance(path, str | os.PathLike):
            raise InvalidField("path", f"must be a file path, got {_show(path)}")
        self.path = Path(path)
        self.busy_timeout_s = _check_seconds(busy_timeout_s, "busy_timeout_s")
        self._db = SqliteFile(
            self.path, busy_timeout_s=self.busy_timeout_s, what="SQLite response store", unavailable=StoreUnavailable,
            setup=_setup,
        )  # fmt: skip
        self._lock = threading.Lock()  # guards the leases this store holds
        self._held: dict[tuple[str, str], str] = {}

    def __repr__(self) -> str:
        return f"SqliteResponseStore({str(self.path)!r})"

    # -- connections -------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        return self._db.conn()

    def open(self) -> None:
        """Set the file up now (otherwise its first use does).

        Raises:
            StoreUnavailable: it cannot be opened, or holds another schema version.
        """
        self._db.ready()

    def close(self) -> None:
        """Close every connection this store opened in this process."""
        self._db.close()

    def _errors(self, doing: str) -> AbstractContextManager[None]:
        return self._db.errors(doing)

    def _write(self, doing: str) -> AbstractContextManager[sqlite3.Connection]:
        return self._db.write(doing)

    # -- the gateway's side ------------------------------------------------------

    def get(self, prefix: str, key: str) -> bytes | None:
        """See :meth:`ResponseStore.get`: one ``UPDATE ... RETURNING`` statement
        (the lookup and the access record in one write transaction)."""
        check_store_prefix(prefix)
        check_key(key)
        now = time.time()
        with self._errors(f"get {prefix}/{key}"):
            rows = (
                self._conn()
                .execute(
                    f"UPDATE response_entries SET last_access_at = ? WHERE prefix = ? AND key = ? AND {_LIVE} RETURNING value",
                    (now, prefix, key, now),
                )
                .fetchall()
            )
        return bytes(rows[0][0]) if rows else None

    def put(
        self, prefix: str, key: str, value: bytes, *, ttl_s: float | None, max_bytes: int | None,
        provenance: Provenance | None = None,
    ) -> int:  # fmt: skip
        """See :meth:`ResponseStore.put`: one transaction purges the prefix's
        expired entries, upserts the entry and its provenance (a row of
        ``response_provenance`` beside it), reads the prefix's total and
        deletes the least recently used others (ties by insertion order)
        until it fits."""
        check_store_prefix(prefix)
        check_key(key)
        _check_value(value)
        ttl = _check_ttl(ttl_s)
        budget = _check_max_bytes(max_bytes)
        if provenance is not None and not isinstance(provenance, Provenance):
            raise InvalidField("provenance", f"must be a Provenance or None, got {_show(provenance)}")
        size = len(value)
        now = time.time()
        with self._write(f"put {prefix}/{key}") as conn:
            conn.execute("DELETE FROM response_entries WHERE expires_at <= ? AND prefix = ?", (now, prefix))
            if budget is not None and size > budget:
                return 0
            conn.execute(
                "INSERT INTO response_entries (prefix, key, value, bytes, created_at, last_access_at, expires_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (prefix, key) DO UPDATE SET value = excluded.value,"
                " bytes = excluded.bytes, created_at = excluded.created_at, last_access_at = excluded.last_access_at,"
                " expires_at = excluded.expires_at",
                (prefix, key, value, size, now, now, None if ttl is None else now + ttl),
            )
            _keep_provenance(conn, prefix, key, provenance)
            if budget is None:
                return 0
            (total,) = conn.execute("SELECT bytes FROM response_totals WHERE prefix = ?", (prefix,)).fetchone()
            if total <= budget:
                return 0
            victims: list[tuple[str, str]] = []
            cursor = conn.execute(
                "SELECT key, bytes FROM response_entries WHERE prefix = ? AND key != ? ORDER BY last_access_at, rowid",
                (prefix, key),
            )
            for victim, victim_bytes in cursor:
                victims.append((prefix, victim))
                total -= victim_bytes
                if total <= budget:
                    break
            cursor.close()
            conn.executemany("DELETE FROM response_entries WHERE prefix = ? AND key = ?", victims)
            return len(victims)

    def provenance(self, prefix: str, key: str) -> Provenance | None:
        """See :meth:`ResponseStore.provenance`: one read of the live entry's provenance row.

        Raises:
            InvalidField: bad prefix or key. StoreUnavailable: see the class.
        """
        check_store_prefix(prefix)
        check_key(key)
        rows = self._read(
            f"provenance {prefix}/{key}",
            "SELECT p.engine_id, p.computed_at FROM response_provenance p JOIN response_entries e"
            f" ON e.prefix = p.prefix AND e.key = p.key WHERE p.prefix = ? AND p.key = ? AND {_LIVE}",
            (prefix, key, time.time()),
        )
        return Provenance(int(rows[0][0]), float(rows[0][1])) if rows else None

    def retire_computed(self, prefix: str, engine_id: int, since: float | None) -> int:
        """See :meth:`ResponseStore.retire_computed`: one transaction (an entry without
        provenance is judged by its ``created_at``, the time it was stored).

        Raises:
            InvalidField: bad prefix, engine id or since. StoreUnavailable: see the class.
        """
        check_store_prefix(prefix)
        check_engine_id(engine_id)
        lower = check_since(since)
        floor = -1.0 if lower is None else lower
        with self._write(f"retire answers of engine {engine_id} in {prefix}") as conn:
            return conn.execute(
                "DELETE FROM response_entries AS e WHERE e.prefix = ? AND ("
                " e.key IN (SELECT key FROM response_provenance WHERE prefix = ? AND engine_id = ? AND computed_at >= ?)"
                " OR (e.created_at >= ? AND NOT EXISTS"
                " (SELECT 1 FROM response_provenance p WHERE p.prefix = e.prefix AND p.key = e.key)))",
                (prefix, prefix, engine_id, floor, floor),
            ).rowcount

    def lease(self, prefix: str, key: str, ttl_s: float) -> bool:
        """See :meth:`ResponseStore.lease`: one upsert that takes the row when
        it is absent or expired (SQLite serialises writers, so one wins)."""
        check_store_prefix(prefix)
        check_key(key)
        ttl = _check_seconds(ttl_s, "ttl_s")
        token = secrets.token_hex(16)
        now = time.time()
        with self._errors(f"lease {prefix}/{key}"):
            cursor = self._conn().execute(
                "INSERT INTO response_leases (prefix, key, token, expires_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (prefix, key) DO UPDATE SET token = excluded.token, expires_at = excluded.expires_at"
                " WHERE response_leases.expires_at <= ?",
                (prefix, key, token, now + ttl, now),
            )
            taken = cursor.rowcount == 1
        if taken:
            with self._lock:
                self._held[(prefix, key)] = token
        return taken

    def renew_lease(self, prefix: str, key: str, ttl_s: float) -> bool:
        """See :meth:`ResponseStore.renew_lease`: moves the expiry of the row only while it
        carries this store's token and has not expired (an expired row is anyone's to take)."""
        check_store_prefix(prefix)
        check_key(key)
        ttl = _check_seconds(ttl_s, "ttl_s")
        with self._lock:
            token = self._held.get((prefix, key))
        if token is None:
            return False
        now = time.time()
        with self._errors(f"renew lease {prefix}/{key}"):
            cursor = self._conn().execute(
                "UPDATE response_leases SET expires_at = ? WHERE prefix = ? AND key = ? AND token = ? AND expires_at > ?",
                (now + ttl, prefix, key, token, now),
            )
            return cursor.rowcount == 1

    def release_lease(self, prefix: str, key: str) -> None:
        """See :meth:`ResponseStore.release_lease`: deletes the row only if it still carries this store's token."""
        check_store_prefix(prefix)
        check_key(key)
        with self._lock:
            token = self._held.pop((prefix, key), None)
        if token is None:
            return
        with self._errors(f"release lease {prefix}/{key}"):
            self._conn().execute(
                "DELETE FROM response_leases WHERE prefix = ? AND key = ? AND token = ?",
                (prefix, key, token),
            )

    def purge_expired(self, prefix: str | None = None) -> int:
        """See :meth:`ResponseStore.purge_expired`.

        Raises:
            InvalidField: invalid ``prefix``. StoreUnavailable: see the class.
        """
        if prefix is not None:
            check_store_prefix(prefix)
        now = time.time()
        with self._write("purge expired") as conn:
            if prefix is None:
                removed = conn.execute("DELETE FROM response_entries WHERE expires_at <= ?", (now,)).rowcount
            else:
                removed = conn.execute(
                    "DELETE FROM response_entries WHERE expires_at <= ? AND prefix = ?", (now, prefix)
                ).rowcount
            conn.execute("DELETE FROM response_leases WHERE expires_at <= ?", (now,))
        return removed

    # -- the control plane's side -----------------------------------------------

    def _read(self, doing: str, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        with self._errors(doing):
            return self._conn().execute(sql, params).fetchall()

    def _stray_names(self, pseudo: str) -> list[str]:
        """Prefix column values that are no valid prefix and that ``pseudo`` stands for.

        Only :meth:`put` writes rows here, and it validates names; another
        program writing this file could leave others, seen as strays."""
        names = self._read("list prefixes", "SELECT DISTINCT prefix FROM response_entries", ())
        return [n for (n,) in names if _sqlite_stray(n) == pseudo]

    def prefixes(self) -> list[str]:
        """See :meth:`ResponseStore.prefixes`.

        Raises:
            StoreUnavailable: see the class.
        """
        rows = self._read("list prefixes", f"SELECT DISTINCT prefix FROM response_entries WHERE {_LIVE}", (time.time(),))
        return sorted(n for (n,) in rows if _sqlite_stray(n) is None)

    def exists(self, prefix: str) -> bool:
        """See :meth:`ResponseStore.exists`.

        Raises:
            InvalidField: invalid prefix. StoreUnavailable: see the class.
        """
        if is_stray_prefix(prefix):
            return bool(self._stray_names(prefix))
        check_store_prefix(prefix)
        rows = self._read(
            f"exists {prefix}", f"SELECT 1 FROM response_entries WHERE prefix = ? AND {_LIVE} LIMIT 1", (prefix, time.time())
        )
        return bool(rows)

    def entries(self, prefix: str) -> list[TierEntry]:
        """See :meth:`ResponseStore.entries`: ``created_at`` is the last put,
        ``last_access_at`` the last get hit or put.

        Raises:
            InvalidField: invalid prefix. StoreUnavailable: see the class.
        """
        check_store_prefix(prefix)
        rows = self._read(
            f"entries {prefix}",
            f"SELECT key, bytes, created_at, last_access_at FROM response_entries WHERE prefix = ? AND {_LIVE} ORDER BY key",
            (prefix, time.time()),
        )
        return [TierEntry(key=k, bytes=b, created_at=c, last_access_at=a) for k, b, c, a in rows]

    def usage(self, prefix: str) -> TierUsage:
        """See :meth:`ResponseStore.usage`: one aggregate query over the live
        entries; a stray pseudo-prefix sums the rows it stands for.

        Raises:
            InvalidField: invalid prefix. StoreUnavailable: see the class.
        """
        if is_stray_prefix(prefix):
            names = self._stray_names(prefix)
            return TierUsage.of_entries(prefix, [e for n in names for e in self._raw_entries(n)])
        check_store_prefix(prefix)
        return TierUsage.of_entries(prefix, self._raw_entries(prefix))

    def _raw_entries(self, name: str) -> list[TierEntry]:
        rows = self._read(
            f"entries {name!r}",
            f"SELECT key, bytes, created_at, last_access_at FROM response_entries WHERE prefix = ? AND {_LIVE}",
            (name, time.time()),
        )
        return [TierEntry(key=k, bytes=b, created_at=c, last_access_at=a) for k, b, c, a in rows]

    def usage_all(self) -> dict[str, TierUsage]:
        """See :meth:`ResponseStore.usage_all`: expired entries are purged
        first (their bytes are the file's until then), then one ``GROUP BY``
        query; a prefix column value that is no valid prefix is reported under
        its stray pseudo-prefix.

        Raises:
            StoreUnavailable: see the class.
        """
        self.purge_expired()
        rows = self._read(
            "usage_all",
            "SELECT prefix, SUM(bytes), COUNT(*), MIN(created_at), MAX(created_at), MAX(last_access_at)"
            f" FROM response_entries WHERE {_LIVE} GROUP BY prefix",
            (time.time(),),
        )
        merged: dict[str, list[TierUsage]] = defaultdict(list)
        for name, total, count, oldest, newest, last in rows:
            label = _sqlite_stray(name) or name
            merged[label].append(TierUsage(label, total, total, count, oldest, newest, last))
        return {label: _merge_usage(label, parts) for label, parts in sorted(merged.items())}

    def delete_entries(self, prefix: str, keys: Iterable[str]) -> int:
        """See :meth:`ResponseStore.delete_entries`: one transaction; expired
        entries still on disk count their bytes as freed too.

        Raises:
            InvalidField: invalid prefix or key (checked before anything is deleted).
            StoreUnavailable: see the class.
        """
        check_store_prefix(prefix)
        wanted = sorted({check_key(k) for k in keys})
        freed = 0
        with self._write(f"delete entries of {prefix}") as conn:
            for start in range(0, len(wanted), BATCH):
                batch = wanted[start : start + BATCH]
                marks = ",".join("?" * len(batch))
                rows = conn.execute(
                    f"DELETE FROM response_entries WHERE prefix = ? AND key IN ({marks}) RETURNING bytes", (prefix, *batch)
                ).fetchall()
                freed += sum(b for (b,) in rows)
        return freed

    def delete_prefix(self, prefix: str) -> int:
        """See :meth:`ResponseStore.delete_prefix`: one transaction (expired
        rows included); a stray pseudo-prefix deletes the rows it stands for.

        Raises:
            InvalidField: invalid prefix. StoreUnavailable: see the class.
        """
        names = self._stray_names(prefix) if is_stray_prefix(prefix) else [check_store_prefix(prefix)]
        freed = 0
        with self._write(f"delete prefix {prefix}") as conn:
            for name in names:
                rows = conn.execute("DELETE FROM response_entries WHERE prefix = ? RETURNING bytes", (name,)).fetchall()
                freed += sum(b for (b,) in rows)
        return freed


def _keep_provenance(conn: sqlite3.Connection, prefix: str, key: str, provenance: Provenance | None) -> None:
    """Write (or, without one, drop) the provenance row of the entry just stored, in its transaction."""
    if provenance is None:
        conn.execute("DELETE FROM response_provenance WHERE prefix = ? AND key = ?", (prefix, key))
        return
    conn.execute(
        "INSERT INTO response_provenance (prefix, key, engine_id, computed_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT (prefix, key) DO UPDATE SET engine_id = excluded.engine_id, computed_at = excluded.computed_at",
        (prefix, key, provenance.engine_id, provenance.computed_at),
    )


def _sqlite_stray(name: str) -> str | None:
    """The stray pseudo-prefix of a prefix column value that is no valid prefix, else None."""
    if isinstance(name, str) and PREFIX_PATTERN.fullmatch(name):
        return None
    raw = name.encode("utf-8", "surrogateescape") if isinstance(name, str) else bytes(name)
    return stray_prefix(raw)


def _merge_usage(label: str, parts: Sequence[TierUsage]) -> TierUsage:
    if len(parts) == 1:
        return parts[0]

    def pick(values: Iterable[float | None], best: Callable[[list[float]], float]) -> float | None:
        known = [v for v in values if v is not None]
        return best(known) if known else None

    total = sum(p.bytes for p in parts)
    return TierUsage(
        prefix=label,
        bytes=total,
        allocated_bytes=total,
        entries=sum(p.entries for p in parts),
        oldest_entry_at=pick((p.oldest_entry_at for p in parts), min),
        newest_entry_at=pick((p.newest_entry_at for p in parts), max),
        last_access_at=pick((p.last_access_at for p in parts), max),
    )
