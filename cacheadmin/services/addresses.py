"""The addresses the control plane contacts engines at: the deployment's
address policy (``ENGINE_ALLOWED_NETWORKS``) applied to every URL and
endpoint before anything is sent (see :mod:`inference.netpolicy`)."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from inference.netpolicy import AddressPolicy, pinned_url


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
