"""Names a person would read as another name are refused, for every kind of
name (retention owners, model version labels, tenant names and slugs, shared
group names and slugs, adapter names) and on every path (services, API, CLI,
admin): a single name that mixes scripts or imitates an ASCII name, and a
name whose Unicode TR39 skeleton (after case and NFKC folding) another row
has. Plain distinct names still pass.

The look-alikes: Cyrillic "а" (U+0430) and "і" (U+0456), Greek "ν" (U+03BD)
and "Α" (U+0391) in place of Latin letters; "1" for "l" and "rn" for "m"
inside ASCII.
"""

from __future__ import annotations

import importlib
import json

import pytest
from django.apps import apps
from django.core.exceptions import ValidationError

from cacheadmin.models import AuditEvent, ModelVersion, RetentionOwner, SharedGroup, Tenant
from cacheadmin.models.naming import name_key, validate_display_name
from cacheadmin.services.model_versions import RegistrationConflict, checkpoint_fingerprint, model_version_register
from cacheadmin.services.namespaces import retention_owner_get_or_create, shared_group_create, tenant_get_or_create
from inference.errors import CheckpointError
from inference.identity import LayoutOptions
from tests.cacheadmin.conftest import make_version
from tests.helpers import manage, subprocess_env

pytestmark = pytest.mark.django_db

NOT_DIFFERENT = "(case, Unicode form and look-alike letters do not count)"
CYRILLIC_A = "mixes Cyrillic and Latin letters (U+0430 CYRILLIC SMALL LETTER A), which can imitate another name"
CYRILLIC_I = (
    "mixes Latin and Cyrillic letters (U+0456 CYRILLIC SMALL LETTER BYELORUSSIAN-UKRAINIAN I), which can imitate another name"
)
GREEK_NU = "mixes Latin and Greek letters (U+03BD GREEK SMALL LETTER NU), which can imitate another name"
CYRILLIC_ER = "mixes Cyrillic and Latin letters (U+0420 CYRILLIC CAPITAL LETTER ER), which can imitate another name"


def refusal(call, *args, **kwargs) -> dict[str, list[str]] | list[str]:
    """The ValidationError a call raises: its message dict, or its messages."""
    with pytest.raises(ValidationError) as caught:
        call(*args, **kwargs)
    return caught.value.message_dict if hasattr(caught.value, "error_dict") else caught.value.messages


# -- one name ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("аcme", CYRILLIC_A),
        ("tіny-v1", CYRILLIC_I),
        ("tiny-ν1", GREEK_NU),
        ("Acme Россия", "mixes Latin and Cyrillic letters (U+0041 LATIN CAPITAL LETTER A), which can imitate another name"),
        ("асе", "reads as 'ace' but is written in look-alike letters (U+0430 CYRILLIC SMALL LETTER A); type it in ASCII"),
        ("ΑΒΕ", "reads as 'ABE' but is written in look-alike letters (U+0391 GREEK CAPITAL LETTER ALPHA); type it in ASCII"),
        ("tıny", "reads as 'tiny' but is written in look-alike letters (U+0131 LATIN SMALL LETTER DOTLESS I); type it in ASCII"),
        ("v1\u0661", "mixes digits of different numbering systems (U+0661 ARABIC-INDIC DIGIT ONE)"),
        ("e\u0301\u0301", "repeats the combining mark U+0301 COMBINING ACUTE ACCENT on one character, which shows no difference"),
        ("team\udcff", "contains the unpaired surrogate U+DCFF, which is not a character"),
        ("platform\u200b-team", "contains the invisible or control character U+200B"),
    ],
)
def test_a_name_that_can_pass_for_another_is_refused(name: str, message: str) -> None:
    assert refusal(validate_display_name, name) == [message]


@pytest.mark.parametrize(
    "name", ["acme", "platform-team", "Команда платформы", "мама", "café", "Müller 東京", "O’Brien", "tiny-v2 (EU)", "ﬁle"]
)
def test_plain_names_in_one_script_pass(name: str) -> None:
    validate_display_name(name)


