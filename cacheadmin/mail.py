"""E-mail backends."""

from __future__ import annotations

import sys
from typing import Any

from django.core.mail.backends import console


class StderrConsoleEmailBackend(console.EmailBackend):
    """Django's console backend writing to stderr: commands print JSON on
    stdout for pipelines, and an owners' digest sent on the way must not mix in."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("stream", sys.stderr)
        super().__init__(*args, **kwargs)
