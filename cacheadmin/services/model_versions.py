"""Fingerprinting and registering model versions."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from cacheadmin.models import Adapter, ModelVersion
from cacheadmin.models.naming import NOT_DIFFERENT, name_key, validate_display_name
from cacheadmin.services.audit import audit_record
from cacheadmin.services.serving import version_status_wanted, version_traffic
from inference.digest_cache import FileDigestCache
from inference.errors import EXIT_CONFLICT, CheckpointError, Refused
from inference.identity import IdentityReport, LayoutOptions, fingerprint_checkpoint, verify_digest_cache
from inference.paths import resolve_adapter_dir, resolve_checkpoint_dir


class RegistrationConflict(Refused):
    """A label is already registered with a different identity (409, exit 3: a conflict with what exists)."""

    code = "registration_conflict"
    exit_code = EXIT_CONFLICT


def checkpoint_fingerprint(
    *,
    path: str | Path,
    layout: LayoutOptions,
    adapters: dict[str, str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> tuple[Path, IdentityReport]:
    """Confine ``path`` to ``MODEL_ROOTS`` and compute its state identity.

    Returns:
        (resolved checkpoint directory, identity report).

    Raises:
        CheckpointError: bad path, outside the roots, malformed checkpoint, an adapter name
            that is not a display name or looks like another adapter's.
    """
    root = resolve_checkpoint_dir(path, settings.MODEL_ROOTS)
    adapter_dirs: dict[str, Path] = {}
    seen: dict[str, str] = {}
    for name in adapters or {}:
        # Adapter names are what clients send as the model: held to the rules of every other name.
        try:
            validate_display_name(name)
        except ValidationError as exc:
            raise CheckpointError(f"adapter name {name!r}: {exc.messages[0]}") from exc
        clash = seen.setdefault(name_key(name), name)
        if clash != name:
            raise CheckpointError(f"adapter names {clash!r} and {name!r} look alike ({NOT_DIFFERENT})")
    for name, adapter_path in (adapters or {}).items():
        adapter_dirs[name] = adapter_dir_resolve(adapter_path)
    cache = FileDigestCache(settings.DIGEST_CACHE_PATH)
    return root, fingerprint_checkpoint(root, layout=layout, adapters=adapter_dirs, cache=cache, on_bytes=on_bytes)


def checkpoint_verify_cache(*, path: str | Path) -> list[dict[str, str]]:
    """Re-hash a checkpoint's weight files and report (and correct) digest-cache mismatches.

    Raises:
        CheckpointError: bad path or outside the roots.
    """
    root = resolve_checkpoint_dir(path, settings.MODEL_ROOTS)
    return verify_digest_cache(root, FileDigestCache(settings.DIGEST_CACHE_PATH))


def adapter_dir_resolve(path: str | Path) -> Path:
    """An adapter directory confined to ``MODEL_ROOTS`` like a checkpoint
    (:func:`inference.paths.resolve_adapter_dir`).

    Raises:
        AdapterOutsideRoots: not a directory, outside the model roots, or a
            link inside it leading out, or a hard link.
    """
    return resolve_adapter_dir(path, settings.MODEL_ROOTS)


def model_version_register(
    *,
    path: str | Path,
    label: str,
    served_name: str,
    layout: LayoutOptions,
    actor: str,
    adapters: dict[str, str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> tuple[ModelVersion, bool]:
    """Register a checkpoint, with its LoRA adapters, as a model version (idempotent per label).

    Re-registering a label whose checkpoint is unchanged returns the existing
    row (the digest cache makes that cheap whatever the checkpoint's size).
    Each adapter (name → directory inside the model roots) becomes an
    :class:`Adapter` row identified by content, and is part of the identity.

    Returns:
        (model version, created).

    Raises:
        CheckpointError: the checkpoint cannot be fingerprinted; nothing is written.
        RegistrationConflict: ``label`` exists with a different identity.
    """
    for what, value in (("label", label), ("served name", served_name)):
        try:
            validate_display_name(value)
        except ValidationError as exc:
            raise CheckpointError(f"{what} {value!r} {exc.messages[0]}") from exc
    root, report = checkpoint_fingerprint(path=path, layout=layout, adapters=adapters, on_bytes=on_bytes)
    existing = ModelVersion.objects.filter(label_key=name_key(label)).first()
    if existing is not None:
        return _same_or_conflict(existing, report.identity), False
    try:
        with transaction.atomic():
            version = ModelVersion.objects.create(
                label=label,
                served_name=served_name,
                path=str(root),
                inputs=report.inputs,
                total_bytes=report.total_bytes,
                fingerprint_seconds=report.seconds,
                **{k: v for k, v in report.digests().items()},
            )
            Adapter.objects.bulk_create(
                Adapter(
                    model_version=version,
                    name=name,
                    content=info["content"],
                    path=str(adapter_dir_resolve(adapters[name])),
                    files=info["files"],
                )
                for name, info in sorted(report.inputs.get("adapters", {}).items())
            )
            audit_record(actor=actor, action="model_version.register", obj=version, after=report.digests())
    except IntegrityError:
        # A concurrent registration of the same label won the race.
        return _same_or_conflict(ModelVersion.objects.get(label_key=name_key(label)), report.identity), False
    return version, True


def _same_or_conflict(existing: ModelVersion, identity: str) -> ModelVersion:
    if existing.identity != identity:
        raise RegistrationConflict(
            f"label {existing.label!r} is registered with identity {existing.identity[:16]}…, "
            f"this checkpoint has {identity[:16]}…; register it under a new label"
        )
    return existing


#: Allowed lifecycle moves: registered → active → draining → retired, and a
#: draining version may be re-activated (rollback before it is retired).
LIFECYCLE: dict[str, set[str]] = {
    ModelVersion.Status.REGISTERED: {ModelVersion.Status.ACTIVE, ModelVersion.Status.RETIRED},
    ModelVersion.Status.ACTIVE: {ModelVersion.Status.DRAINING},
    ModelVersion.Status.DRAINING: {ModelVersion.Status.ACTIVE, ModelVersion.Status.RETIRED},
    ModelVersion.Status.RETIRED: set(),
}


class LifecycleError(Refused):
    """A lifecycle move that is not allowed from the version's current status (409, exit 4)."""

    code = "lifecycle_conflict"


def model_version_transition(*, version: ModelVersion, to: str, actor: str, reason: str = "") -> ModelVersion:
    """Move a model version along its lifecycle, atomically and audited.

    The UPDATE is conditional on the status read, so two concurrent moves
    cannot both apply.

    Raises:
        LifecycleError: ``to`` is not reachable from the current status, the
            status changed underneath, or ``to`` is draining or retired while a
            release routes traffic to the version.
    """
    current = version.status
    if to not in LIFECYCLE.get(current, set()):
        raise LifecycleError(f"{version.label} is {current}; it cannot become {to}")
    if to in (ModelVersion.Status.DRAINING, ModelVersion.Status.RETIRED):
        routes = version_traffic(version)
        if routes:
            where = ", ".join(f"{r.percent}% of release #{r.release_id}" for r in routes)
            raise LifecycleError(f"{version.label} still serves traffic ({where}); it cannot become {to}")
    with transaction.atomic():
        moved = ModelVersion.objects.filter(pk=version.pk, status=current).update(status=to)
        if not moved:
            raise LifecycleError(f"{version.label} changed status concurrently; reload and retry")
        audit_record(
            actor=actor,
            action="model_version.transition",
            obj=version,
            before={"status": current},
            after={"status": to},
            reason=reason,
        )
    version.refresh_from_db()
    return version


def model_versions_status_sync(*, versions: list[ModelVersion], actor: str, reason: str) -> dict[str, str]:
    """Bring each version's status to what routing gives it
    (:func:`cacheadmin.services.serving.version_status_wanted`), audited.

    Called after every change of what serves (traffic, rollback, a release
    becoming ready), so status and routing never disagree.

    Returns:
        label → new status, for the versions that moved.
    """
    moved = {}
    for version in versions:
        version.refresh_from_db()
        wanted = version_status_wanted(version)
        if wanted != version.status:
            moved[version.label] = model_version_transition(version=version, to=wanted, actor=actor, reason=reason).status
    return moved
