"""Loaded with ``-p tests.env`` before Django starts: give the test run its own
``var/`` so tests never touch the demo's database, KV tiers or checkpoints.

Set here rather than in conftest because pytest-django imports the settings
before any conftest runs; subprocesses (workers, commands) inherit it.
"""

import os
import tempfile

if "VAR_DIR" not in os.environ:
    os.environ["VAR_DIR"] = tempfile.mkdtemp(prefix="kvcp-test-")
os.environ.setdefault("MODEL_ROOTS", os.path.join(os.environ["VAR_DIR"], "models"))
os.environ.setdefault("DEMO_MODELS_DIR", os.path.join(os.environ["VAR_DIR"], "models"))
os.makedirs(os.environ["MODEL_ROOTS"].split(":")[0], exist_ok=True)
