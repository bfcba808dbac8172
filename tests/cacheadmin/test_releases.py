"""Release workflow: classification by identity diff, decisions gated on
evidence, new namespaces prewarmed before routing, purges confirmed by every
tier, gray releases, each rollback path, concurrency and idempotency."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.db import connection
from rest_framework.test import APIClient

from cacheadmin.models import (
    AuditEvent,
    CacheNamespace,
    ComparisonJob,
    Engine,
    EvictionRun,
    JobStatus,
    ModelVersion,
    PrewarmJob,
    Residency,
    Tenant,
)
from cacheadmin.models.releases import PrefixHeat, Release, ReleaseEvent
from cacheadmin.services import releases as releases_service
from cacheadmin.services.api_tokens import api_token_issue
from cacheadmin.services.eviction import eviction_plan, eviction_run_approve, eviction_run_execute
from cacheadmin.services.heat import MAX_HITS
from cacheadmin.services.model_versions import LifecycleError, model_version_register, model_version_transition
from cacheadmin.services.namespaces import (
    DEMO_POLICY,
    namespace_get_or_create,
    namespace_storage_path,
    retention_owner_get_or_create,
    tenant_get_or_create,
)
from cacheadmin.services.prewarm import prewarm_job_run
from cacheadmin.services.releases import (
    ReleaseConflict,
    ReleaseRefused,
    release_collect_tokenization_evidence,
    release_create,
    release_decide,
    release_mark_ready,
    release_rollback,
    release_routing,
    release_set_traffic,
    release_sync,
    releases_sync_pending,
)
from inference.checkpoints import mistral_common_tokenizer_path
from inference.corpus import load_corpus
from inference.errors import InvalidField
from inference.identity import LayoutOptions
from inference.tokenization import load_chat_tokenizer, summary, tokenization_diff
from tests.cacheadmin.test_eviction import write_entry
from tests.helpers import manage, subprocess_env

LAYOUT = LayoutOptions(dtype="float32", kv_connector="ExampleConnector")


@pytest.fixture
def versions(demo_checkpoints, model_root: Path, tmp_path: Path, settings) -> dict:
    """tiny-v1; the same checkpoint under another label (identical); a copy
    whose generation defaults and transformers_version changed (compatible);
    tiny-v2 (other weights: incompatible). Tenant acme has v1's namespace."""
    settings.KV_STORE_ROOT, settings.KV_COLD_ROOT, settings.KV_REDIS_URL = tmp_path / "kv", tmp_path / "cold", ""
    compat = model_root / f"tiny-v1-gen-{tmp_path.name}"
    shutil.copytree(demo_checkpoints["tiny-v1"], compat)
    config = json.loads((compat / "config.json").read_text())
    config["transformers_version"] = "9.9.9"
    (compat / "config.json").write_text(json.dumps(config))
    # Sampling defaults only: a greedy request resets them, so the identity keeps (its stop tokens stay).
    generation = json.loads((compat / "generation_config.json").read_text())
    (compat / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.3, "top_p": 0.9}))

    def register(path: Path, label: str) -> ModelVersion:
        return model_version_register(path=path, label=label, served_name="tiny", layout=LAYOUT, actor="alice")[0]

    out = {
        "v1": register(demo_checkpoints["tiny-v1"], "tiny-v1"),
        "v1-again": register(demo_checkpoints["tiny-v1"], "tiny-v1-again"),
        "v1-gen": register(compat, "tiny-v1-gen"),
        "v2": register(demo_checkpoints["tiny-v2"], "tiny-v2"),
    }
    model_version_transition(version=out["v1"], to=ModelVersion.Status.ACTIVE, actor="alice")
    out["acme"] = tenant_get_or_create(slug="acme", name="Acme", actor="alice")
    out["owner"] = retention_owner_get_or_create(name="platform", email="platform@example.com", actor="alice")
    out["ns1"], _ = namespace_get_or_create(
        model_version=out["v1"], tenant=out["acme"], retention_owner=out["owner"], policy=DEMO_POLICY, actor="alice"
    )
    yield out
    shutil.rmtree(compat)


def _release(versions: dict, to: str) -> Release:
    return release_create(
        served_name="tiny", tenant=versions["acme"], from_version=versions["v1"], to_version=versions[to], actor="ci"
    )


def _engine(version: ModelVersion, namespace: CacheNamespace | None, name: str, role: str = "serving") -> Engine:
    return Engine.objects.create(
        name=name, model_version=version, namespace=namespace, base_url="http://127.0.0.1:9", status="ready", role=role,
        kv_connector="ExampleConnector" if namespace else "",
    )  # fmt: skip


def _comparison(versions: dict, to: str, *, deceptive: int, status: str = "succeeded") -> ComparisonJob:
    engine = _engine(versions[to], versions["ns1"], f"{to}-on-ns1-{deceptive}-{status}")
    reference = _engine(versions[to], None, f"{to}-ref-{deceptive}-{status}", role="reference")
    return ComparisonJob.objects.create(
        engine=engine, reference_engine=reference, namespace=versions["ns1"], status=status, deceptive_hits=deceptive, prompts=9
    )


pytestmark = pytest.mark.django_db


