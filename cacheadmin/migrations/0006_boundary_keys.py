"""Immutable boundary keys for tenants and shared groups.

Rows that exist keep an empty key, so their namespace ids (derived from the
boundary) do not change; every row created from now on draws a random key.
"""

from django.db import migrations, models

import cacheadmin.models.tenancy


class Migration(migrations.Migration):
    dependencies = [
        ("cacheadmin", "0005_membership_generation"),
    ]

    operations = [
        migrations.AddField(
            model_name="tenant",
            name="key",
            field=models.CharField(blank=True, default="", editable=False, max_length=32),
            preserve_default=False,
        ),
        migrations.AlterField(
            model_name="tenant",
            name="key",
            field=models.CharField(blank=True, default=cacheadmin.models.tenancy.new_boundary_key, editable=False, max_length=32),
        ),
        migrations.AddField(
            model_name="sharedgroup",
            name="key",
            field=models.CharField(blank=True, default="", editable=False, max_length=32),
            preserve_default=False,
        ),
        migrations.AlterField(
            model_name="sharedgroup",
            name="key",
            field=models.CharField(blank=True, default=cacheadmin.models.tenancy.new_boundary_key, editable=False, max_length=32),
        ),
    ]
