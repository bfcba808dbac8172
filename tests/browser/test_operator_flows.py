"""The operator's pages in a real browser: Chromium (Debian's) driven by
Playwright (npm ``playwright-core``, no browser download) through
``tests/browser/flows.mjs``, against one real gunicorn, one real Celery worker
and one real vLLM engine.

What the flow does, in order: a read-only operator (an active user without
the operate permission) signs in through the login form, sees the dashboard
and no action, no salt, and has four forged POSTs refused with 403; staff
sign in, start the engine from its page and watch it become ready on a
dashboard that never reloads; plan an eviction run from the dashboard and
approve it on its page; prewarm and compare from the engine page and watch the
job rows finish live; decide the release on its page with that comparison as
evidence, move 10 % of acme's traffic to the new version there (a gray
release) and watch the dashboard's "Serving now" split 90/10, and roll it back.

The Node script writes what it saw at each step to ``seen.json`` and a full
page screenshot per step (``01-login-readonly.png``, ...) into the artifacts
folder: ``KVCP_BROWSER_ARTIFACTS`` when set, else ``var/browser-artifacts/<run>``
in the checkout (git-ignored; kept after the run, unlike the run's temporary
``VAR_DIR``, so CI and people can look at them). The test prints where.

``KVCP_README_SCREENSHOT``: when set, a path (relative to the checkout, or
absolute) that the ``dashboard-release-gray`` screenshot is copied to after a
passing run: the picture of the dashboard mid-release in the README and docs/demo.md
(``docs/screenshots/dashboard-mid-release.png``). Unset, nothing is copied.

Comparison needs a reference engine that computes every token. One vLLM
engine is all two cores afford here, so the reference is a second row for the
same server: its requests carry no ``cache_salt`` and the engine has no
persistent tier, so they share no block with the namespace's salted requests
(vLLM mixes the salt into the first block's hash).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission, User

from cacheadmin.management.commands.demo import DashboardServer, ServerOptions, static_collect
from cacheadmin.models import (
    AuditEvent,
    ComparisonJob,
    Engine,
    EvictionRun,
    JobStatus,
    ModelVersion,
    PrewarmJob,
)
from cacheadmin.services.engines import engine_create, engine_stop
from cacheadmin.services.gateway import routing_snapshot_build
from cacheadmin.services.model_versions import model_version_register, model_version_transition
from cacheadmin.services.namespaces import (
    DEMO_POLICY,
    namespace_get_or_create,
    namespace_salt_read,
    retention_owner_get_or_create,
    tenant_get_or_create,
)
from cacheadmin.services.releases import release_collect_tokenization_evidence, release_create
from cacheadmin.services.workers import WorkerProcess
from cacheadmin.templatetags.cacheadmin_tags import iec_bytes
from inference.child_env import die_with_parent
from inference.engines.launcher import free_port
from inference.identity import LayoutOptions
from tests.cacheadmin.test_eviction import write_entry
from tests.helpers import PROJECT, EngineKeyProxy, subprocess_env, worker_log

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

FLOWS = Path(__file__).with_name("flows.mjs")
LAYOUT = LayoutOptions(dtype="float32", kv_connector="ExampleConnector")
#: Two workers of two threads: the dashboard's polling tabs never queue behind a form post.
OPTIONS = ServerOptions(workers=2, threads=2, timeout_s=60, graceful_timeout_s=10)
STAFF, READER = "sam", "rita"
PASSWORD = "browser-flow-pass-1"
ENGINE, REFERENCE = "browser-e1", "browser-ref"
ORPHAN = "browser-orphan"
#: The dashboard's sections (their ids are documented in templates/cacheadmin/dashboard.html).
SECTIONS = ("serving-now", "engines", "jobs", "releases", "eviction-runs", "staleness", "cleanup", "namespaces",
            "model-versions", "gateway", "charts")  # fmt: skip
#: The whole Node flow, engine start included (~30-90 s on 2 cores), must end within this.
FLOW_TIMEOUT_S = 330


def artifacts_dir() -> Path:
    """Where this run's screenshots and ``seen.json`` go: ``KVCP_BROWSER_ARTIFACTS``
    or ``var/browser-artifacts/<UTC time>-<pid>`` in the checkout; created empty."""
    given = os.environ.get("KVCP_BROWSER_ARTIFACTS")
    run = f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{os.getpid()}"
    folder = Path(given) if given else Path(settings.BASE_DIR) / "var" / "browser-artifacts" / run
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def stack(django_db_setup: None) -> Iterator[DashboardServer]:
    """gunicorn (after collectstatic) and a Celery worker on the test database;
    the server is yielded, the worker lives as long."""
    env = subprocess_env()
    server = DashboardServer(
        f"127.0.0.1:{free_port()}", log_path=settings.VAR_DIR / "logs" / "browser-gunicorn.log", options=OPTIONS, env=env
    )
    worker = WorkerProcess(worker_log("browser-worker"), env=env, name="browser")
    # collectstatic runs beside the worker's start; the two long-lived children are
    # started from this thread, since they die with the thread that started them
    # (PR_SET_PDEATHSIG): a helper thread's end would stop them.
    with ThreadPoolExecutor(1) as pool:
        collected = pool.submit(static_collect, server.env)
        worker.start()
    try:
        collected.result()
        server.start(collect_static=False)
    except BaseException:
        worker.stop()
        raise
    try:
        yield server
    finally:
        worker.stop()
        server.stop()


def _user(name: str, *, operate: bool) -> User:
    user = User.objects.create_user(name, password=PASSWORD, is_staff=operate)
    if operate:
        user.user_permissions.add(Permission.objects.get(codename="operate_cache"))
    return user


def _compatible_copy(demo_checkpoints: dict[str, Path], model_root: Path) -> Path:
    """tiny-v1 with new generation defaults: the same KV identity, a release that needs a decision."""
    copy = model_root / f"tiny-v1-browser-{os.getpid()}"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(demo_checkpoints["tiny-v1"], copy)
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "9.9.9"
    (copy / "config.json").write_text(json.dumps(config))
    # Sampling defaults only (a greedy request resets them); its stop tokens stay.
    generation = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.3, "top_p": 0.9}))
    return copy


def _register(path: Path, label: str) -> ModelVersion:
    return model_version_register(path=path, label=label, served_name="tiny", layout=LAYOUT, actor="ci")[0]


def _world(demo_checkpoints: dict[str, Path], compat: Path) -> dict:
    """Users, versions, tenant acme's namespace, a compatible release awaiting a
    decision (tokenization evidence collected), a stopped engine of the new
    version on the old namespace, its reference row, and an orphan on disk."""
    _user(STAFF, operate=True)
    _user(READER, operate=False)
    v1 = _register(demo_checkpoints["tiny-v1"], "tiny-v1")
    v1gen = _register(compat, "tiny-v1-gen")
    model_version_transition(version=v1, to=ModelVersion.Status.ACTIVE, actor="ci")
    acme = tenant_get_or_create(slug="acme", name="Acme", actor="ci")
    owner = retention_owner_get_or_create(name="platform", email="platform@example.com", actor="ci")
    ns1, _ = namespace_get_or_create(model_version=v1, tenant=acme, retention_owner=owner, policy=DEMO_POLICY, actor="ci")
    release = release_create(served_name="tiny", tenant=acme, from_version=v1, to_version=v1gen, actor="ci")
    assert (release.classification, release.status) == ("compatible", "decision_required")
    release_collect_tokenization_evidence(release=release, actor="ci")
    # Recorded, never started: the browser starts it. No disk tier, so the
    # reference row's unsalted requests cannot read the namespace's blocks.
    engine = engine_stop(
        engine=engine_create(name=ENGINE, model_version=v1gen, namespace=ns1, actor="ci", tier="none"), actor="ci"
    )
    # The same server through a proxy that adds its API key (every route of a local engine needs it),
    # verified as an operator's adopted reference would be: a comparison takes no unverified witness.
    proxy = EngineKeyProxy(engine.pk)
    reference = Engine.objects.create(
        name=REFERENCE, role=Engine.Role.REFERENCE, origin=Engine.Origin.ADOPTED, model_version=v1gen, namespace=None,
        base_url=proxy.base_url, prefix_caching=False, status=Engine.Status.READY,
        verification=Engine.Verification.VERIFIED,
    )  # fmt: skip
    # An orphan prefix older than the grace period: the eviction plan's one sure action.
    write_entry(settings.KV_STORE_ROOT, ORPHAN, "c" * 64, size=4096, age_s=settings.ORPHAN_GRACE_S + 3600)
    return {"v1": v1, "v1gen": v1gen, "ns1": ns1, "release": release, "engine": engine, "reference": reference, "proxy": proxy}


#: The states a job's dashboard row passes through, in order (the status is the row's fourth cell).
JOB_ORDER = ("queued", "running", "succeeded")


def _in_job_order(texts: list[str]) -> bool:
    """Whether the row texts seen by the dashboard's polling go forward only, ending succeeded."""
    statuses = [text.split("\t")[3] for text in texts]
    if statuses[-1] != "succeeded" or any(s not in JOB_ORDER for s in statuses):
        return False
    return statuses == sorted(statuses, key=JOB_ORDER.index)


