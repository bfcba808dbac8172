"""The addresses the control plane contacts engines at: the deployment's
address policy (``ENGINE_ALLOWED_NETWORKS``) applied to every URL and
endpoint before anything is sent (see :mod:`inference.netpolicy`), and the
API key of every engine it starts."""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from inference.netpolicy import AddressPolicy, pinned_url

if TYPE_CHECKING:
    from cacheadmin.models import Engine


def engine_address_policy() -> AddressPolicy:
    """The networks engines may be contacted on (``ENGINE_ALLOWED_NETWORKS``, see :mod:`inference.netpolicy`).

    Raises:
        django.core.exceptions.ImproperlyConfigured: the setting names a network
            that is never contacted (link-local, metadata, unspecified).
    """
    try:
        return AddressPolicy.parse(settings.ENGINE_ALLOWED_NETWORKS)
    except ValueError as exc:
        raise ImproperlyConfigured(f"ENGINE_ALLOWED_NETWORKS: {exc}") from exc


def engine_target(field: str, url: str) -> tuple[str, dict[str, str]]:
    """``url`` checked against :func:`engine_address_policy` and pinned to a
    checked address: ``(url to connect to, headers)`` (see :func:`inference.netpolicy.pinned_url`).

    Raises:
        AddressRefused: the host does not resolve, or resolves to an address the policy refuses.
    """
    origin = engine_address_policy().check_url(field, url)
    return pinned_url(url, origin.addresses)


def engine_api_key(engine: Engine) -> str | None:
    """The API key of the current incarnation of an engine this control plane started, here or on a
    Ray node (None for an adopted one: its keys are its operator's). Derived, never stored: an HMAC of the
    engine's id and generation under the server secret, so every control-plane
    process (web, workers, gateways) computes it and a restart changes it.
    vLLM requires it on every route (:mod:`inference.engines.serve`), so no
    other local user can drive the engine."""
    return engine_api_key_of(engine.pk, engine.origin, engine.generation)


def engine_api_key_of(pk: int, origin: str, generation: int) -> str | None:
    """:func:`engine_api_key` from the engine's id, ``origin`` and ``generation`` (plain values)."""
    if origin not in ("local", "ray"):
        return None
    message = f"engine-api-key:{pk}:{generation}".encode()
    return hmac.new(settings.CACHE_SALT_SECRET.encode(), message, hashlib.sha256).hexdigest()


def engine_headers(engine: Engine) -> dict[str, str]:
    """What every request to ``engine`` carries: its API key, when it has one."""
    return engine_headers_of(engine.pk, engine.origin, engine.generation)


def engine_headers_of(pk: int, origin: str, generation: int) -> dict[str, str]:
    """:func:`engine_headers` from the engine's id, ``origin`` and ``generation`` (plain values)."""
    key = engine_api_key_of(pk, origin, generation)
    return {"Authorization": f"Bearer {key}"} if key else {}
