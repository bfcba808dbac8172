#!/usr/bin/env python
"""Django's command-line utility for the KV cache control plane."""

import os
import sys


def main() -> None:
    """Run a management command (``python manage.py --help`` lists them)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
