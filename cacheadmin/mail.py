"""E-mail backends, and what the file backend wrote.

Owners' digests (:mod:`cacheadmin.services.eviction.notify`) go through Django's mail
backend (``EMAIL_BACKEND``). By default that is Django's file backend
(``django.core.mail.backends.filebased.EmailBackend``) writing into ``EMAIL_FILE_PATH``
(``VAR_DIR/mail/``): one file per connection, each message followed by a line of 79
``-`` (Django 5.2 ``core/mail/backends/filebased.py`` and ``console.py``
``write_message``). Set ``EMAIL_BACKEND=django.core.mail.backends.smtp.EmailBackend`` and
``EMAIL_HOST`` etc. for real mail.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.mail.backends import console

#: Django's file backend, the default ``EMAIL_BACKEND``.
FILE_BACKEND = "django.core.mail.backends.filebased.EmailBackend"
#: The line Django's console and file backends write after each message.
MESSAGE_END = "-" * 79


class StderrConsoleEmailBackend(console.EmailBackend):
    """Django's console backend writing to stderr: commands print JSON on
    stdout for pipelines, and an owners' digest sent on the way must not mix in."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("stream", sys.stderr)
        super().__init__(*args, **kwargs)


def mail_count(folder: Path | None = None) -> int:
    """How many messages Django's file backend has written into ``folder`` (default
    ``EMAIL_FILE_PATH``), counted by the line it ends each one with.

    Counted rather than dated: two connections in the same second may share a file name
    (the time to the second and the backend object's id), and the later one appends to it.
    A run counts before and after (:func:`digests_report`).

    Returns:
        The number of messages (0 when the folder does not exist).
    """
    folder = Path(settings.EMAIL_FILE_PATH) if folder is None else folder
    if not folder.is_dir():
        return 0
    count = 0
    for path in folder.iterdir():
        if path.is_file():
            count += sum(1 for line in path.read_text(errors="replace").splitlines() if line == MESSAGE_END)
    return count


def digests_report(before: int) -> str:
    """One line for a run's progress: how many owners' digests were written since :func:`mail_count`
    gave ``before``, and where.

    Returns:
        ``"owners' e-mail digests: N written to FOLDER/ (EMAIL_BACKEND filebased)"`` with the file
        backend; with another backend, where they went (it cannot be counted from here).
    """
    backend = settings.EMAIL_BACKEND
    if backend != FILE_BACKEND:
        return f"owners' e-mail digests: sent through EMAIL_BACKEND {backend}"
    folder = Path(settings.EMAIL_FILE_PATH)
    return f"owners' e-mail digests: {mail_count(folder) - before} written to {folder}/ (EMAIL_BACKEND filebased)"
