"""The models the main job runs on: their traffic, their answers' releases, their sizes."""

from __future__ import annotations

import json
import sqlite3
import struct
from pathlib import Path

import pytest

from cacheadmin.models import ModelVersion
from cacheadmin.services.comparison import version_logprob_floor
from cacheadmin.services.demo_models import DEFAULT_DEMO_MODEL, DEMO_MODELS, checkpoint_parameters, stated_release
from inference.errors import CheckpointError
from inference.policies import load_policies
from tests.helpers import manage, subprocess_env

VERSIONS = {"v1": "1.2", "v2": "1.3"}


def _policy(pid: str) -> dict[str, object]:
    return next(p for p in load_policies()["policies"] if p["id"] == pid)


@pytest.mark.parametrize(
    ("answer", "release"),
    [
        ("You can return any unused item within 30 days of delivery for a full refund.", "1.2"),
        ("You can return any unused item within 14 days of delivery for a full refund.", "1.3"),
        ("WITHIN 14 DAYS", "1.3"),
        ("30 days, or 14 days for sale items", None),
        ("Sizes can be exchanged for free once per order.", None),
        ("", None),
    ],
)
def test_an_answer_states_the_release_whose_marker_it_alone_holds(answer: str, release: str | None) -> None:
    assert stated_release(answer, _policy("refund-window"), VERSIONS) == release


def test_the_real_model_is_the_default_and_the_tiny_one_keeps_today_s_fast_path() -> None:
    real, tiny = DEMO_MODELS[DEFAULT_DEMO_MODEL], DEMO_MODELS["tiny"]
    assert (real.key, real.served_name, real.labels, real.layout.dtype, real.corpus, real.max_tokens) == (
        "smollm2", "northwind-assistant", ("northwind-v1.2", "northwind-v1.3"), "bfloat16", "northwind-sample", 32,
    )  # fmt: skip
    assert (tiny.served_name, tiny.labels, tiny.layout.dtype, tiny.corpus, tiny.max_tokens, tiny.admit_length) == (
        "tiny", ("tiny-v1", "tiny-v2"), "float32", "diagnostic", 16, True,
    )  # fmt: skip
    assert (tiny.workload().max_tokens, tiny.workload().model) == (8, "tiny")


def test_the_real_model_s_traffic_asks_northwind_s_customers_questions() -> None:
    data = load_policies()
    workload = DEMO_MODELS["smollm2"].workload()
    (template,) = workload.templates
    assert (template.system, workload.model, workload.max_tokens) == (data["system"], "northwind-assistant", 32)
    assert template.questions[:3] == (
        "How many days do I have to return an item?", "When is shipping free?", "How long is the warranty on tents?",
    )  # fmt: skip
    assert len(template.questions) == 28 and len(template.paraphrases) == 7
    assert template.paraphrases["How many days do I have to return an item?"] == (
        "What is your return window?", "Can I still return something I bought three weeks ago?",
    )  # fmt: skip
    body = workload.request(0)
    assert body["model"] == "northwind-assistant" and body["messages"][0] == {"role": "system", "content": data["system"]}


def _safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2
        for d in shape:
            size *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_parameters_are_counted_from_the_weight_files_headers(tmp_path: Path) -> None:
    _safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": [3, 4], "b": [5]})
    _safetensors(tmp_path / "model-00002-of-00002.safetensors", {"c": [2, 2, 2]})
    assert checkpoint_parameters(tmp_path) == 3 * 4 + 5 + 8
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError) as refused:
        checkpoint_parameters(tmp_path / "other")
    assert str(refused.value) == f"{tmp_path / 'other'}: pickle weights; parameters are counted in safetensors headers"


def test_the_demo_refuses_an_unknown_model_before_doing_anything() -> None:
    proc = manage("demo", "--no-serve", "--model", "gpt-5", env=subprocess_env())
    assert proc.returncode == 2 and proc.stdout == ""
    assert "argument --model: invalid choice: 'gpt-5' (choose from 'smollm2', 'tiny')" in proc.stderr
    proc = manage("demo", "--no-serve", env=subprocess_env(DEMO_MODEL="gpt-5"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "DEMO_MODEL must be one of smollm2, tiny, got 'gpt-5'" in proc.stderr


@pytest.mark.parametrize(
    ("inputs", "floor"),
    [({"layout": {"dtype": "bfloat16"}}, 0.2), ({"layout": {"dtype": "float32"}}, 1e-3), ({"layout": {}}, 1e-3),
     ({}, 1e-3), ({"layout": {"dtype": 16}}, 1e-3)],
)  # fmt: skip
def test_a_version_s_comparison_floor_is_its_resolved_dtype_s(inputs: dict[str, object], floor: float) -> None:
    assert version_logprob_floor(ModelVersion(inputs=inputs)) == floor


def test_the_demo_refuses_a_models_folder_outside_the_roots_and_a_bad_address_before_migrating(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.sqlite3"
    env = subprocess_env(DATABASE_URL=f"sqlite:///{fresh}", VAR_DIR=str(tmp_path / "var"))
    for name in ("MODEL_ROOTS", "DEMO_MODELS_DIR", "GUNICORN_BIND"):
        env.pop(name, None)  # the defaults, under this VAR_DIR
    outside = manage("demo", "--no-serve", env={**env, "DEMO_MODELS_DIR": str(tmp_path / "elsewhere")})
    assert outside.returncode == 2 and outside.stdout == ""
    roots = tmp_path / "var" / "models"
    assert outside.stderr == (f"CommandError: DEMO_MODELS_DIR {tmp_path / 'elsewhere'} lies outside MODEL_ROOTS ({roots})\n")
    address = manage("demo", "--addr", "nonsense", env=env)
    assert address.returncode == 2 and address.stdout == ""
    assert address.stderr == "CommandError: --addr='nonsense' is not HOST:PORT (port 1-65535) or unix:PATH\n"
    with sqlite3.connect(fresh) as db:  # neither migrated the database
        assert db.execute("SELECT name FROM sqlite_master").fetchall() == []
