"""The control plane fetches on behalf of callers: adoption and metrics URLs.
Found: both fetched any URL given and echoed the reply in the error (an
internal service's body came back in a 409). Now every address is checked
against the deployment's policy before anything is sent, a metrics URL must be
the engine's own origin, and no remote body is repeated."""

from __future__ import annotations

import http.server
import ipaddress
import json
import threading
from collections.abc import Iterator

import pytest
from django.test import override_settings

from cacheadmin.models import Engine
from cacheadmin.services.addresses import engine_api_key
from cacheadmin.services.engines import engine_client
from inference.errors import EngineError
from inference.netpolicy import AddressPolicy, AddressRefused, pinned_url, same_origin, server_origin

pytestmark = pytest.mark.django_db

SECRET_BODY = "internal-service-secret-8f2a"


class _Internal(http.server.BaseHTTPRequestHandler):
    """An internal service: answers every path with a body that must never reach a caller."""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": SECRET_BODY, "object": "model", "owned_by": "corp"}]})
            self.send_response(200)
        else:
            body = f"<html>{SECRET_BODY}</html>"
            self.send_response(500)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(body.encode())

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def internal_service() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Internal)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_service_that_is_not_a_vllm_engine_is_refused_in_our_words(world, real_version, internal_service) -> None:
    alice, before = world["clients"]["alice"], Engine.objects.count()
    answer = alice.post("/api/engines/adopt/", {"url": internal_service, "model_version": real_version[0].pk}, format="json")
    assert answer.status_code == 409
    message = answer.json()["error"]["message"]
    assert SECRET_BODY not in json.dumps(answer.json())
    assert message == (
        f"adoption refused: {internal_service}/v1/models is not a vLLM server's model list (object list of models owned by vllm)"
    )
    # An error status: the status and nothing the server sent.
    row = world["engine"]
    Engine.objects.filter(pk=row.pk).update(base_url=internal_service)
    row.refresh_from_db()
    with engine_client(row) as client, pytest.raises(EngineError) as failed:
        client.reset_prefix_cache()
    assert str(failed.value) == f"engine at {internal_service} answered 500 on /reset_prefix_cache"
    assert Engine.objects.count() == before


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (
            "http://169.254.169.254/latest",
            "169.254.169.254 is link-local (cloud metadata lives at 169.254.169.254): never contacted",
        ),
        ("http://[fd00:ec2::254]:80", "fd00:ec2::254 is a cloud metadata address: never contacted"),
        ("http://100.100.100.200:80", "100.100.100.200 is a cloud metadata address: never contacted"),
        ("http://0.0.0.0:8000", "0.0.0.0 is an unspecified address: never contacted"),
        ("http://[fe80::1]:8000", "fe80::1 is link-local: never contacted"),
        (
            "http://10.1.2.3:8000",
            "10.1.2.3 is outside the networks engines may be reached on (127.0.0.0/8, ::1/128; setting ENGINE_ALLOWED_NETWORKS)",
        ),
        ("http://no-such-host.invalid:8000", "the host 'no-such-host.invalid' does not resolve"),
    ],
)
def test_addresses_outside_the_policy_are_refused_before_anything_is_sent(world, url: str, problem: str) -> None:
    alice, before = world["clients"]["alice"], Engine.objects.count()
    answer = alice.post("/api/engines/adopt/", {"url": url, "model_version": world["v1"].pk}, format="json")
    assert answer.status_code == 400, answer.json()
    assert answer.json()["error"] == {
        "status": 400, "code": "address_refused", "message": f"url: {problem}", "fields": {"url": [problem]},
    }  # fmt: skip
    assert Engine.objects.count() == before


def test_a_deployment_names_its_private_networks_and_never_metadata(world, real_version) -> None:
    with override_settings(ENGINE_ALLOWED_NETWORKS=["10.0.0.0/8"]):
        answer = world["clients"]["alice"].post(
            "/api/engines/adopt/", {"url": "http://10.255.255.1:9", "model_version": real_version[0].pk}, format="json"
        )
        # Allowed: contacted (it is no vLLM engine, whatever answers there): refused for that, not for its address.
        assert (answer.status_code, answer.json()["error"]["code"]) == (409, "engine_refused")
    with pytest.raises(ValueError, match="is link-local .*: never contacted"):
        AddressPolicy.parse(["169.254.0.0/16"])
    policy = AddressPolicy.parse(["0.0.0.0/0"])  # "everything" still excludes what is never contacted
    assert policy.refusal(ipaddress.ip_address("169.254.169.254")) is not None
    assert policy.refusal(ipaddress.ip_address("10.1.2.3")) is None