def _run_flows(server: DashboardServer, world: dict, artifacts: Path) -> tuple[int, str]:
    """Run the Node flow; its output is echoed line by line as it comes (``-s`` shows it live)."""
    env = {
        **os.environ,
        "BASE_URL": server.base_url,
        "ARTIFACTS": str(artifacts),
        "STAFF_USER": STAFF,
        "READER_USER": READER,
        "USER_PASSWORD": PASSWORD,
        "ENGINE_ID": str(world["engine"].pk),
        "ENGINE_NAME": ENGINE,
        "REFERENCE_ID": str(world["reference"].pk),
        "REFERENCE_NAME": REFERENCE,
        "NAMESPACE_ID": str(world["ns1"].pk),
        "RELEASE_ID": str(world["release"].pk),
        "ENGINE_READY_TIMEOUT_S": str(settings.ENGINE_START_TIMEOUT_S),
    }
    proc = subprocess.Popen(
        ["node", str(FLOWS)],
        cwd=PROJECT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=die_with_parent,
    )
    # Killed at the deadline even when it hangs without printing.
    watchdog = threading.Timer(FLOW_TIMEOUT_S, proc.kill)
    watchdog.start()
    lines: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line)
            sys.stdout.write(f"[flows] {line}")
            sys.stdout.flush()
    finally:
        watchdog.cancel()
    if proc.wait(timeout=30) == -9:
        lines.append(f"killed after {FLOW_TIMEOUT_S} s\n")
    return proc.returncode, "".join(lines)


