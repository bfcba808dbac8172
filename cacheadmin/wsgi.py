"""WSGI entry point (gunicorn ``cacheadmin.wsgi:application``)."""

import gc
import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cacheadmin.settings")
application = get_wsgi_application()
# Everything loaded so far lives as long as the process: moving it out of the
# collector's reach spares each worker a full collection of it at exit (seconds
# of CPU per worker on a busy 2-core host, delaying a graceful stop) and keeps
# pages shared copy-on-write after gunicorn forks (with --preload).
gc.freeze()
