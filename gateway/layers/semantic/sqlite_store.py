"""The semantic store on one SQLite file (WAL) shared by every gateway process of a machine: the embedded default."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from gateway.sqlite_file import SqliteFile
from inference.errors import InvalidField
from inference.tiers.base import TierEntry, TierUsage, is_stray_prefix

# redis-py is imported where a Redis store is built: the embedded default never needs it.
if TYPE_CHECKING:
    pass

from gateway.layers.base import Provenance, StoreUnavailable, check_engine_id, check_since
from gateway.layers.semantic.entries import (
    PartKey,
    SemanticEntry,
    _check_budget,
    _check_entry_id,
    _check_name,
    _check_prefix,
    _check_tag_list,
    _chunks,
    _Loaded,
    _now,
    _show,
    _vector_bytes,
    _vector_from,
)
from gateway.layers.semantic.index import DEFAULT_MAX_REPLICAS, HNSW_THRESHOLD, _Delta, _empty_delta
from gateway.layers.semantic.store import SemanticStore

#: Removals each SQLite file keeps in its log (the newest); a replica that falls further behind re-reads membership.
SQLITE_REMOVAL_LOG = 50_000

# -- SQLite ---------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS semantic_models (
    model_id TEXT PRIMARY KEY,
    dim INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS semantic_partitions (
    pid INTEGER PRIMARY KEY AUTOINCREMENT,
    prefix TEXT NOT NULL,
    partition TEXT NOT NULL,
    model_id TEXT NOT NULL,
    present INTEGER NOT NULL,
    UNIQUE (prefix, partition, model_id)
);
CREATE TABLE IF NOT EXISTS semantic_entries (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    entry_id TEXT NOT NULL UNIQUE,
    pid INTEGER NOT NULL,
    prefix TEXT NOT NULL,
    partition TEXT NOT NULL,
    tenant TEXT NOT NULL,
    model_id TEXT NOT NULL,
    text TEXT NOT NULL,
    vector BLOB NOT NULL,
    response BLOB NOT NULL,
    tags TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    bytes INTEGER NOT NULL,
    last_access_at REAL
);
CREATE INDEX IF NOT EXISTS semantic_entries_pid ON semantic_entries (pid, seq);
CREATE INDEX IF NOT EXISTS semantic_entries_age ON semantic_entries (prefix, created_at, seq);
CREATE INDEX IF NOT EXISTS semantic_entries_expiry ON semantic_entries (prefix, expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS semantic_tags (
    tenant TEXT NOT NULL,
    tag TEXT NOT NULL,
    seq INTEGER NOT NULL,
    PRIMARY KEY (tenant, tag, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS semantic_tags_seq ON semantic_tags (seq);
CREATE TABLE IF NOT EXISTS semantic_removals (
    rseq INTEGER PRIMARY KEY AUTOINCREMENT,
    pid INTEGER NOT NULL,
    seq INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS semantic_removals_pid ON semantic_removals (pid, rseq);
CREATE TABLE IF NOT EXISTS semantic_totals (
    prefix TEXT PRIMARY KEY,
    entries INTEGER NOT NULL,
    bytes INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS semantic_entries_ins AFTER INSERT ON semantic_entries BEGIN
    INSERT INTO semantic_totals (prefix, entries, bytes) VALUES (new.prefix, 1, new.bytes)
    ON CONFLICT (prefix) DO UPDATE SET entries = entries + 1, bytes = bytes + new.bytes;
    UPDATE semantic_partitions SET present = present + 1 WHERE pid = new.pid;
END;
CREATE TRIGGER IF NOT EXISTS semantic_entries_del AFTER DELETE ON semantic_entries BEGIN
    UPDATE semantic_totals SET entries = entries - 1, bytes = bytes - old.bytes WHERE prefix = old.prefix;
    DELETE FROM semantic_totals WHERE prefix = old.prefix AND entries <= 0;
    DELETE FROM semantic_tags WHERE seq = old.seq;
    UPDATE semantic_partitions SET present = present - 1 WHERE pid = old.pid;
    INSERT INTO semantic_removals (pid, seq) SELECT old.pid, old.seq
        WHERE (SELECT present FROM semantic_partitions WHERE pid = old.pid) > 0;
    DELETE FROM semantic_removals WHERE pid = old.pid
        AND (SELECT present FROM semantic_partitions WHERE pid = old.pid) <= 0;
    DELETE FROM semantic_partitions WHERE pid = old.pid AND present <= 0;
END;
CREATE TABLE IF NOT EXISTS semantic_provenance (
    seq INTEGER PRIMARY KEY,
    engine_id INTEGER NOT NULL,
    computed_at REAL NOT NULL
);
CREATE TRIGGER IF NOT EXISTS semantic_entries_provenance_del AFTER DELETE ON semantic_entries BEGIN
    DELETE FROM semantic_provenance WHERE seq = old.seq;
END;
"""
#: Schema version in ``PRAGMA user_version``; a file with another one is refused.
_SCHEMA_VERSION = 1
_LIVE = "(expires_at IS NULL OR expires_at > ?)"
_ENTRY_COLUMNS = "seq, entry_id, prefix, partition, tenant, model_id, text, vector, response, tags, created_at, expires_at"


