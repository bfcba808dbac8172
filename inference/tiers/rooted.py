"""What the tiers that keep their state in one folder (disk, cold) share.

Such a tier holds, directly under its root, one item per storage prefix (a
folder, an archive), items that belong to a prefix but are not, or no longer,
whole (restore staging folders, archive temp files: "partial" items), and
strays: anything else, each reported under its own pseudo-prefix
(:func:`inference.tiers.base.stray_prefix`) so every byte under the root is
accounted for.
"""

from __future__ import annotations

import os
import shutil
import stat as stat_module
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from inference.tiers import _scan
from inference.tiers.base import TierError, TierUsage, stray_prefix

__all__ = ["Classifier", "RootListing", "add_root_items", "list_root", "remove_tree", "root_items_usage"]

#: ``classify(name, entry)`` → ``("prefix", prefix)``, ``("partial", prefix)``,
#: ``("stray", name)``, or None for a name the tier keeps to itself (a tombstone).
Classifier = Callable[[str, "os.DirEntry[str]"], "tuple[str, str] | None"]


@dataclass
class RootListing:
    """What lies directly under a tier's root, by kind.

    Attributes:
        prefixes: storage prefixes with a whole item (a prefix folder, an archive).
        partial: prefix → names of its partial items (staging folders, temp files).
        strays: stray pseudo-prefix → the names of the items it stands for.
    """

    prefixes: list[str] = field(default_factory=list)
    partial: defaultdict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    strays: defaultdict[str, list[str]] = field(default_factory=lambda: defaultdict(list))


def list_root(root: Path, label: str, classify: Classifier) -> RootListing:
    """Every name directly under ``root``, sorted into a :class:`RootListing` by ``classify``.

    A root that does not exist lists empty.

    Raises:
        TierError: ``root`` cannot be listed (the message starts with ``label``).
    """
    listing = RootListing()
    try:
        with os.scandir(root) as it:
            kinds = [(entry.name, classify(entry.name, entry)) for entry in it]
    except FileNotFoundError:
        return listing
    except OSError as exc:
        raise TierError(f"{label}: cannot list: {exc}") from exc
    for name, kind in kinds:
        if kind is None:
            continue
        what, key = kind
        if what == "prefix":
            listing.prefixes.append(key)
        elif what == "partial":
            listing.partial[key].append(name)
        else:
            listing.strays[stray_prefix(os.fsencode(name))].append(name)
    return listing


def add_root_items(usages: dict[str, TierUsage], root: Path, listing: RootListing) -> None:
    """Add a listing's partial items to their prefixes' usage and its strays as their own, in place.

    A prefix with partial items only gets 0 entries and their times (a restore
    or an archive still being written keeps a prefix no namespace has yet young).

    Raises:
        TierError: an item cannot be read (other than vanishing).
    """
    for prefix, names in sorted(listing.partial.items()):
        extra = root_items_usage(root, prefix, names)
        current = usages.get(prefix)
        if current is None:
            usages[prefix] = replace(extra, entries=0)
        else:
            usages[prefix] = replace(
                current,
                bytes=current.bytes + extra.bytes,
                allocated_bytes=current.allocated_bytes + extra.allocated_bytes,
            )
    for pseudo, names in sorted(listing.strays.items()):
        usages[pseudo] = root_items_usage(root, pseudo, names)


def remove_tree(path: Path) -> None:
    """Remove a tree; a part someone else removed meanwhile is not an error
    (two finishers of one tombstone). ``shutil.rmtree`` works on directory
    file descriptors here (Linux), so it never follows a symlink."""

    def ignore_missing(_func: object, _path: str, exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise exc

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=ignore_missing)  # type: ignore[call-arg]
    else:
        shutil.rmtree(path, onerror=lambda f, p, info: ignore_missing(f, p, info[1]))


def root_items_usage(root: Path, prefix: str, names: Iterable[str]) -> TierUsage:
    """Usage of items directly under ``root`` (files, links or whole folders,
    never followed), reported as ``prefix``: one entry each, items that
    vanished meanwhile count nothing (:meth:`TierUsage.empty` when none is left).

    Each item: a file's size, blocks and mtime (its creation time here) and
    ``max(atime, mtime)`` (its last access); a folder's bytes and blocks of
    everything below it and, as both times, the latest of its own mtime and
    its files' atime and mtime (so a folder in use never looks old).

    Raises:
        TierError: an item cannot be read (other than vanishing).
    """
    size = blocks = count = 0
    created: list[float] = []
    accessed: list[float] = []
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return TierUsage.empty(prefix)
    name = ""
    try:
        for name in names:
            try:
                st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
                tree = _scan.tree_at(root_fd, name) if stat_module.S_ISDIR(st.st_mode) else None
            except FileNotFoundError:
                continue
            count += 1
            blocks += st.st_blocks
            if tree is None:
                size += st.st_size
                created.append(st.st_mtime)
                accessed.append(max(st.st_atime, st.st_mtime))
            else:
                # Not the folder's own atime: listing it (this scan) sets that.
                size += tree[0]
                blocks += tree[1]
                last = st.st_mtime if tree[2] is None else max(st.st_mtime, tree[2])
                created.append(last)
                accessed.append(last)
    except OSError as exc:
        raise TierError(f"{root}: cannot scan {name!r}: {exc}") from exc
    finally:
        os.close(root_fd)
    if not count:
        return TierUsage.empty(prefix)
    return TierUsage(
        prefix=prefix,
        bytes=size,
        allocated_bytes=blocks * _scan.BLOCK,
        entries=count,
        oldest_entry_at=min(created),
        newest_entry_at=max(created),
        last_access_at=max(accessed),
    )
