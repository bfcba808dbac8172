"""API routes under /api/."""

from django.urls import include, path, re_path
from rest_framework.routers import DefaultRouter

from cacheadmin.api import engine_views, gateway_views, inference_pool_views, release_views, template_views, views


class IdRouter(DefaultRouter):
    """Detail routes take ids of at most 18 digits: anything longer is not a
    row id (signed 64-bit) and gets a 404 instead of reaching the database."""

    def get_lookup_regex(self, viewset: type, lookup_prefix: str = "") -> str:
        return f"(?P<{lookup_prefix}pk>[0-9]{{1,18}})"

    def get_api_root_view(self, api_urls: object = None) -> object:
        """``GET /api/`` lists the routes outside the registry too (identity diff, orphans, schema, docs)."""
        root = {prefix: self.routes[0].name.format(basename=basename) for prefix, _viewset, basename in self.registry}
        root.update(ROOT_EXTRAS)
        return self.APIRootView.as_view(api_root_dict=root)


#: Routes of ``urlpatterns`` below that ``GET /api/`` lists beside the viewsets: name in the listing → URL name.
ROOT_EXTRAS = {
    "identity-diff": "identity-diff", "orphans": "orphans", "schema": "api-schema", "docs": "api-docs",
    "gateway-layers": "gateway-layers", "gateway-explain": "gateway-explain", "gateway-figures": "gateway-figures",
    "cache-lookup": "cache-lookup",
    "semantic-cache-invalidate": "semantic-cache-invalidate",
}  # fmt: skip


# A missing trailing slash is not worth a 301 (which many HTTP clients turn
# into a GET, dropping a POST body): both forms route.
router = IdRouter()
router.trailing_slash = "/?"
router.register("model-versions", views.ModelVersionViewSet, basename="model-version")
router.register("tenants", views.TenantViewSet, basename="tenant")
router.register("shared-groups", views.SharedGroupViewSet, basename="shared-group")
router.register("adapters", views.AdapterViewSet, basename="adapter")
router.register("retention-owners", views.RetentionOwnerViewSet, basename="retention-owner")
router.register("namespaces", views.CacheNamespaceViewSet, basename="namespace")
router.register("engines", engine_views.EngineViewSet, basename="engine")
router.register("engine-alarms", engine_views.EngineAlarmViewSet, basename="engine-alarm")
router.register("inference-pools", inference_pool_views.InferencePoolViewSet, basename="inference-pool")
router.register("prewarm-jobs", views.PrewarmJobViewSet, basename="prewarm-job")
router.register("comparison-jobs", views.ComparisonJobViewSet, basename="comparison-job")
router.register("registration-jobs", views.RegistrationJobViewSet, basename="registration-job")
router.register("eviction-runs", views.EvictionRunViewSet, basename="eviction-run")
router.register("accounting-scans", views.AccountingScanViewSet, basename="accounting-scan")
router.register("tier-usage", views.TierUsageViewSet, basename="tier-usage")
router.register("engine-metrics", views.EngineMetricsViewSet, basename="engine-metrics")
router.register("releases", release_views.ReleaseViewSet, basename="release")
router.register("audit-events", views.AuditEventViewSet, basename="audit-event")
router.register("gateway-keys", gateway_views.GatewayKeyViewSet, basename="gateway-key")
router.register("shadow-checks", gateway_views.ShadowCheckViewSet, basename="shadow-check")
router.register("prompt-templates", template_views.PromptTemplateViewSet, basename="prompt-template")

urlpatterns = [
    re_path(r"^identity-diff/?$", views.IdentityDiffView.as_view(), name="identity-diff"),
    re_path(r"^orphans/?$", views.OrphansView.as_view(), name="orphans"),
    re_path(r"^schema/?$", views.ApiSchemaView.as_view(), name="api-schema"),
    re_path(r"^gateway/layers/?$", gateway_views.GatewayLayersView.as_view(), name="gateway-layers"),
    re_path(r"^gateway/explain/?$", gateway_views.GatewayExplainView.as_view(), name="gateway-explain"),
    re_path(r"^gateway/figures/?$", gateway_views.GatewayFiguresView.as_view(), name="gateway-figures"),
    re_path(r"^cache/lookup/?$", gateway_views.CacheLookupView.as_view(), name="cache-lookup"),
    re_path(r"^semantic-cache/invalidate/?$", gateway_views.SemanticInvalidateView.as_view(), name="semantic-cache-invalidate"),
    re_path(r"^docs/?$", views.ApiDocsView.as_view(url_name="api:api-schema"), name="api-docs"),
    path("", include(router.urls)),
]
