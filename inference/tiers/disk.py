"""The disk KV tier written by vLLM's ExampleConnector.

Layout (vLLM 0.32, ``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``):
an engine started for a namespace gets ``shared_storage_path = root/<storage_prefix>``;
for every stored prompt prefix it creates one folder named by a hash of the
token ids (``_generate_foldername_debug``: ``safe_hash`` of the token bytes,
md5 hex unless FIPS) holding one ``<layer_name>.safetensors`` file per
attention layer (``_generate_filename_debug``). So here:

- a prefix is a directory directly under ``root``;
- an entry is a directory directly under ``root/<prefix>``, its bytes the sum
  of its files' sizes, its creation time the folder's mtime (set when its
  layer files were created, all within one forward pass), its last access
  ``max(atime, mtime)`` over its files.

Hidden folders under ``root`` named by the tier are its own: tombstones
``.deleting-<prefix>.<hex>`` of prefixes, entries and strays being removed
(finished by every scan, never reported), and staging folders
``.restoring-<prefix>.<hex>`` of restores in progress or crashed (reported by
:meth:`DiskTier.usage_all` as bytes of their prefix, removed by a delete of
that prefix). Everything else under ``root`` that is not a prefix folder (a
file, a link, a foreign hidden name, a folder whose name cannot be a storage
prefix) is a stray: reported under its own pseudo-prefix
(:func:`inference.tiers.base.stray_prefix`) so its bytes are seen and an
eviction can delete it; inside a prefix folder, whatever is not an entry
folder counts towards the prefix's bytes.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat as stat_module
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from inference.child_env import die_with_parent
from inference.tiers import _scan
from inference.tiers.base import (
    TierEntry,
    TierError,
    TierUsage,
    TierWriteFailed,
    check_entry_key,
    check_prefix,
    errno_text,
    is_prefix_name,
    is_stray_prefix,
)
from inference.tiers.rooted import RootListing, add_root_items, list_root, remove_tree, root_items_usage

__all__ = ["DiskEntryFiles", "DiskFile", "DiskTier"]

TOMBSTONE = ".deleting-"
STAGING = ".restoring-"
#: Entry folders (estimated) from which :meth:`DiskTier.usage_all` adds worker
#: processes: ~100,000 files at 5 layers, a scan of ~0.4 s on one core here,
#: against ~20 ms to start a ``python -I -S`` worker.
PARALLEL_MIN_ENTRIES = 20_000


@dataclass(frozen=True)
class DiskFile:
    """One regular file of an entry: ``name`` relative to the entry folder
    (``/``-separated when nested), ``size`` in bytes, times in seconds since
    the epoch."""

    name: str
    size: int
    atime: float
    mtime: float


@dataclass(frozen=True)
class DiskEntryFiles:
    """An entry folder and its regular files (symlinks and special files are
    left out); ``mtime`` is the folder's, seconds since the epoch."""

    key: str
    mtime: float
    files: tuple[DiskFile, ...]


def _tombstone_name(prefix: str) -> str:
    # A stray's tombstone has an empty prefix: ".deleting-.<hex>".
    return f"{TOMBSTONE}{prefix}.{secrets.token_hex(8)}"


def _hidden_head(name: str, kind: str) -> str | None:
    """The ``<prefix>`` of ``<kind><prefix>.<16 hex digits>``, or None if
    ``name`` is not so formed."""
    return name[len(kind) :].rpartition(".")[0] if _is_hidden_of(name, kind, None) else None


def _kind_of(name: str, is_dir: bool) -> str:
    """``"prefix"``, ``"tombstone"``, ``"staging"`` or ``"stray"``: what a
    name directly under the root is (``is_dir``: a real folder, not a link)."""
    if name.startswith("."):
        if is_dir and _is_hidden_of(name, TOMBSTONE, None):
            return "tombstone"
        head = _hidden_head(name, STAGING)
        return "staging" if is_dir and head is not None and is_prefix_name(head) else "stray"
    return "prefix" if is_dir and is_prefix_name(name) else "stray"