def test_each_classification(versions) -> None:
    identical = _release(versions, "v1-again")
    assert (identical.classification, identical.status, identical.decision) == ("identical", "ready", "reuse")
    assert identical.to_namespace_id == versions["ns1"].pk
    Release.objects.filter(pk=identical.pk).update(status="rolled_back")
    compatible = _release(versions, "v1-gen")
    assert (compatible.classification, compatible.status) == ("compatible", "decision_required")
    assert compatible.diff["differing"] == [] and sorted(compatible.diff["non_kv"]) == ["config_excluded", "generation_config"]
    written_by_transformers = json.loads((Path(versions["v1"].path) / "generation_config.json").read_text())
    assert compatible.diff["non_kv"]["generation_config"] == {
        "a": written_by_transformers,
        "b": {**written_by_transformers, "temperature": 0.3, "top_p": 0.9},
    }
    Release.objects.filter(pk=compatible.pk).update(status="rolled_back")
    incompatible = _release(versions, "v2")
    assert (incompatible.classification, incompatible.status) == ("incompatible", "decision_required")
    assert incompatible.diff["differing"] == ["weights"]
    with pytest.raises(ReleaseRefused, match="is still decision_required"):
        _release(versions, "v1-gen")
    assert [e.kind for e in ReleaseEvent.objects.filter(release=identical)] == ["created", "decided", "ready"]


def test_verified_reuse_needs_both_pieces_of_evidence(versions) -> None:
    release = _release(versions, "v1-gen")
    clean = _comparison(versions, "v1-gen", deceptive=0)
    with pytest.raises(ReleaseRefused, match="no tokenization evidence"):
        release_decide(release=release, decision="verified_reuse", actor="bob", reason="r", comparison_job=clean)
    evidence = release_collect_tokenization_evidence(release=release, actor="bob")
    assert evidence["identical"] is True and evidence["digest_a"] == evidence["digest_b"]
    assert evidence["summary"]["equal"] == len(load_corpus("diagnostic"))
    with pytest.raises(ReleaseRefused, match="no comparison job"):
        release_decide(release=release, decision="verified_reuse", actor="bob", reason="r")
    deceptive = _comparison(versions, "v1-gen", deceptive=3)
    with pytest.raises(ReleaseRefused, match=f"comparison job #{deceptive.pk} found 3 deceptive hits"):
        release_decide(release=release, decision="verified_reuse", actor="bob", reason="r", comparison_job=deceptive)
    with pytest.raises(ReleaseRefused, match="new_namespace is not allowed for a compatible release"):
        release_decide(release=release, decision="new_namespace", actor="bob", reason="r")
    assert Release.objects.get(pk=release.pk).status == "decision_required"
    decided = release_decide(release=release, decision="verified_reuse", actor="bob", reason="same inputs", comparison_job=clean)
    assert (decided.status, decided.decision, decided.to_namespace_id) == ("ready", "verified_reuse", versions["ns1"].pk)
    assert decided.comparison_job_id == clean.pk


def test_verified_reuse_is_refused_when_token_ids_differ(versions) -> None:
    release = _release(versions, "v1-gen")
    # Evidence as the tokenization diff reports it for two tokenizers whose chat formats differ.
    a = load_chat_tokenizer(mistral_common_tokenizer_path("v3"))
    b = load_chat_tokenizer(mistral_common_tokenizer_path("v7"))
    diffs = tokenization_diff(a, b, load_corpus("diagnostic"))
    first = next(d for d in diffs if d.status != "equal")
    Release.objects.filter(pk=release.pk).update(
        tokenization_evidence={
            "identical": summary(diffs)["identical"],
            "conversations": [
                {"conversation_id": d.conversation_id, "status": d.status, "first_difference": d.first_difference} for d in diffs
            ],
        }
    )
    release.refresh_from_db()
    with pytest.raises(ReleaseRefused, match=f"token ids differ: {first.conversation_id} at token {first.first_difference}"):
        release_decide(
            release=release,
            decision="verified_reuse",
            actor="bob",
            reason="r",
            comparison_job=_comparison(versions, "v1-gen", deceptive=0),
        )


def test_new_namespace_is_ready_only_after_its_prewarm_verified(versions) -> None:
    release = _release(versions, "v2")
    with pytest.raises(ReleaseRefused, match="new_namespace needs an engine serving tiny-v2"):
        release_decide(release=release, decision="new_namespace", actor="bob", reason="new weights")
    ns2, _ = namespace_get_or_create(
        model_version=versions["v2"], tenant=versions["acme"], retention_owner=versions["owner"], policy=DEMO_POLICY, actor="a"
    )
    engine = _engine(versions["v2"], ns2, "v2-serving")
    decided = release_decide(release=release, decision="new_namespace", actor="bob", reason="new weights", engine=engine)
    assert (decided.status, decided.to_namespace_id) == ("preparing", ns2.pk)
    job = PrewarmJob.objects.get(pk=decided.prewarm_job_id)
    assert (job.namespace_id, job.engine_id) == (ns2.pk, engine.pk)
    with pytest.raises(ReleaseRefused, match="no routing before it is ready"):
        release_routing(decided, actor="ci")
    with pytest.raises(ReleaseRefused, match=rf"is preparing \(prewarm job #{job.pk} queued, 0/18\): not ready to route"):
        release_mark_ready(release=decided, actor="ci")
    PrewarmJob.objects.filter(pk=job.pk).update(status=JobStatus.SUCCEEDED, verified=9)
    assert release_mark_ready(release=decided, actor="ci").status == "ready"
    events = list(ReleaseEvent.objects.filter(release=release).order_by("id").values_list("kind", "detail"))
    assert events[-2:] == [("ready", {"prewarm_job": job.pk, "verified": 9, "error": ""}), ("marked_ready", {})]


