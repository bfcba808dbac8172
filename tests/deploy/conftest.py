"""The real promtool for the deploy/ tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def promtool() -> str:
    """Path of the real promtool; the test fails (never skips) without it."""
    path = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
    if path is None:
        pytest.fail("promtool not found: scripts/setup --test installs Debian's prometheus package, which provides it")
    return path
