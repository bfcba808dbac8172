"""``cli.md``: every management command of the control plane, from its argparse parser.

Each command's parser is built as ``manage.py`` builds it
(``BaseCommand.create_parser``) and read through its actions: subcommands,
positional arguments, options, choices, types and defaults come from the
parser objects, never from ``--help`` text (whose wrapping follows the
terminal's width). Django's options that every command has are listed once.
"""

from __future__ import annotations

import argparse
import enum
from collections.abc import Iterator
from dataclasses import dataclass

from django.core.management import get_commands, load_command_class
from django.core.management.base import BaseCommand

from cacheadmin.docs_reference.markdown import GENERATED_NOTE, code, page, rst_to_markdown, table
from inference.errors import EXIT_BAD_INPUT, EXIT_CONFLICT, EXIT_REFUSED

#: The Django app whose commands are documented.
APP = "cacheadmin"
#: Options Django gives every command (``BaseCommand.create_parser``): listed once, at the top.
COMMON_DESTS = frozenset(
    {"help", "version", "verbosity", "settings", "pythonpath", "traceback", "no_color", "force_color", "skip_checks"}
)


@dataclass(frozen=True)
class CommandParser:
    """A command's words (``("engine", "start")``), its help, and its parser."""

    words: tuple[str, ...]
    help: str
    parser: argparse.ArgumentParser


def project_commands() -> list[str]:
    """The names of the project's management commands, sorted."""
    return sorted(name for name, app in get_commands().items() if app == APP)


def command_parser(name: str) -> tuple[BaseCommand, argparse.ArgumentParser]:
    """The command ``name`` and its parser, built as ``manage.py`` builds it."""
    command = load_command_class(APP, name)
    assert isinstance(command, BaseCommand)
    return command, command.create_parser("manage.py", name)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def walk(name: str) -> Iterator[CommandParser]:
    """The command and each of its subcommands (depth first, in the order the command declares them)."""
    command, parser = command_parser(name)

    def visit(words: tuple[str, ...], text: str, p: argparse.ArgumentParser) -> Iterator[CommandParser]:
        yield CommandParser(words, text, p)
        sub = _subparsers(p)
        if sub is None:
            return
        helps = {c.dest: c.help or "" for c in sub._choices_actions}
        for word, child in sub.choices.items():
            yield from visit((*words, word), helps.get(word, ""), child)

    yield from visit((name,), str(command.help or ""), parser)


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's own arguments: not help, not Django's common options, not subcommand dispatch."""
    return [
        a
        for a in parser._actions
        if a.dest not in COMMON_DESTS and not isinstance(a, argparse._SubParsersAction) and a.help is not argparse.SUPPRESS
    ]


def missing_help() -> list[str]:
    """Commands, subcommands and arguments without help text, as ``"engine start --name"``; sorted."""
    out: list[str] = []
    for name in project_commands():
        for entry in walk(name):
            where = " ".join(entry.words)
            if not entry.help.strip():
                out.append(where)
            for action in arguments(entry.parser):
                if not (action.help or "").strip():
                    out.append(f"{where} {_argument_name(action)}")
    return sorted(out)


def _argument_name(action: argparse.Action) -> str:
    if action.option_strings:
        return ", ".join(action.option_strings)
    metavar = action.metavar if isinstance(action.metavar, str) else action.dest
    return metavar


def _value(action: argparse.Action) -> str:
    flags = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._CountAction, argparse._HelpAction)
    if isinstance(action, flags + (argparse._VersionAction,)):
        return "flag"
    if isinstance(action, argparse._StoreConstAction | argparse._AppendConstAction):
        return "flag"
    if action.choices is not None:
        text = "one of " + ", ".join(code(str(c)) for c in action.choices)
    elif action.type is not None:
        text = getattr(action.type, "__name__", type(action.type).__name__).replace("_", " ")
    else:
        text = "text"
    if isinstance(action.metavar, str) and action.option_strings:
        text = f"{code(action.metavar)}: {text}"
    repeat = isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+")
    if repeat:
        text += " (repeatable)" if isinstance(action, argparse._AppendAction) else " (one or more)"
    if isinstance(action.nargs, int) and action.nargs > 1:
        text += f" (×{action.nargs})"
    return text


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value is False or value is argparse.SUPPRESS or value == [] or value == "":
        return ""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return ""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, tuple | list):
        return ", ".join(code(str(v)) for v in value)
    return code(str(value))


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:
        text = parser._get_formatter()._expand_help(action)
    required = action.required and bool(action.option_strings)
    return ("required. " if required else "") + rst_to_markdown(text)


def _section(entry: CommandParser) -> list[str]:
    level = "#" * min(len(entry.words) + 1, 4)
    lines = [f"{level} manage.py {' '.join(entry.words)}", "", rst_to_markdown(entry.help.strip()), ""]
    sub = _subparsers(entry.parser)
    if sub is not None:
        helps = {c.dest: c.help or "" for c in sub._choices_actions}
        lines += table(("Subcommand", "What it does"), [(code(w), rst_to_markdown(helps.get(w, ""))) for w in sub.choices])
        lines.append("")
    args = arguments(entry.parser)
    if args:
        rows = [(code(_argument_name(a)), _value(a), _default(a), _help(entry.parser, a)) for a in args]
        lines += table(("Argument", "Value", "Default", "Help"), rows)
        lines.append("")
    return lines


def render() -> str:
    """The page's Markdown."""
    names = project_commands()
    _, parser = command_parser(names[0])
    common = [a for a in parser._actions if a.dest in COMMON_DESTS]
    lines = [
        GENERATED_NOTE,
        "",
        "# Command line",
        "",
        "Every command runs as `.venv/bin/python manage.py COMMAND ...` from the project folder. Errors are one "
        f"line on stderr; the exit status is 0 on success, 1 when the command ran a check that failed, "
        f"{EXIT_BAD_INPUT} on bad input, {EXIT_CONFLICT} on a conflict or a backend that cannot be reached, "
        f"{EXIT_REFUSED} when the control plane refuses the action in its current state "
        "(each error's code is in [Errors](errors.md)).",
        "",
    ]
    lines += table(("Command", "What it does"), [(code(n), rst_to_markdown(str(command_parser(n)[0].help or ""))) for n in names])
    lines += ["", "## Options of every command", ""]
    rows = [(code(", ".join(a.option_strings)), _value(a), _default(a), _help(parser, a)) for a in common]
    lines += table(("Argument", "Value", "Default", "Help"), rows)
    lines.append("")
    for name in names:
        for entry in walk(name):
            lines += _section(entry)
    return page(lines)
