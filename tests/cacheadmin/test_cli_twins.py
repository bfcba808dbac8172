"""The CLI twins of the API's writes, as a user runs them: exit codes, one-line
errors, audited changes, and nothing written on bad input."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from django.conf import settings

from cacheadmin.management.base import cli_actor
from cacheadmin.models import AuditEvent, CacheNamespace, Engine, ModelVersion, PrewarmJob, RetentionOwner, Tenant
from inference.identity import cache_salt
from tests.helpers import manage, subprocess_env

pytestmark = pytest.mark.django_db(transaction=True)
PROJECT_TMP = Path(tempfile.gettempdir())


def run(*args: str):
    return manage(*args, env=subprocess_env())


def one_line_error(proc, code: int, text: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], proc.stderr


@pytest.mark.slow
def test_tenants_owners_namespaces_and_policies_from_the_cli() -> None:
    version = ModelVersion.objects.create(
        label="v1", served_name="tiny", path="/m", weights="a" * 64, tokenizer="b" * 64, config="c" * 64, layout="d" * 64,
        adapters="e" * 64, identity="1" * 64, inputs={"layout": {"block_size": 32}},
    )  # fmt: skip
    assert json.loads(run("tenant", "create", "acme", "--name", "Acme").stdout)["slug"] == "acme"
    one_line_error(run("tenant", "create", "acme", "--name", "Again"), 2, "already exists")
    one_line_error(run("tenant", "create", "Bad Slug", "--name", "x"), 2, "slug: ")
    assert run("tenant", "owner", "Platform", "--email", "p@example.com").returncode == 0
    one_line_error(run("tenant", "owner", "ＰＬＡＴＦＯＲＭ", "--email", "p@example.com"), 2, "already exists")
    one_line_error(run("tenant", "owner", "storage", "--email", "not-an-email"), 2, "email")

    base = ["namespace", "create", "--model-version", str(version.pk), "--tenant", "acme", "--owner", "platform"]
    one_line_error(run(*base, "--max-bytes", "none", "--versions-kept", "1"), 2, "--max-age-s")
    policy = ["--max-age-s", "3600", "--max-bytes", "none", "--versions-kept", "2"]
    one_line_error(run(*base, *policy, "--pin", "--hold-by", "legal"), 2, "hold_reason: a hold needs a reason")
    one_line_error(run(*base[:-1], "nobody", *policy), 2, "no retention owner 'nobody'")
    huge = ["--max-age-s", "99999999999999999999", "--max-bytes", "none", "--versions-kept", "1"]
    one_line_error(run(*base, *huge), 2, "99999999999999999999 is larger than 9223372036854775807")
    assert CacheNamespace.objects.count() == 0
    created = json.loads(run(*base, *policy, "--json").stdout)
    assert (created["tenant"], created["policy"]["max_bytes"], created["policy"]["versions_kept"]) == ("acme", None, 2)
    ns = CacheNamespace.objects.get()
    updated = run("namespace", "policy", str(ns.pk), "--max-age-s", "60", "--max-bytes", "1024", "--versions-kept", "1",
                  "--reason", "smaller budget", "--json")  # fmt: skip
    assert json.loads(updated.stdout)["policy"]["max_bytes"] == 1024
    assert AuditEvent.objects.get(action="namespace.policy_update").reason == "smaller budget"
    heat_file = PROJECT_TMP / f"heat-{ns.pk}.json"
    heat_file.write_text(json.dumps({"messages": [{"role": "user", "content": "Refund status?"}]}))
    try:
        reported = json.loads(run("namespace", "heat", str(ns.pk), str(heat_file), "--hits", "5").stdout)
        assert reported["hits"] == 5
        assert json.loads(run("namespace", "heat", str(ns.pk), str(heat_file)).stdout)["hits"] == 6
        heat_file.write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}))
        one_line_error(run("namespace", "heat", str(ns.pk), str(heat_file)), 2, "must end on a user or tool turn")
        one_line_error(run("namespace", "heat", str(ns.pk), "/nonexistent.json"), 2, "/nonexistent.json")
        heat_file.write_text('{"messages": [{"role": "user", "content": "a", "content": "b"}]}')
        one_line_error(run("namespace", "heat", str(ns.pk), str(heat_file)), 2, "duplicate key 'content'")
    finally:
        heat_file.unlink()
    salt = run("namespace", "salt", str(ns.pk)).stdout.strip()
    assert salt == cache_salt(settings.CACHE_SALT_SECRET, ns.namespace_key)


@pytest.mark.slow
def test_jobs_and_engines_from_the_cli() -> None:
    version = ModelVersion.objects.create(
        label="v1", served_name="tiny", path="/m", weights="a" * 64, tokenizer="b" * 64, config="c" * 64, layout="d" * 64,
        adapters="e" * 64, identity="1" * 64, inputs={"layout": {"block_size": 32}},
    )  # fmt: skip
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    ns = CacheNamespace.objects.create(
        namespace_key="f" * 64, model_version=version, tenant=tenant, retention_owner=owner, storage_prefix="ns-f"
    )
    engine = Engine.objects.create(
        name="e",
        model_version=version,
        namespace=ns,
        base_url="http://127.0.0.1:9",
        status="stopped",
        kv_connector="ExampleConnector",
    )
    one_line_error(run("job", "prewarm", "--namespace", str(ns.pk), "--engine", str(engine.pk)), 4, "is stopped, not ready")
    one_line_error(run("job", "prewarm", "--namespace", "999", "--engine", str(engine.pk)), 2, "no namespace 999")
    assert PrewarmJob.objects.count() == 0
    job = PrewarmJob.objects.create(namespace=ns, engine=engine)
    cancelled = json.loads(run("job", "cancel", "prewarm", str(job.pk), "--reason", "wrong corpus").stdout)
    assert cancelled["status"] == "cancelled"
    one_line_error(run("job", "cancel", "prewarm", str(job.pk)), 4, "already ended")
    globex = Tenant.objects.create(slug="globex", name="G")
    other = CacheNamespace.objects.create(
        namespace_key="e" * 64, model_version=version, tenant=globex, retention_owner=owner, storage_prefix="ns-e"
    )
    one_line_error(run("engine", "attach", str(engine.pk), str(other.pk)), 4, "ignores cache_salt")
    assert list(engine.attached_namespaces.all()) == []


@pytest.mark.slow
def test_shared_groups_from_the_cli() -> None:
    version = ModelVersion.objects.create(
        label="v1", served_name="tiny", path="/m", weights="a" * 64, tokenizer="b" * 64, config="c" * 64, layout="d" * 64,
        adapters="e" * 64, identity="1" * 64, inputs={"layout": {"block_size": 32}},
    )  # fmt: skip
    for slug in ("acme", "globex"):
        Tenant.objects.create(slug=slug, name=slug)
    RetentionOwner.objects.create(name="platform", email="p@example.com")
    assert json.loads(run("group", "create", "partners", "--name", "Partners").stdout)["generation"] == 1
    one_line_error(run("group", "create", "partners", "--name", "Again"), 4, "shared group 'partners' already exists")
    one_line_error(run("group", "create", "Bad", "--name", "x"), 2, "slug:")
    one_line_error(run("group", "join", "partners", "acme"), 2, "--reason")
    for slug in ("acme", "globex"):
        joined = json.loads(run("group", "join", "partners", slug, "--reason", "shared FAQ").stdout)
    assert joined["members"] == ["acme", "globex"]
    one_line_error(run("group", "join", "partners", "acme", "--reason", "again"), 4, "already a member")
    one_line_error(run("group", "join", "nobody", "acme", "--reason", "x"), 2, "no shared group 'nobody'")
    policy = ["--max-age-s", "3600", "--max-bytes", "none", "--versions-kept", "1", "--json"]
    base = ["namespace", "create", "--model-version", str(version.pk), "--owner", "platform"]
    one_line_error(run(*base, "--tenant", "acme", "--group", "partners", *policy), 2, "not allowed with argument")
    shared = json.loads(run(*base, "--group", "partners", *policy).stdout)
    assert (shared["group"], shared["tenant"]) == ("partners", None)
    left = json.loads(run("group", "leave", "partners", "globex", "--reason", "contract ended").stdout)
    assert (left["generation"], left["members"]) == (2, ["acme"])
    one_line_error(run("namespace", "salt", str(shared["id"])), 4, "a member left")
    renewed = json.loads(run(*base, "--group", "partners", *policy).stdout)
    assert renewed["namespace_key"] != shared["namespace_key"]
    assert run("namespace", "salt", str(renewed["id"])).returncode == 0
    assert [e.action for e in AuditEvent.objects.order_by("id")].count("shared_group.join") == 2


@pytest.mark.slow
def test_eviction_and_accounting_from_the_cli(tmp_path) -> None:
    from cacheadmin.models import EvictionRun, RetentionPolicy
    from tests.cacheadmin.test_eviction import write_entry

    env = subprocess_env(KV_STORE_ROOT=str(tmp_path / "kv"), KV_COLD_ROOT=str(tmp_path / "cold"), KV_REDIS_URL="")
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    namespaces = []
    for i, status in enumerate(("retired", "active")):
        version = ModelVersion.objects.create(
            label=f"v{i}", served_name="tiny", path="/m", weights="a" * 64, tokenizer="b" * 64, config="c" * 64,
            layout="d" * 64, adapters="e" * 64, identity=f"{i}" * 64, inputs={}, status=status,
        )  # fmt: skip
        ns = CacheNamespace.objects.create(
            namespace_key=f"{i}" * 64, model_version=version, tenant=tenant, retention_owner=owner, storage_prefix=f"ns-cli-{i}"
        )
        RetentionPolicy.objects.create(namespace=ns, versions_kept=1, cold_versions_kept=0)
        write_entry(tmp_path / "kv", ns.storage_prefix, "a" * 64, size=100, age_s=10)
        namespaces.append(ns)

    def cli(*args: str):
        return manage(*args, env=env)

    planned = cli("evict", "plan", "--no-orphans", "--reason", "retired v0")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert (plan["status"], [(a["kind"], a["tier"]) for a in plan["actions"]]) == (
        "planned",
        [("delete_prefix", "disk"), ("delete_archive", "cold"), ("set_residency", "")],
    )
    one_line_error(cli("evict", "approve", str(plan["id"])), 2, "--reason")
    one_line_error(cli("evict", "approve", "999", "--reason", "x"), 2, "no eviction run 999")
    one_line_error(cli("evict", "plan", "--purge", "999"), 2, "no namespace 999")
    RetentionPolicy.objects.filter(namespace=namespaces[1]).update(pinned=True, hold_by="legal", hold_reason="case 7")
    one_line_error(cli("evict", "plan", "--purge", str(namespaces[1].pk)), 4, "a held namespace is never purged")
    approving = cli("evict", "approve", str(plan["id"]), "--reason", "retired")
    assert approving.returncode == 0, approving.stderr
    approved = json.loads(approving.stdout)
    assert (approved["status"], approved["approved_by"]) == ("queued", cli_actor())
    one_line_error(cli("evict", "approve", str(plan["id"]), "--reason", "again"), 4, "not awaiting approval")
    cancelled = json.loads(cli("evict", "cancel", str(plan["id"]), "--reason", "not now").stdout)
    assert cancelled["status"] == "cancelled"
    assert EvictionRun.objects.get(pk=plan["id"]).status == "cancelled"
    scanned = cli("accounting", "scan")
    assert scanned.returncode == 0, scanned.stderr
    assert json.loads(scanned.stdout)["bytes_total"] == 2 * 2 * 100
    orphans = json.loads(cli("accounting", "orphans").stdout)
    assert [n["why"] for n in orphans["namespaces"]] == ["model version v0 is retired"]
