"""GPU engine specs: every identity layout field is a flag, each connector's
config names the namespace's own storage, the LMCache YAML parses back, the
shell script starts exactly the argv, and vLLM 0.32's own ``vllm serve``
parser accepts the argv. No engine is started."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from inference.engines.gpu_spec import (
    CONNECTORS,
    LAYOUT_FIELDS,
    LMCACHE_CONFIG_NAME,
    VLLM_CONNECTOR_NAMES,
    GpuEngineSpec,
    gpu_engine_spec,
    lmcache_chunk_size,
)
from inference.layout import LayoutOptions, engine_version, resolve_layout

SALT = "a" * 64  # the shape of inference.identity.cache_salt: 64 hex characters
NAMESPACE = "ns-0123456789abcdef0123456789abcdef"
ROOT = "/srv/kv"
OVERRIDES = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}


def full_layout(kv_connector: str | None) -> dict[str, Any]:
    """A layout with every field set away from its default, as the identity records it."""
    options = LayoutOptions(
        dtype="bfloat16",
        kv_cache_dtype="fp8",
        block_size=64,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        quantization="fp8",
        kv_connector=kv_connector,
        kv_cache_layout="HND",
        attention_backend="FLASH_ATTN",
        hf_overrides=OVERRIDES,
        max_model_len=8192,
        model_impl="vllm",
        disable_sliding_window=True,
    )
    # A LongRoPE model with a sliding window: the two fields that count only for such models count.
    return resolve_layout(options, dtype="bfloat16", quantization=None, longrope_default_len=4096, has_sliding_window=True)


def default_layout(kv_connector: str | None = None) -> dict[str, Any]:
    """The layout of a plain bfloat16 model registered with default options."""
    return resolve_layout(
        LayoutOptions(kv_connector=kv_connector),
        dtype="bfloat16",
        quantization=None,
        longrope_default_len=None,
        has_sliding_window=False,
    )


def spec_for(connector: str, layout: dict[str, Any], **kwargs: Any) -> GpuEngineSpec:
    args: dict[str, Any] = {
        "layout": layout,
        "served_name": "tiny",
        "model_ref": "/models/tiny-v1",
        "storage_prefix": NAMESPACE,
        "cache_salt": SALT,
        "storage_root": ROOT,
        "connector": connector,
    }
    return gpu_engine_spec(**{**args, **kwargs})


def flag(argv: list[str], name: str) -> str:
    """The value after ``name``; the flag must occur exactly once."""
    assert argv.count(name) == 1, name
    return argv[argv.index(name) + 1]


HEAD = ["vllm", "serve", "/models/tiny-v1", "--served-model-name", "tiny", "--host", "0.0.0.0", "--port", "8000"]
EVENTS = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": f"ipc:///run/kvcp-kv-events/{NAMESPACE}.pub",
    "replay_endpoint": f"ipc:///run/kvcp-kv-events/{NAMESPACE}.replay",
    "topic": NAMESPACE,
}
BASE_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "75"}


def test_every_layout_field_becomes_a_flag() -> None:
    layout = full_layout("OffloadingConnector")
    assert set(layout) == LAYOUT_FIELDS  # a new identity field must get a flag here first
    spec = spec_for("offloading", layout)
    assert spec.argv == [
        *HEAD,
        "--dtype", "bfloat16",
        "--kv-cache-dtype", "fp8_e4m3",
        "--block-size", "64",
        "--tensor-parallel-size", "2",
        "--pipeline-parallel-size", "2",
        "--model-impl", "vllm",
        "--max-model-len", "8192",
        "--quantization", "fp8",
        "--attention-backend", "FLASH_ATTN",
        "--hf-overrides", json.dumps(OVERRIDES, sort_keys=True),
        "--disable-sliding-window",
        "--tokenizer-mode", "auto",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-events-config", flag(spec.argv, "--kv-events-config"),
        "--kv-transfer-config", flag(spec.argv, "--kv-transfer-config"),
    ]  # fmt: skip
    assert json.loads(flag(spec.argv, "--hf-overrides")) == layout["hf_overrides"]
    assert json.loads(flag(spec.argv, "--kv-events-config")) == EVENTS
    assert json.loads(flag(spec.argv, "--kv-transfer-config")) == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 8 << 30,
            "self_describing_kv_events": True,
            "secondary_tiers": [{"type": "fs", "root_dir": f"{ROOT}/{NAMESPACE}", "enable_kv_events": True}],
        },
    }
    assert spec.env == {**BASE_ENV, "VLLM_KV_CACHE_LAYOUT": "LBHNC"}
    assert spec.files == {}
    assert spec.storage_path == f"{ROOT}/{NAMESPACE}"
    # Nothing of the CPU build: it would change memory sizing or graphs on a GPU.
    assert "--enforce-eager" not in spec.argv and "VLLM_CPU_KVCACHE_SPACE" not in spec.env


def test_default_layout_is_exact_and_the_example_connector_uses_the_namespace_path() -> None:
    spec = spec_for("example", default_layout(), kv_events_replay_endpoint=None, port=8123, tokenizer_mode="mistral")
    transfer = flag(spec.argv, "--kv-transfer-config")
    events = flag(spec.argv, "--kv-events-config")
    assert spec.argv == [
        *HEAD[:-1], "8123",
        "--dtype", "bfloat16",
        "--kv-cache-dtype", "auto",  # the model's dtype, as the identity resolved it
        "--block-size", "32",
        "--tensor-parallel-size", "1",
        "--pipeline-parallel-size", "1",
        "--model-impl", "auto",
        "--tokenizer-mode", "mistral",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-events-config", events,
        "--kv-transfer-config", transfer,
    ]  # fmt: skip
    assert json.loads(events) == {k: v for k, v in EVENTS.items() if k != "replay_endpoint"}
    assert json.loads(transfer) == {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": f"{ROOT}/{NAMESPACE}"},
    }
    assert spec.env == BASE_ENV
    assert spec.files == {}


def test_lmcache_gets_its_yaml_under_the_namespace_prefix() -> None:
    spec = spec_for("lmcache", default_layout("LMCacheConnectorV1"), storage_root="/srv/kv/", cpu_cache_gib=4, disk_cache_gib=100)
    assert json.loads(flag(spec.argv, "--kv-transfer-config")) == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    assert spec.env == {**BASE_ENV, "LMCACHE_CONFIG_FILE": LMCACHE_CONFIG_NAME}
    assert list(spec.files) == [LMCACHE_CONFIG_NAME]
    text = spec.files[LMCACHE_CONFIG_NAME]
    assert yaml.safe_load(text) == {
        "chunk_size": 256,
        "local_cpu": True,
        "max_local_cpu_size": 4.0,
        "local_disk": f"file://{ROOT}/{NAMESPACE}/",
        "max_local_disk_size": 100.0,
    }
    # The remote tier is documented, not configured.
    assert '# remote_url: "redis://REDIS_HOST:6379"' in text.splitlines()
    assert '# remote_serde: "naive"' in text.splitlines()
    # A chunk is always whole vLLM blocks.
    assert [lmcache_chunk_size(b) for b in (16, 32, 48, 64, 512)] == [256, 256, 288, 256, 512]
    odd = spec_for("lmcache", {**default_layout("LMCacheConnectorV1"), "block_size": 48})
    assert yaml.safe_load(odd.files[LMCACHE_CONFIG_NAME])["chunk_size"] == 288


@pytest.mark.parametrize("connector", CONNECTORS)
def test_notes_state_salt_and_reset_behaviour_with_sources(connector: str) -> None:
    spec = spec_for(connector, default_layout())
    text = "\n".join(spec.notes)
    assert "cache_salt" in text and "reset" in text
    own = {"example": "example_connector.py", "offloading": "offloading_connector.py", "lmcache": "lmcache_connector.py"}
    assert own[connector] in text
    if engine_version().startswith("vllm-cpu"):
        assert f"computed for {engine_version()}" in spec.notes[0]  # a CPU identity is not the GPU engine's
    ran = {"example": "Run here", "offloading": "Generated here, not run", "lmcache": "Generated only"}
    assert ran[connector] in text


def test_unknown_connector_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"^connector 'redis' is not one of example, offloading, lmcache$"):
        spec_for("redis", default_layout())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"connector": "lmcache", "layout": "example-layout"}, "records kv_connector ExampleConnector, not LMCacheConnectorV1"),
        ({"layout": "unknown-field"}, "rope_scaling have no engine flag"),
        ({"layout": "no-dtype"}, "layout lacks dtype"),
        ({"layout": "cpu-backend"}, "CPU_ATTN is a CPU backend"),
        ({"storage_prefix": "../other"}, "not one path segment"),
        ({"storage_prefix": ".deleting-ns"}, "not one path segment"),
        ({"storage_root": "kv"}, "not an absolute path"),
        ({"cache_salt": "a/b"}, "cache_salt must be at most 128"),
        ({"cache_salt": "x" * 129}, "cache_salt must be at most 128"),
        ({"port": 0}, "port must be an integer"),
        ({"tokenizer_mode": "sentencepiece"}, "tokenizer_mode 'sentencepiece' is not one of"),
        ({"served_name": " "}, "served_name is empty"),
    ],
)
def test_bad_input_is_refused(change: dict[str, Any], message: str) -> None:
    layouts = {
        "example-layout": default_layout("ExampleConnector"),
        "unknown-field": {**default_layout(), "rope_scaling": None},
        "no-dtype": {k: v for k, v in default_layout().items() if k != "dtype"},
        "cpu-backend": {**default_layout(), "attention_backend": "CPU_ATTN"},
    }
    kwargs = dict(change)
    layout = layouts.get(kwargs.pop("layout", ""), default_layout())
    with pytest.raises(ValueError, match=message):
        spec_for(kwargs.pop("connector", "example"), layout, **kwargs)


@pytest.mark.parametrize("connector", CONNECTORS)
def test_to_json_is_stable_and_to_shell_round_trips(connector: str) -> None:
    layout = full_layout(None)
    spec = spec_for(connector, layout, model_ref="/models/it's here")  # a quote the shell must survive
    data = spec.to_json()
    assert list(data) == [
        "connector", "storage_prefix", "storage_path", "cache_salt", "argv", "relay", "env", "files", "notes",
    ]  # fmt: skip
    assert list(data["env"]) == sorted(spec.env)
    assert json.dumps(data) == json.dumps(spec_for(connector, layout, model_ref="/models/it's here").to_json())
    script = spec.to_shell()
    last = script.splitlines()[-1]
    assert shlex.split(last) == ["exec", "env", *(f"{k}={spec.env[k]}" for k in sorted(spec.env)), *spec.argv]


@pytest.mark.parametrize("connector", CONNECTORS)
def test_shell_script_starts_exactly_the_spec(connector: str, tmp_path: Path) -> None:
    """Run the script with a stand-in ``vllm`` on PATH that records what it was given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "vllm"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "out = {'argv': sys.argv[1:], 'env': dict(os.environ), 'cwd_files': {n: open(n).read() for n in os.listdir('.')}}\n"
        "json.dump(out, open(os.environ['KVCP_RECORD'], 'w'))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    root = tmp_path / "kv root"  # a space the script must quote
    sockets = tmp_path / "kv events"
    spec = spec_for(connector, full_layout(None), storage_root=str(root), kv_events_dir=str(sockets))
    record = tmp_path / "record.json"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(tmp_path), "KVCP_RECORD": str(record)}
    subprocess.run(["sh", "-c", spec.to_shell()], env=env, check=True, timeout=30)
    seen = json.loads(record.read_text())
    assert seen["argv"] == spec.argv[1:]
    assert {k: seen["env"].get(k) for k in spec.env} == spec.env
    assert seen["cwd_files"] == spec.files
    assert (root / NAMESPACE).is_dir()
    assert stat.S_IMODE(sockets.stat().st_mode) == 0o700  # only the engine's user reaches its KV-event sockets


