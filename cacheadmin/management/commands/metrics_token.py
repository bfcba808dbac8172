"""``python manage.py metrics_token``: print the bearer token of every ``/metrics`` endpoint.

The token is ``METRICS_TOKEN`` when set, else a secret kept in ``VAR_DIR``
(created on first use). Put it in a file Prometheus reads
(``authorization: {credentials_file: ...}``), readable by its owner only:
``(umask 077; manage.py metrics_token > /etc/prometheus/kvcp-token)``. Exit
codes: 0 printed; 2 the token is refused (shorter than 32 characters, or a
character outside visible ASCII: an HTTP header carries it), as every command
refuses to start then.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from cacheadmin.management.base import ControlPlaneCommand


class Command(ControlPlaneCommand):
    help = __doc__.split("\n\n", 1)[1].replace("\n", " ")

    def handle(self, *args: Any, **opts: Any) -> None:
        self.stdout.write(settings.METRICS_TOKEN)
