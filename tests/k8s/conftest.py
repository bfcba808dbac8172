"""A Kubernetes API stand-in: a stdlib HTTP server on 127.0.0.1 serving the recorded
responses (tests/k8s/recorded/) at the exact paths the ``kubernetes`` client calls,
and recording every request it receives."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

RECORDED = Path(__file__).parent / "recorded"
SCHEMAS = Path(__file__).parent / "schemas"
POOL_PATH = "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools/qwen-pool"
PODS_PATH = "/api/v1/namespaces/llm/pods"


def recorded(name: str) -> Any:
    """A recorded response, parsed (a fresh copy each time)."""
    return json.loads((RECORDED / name).read_text(encoding="utf-8"))


@dataclass
class FakeApi:
    """What the server answers and what it was asked.

    Attributes:
        url: ``http://127.0.0.1:PORT``.
        pool: the InferencePool body (``None``: 404, as for a pool that does not exist).
        pods: the PodList body (its first page).
        requests: ``(method, path, query)`` of every request, in order.
        status: when set, every request is answered with this status and a ``Status`` body.
    """

    url: str = ""
    pool: dict[str, Any] | None = field(default_factory=lambda: recorded("inferencepool.json"))
    pods: dict[str, Any] = field(default_factory=lambda: recorded("pods.json"))
    requests: list[tuple[str, str, dict[str, list[str]]]] = field(default_factory=list)
    status: int | None = None
    #: Later pages of the pod list, by the ``continue`` token that asks for them.
    pages: dict[str, dict[str, Any]] = field(default_factory=dict)

    def pod(self, name: str) -> dict[str, Any]:
        """The recorded pod ``name`` (to change before a sync)."""
        return next(p for p in self.pods["items"] if p["metadata"]["name"] == name)

    def ready_pods(self, *names: str) -> None:
        """Keep only these pods of the recording, as they are."""
        self.pods["items"] = [p for p in self.pods["items"] if p["metadata"]["name"] in names]

    def set_target_port(self, port: int) -> None:
        assert self.pool is not None
        self.pool["spec"]["targetPorts"] = [{"number": port}]

    def set_ip(self, name: str, ip: str) -> None:
        pod = self.pod(name)
        pod["status"]["podIP"] = ip
        pod["status"]["podIPs"] = [{"ip": ip}]


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A ``meta/v1`` Status body, as the API server answers an error."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason,
            "code": code}  # fmt: skip


def _handler(api: FakeApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            parts = urlsplit(self.path)
            api.requests.append(("GET", parts.path, parse_qs(parts.query)))
            if api.status is not None:
                self._answer(api.status, _status(api.status, "Forbidden", "forbidden"))
            elif parts.path == POOL_PATH and api.pool is not None:
                self._answer(200, api.pool)
            elif parts.path == PODS_PATH:
                token = parse_qs(parts.query).get("continue", [""])[0]
                self._answer(200, api.pages[token] if token else api.pods)
            else:
                self._answer(404, _status(404, "NotFound", f"{parts.path} not found"))

        def _answer(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


@pytest.fixture
def fake_api() -> Iterator[FakeApi]:
    """The stand-in, serving a fresh copy of the recordings."""
    api = FakeApi()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(api))
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def k8s_client(fake_api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    """The adopter's Kubernetes client pointed at the stand-in with ``Configuration(host=...)``."""
    from kubernetes.client import ApiClient, Configuration  # type: ignore[import-untyped]

    def client() -> Any:
        return ApiClient(Configuration(host=fake_api.url))

    monkeypatch.setattr("cacheadmin.services.inference_pools.kubernetes_api_client", client)
    return fake_api


def kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig whose current context reaches ``server`` without credentials."""
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "stand-in",
                "clusters": [{"name": "stand-in", "cluster": {"server": server}}],
                "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "nobody"}}],
                "users": [{"name": "nobody", "user": {}}],
            }
        ),  # fmt: skip
        encoding="utf-8",
    )
    return path


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists its ``properties`` closed to others
    (``additionalProperties: false``), unless it keeps unknown fields
    (``x-kubernetes-preserve-unknown-fields``): Kubernetes' schemas leave objects open, so
    without this a misspelt field would pass."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def validator(document: str, root: str | None = None) -> Callable[[Any], list[str]]:
    """A validator of a vendored schema: an OpenAPI document's component ``root``, or a CRD's
    ``openAPIV3Schema`` (``root`` None), closed (:func:`closed`). Returns the errors, one line each."""
    from jsonschema import Draft7Validator  # type: ignore[import-untyped]

    loaded = json.loads((SCHEMAS / document).read_text(encoding="utf-8"))
    schema = {"$ref": f"#/components/schemas/{root}", "components": closed(loaded["components"])} if root else closed(loaded)
    checker = Draft7Validator(copy.deepcopy(schema))

    def errors(instance: Any) -> list[str]:
        return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in checker.iter_errors(instance))

    return errors
