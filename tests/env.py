"""Loaded with ``-p tests.env`` before Django starts: give the test run its own
``var/`` so tests never touch the demo's database, KV tiers or checkpoints.

Set here rather than in conftest because pytest-django imports the settings
before any conftest runs; subprocesses (workers, commands) inherit it.
"""

import atexit
import getpass
import os
import shutil
import tempfile

if "VAR_DIR" not in os.environ:
    os.environ["VAR_DIR"] = tempfile.mkdtemp(prefix="kvcp-test-")
    # Created here, so removed here when the run ends (subprocesses inherit
    # VAR_DIR and never take this branch); a given VAR_DIR is left alone.
    atexit.register(shutil.rmtree, os.environ["VAR_DIR"], True)
os.environ.setdefault("MODEL_ROOTS", os.path.join(os.environ["VAR_DIR"], "models"))
os.environ.setdefault("DEMO_MODELS_DIR", os.path.join(os.environ["VAR_DIR"], "models"))
os.makedirs(os.environ["MODEL_ROOTS"].split(":")[0], exist_ok=True)

# Temporary files of this process and of every process it starts (pytest's
# tmp_path folders, vLLM's IPC sockets and dist files, tarfile spools) go under
# VAR_DIR, so the run leaves nothing behind in /tmp. TorchInductor's compile
# cache is a cache, not a temporary file: it stays where later runs (and the
# demo) reuse it, instead of following TMPDIR into VAR_DIR.
_default_tmp = tempfile.gettempdir()
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_default_tmp, f"torchinductor_{getpass.getuser()}"))
os.environ["TMPDIR"] = os.path.join(os.environ["VAR_DIR"], "tmp")
os.makedirs(os.environ["TMPDIR"], exist_ok=True)
tempfile.tempdir = None  # computed again from TMPDIR on next use