def _is_hidden_of(name: str, kind: str, prefix: str | None) -> bool:
    """Whether ``name`` is a tombstone/staging folder (``kind``) of ``prefix``
    (of any prefix when None): ``<kind><prefix>.<16 hex digits>``."""
    if not name.startswith(kind):
        return False
    rest = name[len(kind) :]
    head, dot, token = rest.rpartition(".")
    if not dot or len(token) != 16 or any(c not in "0123456789abcdef" for c in token):
        return False
    return prefix is None or head == prefix


class DiskTier:
    """Accounting, eviction and restore staging for the ExampleConnector disk tier.

    Args:
        root: the directory holding one folder per storage prefix.
        workers: processes for big accounting scans (default: usable CPUs, at
            most 8); 1 keeps every scan in this process.

    Concurrency: deletes are atomic renames to a tombstone first, so an engine
    reading the tier sees a whole entry or none. An engine still *writing* a
    prefix can re-create it after :meth:`delete_prefix` (ExampleConnector
    calls ``os.makedirs(..., exist_ok=True)``); stop routing to a namespace
    before deleting it.
    """

    access_time_source = (
        "file atime, which relatime mounts (the Linux default) update at most once a day "
        "or when older than mtime, and noatime mounts never; max(atime, mtime) of the "
        "entry's files is used, so a write always counts"
    )
    keeps_access_history = False

    def __init__(self, root: Path, *, workers: int | None = None) -> None:
        self.root = Path(root)
        if workers is None:
            try:
                workers = len(os.sched_getaffinity(0))
            except AttributeError:  # not Linux
                workers = os.cpu_count() or 1
            workers = min(workers, 8)
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers

    def __repr__(self) -> str:
        return f"DiskTier({str(self.root)!r})"

    # -- reading -------------------------------------------------------------

    def prefix_path(self, prefix: str) -> Path:
        """``root/<prefix>`` (whether or not it exists).

        Raises:
            ValueError: invalid prefix (see :func:`inference.tiers.base.check_prefix`).
        """
        return self.root / check_prefix(prefix)

    def prefixes(self) -> list[str]:
        """Storage prefixes present, sorted: real directories directly under
        ``root`` whose names can be storage prefixes (no leading ``.``; see
        :func:`inference.tiers.base.is_prefix_name`; symlinks are not
        followed, so not listed). Empty when ``root`` does not exist.

        Raises:
            TierError: ``root`` cannot be listed (other than not existing).
        """
        return sorted(self._list_root().prefixes)

    def exists(self, prefix: str) -> bool:
        """Whether ``root/<prefix>`` is a directory (not a symlink); for a
        stray pseudo-prefix, whether any item it stands for is there.

        Raises:
            ValueError: invalid prefix.
        """
        if is_stray_prefix(prefix):
            return bool(self._list_root().strays.get(prefix))
        try:
            return stat_module.S_ISDIR(os.lstat(self.prefix_path(prefix)).st_mode)
        except FileNotFoundError:
            return False

    def usage(self, prefix: str) -> TierUsage:
        """Usage of one prefix (:class:`TierUsage.empty` if absent). ``bytes``
        is the sum of file sizes; ``allocated_bytes`` counts file system blocks
        of files and directories, prefix folder included, as ``du -s -B1``
        does (hard links are counted each time). The prefix's staging folders
        are left out (only :meth:`usage_all` lists the root to find them).
        A stray pseudo-prefix gets the usage of the items it stands for (see
        :meth:`usage_all`).

        Raises:
            ValueError: invalid prefix.
        """
        if is_stray_prefix(prefix):
            return root_items_usage(self.root, prefix, self._list_root().strays.get(prefix, []))
        check_prefix(prefix)
        return self._usage_of([prefix]).get(prefix) or TierUsage.empty(prefix)

    def usage_all(self) -> dict[str, TierUsage]:
        """The accounting scan: usage of every prefix in one pass, keyed by
        prefix, and of every stray, keyed by its pseudo-prefix: every byte
        under ``root`` is in exactly one of them, except leftover tombstones,
        which are finished first (a crash between rename and removal) so they
        stop holding space.

        A prefix's staging folders (restores in progress or crashed) add to
        its ``bytes`` and ``allocated_bytes`` (a prefix with nothing else has
        0 entries and the staging folders' times). A stray's usage: its bytes (a folder's: of everything
        below it), 1 entry, created and newest at its mtime (a folder's: the
        latest of its own mtime and its files' atime and mtime, so a folder in
        use never looks old). Big trees are split across worker processes (see
        :data:`PARALLEL_MIN_ENTRIES`); a worker that fails is redone in this
        process.

        Raises:
            TierError: ``root`` cannot be listed or scanned (other than not existing).
        """
        self._finish_tombstones(None)
        listing = self._list_root()
        usages = self._usage_of(sorted(listing.prefixes))
        add_root_items(usages, self.root, listing)
        return usages

    def entries(self, prefix: str) -> list[TierEntry]:
        """Entries of ``prefix`` sorted by key (empty if the prefix is absent).

        Each: ``bytes`` = sum of its file sizes, ``created_at`` = folder mtime,
        ``last_access_at`` = max(atime, mtime) over its files (None when it
        has no files), no access history.

        Raises:
            ValueError: invalid prefix.
        """
        path = self.prefix_path(prefix)
        try:
            pfd = os.open(path, _scan.DIR_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink: never followed
                return []
            raise TierError(f"disk tier {self.root}: cannot open prefix {prefix}: {exc}") from exc
        result: list[TierEntry] = []
        try:
            names, _others = _scan.list_prefix(pfd)
            for name in sorted(names):
                details = _scan.entry_details(pfd, name)
                if details is None:
                    continue
                size, created, last = details
                result.append(TierEntry(key=name, bytes=size, created_at=created, last_access_at=last))
        finally:
            os.close(pfd)
        return result

    def entry_files(self, prefix: str) -> Iterator[DiskEntryFiles]:
        """Each entry folder of ``prefix`` with its regular files, both sorted
        by name (what :class:`inference.tiers.cold.ColdTier` archives).

        Raises:
            ValueError: invalid prefix.
        """
        path = self.prefix_path(prefix)
        try:
            pfd = os.open(path, _scan.DIR_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return
            raise TierError(f"disk tier {self.root}: cannot open prefix {prefix}: {exc}") from exc
        try:
            names, _others = _scan.list_prefix(pfd)
            for name in sorted(names):
                try:
                    efd = os.open(name, _scan.DIR_FLAGS, dir_fd=pfd)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                try:
                    mtime = os.fstat(efd).st_mtime
                    files = tuple(_regular_files(efd, ""))
                finally:
                    os.close(efd)
                yield DiskEntryFiles(key=name, mtime=mtime, files=files)
        finally:
            os.close(pfd)

    def open_file(self, prefix: str, key: str, name: str) -> BinaryIO:
        """Open one entry file for reading without following any symlink, and
        without updating its atime where the kernel allows (``O_NOATIME``:
        file owner or root), so archiving does not count as an access.

        Args:
            name: path relative to the entry folder, as in :class:`DiskFile`.

        Raises:
            ValueError: invalid prefix, key or name component.
            FileNotFoundError: the file is gone; OSError for other failures.
        """
        parts = [check_prefix(prefix), check_entry_key(key), *(check_entry_key(p) for p in name.split("/"))]
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts[:-1]:
                next_fd = os.open(part, _scan.DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = next_fd
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                file_fd = os.open(parts[-1], flags | getattr(os, "O_NOATIME", 0), dir_fd=fd)
            except PermissionError:
                file_fd = os.open(parts[-1], flags, dir_fd=fd)
        finally:
            os.close(fd)
        return os.fdopen(file_fd, "rb")

    # -- deleting ------------------------------------------------------------

    def delete_entries(self, prefix: str, keys: Iterable[str]) -> int:
        """Delete entries of ``prefix``; returns logical bytes freed.

        Each entry folder is first renamed to a tombstone under ``root`` (one
        atomic step: engines see the whole entry or nothing), then removed.
        Idempotent: a missing key frees 0.

        Raises:
            ValueError: invalid prefix or any invalid key (checked before
                anything is deleted).
            TierError: a rename or removal failed for another reason.
        """
        check_prefix(prefix)
        wanted = sorted({check_entry_key(k) for k in keys})
        freed = 0
        for key in wanted:
            tomb = self.root / _tombstone_name(prefix)
            try:
                os.rename(self.root / prefix / key, tomb)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                raise TierError(f"disk tier {self.root}: cannot delete entry {prefix}/{key}: {exc}") from exc
            freed += self._remove_tombstone(tomb.name)
        return freed

    def delete_prefix(self, prefix: str) -> int:
        """Delete everything the tier holds for ``prefix``; returns logical bytes freed.

        The prefix directory is renamed to a tombstone first, so no live
        prefix is ever half deleted; leftover tombstones and staging folders
        of this prefix (an earlier crash) are removed too and their bytes
        counted. For a stray pseudo-prefix, the items it stands for are
        removed (a folder through a tombstone, like a prefix; a file or link
        unlinked, never its target). Idempotent: afterwards ``exists(prefix)``
        is False and a second call returns 0.

        Raises:
            ValueError: invalid prefix.
            TierError: the rename or removal failed for another reason.
        """
        if is_stray_prefix(prefix):
            return self._delete_strays(self._list_root().strays.get(prefix, []))
        path = self.prefix_path(prefix)
        try:
            if stat_module.S_ISDIR(os.lstat(path).st_mode):
                os.rename(path, self.root / _tombstone_name(prefix))
            else:
                # A stray file or symlink under the prefix's name: not tier
                # data, but it holds the name; remove it (a link, not its target).
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise TierError(f"disk tier {self.root}: cannot delete prefix {prefix}: {exc}") from exc
        return self._finish_tombstones(prefix)

    # -- restoring -----------------------------------------------------------

    def staging_dir(self, prefix: str) -> Path:
        """Create and return an empty hidden folder under ``root`` (same file
        system, so :meth:`adopt_staging` can rename from it atomically) to
        write ``<entry key>/<file>`` into.

        Raises:
            ValueError: invalid prefix.
            TierWriteFailed: it cannot be created (message has the errno name).
        """
        check_prefix(prefix)
        path = self.root / f"{STAGING}{prefix}.{secrets.token_hex(8)}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            path.mkdir()
        except OSError as exc:
            raise TierWriteFailed(f"disk tier {self.root}: cannot create staging folder: {errno_text(exc)}") from exc
        return path

    def adopt_staging(self, prefix: str, staging: Path, *, replace: bool = False) -> int:
        """Move the entry folders of ``staging`` into ``root/<prefix>`` and
        remove ``staging``; returns the number of entries moved.

        When the prefix does not exist the whole folder is renamed into place
        in one step. Otherwise each entry is renamed in; an existing entry of
        the same key is replaced only with ``replace=True`` (renamed to a
        tombstone first), and other existing entries are kept.

        Raises:
            ValueError: invalid prefix or ``staging`` not one of ours.
            TierError: an entry exists and ``replace`` is False (nothing moved).
        """
        check_prefix(prefix)
        staging = Path(staging)
        if staging.parent != self.root or not _is_hidden_of(staging.name, STAGING, prefix):
            raise ValueError(f"{staging} is not a staging folder of prefix {prefix} under {self.root}")
        keys = sorted(e.name for e in os.scandir(staging) if e.is_dir(follow_symlinks=False))
        target = self.root / prefix
        if not self.exists(prefix):
            try:
                os.rename(staging, target)
                return len(keys)
            except OSError as exc:
                # Created meanwhile (ENOTEMPTY/EEXIST): merge entry by entry.
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise TierError(f"disk tier {self.root}: cannot move restored prefix {prefix}: {exc}") from exc
        target.mkdir(exist_ok=True)
        clashes = [k for k in keys if os.path.lexists(target / k)]
        if clashes and not replace:
            raise TierError(
                f"disk tier {self.root}: prefix {prefix} already holds {len(clashes)} of the restored entries "
                f"(e.g. {clashes[0]}); pass replace=True to overwrite them"
            )
        for key in keys:
            if key in clashes:
                tomb = self.root / _tombstone_name(prefix)
                try:
                    os.rename(target / key, tomb)
                except FileNotFoundError:
                    pass
            os.rename(staging / key, target / key)
        remove_tree(staging)
        self._finish_tombstones(prefix)
        return len(keys)

    # -- internals -----------------------------------------------------------

    def _list_root(self) -> RootListing:
        """Every name directly under ``root`` by kind (tombstones left out)."""

        def classify(name: str, entry: os.DirEntry[str]) -> tuple[str, str] | None:
            kind = _kind_of(name, entry.is_dir(follow_symlinks=False))
            if kind == "prefix":
                return ("prefix", name)
            if kind == "staging":
                return ("partial", name[len(STAGING) :].rpartition(".")[0])
            return ("stray", name) if kind == "stray" else None

        return list_root(self.root, f"disk tier {self.root}", classify)

    def _delete_strays(self, names: list[str]) -> int:
        """Remove stray items directly under ``root``; returns logical bytes freed.
        Each is classified again first: one that became a prefix folder since
        the listing is left alone."""
        freed = 0
        for name in sorted(names):
            path = self.root / name
            try:
                st = os.lstat(path)
                if _kind_of(name, stat_module.S_ISDIR(st.st_mode)) != "stray":
                    continue
                if stat_module.S_ISDIR(st.st_mode):
                    tomb = self.root / _tombstone_name("")
                    os.rename(path, tomb)
                    freed += self._remove_tombstone(tomb.name)
                else:
                    os.unlink(path)
                    freed += st.st_size
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise TierError(f"disk tier {self.root}: cannot delete stray {name!r}: {exc}") from exc
        return freed

    def _remove_tombstone(self, name: str) -> int:
        """Remove one tombstone; returns the logical bytes it held (0 if
        someone else removed it first)."""
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                tfd = os.open(name, _scan.DIR_FLAGS, dir_fd=root_fd)
            except FileNotFoundError:
                return 0
            try:
                size, _blocks, _last = _scan.walk_tree(tfd)
            finally:
                os.close(tfd)
        finally:
            os.close(root_fd)
        try:
            remove_tree(self.root / name)
        except OSError as exc:
            raise TierError(f"disk tier {self.root}: cannot remove {name}: {exc}") from exc
        return size

    def _finish_tombstones(self, prefix: str | None) -> int:
        """Remove leftover tombstones (and, for one prefix, its staging
        folders) of ``prefix``, or of every prefix when None; returns bytes freed."""
        try:
            with os.scandir(self.root) as it:
                names = [e.name for e in it if e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise TierError(f"disk tier {self.root}: cannot list: {exc}") from exc
        freed = 0
        for name in sorted(names):
            # A staging folder may belong to a restore still running, so only
            # a delete of that very prefix removes it, never a scan.
            if _is_hidden_of(name, TOMBSTONE, prefix) or (prefix is not None and _is_hidden_of(name, STAGING, prefix)):
                freed += self._remove_tombstone(name)
        return freed

    def _usage_of(self, prefixes: list[str]) -> dict[str, TierUsage]:
        """Scan ``prefixes`` (validated names), in worker processes too when big."""
        if not prefixes:
            return {}
        nshards = self.workers if self.workers > 1 and self._estimate_entries(prefixes) >= PARALLEL_MIN_ENTRIES else 1
        root = str(self.root)
        workers: list[subprocess.Popen[bytes] | None] = []
        try:
            workers = [_start_worker(root, prefixes, shard, nshards) for shard in range(1, nshards)]
            partials = [_scan.scan_prefixes(root, prefixes, 0, nshards)]
            for shard, proc in enumerate(workers, start=1):
                result = _finish_worker(proc)
                partials.append(result if result is not None else _scan.scan_prefixes(root, prefixes, shard, nshards))
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and not self.root.exists():
                return {}  # no root: nothing stored
            raise TierError(f"disk tier {self.root}: scan failed: {exc}") from exc
        finally:
            for proc in workers:
                _stop_worker(proc)
        usages: dict[str, TierUsage] = {}
        for prefix in prefixes:
            first = partials[0].get(prefix)
            if first is None:
                continue  # vanished or not a directory
            parts = [first] + [part for p in partials[1:] if (part := p.get(prefix)) is not None]
            usages[prefix] = TierUsage(
                prefix=prefix,
                bytes=sum(p[0] for p in parts),
                allocated_bytes=sum(p[1] for p in parts),
                entries=sum(p[2] for p in parts),
                oldest_entry_at=_min_or_none(p[3] for p in parts),
                newest_entry_at=_max_or_none(p[4] for p in parts),
                last_access_at=_max_or_none(p[5] for p in parts),
            )
        return usages

    def _estimate_entries(self, prefixes: list[str]) -> int:
        # A directory's link count is 2 + its subdirectories on ext4 and xfs,
        # so one lstat per prefix estimates the entry count. Where it says
        # nothing (btrfs reports 1) assume big.
        total = 0
        for prefix in prefixes:
            try:
                nlink = os.lstat(self.root / prefix).st_nlink
            except OSError:
                continue
            total += nlink - 2 if nlink >= 2 else PARALLEL_MIN_ENTRIES
        return total


def _regular_files(dir_fd: int, base: str) -> Iterator[DiskFile]:
    with os.scandir(dir_fd) as it:
        children = sorted(it, key=lambda e: e.name)
    for child in children:
        st = child.stat(follow_symlinks=False)
        if stat_module.S_ISREG(st.st_mode):
            yield DiskFile(name=base + child.name, size=st.st_size, atime=st.st_atime, mtime=st.st_mtime)
        elif stat_module.S_ISDIR(st.st_mode):
            sub = os.open(child.name, _scan.DIR_FLAGS, dir_fd=dir_fd)
            try:
                yield from list(_regular_files(sub, f"{base}{child.name}/"))
            finally:
                os.close(sub)


def _start_worker(root: str, prefixes: list[str], shard: int, nshards: int) -> subprocess.Popen[bytes] | None:
    """Start ``python -I -S _scan.py`` on one shard; None if it cannot start
    (the caller then scans that shard itself)."""
    try:
        # -I -S: stdlib only, no site-packages, no environment: starts in ~20 ms.
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _scan.__file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # a failed worker is redone in-process, where errors surface
            preexec_fn=die_with_parent,  # a killed scan leaves no worker behind
        )
    except OSError:
        return None
    try:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"root": root, "prefixes": prefixes, "shard": shard, "nshards": nshards}).encode())
        proc.stdin.close()
    except OSError:  # it died before reading its request
        _stop_worker(proc)
        return None
    return proc


def _finish_worker(proc: subprocess.Popen[bytes] | None) -> dict[str, _scan.Aggregate | None] | None:
    """A worker's aggregates, or None if it did not start or failed."""
    if proc is None:
        return None
    # Not communicate(): with stdin already closed it fails on Python 3.11.
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.stdout.close()
    if proc.wait() != 0:
        return None
    try:
        aggregates: dict[str, _scan.Aggregate | None] = json.loads(out)
    except ValueError:
        return None
    return aggregates


def _stop_worker(proc: subprocess.Popen[bytes] | None) -> None:
    """Kill and reap a worker that is no longer wanted."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.kill()
    if proc.stdout is not None and not proc.stdout.closed:
        proc.stdout.close()
    proc.wait()


def _min_or_none(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _max_or_none(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None