def test_names_that_read_alike_share_a_key_and_distinct_ones_do_not() -> None:
    alike = [
        ("Team-A", "team-a", "ｔｅａｍ-ａ", " TEAM-A "),  # case, NFKC, spaces: as before
        ("tiny-v1", "tiny-vl", "TINY-V1"),  # "1" looks like "l"
        ("modern", "modem"),  # "rn" looks like "m"
        ("v0", "vO", "vo"),  # "0" looks like "O"
        ("acme–eu", "acme-eu"),  # en dash for hyphen
        ("O’Brien", "o'brien"),
        ("аcme", "acme"),  # refused alone, and colliding anyway
    ]
    for names in alike:
        assert len({name_key(n) for n in names}) == 1, names
    distinct = ["tiny-v1", "tiny-v2", "acme", "acne", "team-a", "team-b", "мама", "папа"]
    assert len({name_key(n) for n in distinct}) == len(distinct)


# -- each kind of name, through the services and models -------------------------


def test_retention_owner_look_alikes(world) -> None:
    assert refusal(retention_owner_get_or_create, name="аcme", email="a@example.com", actor="alice") == [CYRILLIC_A]
    first = retention_owner_get_or_create(name="acme-1", email="a@example.com", actor="alice")
    # The service is a get-or-create by key: the look-alike is the same owner, never a second one.
    assert retention_owner_get_or_create(name="ACME-l", email="b@example.com", actor="bob") == first
    assert refusal(RetentionOwner(name="acme-l", email="b@example.com").full_clean) == {
        "name": [f"looks like retention owner 'acme-1' {NOT_DIFFERENT}"]
    }
    assert list(RetentionOwner.objects.order_by("name").values_list("name", flat=True)) == ["acme-1", "platform"]


def test_model_version_label_look_alikes(demo_checkpoints) -> None:
    layout = LayoutOptions()
    for label, message in (("tіny-v1", CYRILLIC_I), ("tiny-ν1", GREEK_NU)):
        with pytest.raises(CheckpointError) as caught:
            model_version_register(path="/nowhere", label=label, served_name="tiny", layout=layout, actor="alice")
        assert str(caught.value) == f"label {label!r} {message}"
    existing = make_version("tiny-v1", "1" * 64)
    with pytest.raises(RegistrationConflict) as conflict:
        model_version_register(path=demo_checkpoints["tiny-v2"], label="tiny-vl", served_name="tiny", layout=layout, actor="a")
    assert str(conflict.value).startswith("label 'tiny-v1' is registered with identity 1111111111111111…, this checkpoint has ")
    others = [f.name for f in ModelVersion._meta.fields if f.name != "label"]
    assert refusal(ModelVersion(label="TINY-VL").full_clean, exclude=others) == {
        "label": [f"looks like model version 'tiny-v1' {NOT_DIFFERENT}"]
    }
    assert list(ModelVersion.objects.values_list("label", flat=True)) == [existing.label]


def test_adapter_names_are_display_names_and_never_look_alike(demo_checkpoints) -> None:
    """The service refuses (CLI and API go through it): a mixed-script adapter
    name, and two adapter names of one registration that read alike."""
    path = demo_checkpoints["tiny-v1"]
    with pytest.raises(CheckpointError) as mixed:
        checkpoint_fingerprint(path=path, layout=LayoutOptions(dtype="float32"), adapters={"ѕql": str(path)})
    assert str(mixed.value) == (
        "adapter name 'ѕql': mixes Cyrillic and Latin letters (U+0455 CYRILLIC SMALL LETTER DZE), which can imitate another name"
    )
    with pytest.raises(CheckpointError) as alike:
        checkpoint_fingerprint(path=path, layout=LayoutOptions(dtype="float32"), adapters={"sql-v1": "/a", "SQL-vl": "/b"})
    assert (
        str(alike.value)
        == "adapter names 'sql-v1' and 'SQL-vl' look alike (case, Unicode form and look-alike letters do not count)"
    )


def test_tenant_name_and_slug_look_alikes() -> None:
    tenant_get_or_create(slug="acme-1", name="Acme Corp", actor="alice")
    assert refusal(tenant_get_or_create, slug="acme-eu", name="Аcme Corp", actor="alice") == {
        "name": ["mixes Cyrillic and Latin letters (U+0410 CYRILLIC CAPITAL LETTER A), which can imitate another name"]
    }
    assert refusal(tenant_get_or_create, slug="acme-eu", name="ACME CORP", actor="alice") == {
        "name": [f"looks like 'Acme Corp', the name of tenant acme-1 {NOT_DIFFERENT}"]
    }
    assert refusal(tenant_get_or_create, slug="acme-l", name="Acme Europe", actor="alice") == {
        "slug": [f"looks like tenant 'acme-1' {NOT_DIFFERENT}"]
    }
    # The same slug again is the same tenant (get-or-create), not a look-alike of itself.
    assert tenant_get_or_create(slug="acme-1", name="Acme Corp", actor="alice").slug == "acme-1"
    tenant_get_or_create(slug="acme-eu", name="Acme Europe", actor="alice")
    assert list(Tenant.objects.values_list("slug", "slug_key", "name_key")) == [
        ("acme-1", "acrne-l", "acrne corp"),
        ("acme-eu", "acrne-eu", "acrne europe"),
    ]


