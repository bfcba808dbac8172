"""Errors raised by the inference package, each with a message fit for a user."""

from __future__ import annotations


def storable_text(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udcff`` escapes: valid UTF-8.

    A file name that is not UTF-8 decodes (``os.fsdecode``) to lone surrogates,
    which no database column, JSON answer or log line can encode.
    """
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class CheckpointError(ValueError):
    """A checkpoint path or file cannot be fingerprinted (missing, outside the
    model roots, truncated, rewritten while hashed...). The message names the
    path and the problem, always as valid UTF-8 (see :func:`storable_text`)."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(storable_text(str(message)), *args)


class CheckpointOutsideRoots(CheckpointError):
    """The path does not exist, is not a directory, or resolves outside the
    model roots (a message for an operator; an API answer says less)."""


class EngineError(RuntimeError):
    """An engine did not start, did not answer, or answered with an error."""


class AdapterOutsideRoots(CheckpointOutsideRoots):
    """A LoRA adapter path that does not exist, is not a directory, or resolves
    outside the model roots."""