def test_kv_event_endpoints_and_metrics_urls_are_checked_too(world) -> None:
    alice, version = world["clients"]["alice"], world["v1"].pk
    body = {"url": "http://127.0.0.1:9", "model_version": version}
    own_origin = "must be served by the engine itself: the same scheme, host and port as url"
    cases = [
        ({"metrics_url": "http://127.0.0.1:10/metrics"}, "metrics_url", own_origin),
        ({"metrics_url": "http://169.254.169.254/metrics"}, "metrics_url", own_origin),
        (
            {"kv_events": "tcp://169.254.169.254:5557", "kv_events_replay": "tcp://127.0.0.1:5558", "kv_events_key": "x" * 40},
            "kv_events",
            "169.254.169.254 is link-local (cloud metadata lives at 169.254.169.254): never contacted",
        ),
        ({"kv_events": "tcp://127.0.0.1:5557", "kv_events_replay": "tcp://127.0.0.1:5558"}, "kv_events_key", None),
        ({"kv_events": "tcp://127.0.0.1:5557", "kv_events_key": "x" * 40}, "kv_events_replay", None),
        ({"kv_connector": "rm -rf"}, "kv_connector", "none, or the KV connector's class name (e.g. LMCacheConnectorV1)"),
    ]  # fmt: skip
    for extra, field, problem in cases:
        answer = alice.post("/api/engines/adopt/", {**body, **extra}, format="json")
        assert answer.status_code == 400, (extra, answer.json())
        assert list(answer.json()["error"]["fields"]) == [field], (extra, answer.json())
        if problem is not None:
            assert answer.json()["error"]["fields"][field] == [problem]


def test_one_server_under_every_spelling_of_its_address() -> None:
    a = server_origin("http://localhost:8000")
    for same in ("http://127.0.0.1:8000/", "http://[::ffff:127.0.0.1]:8000", "http://LOCALHOST:8000"):
        assert a.same_server(server_origin(same)), same
    for other in ("http://127.0.0.1:8001", "http://127.0.0.2:8000"):
        assert not a.same_server(server_origin(other)), other
    assert server_origin("http://127.0.0.1").port == 80 and server_origin("https://127.0.0.1").port == 443
    assert same_origin("http://Engine:80/metrics", "http://engine")
    assert not same_origin("https://engine/metrics", "http://engine")
    assert pinned_url("http://localhost:8000/v1", frozenset({ipaddress.ip_address("127.0.0.1")})) == (
        "http://127.0.0.1:8000/v1", {"Host": "localhost:8000"},
    )  # fmt: skip
    assert pinned_url("https://engine:8000", frozenset({ipaddress.ip_address("127.0.0.1")})) == ("https://engine:8000", {})


def test_an_engine_whose_address_is_refused_now_is_not_contacted(world) -> None:
    row = world["engine"]
    Engine.objects.filter(pk=row.pk).update(base_url="http://169.254.169.254:80")
    row.refresh_from_db()
    with pytest.raises(EngineError, match="169.254.169.254 is link-local .*: never contacted"):
        engine_client(row)
    with pytest.raises(AddressRefused):
        AddressPolicy.parse([]).check_url("url", "http://169.254.169.254")


def test_gateways_route_to_checked_and_pinned_addresses_only(world) -> None:
    from cacheadmin.services.gateway import routing_snapshot_build

    ns = world["ns"]["acme"]
    named = Engine.objects.create(
        name="named", model_version=world["v1"], namespace=ns, base_url="http://localhost:18009", status="ready",
        verification="verified",
    )  # fmt: skip
    Engine.objects.create(
        name="metadata", model_version=world["v1"], namespace=ns, base_url="http://169.254.169.254:80", status="ready",
        verification="verified",
    )  # fmt: skip
    targets = {e.name: e for e in routing_snapshot_build().namespaces[ns.pk].engines}
    assert set(targets) == {"named"}
    assert (targets["named"].id, targets["named"].base_url, targets["named"].headers) == (
        named.pk, "http://127.0.0.1:18009",
        (("Host", "localhost:18009"), ("Authorization", f"Bearer {engine_api_key(named)}")),
    )  # fmt: skip
