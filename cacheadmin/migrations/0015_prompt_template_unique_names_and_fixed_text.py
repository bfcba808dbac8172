"""Prompt template names unique across every tenant (they are the metrics'
``template`` label, which carries no tenant), and no two templates of the same
precedence (two global ones, two of one tenant) with the same fixed text.

Rows already in conflict are kept: a later template whose name is taken is
renamed ``<name>-<id>``; a later one whose fixed text an older one of the
same precedence has gets no digest (NULL), so the constraint leaves it alone.
"""

import hashlib
import string

from django.db import migrations, models

#: As :mod:`gateway.templates` matches: the fixed text's first 128 chunks of 32 characters.
_MATCHED_CHARS = 4096


def _fixed_digest(text: str) -> str | None:
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError:
        return None
    fixed = []
    for literal, name, _, _ in parsed:
        fixed.append(literal)
        if name is not None:
            break
    matched = "".join(fixed)[:_MATCHED_CHARS]
    return hashlib.blake2b(matched.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _resolve_conflicts(apps, schema_editor) -> None:  # noqa: ANN001 (migration signature)
    PromptTemplate = apps.get_model("cacheadmin", "PromptTemplate")
    names: set[str] = set()
    digests: set[tuple[int | None, str]] = set()
    for template in PromptTemplate.objects.order_by("id"):
        name = template.name
        n = 0
        while name in names:
            n += 1
            suffix = f"-{template.pk}" + (f"-{n}" if n > 1 else "")
            name = template.name[: 64 - len(suffix)] + suffix
        names.add(name)
        digest = _fixed_digest(template.text)
        if digest is not None and (template.tenant_id, digest) in digests:
            digest = None
        elif digest is not None:
            digests.add((template.tenant_id, digest))
        PromptTemplate.objects.filter(pk=template.pk).update(name=name, fixed_digest=digest)


class Migration(migrations.Migration):
    dependencies = [
        ("cacheadmin", "0014_dashboard_indexes"),
    ]

    operations = [
        migrations.AddField(
            model_name="prompttemplate",
            name="fixed_digest",
            field=models.CharField(blank=True, editable=False, max_length=32, null=True),
        ),
        migrations.RemoveConstraint(model_name="prompttemplate", name="prompt_template_name_per_tenant"),
        migrations.RemoveConstraint(model_name="prompttemplate", name="prompt_template_name_global"),
        migrations.RunPython(_resolve_conflicts, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name="prompttemplate",
            constraint=models.UniqueConstraint(fields=("name",), name="prompt_template_name_unique"),
        ),
        migrations.AddConstraint(
            model_name="prompttemplate",
            constraint=models.UniqueConstraint(fields=("tenant", "fixed_digest"), name="prompt_template_fixed_text_per_tenant"),
        ),
        migrations.AddConstraint(
            model_name="prompttemplate",
            constraint=models.UniqueConstraint(
                condition=models.Q(("tenant__isnull", True)), fields=("fixed_digest",), name="prompt_template_fixed_text_global"
            ),
        ),
    ]
