#!/usr/bin/env python
"""Django's command-line utility for the KV cache control plane."""

import os
import sys


def main() -> None:
    """Run a management command (``python manage.py --help`` lists them).

    A setting the environment or ``VAR_DIR`` gets wrong (a weak or non-ASCII
    secret, a malformed number) is one line on stderr and exit 2, bad input
    like every command's, for every command: Django would otherwise print the
    settings module's traceback, with the one useful line at its end.
    """
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        settings.INSTALLED_APPS  # noqa: B018 - the attribute read loads (and checks) the settings
    except ImproperlyConfigured as exc:
        message = " ".join(str(exc).split())
        sys.stderr.write(f"manage.py: configuration error: {message}\n")
        sys.exit(2)
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