def test_shared_group_name_and_slug_look_alikes() -> None:
    shared_group_create(slug="partners", name="Partners", actor="alice")
    assert refusal(shared_group_create, slug="partners-2", name="Раrtners", actor="alice") == {"name": [CYRILLIC_ER]}
    assert refusal(shared_group_create, slug="partners-2", name="PARTNERS", actor="alice") == {
        "name": [f"looks like 'Partners', the name of shared group partners {NOT_DIFFERENT}"]
    }
    # Slugs stay ASCII lower case: a look-alike from another script never gets that far.
    assert refusal(shared_group_create, slug="partnerѕ-2", name="Other", actor="alice") == {
        "slug": ["lowercase letters, digits and '-', 1 to 63 characters"]
    }
    shared_group_create(slug="partner-rn", name="Partner M", actor="alice")
    assert refusal(shared_group_create, slug="partner-m", name="Partner N", actor="alice") == {
        "slug": [f"looks like shared group 'partner-rn' {NOT_DIFFERENT}"]
    }
    assert list(SharedGroup.objects.values_list("slug", flat=True)) == ["partner-rn", "partners"]


def test_existing_look_alikes_are_reported_by_the_migration_not_dropped(capsys) -> None:
    migration = importlib.import_module("cacheadmin.migrations.0008_confusable_name_keys")
    # Rows from before the keys (bulk_create stores no key, as the old schema did).
    RetentionOwner.objects.bulk_create([RetentionOwner(name="acme", email="a@x"), RetentionOwner(name="аcme", email="b@x")])
    Tenant.objects.bulk_create([Tenant(slug="t1", name="Acme"), Tenant(slug="tl", name="ACME")])
    owners = dict(RetentionOwner.objects.values_list("name", "pk"))
    tenants = dict(Tenant.objects.values_list("slug", "pk"))
    migration.forwards(apps, None)
    assert capsys.readouterr().out.splitlines() == [
        "",
        "  Names that look alike (case, Unicode form and look-alike letters do not count):",
        f"    retention owner 'аcme' (id {owners['аcme']}) looks like 'acme' (id {owners['acme']}): "
        "left without a key until one of them is renamed",
        f"    tenant slug 'tl' (id {tenants['tl']}) looks like 't1' (id {tenants['t1']}): "
        "left without a key until one of them is renamed",
        f"    tenant name 'ACME' (id {tenants['tl']}) looks like 'Acme' (id {tenants['t1']}): "
        "left without a key until one of them is renamed",
    ]
    assert list(RetentionOwner.objects.order_by("pk").values_list("name", "name_key")) == [("acme", "acrne"), ("аcme", None)]
    assert list(Tenant.objects.order_by("pk").values_list("slug", "slug_key", "name_key")) == [
        ("t1", "tl", "acrne"),
        ("tl", None, None),
    ]
    migration.backwards(apps, None)  # the owner and label keys as they were
    assert list(RetentionOwner.objects.order_by("pk").values_list("name_key", flat=True)) == ["acme", "аcme"]


# -- the API ----------------------------------------------------------------------


def api_refusal(response) -> dict[str, list[str]]:
    assert response.status_code == 400, response.json()
    return response.json()["error"]["fields"]


