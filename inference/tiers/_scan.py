"""The disk tier's accounting scan, stdlib only so it can also run as a worker process.

:class:`inference.tiers.disk.DiskTier` calls :func:`scan_prefixes` in-process
and, for big trees, starts extra copies of this file as scripts
(``python -I -S _scan.py``), each scanning its own shard of every prefix's
entries. Processes rather than threads: each ``stat`` is about a microsecond
of system time, so threads spend more on handing the GIL back and forth than
they save (measured here: two threads were slower than one).
Scripts rather than a ``concurrent.futures`` process pool: a ``spawn`` or
``forkserver`` worker imports the whole package (0.45–0.65 s to start, against
~0.04 s for ``python -I -S``), and ``fork`` would copy a threaded web or worker
process (see ``bench/README.md``).

Everything is opened relative to directory file descriptors with
``O_NOFOLLOW``, and files are ``lstat``-ed, so no symlink inside the root is
ever followed.

Worker protocol: one JSON object on stdin ``{"root": str, "prefixes": [str],
"shard": int, "nshards": int}``; one JSON object on stdout mapping each prefix
to its partial aggregate (see :data:`Aggregate`) or null when the prefix
vanished.
"""

from __future__ import annotations

import errno
import json
import os
import stat as stat_module
import sys
import zlib
from functools import partial
from operator import attrgetter

