"""Loaded with ``-p tests.env`` before Django starts: give the test run its own
``var/`` so tests never touch the demo's database, KV tiers or checkpoints.

Set here rather than in conftest because pytest-django imports the settings
before any conftest runs; subprocesses (workers, commands) inherit it.
"""

import atexit
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
