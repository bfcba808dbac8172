"""No secret at rest: what the control plane issues, reads or is told (API
tokens, salts, passwords) is stored in no table, every API write whose answer
shows a secret keeps it out of its Idempotency-Key record, and the files that
hold secrets are owner-only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from axes.models import AccessAttempt
from django.contrib.auth.models import User
from django.contrib.sessions.models import Session
from django.test import Client
from django.urls import resolve
from drf_spectacular.generators import SchemaGenerator

from cacheadmin.api.idempotency import SECRETS_ATTR
from cacheadmin.env import persistent_secret, write_private_file
from cacheadmin.management.commands.demo import DEMO_GATEWAY_KEY_NAME
from cacheadmin.management.commands.demo import Command as DemoCommand
from cacheadmin.models import AuditEvent, GatewayKey, Tenant
from cacheadmin.services.api_tokens import api_token_issue
from cacheadmin.services.gateway_stores import response_store
from gateway.routing import key_hash
from tests.helpers import rows_holding

#: Top-level answer fields that name a secret.
SECRET_NAMES = frozenset({"key", "token", "secret", "password", "salt", "cache_salt", "api_key"})
#: Write answers with such a field that is no secret, and why.
NOT_SECRET = {
    ("/api/engine-alarms/{id}/resolve/", "key"): "an alarm's key: a salt's digest or a namespace id, never a salt",
}


@pytest.mark.django_db
def test_an_api_tokens_secret_is_stored_nowhere() -> None:
    user = User.objects.create_user("dana")
    _, plain = api_token_issue(user=user, name="ci", scope="read", tenant=None, actor="setup")
    secret = plain.split("_", 2)[2]
    assert len(secret) >= 40 and rows_holding(secret) == []


@pytest.mark.django_db
def test_a_namespace_salt_read_is_audited_without_the_salt(world) -> None:
    ns = world["ns"]["acme"]
    answer = world["clients"]["alice"].get(f"/api/namespaces/{ns.pk}/cache-salt/")
    assert answer.status_code == 200, answer.json()
    salt = answer.json()["cache_salt"]
    assert len(salt) >= 32 and rows_holding(salt) == []
    assert AuditEvent.objects.filter(action="namespace.read_salt", object_id=str(ns.pk)).count() == 1


@pytest.mark.django_db
def test_passwords_typed_at_sign_in_are_stored_nowhere() -> None:
    User.objects.create_user("erin", password="right-horse-battery-7791")
    client = Client()
    failed = client.post("/login/", {"username": "erin", "password": "wrong-staple-horse-5512"})
    assert failed.status_code == 200  # the form again, with its error
    # django-axes recorded the failure, with the posted form (its password cleansed).
    assert AccessAttempt.objects.filter(username="erin").count() == 1
    assert rows_holding("wrong-staple-horse-5512") == []
    signed_in = client.post("/login/", {"username": "erin", "password": "right-horse-battery-7791"})
    assert signed_in.status_code == 302 and Session.objects.count() == 1
    assert rows_holding("wrong-staple-horse-5512") == [] and rows_holding("right-horse-battery-7791") == []


def test_every_write_that_answers_a_secret_keeps_it_out_of_idempotency_records() -> None:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    components = schema["components"]["schemas"]

    def top_fields(node: dict) -> set[str]:
        if "$ref" in node:
            node = components[node["$ref"].split("/")[-1]]
        if node.get("type") == "array":
            return top_fields(node.get("items", {}))
        return set(node.get("properties", {})) | {f for sub in node.get("allOf", []) for f in top_fields(sub)}

    marked = []
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if method.upper() not in ("POST", "PUT", "PATCH", "DELETE"):
                continue
            shown = set()
            for status, answer in operation["responses"].items():
                if status.startswith("2"):
                    for media in answer.get("content", {}).values():
                        shown |= top_fields(media["schema"])
            secrets = {f for f in shown & SECRET_NAMES if (path, f) not in NOT_SECRET}
            if not secrets:
                continue
            view = resolve(path.replace("{id}", "1")).func
            actions = getattr(view, "actions", None) or {}
            handler = getattr(view.cls, actions.get(method, method))
            declared = getattr(handler, SECRETS_ATTR, None)
            assert declared is not None and secrets <= set(declared.fields), (method, path, secrets)
            marked.append((method.upper(), path))
    assert marked == [("POST", "/api/gateway-keys/")]


def test_a_world_readable_secret_file_is_made_owner_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CACHE_SALT_SECRET", raising=False)
    var = tmp_path / "var"
    var.mkdir(mode=0o755)
    (var / "cache-salt-secret").write_text("s" * 64)
    (var / "cache-salt-secret").chmod(0o644)
    assert persistent_secret("cache-salt-secret", "CACHE_SALT_SECRET", var) == "s" * 64
    assert ((var / "cache-salt-secret").stat().st_mode & 0o777, var.stat().st_mode & 0o777) == (0o600, 0o700)


def test_a_private_file_is_owner_only_even_over_a_world_readable_one(tmp_path: Path) -> None:
    path = tmp_path / "gateway-key"
    path.write_text("old")
    path.chmod(0o644)
    write_private_file(path, "kvgw_abc_new")
    assert (path.read_text(), path.stat().st_mode & 0o777) == ("kvgw_abc_new", 0o600)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gateway-key"]  # no temporary file left


def test_the_embedded_gateway_stores_folder_is_owner_only(settings, tmp_path: Path) -> None:
    settings.GATEWAY_REDIS_URL, settings.GATEWAY_DIR = "", tmp_path / "elsewhere" / "gateway"
    response_store()
    assert settings.GATEWAY_DIR.stat().st_mode & 0o777 == 0o700
    os.chmod(settings.GATEWAY_DIR, 0o755)  # loosened by hand: tightened again at the next start
    response_store()
    assert settings.GATEWAY_DIR.stat().st_mode & 0o777 == 0o700


@pytest.mark.django_db
def test_each_served_demo_run_leaves_one_valid_demo_key(settings, tmp_path: Path) -> None:
    """The demo prints and keeps a gateway key of acme; a later run revokes the key
    an earlier one issued (found: every run's key stayed valid, the older ones
    known to nobody but the terminals that printed them)."""
    settings.VAR_DIR = tmp_path
    Tenant.objects.create(slug="acme", name="Acme", key="a" * 32)
    first = DemoCommand()._gateway_key()
    second = DemoCommand()._gateway_key()
    keys = GatewayKey.objects.filter(tenant__slug="acme", name=DEMO_GATEWAY_KEY_NAME).order_by("pk")
    assert [k.revoked_at is None for k in keys] == [False, True]
    assert key_hash(first) == keys[0].key_hash and key_hash(second) == keys[1].key_hash
    assert (tmp_path / "gateway-key").read_text() == second
    assert (tmp_path / "gateway-key").stat().st_mode & 0o777 == 0o600