def test_the_api_refuses_every_kind_of_look_alike(world) -> None:
    alice = world["clients"]["alice"]  # admin scope; the world has tenants Acme and Globex, owner platform
    before = (Tenant.objects.count(), SharedGroup.objects.count(), RetentionOwner.objects.count(), AuditEvent.objects.count())
    post = alice.post
    assert api_refusal(post("/api/tenants/", {"slug": "acme-eu", "name": "аcme"}, format="json")) == {"name": [CYRILLIC_A]}
    assert api_refusal(post("/api/tenants/", {"slug": "acme-eu", "name": "ACME"}, format="json")) == {
        "name": [f"looks like 'Acme', the name of tenant acme {NOT_DIFFERENT}"]
    }
    assert api_refusal(post("/api/shared-groups/", {"slug": "g", "name": "Glоbex"}, format="json")) == {
        "name": ["mixes Latin and Cyrillic letters (U+043E CYRILLIC SMALL LETTER O), which can imitate another name"]
    }
    assert api_refusal(post("/api/retention-owners/", {"name": "plаtform", "email": "p@x.org"}, format="json")) == {
        "name": ["mixes Latin and Cyrillic letters (U+0430 CYRILLIC SMALL LETTER A), which can imitate another name"]
    }
    assert api_refusal(post("/api/retention-owners/", {"name": "p1atform", "email": "p@x.org"}, format="json")) == {
        "name": ["retention owner 'platform' already exists (case, Unicode form and look-alike letters do not count)"]
    }
    registration = {"path": "/nowhere", "label": "tіny-v1", "served_name": "tiny", "adapters": {"ѕql": "/nowhere"}}
    assert api_refusal(post("/api/model-versions/", registration, format="json")) == {
        "label": [CYRILLIC_I],
        "adapters": [
            "adapter name 'ѕql': mixes Cyrillic and Latin letters (U+0455 CYRILLIC SMALL LETTER DZE), "
            "which can imitate another name"
        ],
    }
    after = (Tenant.objects.count(), SharedGroup.objects.count(), RetentionOwner.objects.count(), AuditEvent.objects.count())
    assert after == before
    # Plain distinct names still pass.
    assert post("/api/tenants/", {"slug": "initech", "name": "Initech"}, format="json").status_code == 201
    assert post("/api/shared-groups/", {"slug": "partners", "name": "Partners"}, format="json").status_code == 201
    assert post("/api/retention-owners/", {"name": "storage", "email": "s@x.org"}, format="json").status_code == 201


# -- the CLI and the admin -----------------------------------------------------------


def cli_error(*args: str) -> tuple[int, str]:
    proc = manage(*args, env=subprocess_env())
    return proc.returncode, proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)  # the commands run in subprocesses: rows must be committed
def test_the_cli_refuses_look_alikes() -> None:
    tenant_get_or_create(slug="acme", name="Acme", actor="setup")
    retention_owner_get_or_create(name="platform", email="p@example.com", actor="setup")
    assert cli_error("tenant", "create", "acme-eu", "--name", "ACME") == (
        2,
        f"CommandError: name: looks like 'Acme', the name of tenant acme {NOT_DIFFERENT}",
    )
    assert cli_error("group", "create", "partners", "--name", "Раrtners") == (
        2,
        f"CommandError: name: {CYRILLIC_ER}",
    )
    # The command looks for a clash first: the look-alike of an existing owner is named as such.
    assert cli_error("tenant", "owner", "plаtform", "--email", "x@example.com") == (
        2,
        "CommandError: name: retention owner 'platform' already exists (case, Unicode form and look-alike letters do not count)",
    )
    assert cli_error("tenant", "owner", "tеam", "--email", "x@example.com") == (
        2,
        "CommandError: name: mixes Latin and Cyrillic letters (U+0435 CYRILLIC SMALL LETTER IE), which can imitate another name",
    )
    assert list(Tenant.objects.values_list("slug", flat=True)) == ["acme"] and not SharedGroup.objects.exists()
    created = manage("tenant", "create", "globex", "--name", "Globex", env=subprocess_env())
    assert created.returncode == 0 and json.loads(created.stdout)["slug"] == "globex"


def test_the_admin_add_forms_refuse_look_alikes(admin_client) -> None:
    tenant_get_or_create(slug="acme", name="Acme", actor="setup")
    page = admin_client.post("/admin/cacheadmin/tenant/add/", {"slug": "acme-eu", "name": "ACME"})
    assert page.status_code == 200
    assert page.context["adminform"].form.errors == {"name": [f"looks like 'Acme', the name of tenant acme {NOT_DIFFERENT}"]}
    page = admin_client.post("/admin/cacheadmin/retentionowner/add/", {"name": "tеam", "email": "t@example.com"})
    assert page.status_code == 200
    assert page.context["adminform"].form.errors == {
        "name": ["mixes Latin and Cyrillic letters (U+0435 CYRILLIC SMALL LETTER IE), which can imitate another name"]
    }
    assert list(Tenant.objects.values_list("slug", flat=True)) == ["acme"] and not RetentionOwner.objects.exists()
