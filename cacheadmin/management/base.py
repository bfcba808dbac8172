"""Shared behaviour of the control plane's management commands.

Exit codes: 0 success; 1 the command ran but its check failed (e.g. the demo
did not catch the unsafe upgrade); 2 bad input (usage, path, checkpoint),
reported as one line on stderr.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

from django.core.management.base import BaseCommand, CommandError, CommandParser

EXIT_BAD_INPUT = 2


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
        return parser

    def bad_input(self, message: str) -> CommandError:
        """A CommandError that exits 2 with ``message`` on one line."""
        one_line = " ".join(message.split())
        # Escape control characters from user input (paths) so they cannot drive the terminal.
        printable = "".join(c if c.isprintable() else repr(c)[1:-1] for c in one_line)
        return CommandError(printable, returncode=EXIT_BAD_INPUT)
