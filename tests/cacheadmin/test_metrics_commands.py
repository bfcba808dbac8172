"""``manage.py metrics_token`` and ``manage.py metrics_serve``, run as operators run them."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from cacheadmin.models import CacheNamespace, RetentionOwner, Tenant
from tests.cacheadmin.conftest import make_version
from tests.helpers import PROJECT, manage, subprocess_env, wait_for
from tests.prometheus import free_port

pytestmark = pytest.mark.django_db(transaction=True)  # the command's process reads committed rows


def test_metrics_token_prints_the_token_the_endpoints_ask_for() -> None:
    done = manage("metrics_token")
    assert done.returncode == 0, done.stderr
    assert done.stdout == settings.METRICS_TOKEN + "\n"


def test_metrics_serve_answers_without_a_token_on_its_own_address() -> None:
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    owner = RetentionOwner.objects.create(name="platform", email="p@example.com")
    CacheNamespace.objects.create(namespace_key="a" * 64, model_version=make_version("v1", "1" * 64), tenant=tenant,
                                  retention_owner=owner, storage_prefix="ns-acme")  # fmt: skip
    assert manage("metrics_serve", "--addr", "nonsense", env=subprocess_env()).returncode == 2
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "metrics_serve", "--addr", f"127.0.0.1:{port}"], cwd=PROJECT, env=subprocess_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line == f"metrics on http://127.0.0.1:{port}/metrics (no token: keep this address private)\n"
        taken = manage("metrics_serve", "--addr", f"127.0.0.1:{port}", env=subprocess_env())
        assert taken.returncode == 3 and "cannot listen" in taken.stderr
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            response = client.get("/metrics")
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
            (info,) = [f for f in text_string_to_metric_families(response.text) if f.name == "kvcp_namespace_info"]
            assert [s.labels["namespace"] for s in info.samples] == ["a" * 64]
            assert client.get("/").status_code == 404
            assert client.post("/metrics").status_code == 405
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: proc.poll() is not None, timeout=10, what="metrics_serve to stop on SIGTERM")
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
