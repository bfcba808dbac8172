"""Eviction runs: plan (dry run), approve, execute across every tier, confirm.

Version policy, per served model: the namespaces of active versions stay hot
(engine memory and hot tiers); the model versions of the served model are
ranked (active first, then newest first) and a namespace of a version within
the first ``versions_kept`` stays hot
(a version registered but not yet routed is being prepared for a release),
the next ``cold_versions_kept`` are demoted to the cold tier (archived, not
readable by engines, restorable for rollback), and older ones are dropped.
Retired versions are never hot; superseded shared-group generations are
dropped (their salts are no longer served). Each namespace is judged by its
own policy; a pinned (held) namespace is never touched.

Within a hot namespace, entries leave by size-aware TTL (max age since last
hit, shorter for large entries) and then, over the byte budget, by LRU-K
where the tier keeps access history (the Redis tier) or by last access where
it does not (the disk tier: atime/mtime, see ``DiskTier.access_time_source``).

Execution records each action as ``running`` before touching a tier and
``done`` after the tier confirmed; every action is idempotent, so a run
resumed after a killed worker redoes at most the action it was in. A purge
counts only when every tier confirmed: hot tiers report the prefix gone, the
cold tier the archive gone, and every engine serving the namespace was reset
and then probed with a prompt warmed before, answering zero cached tokens.
"""

from __future__ import annotations

from cacheadmin.services.eviction.approve import eviction_run_approve
from cacheadmin.services.eviction.common import EvictionNotConfirmed, EvictionRefused
from cacheadmin.services.eviction.execute import EvictionRunner, eviction_run_execute
from cacheadmin.services.eviction.notify import eviction_digest_send
from cacheadmin.services.eviction.plan import eviction_plan, namespace_targets, version_ranks
from cacheadmin.services.eviction.resume import eviction_runs_resume_due, eviction_sweep

__all__ = [
    "EvictionNotConfirmed",
    "EvictionRefused",
    "EvictionRunner",
    "eviction_digest_send",
    "eviction_plan",
    "eviction_run_approve",
    "eviction_run_execute",
    "eviction_runs_resume_due",
    "eviction_sweep",
    "namespace_targets",
    "version_ranks",
]
