"""Owners' digests go through Django's mail backend: its file backend under VAR_DIR/mail/ by
default (never into a command's output), and a run can say how many it wrote and where."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core import mail

from cacheadmin.mail import FILE_BACKEND, digests_report, mail_count
from tests.helpers import manage, subprocess_env

SHOW = "from django.conf import settings as s; print(s.EMAIL_BACKEND, s.EMAIL_FILE_PATH, s.EMAIL_HOST, s.EMAIL_USE_TLS)"


def test_the_default_backend_writes_files_under_var_dir(tmp_path: Path) -> None:
    env = {k: v for k, v in subprocess_env(VAR_DIR=str(tmp_path)).items() if not k.startswith("EMAIL_")}
    done = manage("shell", "-v", "0", "-c", SHOW, env=env)
    assert (done.returncode, done.stdout) == (0, f"{FILE_BACKEND} {tmp_path / 'mail'} localhost False\n"), done.stderr


def test_the_mail_settings_are_read_from_the_environment(tmp_path: Path) -> None:
    env = subprocess_env(
        EMAIL_BACKEND="django.core.mail.backends.smtp.EmailBackend", EMAIL_FILE_PATH=str(tmp_path),
        EMAIL_HOST="smtp.example.com", EMAIL_USE_TLS="1",
    )  # fmt: skip
    done = manage("shell", "-v", "0", "-c", SHOW, env=env)
    assert done.stdout == f"django.core.mail.backends.smtp.EmailBackend {tmp_path} smtp.example.com True\n", done.stderr
    bad = manage("shell", "-v", "0", "-c", SHOW, env=subprocess_env(EMAIL_USE_TLS="maybe"))
    assert bad.returncode != 0 and "EMAIL_USE_TLS" in bad.stderr


def _send(count: int) -> None:
    for n in range(count):
        mail.send_mail(subject=f"digest {n}", message="body\n" + "-" * 78, from_email="a@x", recipient_list=["o@x"])


def test_the_digests_written_since_a_count_are_counted_where_they_were_written(settings, tmp_path: Path) -> None:
    settings.EMAIL_BACKEND, settings.EMAIL_FILE_PATH = FILE_BACKEND, str(tmp_path / "mail")
    assert mail_count() == 0  # no folder yet
    assert digests_report(0) == f"owners' e-mail digests: 0 written to {tmp_path / 'mail'}/ (EMAIL_BACKEND filebased)"
    _send(1)  # an earlier run's
    before = mail_count()
    _send(2)
    assert (before, mail_count(), mail_count(tmp_path / "mail")) == (1, 3, 3)
    assert digests_report(before) == f"owners' e-mail digests: 2 written to {tmp_path / 'mail'}/ (EMAIL_BACKEND filebased)"


@pytest.mark.parametrize("backend", ["django.core.mail.backends.smtp.EmailBackend"])
def test_another_backend_is_named_not_counted(settings, backend: str) -> None:
    settings.EMAIL_BACKEND = backend
    assert digests_report(0) == f"owners' e-mail digests: sent through EMAIL_BACKEND {backend}"
