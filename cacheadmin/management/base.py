"""Shared behaviour of the control plane's management commands.

Exit codes: 0 success; 1 the command ran but its check failed (e.g. the demo
did not catch the unsafe upgrade); 2 bad input (usage, path, checkpoint);
3 a conflict with what exists or a backend that cannot be reached; 4 refused
in the current state. Errors are one line on stderr; a service error's exit
code is its class's ``exit_code`` (:class:`inference.errors.ControlPlaneError`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pwd
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError

from cacheadmin.forms import MAX_ID
from inference.errors import EXIT_BAD_INPUT, EXIT_CONFLICT, ControlPlaneError
from inference.identity import LayoutOptions
from inference.strict_json import loads_unique


def cli_actor() -> str:
    """Who a management command acts as in the audit trail: ``cli:<OS user>``, e.g. ``cli:alice``.

    The user is the process's real uid looked up in the password database (``pwd``), not
    ``$USER``/``$LOGNAME`` (``getpass.getuser()`` reads those first, and anyone can set them);
    a uid the database does not name is recorded as ``cli:uid<N>``. The commands take no API
    token (they run with the database's own credentials), so the OS account is what names the
    person: a bare ``cli`` said nothing about who did it.
    """
    uid = os.getuid()
    try:
        return f"cli:{pwd.getpwuid(uid).pw_name}"
    except KeyError:  # a container's uid with no /etc/passwd entry
        return f"cli:uid{uid}"


class OneLineParser(CommandParser):
    """An argument parser whose usage errors are one stderr line and exit 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(EXIT_BAD_INPUT)


class ControlPlaneCommand(BaseCommand):
    """Base command: one-line errors, exit 2 on bad input."""

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        # BaseCommand builds a CommandParser with no hook for another class;
        # OneLineParser only overrides error(), so switching the class is safe.
        parser.__class__ = OneLineParser
        for action in parser._actions:  # subcommands were built before the switch
            if isinstance(action, argparse._SubParsersAction):
                for subparser in action.choices.values():
                    subparser.__class__ = OneLineParser
        return parser

    def execute(self, *args: Any, **options: Any) -> Any:
        """Run the command; a service error is one line and its class's exit
        code, a service's ValidationError (e.g. a reason with invisible
        characters) is bad input (exit 2); never a traceback."""
        try:
            return super().execute(*args, **options)
        except ControlPlaneError as exc:
            raise self.failed(str(exc), exc.exit_code) from exc
        except DatabaseError as exc:
            # A database that is not migrated yet (a fresh VAR_DIR or DATABASE_URL), or not reachable:
            # one line saying what to do, never a traceback.
            detail = " ".join(str(exc).split())
            if _migrations_pending():
                raise self.failed(f"the database is not migrated ({detail}): run manage.py migrate", EXIT_CONFLICT) from exc
            raise self.failed(f"the database cannot be used: {detail}", EXIT_CONFLICT) from exc
        except ValidationError as exc:
            problems = (
                [f"{field}: {messages[0]}" for field, messages in exc.message_dict.items()]
                if hasattr(exc, "error_dict")
                else exc.messages
            )
            raise self.bad_input("; ".join(problems)) from exc

    def bad_input(self, message: str) -> CommandError:
        """A CommandError that exits 2 with ``message`` on one line."""
        return self.failed(message, EXIT_BAD_INPUT)

    @staticmethod
    def failed(message: str, exit_code: int) -> CommandError:
        """A CommandError that exits ``exit_code`` with ``message`` on one printable line."""
        one_line = " ".join(message.split())
        # Escape control characters from user input (paths) so they cannot drive the terminal.
        printable = "".join(c if c.isprintable() else repr(c)[1:-1] for c in one_line)
        return CommandError(printable, returncode=exit_code)


def _migrations_pending() -> bool:
    """True when the default database lacks migrations this code has (False when it cannot be read)."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    try:
        executor = MigrationExecutor(connection)
        return bool(executor.migration_plan(executor.loader.graph.leaf_nodes()))
    except DatabaseError:
        return False


def _ascii_int(value: str) -> int:
    """An integer in ASCII digits (int() also takes other scripts' digits: "١٠" is 10)."""
    if not (value.isascii() and value.strip().lstrip("+-").isdigit()):
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer")
    return int(value)


def int_within(low: int, high: int) -> Callable[[str], int]:
    """argparse type: an integer in ASCII digits within ``low..high`` (inclusive)."""

    def parse(value: str) -> int:
        number = _ascii_int(value)
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{number} is not within {low}..{high}")
        return number

    parse.__name__ = f"integer {low}..{high}"  # argparse names the type in its error
    return parse


def float_within(low: float, high: float) -> Callable[[str], float]:
    """argparse type: a decimal number in ASCII (``2``, ``0.5``, ``1e1``) within
    ``low..high`` (inclusive); ``nan``, ``inf`` and other scripts' digits are refused."""

    def parse(value: str) -> float:
        text = value.strip()
        try:
            if not text.isascii():
                raise ValueError(text)
            number = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
        if not low <= number <= high:  # also false for nan
            raise argparse.ArgumentTypeError(f"{text} is not within {low:g}..{high:g}")
        return number

    parse.__name__ = f"number {low:g}..{high:g}"  # argparse names the type in its error
    return parse


def positive_int(value: str) -> int:
    """argparse type: a positive integer in ASCII digits (int() also takes other scripts' digits)."""
    number = _ascii_int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number} is not a positive integer")
    if number > MAX_ID:
        # Beyond signed 64-bit no id, byte count or age can be stored.
        raise argparse.ArgumentTypeError(f"{value.strip()} is larger than {MAX_ID}")
    return number


def _json_object(value: str) -> dict[str, Any]:
    """argparse type: a JSON object (``--hf-overrides``)."""
    try:
        parsed = loads_unique(value)
    except (ValueError, RecursionError) as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of config keys")
    return parsed


def add_layout_arguments(parser: CommandParser) -> None:
    """The engine layout options shared by commands that fingerprint a path
    (each one a field of the identity's ``layout``; see :mod:`inference.layout`)."""
    d = LayoutOptions.defaults()
    parser.add_argument("--dtype", default=d["dtype"], help="engine dtype; auto = as the engine resolves it on this platform")
    parser.add_argument("--kv-cache-dtype", default=d["kv_cache_dtype"], help="KV cache dtype; auto = the dtype")
    parser.add_argument("--block-size", type=positive_int, default=d["block_size"], help="KV block size in tokens")
    parser.add_argument(
        "--tensor-parallel-size", type=positive_int, default=d["tensor_parallel_size"], help="GPUs one layer is split across"
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        type=positive_int,
        default=d["pipeline_parallel_size"],
        help="stages the layers are split into",
    )
    parser.add_argument("--quantization", default=d["quantization"], help="vLLM --quantization method; default: none")
    parser.add_argument(
        "--kv-connector", default=d["kv_connector"], help="KV connector of the persistent tier, e.g. ExampleConnector"
    )
    parser.add_argument(
        "--kv-storage-format", default=d["kv_storage_format"], help="the connector's storage format; default: its engine build"
    )
    parser.add_argument(
        "--kv-cache-layout", default=d["kv_cache_layout"], help="VLLM_KV_CACHE_LAYOUT (NHD, HND, LBNHC…); auto = the engine's"
    )
    parser.add_argument(
        "--attention-backend", default=d["attention_backend"], help="vLLM --attention-backend; auto = the engine's"
    )
    parser.add_argument("--hf-overrides", type=_json_object, default=d["hf_overrides"], help="vLLM --hf-overrides, a JSON object")
    parser.add_argument(
        "--max-model-len", type=positive_int, default=d["max_model_len"], help="context length (counts for LongRoPE models)"
    )
    parser.add_argument("--model-impl", default=d["model_impl"], help="vLLM --model-impl: auto, vllm, transformers, terratorch")
    parser.add_argument("--disable-sliding-window", action="store_true", help="full attention instead of the model's window")


def layout_from_options(opts: dict[str, Any]) -> LayoutOptions:
    """LayoutOptions from parsed :func:`add_layout_arguments` options.

    Raises:
        inference.errors.CheckpointError: an invalid value or combination.
    """
    return LayoutOptions(**{name: opts[name] for name in LAYOUT_OPTION_NAMES})


#: Every LayoutOptions field, each with its CLI flag (``--kebab-case``) and API key.
LAYOUT_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(LayoutOptions))


def add_adapter_argument(parser: CommandParser) -> None:
    """``--adapter NAME=PATH`` (repeatable): LoRA adapters, identified by content."""
    parser.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=PATH", help="LoRA adapter by name and directory (repeatable)"
    )


def adapters_from_options(command: ControlPlaneCommand, opts: dict[str, Any]) -> dict[str, str]:
    """``--adapter`` values as name → path.

    Raises:
        CommandError: (exit 2) a value without ``=``, an empty side, or a name given twice.
    """
    adapters: dict[str, str] = {}
    for spec in opts["adapter"]:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise command.bad_input(f"--adapter {spec!r}: expected NAME=PATH")
        if name in adapters:
            raise command.bad_input(f"--adapter {name!r} given twice")
        adapters[name] = path
    return adapters


def get_or_bad_input(command: ControlPlaneCommand, model: type, pk: int | str, what: str, **lookup: Any) -> Any:
    """The row with ``pk`` (or ``lookup``), or a one-line bad-input error naming it."""
    row = model.objects.filter(**(lookup or {"pk": pk})).first()
    if row is None:
        raise command.bad_input(f"no {what} {pk!r}")
    return row
