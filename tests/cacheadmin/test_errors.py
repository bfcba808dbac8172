"""Each service error class says its API status, code and CLI exit code; both surfaces read them from the class."""

from __future__ import annotations

import pytest
from django.core.management.base import CommandError

# Each module below defines error classes.
import cacheadmin.services.engine_verification  # noqa: F401
import cacheadmin.services.engines  # noqa: F401
import cacheadmin.services.eviction  # noqa: F401
import cacheadmin.services.gateway  # noqa: F401
import cacheadmin.services.inference_pools  # noqa: F401
import cacheadmin.services.model_versions  # noqa: F401
import cacheadmin.services.namespaces  # noqa: F401
import cacheadmin.services.prewarm  # noqa: F401
import cacheadmin.services.quotas  # noqa: F401
import cacheadmin.services.releases  # noqa: F401
import gateway.layers.base  # noqa: F401
from cacheadmin.api.exceptions import api_exception_handler
from cacheadmin.management.base import ControlPlaneCommand
from inference.errors import ControlPlaneError, Refused
from inference.netpolicy import AddressRefused  # noqa: F401

#: Every error class the surfaces report, with the status, code and exit code the README documents.
EXPECTED = {
    "CheckpointError": (400, "bad_checkpoint", 2),
    "CheckpointOutsideRoots": (400, "invalid", 2),
    "AdapterOutsideRoots": (400, "invalid", 2),
    "InvalidField": (400, "invalid", 2),
    "TierUnavailable": (503, "tier_unavailable", 3),
    "RegistrationConflict": (409, "registration_conflict", 3),
    "EngineRefused": (409, "engine_refused", 4),
    "VerificationRefused": (409, "verification_refused", 4),
    "EngineUnreachable": (503, "engine_unreachable", 3),
    # The Ray cluster (RAY_ADDRESS) does not answer.
    "ClusterUnreachable": (503, "cluster_unreachable", 3),
    "NamespaceConflict": (409, "namespace_conflict", 4),
    "GroupError": (409, "group_conflict", 4),
    "JobRefused": (409, "job_refused", 4),
    "EvictionRefused": (409, "eviction_refused", 4),
    "ReleaseRefused": (409, "release_refused", 4),
    "ReleaseConflict": (409, "release_conflict", 4),
    "LifecycleError": (409, "lifecycle_conflict", 4),
    "GatewayRefused": (409, "gateway_refused", 4),
    # The Kubernetes API cannot be configured, reached or read, or the InferencePool is not of the v1 shape.
    "InferencePoolRefused": (409, "inference_pool_refused", 4),
    # An address the deployment's policy (ENGINE_ALLOWED_NETWORKS) does not let the control plane contact.
    "AddressRefused": (400, "address_refused", 2),
    # A tenant holds as many rows of a kind as its quota allows.
    "QuotaExceeded": (429, "quota_exceeded", 4),
    # A cache layer's store (gateway.layers.base: one class for every layer).
    "StoreUnavailable": (503, "store_unavailable", 3),
}


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _instance(cls: type[ControlPlaneError]) -> ControlPlaneError:
    if cls.__name__ in ("InvalidField", "AddressRefused"):
        return cls("field", "is wrong")
    if cls.__name__ == "QuotaExceeded":
        return cls("engines", 8, "live engines serving the tenant's namespaces")
    if cls.__name__ == "VerificationRefused":
        return cls("the reason", [])
    return cls("the reason")


def test_every_error_class_declares_what_the_readme_documents() -> None:
    declared = {c.__name__: (c.http_status, c.code, c.exit_code) for c in _subclasses(ControlPlaneError) if c is not Refused}
    assert declared == EXPECTED


class _Raises(ControlPlaneCommand):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def handle(self, *args: object, **options: object) -> None:
        raise self.error


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_api_and_cli_read_the_class(name: str) -> None:
    cls = next(c for c in _subclasses(ControlPlaneError) if c.__name__ == name)
    error = _instance(cls)
    response = api_exception_handler(error, {"view": None})
    status, code, exit_code = EXPECTED[name]
    assert response is not None and response.status_code == status
    expected_error = {"status": status, "code": code, "message": str(error)}
    if name in ("InvalidField", "AddressRefused"):
        expected_error["fields"] = {"field": ["is wrong"]}
    elif name in ("CheckpointOutsideRoots", "AdapterOutsideRoots"):
        # The operator's message names the server's paths; a remote caller is told less.
        field, problem = cls.field, cls.public_problem
        expected_error.update(message=f"{field}: {problem}", fields={field: [problem]})
    assert response.data == {"error": expected_error}
    with pytest.raises(CommandError) as raised:
        _Raises(error).execute(no_color=True, force_color=False, skip_checks=True, stdout=None, stderr=None)
    assert (raised.value.returncode, str(raised.value)) == (exit_code, str(error))


def test_cli_message_is_one_printable_line() -> None:
    with pytest.raises(CommandError) as raised:
        _Raises(Refused("first\nsecond\x1b[31m")).execute(no_color=True, force_color=False, skip_checks=True)
    assert (raised.value.returncode, str(raised.value)) == (4, "first second\\x1b[31m")
