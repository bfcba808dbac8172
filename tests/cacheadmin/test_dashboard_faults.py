"""The dashboard's edges: a signed-out poll sends the tab to the sign-in page
(never a login form swapped into a section), read-only views refuse unsafe
methods, bad query parameters are a 400 that says what is allowed, and the
schedule form accepts only what its fields send and writes nothing when
nothing changes. Each refusal also checks that nothing changed."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from cacheadmin.models import AuditEvent, CacheNamespace, Engine, RetentionPolicy
from cacheadmin.schedules import schedules_sync
from cacheadmin.views_dashboard import PAGE_MAX, SECTIONS

pytestmark = pytest.mark.django_db

PASSWORD = "dash-faults-pass-1"
#: Every read-only page and fragment of the dashboard.
READ_ONLY = ("/", "/namespaces/", "/fragments/live", "/fragments/cleanup-preview",
             *(f"/fragments/dashboard/{s}" for s in SECTIONS))  # fmt: skip
#: Pages whose live parts poll with htmx (the dashboard's and other pages'); the
#: sign-in check runs before the view, so the ids need no rows.
POLLED = ("/fragments/dashboard/cleanup", "/fragments/dashboard/schedules", "/fragments/live", "/fragments/cleanup-preview",
          "/engines/1/live", "/prompt-templates/1/live", "/prompt-templates/", "/prewarm-jobs/1/",
          "/comparison-jobs/1/", "/eviction-runs/1/", "/releases/1/", "/")  # fmt: skip


def _reader(client: Client) -> User:
    user = User.objects.create_user("rita", password=PASSWORD)
    client.force_login(user)
    return user


def _staff(client: Client) -> User:
    user = User.objects.create_user("sam", password=PASSWORD, is_staff=True, is_superuser=True)
    client.force_login(user)
    return user


def _state() -> tuple:
    """What a refused request must leave as it was."""
    tasks = tuple(PeriodicTask.objects.order_by("name").values_list("name", "interval_id", "enabled"))
    namespaces = tuple(CacheNamespace.objects.order_by("pk").values_list("pk", "residency", "residency_changed_at"))
    return tasks, namespaces, AuditEvent.objects.count(), IntervalSchedule.objects.count()


# --- signed out ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", POLLED)
def test_a_signed_out_htmx_poll_sends_the_tab_to_the_sign_in_page(world: dict, client: Client, path: str) -> None:
    page = "http://testserver/namespaces/?order=biggest&page=2"
    response = client.get(path, headers={"HX-Request": "true", "HX-Current-URL": page})
    target = "/login/?next=" + quote("/namespaces/?order=biggest&page=2", safe="/")
    assert response.status_code == 401
    assert response["HX-Redirect"] == target
    assert not response.has_header("Location")
    assert response.content.decode() == f"Signed out: sign in again at {target}\n"
    # The same request without htmx is an ordinary page load: Django's redirect to the form.
    plain = client.get(path)
    assert plain.status_code == 302 and plain["Location"] == "/login/?next=" + quote(path, safe="/")
    assert not plain.has_header("HX-Redirect")


def test_signing_in_from_the_hx_redirect_lands_on_the_page_not_the_fragment(world: dict, client: Client) -> None:
    User.objects.create_user("rita", password=PASSWORD)
    response = client.get(
        "/fragments/dashboard/namespaces?order=biggest",
        headers={"HX-Request": "true", "HX-Current-URL": "http://testserver/?order=biggest#namespaces"},
    )
    target = response["HX-Redirect"]
    # The fragment is kept: the browser never sends it, and it names the section the operator was at.
    assert target == "/login/?next=/%3Forder%3Dbiggest%23namespaces"
    form = client.get(target)
    assert form.status_code == 200 and 'name="username"' in form.content.decode()
    signed_in = client.post(target, {"username": "rita", "password": PASSWORD, "next": "/?order=biggest#namespaces"})
    assert signed_in.status_code == 302 and signed_in["Location"] == "/?order=biggest#namespaces"


@pytest.mark.parametrize(
    "current",
    ["http://evil.example/steal", "//evil.example/x", "javascript:alert(1)", "", "http://testserver//evil.example/"],
)
def test_a_foreign_or_missing_current_url_never_becomes_next(world: dict, client: Client, current: str) -> None:
    headers = {"HX-Request": "true", **({"HX-Current-URL": current} if current else {})}
    response = client.get("/fragments/live", headers=headers)
    assert (response.status_code, response["HX-Redirect"]) == (401, "/login/?next=/")


def test_hx_request_other_than_true_is_a_plain_request(world: dict, client: Client) -> None:
    response = client.get("/fragments/live", headers={"HX-Request": "false"})
    assert response.status_code == 302 and response["Location"] == "/login/?next=/fragments/live"


@pytest.mark.parametrize("method", ["get", "post", "delete"])
def test_charts_json_signed_out_is_401_in_the_envelope(world: dict, method: str) -> None:
    client = Client(enforce_csrf_checks=True)
    before = _state()
    response = getattr(client, method)("/dashboard/charts.json")
    assert response.status_code == 401
    assert response["Content-Type"] == "application/json"
    assert response.json() == {
        "error": {
            "status": 401,
            "code": "not_authenticated",
            "message": "not signed in: sign in at /login/ (this endpoint reads the browser session)",
        }
    }
    assert response["WWW-Authenticate"] == 'Session realm="kvcp", login="/login/"'
    assert _state() == before


# --- methods ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["post", "put", "patch", "delete"])
def test_read_only_views_answer_405_to_unsafe_methods_and_change_nothing(world: dict, method: str) -> None:
    schedules_sync()
    # CSRF checks on: a refused method must read 405, not the CSRF failure page.
    client = Client(enforce_csrf_checks=True)
    _staff(client)
    before = _state()
    for path in READ_ONLY:
        response = getattr(client, method)(path, {"every_s": "60"}, content_type="application/x-www-form-urlencoded")
        assert response.status_code == 405, path
        assert response["Allow"] == "GET, HEAD", path
        expected = f"{path} only reads: it answers GET and HEAD, not {method.upper()}; nothing was changed.\n"
        assert response.content.decode() == expected
    assert _state() == before


def test_read_only_views_answer_head_like_get(world: dict, client: Client) -> None:
    schedules_sync()
    for ns in CacheNamespace.objects.all():  # as namespace_get_or_create gives every namespace
        RetentionPolicy.objects.create(namespace=ns)
    _reader(client)
    for path in (*READ_ONLY, "/dashboard/charts.json"):
        assert client.head(path).status_code == 200, path


@pytest.mark.parametrize("method", ["post", "put", "delete"])
def test_charts_json_answers_405_in_the_envelope(world: dict, method: str) -> None:
    client = Client(enforce_csrf_checks=True)
    _reader(client)
    before = _state()
    response = getattr(client, method)("/dashboard/charts.json")
    assert response.status_code == 405 and response["Allow"] == "GET, HEAD"
    assert response.json() == {
        "error": {
            "status": 405,
            "code": "method_not_allowed",
            "message": f"{method.upper()} is not allowed on /dashboard/charts.json (GET, HEAD)",
        }
    }
    assert _state() == before


# --- query parameters ---------------------------------------------------------------------------

PAGED = (("/namespaces/", "page"), ("/", "serving_page"), ("/fragments/dashboard/serving-now", "serving_page"))
ORDERED = ("/namespaces/", "/", "/fragments/dashboard/namespaces")


@pytest.mark.parametrize(("path", "name"), PAGED)
@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("abc", "'abc'"),
        ("-1", "'-1'"),
        ("١", "'١'"),
        ("0", "'0'"),
        ("1.5", "'1.5'"),
        ("", "''"),
        (str(PAGE_MAX + 1), f"'{PAGE_MAX + 1}'"),
        ("999999999", "'999999999'"),
        ("99999999999999999999", "'99999999999999999999'"),
        ("9" * 5000, repr("9" * 40 + "…")),
    ],
)
def test_a_bad_page_is_400_and_says_what_is_allowed(
    world: dict, client: Client, path: str, name: str, raw: str, shown: str
) -> None:
    _reader(client)
    response = client.get(path, {name: raw})
    assert response.status_code == 400
    body = response.content.decode()
    message = f"{name} must be a whole number from 1 to {PAGE_MAX} (a page past the last shows the last), not {shown}"
    assert f'<p class="error" id="query-error" role="alert">Bad query parameter <code>{name}</code>: ' in body
    # Django escapes the quotes of the value.
    assert message.replace("'", "&#x27;") in body
    # A fragment is a fragment; a page is a whole page.
    assert ("<html" in body) is (not path.startswith("/fragments/"))


@pytest.mark.parametrize("path", ORDERED)
@pytest.mark.parametrize("raw", ["bogus", "", "NEWEST", "newest "])
def test_a_bad_order_is_400_and_lists_the_orders(world: dict, client: Client, path: str, raw: str) -> None:
    _reader(client)
    response = client.get(path, {"order": raw})
    assert response.status_code == 400
    expected = f"order must be one of newest, biggest, stalest, not {raw!r}".replace("'", "&#x27;")
    assert expected in response.content.decode()


@pytest.mark.parametrize(("path", "name"), [*PAGED, *((p, "order") for p in ORDERED)])
def test_a_parameter_given_twice_is_400(world: dict, client: Client, path: str, name: str) -> None:
    _reader(client)
    value = "1" if "page" in name else "newest"
    response = client.get(f"{path}?{name}={value}&{name}={value}")
    assert response.status_code == 400
    assert f"{name} is given 2 times; give it once" in response.content.decode()


@pytest.mark.parametrize("raw", ["3", "999999", str(PAGE_MAX)])
def test_any_page_up_to_the_bound_past_the_end_shows_the_last(world: dict, client: Client, raw: str) -> None:
    _reader(client)
    body = client.get("/namespaces/", {"page": raw, "order": "stalest"}).content.decode()
    assert "2 namespaces (not dropped), page 1 of 1" in body and body.count("<tr data-namespace-id=") == 2
    serving = client.get("/fragments/dashboard/serving-now", {"serving_page": raw})
    assert serving.status_code == 200 and 'data-tenant="acme"' not in serving.content.decode()


def test_parameters_a_view_does_not_read_are_ignored(world: dict, client: Client) -> None:
    _reader(client)
    # The dashboard reads order and serving_page (not page); the list reads order and page;
    # the engines section reads none. A tracker's utm_source is nobody's.
    for path, query in (
        ("/", {"utm_source": "mail", "page": "x"}),
        ("/namespaces/", {"utm_source": "mail", "serving_page": "x"}),
        ("/fragments/dashboard/engines", {"order": "bogus", "page": "x"}),
    ):
        assert client.get(path, query).status_code == 200, path


# --- schedules ----------------------------------------------------------------------------------


def _sweep() -> PeriodicTask:
    return PeriodicTask.objects.select_related("interval").get(name="eviction-sweep")


@pytest.mark.parametrize("flag", ["garbage", "ON", "true", "off", "1", ""])
def test_enabled_is_only_on_or_absent(world: dict, client: Client, flag: str) -> None:
    schedules_sync()
    _staff(client)
    before = _state()
    response = client.post("/schedules/accounting-scan/", {"every_s": "1200", "enabled": flag})
    assert response.status_code == 400
    body = response.content.decode()
    message = f"enabled must be 'on' (runs) or left out (off), as the checkbox sends it, not {flag!r}".replace("'", "&#x27;")
    assert f'<p class="error" id="schedule-error" role="alert">accounting-scan: {message}. Nothing was changed.</p>' in body
    assert _state() == before


def test_a_field_given_twice_is_refused(world: dict, client: Client) -> None:
    schedules_sync()
    _staff(client)
    before = _state()
    response = client.post("/schedules/eviction-sweep/", {"every_s": ["60", "120"], "enabled": "on"})
    assert response.status_code == 400 and "every_s is given 2 times; give it once" in response.content.decode()
    response = client.post("/schedules/eviction-sweep/", {"every_s": "60", "enabled": ["on", "on"]})
    assert response.status_code == 400 and "enabled is given 2 times; give it once" in response.content.decode()
    assert _state() == before


def test_the_refusal_keeps_what_was_typed_and_does_not_poll(world: dict, client: Client) -> None:
    schedules_sync()
    _staff(client)
    response = client.post("/schedules/eviction-sweep/", {"every_s": "9", "enabled": "on"})
    assert response.status_code == 400
    body = response.content.decode()
    section = body[body.index('<section id="schedules"') :]
    section = section[: section.index(">")]
    # No polling on this page: the error stays until the next save or navigation.
    assert "hx-get" not in section and "hx-trigger" not in section and 'data-poll-s="0"' in section
    row = body[body.index('data-schedule="eviction-sweep"') :].split("</tr>")[0]
    assert 'value="9" size="7" aria-invalid="true" aria-describedby="schedule-error"' in row
    assert "every_s must be between 10 and 604800 seconds, not 9. Nothing was changed." in body
    # The dashboard's schedules section polls, as every section does.
    dashboard = client.get("/").content.decode()
    assert 'id="schedules" class="dash-section" hx-get="/fragments/dashboard/schedules"' in dashboard
    assert 'id="schedule-error"' not in dashboard


def test_saving_what_is_already_set_writes_nothing_and_says_unchanged(world: dict, client: Client) -> None:
    schedules_sync()
    _staff(client)
    # Stored as 10 minutes: 600 s is the same interval, so nothing is rewritten.
    ten_minutes, _ = IntervalSchedule.objects.get_or_create(every=10, period=IntervalSchedule.MINUTES)
    PeriodicTask.objects.filter(name="eviction-sweep").update(interval=ten_minutes, enabled=True)
    before = _state()
    response = client.post("/schedules/eviction-sweep/", {"every_s": "600", "enabled": "on"})
    assert (response.status_code, response["Location"]) == (302, "/#schedules")
    assert _state() == before
    assert (_sweep().interval.every, _sweep().interval.period) == (10, "minutes")
    page = client.get("/").content.decode()
    said = '<ul id="messages" class="messages"><li class="info">Schedule eviction-sweep unchanged: every 600 s, on.</li></ul>'
    assert said in page
    # Shown once.
    assert 'id="messages"' not in client.get("/").content.decode()


def test_a_change_is_saved_audited_and_said(world: dict, client: Client) -> None:
    schedules_sync()
    _staff(client)
    response = client.post("/schedules/eviction-sweep/", {"every_s": "1200"})
    assert (response.status_code, response["Location"]) == (302, "/#schedules")
    task = _sweep()
    assert (task.interval.every, task.interval.period, task.enabled) == (1200, "seconds", False)
    event = AuditEvent.objects.get(action="schedule.update")
    assert (event.before, event.after) == (
        {"every_s": 600, "period": "seconds", "enabled": True},
        {"every_s": 1200, "period": "seconds", "enabled": False},
    )
    assert '<li class="success">Schedule eviction-sweep saved: every 1200 s, off.</li>' in client.get("/").content.decode()
    # Saving the same again: no second event.
    client.post("/schedules/eviction-sweep/", {"every_s": "1200"})
    assert AuditEvent.objects.filter(action="schedule.update").count() == 1


def test_the_poll_interval_follows_activity(world: dict, client: Client) -> None:
    """The schedules section polls at the dashboard's rate (2 s while an engine serves)."""
    schedules_sync()
    _reader(client)
    body = client.get("/fragments/dashboard/schedules").content.decode()
    assert "hx-trigger=\"every 2s [document.visibilityState === 'visible']\"" in body
    Engine.objects.update(status=Engine.Status.STOPPED)
    world["job"].delete()
    body = client.get("/fragments/dashboard/schedules").content.decode()
    assert "hx-trigger=\"every 15s [document.visibilityState === 'visible']\"" in body
    assert "schedule-form" not in body
