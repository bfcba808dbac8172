"""``fingerprint`` and registration as a user meets them: real subprocesses,
exit codes, one-line errors, and nothing registered on bad input."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cacheadmin.models import AuditEvent, ModelVersion, Tenant
from cacheadmin.models.naming import name_key
from cacheadmin.services.model_versions import RegistrationConflict, model_version_register
from inference.errors import CheckpointError
from inference.identity import LayoutOptions, fingerprint_checkpoint, namespace_key
from tests.helpers import manage, subprocess_env


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)  # the command runs in a subprocess: the tenant must be committed
def test_fingerprint_json_prints_every_digest_and_namespace(demo_checkpoints) -> None:
    acme = Tenant.objects.create(slug="acme", name="Acme")
    path = demo_checkpoints["tiny-v1"]
    args = ("fingerprint", str(path), "--block-size", "64", "--dtype", "bf16", "--json")
    proc = manage(*args, "--tenant", "acme", env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    expected = fingerprint_checkpoint(path, layout=LayoutOptions(block_size=64, dtype="bfloat16"))
    for key, value in expected.digests().items():
        assert out[key] == value
    assert out["namespace_key"] == namespace_key(expected.identity, f"tenant:acme:{acme.key}")
    assert len(out["identity"]) == 64 and len(acme.key) == 32
    missing = manage(*args, "--tenant", "globex", env=subprocess_env())
    assert (missing.returncode, missing.stderr.strip()) == (2, "CommandError: --tenant 'globex': no such tenant")


@pytest.mark.slow
def test_fingerprint_takes_every_layout_option(demo_checkpoints) -> None:
    path = demo_checkpoints["tiny-v1"]
    proc = manage(
        "fingerprint", str(path), "--json", "--kv-cache-layout", "HND", "--attention-backend", "CPU_ATTN",
        "--hf-overrides", '{"rms_norm_eps": 1e-05}', "--model-impl", "vllm", "--max-model-len", "4096",
        "--disable-sliding-window", "--kv-connector", "ExampleConnector", "--kv-storage-format", "ExampleConnector@example-v1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    options = LayoutOptions(
        kv_cache_layout="HND", attention_backend="CPU_ATTN", hf_overrides={"rms_norm_eps": 1e-05}, model_impl="vllm",
        max_model_len=4096, disable_sliding_window=True, kv_connector="ExampleConnector",
        kv_storage_format="ExampleConnector@example-v1",
    )  # fmt: skip
    assert json.loads(proc.stdout)["identity"] == fingerprint_checkpoint(path, layout=options).identity


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/does/not/exist"], "does not exist"),
        (["{root}/tiny-v1", "--block-size", "0"], "not a positive integer"),
        (["{root}/tiny-v1", "--block-size", "abc"], "is not an integer"),
        (["{root}/tiny-v1", "--dtype", "int3"], "dtype 'int3' is not one of"),
        (["{root}/tiny-v1", "--tenant", "Not A Slug"], "--tenant"),
        (["{tmp}"], "outside the model roots"),
        (["{root}/tiny-v1", "--unknown-flag"], "unrecognized arguments"),
        (["{root}/tiny-v1", "--hf-overrides", "[1]"], "must be a JSON object"),
        (["{root}/tiny-v1", "--hf-overrides", "[[bad"], "not JSON"),
        (["{root}/tiny-v1", "--hf-overrides", '{{"rope_theta": 1, "rope_theta": 2}}'], "duplicate key 'rope_theta'"),
        (["{root}/tiny-v1", "--quantization", "fp9"], "quantization 'fp9' is not a vLLM quantization method"),
        (["{root}/tiny-v1", "--kv-connector", "Nope"], "kv_connector 'Nope' is not one of"),
        (["{root}/tiny-v1", "--kv-storage-format", "x"], "kv_storage_format 'x' is not <connector>@<version>"),
        (["{root}/tiny-v1", "--kv-cache-layout", "XYZ"], "kv_cache_layout 'XYZ' is not one of"),
        (["{root}/tiny-v1", "--attention-backend", "NOPE"], "attention_backend 'NOPE' is not one of"),
        (["{root}/tiny-v1", "--model-impl", "jax"], "model_impl 'jax' is not one of"),
        (["{root}/tiny-v1", "--dtype", "bf16", "--kv-cache-dtype", "fp16"], "kv_cache_dtype float16 on a bfloat16 model"),
    ],
)
def test_fingerprint_bad_input_exits_2_with_one_line(demo_checkpoints, model_root: Path, tmp_path: Path, args, message) -> None:
    args = [a.format(root=model_root, tmp=tmp_path) for a in args]
    proc = manage("fingerprint", *args, "--json")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert message in lines[0]


@pytest.mark.slow
def test_fingerprint_truncated_and_configless_checkpoints(checkpoint_copy) -> None:
    truncated = checkpoint_copy()
    with (truncated / "model.safetensors").open("r+b") as fh:
        fh.truncate(1000)
    proc = manage("fingerprint", str(truncated), "--json")
    assert (proc.returncode, len(proc.stderr.strip().splitlines())) == (2, 1)
    assert "truncated" in proc.stderr
    configless = checkpoint_copy()
    (configless / "config.json").unlink()
    proc = manage("fingerprint", str(configless))
    assert proc.returncode == 2 and "no config.json" in proc.stderr


@pytest.mark.django_db
def test_register_is_idempotent_and_refuses_bad_checkpoints(
    demo_checkpoints, checkpoint_copy, model_root: Path, tmp_path: Path
) -> None:
    layout = LayoutOptions(kv_connector="ExampleConnector")
    v1, created = model_version_register(
        path=demo_checkpoints["tiny-v1"], label="v1", served_name="tiny", layout=layout, actor="alice"
    )
    assert created is True
    again, created = model_version_register(
        path=demo_checkpoints["tiny-v1"], label="v1", served_name="tiny", layout=layout, actor="alice"
    )
    assert (again.pk, created) == (v1.pk, False)
    with pytest.raises(RegistrationConflict, match="register it under a new label"):
        model_version_register(path=demo_checkpoints["tiny-v2"], label="v1", served_name="tiny", layout=layout, actor="alice")
    truncated = checkpoint_copy()
    with (truncated / "model.safetensors").open("r+b") as fh:
        fh.truncate(5000)
    outside = tmp_path / "outside"
    shutil.copytree(demo_checkpoints["tiny-v1"], outside)
    link = model_root / "escape"
    link.symlink_to(outside)
    for bad in (truncated, outside, link, model_root / "missing"):
        with pytest.raises(CheckpointError):
            model_version_register(path=bad, label="bad", served_name="tiny", layout=layout, actor="alice")
    link.unlink()
    assert list(ModelVersion.objects.values_list("label", flat=True)) == ["v1"]
    assert list(AuditEvent.objects.values_list("actor", "action")) == [("alice", "model_version.register")]
    assert v1.weights == fingerprint_checkpoint(demo_checkpoints["tiny-v1"], layout=layout).weights
    assert v1.inputs["layout"]["kv_connector"] == "ExampleConnector"


@pytest.mark.django_db
def test_health_needs_no_login_and_pages_do(client) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "database": {"read": True, "write": True}}
    response = client.get("/")
    assert response.status_code == 302 and response.url.startswith("/login/")


@pytest.mark.django_db
def test_a_reused_tenant_slug_never_gets_another_tenants_namespace(demo_checkpoints) -> None:
    from cacheadmin.models import CacheNamespace, Tenant
    from cacheadmin.services.namespaces import (
        DEMO_POLICY,
        NamespaceConflict,
        namespace_get_or_create,
        retention_owner_get_or_create,
        tenant_get_or_create,
    )

    version, _ = model_version_register(
        path=demo_checkpoints["tiny-v1"], label="v1", served_name="tiny", layout=LayoutOptions(), actor="alice"
    )
    owner = retention_owner_get_or_create(name="team", email="t@example.com", actor="alice")
    acme = tenant_get_or_create(slug="acme", name="Acme", actor="alice")
    first, _ = namespace_get_or_create(
        model_version=version, tenant=acme, retention_owner=owner, policy=DEMO_POLICY, actor="alice"
    )
    # A rename behind the services' back (its comparison key follows, as a save would).
    Tenant.objects.filter(pk=acme.pk).update(slug="acme-old", slug_key=name_key("acme-old"))
    newcomer = tenant_get_or_create(slug="acme", name="Someone else", actor="bob")
    # The newcomer's boundary holds its own key: another namespace, never the first one.
    theirs, _ = namespace_get_or_create(
        model_version=version, tenant=newcomer, retention_owner=owner, policy=DEMO_POLICY, actor="bob"
    )
    assert theirs.namespace_key != first.namespace_key and theirs.storage_prefix != first.storage_prefix
    assert CacheNamespaceCount() == 2 and first.tenant_id == acme.pk
    # A boundary string that collides anyway (a row edited behind the services' back) is still refused.
    Tenant.objects.filter(pk=newcomer.pk).update(key=acme.key)
    newcomer.refresh_from_db()
    CacheNamespace.objects.filter(pk=theirs.pk).delete()
    with pytest.raises(NamespaceConflict, match="never handed to another boundary"):
        namespace_get_or_create(model_version=version, tenant=newcomer, retention_owner=owner, policy=DEMO_POLICY, actor="bob")


def CacheNamespaceCount() -> int:  # noqa: N802 - reads like the count it returns
    from cacheadmin.models import CacheNamespace

    return CacheNamespace.objects.count()


@pytest.mark.django_db
def test_admin_cannot_forge_identity_namespaces_engines_or_jobs(admin_client) -> None:
    from cacheadmin.models import Tenant

    for model in ("modelversion", "cachenamespace", "engine", "prewarmjob", "comparisonjob"):
        assert admin_client.get(f"/admin/cacheadmin/{model}/add/").status_code == 403, model
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    page = admin_client.get(f"/admin/cacheadmin/tenant/{tenant.pk}/change/").content.decode()
    assert 'name="slug"' not in page
    from django.core.exceptions import ValidationError

    from cacheadmin.services.namespaces import tenant_get_or_create

    with pytest.raises(ValidationError):
        tenant_get_or_create(slug="acme\n", name="x", actor="alice")
    assert list(Tenant.objects.values_list("slug", flat=True)) == ["acme"]


@pytest.mark.slow
def test_fingerprint_escapes_control_characters_and_refuses_non_ascii_digits(demo_checkpoints) -> None:
    proc = manage("fingerprint", "/nonexistent/a\x1b[31mred", "--json")
    assert proc.returncode == 2 and "\x1b" not in proc.stderr and "\\x1b[31mred" in proc.stderr
    proc = manage("fingerprint", str(demo_checkpoints["tiny-v1"]), "--block-size", "\u0663", "--json")
    assert proc.returncode == 2 and "is not an integer" in proc.stderr


@pytest.mark.django_db
def test_model_version_lifecycle_moves_and_refusals(demo_checkpoints) -> None:
    from cacheadmin.services.model_versions import LifecycleError, model_version_transition

    version, _ = model_version_register(
        path=demo_checkpoints["tiny-v1"], label="v1", served_name="tiny", layout=LayoutOptions(), actor="alice"
    )
    for to in ("active", "draining", "active", "draining", "retired"):
        version = model_version_transition(version=version, to=to, actor="alice", reason=f"to {to}")
        assert version.status == to
    with pytest.raises(LifecycleError, match="is retired; it cannot become active"):
        model_version_transition(version=version, to="active", actor="alice")
    stale = ModelVersion.objects.get(pk=version.pk)
    stale.status = "draining"  # a view of the row from before it was retired
    with pytest.raises(LifecycleError, match="changed status concurrently"):
        model_version_transition(version=stale, to="active", actor="bob")
    moves = AuditEvent.objects.filter(action="model_version.transition").order_by("id")
    assert [(e.before["status"], e.after["status"]) for e in moves] == [
        ("registered", "active"),
        ("active", "draining"),
        ("draining", "active"),
        ("active", "draining"),
        ("draining", "retired"),
    ]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)  # the command runs in a subprocess: rows must be committed
def test_identity_diff_command_between_registered_versions_and_paths(demo_checkpoints) -> None:
    v1, _ = model_version_register(
        path=demo_checkpoints["tiny-v1"], label="v1", served_name="tiny", layout=LayoutOptions(), actor="a"
    )
    from tests.helpers import subprocess_env

    env = subprocess_env()
    proc = manage("identity_diff", str(v1.pk), str(demo_checkpoints["tiny-v2"]), "--json", env=env)
    assert proc.returncode == 1, proc.stderr
    diff = json.loads(proc.stdout)
    assert diff["differing"] == ["weights"]
    # Other seeds draw every tensor anew except the RMSNorm weights, which
    # start at ones in both: the diff names exactly the tensors that differ.
    tensors = sorted(v1.inputs["weights"])
    assert [c["key"] for c in diff["fields"]["weights"]["changes"]] == [t for t in tensors if not t.endswith("norm.weight")]
    assert len(tensors) - len(diff["fields"]["weights"]["changes"]) == 2 * 4 + 1  # two norms per layer, one final
    assert diff["fields"]["weights"]["a"] == v1.weights
    same = manage("identity_diff", str(v1.pk), str(demo_checkpoints["tiny-v1"]), env=env)
    assert (same.returncode, same.stdout.strip()) == (0, "identical")
    bad = manage("identity_diff", "424242", str(demo_checkpoints["tiny-v1"]), env=env)
    assert (bad.returncode, bad.stderr.strip().splitlines()) == (2, ["CommandError: no model version with id 424242"])


@pytest.mark.slow
def test_fingerprint_adapters_and_verify(checkpoint_copy, model_root: Path) -> None:
    import sqlite3

    from django.conf import settings

    path = checkpoint_copy()
    adapter = model_root / f"{path.name}-lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.bin").write_bytes(b"lora")
    try:
        plain = json.loads(manage("fingerprint", str(path), "--json").stdout)
        with_lora = json.loads(manage("fingerprint", str(path), "--adapter", f"support={adapter}", "--json").stdout)
        assert [k for k in ("weights", "tokenizer", "config", "layout", "adapters") if plain[k] != with_lora[k]] == ["adapters"]
        for spec, message in (
            (f"={adapter}", "expected NAME=PATH"),
            ("x", "expected NAME=PATH"),
            ("a=/nonexistent", "not a directory"),
        ):
            proc = manage("fingerprint", str(path), "--adapter", spec, "--json")
            assert proc.returncode == 2 and message in proc.stderr, (spec, proc.stderr)
        twice = manage("fingerprint", str(path), "--adapter", f"a={adapter}", "--adapter", f"a={adapter}")
        assert twice.returncode == 2 and "given twice" in twice.stderr
    finally:
        shutil.rmtree(adapter)
    clean = manage("fingerprint", str(path), "--verify", "--json")
    assert clean.returncode == 0 and json.loads(clean.stdout)["cache_mismatches"] == []
    # A digest cache that lies (as after a block-level rewrite the filesystem never saw).
    weights_file = os.fsencode(path / "model.safetensors")
    with sqlite3.connect(settings.DIGEST_CACHE_PATH) as conn:
        (manifest,) = conn.execute("SELECT tensors FROM file_tensors_v1 WHERE path=?", (weights_file,)).fetchone()
        tensors = json.loads(manifest)
        tensor, actual = tensors[0][0], tensors[0][3]
        tensors[0][3] = "0" * 64
        conn.execute("UPDATE file_tensors_v1 SET tensors=? WHERE path=?", (json.dumps(tensors), weights_file))
    lied = manage("fingerprint", str(path), "--json")
    assert json.loads(lied.stdout)["weights"] != plain["weights"]  # the cache answered, wrongly
    verified = manage("fingerprint", str(path), "--verify", "--json")
    assert verified.returncode == 3
    out = json.loads(verified.stdout)
    assert out["cache_mismatches"] == [{"file": "model.safetensors", "tensor": tensor, "cached": "0" * 64, "actual": actual}]
    assert out["weights"] == plain["weights"]  # corrected before fingerprinting
    assert json.loads(manage("fingerprint", str(path), "--json").stdout)["weights"] == plain["weights"]
