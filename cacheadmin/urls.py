"""URL configuration."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from django.views.decorators.http import require_http_methods, require_safe

from cacheadmin import views, views_dashboard, views_engine, views_templates
from cacheadmin.metrics import views as metrics_views

# Pages that only read answer GET and HEAD (require_safe): another method is a
# 405 rather than the page, so a form posted to the wrong address says so.
urlpatterns = [
    path("", views_dashboard.dashboard, name="dashboard"),
    path("healthz", views.health, name="health"),
    path("metrics", metrics_views.metrics, name="metrics"),
    # Every active account signs in here (the admin site's login takes staff only).
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("fragments/live", views_dashboard.live_fragment, name="live-fragment"),
    path("fragments/dashboard/<slug:name>", views_dashboard.section_fragment, name="dashboard-section"),
    path("fragments/cleanup-preview", views_dashboard.cleanup_preview, name="dashboard-cleanup-preview"),
    path("dashboard/charts.json", views_dashboard.charts_json, name="dashboard-charts"),
    path("schedules/<slug:name>/", views_dashboard.schedule_edit, name="schedule-edit"),
    path("namespaces/", views_dashboard.namespace_list, name="namespace-list"),
    path("model-versions/<int:pk>/", require_safe(views.model_version_detail), name="model-version-detail"),
    path("prewarm-jobs/<int:pk>/", require_safe(views.prewarm_job_detail), name="prewarm-job-detail"),
    path("engines/start/", require_http_methods(["GET", "HEAD", "POST"])(views_engine.engine_start_page), name="engine-start"),
    path("engines/<int:pk>/", require_safe(views_engine.engine_detail), name="engine-detail"),
    path("engines/<int:pk>/live", require_safe(views_engine.engine_live), name="engine-live"),
    path("engines/<int:pk>/<str:verb>/", views_engine.engine_action, name="engine-action"),
    path("prompt-templates/", views_templates.prompt_template_list, name="prompt-template-list"),
    path("prompt-templates/<int:pk>/", require_safe(views_templates.prompt_template_detail), name="prompt-template-detail"),
    path("prompt-templates/<int:pk>/live", require_safe(views_templates.prompt_template_live), name="prompt-template-live"),
    path("prompt-templates/<int:pk>/delete", views_templates.prompt_template_remove, name="prompt-template-delete"),
    path("comparison-jobs/<int:pk>/", require_safe(views.comparison_job_detail), name="comparison-job-detail"),
    path("namespaces/<int:pk>/", require_safe(views.namespace_detail), name="namespace-detail"),
    path("eviction-runs/<int:pk>/", views.eviction_run_detail, name="eviction-run-detail"),
    path("eviction-runs/plan", views.eviction_run_plan, name="eviction-run-plan"),
    path("releases/<int:pk>/", views.release_detail, name="release-detail"),
    path("admin/", admin.site.urls),
    # Namespaced: the router's route names (e.g. "namespace-detail") would
    # otherwise shadow the pages' names and send browser links to the JSON API.
    path("api/", include(("cacheadmin.api.urls", "api"), namespace="api")),
]

handler400 = "cacheadmin.api.exceptions.api_or_page_400"
handler404 = "cacheadmin.api.exceptions.api_or_page_404"
handler500 = "cacheadmin.api.exceptions.api_or_page_500"
