"""The cold tier: one compressed archive per storage prefix, restorable for rollback.

Engines cannot read it; it holds what was demoted from the hot tiers until it
is restored or dropped. ``root/<prefix>.tar.gz`` is a tar stream (stdlib
``tarfile``, PAX format) of, in order:

1. ``manifest.json``: format, prefix, creation time and per tier the entry
   count and logical bytes (first, so usage reads only the archive's start);
2. ``disk/<entry key>/`` directories and ``disk/<entry key>/<file>`` files:
   the disk tier's folder of that prefix, with mtimes (and atimes, as PAX
   ``atime`` records) so a restore gives back the same ages;
3. ``redis/entries.bin``: the Redis entries as frames ``>IQQQ`` (key length,
   TTL ms, logical bytes, payload length) + UTF-8 key + ``DUMP`` payload;
4. ``digest.json``: ``{"blake3": hex}`` over every member before it, each as
   ``len(name) name len(data) data`` (8-byte big-endian lengths).

Hidden temp files ``.<prefix>.tar.gz.tmp-<16 hex>`` are archives being written
(or left by a crash); :meth:`ColdTier.usage_all` counts them as bytes of their
prefix and :meth:`ColdTier.delete` removes them. Anything else under ``root``
(another file, a folder, a link, an archive name that cannot be a storage
prefix) is a stray: reported under its own pseudo-prefix
(:func:`inference.tiers.base.stray_prefix`) and removed by ``delete`` of it.

gzip rather than xz: KV tensors are float data that barely compress. Measured
here on float16 normal values: gzip level 1 leaves 92.6 % of the bytes at
~24 MB/s, xz preset 6 88.8 % at ~2.4 MB/s; restores (rollback) and demotions
both run 10x faster with gzip for 4 % more space.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import stat
import struct
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

import blake3

from inference.tiers import _scan
from inference.tiers.base import (
    TierError,
    TierUsage,
    TierWriteFailed,
    check_entry_key,
    check_prefix,
    errno_text,
    is_prefix_name,
    is_stray_prefix,
)
from inference.tiers.disk import DiskTier
from inference.tiers.redis_tier import DumpedEntry, RedisTier
from inference.tiers.rooted import RootListing, add_root_items, list_root, remove_tree, root_items_usage

__all__ = ["ArchiveInfo", "ColdTier"]

SUFFIX = ".tar.gz"
#: Between ``.<prefix>.tar.gz`` and the 16 hex digits of an archive's temp file.
TEMP_MARK = ".tmp-"
FORMAT = 1
MANIFEST = "manifest.json"
DIGEST = "digest.json"
REDIS_MEMBER = "redis/entries.bin"
DISK_DIR = "disk"
#: gzip level; see the module doc for why low.
COMPRESSLEVEL = 1
_FRAME = struct.Struct(">IQQQ")
_LEN = struct.Struct(">Q")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ArchiveInfo:
    """A verified cold archive.

    Attributes:
        prefix: storage prefix.
        path: the archive file.
        bytes: archive file size in bytes.
        logical_bytes: logical bytes archived: disk file sizes + Redis value
            lengths (``STRLEN``), as the hot tiers' usage counts them.
        entries: disk entries + Redis entries.
        digest: BLAKE3 hex digest of the archive's members (see module doc).
        created_at: when the archive was written, seconds since the epoch.
        disk_entries: disk entries in it.
        redis_entries: Redis entries in it.
    """

    prefix: str
    path: Path
    bytes: int
    logical_bytes: int
    entries: int
    digest: str
    created_at: float
    disk_entries: int = 0
    redis_entries: int = 0


class _WriteError(Exception):
    """An OSError raised while writing our output, told apart from errors
    reading the hot tiers (those are :class:`TierError`, not a full disk)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _Sink:
    """A write-only file wrapper that marks its OSErrors as :class:`_WriteError`."""

    def __init__(self, raw: IO[bytes], name: str) -> None:
        self._raw = raw
        self.name = name  # gzip stores its basename in the header

    def write(self, data: bytes) -> int:
        try:
            return self._raw.write(data)
        except OSError as exc:
            raise _WriteError(exc) from exc

    def flush(self) -> None:
        try:
            self._raw.flush()
        except OSError as exc:
            raise _WriteError(exc) from exc


