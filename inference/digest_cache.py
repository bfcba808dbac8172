"""Per-file content digest cache keyed on (path, device, inode, size, mtime_ns, ctime_ns).

Hashing a multi-gigabyte checkpoint takes seconds to minutes; re-registering an
unchanged one should not. A file is re-hashed whenever any part of its key
changes, which catches rewrites in place (mtime, size), replacements by rename
(inode), and in-place writes whose mtime was set back afterwards (ctime, which
no user call can set). Stored in a stdlib SQLite file because inode and path are facts
of one host: each host keeps its own cache.

The same file also holds the identity's config, tokenizer and layout fields by a
content key (:func:`inference.identity.metadata_key`: the bytes of the files they
are computed from, the library versions and the platform), so a fingerprint that
finds them needs no vLLM, transformers or torch import.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS file_digest_v2 (
    path BLOB PRIMARY KEY,
    key TEXT NOT NULL,
    digest TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS file_tensors_v1 (
    path BLOB PRIMARY KEY,
    key TEXT NOT NULL,
    tensors TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS identity_fields_v1 (
    key TEXT PRIMARY KEY,
    fields TEXT NOT NULL
);
"""


class FileDigestCache:
    """A persistent map from a file's (path, size, mtime_ns, inode) to its digest.

    Safe for use from several threads of one process (one connection per
    thread) and from several processes (SQLite locking).
    """

    def __init__(self, db_path: Path) -> None:
        self._db_path = db_path
        self._local = threading.local()
        db_path.parent.mkdir(parents=True, exist_ok=True)
        with self._conn() as conn:
            conn.executescript(_SCHEMA)

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self._db_path, timeout=30)
            self._local.conn = conn
        return conn

    @staticmethod
    def stat_key(st: os.stat_result) -> str:
        """What "unchanged" means for a file: device, inode, size, mtime and ctime."""
        return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"

    def get(self, path: Path, st: os.stat_result) -> str | None:
        """The cached hex digest if the file's key still matches, else None."""
        query = "SELECT digest FROM file_digest_v2 WHERE path=? AND key=?"
        row = self._conn().execute(query, (os.fsencode(path), self.stat_key(st))).fetchone()
        return row[0] if row else None

    def put(self, path: Path, st: os.stat_result, digest: str) -> None:
        """Record ``digest`` for the file as it was when ``st`` was taken."""
        with self._conn() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO file_digest_v2(path, key, digest) VALUES (?,?,?)",
                (os.fsencode(path), self.stat_key(st), digest),
            )

    def get_manifest(self, path: Path, st: os.stat_result) -> list[list[Any]] | None:
        """The cached tensor list of a weight file (``[[name, dtype, shape, digest], ...]``)
        if the file's key still matches, else None."""
        query = "SELECT tensors FROM file_tensors_v1 WHERE path=? AND key=?"
        row = self._conn().execute(query, (os.fsencode(path), self.stat_key(st))).fetchone()
        return json.loads(row[0]) if row else None

    def put_manifest(self, path: Path, st: os.stat_result, tensors: list[list[Any]]) -> None:
        """Record a weight file's tensor list as it was when ``st`` was taken."""
        with self._conn() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO file_tensors_v1(path, key, tensors) VALUES (?,?,?)",
                (os.fsencode(path), self.stat_key(st), json.dumps(tensors, separators=(",", ":"))),
            )

    def get_fields(self, key: str) -> dict[str, Any] | None:
        """The identity fields recorded under a content key
        (:func:`inference.identity.metadata_key`), or None."""
        row = self._conn().execute("SELECT fields FROM identity_fields_v1 WHERE key=?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def put_fields(self, key: str, fields: dict[str, Any]) -> None:
        """Record identity fields (JSON-ready) under their content key."""
        with self._conn() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO identity_fields_v1(key, fields) VALUES (?,?)",
                (key, json.dumps(fields, separators=(",", ":"), allow_nan=False)),
            )