def test_operators_drive_the_control_plane_from_the_browser(stack: DashboardServer, demo_checkpoints, model_root) -> None:
    compat = _compatible_copy(demo_checkpoints, model_root)
    world = _world(demo_checkpoints, compat)
    artifacts = artifacts_dir()
    print(f"browser artifacts: {artifacts}")
    try:
        code, output = _run_flows(stack, world, artifacts)
        # As the flow left them, before the engine is stopped.
        engine = Engine.objects.get(pk=world["engine"].pk)
        snapshot = routing_snapshot_build()
    finally:
        engine_stop(engine=Engine.objects.get(pk=world["engine"].pk), actor="ci")
        world["proxy"].close()
        shutil.rmtree(compat, ignore_errors=True)
    seen_path = artifacts / "seen.json"
    assert seen_path.exists(), output[-4000:]
    seen = json.loads(seen_path.read_text())
    failed = seen.get("failed_step") or {}
    shot = artifacts / failed.get("screenshot", "?")
    assert code == 0, f"flows.mjs exited {code}: {seen.get('error')}\nfailing page: {shot}\n{output[-4000:]}"
    steps = seen["steps"]

    # Every step left a full-page screenshot, named by step.
    assert [s["name"] for s in steps] == [
        "login-readonly", "dashboard-readonly", "readonly-refused", "login-staff", "dashboard-staff",
        "engine-start", "eviction-planned", "eviction-approved", "dashboard-engine-ready", "eviction-succeeded",
        "dashboard-eviction-succeeded", "prewarm", "dashboard-prewarm-succeeded", "compare", "dashboard-compare-succeeded",
        "release-decided", "dashboard-release-decided", "release-gray", "dashboard-release-gray", "release-rolled-back",
        "dashboard-release-rolled-back",
    ]  # fmt: skip
    for number, step in enumerate(steps, start=1):
        shot = artifacts / step["screenshot"]
        assert step["screenshot"] == f"{number:02d}-{step['name']}.png"
        assert shot.stat().st_size > 5_000, shot
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    by = {s["name"]: s["saw"] for s in steps}
    release = world["release"]

    # Read-only: signed in through the form, every section there, no action, no salt;
    # each forged write refused, and the engine it tried to start still stopped.
    assert by["login-readonly"] == {"who": READER}
    readonly = by["dashboard-readonly"]
    assert set(SECTIONS) <= set(readonly["section_ids"])
    assert {"Serving now", "Engines", "Prewarm jobs", "Comparison jobs", "Releases", "Eviction runs", "Staleness",
            "Cleanup", "Cache namespaces", "Model versions", "Gateway", "Charts"} <= set(readonly["headings"])  # fmt: skip
    assert (readonly["buttons_in_main"], readonly["post_forms_in_main"]) == ([], 0)
    refused = by["readonly-refused"]
    assert refused["posts"] == {
        "plan eviction run": 403, f"start engine {ENGINE}": 403, f"restart engine {ENGINE}": 403,
        f"decide release #{release.pk}": 403, f"move traffic of release #{release.pk}": 403,
    }  # fmt: skip
    assert (refused["engine_status_after"], refused["buttons_on_engine_page"]) == ("stopped", [])
    assert not AuditEvent.objects.filter(actor__startswith=READER).exists()
    salt = namespace_salt_read(world["ns1"], actor="ci", purpose="browser test: no salt on read-only pages")
    for page in refused["saved_html"]:
        html = (artifacts / page).read_text()
        assert len(html) > 1_000 and salt not in html, page
    assert by["login-staff"] == {"who": STAFF}

    # The engine: stopped, started from its page, ready on a dashboard that never reloaded.
    stopped = by["dashboard-staff"]["engine_row"].split("\t")
    assert stopped[:3] + stopped[4:6] == [ENGINE, "serving", "tiny-v1-gen", "memory only", "stopped · unverified"]
    assert stopped[-1] == "Start"
    assert by["engine-start"] == {"via": "Start", "status_before": "stopped", "status_after": "starting"}
    ready = by["dashboard-engine-ready"]
    assert ready["engine_row"].split("\t")[5] == "ready · verified" and ready["engine_row"].endswith("\tRestart Stop")
    statuses = [row.split("\t")[5] for row in ready["row_texts_seen"]]
    assert statuses[0] == "stopped · unverified" and "starting · unverified" in statuses
    assert statuses[-1] == "ready · verified"
    assert (engine.status, engine.verification) == ("ready", "verified")

    # The eviction run: planned from the dashboard, approved on its page, done; its table showed each action.
    run = EvictionRun.objects.get()
    assert (run.status, run.created_by, run.approved_by) == (JobStatus.SUCCEEDED, f"{STAFF} (page)", f"{STAFF} (page)")
    actions = list(run.actions.order_by("seq"))
    planned = by["eviction-planned"]
    assert (planned["run_id"], planned["status"]) == (run.pk, "planned")
    assert [row[:5] + [row[6]] for row in planned["actions"]] == [
        [str(a.seq), a.kind, a.tier, f"{a.storage_prefix} (orphan)" if a.namespace_id is None else a.namespace.boundary_label
         + "/" + a.namespace.model_version.label, iec_bytes(a.bytes_planned), "pending"] for a in actions
    ]  # fmt: skip
    assert [ORPHAN, "delete_prefix", "disk"] in [[a.storage_prefix, a.kind, a.tier] for a in actions]
    assert by["eviction-approved"] == {"status": "queued"}
    done = by["eviction-succeeded"]
    assert done["status"] == "succeeded"
    assert [[row[0], row[5], row[6]] for row in done["action_status"]] == [
        [str(a.seq), iec_bytes(a.bytes_freed), "done"] for a in actions
    ]
    assert by["dashboard-eviction-succeeded"]["texts_seen"][-1] == "succeeded"
    assert not (settings.KV_STORE_ROOT / ORPHAN).exists()

    # Prewarm and compare from the engine page; their rows appeared and finished live.
    prewarm = PrewarmJob.objects.get(engine=engine)
    assert (prewarm.status, prewarm.verified, prewarm.prompts, prewarm.created_by) == ("succeeded", 9, 9, f"{STAFF} (page)")
    assert by["prewarm"] == {"via": "page", "url": f"/prewarm-jobs/{prewarm.pk}/"}
    row = by["dashboard-prewarm-succeeded"]
    assert row["job_id"] == prewarm.pk
    assert row["row"].split("\t")[:7] == [
        f"#{prewarm.pk}", "acme/tiny-v1", ENGINE, "succeeded", "18/18", "9/9", str(prewarm.cached_tokens_verified),
    ]  # fmt: skip
    # The row appeared without a reload and changed in place; how many states the 2 s poll caught before
    # the end depends on how fast the engine is (a prewarm here takes under a second), so only their order counts.
    assert row["row_texts_seen"][-1] == row["row"] and _in_job_order(row["row_texts_seen"])
    comparison = ComparisonJob.objects.get(engine=engine)
    assert (comparison.status, comparison.deceptive_hits, comparison.reference_engine_id, comparison.max_tokens) == (
        "succeeded", 0, world["reference"].pk, 4,
    )  # fmt: skip
    assert comparison.created_by == f"{STAFF} (page)"
    assert by["compare"] == {"via": "page", "url": f"/comparison-jobs/{comparison.pk}/"}
    row = by["dashboard-compare-succeeded"]
    assert row["job_id"] == comparison.pk
    assert row["row"].split("\t")[:7] == [
        f"#{comparison.pk}", f"{ENGINE} (tiny-v1-gen)", "acme/tiny-v1", "succeeded", "9/9", "0", str(comparison.cached_tokens),
    ]  # fmt: skip
    assert row["row_texts_seen"][-1] == row["row"] and _in_job_order(row["row_texts_seen"])

    # The release: verified reuse with that comparison as evidence, 10 % of traffic on it, then
    # rolled back; page and dashboard agreed at each step.
    release.refresh_from_db()
    assert (release.status, release.decision, release.decided_by, release.comparison_job_id, release.traffic_percent) == (
        "rolled_back", "verified_reuse", f"{STAFF} (page)", comparison.pk, 0,
    )  # fmt: skip
    decided, gray, rolled = by["release-decided"], by["release-gray"], by["release-rolled-back"]
    summary = (
        "tiny-v1 → tiny-v1-gen: compatible candidate: only fields without effect on KV state changed "
        "(config_excluded, generation_config)."
    )
    when = f"{release.decided_at:%Y-%m-%d %H:%M:%S}"
    decision = f"verified reuse (with evidence) by {STAFF} (page) at {when}: same tokens, no deceptive hit"
    assert decided == {
        "status": "ready", "summary": summary, "decision": decision, "buttons": ["Set traffic", "Roll back"],
        "timeline_kinds": ["created", "evidence.tokenization", "decided", "ready"], "error": "",
    }  # fmt: skip
    assert gray == {
        **decided,
        "summary": f"{summary} 10% of traffic on the new version.",
        "timeline_kinds": decided["timeline_kinds"] + ["traffic"],
        "percent_before": "0",
        "percent_after": "10",
    }
    moved = release.events.get(kind="traffic")
    assert (moved.actor, moved.detail) == (f"{STAFF} (page)", {"before": 0, "after": 10})
    assert AuditEvent.objects.filter(action="release.traffic", actor=f"{STAFF} (page)").count() == 1
    assert rolled == {
        **decided,
        "status": "rolled_back",
        "buttons": [],
        "timeline_kinds": gray["timeline_kinds"] + ["rolled_back"],
    }
    for name, status, percent in (
        ("dashboard-release-decided", "ready", 0),
        ("dashboard-release-gray", "ready", 10),
        ("dashboard-release-rolled-back", "rolled_back", 0),
    ):
        shown = by[name]
        assert shown["release_rows"] == [
            [f"#{release.pk}", "tiny", "acme", "tiny-v1 → tiny-v1-gen", "compatible", "verified_reuse", status, f"{percent} %",
             shown["release_rows"][0][-1]],
        ]  # fmt: skip
        # Serving now: both versions routed; verified reuse moved none, the gray release 10 %, the rollback all back.
        want = [["tiny", "tiny-v1", str(100 - percent)], ["tiny", "tiny-v1-gen", str(percent)]]
        assert shown["serving"] == want, (name, shown["serving"])
        assert (shown["marker_survived"], shown["navigations_since_marker"]) == (True, 0)
    assert by["dashboard-release-gray"][f'#releases tr[data-release-id="{release.pk}"] td:nth-child(8)'] == "10 %"
    # ... which is what the gateways' routing snapshot says now.
    (acme_tiny,) = [targets for (tenant_id, served), targets in snapshot.routes.items() if served == "tiny"]
    routed = [["tiny", t.version_label, str(t.percent)] for t in acme_tiny]
    assert by["dashboard-release-rolled-back"]["serving"] == routed

    # The docs' picture of the dashboard mid-release (README.md, docs/demo.md), from this passing run.
    readme_shot = os.environ.get("KVCP_README_SCREENSHOT")
    if readme_shot:
        target = Path(settings.BASE_DIR) / readme_shot
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(artifacts / next(s["screenshot"] for s in steps if s["name"] == "dashboard-release-gray"), target)
        print(f"README screenshot: {target}")