class _HashingReader:
    """Reads a source file for ``tarfile.addfile``, feeding the digest."""

    def __init__(self, raw: BinaryIO, hasher: Any) -> None:
        self._raw = raw
        self._hasher = hasher

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self._hasher.update(data)
        return data


def _temp_prefix(name: str) -> str | None:
    """The prefix of a temp file name ``.<prefix>.tar.gz.tmp-<16 hex>``, else None."""
    head, mark, token = name.rpartition(TEMP_MARK)
    if not (mark and name.startswith(".") and head.endswith(SUFFIX)) or len(token) != 16:
        return None
    if any(c not in "0123456789abcdef" for c in token):
        return None
    prefix = head[1 : -len(SUFFIX)]
    return prefix if is_prefix_name(prefix) else None


def _kind_of(name: str, is_file: bool) -> str:
    """``"archive"``, ``"temp"`` or ``"stray"``: what a name directly under the
    root is (``is_file``: a regular file, not a link)."""
    if is_file and _temp_prefix(name) is not None:
        return "temp"
    if is_file and name.endswith(SUFFIX) and is_prefix_name(name[: -len(SUFFIX)]):
        return "archive"
    return "stray"


def _hash_header(hasher: Any, name: str, size: int) -> None:
    encoded = name.encode("utf-8", "surrogateescape")
    hasher.update(_LEN.pack(len(encoded)) + encoded + _LEN.pack(size))


def _read_frames(stream: IO[bytes], hasher: Any | None = None) -> Iterator[DumpedEntry]:
    """Parse ``redis/entries.bin`` frames; raises ValueError on a torn frame."""

    def exact(n: int) -> bytes:
        data = stream.read(n)
        if len(data) != n:
            raise ValueError(f"truncated Redis frame: wanted {n} bytes, got {len(data)}")
        if hasher is not None:
            hasher.update(data)
        return data

    while True:
        head = stream.read(_FRAME.size)
        if not head:
            return
        if len(head) != _FRAME.size:
            raise ValueError("truncated Redis frame header")
        if hasher is not None:
            hasher.update(head)
        key_len, ttl_ms, size, payload_len = _FRAME.unpack(head)
        key = exact(key_len).decode("utf-8", "surrogateescape")
        yield DumpedEntry(key=key, payload=exact(payload_len), ttl_ms=ttl_ms, bytes=size)


