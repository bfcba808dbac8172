"""Control-plane models, one module per area."""

from cacheadmin.models.api_tokens import ApiToken
from cacheadmin.models.audit import AuditEvent
from cacheadmin.models.engines import (
    Engine,
    EngineAlarm,
    EngineVerification,
    InferencePool,
    KvEventStream,
    ResidentSample,
)
from cacheadmin.models.eviction import (
    AccountingScan,
    EngineMetricsSample,
    EvictionAction,
    EvictionRun,
    Tier,
    TierUsageSample,
)
from cacheadmin.models.gateway import (
    AnswerRetirement,
    CacheLayer,
    CacheLayerSwitch,
    GatewayKey,
    GatewayStat,
    LayerNotPaying,
    NamespaceRouting,
    RoutingChange,
    RoutingEpoch,
    ShadowCheck,
    TenantGatewayPolicy,
)
from cacheadmin.models.jobs import ComparisonJob, ComparisonResult, JobStatus, PrewarmJob, PrewarmResult, RegistrationJob
from cacheadmin.models.model_versions import Adapter, ModelVersion
from cacheadmin.models.releases import IdempotencyKey, PrefixHeat, Release, ReleaseEvent
from cacheadmin.models.templates import PromptTemplate, TemplateStat
from cacheadmin.models.tenancy import (
    CacheNamespace,
    Residency,
    RetentionOwner,
    RetentionPolicy,
    SharedGroup,
    SharedGroupMembership,
    Tenant,
)

__all__ = [
    "AnswerRetirement",
    "CacheLayer",
    "CacheLayerSwitch",
    "GatewayKey",
    "GatewayStat",
    "LayerNotPaying",
    "NamespaceRouting",
    "RoutingChange",
    "RoutingEpoch",
    "ShadowCheck",
    "TenantGatewayPolicy",
    "AccountingScan",
    "EngineMetricsSample",
    "EvictionAction",
    "EvictionRun",
    "Tier",
    "TierUsageSample",
    "Adapter",
    "ApiToken",
    "AuditEvent",
    "CacheNamespace",
    "ComparisonJob",
    "ComparisonResult",
    "Engine",
    "EngineAlarm",
    "EngineVerification",
    "InferencePool",
    "KvEventStream",
    "ResidentSample",
    "IdempotencyKey",
    "JobStatus",
    "ModelVersion",
    "PrefixHeat",
    "PrewarmJob",
    "PrewarmResult",
    "PromptTemplate",
    "RegistrationJob",
    "Release",
    "ReleaseEvent",
    "Residency",
    "RetentionOwner",
    "RetentionPolicy",
    "SharedGroup",
    "SharedGroupMembership",
    "TemplateStat",
    "Tenant",
]
