"""Registration jobs: fingerprint and register a checkpoint in a worker."""

from __future__ import annotations

from dataclasses import asdict

from django.conf import settings
from django.db import transaction

from cacheadmin.models import JobStatus, RegistrationJob
from cacheadmin.services.audit import audit_record
from cacheadmin.services.jobs import JobCancelled, JobRunner, job_claim, job_finish, job_log, job_progress
from cacheadmin.services.model_versions import RegistrationConflict, adapter_dir_resolve, model_version_register
from inference.errors import CheckpointError
from inference.identity import LayoutOptions, identity_precheck, weight_files
from inference.paths import resolve_checkpoint_dir


def registration_job_create(
    *, path: str, label: str, served_name: str, layout: LayoutOptions, actor: str, adapters: dict[str, str] | None = None
) -> RegistrationJob:
    """Check the paths now (bad input is refused before anything is written),
    record the job, and enqueue it once committed.

    Args:
        adapters: LoRA adapter name → directory inside the model roots.

    Raises:
        CheckpointError: missing, outside the model roots, no config.json, a
            config, tokenizer or layout the engine would refuse, an adapter
            directory that is missing or outside the roots.
    """
    root = resolve_checkpoint_dir(path, settings.MODEL_ROOTS)
    adapter_dirs = {name: str(adapter_dir_resolve(p)) for name, p in (adapters or {}).items()}
    # Config, tokenizer and layout take seconds; refuse what they refuse now,
    # not after the job has queued behind hours of weight hashing.
    identity_precheck(root, layout=layout)
    total = sum(p.stat().st_size for p in weight_files(root))
    with transaction.atomic():
        job = RegistrationJob.objects.create(
            path=str(root),
            label=label,
            served_name=served_name,
            layout_options=asdict(layout),
            adapters=adapter_dirs,
            progress_total=total,
            created_by=actor,
        )
        audit_record(actor=actor, action="registration_job.create", obj=job, after={"path": str(root), "label": label})
        RegistrationRunner.enqueue(job.pk)
    return job


def registration_job_run(*, job_id: int) -> None:
    """Hash and register; progress in weight bytes. A retry re-hashes only
    what the digest cache does not already hold."""
    job = job_claim(RegistrationJob, job_id)
    if job is None:
        return
    job_log(job, f"attempt {job.attempts}: fingerprinting {job.path}")
    done = 0

    def on_bytes(count: int) -> None:
        nonlocal done
        done += count
        job_progress(job, done)

    try:
        version, created = model_version_register(
            path=job.path,
            label=job.label,
            served_name=job.served_name,
            layout=LayoutOptions(**job.layout_options),
            actor=job.created_by,
            adapters=job.adapters,
            on_bytes=on_bytes,
        )
    except (CheckpointError, RegistrationConflict) as exc:
        job_finish(job, JobStatus.FAILED, error=str(exc), line=f"refused: {exc}")
        return
    except JobCancelled:
        job_log(job, "cancelled; stopped")
        return
    word = "registered" if created else "already registered as"
    job_finish(job, JobStatus.SUCCEEDED, line=f"{word} {version.label} ({version.identity[:12]}…)", model_version=version)


class RegistrationRunner(JobRunner):
    """Registration jobs (:func:`registration_job_run`)."""

    model = RegistrationJob
    task_name = "cacheadmin.registration_job"

    @classmethod
    def run(cls, job_id: int) -> None:
        """Hash and register for registration job ``job_id``."""
        registration_job_run(job_id=job_id)
