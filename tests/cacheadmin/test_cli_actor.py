"""Who a management command acts as: ``cli:<OS user>`` in the audit trail, from the
process's uid (never from ``$USER``, which anyone sets), ``cli:uid<N>`` for a uid the
password database does not name."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys

import pytest

from cacheadmin.management.base import cli_actor
from cacheadmin.models import AccountingScan, AuditEvent, Tenant
from tests.helpers import PROJECT, manage, subprocess_env

OS_USER = pwd.getpwuid(os.getuid()).pw_name


def test_the_actor_is_the_os_account_of_the_process() -> None:
    assert cli_actor() == f"cli:{OS_USER}"


def _unnamed_uid() -> int:
    uid = 54321
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


@pytest.mark.skipif(os.getuid() != 0, reason="changing uid needs root")
def test_a_uid_without_a_name_is_recorded_by_number() -> None:
    uid = _unnamed_uid()
    # Imported first: the project's files need not be readable by that uid.
    code = f"import os; from cacheadmin.management.base import cli_actor; os.setuid({uid}); print(cli_actor())"
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"cli:uid{uid}\n", "")


@pytest.mark.django_db(transaction=True)
def test_a_command_audits_its_os_user_whatever_user_says() -> None:
    # $USER and $LOGNAME are the caller's to set: getpass.getuser() would take them first.
    env = subprocess_env(USER="mallory", LOGNAME="mallory")
    done = manage("tenant", "create", "acme", "--name", "Acme", env=env)
    assert done.returncode == 0, done.stderr
    tenant = Tenant.objects.get(slug=json.loads(done.stdout)["slug"])
    (event,) = AuditEvent.objects.filter(object_type="tenant", object_id=str(tenant.pk))
    assert (event.actor, event.action) == (f"cli:{OS_USER}", "tenant.create")
    # A row a command creates names the same actor (an accounting scan's creator).
    scanned = manage("accounting", "scan", env=env)
    assert scanned.returncode == 0, scanned.stderr
    assert list(AccountingScan.objects.values_list("created_by", flat=True)) == [f"cli:{OS_USER}"]
