"""What the benchmark scripts' command lines share.

The scripts run as files (``python bench/NAME.py``) and put the project root on ``sys.path``
first, so ``bench`` is importable there as a namespace package: ``from bench.cli import counts``.
"""

from __future__ import annotations

import argparse


def counts(text: str) -> list[int]:
    """argparse type of a ``--sizes``-like option: comma-separated whole counts, e.g. ``1000,10000``
    -> ``[1000, 10000]`` (in the given order; ``_`` as in ``1_000_000`` allowed, empty parts skipped).

    Raises:
        argparse.ArgumentTypeError: a part is not an integer, or there is none (argparse
            answers it as a usage error naming the option: exit 2).
    """
    try:
        parsed = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes whole numbers, comma-separated, not {text!r}") from None
    if not parsed:
        raise argparse.ArgumentTypeError(f"takes at least one integer, not {text!r}")
    return parsed
