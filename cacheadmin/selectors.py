"""Read queries for pages (and later the API), each with a fixed query count."""

from __future__ import annotations

from django.db.models import QuerySet

from cacheadmin.models import CacheNamespace, ComparisonJob, Engine, ModelVersion, PrewarmJob, SharedGroup


def model_version_list() -> QuerySet[ModelVersion]:
    """All model versions, newest first."""
    return ModelVersion.objects.order_by("-created_at", "-id")


def namespace_list() -> QuerySet[CacheNamespace]:
    """All namespaces with their version, tenant and owner (one query)."""
    return CacheNamespace.objects.select_related("model_version", "tenant", "group", "retention_owner", "policy").order_by(
        "-created_at", "-id"
    )


def shared_group_list() -> QuerySet[SharedGroup]:
    """Shared groups with their members (two queries)."""
    return SharedGroup.objects.prefetch_related("members").order_by("slug")


def engine_list(limit: int = 20) -> QuerySet[Engine]:
    """Recent engines with version and namespace (one query)."""
    return Engine.objects.select_related("model_version", "namespace__tenant", "namespace__group").order_by("-created_at", "-id")[
        :limit
    ]


def prewarm_job_list(limit: int = 20) -> QuerySet[PrewarmJob]:
    """Recent prewarm jobs (one query)."""
    return PrewarmJob.objects.select_related(
        "engine", "namespace__tenant", "namespace__group", "namespace__model_version"
    ).order_by("-created_at", "-id")[:limit]


def comparison_job_list(limit: int = 20) -> QuerySet[ComparisonJob]:
    """Recent comparison jobs (one query)."""
    return ComparisonJob.objects.select_related(
        "engine__model_version", "reference_engine", "namespace__tenant", "namespace__group", "namespace__model_version"
    ).order_by("-created_at", "-id")[:limit]
