"""Eviction runs and actions, accounting scans and tier usage samples."""

from __future__ import annotations

from rest_framework import serializers

from cacheadmin.api.schema import FreeFormObjectField
from cacheadmin.api.serializers.fields import IdField, RowSerializer, StrictBooleanField, StrictCharField, StrictFieldsMixin
from cacheadmin.api.serializers.scope import namespace_of_tenant
from cacheadmin.models import (
    AccountingScan,
    CacheNamespace,
    EvictionAction,
    EvictionRun,
    TierUsageSample,
)


class EvictionRunSerializer(RowSerializer):
    """An eviction run: a planned dry run until approved, then executed action by action."""

    class Meta:
        model = EvictionRun
        fields = (
            "id", "status", "trigger", "reason", "progress_done", "progress_total", "attempts", "created_at", "created_by",
            "approved_by", "approved_at", "auto_approved", "not_before", "started_at", "finished_at", "retry_at",
            "bytes_planned", "bytes_freed", "digest_sent_at", "error", "log",
        )  # fmt: skip


class EvictionActionSerializer(RowSerializer):
    """One action of an eviction run, recorded before it is done, with what its tier confirmed."""

    detail = FreeFormObjectField(
        read_only=True,
        help_text="by kind: `delete_entries` {entries: [[key, last access]]}, `set_residency` {residency}, "
        "`archive` {logical_bytes}; {} otherwise",
    )
    confirmation = FreeFormObjectField(read_only=True, help_text="what the tier answered when the action was confirmed")

    class Meta:
        model = EvictionAction
        fields = (
            "seq", "kind", "tier", "namespace", "storage_prefix", "engine", "detail", "reason", "bytes_planned",
            "bytes_freed", "status", "confirmation", "error", "started_at", "finished_at",
        )  # fmt: skip


class EvictionPlanSerializer(StrictFieldsMixin, serializers.Serializer):
    """What to plan: all namespaces (and orphan prefixes) or only some, and which to purge outright."""

    only = serializers.ListField(
        child=IdField(queryset=CacheNamespace.objects.all(), tenant_filter=namespace_of_tenant), required=False, max_length=1000,
        help_text="consider only these namespaces (default: all, and orphan prefixes)",
    )  # fmt: skip
    purge = serializers.ListField(
        child=IdField(queryset=CacheNamespace.objects.all(), tenant_filter=namespace_of_tenant), required=False, max_length=1000,
        help_text="drop these namespaces from every tier whatever the version policy says",
    )  # fmt: skip
    include_orphans = StrictBooleanField(default=True)
    reason = StrictCharField(max_length=2000, required=False, allow_blank=True, default="")


class AccountingScanSerializer(RowSerializer):
    """An accounting scan of every tier: prefixes seen, orphans, bytes."""

    class Meta:
        model = AccountingScan
        fields = (
            "id", "status", "created_at", "created_by", "started_at", "finished_at", "prefixes_seen", "orphan_prefixes",
            "bytes_total", "error",
        )  # fmt: skip


class TierUsageSampleSerializer(RowSerializer):
    """Usage of one (tier, storage prefix) at one scan; ``namespace`` is null for an orphan prefix."""

    class Meta:
        model = TierUsageSample
        fields = (
            "id", "scan", "namespace", "storage_prefix", "tier", "bytes", "allocated_bytes", "entries", "oldest_entry_at",
            "newest_entry_at", "last_access_at", "sampled_at",
        )  # fmt: skip
