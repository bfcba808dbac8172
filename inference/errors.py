"""Errors raised by the inference package, each with a message fit for a user."""

from __future__ import annotations

from typing import ClassVar

#: Exit statuses of the management commands (0 success; 1 a check the command ran failed).
EXIT_BAD_INPUT = 2
#: A conflict with what exists (a label registered with another identity) or a backend that cannot be reached.
EXIT_CONFLICT = 3
#: The control plane refused the action in the current state.
EXIT_REFUSED = 4


class ControlPlaneError(Exception):
    """Base of every error a caller is told about; the class says how each surface reports it.

    Modelled on Zulip's ``JsonableError``: the REST API's error handler and the
    management commands read these class attributes, so a new error class needs
    no entry in any table.

    Attributes:
        code: the API envelope's ``error.code`` (snake_case, stable).
        http_status: the API answer's status: 400 bad input, 409 refused or in
            conflict with the current state, 503 a backend that cannot be reached.
        exit_code: the management command's exit status (``EXIT_*`` above).
    """

    code: ClassVar[str] = "invalid"
    http_status: ClassVar[int] = 400
    exit_code: ClassVar[int] = EXIT_BAD_INPUT

    def fields(self) -> dict[str, list[str]] | None:
        """The API envelope's ``error.fields`` (field → problems), or None when no one field is at fault."""
        return None

    def api_message(self) -> str:
        """The API envelope's ``error.message`` (default: the message itself).

        A subclass whose message is for an operator at the server (paths, the
        server's directories) says less to a remote caller here."""
        return str(self)


class InvalidField(ControlPlaneError, ValueError):
    """One input field's value is refused; ``field`` names it (400 ``invalid``
    with ``{field: [problem]}``, exit 2). The message is ``"<field>: <problem>"``,
    as a validation error's is."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem

    def fields(self) -> dict[str, list[str]]:
        """``{field: [problem]}``."""
        return {self.field: [self.problem]}


class Refused(ControlPlaneError, ValueError):
    """The control plane refuses the action in the current state; the message says why (409, exit 4)."""

    code = "refused"
    http_status = 409
    exit_code = EXIT_REFUSED


def storable_text(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udcff`` escapes: valid UTF-8.

    A file name that is not UTF-8 decodes (``os.fsdecode``) to lone surrogates,
    which no database column, JSON answer or log line can encode.
    """
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class CheckpointError(ControlPlaneError, ValueError):
    """A checkpoint path or file cannot be fingerprinted (missing, outside the
    model roots, truncated, rewritten while hashed...). The message names the
    path and the problem, always as valid UTF-8 (see :func:`storable_text`).
    Bad input: 400 ``bad_checkpoint``, exit 2."""

    code = "bad_checkpoint"

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(storable_text(str(message)), *args)


class CheckpointOutsideRoots(CheckpointError):
    """The path does not exist, is not a directory, or resolves outside the
    model roots (400 ``invalid`` on ``path``, exit 2). The message is for an
    operator; the API answer says less (details would map the server's
    filesystem)."""

    code = "invalid"
    #: The request field at fault, and what a remote caller is told about it.
    field: ClassVar[str] = "path"
    public_problem: ClassVar[str] = "not a checkpoint directory inside the model roots"
    #: Set for a folder refused for one of its own entries: that entry, relative to the folder the caller
    #: named, and why (the caller's own names; never where a link leads).
    public_detail: str | None = None

    def _public(self) -> str:
        if self.public_detail is None:
            return self.public_problem
        return self.public_detail

    def fields(self) -> dict[str, list[str]]:
        """``{field: [what the caller may be told]}``."""
        return {self.field: [self._public()]}

    def api_message(self) -> str:
        """``"<field>: <problem>"``: nothing about the server's directories."""
        return f"{self.field}: {self._public()}"


class EngineError(RuntimeError):
    """An engine did not start, did not answer, or answered with an error."""


class AdapterOutsideRoots(CheckpointOutsideRoots):
    """A LoRA adapter path that does not exist, is not a directory, or resolves
    outside the model roots (400 ``invalid`` on ``adapters``, exit 2)."""

    field = "adapters"
    public_problem = "not a directory inside the model roots"