def _entry_from_row(row: Sequence[Any]) -> _Loaded:
    seq, entry_id, prefix, partition, tenant, model_id, text, vector, response, tags, created_at, expires_at = row
    entry = SemanticEntry._stored(
        entry_id=entry_id,
        prefix=prefix,
        partition=partition,
        tenant=tenant,
        model_id=model_id,
        text=text,
        vector=_vector_from(vector),
        response=bytes(response),
        tags=tuple(json.loads(tags)),
        created_at=float(created_at),
        expires_at=None if expires_at is None else float(expires_at),
    )
    return _Loaded(key=(prefix, partition, model_id), seq=seq, entry=entry)


class SqliteSemanticStore(SemanticStore):
    """The embedded default: one SQLite file (stdlib ``sqlite3``, WAL journal
    so readers never wait for the writer, ``synchronous=NORMAL``) shared by
    every gateway process of the machine.

    Layout: ``semantic_entries`` (``seq`` AUTOINCREMENT: never reused, so a
    replica's "after seq N" is exact), ``semantic_partitions`` (one row per
    ``(prefix, partition, model_id)`` holding entries, with their count),
    ``semantic_removals`` (the removal log, AUTOINCREMENT ``rseq``, the newest
    :data:`SQLITE_REMOVAL_LOG` kept), ``semantic_tags``, ``semantic_totals``
    (entries and bytes per prefix, for O(1) budget checks) and
    ``semantic_models`` (each model's dimension). Triggers keep counts, tags
    and the removal log in the same transaction as every insert or delete, so
    no code path can forget them. The ``semantic_`` names let the file be
    shared with other stores.

    Times are this host's wall clock (``time.time()``), which every process of
    the machine reads alike.

    Thread-safe: each thread (and each process after a fork) opens its own
    connection. A write waits at most ``busy_timeout_s`` for another
    process's write (SQLite's busy handler), then raises :class:`StoreUnavailable`.

    Args:
        path: the database file (created with its tables when missing; its folder must exist).
        busy_timeout_s: how long a statement waits for a lock, seconds (> 0).
        max_replicas, hnsw_threshold, background_builds: see :class:`SemanticStore`.

    Raises:
        InvalidField: an argument out of range.
        StoreUnavailable: the file cannot be opened, its tables created, or it
            holds another schema version.
    """

    access_time_source: ClassVar[str] = (
        "semantic-cache hits recorded by SemanticStore.touch by any gateway process of the machine "
        "(the host's wall clock), else the entry's creation"
    )

    def __init__(
        self,
        path: Path,
        *,
        busy_timeout_s: float = 1.0,
        max_replicas: int = DEFAULT_MAX_REPLICAS,
        hnsw_threshold: int = HNSW_THRESHOLD,
        background_builds: bool = True,
    ) -> None:
        super().__init__(max_replicas=max_replicas, hnsw_threshold=hnsw_threshold, background_builds=background_builds)
        if not isinstance(path, str | os.PathLike):
            raise InvalidField("path", f"must be a file path, got {_show(path)}")
        if (
            isinstance(busy_timeout_s, bool)
            or not isinstance(busy_timeout_s, int | float)
            or not math.isfinite(busy_timeout_s)
            or busy_timeout_s <= 0
        ):
            raise InvalidField("busy_timeout_s", f"must be a finite number of seconds > 0, got {_show(busy_timeout_s)}")
        self.path = Path(path)
        self.busy_timeout_s = float(busy_timeout_s)
        self._db = SqliteFile(
            self.path, busy_timeout_s=self.busy_timeout_s, what="SQLite semantic store", unavailable=StoreUnavailable,
            setup=self._setup,
        )  # fmt: skip

    def _setup(self, conn: sqlite3.Connection) -> None:
        """The file's journal mode and schema, on its first use in this process (see :class:`SqliteFile`).

        Raises:
            StoreUnavailable: the file holds a schema version this code does not read.
        """
        # The journal mode is a property of the file: set once, every later connection reads it.
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            if version not in (0, _SCHEMA_VERSION):
                raise StoreUnavailable(
                    f"SQLite semantic store {self.path}: schema version {version}, this code reads {_SCHEMA_VERSION}"
                )
            for statement in _split_schema(_SCHEMA):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
        except BaseException:
            conn.rollback()
            raise
        conn.execute("COMMIT")

    def __repr__(self) -> str:
        return f"SqliteSemanticStore({str(self.path)!r})"

    # -- connections ------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        return self._db.conn()

    def open(self) -> None:
        """Set the file up now (otherwise its first use does).

        Raises:
            StoreUnavailable: it cannot be opened, or holds another schema version.
        """
        self._db.ready()

    def close(self) -> None:
        """Drop the replicas and close every connection this store opened in this process."""
        super().close()
        self._db.close()

    def _errors(self, doing: str) -> AbstractContextManager[None]:
        return self._db.errors(doing)

    def _write(self, doing: str) -> AbstractContextManager[sqlite3.Connection]:
        return self._db.write(doing)

    @contextmanager
    def _snapshot(self, doing: str) -> Iterator[sqlite3.Connection]:
        """One read transaction: every statement in it sees the same committed state (WAL snapshot)."""
        with self._errors(doing):
            conn = self._conn()
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.execute("COMMIT")

    def _read(self, doing: str, sql: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        with self._errors(doing):
            return self._conn().execute(sql, params).fetchall()

    @staticmethod
    def _delete_seqs(conn: sqlite3.Connection, seqs: Sequence[int]) -> tuple[int, int]:
        """Delete these entries (triggers keep the rest consistent); returns (entries, bytes) removed."""
        count = freed = 0
        for batch in _chunks(list(seqs)):
            marks = ",".join("?" * len(batch))
            rows = conn.execute(f"DELETE FROM semantic_entries WHERE seq IN ({marks}) RETURNING bytes", tuple(batch)).fetchall()
            count += len(rows)
            freed += sum(b for (b,) in rows)
        if count:
            conn.execute(
                "DELETE FROM semantic_removals WHERE rseq <= (SELECT MAX(rseq) FROM semantic_removals) - ?",
                (SQLITE_REMOVAL_LOG,),
            )
        return count, freed

    # -- the gateway's side -----------------------------------------------------------

    def add(
        self, entry: SemanticEntry, *, max_entries: int | None = None, max_bytes: int | None = None,
        provenance: Provenance | None = None,
    ) -> int:  # fmt: skip
        """See :meth:`SemanticStore.add`: one transaction checks the model's
        dimension, purges the prefix's expired entries, replaces the entry (its
        provenance in a row of ``semantic_provenance`` beside it) and deletes the
        oldest others (ties by insertion order) until the budget holds."""
        if not isinstance(entry, SemanticEntry):
            raise InvalidField("entry", f"must be a SemanticEntry, got {type(entry).__name__}")
        if provenance is not None and not isinstance(provenance, Provenance):
            raise InvalidField("provenance", f"must be a Provenance or None, got {_show(provenance)}")
        budget_n = _check_budget("max_entries", max_entries, 1)
        budget_b = _check_budget("max_bytes", max_bytes, 0)
        size = entry.nbytes
        dim = int(entry.vector.shape[0])
        now = time.time()
        with self._write(f"add {entry.prefix}/{entry.entry_id}") as conn:
            row = conn.execute("SELECT dim FROM semantic_models WHERE model_id = ?", (entry.model_id,)).fetchone()
            if row is None:
                conn.execute("INSERT INTO semantic_models (model_id, dim) VALUES (?, ?)", (entry.model_id, dim))
            elif row[0] != dim:
                raise InvalidField("vector", f"has {dim} dimensions; model {entry.model_id!r} embeds in {row[0]}")
            expired = conn.execute(
                "SELECT seq FROM semantic_entries WHERE prefix = ? AND expires_at <= ?", (entry.prefix, now)
            ).fetchall()
            self._delete_seqs(conn, [s for (s,) in expired])
            if budget_b is not None and size > budget_b:
                return 0
            old = conn.execute("SELECT seq FROM semantic_entries WHERE entry_id = ?", (entry.entry_id,)).fetchall()
            self._delete_seqs(conn, [s for (s,) in old])
            seq = self._insert(conn, entry, size)
            if provenance is not None:
                conn.execute(
                    "INSERT INTO semantic_provenance (seq, engine_id, computed_at) VALUES (?, ?, ?)",
                    (seq, provenance.engine_id, provenance.computed_at),
                )
            if budget_n is None and budget_b is None:
                return 0
            return self._delete_seqs(conn, self._over_budget(conn, entry.prefix, seq, budget_n, budget_b))[0]

    @staticmethod
    def _insert(conn: sqlite3.Connection, entry: SemanticEntry, size: int) -> int:
        """Insert the entry (its partition row first, then the entry and its tags); its ``seq``."""
        conn.execute(
            "INSERT INTO semantic_partitions (prefix, partition, model_id, present) VALUES (?, ?, ?, 0)"
            " ON CONFLICT (prefix, partition, model_id) DO NOTHING",
            (entry.prefix, entry.partition, entry.model_id),
        )
        (pid,) = conn.execute(
            "SELECT pid FROM semantic_partitions WHERE prefix = ? AND partition = ? AND model_id = ?",
            (entry.prefix, entry.partition, entry.model_id),
        ).fetchone()
        (seq,) = conn.execute(
            "INSERT INTO semantic_entries (entry_id, pid, prefix, partition, tenant, model_id, text, vector, response,"
            " tags, created_at, expires_at, bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING seq",
            (entry.entry_id, pid, entry.prefix, entry.partition, entry.tenant, entry.model_id, entry.text,
             _vector_bytes(entry.vector), entry.response, json.dumps(list(entry.tags)), entry.created_at,
             entry.expires_at, size),
        ).fetchone()  # fmt: skip
        conn.executemany(
            "INSERT INTO semantic_tags (tenant, tag, seq) VALUES (?, ?, ?)", [(entry.tenant, t, seq) for t in entry.tags]
        )
        return int(seq)

    @staticmethod
    def _over_budget(conn: sqlite3.Connection, prefix: str, keep: int, budget_n: int | None, budget_b: int | None) -> list[int]:
        """The oldest entries of ``prefix`` but ``keep`` (ties by insertion order) whose deletion brings it within budget."""
        (count, total) = conn.execute("SELECT entries, bytes FROM semantic_totals WHERE prefix = ?", (prefix,)).fetchone()
        victims: list[int] = []
        if (budget_n is None or count <= budget_n) and (budget_b is None or total <= budget_b):
            return victims
        cursor = conn.execute(
            "SELECT seq, bytes FROM semantic_entries WHERE prefix = ? AND seq != ? ORDER BY created_at, seq", (prefix, keep)
        )
        for victim, victim_bytes in cursor:
            victims.append(victim)
            count -= 1
            total -= victim_bytes
            if (budget_n is None or count <= budget_n) and (budget_b is None or total <= budget_b):
                break
        cursor.close()
        return victims

    def get(self, entry_id: str, *, now: float | None = None) -> SemanticEntry | None:
        """See :meth:`SemanticStore.get`."""
        _check_entry_id(entry_id)
        at = _now(now)
        rows = self._read(
            f"get {entry_id}",
            f"SELECT {_ENTRY_COLUMNS} FROM semantic_entries WHERE entry_id = ? AND {_LIVE}",
            (entry_id, at),
        )
        return _entry_from_row(rows[0]).entry if rows else None

    def touch(self, entry_id: str, *, now: float | None = None) -> bool:
        """See :meth:`SemanticStore.touch`: one UPDATE."""
        _check_entry_id(entry_id)
        at = _now(now)
        with self._errors(f"touch {entry_id}"):
            cursor = self._conn().execute(
                f"UPDATE semantic_entries SET last_access_at = ? WHERE entry_id = ? AND {_LIVE}", (at, entry_id, at)
            )
            return cursor.rowcount == 1

    def provenance(self, entry_id: str) -> Provenance | None:
        """See :meth:`SemanticStore.provenance`: one read."""
        _check_entry_id(entry_id)
        rows = self._read(
            f"provenance {entry_id}",
            "SELECT p.engine_id, p.computed_at FROM semantic_provenance p JOIN semantic_entries e ON e.seq = p.seq"
            " WHERE e.entry_id = ?",
            (entry_id,),
        )
        return Provenance(int(rows[0][0]), float(rows[0][1])) if rows else None

    def retire_computed(self, prefix: str, engine_id: int, since: float | None) -> int:
        """See :meth:`SemanticStore.retire_computed`: one transaction."""
        _check_prefix(prefix)
        check_engine_id(engine_id)
        lower = check_since(since)
        floor = -1.0 if lower is None else lower
        with self._write(f"retire answers of engine {engine_id} in {prefix}") as conn:
            rows = conn.execute(
                "SELECT e.seq FROM semantic_entries e LEFT JOIN semantic_provenance p ON p.seq = e.seq WHERE e.prefix = ?"
                " AND ((p.seq IS NULL AND e.created_at >= ?) OR (p.engine_id = ? AND p.computed_at >= ?))",
                (prefix, floor, engine_id, floor),
            ).fetchall()
            return self._delete_seqs(conn, [s for (s,) in rows])[0]

    def invalidate_tags(self, tenant: str, tags: Iterable[str]) -> int:
        """See :meth:`SemanticStore.invalidate_tags`: one IMMEDIATE transaction."""
        _check_name("tenant", tenant)
        wanted = _check_tag_list(tags)
        if not wanted:
            return 0
        with self._write(f"invalidate tags of {tenant}") as conn:
            seqs: set[int] = set()
            for batch in _chunks(wanted):
                marks = ",".join("?" * len(batch))
                rows = conn.execute(
                    f"SELECT seq FROM semantic_tags WHERE tenant = ? AND tag IN ({marks})", (tenant, *batch)
                ).fetchall()
                seqs.update(s for (s,) in rows)
            return self._delete_seqs(conn, sorted(seqs))[0]

    def purge_expired(self, prefix: str | None = None, *, now: float | None = None) -> int:
        """See :meth:`SemanticStore.purge_expired`: one transaction."""
        if prefix is not None:
            _check_prefix(prefix)
        at = _now(now)
        with self._write("purge expired") as conn:
            if prefix is None:
                rows = conn.execute("SELECT seq FROM semantic_entries WHERE expires_at <= ?", (at,)).fetchall()
            else:
                rows = conn.execute(
                    "SELECT seq FROM semantic_entries WHERE prefix = ? AND expires_at <= ?", (prefix, at)
                ).fetchall()
            return self._delete_seqs(conn, [s for (s,) in rows])[0]

    # -- the control plane's side -------------------------------------------------

    def prefixes(self) -> list[str]:
        """See :meth:`SemanticStore.prefixes`."""
        rows = self._read("list prefixes", f"SELECT DISTINCT prefix FROM semantic_entries WHERE {_LIVE}", (time.time(),))
        return sorted(p for (p,) in rows)

    def exists(self, prefix: str) -> bool:
        """See :meth:`SemanticStore.exists`."""
        if is_stray_prefix(prefix):
            return False
        _check_prefix(prefix)
        rows = self._read(
            f"exists {prefix}", f"SELECT 1 FROM semantic_entries WHERE prefix = ? AND {_LIVE} LIMIT 1", (prefix, time.time())
        )
        return bool(rows)

    def entries(self, prefix: str) -> list[TierEntry]:
        """See :meth:`SemanticStore.entries`."""
        _check_prefix(prefix)
        rows = self._read(
            f"entries {prefix}",
            "SELECT entry_id, bytes, created_at, COALESCE(last_access_at, created_at) FROM semantic_entries"
            f" WHERE prefix = ? AND {_LIVE} ORDER BY entry_id",
            (prefix, time.time()),
        )
        return [TierEntry(key=k, bytes=b, created_at=c, last_access_at=a) for k, b, c, a in rows]

    def usage_all(self) -> dict[str, TierUsage]:
        """See :meth:`SemanticStore.usage_all`: one ``GROUP BY`` query over the live entries."""
        rows = self._read(
            "usage_all",
            "SELECT prefix, SUM(bytes), COUNT(*), MIN(created_at), MAX(created_at), MAX(COALESCE(last_access_at, created_at))"
            f" FROM semantic_entries WHERE {_LIVE} GROUP BY prefix ORDER BY prefix",
            (time.time(),),
        )
        return {p: TierUsage(p, total, total, count, oldest, newest, last) for p, total, count, oldest, newest, last in rows}

    def delete_entries(self, prefix: str, keys: Iterable[str]) -> int:
        """See :meth:`SemanticStore.delete_entries`: one transaction."""
        _check_prefix(prefix)
        wanted = sorted({_check_entry_id(k) for k in keys})
        freed = 0
        with self._write(f"delete entries of {prefix}") as conn:
            for batch in _chunks(wanted):
                marks = ",".join("?" * len(batch))
                rows = conn.execute(
                    f"SELECT seq FROM semantic_entries WHERE prefix = ? AND entry_id IN ({marks})", (prefix, *batch)
                ).fetchall()
                freed += self._delete_seqs(conn, [s for (s,) in rows])[1]
        return freed

    def delete_prefix(self, prefix: str) -> int:
        """See :meth:`SemanticStore.delete_prefix`: one transaction."""
        if is_stray_prefix(prefix):
            return 0
        _check_prefix(prefix)
        with self._write(f"delete prefix {prefix}") as conn:
            rows = conn.execute("SELECT seq FROM semantic_entries WHERE prefix = ?", (prefix,)).fetchall()
            return self._delete_seqs(conn, [s for (s,) in rows])[1]

    # -- primitives ---------------------------------------------------------------

    def _delta(self, key: PartKey, generation: int | None, since_seq: int, since_rseq: int) -> _Delta:
        prefix, partition, model_id = key
        with self._snapshot(f"catch up {prefix}/{partition}") as conn:
            dim_row = conn.execute("SELECT dim FROM semantic_models WHERE model_id = ?", (model_id,)).fetchone()
            dim = None if dim_row is None else int(dim_row[0])
            part = conn.execute(
                "SELECT pid, present FROM semantic_partitions WHERE prefix = ? AND partition = ? AND model_id = ?", key
            ).fetchone()
            if part is None:
                return _empty_delta(None, reset=generation is not None or since_seq > 0, dim=dim)
            pid, present = part
            reset = pid != generation
            if reset:
                since_seq = since_rseq = 0
            rows = conn.execute(
                "SELECT seq, vector, expires_at FROM semantic_entries WHERE pid = ? AND seq > ? ORDER BY seq", (pid, since_seq)
            ).fetchall()
            removals = conn.execute(
                "SELECT rseq, seq FROM semantic_removals WHERE pid = ? AND rseq > ? ORDER BY rseq", (pid, since_rseq)
            ).fetchall()
        assert dim is not None  # a partition exists only with entries, and entries only with their model's row
        delta = _empty_delta(pid, reset, dim, since_rseq)
        delta.present = present
        if rows:
            delta.seqs = np.fromiter((r[0] for r in rows), np.int64, len(rows))
            delta.vectors = np.frombuffer(b"".join(r[1] for r in rows), dtype="<f4").reshape(len(rows), dim)
            delta.expires = np.fromiter((math.inf if r[2] is None else r[2] for r in rows), np.float64, len(rows))
        if removals:
            delta.removed = [s for _, s in removals]
            delta.last_rseq = removals[-1][0]
        return delta

    def _members(self, key: PartKey, generation: int | None) -> np.ndarray:
        if generation is None:
            return np.empty(0, np.int64)
        rows = self._read("membership", "SELECT seq FROM semantic_entries WHERE pid = ?", (generation,))
        return np.fromiter((s for (s,) in rows), np.int64, len(rows))

    def _load(self, seqs: Sequence[int]) -> dict[int, _Loaded]:
        out: dict[int, _Loaded] = {}
        for batch in _chunks(list(seqs)):
            marks = ",".join("?" * len(batch))
            rows = self._read("read hits", f"SELECT {_ENTRY_COLUMNS} FROM semantic_entries WHERE seq IN ({marks})", batch)
            for row in rows:
                loaded = _entry_from_row(row)
                out[loaded.seq] = loaded
        return out


def _split_schema(script: str) -> list[str]:
    """Statements of :data:`_SCHEMA` (triggers hold ``;`` inside ``BEGIN ... END``), for
    ``execute`` one by one inside a transaction (``executescript`` would commit first)."""
    statements, current = [], []
    for line in script.strip().splitlines():
        current.append(line)
        text = "\n".join(current)
        if line.rstrip().endswith(";") and (not text.lstrip().startswith("CREATE TRIGGER") or line.strip() == "END;"):
            statements.append(text)
            current = []
    return statements