class ColdTier:
    """Archive, verify, restore and drop the demoted state of storage prefixes.

    Args:
        root: directory holding ``<prefix>.tar.gz`` archives (created on the
            first archive).
    """

    access_time_source = "none: engines never read cold archives; an archive's only time is when it was written"
    keeps_access_history = False

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"ColdTier({str(self.root)!r})"

    def archive_path(self, prefix: str) -> Path:
        """``root/<prefix>.tar.gz`` (whether or not it exists).

        Raises:
            ValueError: invalid prefix.
        """
        return self.root / f"{check_prefix(prefix)}{SUFFIX}"

    def exists(self, prefix: str) -> bool:
        """Whether the prefix has an archive (not checked; see :meth:`verify`);
        for a stray pseudo-prefix, whether any item it stands for is there.

        Raises:
            ValueError: invalid prefix.
        """
        if is_stray_prefix(prefix):
            return bool(self._list_root().strays.get(prefix))
        return self.archive_path(prefix).is_file()

    def prefixes(self) -> list[str]:
        """Prefixes with an archive, sorted: regular files ``<prefix>.tar.gz``
        whose ``<prefix>`` can be a storage prefix (temp files and strays are
        not listed).

        Raises:
            TierError: ``root`` cannot be listed (other than not existing).
        """
        return sorted(self._list_root().prefixes)

    # -- writing -------------------------------------------------------------

    def archive(self, prefix: str, *, disk: DiskTier | None, redis: RedisTier | None) -> ArchiveInfo:
        """Archive the prefix's hot state (disk folder and/or Redis entries).

        Written to a hidden temp file in ``root``, fsynced, then renamed over
        ``root/<prefix>.tar.gz`` (``os.replace``, atomic) and the directory
        fsynced: a crash leaves the old archive or the new one, never a torn
        one. The hot tiers are only read, never changed: delete them after
        this returns (and :meth:`verify` agrees). Writers to the prefix must
        be stopped first: entries written meanwhile may be missed.

        Idempotent: when a verified archive already exists it is returned as
        is, so a retry after "archived, crashed before deleting the hot copy"
        does not rewrite it from a hot copy that may be half deleted. A
        corrupt archive is rewritten from the hot tiers if they hold entries.

        Raises:
            ValueError: invalid prefix.
            TierWriteFailed: writing failed (ENOSPC, EDQUOT, EFBIG...; the
                message has the errno name); the temp file is removed.
            TierError: a hot file changed size while read, the existing
                archive is corrupt and there is nothing to rebuild it from.
            TierUnavailable: Redis down.
        """
        check_prefix(prefix)
        if redis is not None:
            redis.check_prefix(prefix)
        path = self.archive_path(prefix)
        corrupt: TierError | None = None
        try:
            existing = self.verify(prefix)
        except TierError as exc:
            existing, corrupt = None, exc
        if existing is not None:
            return existing

        tmp = self.root / f".{prefix}{SUFFIX}.tmp-{secrets.token_hex(8)}"
        spool: IO[bytes] | None = None
        try:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise _WriteError(exc) from exc
            disk_entries = list(disk.entry_files(prefix)) if disk is not None else []
            redis_count = redis_bytes = 0
            if redis is not None:
                # Unnamed (O_TMPFILE/unlinked) next to the archive: never left behind.
                try:
                    spool = tempfile.TemporaryFile(dir=self.root)
                except OSError as exc:
                    raise _WriteError(exc) from exc
                sink = _Sink(spool, "")
                for item in redis.dump_prefix(prefix):
                    key = item.key.encode("utf-8", "surrogateescape")
                    sink.write(_FRAME.pack(len(key), item.ttl_ms, item.bytes, len(item.payload)) + key)
                    sink.write(item.payload)
                    redis_count += 1
                    redis_bytes += item.bytes
                sink.flush()
            if corrupt is not None and not disk_entries and redis_count == 0:
                raise TierError(f"{corrupt}; the hot tiers hold nothing to rebuild it from, so it is kept for inspection")
            created_at = time.time()
            manifest = {
                "format": FORMAT,
                "prefix": prefix,
                "created_at": created_at,
                "disk": {
                    "entries": len(disk_entries),
                    "files": sum(len(e.files) for e in disk_entries),
                    "bytes": sum(f.size for e in disk_entries for f in e.files),
                },
                "redis": {"entries": redis_count, "bytes": redis_bytes},
            }
            digest = self._write(tmp, prefix, manifest, disk, disk_entries, spool)
            try:
                os.replace(tmp, path)
                _fsync_dir(self.root)
            except OSError as exc:
                raise _WriteError(exc) from exc
        except _WriteError as exc:
            _unlink_quietly(tmp)
            raise TierWriteFailed(
                f"cold tier {self.root}: writing the archive of {prefix} failed: {errno_text(exc.error)}"
            ) from exc
        except BaseException:
            _unlink_quietly(tmp)
            raise
        finally:
            if spool is not None:
                spool.close()
        disk_meta, redis_meta = manifest["disk"], manifest["redis"]
        assert isinstance(disk_meta, dict) and isinstance(redis_meta, dict)
        return ArchiveInfo(
            prefix=prefix,
            path=path,
            bytes=path.stat().st_size,
            logical_bytes=disk_meta["bytes"] + redis_meta["bytes"],
            entries=disk_meta["entries"] + redis_meta["entries"],
            digest=digest,
            created_at=created_at,
            disk_entries=disk_meta["entries"],
            redis_entries=redis_meta["entries"],
        )

    def _write(
        self,
        tmp: Path,
        prefix: str,
        manifest: dict[str, Any],
        disk: DiskTier | None,
        disk_entries: list[Any],
        spool: IO[bytes] | None,
    ) -> str:
        """Write the tar stream to ``tmp`` and fsync it; returns the digest."""
        hasher = blake3.blake3()
        try:
            raw = open(tmp, "xb")  # noqa: SIM115 - closed below, after fsync
        except OSError as exc:
            raise _WriteError(exc) from exc
        try:
            sink = _Sink(raw, f"{prefix}{SUFFIX}")
            # typeshed asks w:gz's fileobj for read, seek, tell and close too; gzip's writer only calls write and flush.
            with tarfile.open(fileobj=sink, mode="w:gz", compresslevel=COMPRESSLEVEL, format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
                _add_bytes(tar, MANIFEST, json.dumps(manifest, sort_keys=True).encode(), hasher)
                for entry in disk_entries:
                    assert disk is not None
                    member = f"{DISK_DIR}/{entry.key}"
                    info = tarfile.TarInfo(member)
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, entry.mtime
                    _hash_header(hasher, member + "/", 0)
                    tar.addfile(info)
                    for file in entry.files:
                        self._add_disk_file(tar, disk, prefix, entry.key, file, hasher)
                if spool is not None:
                    size = spool.seek(0, os.SEEK_END)
                    spool.seek(0)
                    info = tarfile.TarInfo(REDIS_MEMBER)
                    info.size, info.mode, info.mtime = size, 0o644, manifest["created_at"]
                    _hash_header(hasher, REDIS_MEMBER, size)
                    tar.addfile(info, _HashingReader(spool, hasher))  # type: ignore[arg-type]
                digest = hasher.hexdigest()
                _add_bytes(tar, DIGEST, json.dumps({"blake3": digest}).encode(), None)
            try:
                raw.flush()
                os.fsync(raw.fileno())
            except OSError as exc:
                raise _WriteError(exc) from exc
        finally:
            try:
                raw.close()
            except OSError:
                pass  # already failing, or flushed above
        return digest

    @staticmethod
    def _add_disk_file(tar: tarfile.TarFile, disk: DiskTier, prefix: str, key: str, file: Any, hasher: Any) -> None:
        member = f"{DISK_DIR}/{key}/{file.name}"
        try:
            source = disk.open_file(prefix, key, file.name)
        except OSError as exc:
            raise TierError(f"disk tier {disk.root}: {prefix}/{key}/{file.name} vanished while archiving: {exc}") from exc
        with source:
            info = tarfile.TarInfo(member)
            info.size, info.mode, info.mtime = file.size, 0o644, file.mtime
            info.pax_headers = {"atime": repr(file.atime)}
            _hash_header(hasher, member, file.size)
            try:
                tar.addfile(info, _HashingReader(source, hasher))
                grew = source.read(1)
            except _WriteError:
                raise
            except OSError as exc:  # tarfile: "unexpected end of data" when the file shrank
                raise TierError(f"disk tier {disk.root}: {prefix}/{key}/{file.name} changed while archiving: {exc}") from exc
            if grew:
                raise TierError(f"disk tier {disk.root}: {prefix}/{key}/{file.name} grew while archiving")

    # -- reading -------------------------------------------------------------

    def verify(self, prefix: str) -> ArchiveInfo | None:
        """Read the whole archive and check it: manifest first, digest last,
        the BLAKE3 of everything between matching, counts matching the manifest.

        Returns:
            Its info, or None when there is no archive.

        Raises:
            ValueError: invalid prefix.
            TierError: the archive is corrupt or truncated (the message says how).
        """
        path = self.archive_path(prefix)
        if not path.is_file():
            return None
        return self._read(prefix, path, None)

    def restore(self, prefix: str, *, disk: DiskTier | None, redis: RedisTier | None, replace: bool = False) -> int:
        """Put the archived state back into the hot tiers; returns the entries restored.

        The archive is verified first (a full read), then read again to
        restore: disk entries are written to a staging folder in the disk
        tier's root and moved into place (the whole prefix in one rename when
        it is absent), Redis entries are ``RESTORE``d in batches. A tier given
        as None is skipped. The archive is kept (delete it with :meth:`delete`).

        Args:
            replace: allow restoring into a hot prefix that already holds
                entries; same-named entries are overwritten, others kept.

        Raises:
            ValueError: invalid prefix.
            TierError: no archive, corrupt archive, or (without ``replace``) a
                hot tier already holds entries of the prefix; nothing changed.
            TierWriteFailed: the disk staging could not be written (errno
                name in the message); the staging folder is removed.
            TierUnavailable: Redis down.
        """
        path = self.archive_path(prefix)
        info = self.verify(prefix)
        if info is None:
            raise TierError(f"cold tier {self.root}: no archive of prefix {prefix}")
        if redis is not None:
            redis.check_prefix(prefix)
        if not replace:
            if disk is not None and info.disk_entries and disk.entries(prefix):
                raise TierError(
                    f"disk tier {disk.root}: prefix {prefix} already holds entries; pass replace=True to restore over them"
                )
            if redis is not None and info.redis_entries and redis.exists(prefix):
                raise TierError(f"Redis tier: prefix {prefix} already holds entries; pass replace=True to restore over them")
        restored = self._read(prefix, path, _Restore(prefix, disk, redis, replace))
        assert restored is not None
        return restored.entries

    def delete(self, prefix: str) -> int:
        """Drop the prefix's archive (and any temp file a crashed archive left);
        returns bytes freed (file sizes). For a stray pseudo-prefix, remove
        the items it stands for (a folder with everything below it; a link,
        never its target). Idempotent: 0 when absent.

        Raises:
            ValueError: invalid prefix. TierError: removal failed.
        """
        if is_stray_prefix(prefix):
            return self._delete_strays(self._list_root().strays.get(prefix, []))
        path = self.archive_path(prefix)
        freed = 0
        candidates = [path]
        try:
            with os.scandir(self.root) as it:
                temp_head = f".{prefix}{SUFFIX}.tmp-"
                candidates += [self.root / e.name for e in it if e.name.startswith(temp_head)]
        except FileNotFoundError:
            return 0
        for candidate in candidates:
            try:
                size = candidate.lstat().st_size
                candidate.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise TierError(f"cold tier {self.root}: cannot delete {candidate.name}: {exc}") from exc
            freed += size
        return freed

    def usage(self, prefix: str) -> TierUsage:
        """Usage of one archive: ``bytes`` = archive file size, ``allocated_bytes``
        its blocks, ``entries`` from its manifest (only the archive's first
        member is read), oldest = newest entry time = when it was archived; no
        last access. An unreadable manifest counts 0 entries and uses the
        file's mtime (run :meth:`verify` to find out why).

        A stray pseudo-prefix gets the usage of the items it stands for (see
        :func:`inference.tiers.rooted.root_items_usage`).

        Raises:
            ValueError: invalid prefix.
            TierError: a stray cannot be read.
        """
        if is_stray_prefix(prefix):
            return root_items_usage(self.root, prefix, self._list_root().strays.get(prefix, []))
        path = self.archive_path(prefix)
        try:
            st = path.stat()
        except FileNotFoundError:
            return TierUsage.empty(prefix)
        entries, created = 0, st.st_mtime
        try:
            with tarfile.open(path, "r|gz") as tar:
                member = tar.next()
                if member is not None and member.name == MANIFEST:
                    stream = tar.extractfile(member)
                    assert stream is not None
                    manifest = json.loads(stream.read())
                    entries = int(manifest["disk"]["entries"]) + int(manifest["redis"]["entries"])
                    created = float(manifest["created_at"])
        except (tarfile.TarError, OSError, EOFError, zlib.error, ValueError, KeyError, TypeError):
            pass
        return TierUsage(
            prefix=prefix,
            bytes=st.st_size,
            allocated_bytes=st.st_blocks * 512,
            entries=entries,
            oldest_entry_at=created,
            newest_entry_at=created,
            last_access_at=None,
        )

    def usage_all(self) -> dict[str, TierUsage]:
        """:meth:`usage` of every archived prefix and of every stray, keyed by
        prefix or pseudo-prefix: every byte under ``root`` is in one of them.

        An archive's temp files (being written, or left by a crash) add to
        its prefix's ``bytes`` and ``allocated_bytes``; a prefix with temp
        files only has 0 entries and their mtimes as its times (a temp file
        still being written keeps it young).

        Raises:
            TierError: ``root`` cannot be listed, or a stray cannot be read.
        """
        listing = self._list_root()
        usages = {prefix: self.usage(prefix) for prefix in sorted(listing.prefixes)}
        add_root_items(usages, self.root, listing)
        return usages

    # -- internals -----------------------------------------------------------

    def _list_root(self) -> RootListing:
        """Every name directly under ``root`` by kind: ``prefixes`` are those with an archive, ``partial`` their temp files."""

        def classify(name: str, entry: os.DirEntry[str]) -> tuple[str, str]:
            kind = _kind_of(name, entry.is_file(follow_symlinks=False))
            if kind == "archive":
                return ("prefix", name[: -len(SUFFIX)])
            if kind == "temp":
                prefix = _temp_prefix(name)
                assert prefix is not None
                return ("partial", prefix)
            return ("stray", name)

        return list_root(self.root, f"cold tier {self.root}", classify)

    def _delete_strays(self, names: list[str]) -> int:
        """Remove stray items directly under ``root``; returns logical bytes
        freed. Each is classified again first: one that became an archive or
        a temp file since the listing is left alone."""
        freed = 0
        for name in sorted(names):
            path = self.root / name
            try:
                st = os.lstat(path)
                if _kind_of(name, stat.S_ISREG(st.st_mode)) != "stray":
                    continue
                if stat.S_ISDIR(st.st_mode):
                    root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    try:
                        tree = _scan.tree_at(root_fd, name)
                    finally:
                        os.close(root_fd)
                    remove_tree(path)
                    freed += tree[0] if tree is not None else 0
                else:
                    path.unlink()
                    freed += st.st_size
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise TierError(f"cold tier {self.root}: cannot delete stray {name!r}: {exc}") from exc
        return freed

    def _read(self, prefix: str, path: Path, restore: _Restore | None) -> ArchiveInfo | None:
        """One sequential pass over the archive: verify it, and restore it
        when ``restore`` is given (the caller verified it before)."""
        hasher = blake3.blake3()
        counts = {"disk_entries": 0, "disk_files": 0, "disk_bytes": 0, "redis_entries": 0, "redis_bytes": 0}
        manifest: dict[str, Any] | None = None
        digest: str | None = None
        try:
            with tarfile.open(path, "r|gz") as tar:
                for member in tar:
                    if digest is not None:
                        raise ValueError(f"member {member.name!r} after {DIGEST}")
                    if manifest is None:
                        if member.name != MANIFEST or not member.isfile():
                            raise ValueError(f"first member is {member.name!r}, not {MANIFEST}")
                        data = _member_bytes(tar, member)
                        _hash_header(hasher, MANIFEST, len(data))
                        hasher.update(data)
                        manifest = json.loads(data)
                        if manifest.get("format") != FORMAT or manifest.get("prefix") != prefix:
                            raise ValueError(
                                f"manifest is for format {manifest.get('format')!r}, prefix {manifest.get('prefix')!r}"
                            )
                    elif member.name == DIGEST:
                        digest = json.loads(_member_bytes(tar, member))["blake3"]
                    elif member.name == REDIS_MEMBER and member.isfile():
                        _hash_header(hasher, REDIS_MEMBER, member.size)
                        stream = tar.extractfile(member)
                        assert stream is not None
                        frames = _read_frames(stream, hasher)
                        if restore is not None and restore.redis is not None:
                            frames = restore.count_redis(frames)
                            restore.redis.restore_entries(prefix, frames)
                        for frame in frames:  # the rest (all of it when not restoring)
                            counts["redis_entries"] += 1
                            counts["redis_bytes"] += frame.bytes
                        if restore is not None and restore.redis is not None:
                            counts["redis_entries"] += restore.redis_count
                            counts["redis_bytes"] += restore.redis_bytes
                    elif member.name.startswith(DISK_DIR + "/"):
                        parts = member.name.split("/")
                        key = check_entry_key(parts[1])
                        for part in parts[2:]:
                            check_entry_key(part)
                        if member.isdir() and len(parts) == 2:
                            _hash_header(hasher, member.name + "/", 0)
                            counts["disk_entries"] += 1
                            if restore is not None:
                                restore.disk_dir(key, member.mtime)
                        elif member.isfile() and len(parts) > 2:
                            _hash_header(hasher, member.name, member.size)
                            counts["disk_files"] += 1
                            counts["disk_bytes"] += member.size
                            stream = tar.extractfile(member)
                            assert stream is not None
                            restore_file = restore.disk_file(parts[1:], member) if restore is not None else None
                            _copy(stream, hasher, restore_file, member)
                        else:
                            raise ValueError(f"unexpected member {member.name!r} of type {member.type!r}")
                    else:
                        raise ValueError(f"unexpected member {member.name!r}")
            if manifest is None:
                raise ValueError("empty archive")
            if digest is None:
                raise ValueError(f"no {DIGEST}: truncated archive")
            if hasher.hexdigest() != digest:
                raise ValueError(f"BLAKE3 mismatch: recorded {digest}, content {hasher.hexdigest()}")
            expected = {
                "disk_entries": manifest["disk"]["entries"],
                "disk_files": manifest["disk"]["files"],
                "disk_bytes": manifest["disk"]["bytes"],
                "redis_entries": manifest["redis"]["entries"],
                "redis_bytes": manifest["redis"]["bytes"],
            }
            if counts != expected:
                raise ValueError(f"content {counts} does not match the manifest {expected}")
        except _WriteError as exc:
            if restore is not None:
                restore.abort()
            raise TierWriteFailed(f"disk tier: restoring {prefix} failed: {errno_text(exc.error)}") from exc
        except (tarfile.TarError, OSError, EOFError, zlib.error, ValueError, KeyError, TypeError) as exc:
            if restore is not None:
                restore.abort()
            raise TierError(f"cold tier {self.root}: archive {path.name} is corrupt: {type(exc).__name__}: {exc}") from exc
        except BaseException:
            if restore is not None:
                restore.abort()
            raise
        restored_entries = counts["disk_entries"] + counts["redis_entries"]
        if restore is not None:
            restored_entries = restore.commit()
        return ArchiveInfo(
            prefix=prefix,
            path=path,
            bytes=path.stat().st_size,
            logical_bytes=counts["disk_bytes"] + counts["redis_bytes"],
            entries=restored_entries,
            digest=digest,
            created_at=float(manifest["created_at"]),
            disk_entries=counts["disk_entries"],
            redis_entries=counts["redis_entries"],
        )


class _Restore:
    """Writes what :meth:`ColdTier._read` streams into the hot tiers."""

    def __init__(self, prefix: str, disk: DiskTier | None, redis: RedisTier | None, replace: bool) -> None:
        self.prefix, self.disk, self.redis, self.replace = prefix, disk, redis, replace
        self.staging: Path | None = None
        self.dir_times: dict[str, float] = {}
        self.redis_count = self.redis_bytes = 0

    def count_redis(self, frames: Iterator[DumpedEntry]) -> Iterator[DumpedEntry]:
        for frame in frames:
            self.redis_count += 1
            self.redis_bytes += frame.bytes
            yield frame

    def _staging(self) -> Path:
        if self.staging is None:
            assert self.disk is not None
            self.staging = self.disk.staging_dir(self.prefix)
        return self.staging

    def disk_dir(self, key: str, mtime: float) -> None:
        if self.disk is None:
            return
        try:
            (self._staging() / key).mkdir()
        except OSError as exc:
            raise _WriteError(exc) from exc
        self.dir_times[key] = mtime

    def disk_file(self, parts: list[str], member: tarfile.TarInfo) -> IO[bytes] | None:
        if self.disk is None:
            return None
        target = self._staging().joinpath(*parts)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            return open(target, "xb")  # noqa: SIM115 - closed by _copy
        except OSError as exc:
            raise _WriteError(exc) from exc

    def commit(self) -> int:
        restored = self.redis_count
        if self.disk is not None and self.staging is not None:
            # Files were written first, so folder mtimes are set last.
            for key, mtime in self.dir_times.items():
                os.utime(self.staging / key, (mtime, mtime))
            try:
                restored += self.disk.adopt_staging(self.prefix, self.staging, replace=self.replace)
            except BaseException:
                self.abort()
                raise
        return restored

    def abort(self) -> None:
        if self.staging is not None and self.staging.exists():
            remove_tree(self.staging)


def _copy(stream: IO[bytes], hasher: Any, target: IO[bytes] | None, member: tarfile.TarInfo) -> None:
    """Hash a member's content and write it to ``target`` (closed after, with
    the archived atime/mtime set) when given."""
    try:
        while chunk := stream.read(_CHUNK):
            hasher.update(chunk)
            if target is not None:
                try:
                    target.write(chunk)
                except OSError as exc:
                    raise _WriteError(exc) from exc
    finally:
        if target is not None:
            try:
                target.close()
            except OSError as exc:
                raise _WriteError(exc) from exc
    if target is not None:
        atime = float(member.pax_headers.get("atime", member.mtime))
        os.utime(target.name, (atime, member.mtime))


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    stream = tar.extractfile(member)
    if stream is None:
        raise ValueError(f"member {member.name!r} is not a file")
    return stream.read()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, hasher: Any | None) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
    if hasher is not None:
        _hash_header(hasher, name, len(data))
        hasher.update(data)
    tar.addfile(info, io.BytesIO(data))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
