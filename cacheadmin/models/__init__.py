"""Control-plane models, one module per area."""

from cacheadmin.models.api_tokens import ApiToken
from cacheadmin.models.audit import AuditEvent
from cacheadmin.models.engines import Engine
from cacheadmin.models.jobs import ComparisonJob, ComparisonResult, JobStatus, PrewarmJob, PrewarmResult, RegistrationJob
from cacheadmin.models.model_versions import ModelVersion
from cacheadmin.models.tenancy import CacheNamespace, RetentionOwner, RetentionPolicy, Tenant

__all__ = [
    "ApiToken",
    "AuditEvent",
    "CacheNamespace",
    "ComparisonJob",
    "ComparisonResult",
    "Engine",
    "JobStatus",
    "ModelVersion",
    "PrewarmJob",
    "PrewarmResult",
    "RegistrationJob",
    "RetentionOwner",
    "RetentionPolicy",
    "Tenant",
]
