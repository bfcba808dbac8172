"""Build small, real Mistral checkpoints for demos and tests.

The checkpoints are genuine ``MistralForCausalLM`` models (config.json plus a
safetensors weight file written by ``transformers``) with a real tokenizer
taken from the files that ship inside the ``mistral_common`` package, so vLLM
serves them with ``tokenizer_mode="mistral"`` exactly as it serves a released
Mistral model. Nothing is downloaded.

Shape constraints come from vLLM 0.32's CPU backend (measured here, see
DESIGN.md): head_dim 64 works, 16 does not.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import mistral_common

from inference.processes import process_token, token_alive

#: Tokenizer files shipped inside mistral_common, by short name.
MISTRAL_COMMON_TOKENIZERS: dict[str, str] = {
    "v1": "tokenizer.model.v1",
    "v2": "mistral_instruct_tokenizer_240216.model.v2",
    "v3": "mistral_instruct_tokenizer_240323.model.v3",
    "v7": "mistral_instruct_tokenizer_241114.model.v7",
    "tekken-240718": "tekken_240718.json",
    "tekken-240911": "tekken_240911.json",
}


def mistral_common_tokenizer_path(name: str) -> Path:
    """Return the path of a tokenizer file shipped inside ``mistral_common``.

    Args:
        name: a key of :data:`MISTRAL_COMMON_TOKENIZERS` (``"v3"``, ``"tekken-240911"``...).

    Raises:
        KeyError: unknown name.
        FileNotFoundError: the installed mistral_common lacks that file.
    """
    path = Path(mistral_common.__file__).parent / "data" / MISTRAL_COMMON_TOKENIZERS[name]
    if not path.is_file():
        raise FileNotFoundError(f"mistral_common ships no {path.name} at {path}")
    return path


#: File recording the spec a checkpoint was built from (hidden: not a model input).
SPEC_MARKER = ".build-spec.json"


@dataclass(frozen=True)
class TinyMistralSpec:
    """Shape and seed of a tiny Mistral checkpoint.

    The defaults (hidden 256, 4 layers, 4 heads of 64, 2 KV heads) are the
    smallest shape whose prefill of a ~1,500-token prompt clearly outweighs
    the fixed per-request cost on 2 CPU cores (measured: ~100 ms cold vs
    ~25 ms served from cache; with hidden 128 and 2 layers it was ~28 vs ~22
    ms, too close for a TTFT comparison to mean anything).

    ``initializer_range`` is larger than the usual 0.02 on purpose: with tiny
    random weights and std 0.02 the next-token logits are nearly flat, so
    greedy decoding would sit on near-ties that float rounding can flip. A
    wider spread keeps greedy decoding stable, which the comparison job's
    cold-vs-cold control then confirms.
    """

    seed: int
    tokenizer: str = "v3"
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 8192
    initializer_range: float = 0.2


def _vocab_size(tokenizer_file: Path) -> int:
    """Vocabulary size of a mistral_common tokenizer file (SentencePiece or Tekken)."""
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tok = MistralTokenizer.from_file(str(tokenizer_file))
    return int(tok.instruct_tokenizer.tokenizer.n_words)


def tokenizer_target_name(tokenizer_file: Path) -> str:
    """File name vLLM's mistral tokenizer mode looks for in a model directory.

    vLLM (``vllm/transformers_utils/tokenizer``, mistral mode) accepts
    ``tekken.json`` or ``tokenizer.model.v*``.
    """
    if tokenizer_file.suffix == ".json":
        return "tekken.json"
    version = tokenizer_file.name.rsplit(".", 1)[-1]
    return f"tokenizer.model.{version}" if version.startswith("v") else "tokenizer.model.v1"


def build_tiny_mistral(target: Path, spec: TinyMistralSpec, *, served_name: str = "tiny") -> Path:
    """Write a tiny random-weight ``MistralForCausalLM`` checkpoint to ``target``.

    The directory gets ``config.json``, ``generation_config.json``,
    ``model.safetensors`` (float32) and the tokenizer file. Building is
    deterministic for a given spec: the same seed gives byte-identical weights.

    Args:
        target: directory to create; must not exist yet, be empty, or hold a finished build of ``spec``
            (another process building the same checkpoint got there first; it is returned as it is).
        spec: shape and seed.
        served_name: recorded in config as ``_name_or_path`` (a name-only field).

    Returns:
        ``target``.

    Raises:
        FileExistsError: ``target`` exists, is not empty and is not a finished build of ``spec``.
    """
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    if target.exists() and any(target.iterdir()):
        marker = target / SPEC_MARKER
        if marker.is_file() and marker.read_text() == json.dumps(asdict(spec), sort_keys=True):
            return target  # another builder of this same spec finished first: the same bytes
        raise FileExistsError(f"{target} exists and is not empty")
    tokenizer_file = mistral_common_tokenizer_path(spec.tokenizer)
    vocab = _vocab_size(tokenizer_file)
    config = MistralConfig(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,
        # transformers 5 names it dtype and still takes torch_dtype (same config.json); 4.x, which requirements allow, needs it.
        torch_dtype="float32",  # type: ignore[call-arg]
    )
    config._name_or_path = served_name
    torch.manual_seed(spec.seed)
    # transformers leaves the model's __init__ unannotated, and its wrapper of .to() types self as an argument.
    model = MistralForCausalLM(config).to(torch.float32)  # type: ignore[no-untyped-call, arg-type]
    # This build's own folder: another process building the same checkpoint (a second demo on the same
    # VAR_DIR) writes its own, and only the folders of builders that died are removed.
    partials_reap(target)
    tmp = target.with_name(f"{target.name}{PARTIAL}{process_token()}")
    shutil.rmtree(tmp, ignore_errors=True)  # this very process's own, from a build that raised
    model.save_pretrained(tmp, safe_serialization=True)
    shutil.copyfile(tokenizer_file, tmp / tokenizer_target_name(tokenizer_file))
    (tmp / SPEC_MARKER).write_text(json.dumps(asdict(spec), sort_keys=True))
    # Written last and renamed into place so a killed build never leaves a
    # half-written checkpoint that looks complete.
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        if target.exists():
            target.rmdir()
        tmp.rename(target)
    except OSError:
        if not (target / SPEC_MARKER).is_file():
            raise
        shutil.rmtree(tmp)  # another builder finished first; same spec, same seed: the same bytes
    return target


#: Infix of a checkpoint being built: ``<target>.partial-<pid>-<start>`` (the builder's token).
PARTIAL = ".partial-"


def partial_folder(target: Path) -> Path:
    """This process's fresh partial folder for building ``target`` (dead builders' partials are removed first)."""
    partials_reap(target)
    tmp = target.with_name(f"{target.name}{PARTIAL}{process_token()}")
    shutil.rmtree(tmp, ignore_errors=True)  # this very process's own, from a build that raised
    tmp.mkdir(parents=True)
    return tmp


def replace_with(tmp: Path, target: Path) -> None:
    """Rename a finished build (its :data:`SPEC_MARKER` written last) to ``target``, replacing a folder built
    from other inputs; when another builder of the same inputs renamed its own first, that one stays.

    Raises:
        OSError: the rename failed and no finished build is at ``target``.
    """
    if target.exists():
        shutil.rmtree(target)
    try:
        tmp.rename(target)
    except OSError:
        if not (target / SPEC_MARKER).is_file():
            raise
        shutil.rmtree(tmp)


def partials_reap(target: Path) -> list[str]:
    """Remove the partial folders of ``target`` whose builder is dead (pid and
    start time, :func:`inference.processes.token_alive`); a running build's is kept.

    Returns:
        The names removed, sorted.
    """
    removed: list[str] = []
    if not target.parent.is_dir():
        return removed
    for path in sorted(target.parent.glob(f"{target.name}{PARTIAL}*")):
        if not token_alive(path.name[len(target.name) + len(PARTIAL) :]):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


#: The two demo checkpoints: same tokenizer, config and served name; only the
#: weights differ (different seeds).
DEMO_CHECKPOINTS: dict[str, TinyMistralSpec] = {
    "tiny-v1": TinyMistralSpec(seed=1),
    "tiny-v2": TinyMistralSpec(seed=2),
}


def ensure_demo_checkpoints(models_dir: Path) -> dict[str, Path]:
    """Build the demo checkpoints under ``models_dir`` if they are missing or
    were built from another spec (their marker file differs).

    Returns:
        ``{"tiny-v1": path, "tiny-v2": path}``.
    """
    paths: dict[str, Path] = {}
    for name, spec in DEMO_CHECKPOINTS.items():
        path = models_dir / name
        marker = path / SPEC_MARKER
        wanted = json.dumps(asdict(spec), sort_keys=True)
        if not marker.is_file() or marker.read_text() != wanted:
            if path.exists():
                shutil.rmtree(path)
            build_tiny_mistral(path, spec, served_name="tiny")
        paths[name] = path
    return paths
