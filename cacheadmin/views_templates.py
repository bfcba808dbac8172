"""The prompt-template pages: the list with each template's live hit ratio and
a create form (staff), and a template's analysis per model version."""

from __future__ import annotations

import json
from typing import Any

from django.http import HttpRequest, HttpResponse, HttpResponseForbidden
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from cacheadmin.models import ApiToken, PromptTemplate, Tenant
from cacheadmin.models.api_tokens import session_allows
from cacheadmin.services.prompt_templates import (
    HIT_RATIO_WINDOW,
    prompt_template_analysis,
    prompt_template_create,
    prompt_template_delete,
    prompt_template_samples_parse,
    template_hit_ratios,
)
from inference.errors import ControlPlaneError, InvalidField

#: Poll interval (seconds) of the live hit-ratio fragments.
POLL_S = 10


def _list_context(request: HttpRequest, **extra: Any) -> dict[str, Any]:
    templates = list(PromptTemplate.objects.select_related("tenant").order_by("name", "id"))
    return {
        "templates": templates,
        "ratios": template_hit_ratios(templates),
        "tenants": Tenant.objects.order_by("slug"),
        "can_operate": session_allows(request.user, ApiToken.Scope.OPERATE),
        "window_min": int(HIT_RATIO_WINDOW.total_seconds() // 60),
        "updated_at": timezone.now(),
        "poll_s": POLL_S,
        "error": "",
        "form": {},
        **extra,
    }


def prompt_template_list(request: HttpRequest) -> HttpResponse:
    """GET: every template with its hit ratio over the last hour (the table
    alone for an htmx poll). POST (operate permission): create one from the
    form (``name``, ``tenant`` slug or empty for every tenant, ``text``,
    ``samples`` as a JSON list), with the API's rules (the service checks
    both); bad input re-renders the form with the error (400), nothing stored."""
    if request.method == "POST":
        return _create(request)
    if request.headers.get("HX-Request"):
        return render(request, "cacheadmin/_prompt_template_rows.html", _list_context(request))
    return render(request, "cacheadmin/prompt_template_list.html", _list_context(request))


def _create(request: HttpRequest) -> HttpResponse:
    if not session_allows(request.user, ApiToken.Scope.OPERATE):
        return HttpResponseForbidden("creating a prompt template needs the operate permission")
    data = request.POST
    form = {k: data.get(k, "") for k in ("name", "tenant", "text", "samples")}
    try:
        tenant = None
        if form["tenant"]:
            tenant = Tenant.objects.filter(slug=form["tenant"]).first()
            if tenant is None:
                raise InvalidField("tenant", f"no tenant {form['tenant'][:60]!r}")
        # Read as the API reads its body (a duplicate key refused), then checked by the service like the API's.
        samples = prompt_template_samples_parse(form["samples"])
        template = prompt_template_create(
            name=form["name"], tenant=tenant, text=form["text"], samples=samples, actor=f"{request.user.get_username()} (page)"
        )
    except ControlPlaneError as exc:
        context = _list_context(request, error=str(exc), form=form)
        return render(request, "cacheadmin/prompt_template_list.html", context, status=exc.http_status)
    return redirect("prompt-template-detail", pk=template.pk)


def _live(template: PromptTemplate) -> dict[str, Any]:
    return {
        "template": template,
        "ratio": template_hit_ratios([template])[template.pk],
        "window_min": int(HIT_RATIO_WINDOW.total_seconds() // 60),
        "updated_at": timezone.now(),
        "poll_s": POLL_S,
    }


def prompt_template_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """A template: its text and samples, its live hit ratio, and the prefix
    reuse analysis per model version (tokenizer, block size, shared tokens and
    blocks, the first variable that breaks the shared prefix, the recommendation)."""
    template = get_object_or_404(PromptTemplate.objects.select_related("tenant"), pk=pk)
    context = {
        **_live(template),
        "analysis": prompt_template_analysis(template),
        "samples_json": json.dumps(template.samples, ensure_ascii=False, indent=1),
        "can_operate": session_allows(request.user, ApiToken.Scope.OPERATE),
    }
    return render(request, "cacheadmin/prompt_template_detail.html", context)


def prompt_template_live(request: HttpRequest, pk: int) -> HttpResponse:
    """The live hit-ratio fragment of a template page, for polling."""
    template = get_object_or_404(PromptTemplate, pk=pk)
    return render(request, "cacheadmin/_prompt_template_live.html", _live(template))


@require_POST
def prompt_template_remove(request: HttpRequest, pk: int) -> HttpResponse:
    """Delete a template (operate permission; 403 otherwise, nothing changed)."""
    if not session_allows(request.user, ApiToken.Scope.OPERATE):
        return HttpResponseForbidden("deleting a prompt template needs the operate permission")
    template = get_object_or_404(PromptTemplate, pk=pk)
    prompt_template_delete(template=template, actor=f"{request.user.get_username()} (page)")
    return redirect("prompt-template-list")