def test_with_a_consumer_key_a_curve_relay_carries_the_events_off_the_host() -> None:
    consumer = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
    spec = spec_for("offloading", full_layout(None), consumer_key=consumer)
    assert spec.relay == [
        "python", "-m", "inference.kv_transport", "relay",
        "--engine-events", f"ipc:///run/kvcp-kv-events/{NAMESPACE}.pub",
        "--engine-replay", f"ipc:///run/kvcp-kv-events/{NAMESPACE}.replay",
        "--publish", "tcp://0.0.0.0:5557", "--replay", "tcp://0.0.0.0:5558",
        "--key-file", "/var/lib/kvcp/kv-relay.key", "--allow", consumer,
    ]  # fmt: skip
    lines = spec.to_shell().splitlines()
    assert shlex.split(lines[-2]) == [*spec.relay, "&"] and lines[-1].startswith("exec env ")
    assert any("kv_events_key: the relay's public key" in note for note in spec.notes)
    # Without one, events stay on the host and the notes say so.
    alone = spec_for("offloading", full_layout(None))
    assert alone.relay == [] and "KV events stay on this host" in alone.notes[-1]


@pytest.mark.parametrize("connector", CONNECTORS)
def test_vllm_serve_parser_accepts_the_argv(connector: str) -> None:
    """vLLM 0.32's own ``vllm serve`` parser turns the argv into the configs we meant."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    spec = spec_for(connector, full_layout(None))
    parser = FlexibleArgumentParser()
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(spec.argv[1:])
    command.validate(args)
    args.model = args.model_tag  # what ServeSubcommand.cmd does
    engine = AsyncEngineArgs.from_cli_args(args)
    assert engine.model == "/models/tiny-v1"
    assert (engine.dtype, engine.kv_cache_dtype, engine.block_size) == ("bfloat16", "fp8_e4m3", 64)
    assert (engine.tensor_parallel_size, engine.pipeline_parallel_size, engine.max_model_len) == (2, 2, 8192)
    assert (engine.quantization, engine.model_impl, engine.disable_sliding_window) == ("fp8", "vllm", True)
    assert engine.hf_overrides == OVERRIDES and engine.enable_prefix_caching is True
    assert args.enable_prompt_tokens_details is True
    events = engine.kv_events_config
    assert (events.enable_kv_cache_events, events.publisher, events.endpoint, events.replay_endpoint, events.topic) == (
        True, "zmq", f"ipc:///run/kvcp-kv-events/{NAMESPACE}.pub", f"ipc:///run/kvcp-kv-events/{NAMESPACE}.replay", NAMESPACE,
    )  # fmt: skip
    transfer = engine.kv_transfer_config
    assert transfer.kv_connector == VLLM_CONNECTOR_NAMES[connector]
    assert transfer.kv_role == "kv_both"


def test_shell_refuses_a_file_its_here_document_would_change() -> None:
    spec = spec_for("lmcache", default_layout("LMCacheConnectorV1"))
    for content in ("no final newline", "a\nKVCP_FILE_END\nb\n"):
        broken = GpuEngineSpec(**{**spec.__dict__, "files": {"x.yaml": content}})
        with pytest.raises(ValueError, match="must end with a newline and hold no line KVCP_FILE_END"):
            broken.to_shell()
