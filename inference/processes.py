"""A process is its pid and its start time.

A pid is reused once its process is gone; the pair (pid, start time) names one
process for the machine's uptime. Everything that records a process (an
engine's row, a file a process owns in a folder that several processes share)
keeps both, so a reused pid never makes a dead process look alive and a live
process is never taken for a dead one.

A process's *token* is that pair as text, ``"<pid>-<start>"``: safe in a file
name (digits and one hyphen, no underscore: prometheus-client splits its
multiprocess file names on ``_``).

Linux only: the start time is field 22 of ``/proc/PID/stat`` (``starttime``,
clock ticks after boot, proc(5)).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: ``"<pid>-<start>"``, or a bare ``"<pid>"`` (files written before tokens: alive while the pid is).
TOKEN_RE = re.compile(r"(?P<pid>[1-9][0-9]{0,9})(?:-(?P<start>[0-9]{1,20}))?")


def _stat_fields(pid: int) -> list[bytes] | None:
    """``/proc/PID/stat`` after ``(comm)``: field 3 (state) first, as proc(5) numbers them; None when unreadable."""
    try:
        # "pid (comm) state ...": comm may hold spaces and parentheses.
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_started(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (``/proc/PID/stat``
    field 22, ``starttime``, proc(5)), or None when no such process is readable.

    A pid is reused once its process is gone; the pair (pid, start time) names
    one process for the machine's uptime, so a recorded engine is never confused
    with whatever runs under its old pid now.
    """
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None  # field 22 is the 20th after "(comm)"
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int, started: int | None = None) -> bool:
    """True if a process with this pid exists and is not a zombie (it may
    belong to another user) and, when ``started`` is given, is the process
    that started then (:func:`process_started`): a reused pid is not it. A
    detached engine's parent may be an init that never reaps it: its zombie
    must not count as a running engine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return started is None
    fields = _stat_fields(pid)
    if fields is None:
        return started is None
    if fields[0] in (b"Z", b"X"):
        return False
    return started is None or process_started(pid) == started


#: pid → its token, for this process (a fork changes the pid, and so the token).
_tokens: dict[int, str] = {}


def process_token() -> str:
    """This process's token, ``"<pid>-<start>"`` (see the module's docstring).

    Called on every metric update in multiprocess mode (prometheus-client checks
    its process identifier each time), so it is a dictionary read after the first
    call of each pid.

    Raises:
        RuntimeError: the own start time cannot be read (no ``/proc``).
    """
    pid = os.getpid()
    token = _tokens.get(pid)
    if token is None:
        started = process_started(pid)
        if started is None:
            raise RuntimeError(f"/proc/{pid}/stat cannot be read: a process's files need its start time")
        token = _tokens[pid] = f"{pid}-{started}"
    return token


def token_parse(text: str) -> tuple[int, int | None] | None:
    """``(pid, start)`` of a token (``start`` None for a bare pid), or None when ``text`` is none."""
    match = TOKEN_RE.fullmatch(text)
    if match is None:
        return None
    start = match.group("start")
    return int(match.group("pid")), int(start) if start is not None else None


def token_alive(text: str) -> bool:
    """Whether the process a token names still runs: same pid, same start time.

    A bare pid (a file written before tokens) is alive while its pid is (the
    cautious answer: a live process's file is never taken for a dead one's).
    Text that is no token is alive too: it is no process's, so nothing may
    decide it is dead.
    """
    owner = token_parse(text)
    if owner is None:
        return True
    return pid_alive(*owner)
