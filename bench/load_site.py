"""Settings of ``bench/load.py``'s server: the control plane's own, with one URL
more (:mod:`bench.load_urls`, the bare baseline views)."""

from cacheadmin.settings import *  # noqa: F403 - the control plane's settings, unchanged

ROOT_URLCONF = "bench.load_urls"
