"""Secrets and the private folder: a missing, empty or weak secret refuses the
start, creation is atomic across processes and faults, ``var/`` is owner-only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from inference.child_env import die_with_parent
from tests.helpers import PROJECT

PRINT_SECRETS = (
    "import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'cacheadmin.settings'); django.setup(); "
    "from django.conf import settings; print(settings.CACHE_SALT_SECRET, settings.SECRET_KEY)"
)


def start(var_dir: Path, **env: str) -> subprocess.Popen[str]:
    """A process that loads the settings the way every entry point does."""
    clean = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SECRET_KEY", "CACHE_SALT_SECRET")}
    return subprocess.Popen(
        [sys.executable, "-c", PRINT_SECRETS],
        cwd=PROJECT,
        env={**clean, "VAR_DIR": str(var_dir), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=die_with_parent,
        text=True,
    )


def run(var_dir: Path, **env: str) -> tuple[int, str, str]:
    proc = start(var_dir, **env)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out.strip(), err.strip().splitlines()[-1] if err.strip() else ""


@pytest.mark.slow
def test_processes_starting_together_agree_on_one_secret(tmp_path: Path) -> None:
    var = tmp_path / "var"
    procs = [start(var) for _ in range(6)]
    outputs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0] * 6
    assert len(outputs) == 1
    salt_key, secret_key = outputs.pop().split()
    assert (len(salt_key), len(secret_key)) == (64, 64) and salt_key != secret_key
    assert (var / "cache-salt-secret").read_text() == salt_key
    assert sorted(p.name for p in var.iterdir() if p.name.startswith(".")) == []  # no temporary files left
    assert (var / "cache-salt-secret").stat().st_mode & 0o777 == 0o600
    assert var.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("content", ["", "\n", "abc123", "x" * 31])
def test_an_empty_or_short_secret_file_refuses_the_start(tmp_path: Path, content: str) -> None:
    var = tmp_path / "var"
    var.mkdir()
    (var / "cache-salt-secret").write_text(content)
    code, out, err = run(var)
    assert code != 0 and out == ""
    assert f"holds {len(content.strip())} characters, fewer than 32: refusing a weak secret" in err
    assert (var / "cache-salt-secret").read_text() == content  # nothing overwritten: salts handed out stay valid


def test_a_weak_secret_from_the_environment_refuses_the_start(tmp_path: Path) -> None:
    code, _, err = run(tmp_path / "var", DJANGO_SECRET_KEY="changeme")
    assert code != 0 and "DJANGO_SECRET_KEY is shorter than 32 characters" in err
    code, out, _ = run(tmp_path / "var", DJANGO_SECRET_KEY="k" * 40, CACHE_SALT_SECRET="s" * 40)
    assert (code, out) == (0, f"{'s' * 40} {'k' * 40}")


def test_an_existing_world_readable_var_is_made_owner_only(tmp_path: Path) -> None:
    var = tmp_path / "var"
    var.mkdir(mode=0o755)
    var.chmod(0o755)
    assert run(var)[0] == 0
    assert var.stat().st_mode & 0o777 == 0o700


def test_a_full_disk_at_first_start_leaves_no_empty_secret(small_tmpfs) -> None:
    var = small_tmpfs("64k")
    filler = var / "filler"
    with filler.open("wb", buffering=0) as fh:  # fill the file system to the last block
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass
    code, out, err = run(var)
    assert code != 0 and out == ""
    assert "cannot create the secret" in err and "No space left on device" in err
    assert sorted(p.name for p in var.iterdir()) == ["filler"]  # no empty secret, no temporary file
    filler.unlink()
    code, out, _ = run(var)
    assert code == 0 and len(out.split()[0]) == 64
