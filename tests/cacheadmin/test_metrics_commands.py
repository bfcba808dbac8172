"""``manage.py metrics_token`` and ``manage.py metrics_serve``, run as operators run them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from cacheadmin.models import CacheNamespace, RetentionOwner, Tenant
from inference.child_env import die_with_parent
from tests.cacheadmin.conftest import make_version
from tests.cacheadmin.test_metrics import DETAIL_QUERIES
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
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
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
            assert info.samples == []  # nothing else names the namespace
            detail = client.get("/metrics?detail=namespaces")
            (info,) = [f for f in text_string_to_metric_families(detail.text) if f.name == "kvcp_namespace_info"]
            assert [s.labels["namespace"] for s in info.samples] == ["a" * 64]
            wrong = client.get("/metrics?detail=all")
            assert (wrong.status_code, wrong.json()["error"]["code"]) == (400, "invalid")
            # The same answers as the web view's /metrics to the same queries.
            assert [(q, client.get(f"/metrics?{q}").status_code) for q, _ in DETAIL_QUERIES] == DETAIL_QUERIES
            assert client.get("/").status_code == 404
            assert client.post("/metrics").status_code == 405
        proc.send_signal(signal.SIGTERM)
        # A liveness bound, not a speed claim: on 2 cores under a CI lane with live
        # engines, a process's exit has taken over 10 s.
        wait_for(lambda: proc.poll() is not None, timeout=30, what="metrics_serve to stop on SIGTERM")
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- A secret the settings refuse: one line, exit 2, for every command ------------------------------------

#: What every command prints (its whole stderr) when a secret from the environment is refused.
ENV_REFUSAL = (
    "manage.py: configuration error: {var} {problem}: refusing it. Set {var} to 32 or more visible ASCII characters "
    "(e.g. the output of: python -c 'import secrets; print(secrets.token_hex(32))'), or unset it to use {path}\n"
)
FILE_REFUSAL = (
    "manage.py: configuration error: {path} {problem}: refusing a weak secret. Restore it from a backup, or set {var}; "
    "deleting it makes a new one and changes every value derived from it\n"
)
SECRETS = {"DJANGO_SECRET_KEY": "secret-key", "CACHE_SALT_SECRET": "cache-salt-secret", "METRICS_TOKEN": "metrics-token"}


def own_var(var_dir: Path, **env: str) -> dict[str, str]:
    """The environment with a VAR_DIR of its own and no secret from the environment (unless given)."""
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS}
    return {**clean, "VAR_DIR": str(var_dir), **env}


def var_with_secrets(tmp_path: Path) -> Path:
    """A VAR_DIR whose three secrets exist and are fit (made by a command that succeeds)."""
    var = tmp_path / "var"
    done = manage("metrics_token", env=own_var(var))
    assert done.returncode == 0, done.stderr
    return var


@pytest.mark.slow
@pytest.mark.parametrize("var_name", list(SECRETS))
@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("short", "is shorter than 32 characters"),
        ("   ", "is shorter than 32 characters"),
        ("é" * 32, "holds a character outside visible ASCII (position 1)"),
        ("a" * 31 + "\u00a0" + "b", "holds a character outside visible ASCII (position 32)"),
        ("a" * 20 + " " + "b" * 20, "holds a character outside visible ASCII (position 21)"),
    ],
)
def test_a_refused_secret_from_the_environment_is_one_line_and_exit_2(
    tmp_path: Path, var_name: str, value: str, problem: str
) -> None:
    var = var_with_secrets(tmp_path)
    before = {name: (var / name).read_bytes() for name in SECRETS.values()}
    for command in (["metrics_token"], ["check"]):
        done = manage(*command, env=own_var(var, **{var_name: value}))
        assert (done.returncode, done.stdout) == (2, "")
        assert done.stderr == ENV_REFUSAL.format(var=var_name, problem=problem, path=var / SECRETS[var_name])
    assert {name: (var / name).read_bytes() for name in SECRETS.values()} == before  # nothing written


@pytest.mark.slow
@pytest.mark.parametrize("var_name", list(SECRETS))
@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "holds 0 characters, fewer than 32"),
        (b"abc", "holds 3 characters, fewer than 32"),
        ("é".encode() * 32, "holds a character outside visible ASCII"),
        (b"a" * 40 + b"\x07" + b"b", "holds a character outside visible ASCII (position 41)"),
    ],
)
def test_a_refused_secret_file_is_one_line_and_exit_2(tmp_path: Path, var_name: str, content: bytes, problem: str) -> None:
    var = var_with_secrets(tmp_path)
    (var / SECRETS[var_name]).write_bytes(content)
    before = {name: (var / name).read_bytes() for name in SECRETS.values()}
    for command in (["metrics_token"], ["check"]):
        done = manage(*command, env=own_var(var))
        assert (done.returncode, done.stdout) == (2, "")
        assert done.stderr == FILE_REFUSAL.format(path=var / SECRETS[var_name], problem=problem, var=var_name)
    assert {name: (var / name).read_bytes() for name in SECRETS.values()} == before  # nothing overwritten


@pytest.mark.slow
def test_a_fit_metrics_token_from_the_environment_is_printed_and_opens_metrics(tmp_path: Path) -> None:
    token = "Tok-" + "x" * 28 + "~!"  # 34 visible ASCII characters
    done = manage("metrics_token", env=own_var(tmp_path / "var", METRICS_TOKEN=f"  {token}\n"))
    assert (done.returncode, done.stdout, done.stderr) == (0, token + "\n", "")
    assert not (tmp_path / "var" / "metrics-token").exists()  # the environment's token is not written anywhere


# --- metrics_serve's address ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ((), {"METRICS_ADDR": ""}, "no address to listen on: pass --addr HOST:PORT (e.g. 127.0.0.1:9466) or set "
         "METRICS_ADDR; without either, scrape GET /metrics of the web server with the token"),
        (("--addr", "256.1.1.1:9000"), {}, "--addr: '256.1.1.1' is not an IPv4 address in '256.1.1.1:9000'"),
        (("--addr", "::1:9000"), {}, "--addr: an IPv6 address goes in brackets, e.g. [::1]:9466, got '::1:9000'"),
        (("--addr", "[::g]:9000"), {}, "--addr: [::g] is not an IPv6 address in '[::g]:9000'"),
        (("--addr", "[::1:9000"), {}, "--addr: unbalanced brackets in host '[::1' of '[::1:9000'"),
        (("--addr", "127.0.0.1:0"), {}, "--addr: port must be 1..65535, got '0' in '127.0.0.1:0'"),
        (("--addr", "127.0.0.1:٩٠٠٠"), {}, "--addr: port must be 1..65535, got '٩٠٠٠' in '127.0.0.1:٩٠٠٠'"),
        ((), {"METRICS_ADDR": "localhost"},
         "METRICS_ADDR: must be HOST:PORT (e.g. 127.0.0.1:9466 or [::1]:9466), got 'localhost'"),
    ],
)  # fmt: skip
def test_metrics_serve_refuses_a_bad_address_before_binding(args: tuple[str, ...], env: dict[str, str], message: str) -> None:
    done = manage("metrics_serve", *args, env={**subprocess_env(), **env})
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"CommandError: {message}\n")


@pytest.mark.slow
def test_metrics_serve_refuses_a_host_name_that_does_not_resolve() -> None:
    """``.invalid`` never resolves (RFC 6761); the resolver's reason depends on the host (offline or not)."""
    done = manage("metrics_serve", "--addr", "no-such-host.invalid:9000", env=subprocess_env())
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("CommandError: --addr: host 'no-such-host.invalid' does not resolve (")
    assert done.stderr.endswith(") in 'no-such-host.invalid:9000'\n") and done.stderr.count("\n") == 1


