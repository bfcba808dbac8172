"""Registration as a job (API) with byte progress through a real worker, and
its CLI twin; bad input refused before anything is written."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from cacheadmin.models import AuditEvent, JobStatus, ModelVersion, RegistrationJob
from cacheadmin.services.api_tokens import api_token_issue
from cacheadmin.services.workers import WorkerProcess
from inference.identity import LayoutOptions, fingerprint_checkpoint
from tests.helpers import manage, subprocess_env, wait_for, worker_log

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def operator() -> APIClient:
    _, key = api_token_issue(user=User.objects.create_user("ops"), name="release", scope="operate", tenant=None, actor="setup")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


@pytest.fixture
def worker() -> Iterator[WorkerProcess]:
    proc = WorkerProcess(worker_log("registration-worker"), env=subprocess_env(), name="reg")
    proc.start()
    yield proc
    proc.stop()


def test_api_registration_runs_as_a_job_with_byte_progress(operator, worker, demo_checkpoints) -> None:
    path = demo_checkpoints["tiny-v2"]
    body = {
        "path": str(path),
        "label": "tiny-v2",
        "served_name": "tiny",
        "layout": {"block_size": 64, "kv_connector": "ExampleConnector"},
    }
    response = operator.post("/api/model-versions/", body, format="json")
    assert response.status_code == 202, response.json()
    job_id = response.json()["id"]
    weight_bytes = (path / "model.safetensors").stat().st_size
    assert response.json()["progress_total"] == weight_bytes
    wait_for(lambda: RegistrationJob.objects.get(pk=job_id).status == JobStatus.SUCCEEDED, timeout=60, what="registration")
    job = operator.get(f"/api/registration-jobs/{job_id}/").json()
    assert (job["progress_done"], job["progress_total"]) == (weight_bytes, weight_bytes)
    version = ModelVersion.objects.get(pk=job["model_version"])
    expected = fingerprint_checkpoint(path, layout=LayoutOptions(block_size=64, kv_connector="ExampleConnector"))
    assert {f: getattr(version, f) for f in expected.digests()} == expected.digests()
    assert AuditEvent.objects.filter(action="model_version.register", actor="ops (token release)").count() == 1


@pytest.mark.parametrize(
    ("body", "status", "field_or_code"),
    [
        ({"path": "/nonexistent", "label": "x", "served_name": "tiny"}, 400, "path"),
        ({"path": "/etc", "label": "x", "served_name": "tiny"}, 400, "path"),
        ({"path": "var/models/tiny-v1", "label": "x", "served_name": "tiny"}, 400, "path"),
        ({"path": "{root}/tiny-v1", "label": "x", "served_name": "tiny", "layout": {"block_sise": 16}}, 400, "layout.block_sise"),
        ({"path": "{root}/tiny-v1", "label": "x\u202e", "served_name": "tiny"}, 400, "label"),
        ({"path": "{root}/tiny-v1", "label": "x", "served_name": "tiny", "layout": {"dtype": "int3"}}, 400, "layout"),
        ({"path": "{root}/tiny-v1", "label": "x", "served_name": "tiny", "layout": {"block_size": 0}}, 400, "layout.block_size"),
        ({"path": "{root}/tiny-v1", "label": "x"}, 400, "served_name"),
        (
            {"path": "{root}/tiny-v1", "label": "x", "served_name": "t", "layout": {"hf_overrides": [1]}},
            400,
            "layout.hf_overrides",
        ),
        ({"path": "{root}/tiny-v1", "label": "x", "served_name": "t", "layout": {"kv_cache_layout": "XYZ"}}, 400, "layout"),
        (
            {"path": "{root}/tiny-v1", "label": "x", "served_name": "t", "layout": {"max_model_len": 0}},
            400,
            "layout.max_model_len",
        ),
        (
            {"path": "{root}/tiny-v1", "label": "x", "served_name": "t", "layout": {"disable_sliding_window": "yes"}},
            400,
            "layout.disable_sliding_window",
        ),
        # Refused from the config before any hashing: float16 KV on the bfloat16 that auto resolves to.
        (
            {"path": "{root}/tiny-v1", "label": "x", "served_name": "t", "layout": {"kv_cache_dtype": "float16"}},
            400,
            "bad_checkpoint",
        ),
        ({"path": "{root}/tiny-v1", "label": "x", "served_name": "tiny", "extra": 1}, 400, "extra"),
    ],
)
def test_bad_registrations_write_nothing(operator, demo_checkpoints, model_root: Path, body, status, field_or_code) -> None:
    body = {k: (v.format(root=model_root) if isinstance(v, str) else v) for k, v in body.items()}
    response = operator.post("/api/model-versions/", body, format="json")
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == field_or_code or field_or_code in error.get("fields", {})
    assert RegistrationJob.objects.count() == 0 and ModelVersion.objects.count() == 0


@pytest.mark.parametrize("path", ["/etc", "/nonexistent", "{root}/../.."])
def test_a_path_outside_the_roots_is_named_without_the_servers_directories(operator, model_root: Path, path: str) -> None:
    response = operator.post(
        "/api/model-versions/", {"path": path.format(root=model_root), "label": "x", "served_name": "tiny"}, format="json"
    )
    assert (response.status_code, response.json()) == (
        400,
        {
            "error": {
                "status": 400,
                "code": "invalid",
                "message": "path: not a checkpoint directory inside the model roots",
                "fields": {"path": ["not a checkpoint directory inside the model roots"]},
            }
        },
    )
    assert RegistrationJob.objects.count() == 0


def _loop(a: Path, b: Path) -> None:
    os.symlink(b, a)
    os.symlink(a, b)


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (
            lambda d: os.symlink("/etc/passwd", d / "quantize_config.json"),
            "quantize_config.json is a link leading outside the model roots",
        ),
        (
            lambda d: _loop(d / "a.json", d / "b.json"),
            "a.json is a link that loops",
        ),
        (lambda d: os.symlink(d / "gone", d / "extra.json"), "extra.json is a link to nothing"),
        (
            lambda d: os.link(d / "config.json", d / "config-copy.json"),
            "config-copy.json has several hard links; copy it instead",
        ),
    ],
)
def test_a_checkpoint_refused_for_one_of_its_entries_names_that_entry_not_where_it_leads(
    operator, checkpoint_copy, make, problem: str
) -> None:  # type: ignore[no-untyped-def]
    folder = checkpoint_copy()
    make(folder)
    response = operator.post("/api/model-versions/", {"path": str(folder), "label": "x", "served_name": "tiny"}, format="json")
    assert (response.status_code, response.json()["error"]["message"], response.json()["error"]["fields"]) == (
        400, f"path: {problem}", {"path": [problem]}
    )  # fmt: skip
    assert "/etc" not in response.content.decode() and RegistrationJob.objects.count() == 0


@pytest.mark.slow
def test_register_command_is_idempotent_and_reports_conflicts(demo_checkpoints) -> None:
    env = subprocess_env()
    first = manage("register", str(demo_checkpoints["tiny-v1"]), "--label", "v1", "--served-name", "tiny", "--json", env=env)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out["created"] is True and out["weights"] == fingerprint_checkpoint(demo_checkpoints["tiny-v1"]).weights
    again = manage("register", str(demo_checkpoints["tiny-v1"]), "--label", "v1", "--served-name", "tiny", "--json", env=env)
    assert json.loads(again.stdout)["created"] is False
    conflict = manage("register", str(demo_checkpoints["tiny-v2"]), "--label", "v1", "--served-name", "tiny", env=env)
    assert conflict.returncode == 3 and "register it under a new label" in conflict.stderr
    empty = manage("register", str(demo_checkpoints["tiny-v2"]), "--label", " ", "--served-name", "tiny", env=env)
    assert empty.returncode == 2 and empty.stderr.strip() == "CommandError: --label must not be empty"
    assert list(ModelVersion.objects.values_list("label", flat=True)) == ["v1"]


def test_concurrent_registration_of_one_checkpoint_makes_one_row(demo_checkpoints) -> None:
    import threading

    from django.db import connection

    from cacheadmin.services.model_versions import model_version_register

    barrier = threading.Barrier(4)
    outcomes: list[tuple[int, bool]] = []
    errors: list[BaseException] = []

    def register() -> None:
        try:
            barrier.wait()
            version, created = model_version_register(
                path=demo_checkpoints["tiny-v1"], label="race", served_name="tiny", layout=LayoutOptions(), actor="racer"
            )
            outcomes.append((version.pk, created))
        except BaseException as exc:  # noqa: BLE001 - reported below with the test's assertion
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=register) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert len({pk for pk, _ in outcomes}) == 1
    assert sorted(created for _, created in outcomes) == [False, False, False, True]
    assert ModelVersion.objects.filter(label="race").count() == 1
    assert AuditEvent.objects.filter(action="model_version.register").count() == 1


def _adapter(root: Path, name: str, weights: bytes) -> Path:
    adapter = root / name
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"]}')
    (adapter / "adapter_model.safetensors").write_bytes(_safetensors(weights))
    return adapter


def _safetensors(payload: bytes) -> bytes:
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}).encode()
    return len(header).to_bytes(8, "little") + header + payload


@pytest.mark.slow
def test_adapters_register_by_content_through_the_api_and_the_cli(operator, worker, demo_checkpoints, model_root) -> None:
    support = _adapter(model_root, "lora-support", b"\x01" * 64)
    twin = _adapter(model_root, "lora-support-retrained", b"\x02" * 64)  # same name below, other bytes
    try:
        body = {"path": str(demo_checkpoints["tiny-v1"]), "label": "v1+support", "served_name": "tiny"}
        response = operator.post("/api/model-versions/", {**body, "adapters": {"support": str(support)}}, format="json")
        assert response.status_code == 202, response.json()
        assert response.json()["adapters"] == {"support": str(support)}
        job_id = response.json()["id"]
        wait_for(lambda: RegistrationJob.objects.get(pk=job_id).status == JobStatus.SUCCEEDED, timeout=60, what="registration")
        version = ModelVersion.objects.get(label="v1+support")
        listed = operator.get(f"/api/adapters/?model_version={version.pk}").json()["results"]
        expected = fingerprint_checkpoint(demo_checkpoints["tiny-v1"], adapters={"support": support})
        assert [(a["name"], a["content"], a["path"]) for a in listed] == [
            ("support", expected.inputs["adapters"]["support"]["content"], str(support))
        ]
        assert version.adapters == expected.adapters
        cli = manage(
            "register", str(demo_checkpoints["tiny-v1"]), "--label", "v1+support-2", "--served-name", "tiny",
            "--adapter", f"support={twin}", "--json", env=subprocess_env(),
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        out = json.loads(cli.stdout)
        # Same adapter name, other bytes: another content, another identity.
        assert out["adapters_registered"]["support"] != listed[0]["content"]
        assert out["identity"] != version.identity
        bad = operator.post("/api/model-versions/", {**body, "label": "x", "adapters": {"support": "/etc"}}, format="json")
        assert bad.json()["error"]["fields"] == {"adapters": ["not a directory inside the model roots"]}
    finally:
        shutil.rmtree(support)
        shutil.rmtree(twin)


@pytest.mark.slow
def test_adapters_are_confined_like_checkpoints(operator, demo_checkpoints, model_root: Path, tmp_path: Path) -> None:
    """Relative and "~" paths, a link to a file outside the roots, and a hard
    link are refused; nothing is hashed or shown; nothing is written."""
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"outside the model roots")
    linked, hard = model_root / f"lora-link-{tmp_path.name}", model_root / f"lora-hard-{tmp_path.name}"
    for folder in (linked, hard):
        folder.mkdir()
        (folder / "adapter_config.json").write_text('{"r": 8}')
    (linked / "adapter_model.safetensors").symlink_to(secret)
    outside_root = model_root / f"outside-{tmp_path.name}.safetensors"
    outside_root.write_bytes(b"w")
    (hard / "adapter_model.safetensors").hardlink_to(outside_root)
    try:
        for adapter in ("relative/lora", "~/lora", str(linked), str(hard)):
            body = {"path": str(demo_checkpoints["tiny-v1"]), "label": "x", "served_name": "t", "adapters": {"a": adapter}}
            response = operator.post("/api/model-versions/", body, format="json")
            assert response.status_code == 400, (adapter, response.json())
            assert list(response.json()["error"]["fields"]) == ["adapters"]
            assert "secret" not in json.dumps(response.json())
        proc = manage("fingerprint", str(demo_checkpoints["tiny-v1"]), "--adapter", f"a={linked}", "--json")
        assert proc.returncode == 2 and "links to" in proc.stderr and proc.stdout == ""
        proc = manage("fingerprint", str(demo_checkpoints["tiny-v1"]), "--adapter", f"a={hard}", "--json")
        assert proc.returncode == 2 and "has 2 hard links" in proc.stderr
        assert RegistrationJob.objects.count() == 0 and ModelVersion.objects.count() == 0
    finally:
        shutil.rmtree(linked)
        shutil.rmtree(hard)
        outside_root.unlink()


@pytest.mark.slow
def test_a_file_the_engine_reads_but_the_identity_cannot_cover_is_refused_at_registration(operator, checkpoint_copy) -> None:
    path = checkpoint_copy()
    (path / "audio_tokenizer_config.json").write_text(json.dumps({"audio_tokenizer_class": "DacModel"}))
    response = operator.post("/api/model-versions/", {"path": str(path), "label": "x", "served_name": "tiny"}, format="json")
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert error["code"] == "bad_checkpoint" and "audio_tokenizer_config.json" in error["message"], error
    assert RegistrationJob.objects.count() == 0 and ModelVersion.objects.count() == 0
    cli = manage("register", str(path), "--label", "x", "--served-name", "tiny", env=subprocess_env())
    assert cli.returncode == 2 and "audio_tokenizer_config.json: transformers/processing_utils.py" in cli.stderr, cli.stderr
    assert ModelVersion.objects.count() == 0
