"""No exception leaves a job ``running``: an unexpected one fails it at once
with the real reason; a busy database puts it back in the queue with the reason."""

from __future__ import annotations

import pytest
from django.db import OperationalError

from cacheadmin import tasks
from cacheadmin.models import JobStatus, RegistrationJob
from cacheadmin.services import registration
from cacheadmin.services.jobs import job_finish, job_finished
from inference.identity import LayoutOptions

pytestmark = pytest.mark.django_db


def _job(demo_checkpoints) -> RegistrationJob:
    # Recorded directly: the test is about running it, and create() would enqueue it.
    return RegistrationJob.objects.create(
        path=str(demo_checkpoints["tiny-v1"]), label="v1", served_name="tiny", layout_options={}, created_by="alice",
        progress_total=1,
    )  # fmt: skip


def test_an_unexpected_exception_fails_the_job_at_once_with_the_reason(demo_checkpoints, monkeypatch) -> None:
    def broken(**kwargs: object) -> None:
        raise UnicodeEncodeError("utf-8", "\udc80", 0, 1, "surrogates not allowed")

    monkeypatch.setattr(registration, "model_version_register", broken)
    job = _job(demo_checkpoints)
    tasks.registration_job_task(job.pk)
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    assert job.error == "UnicodeEncodeError: 'utf-8' codec can't encode character '\\udc80' in position 0: surrogates not allowed"
    assert job.finished_at is not None and "failed: UnicodeEncodeError" in job.log


def test_a_busy_database_requeues_the_job_with_the_reason(
    demo_checkpoints, monkeypatch, django_capture_on_commit_callbacks
) -> None:
    sent: list[tuple[int, int]] = []

    def locked(**kwargs: object) -> None:
        raise OperationalError("database is locked")

    monkeypatch.setattr(registration, "model_version_register", locked)
    monkeypatch.setattr(tasks.registration_job_task, "apply_async", lambda args, countdown=0: sent.append((args[0], countdown)))
    job = _job(demo_checkpoints)
    # The job is queued again once the row is committed (at once in a worker's autocommit).
    with django_capture_on_commit_callbacks(execute=True):
        tasks.registration_job_task(job.pk)
    job.refresh_from_db()
    assert (job.status, job.error, job.attempts) == (JobStatus.QUEUED, "OperationalError: database is locked", 1)
    assert sent == [(job.pk, 5)]
    # Out of attempts, the same fault fails it with the reason.
    RegistrationJob.objects.filter(pk=job.pk).update(attempts=2)
    tasks.registration_job_task(job.pk)
    job.refresh_from_db()
    assert (job.status, job.error, job.attempts) == (JobStatus.FAILED, "OperationalError: database is locked", 3)


def test_a_config_with_nan_fails_registration_with_the_reason(checkpoint_copy) -> None:
    path = checkpoint_copy()
    config = (path / "config.json").read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN')
    (path / "config.json").write_text(config)
    job = RegistrationJob.objects.create(
        path=str(path), label="nan", served_name="tiny", layout_options=LayoutOptions().__dict__, created_by="a", progress_total=1
    )
    tasks.registration_job_task(job.pk)
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    assert job.error.endswith("config.json is not valid JSON: NaN is not a JSON value")


def test_a_job_reaching_a_final_status_is_announced_once(demo_checkpoints) -> None:
    heard: list[tuple[type, int, str]] = []

    def receiver(sender: type, job: RegistrationJob, **_kwargs: object) -> None:
        heard.append((sender, job.pk, job.status))

    job_finished.connect(receiver, weak=False)
    try:
        job = _job(demo_checkpoints)
        RegistrationJob.objects.filter(pk=job.pk).update(status=JobStatus.RUNNING)
        job_finish(job, JobStatus.FAILED, error="no")
        job_finish(job, JobStatus.SUCCEEDED)  # not running any more: nothing moves, nothing is sent
    finally:
        job_finished.disconnect(receiver)
    assert heard == [(RegistrationJob, job.pk, JobStatus.FAILED)]