@pytest.mark.slow
def test_metrics_serve_listens_on_ipv6_and_answers_head_and_other_methods() -> None:
    if not socket.has_ipv6:
        pytest.skip("this host has no IPv6")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "metrics_serve", "--addr", f"[::1]:{port}"], cwd=PROJECT, env=subprocess_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line == f"metrics on http://[::1]:{port}/metrics (no token: keep this address private)\n"
        with httpx.Client(base_url=f"http://[::1]:{port}", timeout=10) as client:
            got = client.get("/metrics")
            assert got.status_code == 200 and "kvcp_" in got.text
            head = client.head("/metrics")
            assert (head.status_code, head.content) == (200, b"")
            assert head.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
            assert int(head.headers["content-length"]) > 0
            for method in ("POST", "PUT", "DELETE"):
                refused = client.request(method, "/metrics", content=b"x")
                assert refused.status_code == 405
                assert refused.headers["allow"] == "GET, HEAD"
                assert refused.json() == {"error": {"status": 405, "code": "method_not_allowed",
                                                    "message": f"{method} is not allowed on /metrics (GET or HEAD)"}}  # fmt: skip
            missing = client.get("/other")
            assert missing.status_code == 404
            assert missing.json() == {"error": {"status": 404, "code": "not_found",
                                                "message": "not found: the metrics are at /metrics"}}  # fmt: skip
        taken = manage("metrics_serve", "--addr", f"[::1]:{port}", env=subprocess_env())
        assert (taken.returncode, taken.stderr) == (3, f"CommandError: cannot listen on [::1]:{port}: Address already in use\n")
        proc.send_signal(signal.SIGTERM)
        # A liveness bound, not a speed claim: on 2 cores under a CI lane with live
        # engines, a process's exit has taken over 10 s.
        wait_for(lambda: proc.poll() is not None, timeout=30, what="metrics_serve to stop on SIGTERM")
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- The other commands that listen parse their address the same way ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("gateway", "--addr", "256.1.1.1:9000"), "--addr: '256.1.1.1' is not an IPv4 address in '256.1.1.1:9000'"),
        (("gateway", "--addr", "::1:9000"), "--addr: an IPv6 address goes in brackets, e.g. [::1]:8300, got '::1:9000'"),
        (("gateway", "--addr", "localhost"),
         "--addr: must be HOST:PORT (e.g. 127.0.0.1:8300 or [::1]:8300), got 'localhost'"),
        (("kv_events", "--metrics-addr", "localhost", "--seconds", "1"),
         "--metrics-addr: must be HOST:PORT (e.g. 127.0.0.1:9464 or [::1]:9464), got 'localhost'"),
        (("kv_events", "--metrics-addr", "256.1.1.1:9000", "--seconds", "1"),
         "--metrics-addr: '256.1.1.1' is not an IPv4 address in '256.1.1.1:9000'"),
        (("kv_events", "--metrics-addr", "[::1:9000", "--seconds", "1"),
         "--metrics-addr: unbalanced brackets in host '[::1' of '[::1:9000'"),
        (("kv_events", "--metrics-addr", "unix:/tmp/x", "--seconds", "1"),
         "--metrics-addr takes HOST:PORT (Prometheus scrapes over TCP)"),
    ],
)  # fmt: skip
def test_gateway_and_kv_events_refuse_a_bad_address_before_binding(args: tuple[str, ...], message: str) -> None:
    done = manage(*args, env=subprocess_env())
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"CommandError: {message}\n")


@pytest.mark.slow
@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_a_taken_address_is_a_conflict_for_each_command_that_listens(family: socket.AddressFamily) -> None:
    if family == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("this host has no IPv6")
    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    with socket.create_server((host, 0), family=family) as taken:
        port = taken.getsockname()[1]
        addr = f"{host}:{port}" if family == socket.AF_INET else f"[{host}]:{port}"
        for args, prefix, suffix in [
            (("metrics_serve", "--addr", addr), "", ""),
            (("gateway", "--addr", addr), "", "; set another with --addr or GATEWAY_ADDR"),
            (("kv_events", "--metrics-addr", addr, "--seconds", "1"), "--metrics-addr: ", ""),
        ]:
            done = manage(*args, env=subprocess_env())
            assert (done.returncode, done.stdout, done.stderr) == (
                3, "", f"CommandError: {prefix}cannot listen on {addr}: Address already in use{suffix}\n"
            ), args  # fmt: skip