#: Partial usage of one prefix: [logical bytes, allocated bytes, entries,
#: oldest entry mtime, newest entry mtime, last file access]; times are
#: seconds since the epoch or None.
TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing (most of this script's ~20 ms start)
if TYPE_CHECKING:
    from typing import Any

    Aggregate = list[Any]
else:
    Aggregate = list

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Entries per aggregation step: the sums run over one list of stat results
#: per chunk rather than per entry (fewer Python calls per file), and the list
#: stays small so the cyclic GC is not triggered by thousands of live objects.
CHUNK = 64
#: POSIX st_blocks unit (Linux stat(2): "number of 512B blocks allocated").
BLOCK = 512

_size = attrgetter("st_size")
_blocks = attrgetter("st_blocks")
_atime = attrgetter("st_atime")
_mtime = attrgetter("st_mtime")
_nlink = attrgetter("st_nlink")


def _gone(exc: OSError) -> bool:
    """Whether an error means the path vanished or was swapped for a symlink
    (never followed: O_NOFOLLOW answers ELOOP) while we scanned: skip it."""
    return isinstance(exc, (FileNotFoundError, NotADirectoryError)) or exc.errno == errno.ELOOP


def stat_files(dir_fd: int) -> list[os.stat_result]:
    """``lstat`` of every name in ``dir_fd``: one ``map`` in C on the usual
    path; if a file vanishes meanwhile (an eviction running beside the scan),
    again one by one, skipping the missing."""
    names = os.listdir(dir_fd)
    try:
        return list(map(partial(os.stat, dir_fd=dir_fd, follow_symlinks=False), names))
    except FileNotFoundError:
        found = []
        for name in names:
            try:
                found.append(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
            except FileNotFoundError:
                continue
        return found


def in_shard(name: str, shard: int, nshards: int) -> bool:
    """Whether entry ``name`` belongs to ``shard`` of ``nshards``: CRC-32 of its
    bytes, so every process agrees however the directory is listed."""
    return nshards == 1 or zlib.crc32(os.fsencode(name)) % nshards == shard


def walk_tree(dir_fd: int) -> tuple[int, int, float | None]:
    """(logical bytes, 512-byte blocks, last file access) of everything below
    ``dir_fd``, recursing without following symlinks. The directory's own
    blocks are not included (the caller has its stat)."""
    size = blocks = 0
    last: float | None = None
    with os.scandir(dir_fd) as it:
        children = list(it)
    for child in children:
        try:
            st = child.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        blocks += st.st_blocks
        if stat_module.S_ISDIR(st.st_mode):
            try:
                fd = os.open(child.name, DIR_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                if _gone(exc):
                    continue
                raise
            try:
                sub_size, sub_blocks, sub_last = walk_tree(fd)
            finally:
                os.close(fd)
            size += sub_size
            blocks += sub_blocks
            if sub_last is not None and (last is None or sub_last > last):
                last = sub_last
        else:
            size += st.st_size
            seen = max(st.st_atime, st.st_mtime)
            if last is None or seen > last:
                last = seen
    return size, blocks, last


def list_prefix(prefix_fd: int) -> tuple[list[str], list[os.DirEntry[str]]]:
    """(entry folder names, other children) of a prefix directory.

    Entries are the visible folders; everything else (files, links, hidden
    names: the tiers keep none of their own inside a prefix) is an "other",
    whose bytes count towards the prefix but which is no entry."""
    entries: list[str] = []
    others: list[os.DirEntry[str]] = []
    with os.scandir(prefix_fd) as it:
        for child in it:
            if not child.name.startswith(".") and child.is_dir(follow_symlinks=False):
                entries.append(child.name)
            else:
                others.append(child)
    return entries, others


def tree_at(dir_fd: int, name: str) -> tuple[int, int, float | None] | None:
    """:func:`walk_tree` of the folder ``name`` in ``dir_fd``: (logical bytes,
    512-byte blocks, last file access) of everything below it, its own
    blocks not included; None if it vanished or is not a folder (anymore)."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if _gone(exc):
            return None
        raise
    try:
        return walk_tree(fd)
    finally:
        os.close(fd)


def scan_prefix(root_fd: int, prefix: str, shard: int = 0, nshards: int = 1) -> Aggregate | None:
    """Aggregate one prefix's shard (see the module doc); None if the prefix is
    not a directory (vanished, or a symlink, which is never followed).

    Raises:
        OSError: other than a path vanishing (permissions, I/O errors).
    """
    try:
        pfd = os.open(prefix, DIR_FLAGS, dir_fd=root_fd)
    except OSError as exc:
        if _gone(exc):
            return None
        raise
    size = blocks = 0
    oldest: float | None = None
    newest: float | None = None
    last: float | None = None
    try:
        names, others = list_prefix(pfd)
        if shard == 0:
            # The prefix directory itself and what is not an entry are counted once, by shard 0.
            blocks += os.fstat(pfd).st_blocks
            for other in others:
                try:
                    st = other.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                blocks += st.st_blocks
                if not stat_module.S_ISDIR(st.st_mode):
                    size += st.st_size
                    continue
                # A hidden folder: no entry, but its content is the prefix's.
                tree = tree_at(pfd, other.name)
                if tree is not None:
                    size += tree[0]
                    blocks += tree[1]
        if nshards > 1:
            names = [n for n in names if in_shard(n, shard, nshards)]
        count = 0
        dstat = partial(os.stat, dir_fd=pfd, follow_symlinks=False)
        for start in range(0, len(names), CHUNK):
            chunk = names[start : start + CHUNK]
            dirs = []
            files: list[os.stat_result] = []
            extend = files.extend
            for name in chunk:
                try:
                    dst = dstat(name)
                    efd = os.open(name, DIR_FLAGS, dir_fd=pfd)
                except OSError as exc:
                    if _gone(exc):
                        continue  # evicted while we scanned
                    raise
                try:
                    if dst.st_nlink == 2:
                        # No subdirectories (ext4/xfs count "." and ".."): the
                        # ExampleConnector layout, the fast path.
                        extend(stat_files(efd))
                    else:
                        sub_size, sub_blocks, sub_last = walk_tree(efd)
                        size += sub_size
                        blocks += sub_blocks
                        if sub_last is not None and (last is None or sub_last > last):
                            last = sub_last
                finally:
                    os.close(efd)
                dirs.append(dst)
            if not dirs:
                continue
            count += len(dirs)
            blocks += sum(map(_blocks, dirs))
            lo = min(map(_mtime, dirs))
            hi = max(map(_mtime, dirs))
            oldest = lo if oldest is None or lo < oldest else oldest
            newest = hi if newest is None or hi > newest else newest
            if files:
                size += sum(map(_size, files))
                blocks += sum(map(_blocks, files))
                # Directory atimes are left out: listing a folder (this scan)
                # updates them; only file atime/mtime mean an engine access.
                seen = max(max(map(_atime, files)), max(map(_mtime, files)))
                if last is None or seen > last:
                    last = seen
    finally:
        os.close(pfd)
    return [size, blocks * BLOCK, count, oldest, newest, last]


def scan_prefixes(root: str, prefixes: list[str], shard: int = 0, nshards: int = 1) -> dict[str, Aggregate | None]:
    """Aggregate each of ``prefixes`` (names directly under ``root``) for one shard."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return {prefix: scan_prefix(root_fd, prefix, shard, nshards) for prefix in prefixes}
    finally:
        os.close(root_fd)


def entry_details(prefix_fd: int, name: str) -> tuple[int, float, float | None] | None:
    """(logical bytes, folder mtime, last file access) of one entry folder, or
    None if it is not a directory (anymore)."""
    try:
        efd = os.open(name, DIR_FLAGS, dir_fd=prefix_fd)
    except OSError as exc:
        if _gone(exc):
            return None
        raise
    try:
        dst = os.fstat(efd)
        if dst.st_nlink == 2:
            files = stat_files(efd)
            size = sum(map(_size, files))
            last = max(max(map(_atime, files)), max(map(_mtime, files))) if files else None
        else:
            size, _blocks_unused, last = walk_tree(efd)
    finally:
        os.close(efd)
    return size, dst.st_mtime, last


def main() -> int:
    """Worker entry point: read the request from stdin, print the aggregates."""
    request = json.load(sys.stdin)
    result = scan_prefixes(request["root"], request["prefixes"], request["shard"], request["nshards"])
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
