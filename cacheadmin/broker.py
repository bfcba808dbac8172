"""kombu's filesystem transport, with its files written whole before anyone can read them.

The embedded default runs Celery on kombu's filesystem transport (settings). kombu 5.7's
``Channel._put`` creates a message file and only then writes into it, and ``_get`` moves and
reads any file it lists, without the writer's lock: a worker that lists the file in that
moment reads it empty, ``json.loads("")`` raises, and the worker's consumer dies with
``Unrecoverable error: JSONDecodeError('Expecting value: line 1 column 1 (char 0)')``
(celery/kombu#1551, open). The exchange table in the control folder has the same window: the
file is created with ``open("wb")`` before its lock is taken, and a reader that locks it first
reads it empty (treeverse/dvc-task#73 reports the garbled variant).

Here every file is written under a name no reader lists, then renamed into place (``rename``
is atomic within one folder), and a message is claimed by renaming it into a folder of claimed
files beside the queue (so two consumers never both take it, which ``shutil.move`` to the
temporary folder did not guarantee across filesystems). A file that still cannot be decoded
(written by something else) is set aside under ``.unreadable/`` with an error in the log,
instead of ending the worker.

Selected by ``CELERY_BROKER_TRANSPORT`` in the embedded default (settings).
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from queue import Empty
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

log = logging.getLogger(__name__)

#: Where a consumer moves a message it takes (inside the queue's folder: same filesystem).
CLAIMED_DIR = ".claimed"
#: Where a message file that cannot be decoded is set aside for an operator to look at.
UNREADABLE_DIR = ".unreadable"


def _write_whole(folder: str | Path, name: str, data: bytes, *, replace: bool = True) -> bool:
    """Write ``data`` to ``folder/name`` so that no reader ever sees it partly written.

    The bytes go to a hidden temporary name (``.<name>.<uuid>.part``, never listed as a message),
    are flushed, and the file is then renamed (``replace=True``) or linked (``replace=False``:
    only if ``name`` does not exist yet) into place.

    Returns:
        True when the file is in place; False only with ``replace=False`` when ``name`` already
        existed (nothing written).

    Raises:
        OSError: the folder cannot be written.
    """
    final = os.path.join(folder, name)
    partial = os.path.join(folder, f".{name}.{uuid.uuid4().hex}.part")
    try:
        with open(partial, "wb") as f:
            f.write(data)
            f.flush()
        if replace:
            os.replace(partial, final)
            return True
        try:
            os.link(partial, final)
        except FileExistsError:
            return False
        return True
    finally:
        try:
            os.unlink(partial)
        except FileNotFoundError:
            pass


class Channel(filesystem.Channel):
    """kombu's filesystem channel with whole-file writes and atomic claims (see the module)."""

    def _put(self, queue: str, payload: dict[str, Any], **kwargs: Any) -> None:  # type: ignore[override]  # as kombu's stub
        """Put one message on ``queue``: ``<ms>_<uuid>.<queue>.msg``, written whole, as kombu names it.

        Raises:
            ChannelError: the data folder cannot be written.
        """
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        try:
            _write_whole(self.data_folder_out, name, str_to_bytes(dumps(payload)))
        except OSError as exc:
            raise ChannelError(f"Cannot add file {name!r} to directory") from exc

    def _get(self, queue: str) -> dict[str, Any]:  # type: ignore[override]  # as kombu's stub
        """The oldest message of ``queue``, claimed by a rename no other consumer can also win.

        Raises:
            Empty: no message waits on ``queue``.
            ChannelError: a claimed file cannot be read.
        """
        queue_find = f"{queue}.msg"
        folder = Path(self.data_folder_in)
        claimed_dir = folder / CLAIMED_DIR
        claimed_dir.mkdir(exist_ok=True)
        for filename in sorted(os.listdir(folder)):
            if filename.partition(".")[2] != queue_find:
                continue
            claimed = claimed_dir / filename
            try:
                os.rename(folder / filename, claimed)
            except OSError:
                continue  # another consumer took it first (or it went meanwhile)
            try:
                payload = claimed.read_bytes()
            except OSError as exc:
                raise ChannelError(f"Cannot read file {filename!r} from queue.") from exc
            try:
                message: dict[str, Any] = loads(bytes_to_str(payload))
            except ValueError:
                self._set_aside(claimed, len(payload))
                continue
            self._done(claimed)
            return message
        raise Empty()

    def _done(self, claimed: Path) -> None:
        # kombu's option to keep processed messages is honoured; otherwise the file goes.
        if self.store_processed:
            os.replace(claimed, Path(self.processed_folder) / claimed.name)
        else:
            claimed.unlink(missing_ok=True)

    def _set_aside(self, claimed: Path, size: int) -> None:
        aside = Path(self.data_folder_in) / UNREADABLE_DIR
        aside.mkdir(exist_ok=True)
        os.replace(claimed, aside / claimed.name)
        log.error(
            "message file %s (%d bytes) is not a kombu message: set aside in %s, the worker goes on",
            claimed.name, size, aside,
        )  # fmt: skip

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str | None, queue: str) -> None:
        """Bind ``queue`` in the exchange's table: created whole (a link that only one binder
        wins), or updated in place under kombu's exclusive lock.

        Raises:
            ChannelError: the control folder cannot be written.
        """
        file = self._exchange_file(exchange)  # type: ignore[attr-defined]  # kombu 5.7 has it; its stubs do not
        self.control_folder.mkdir(exist_ok=True)
        entry = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        try:
            if _write_whole(self.control_folder, file.name, str_to_bytes(dumps([entry])), replace=False):
                return
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}") from exc
        # The table exists (written whole): kombu's own update, under its lock, is safe now.
        super()._queue_bind(exchange, routing_key, pattern, queue)


class Transport(filesystem.Transport):
    """kombu's filesystem transport on :class:`Channel`."""

    Channel = Channel
