"""TLS and cookie security come from the environment; `check --deploy` is
clean with them set and names each missing one otherwise."""

from __future__ import annotations

import os

import pytest

from tests.helpers import manage

HTTPS_ENV = {
    "DJANGO_ALLOWED_HOSTS": "cp.example.com",
    "DJANGO_HTTPS": "1",
    "DJANGO_HSTS_SECONDS": "31536000",
    "DJANGO_HSTS_INCLUDE_SUBDOMAINS": "1",
    "DJANGO_HSTS_PRELOAD": "1",
    "DJANGO_SECURE_PROXY_SSL_HEADER": "X-Forwarded-Proto",
    "DJANGO_CSRF_TRUSTED_ORIGINS": "https://cp.example.com",
}


@pytest.mark.slow
def test_check_deploy_is_clean_with_the_https_settings() -> None:
    clean = manage("check", "--deploy", "--fail-level", "WARNING", env={**os.environ, **HTTPS_ENV})
    assert clean.returncode == 0, clean.stderr
    assert "System check identified no issues" in clean.stdout
    plain = manage("check", "--deploy", "--fail-level", "WARNING", env={**os.environ, "DJANGO_ALLOWED_HOSTS": "cp.example.com"})
    assert plain.returncode == 1
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert warning in plain.stderr, warning


@pytest.mark.slow
def test_a_malformed_setting_refuses_the_start() -> None:
    bad = manage("check", env={**os.environ, "DJANGO_HTTPS": "maybe"})
    assert bad.returncode != 0 and "DJANGO_HTTPS='maybe' is not a boolean" in bad.stderr