def test_gray_release_keeps_each_version_on_its_own_namespace(versions) -> None:
    release = _release(versions, "v2")
    ns2, _ = namespace_get_or_create(
        model_version=versions["v2"], tenant=versions["acme"], retention_owner=versions["owner"], policy=DEMO_POLICY, actor="a"
    )
    decided = release_decide(
        release=release, decision="new_namespace", actor="bob", reason="r", engine=_engine(versions["v2"], ns2, "v2-gray")
    )
    PrewarmJob.objects.filter(pk=decided.prewarm_job_id).update(status=JobStatus.SUCCEEDED)
    gray = release_set_traffic(release=release, percent=20, actor="bob")
    assert gray.traffic_percent == 20
    statuses = dict(ModelVersion.objects.filter(pk__in=[versions["v1"].pk, versions["v2"].pk]).values_list("label", "status"))
    assert statuses == {"tiny-v1": "active", "tiny-v2": "active"}
    routes = release_routing(gray, actor="ci")
    assert [(r["label"], r["percent"]) for r in routes] == [("tiny-v1", 80), ("tiny-v2", 20)]
    assert routes[0]["namespace_key"] != routes[1]["namespace_key"] and routes[0]["cache_salt"] != routes[1]["cache_salt"]
    # Every salt handed out is audited with who read it and why.
    reads = AuditEvent.objects.filter(action="namespace.read_salt", actor="ci").order_by("id")
    assert [(int(r.object_id), r.after) for r in reads] == [
        (routes[0]["namespace"], {"purpose": f"routing of release #{gray.pk}"}),
        (routes[1]["namespace"], {"purpose": f"routing of release #{gray.pk}"}),
    ]
    # Both versions active: the version policy keeps both namespaces hot.
    plan = eviction_plan(actor="alice", only=[versions["ns1"], ns2])
    assert plan.actions.count() == 0
    with pytest.raises(InvalidField) as beyond:
        release_set_traffic(release=release, percent=101, actor="bob")
    assert beyond.value.fields() == {"percent": ["must be within 0..100, got 101"]}
    done = release_set_traffic(release=release, percent=100, actor="bob")
    assert [r["percent"] for r in release_routing(done, actor="ci")] == [0, 100]
    assert ModelVersion.objects.get(pk=versions["v1"].pk).status == "draining"


def test_rollback_to_a_hot_namespace(versions) -> None:
    release = _release(versions, "v1-gen")
    release_collect_tokenization_evidence(release=release, actor="bob")
    release_decide(
        release=release,
        decision="verified_reuse",
        actor="bob",
        reason="r",
        comparison_job=_comparison(versions, "v1-gen", deceptive=0),
    )
    release_set_traffic(release=release, percent=100, actor="bob")
    with pytest.raises(ValidationError) as blank:
        release_rollback(release=release, actor="bob", reason="")
    assert blank.value.message_dict == {"reason": ["a rollback needs a reason"]}
    back = release_rollback(release=release, actor="bob", reason="latency regression")
    assert (back.status, back.traffic_percent) == ("rolled_back", 0)
    statuses = dict(ModelVersion.objects.filter(pk__in=[versions["v1"].pk, versions["v1-gen"].pk]).values_list("label", "status"))
    assert statuses == {"tiny-v1": "active", "tiny-v1-gen": "draining"}
    assert ReleaseEvent.objects.get(release=release, kind="rolled_back").detail["how"] == "still hot"
    with pytest.raises(ReleaseRefused, match="is rolled_back: nothing to roll back"):
        release_rollback(release=release, actor="bob", reason="again")


def test_rollback_restores_a_demoted_namespace_from_the_cold_tier(versions, settings) -> None:
    ns1 = versions["ns1"]
    for e in range(3):
        write_entry(settings.KV_STORE_ROOT, ns1.storage_prefix, f"{e:064x}", size=500, age_s=60)
    release = _release(versions, "v2")
    ns2, _ = namespace_get_or_create(
        model_version=versions["v2"], tenant=versions["acme"], retention_owner=versions["owner"], policy=DEMO_POLICY, actor="a"
    )
    decided = release_decide(
        release=release, decision="new_namespace", actor="bob", reason="r", engine=_engine(versions["v2"], ns2, "v2-cold")
    )
    PrewarmJob.objects.filter(pk=decided.prewarm_job_id).update(status=JobStatus.SUCCEEDED)
    release_set_traffic(release=release, percent=100, actor="bob")
    # v1 is draining and the oldest of four versions of tiny: with one version hot
    # and three cold, eviction demotes its namespace.
    ns1.policy.versions_kept, ns1.policy.cold_versions_kept = 1, 3
    ns1.policy.save()
    run = eviction_plan(actor="alice", only=[ns1])
    eviction_run_approve(run=run, actor="alice", reason="v2 out")
    assert eviction_run_execute(run_id=run.pk) == "succeeded"
    assert CacheNamespace.objects.get(pk=ns1.pk).residency == Residency.COLD
    assert not namespace_storage_path(ns1).exists()
    back = release_rollback(release=Release.objects.get(pk=release.pk), actor="bob", reason="bad answers")
    assert back.status == "rolled_back"
    event = ReleaseEvent.objects.get(release=release, kind="rolled_back").detail
    assert (event["how"], event["entries_restored"]) == ("restored from the cold tier", 3)
    assert CacheNamespace.objects.get(pk=ns1.pk).residency == Residency.HOT
    assert sorted(p.name for p in namespace_storage_path(ns1).iterdir()) == [f"{e:064x}" for e in range(3)]


