"""Prometheus metrics of the control plane, its workers, the KV-event consumer
and the gateway. :mod:`cacheadmin.metrics.catalogue` names every one."""