def test_purge_then_rollback_needs_a_new_decision(versions, settings) -> None:
    write_entry(settings.KV_STORE_ROOT, versions["ns1"].storage_prefix, "a" * 64, size=500, age_s=60)
    release = _release(versions, "v2")
    decided = release_decide(release=release, decision="purge", actor="bob", reason="tokenizer bug in v1")
    assert decided.status == "preparing"
    run = EvictionRun.objects.get(pk=decided.eviction_run_id)
    assert (run.status, run.approved_by) == ("queued", "bob")
    assert eviction_run_execute(run_id=run.pk) == "succeeded"
    ready = release_sync(Release.objects.get(pk=release.pk))
    assert ready.status == "ready"
    assert CacheNamespace.objects.get(pk=versions["ns1"].pk).residency == Residency.DROPPED
    with pytest.raises(ReleaseRefused, match="the previous namespace of tiny-v1 was dropped"):
        release_rollback(release=ready, actor="bob", reason="oops")


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_decisions_one_wins(versions) -> None:
    release = _release(versions, "v2")
    outcomes: list[str] = []
    barrier = threading.Barrier(2)

    def decide(who: str) -> None:
        barrier.wait()
        try:
            release_decide(release=Release.objects.get(pk=release.pk), decision="purge", actor=who, reason="r")
            outcomes.append(f"{who}: won")
        except ReleaseConflict as exc:
            outcomes.append(f"{who}: {exc}")
        finally:
            connection.close()

    threads = [threading.Thread(target=decide, args=(who,)) for who in ("alice", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [o for o in outcomes if o.endswith("won")]
    assert len(won) == 1, outcomes
    winner = won[0].split(":")[0]
    loser = next(o for o in outcomes if not o.endswith("won"))
    assert f"was decided by {winner} (purge)" in loser or "is preparing" in loser
    assert Release.objects.get(pk=release.pk).decided_by == winner
    assert EvictionRun.objects.count() == 1


def _client(scope: str = "operate") -> APIClient:
    _, key = api_token_issue(
        user=User.objects.create_user(f"u-{time.monotonic_ns()}"), name="ci", scope=scope, tenant=None, actor="s"
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def test_the_api_acts_once_per_idempotency_key(versions) -> None:
    client = _client()
    body = {"served_name": "tiny", "tenant": "acme", "from_version": versions["v1"].pk, "to_version": versions["v2"].pk}
    missing = client.post("/api/releases/", body, format="json")
    assert missing.status_code == 400 and list(missing.json()["error"]["fields"]) == ["Idempotency-Key"]
    first = client.post("/api/releases/", body, format="json", HTTP_IDEMPOTENCY_KEY="deploy-42")
    assert first.status_code == 201, first.json()
    retry = client.post("/api/releases/", body, format="json", HTTP_IDEMPOTENCY_KEY="deploy-42")
    assert (retry.status_code, retry.json()["id"], retry["Idempotent-Replayed"]) == (201, first.json()["id"], "true")
    assert Release.objects.count() == 1
    # Without the trailing slash it is the same route: a replay, not a conflict.
    slashless = client.post("/api/releases", body, format="json", HTTP_IDEMPOTENCY_KEY="deploy-42")
    assert (slashless.status_code, slashless["Idempotent-Replayed"]) == (201, "true")
    other = client.post("/api/releases/", {**body, "served_name": "x"}, format="json", HTTP_IDEMPOTENCY_KEY="deploy-42")
    assert (other.status_code, other.json()["error"]["code"]) == (409, "idempotency_conflict")
    rid = first.json()["id"]
    decide = {"decision": "purge", "reason": "v1 tokenizer bug"}
    a = client.post(f"/api/releases/{rid}/decide/", decide, format="json", HTTP_IDEMPOTENCY_KEY="decide-1")
    b = client.post(f"/api/releases/{rid}/decide/", decide, format="json", HTTP_IDEMPOTENCY_KEY="decide-1")
    assert a.status_code == b.status_code == 200 and a.json() == b.json()
    assert ReleaseEvent.objects.filter(release_id=rid, kind="decided").count() == 1
    again = client.post(f"/api/releases/{rid}/decide/", decide, format="json", HTTP_IDEMPOTENCY_KEY="decide-2")
    assert (again.status_code, again.json()["error"]["code"]) == (409, "release_conflict")
    # Rolled back while the purge is still queued: the purge is cancelled, the old namespace stays.
    back = client.post(f"/api/releases/{rid}/rollback/", {"reason": "wrong build"}, format="json", HTTP_IDEMPOTENCY_KEY="rb-1")
    assert (back.status_code, back.json()["status"]) == (200, "rolled_back")
    assert EvictionRun.objects.get(pk=a.json()["eviction_run"]).status == "cancelled"
    timeline = client.get(f"/api/releases/{rid}/timeline/").json()
    assert [e["kind"] for e in timeline][:2] == ["created", "decided"]
    assert _client("read").post("/api/releases/", body, format="json", HTTP_IDEMPOTENCY_KEY="k").status_code == 403


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_release_command_exit_codes(versions) -> None:
    env = subprocess_env()
    plan = manage(
        "release", "plan", "--served-name", "tiny", "--tenant", "acme", "--from", str(versions["v1"].pk), "--to",
        str(versions["v2"].pk), env=env,
    )  # fmt: skip
    assert plan.returncode == 3, plan.stderr
    out = json.loads(plan.stdout)
    assert (out["classification"], out["status"], out["differing"]) == ("incompatible", "decision_required", ["weights"])
    refused = manage("release", "decide", str(out["id"]), "--decision", "verified_reuse", "--reason", "r", env=env)
    assert refused.returncode == 4 and "verified_reuse is not allowed for an incompatible release" in refused.stderr
    bad = manage("release", "decide", "999", "--decision", "purge", "--reason", "r", env=env)
    assert bad.returncode == 2 and bad.stderr.strip() == "CommandError: no release 999"
    # Bad input is exit 2, before any state is looked at: a blank reason, a share beyond 0..100, other scripts' digits.
    for args, message in (
        (("decide", str(out["id"]), "--decision", "purge", "--reason", " "), "CommandError: reason: a decision needs a reason"),
        (("rollback", str(out["id"]), "--reason", ""), "CommandError: reason: a rollback needs a reason"),
        (("traffic", str(out["id"]), "--percent", "101"), "argument --percent: 101 is not within 0..100"),
        (("traffic", str(out["id"]), "--percent", "-1"), "argument --percent: -1 is not within 0..100"),
        (("traffic", str(out["id"]), "--percent", "١٠"), "argument --percent: '١٠' is not an integer"),
    ):
        refused = manage("release", *args, env=env)
        assert refused.returncode == 2 and message in refused.stderr, (args, refused.stderr)
    assert Release.objects.get(pk=out["id"]).status == "decision_required"
    purge = manage("release", "decide", str(out["id"]), "--decision", "purge", "--reason", "v1 bug", env=env)
    assert purge.returncode == 5, purge.stderr  # preparing: the purge has to run first
    status = manage("release", "status", str(out["id"]), env=env)
    assert status.returncode == 5 and json.loads(status.stdout)["timeline"][1]["kind"] == "decided"


def test_release_page_shows_the_diff_and_lets_staff_decide(versions, admin_client, client) -> None:
    release = _release(versions, "v2")
    page = admin_client.get(f"/releases/{release.pk}/").content.decode()
    # Only the weights differ: the heading names them, not every identity field.
    assert "<b>incompatible: weights changed</b>" in page
    assert "<td>weights</td>" in page and "Required: new_namespace or purge." in page
    # Timeline details are key: JSON, never a Python repr.
    # Keys in one order on both databases (jsonb reorders them).
    details = "classification: <code>incompatible</code>; differing: <code>[&quot;weights&quot;]</code>; non_kv: <code>[]</code>"
    assert details in page and "{&#x27;" not in page
    refused = admin_client.post(f"/releases/{release.pk}/", {"action": "decide", "decision": "verified_reuse", "reason": "r"})
    assert refused.status_code == 400 and "verified_reuse is not allowed for an incompatible release" in refused.content.decode()
    bad_engine = admin_client.post(
        f"/releases/{release.pk}/", {"action": "decide", "decision": "new_namespace", "reason": "r", "engine": "99999"}
    )
    assert bad_engine.status_code == 400 and "no engine &#x27;99999&#x27;" in bad_engine.content.decode()
    # The refused form keeps what was typed.
    kept = bad_engine.content.decode()
    assert (
        '<option value="new_namespace" selected>' in kept and 'name="engine" size="6" inputmode="numeric" value="99999"' in kept
    )
    assert 'name="reason" required maxlength="2000" size="40" value="r"' in kept
    client.force_login(User.objects.create_user("viewer"))
    assert client.post(f"/releases/{release.pk}/", {"action": "decide", "decision": "purge", "reason": "r"}).status_code == 403
    decided = admin_client.post(f"/releases/{release.pk}/", {"action": "decide", "decision": "purge", "reason": "v1 bug"})
    assert decided.status_code == 302
    release.refresh_from_db()
    assert (release.decision, release.decided_by, release.status) == ("purge", "admin (page)", "preparing")
    assert "decided" in admin_client.get(f"/releases/{release.pk}/").content.decode()


def test_a_new_namespace_is_prewarmed_with_the_old_ones_hottest_prefixes(versions) -> None:
    from cacheadmin.services.heat import corpus_load

    client = _client()
    ns1 = versions["ns1"]
    hot = [{"role": "system", "content": "You answer billing questions."}, {"role": "user", "content": "Refund status?"}]
    warm = [{"role": "user", "content": "Opening hours?"}]
    for messages, hits in ((hot, 40), (warm, 3), (hot, 2)):
        reported = client.post(f"/api/namespaces/{ns1.pk}/prefix-heat/", {"messages": messages, "hits": hits}, format="json")
        assert reported.status_code == 200, reported.json()
    listed = client.get(f"/api/namespaces/{ns1.pk}/prefix-heat/").json()
    assert [(row["hits"], row["messages"][-1]["content"]) for row in listed] == [(42, "Refund status?"), (3, "Opening hours?")]
    for body, field in (
        ({"messages": [{"role": "assistant", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "hits": 0}, "hits"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages"),
    ):
        bad = client.post(f"/api/namespaces/{ns1.pk}/prefix-heat/", body, format="json")
        assert bad.status_code == 400 and list(bad.json()["error"]["fields"]) == [field], bad.json()
    assert PrefixHeat.objects.filter(namespace=ns1).count() == 2
    release = _release(versions, "v2")
    ns2, _ = namespace_get_or_create(
        model_version=versions["v2"], tenant=versions["acme"], retention_owner=versions["owner"], policy=DEMO_POLICY, actor="a"
    )
    decided = release_decide(
        release=release, decision="new_namespace", actor="bob", reason="r", engine=_engine(versions["v2"], ns2, "v2-heat")
    )
    job = PrewarmJob.objects.get(pk=decided.prewarm_job_id)
    assert (job.corpus, job.prompts) == (f"heat:{ns1.pk}", 2)
    assert [c.messages[-1]["content"] for c in corpus_load(job.corpus)] == ["Refund status?", "Opening hours?"]
    with pytest.raises(ValueError, match="no prefix heat reported for namespace '999'"):
        corpus_load("heat:999")
    # Live traffic keeps reporting heat after the job was created: every attempt runs the prompts chosen then,
    # in that order (results are keyed by position), not today's hottest.
    hotter = [{"role": "user", "content": "Cancel my plan"}]
    reported = client.post(f"/api/namespaces/{ns1.pk}/prefix-heat/", {"messages": hotter, "hits": 99}, format="json")
    assert reported.status_code == 200
    assert [c.messages[-1]["content"] for c in corpus_load(job.corpus)][0] == "Cancel my plan"
    assert job.corpus_digests == [r.digest for r in PrefixHeat.objects.filter(namespace=ns1).exclude(hits=99).order_by("-hits")]
    pinned = corpus_load(job.corpus, for_namespace=job.namespace, digests=job.corpus_digests)
    assert [c.messages[-1]["content"] for c in pinned] == ["Refund status?", "Opening hours?"]
    # A pinned prompt that is gone fails the job's run with the reason, before any engine is asked.
    PrefixHeat.objects.filter(digest=job.corpus_digests[1]).delete()
    prewarm_job_run(job_id=job.pk)
    job.refresh_from_db()
    assert (job.status, job.error) == (
        "failed", f"corpus 'heat:{ns1.pk}': 1 of the 2 prompts pinned when the job was created are no longer there "
        "(deleted with their namespace)",
    )  # fmt: skip
    assert job.results.count() == 0


def test_prefix_heat_saturates_at_64_bits(versions) -> None:
    client = _client()
    url = f"/api/namespaces/{versions['ns1'].pk}/prefix-heat/"
    messages = [{"role": "user", "content": "Refund status?"}]
    for hits in (MAX_HITS - 5, 10, MAX_HITS):
        assert client.post(url, {"messages": messages, "hits": hits}, format="json").status_code == 200
    assert [row["hits"] for row in client.get(url).json()] == [9223372036854775807]  # saturated, not wrapped
    too_big = client.post(url, {"messages": messages, "hits": MAX_HITS + 1}, format="json")
    assert too_big.status_code == 400 and list(too_big.json()["error"]["fields"]) == ["hits"]
    assert [row["hits"] for row in client.get(url).json()] == [9223372036854775807]


def test_the_new_namespace_of_a_failed_release_is_an_orphan(versions) -> None:
    from cacheadmin.services.accounting import orphans_report

    release = _release(versions, "v2")
    ns2, _ = namespace_get_or_create(
        model_version=versions["v2"], tenant=versions["acme"], retention_owner=versions["owner"], policy=DEMO_POLICY, actor="a"
    )
    decided = release_decide(
        release=release, decision="new_namespace", actor="bob", reason="r", engine=_engine(versions["v2"], ns2, "v2-fail")
    )
    PrewarmJob.objects.filter(pk=decided.prewarm_job_id).update(status=JobStatus.FAILED, error="engine died")
    failed = release_sync(decided)
    assert (failed.status, failed.error) == ("failed", f"prewarm job #{decided.prewarm_job_id} failed: engine died")
    assert [(n["id"], n["why"]) for n in orphans_report()["namespaces"]] == [(ns2.pk, "the new namespace of a failed release")]


def test_a_nested_config_change_reaches_the_classification(versions, demo_checkpoints, model_root: Path, tmp_path: Path) -> None:
    """A change deep inside the config is incompatible like a top-level one; a
    change only to what the engine does not compute with is compatible."""
    copies = []

    def variant(name: str, edit: dict) -> ModelVersion:
        path = model_root / f"tiny-v1-{name}-{tmp_path.name}"
        shutil.copytree(demo_checkpoints["tiny-v1"], path)
        copies.append(path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **edit}))
        return model_version_register(path=path, label=f"tiny-v1-{name}", served_name="tiny", layout=LAYOUT, actor="alice")[0]

    def quant(dtype: str) -> dict:
        spec = {"dtype": dtype, "qscheme": "per_group", "group_size": 32}
        return {"quantization_config": {"quant_method": "quark", "global_quant_config": {"input_tensors": spec}}}

    try:
        fp4, fp6 = variant("fp4", quant("fp4")), variant("fp6", quant("fp6_e2m3"))
        dropout = variant("dropout", {"attention_dropout": 0.1, "initializer_range": 0.02})
        model_version_transition(version=fp4, to=ModelVersion.Status.ACTIVE, actor="alice")
        namespace_get_or_create(
            model_version=fp4, tenant=versions["acme"], retention_owner=versions["owner"], policy=DEMO_POLICY, actor="a"
        )
        nested = release_create(served_name="tiny", tenant=versions["acme"], from_version=fp4, to_version=fp6, actor="ci")
        assert (nested.classification, nested.diff["differing"]) == ("incompatible", ["config"])
        assert nested.diff["fields"]["config"]["changes"] == [
            {
                "key": "quantization_config.global_quant_config.input_tensors.dtype",
                "change": "changed",
                "a": "fp4",
                "b": "fp6_e2m3",
            }
        ]
        Release.objects.filter(pk=nested.pk).delete()  # only its classification mattered
        compatible = release_create(
            served_name="tiny", tenant=versions["acme"], from_version=versions["v1"], to_version=dropout, actor="ci"
        )
        assert (compatible.classification, compatible.diff["differing"]) == ("compatible", [])
        assert compatible.diff["non_kv"]["config_excluded"]["b"]["attention_dropout"] == 0.1
    finally:
        for path in copies:
            shutil.rmtree(path)


def _new_namespace_release(versions: dict, tenant: Tenant, engine_name: str) -> Release:
    """A v1 → v2 release for ``tenant`` decided new_namespace, its prewarm done: ready at 0%."""
    release = release_create(
        served_name="tiny", tenant=tenant, from_version=versions["v1"], to_version=versions["v2"], actor="ci"
    )
    ns2, _ = namespace_get_or_create(
        model_version=versions["v2"], tenant=tenant, retention_owner=versions["owner"], policy=DEMO_POLICY, actor="a"
    )
    decided = release_decide(
        release=release, decision="new_namespace", actor="bob", reason="r", engine=_engine(versions["v2"], ns2, engine_name)
    )
    PrewarmJob.objects.filter(pk=decided.prewarm_job_id).update(status=JobStatus.SUCCEEDED)
    return release_sync(decided)


def _statuses(versions: dict) -> tuple[str, str]:
    return tuple(ModelVersion.objects.get(pk=versions[v].pk).status for v in ("v1", "v2"))


def _shares(release: Release) -> list[tuple[str, int]]:
    return [(r["label"], r["percent"]) for r in release_routing(Release.objects.get(pk=release.pk), actor="ci")]


def test_two_tenants_sharing_versions_status_follows_routing(versions) -> None:
    """Gray releases, rollbacks and a purge for two tenants on the same versions:
    a version is active exactly while some tenant's routing sends it traffic."""
    globex = tenant_get_or_create(slug="globex", name="Globex", actor="alice")
    ns1_globex, _ = namespace_get_or_create(
        model_version=versions["v1"], tenant=globex, retention_owner=versions["owner"], policy=DEMO_POLICY, actor="alice"
    )
    a = _new_namespace_release(versions, versions["acme"], "v2-acme")
    b = _new_namespace_release(versions, globex, "v2-globex")
    assert (a.status, b.status, _statuses(versions)) == ("ready", "ready", ("active", "registered"))
    release_set_traffic(release=a, percent=50, actor="bob")
    release_set_traffic(release=b, percent=100, actor="bob")
    # Globex left v1 entirely; acme still sends it half its traffic.
    assert _statuses(versions) == ("active", "active")
    assert (_shares(a), _shares(b)) == ([("tiny-v1", 50), ("tiny-v2", 50)], [("tiny-v1", 0), ("tiny-v2", 100)])
    release_rollback(release=b, actor="bob", reason="globex regression")
    # Globex is back on v1; acme still sends v2 half its traffic: v2 stays active.
    assert _statuses(versions) == ("active", "active")
    assert _shares(b) == [("tiny-v1", 100), ("tiny-v2", 0)]
    release_set_traffic(release=a, percent=100, actor="bob")
    assert _statuses(versions) == ("active", "active")  # v1 still serves globex
    with pytest.raises(LifecycleError, match=r"tiny-v1 still serves traffic \(100% of release #\d+\); it cannot become draining"):
        model_version_transition(version=ModelVersion.objects.get(pk=versions["v1"].pk), to="draining", actor="x")
    # Globex's next release purges v1's namespace: at ready all its traffic is on v2, none on the dropped namespace.
    c = release_create(served_name="tiny", tenant=globex, from_version=versions["v1"], to_version=versions["v2"], actor="ci")
    c = release_decide(release=c, decision="purge", actor="bob", reason="v1 cache suspect")
    assert eviction_run_execute(run_id=c.eviction_run_id) == "succeeded"
    c = Release.objects.get(pk=c.pk)
    assert (c.status, c.traffic_percent) == ("ready", 100)
    assert CacheNamespace.objects.get(pk=ns1_globex.pk).residency == Residency.DROPPED
    assert _shares(c) == [("tiny-v2", 100)]
    assert _statuses(versions) == ("draining", "active")
    with pytest.raises(ReleaseRefused, match=r"purged tiny-v1's namespace: all traffic stays on tiny-v2"):
        release_set_traffic(release=c, percent=50, actor="bob")
    # B's rolled-back release is superseded by C: it no longer routes, and cannot move traffic.
    with pytest.raises(ReleaseRefused, match=rf"release #{c.pk} now routes tiny for globex: route by that one instead"):
        release_routing(Release.objects.get(pk=b.pk), actor="ci")
    # Acme rolls back: v1 serves again, v2 still serves globex.
    release_rollback(release=Release.objects.get(pk=a.pk), actor="bob", reason="acme regression")
    assert _statuses(versions) == ("active", "active")


def test_a_new_release_starts_from_the_version_carrying_all_traffic(versions) -> None:
    a = _new_namespace_release(versions, versions["acme"], "v2-split")
    release_set_traffic(release=a, percent=30, actor="bob")
    with pytest.raises(ReleaseRefused, match=rf"release #{a.pk} routes tiny for acme as tiny-v1 70%, tiny-v2 30%"):
        _release(versions, "v1-gen")


def test_reads_do_not_move_a_release(versions, settings) -> None:
    """GET on the release, its routing, the page and the CLI's status change nothing;
    the job-end event or the recovery sweep moves it."""
    release = _release(versions, "v2")
    ns2, _ = namespace_get_or_create(
        model_version=versions["v2"], tenant=versions["acme"], retention_owner=versions["owner"], policy=DEMO_POLICY, actor="a"
    )
    decided = release_decide(
        release=release, decision="new_namespace", actor="bob", reason="r", engine=_engine(versions["v2"], ns2, "v2-reads")
    )
    PrewarmJob.objects.filter(pk=decided.prewarm_job_id).update(status=JobStatus.SUCCEEDED, verified=4)
    api = _client("operate")
    assert api.get(f"/api/releases/{release.pk}/").json()["status"] == "preparing"
    assert api.get(f"/api/releases/{release.pk}/routing/").status_code == 409
    staff = User.objects.create_user("viewer", password="pw-viewer-123456", is_staff=True)
    page = APIClient()
    page.force_login(staff)
    assert page.get(f"/releases/{release.pk}/").status_code == 200
    assert Release.objects.get(pk=release.pk).status == "preparing"
    assert ReleaseEvent.objects.filter(release=release, kind="ready").count() == 0
    assert releases_sync_pending() == 1
    assert Release.objects.get(pk=release.pk).status == "ready"
    assert releases_sync_pending() == 0


def test_traffic_is_not_moved_onto_a_namespace_demoted_since_the_release_was_ready(versions) -> None:
    release = _new_namespace_release(versions, versions["acme"], "v2-stale")
    ns2 = release.to_namespace
    assert release_set_traffic(release=release, percent=10, actor="bob").traffic_percent == 10
    CacheNamespace.objects.filter(pk=ns2.pk).update(residency=Residency.COLD)  # an eviction demoted it meanwhile
    with pytest.raises(ReleaseRefused) as refused:
        release_set_traffic(release=release, percent=100, actor="bob")
    assert str(refused.value) == (
        f"namespace {ns2.pk} of release #{release.pk} is cold since the release was prepared: traffic is not moved onto it "
        "(roll back, or plan a new release)"
    )
    assert Release.objects.get(pk=release.pk).traffic_percent == 10
    assert ReleaseEvent.objects.filter(release=release, kind="traffic").count() == 1


def test_a_rollback_whose_namespace_is_dropped_while_it_restores_routes_nothing(versions, settings, monkeypatch) -> None:
    ns1 = versions["ns1"]
    release = _new_namespace_release(versions, versions["acme"], "v2-drop")
    release_set_traffic(release=release, percent=100, actor="bob")
    CacheNamespace.objects.filter(pk=ns1.pk).update(residency=Residency.COLD)

    def restored_while_an_eviction_drops_it(**_kwargs: object) -> int:
        CacheNamespace.objects.filter(pk=ns1.pk).update(residency=Residency.DROPPED)
        return 3

    monkeypatch.setattr(releases_service, "tier_load_counted", restored_while_an_eviction_drops_it)
    with pytest.raises(ReleaseConflict) as conflict:
        release_rollback(release=Release.objects.get(pk=release.pk), actor="bob", reason="bad answers")
    assert str(conflict.value) == (
        f"namespace {ns1.pk} of tiny-v1 went from cold to dropped during the rollback: nothing was routed; roll back again, "
        "or create a release back to it"
    )
    assert (Release.objects.get(pk=release.pk).status, CacheNamespace.objects.get(pk=ns1.pk).residency) == ("ready", "dropped")
    assert not ReleaseEvent.objects.filter(release=release, kind="rolled_back").exists()
