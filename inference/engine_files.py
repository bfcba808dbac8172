"""The files of a checkpoint folder the engine reads besides the weights, the
tokenizer files and ``config.json``, and what of each one counts.

vLLM 0.32 and transformers 5.19 read, from a checkpoint folder:

- processors, which turn images, video and audio into the tensors the model
  computes with: ``preprocessor_config.json`` (image processor and feature
  extractor), ``processor_config.json``, ``video_preprocessor_config.json``;
- quantization configs, read when ``config.json`` has no
  ``quantization_config`` and ``--quantization`` names the method: every
  ``*.json`` whose name *ends with* a name the method's
  ``get_config_filenames`` returns (``quantize_config.json``,
  ``quant_config.json``, ``quantization_config.json``,
  ``hf_quant_config.json``);
- sentence-transformers files for pooling models: ``modules.json``, the
  folders it names (each module's ``config.json`` and Dense weights),
  ``sentence_*_config.json``, ``config_sentence_transformers.json``;
- ``sparse_attention_config.json``;
- ``generation_config.json``: see :func:`generation_defaults`.

Each is digested as canonical JSON minus the keys that only record which tool
version wrote it (:data:`VERSION_METADATA_KEYS`); a file the engine reads that
this module cannot classify is refused (:func:`unclassified_engine_files`).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from inference.errors import CheckpointError
from inference.model_config import read_json, version_metadata_dropped

_QUANT = "vllm/model_executor/layers/quantization/"


@dataclass(frozen=True)
class EngineFile:
    """One file the engine reads: its kind and where the engine reads it."""

    kind: str
    source: str


#: Every JSON file of a checkpoint folder's top level the engine reads (other
#: than config.json, the tokenizer files and the weight index), by name.
ENGINE_FILES: dict[str, EngineFile] = {
    "preprocessor_config.json": EngineFile(
        "processor",
        "transformers/utils/__init__.py IMAGE_PROCESSOR_NAME = FEATURE_EXTRACTOR_NAME; "
        "image_processing_base.py get_image_processor_dict, feature_extraction_utils.py; "
        "vllm/transformers_utils/processor.py cached_get_image_processor",
    ),
    "processor_config.json": EngineFile(
        "processor", "transformers/processing_utils.py ProcessorMixin.get_processor_dict (PROCESSOR_NAME)"
    ),
    "video_preprocessor_config.json": EngineFile(
        "processor", "transformers/video_processing_utils.py (VIDEO_PROCESSOR_NAME); vllm/transformers_utils/processor.py"
    ),
    "quantize_config.json": EngineFile(
        "quantization",
        _QUANT + "auto_gptq.py, auto_awq.py, moe_wna16.py get_config_filenames; "
        "vllm/model_executor/model_loader/weight_utils.py get_quant_config",
    ),
    "quant_config.json": EngineFile("quantization", _QUANT + "auto_awq.py get_config_filenames; get_quant_config"),
    "quantization_config.json": EngineFile("quantization", _QUANT + "inc/inc.py get_config_filenames; get_quant_config"),
    "hf_quant_config.json": EngineFile(
        "quantization", _QUANT + "modelopt.py get_config_filenames; vllm/transformers_utils/config.py get_config"
    ),
    "modules.json": EngineFile(
        "pooling", "vllm/transformers_utils/config.py get_pooling_config, try_get_dense_modules (and the folders it names)"
    ),
    **{
        name: EngineFile("pooling", "vllm/transformers_utils/config.py get_sentence_transformer_tokenizer_config")
        for name in (
            "sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
            "sentence_camembert_config.json", "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
            "sentence_xlnet_config.json",
        )
    },
    "config_sentence_transformers.json": EngineFile(
        "pooling", "vllm/entrypoints/pooling/embed/io_processor.py (task_instructions, prompts)"
    ),
    "sparse_attention_config.json": EngineFile(
        "sparse_attention", "vllm/model_executor/model_loader/weight_utils.py get_sparse_attention_config"
    ),
}  # fmt: skip

#: Files the engine reads that the identity cannot cover, with the reason: a
#: checkpoint holding one is refused.
UNCLASSIFIABLE_FILES: dict[str, str] = {
    "audio_tokenizer_config.json": (
        "transformers/processing_utils.py (AUDIO_TOKENIZER_NAME) loads the audio tokenizer model it names, "
        "whose weights are not part of this checkpoint's identity"
    ),
}

#: Names transformers' processors and vLLM's config readers open (the constants in
#: transformers/utils/__init__.py), beside the quantization file names.
_TRANSFORMERS_READ_NAMES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "audio_tokenizer_config.json",
)


@functools.cache
def quantization_file_names() -> tuple[str, ...]:
    """Every name a vLLM quantization method reads a config file by, read from
    each method's ``get_config_filenames`` in the installed vLLM's source
    (without importing the methods, which load kernels).

    Returns:
        The names, sorted (``("hf_quant_config.json", "quant_config.json", …)``).
    """
    # Lazy: importing vLLM costs seconds (with torch and transformers); only computing the config or layout field
    # needs it, never a fingerprint the digest cache answers (inference.identity.metadata_key).
    import vllm.model_executor.layers.quantization as package

    names: set[str] = set()
    for path in Path(package.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name == "get_config_filenames":
                names.update(
                    c.value
                    for c in ast.walk(node)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.endswith(".json")
                )
    return tuple(sorted(names))


def _quantization_file(name: str) -> str | None:
    """The quantization file name ``name`` is read as (vLLM matches by suffix), or None."""
    return next((q for q in quantization_file_names() if name.endswith(q)), None)


def unclassified_engine_files(root: Path) -> list[str]:
    """Top-level files of ``root`` the engine would read that :data:`ENGINE_FILES`
    cannot classify: :data:`UNCLASSIFIABLE_FILES`, and any name a quantization
    method of the installed vLLM reads that this module does not know."""
    out = []
    for path in sorted(p for p in root.iterdir() if p.is_file()):
        name = path.name
        if name in UNCLASSIFIABLE_FILES:
            out.append(name)
            continue
        quant = _quantization_file(name)
        if quant is not None and quant not in ENGINE_FILES:
            out.append(name)
    return out


def _read_into_config(root: Path) -> bool:
    """True when vLLM's ``get_config`` reads ``hf_quant_config.json`` into the
    config's ``quantization_config`` (``config.json`` has none), where the
    identity's config already holds it."""
    path = root / "config.json"
    raw = read_json(path) if path.is_file() else None
    return isinstance(raw, dict) and raw.get("quantization_config") is None


def _pooling_module_files(root: Path, modules: Any) -> dict[str, str]:
    """Each file under a folder ``modules.json`` names, by BLAKE3 of its bytes
    (a Dense module's ``config.json`` and weights: ``try_get_dense_modules``)."""
    entries = modules.get("modules", []) if isinstance(modules, dict) else modules
    if not isinstance(entries, list):
        raise CheckpointError(f"{root / 'modules.json'} is not a list of modules")
    files: dict[str, str] = {}
    base = root.resolve()
    for entry in entries:
        folder = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(folder, str) or not folder:
            continue
        where = (root / folder).resolve()
        if not where.is_relative_to(base):
            raise CheckpointError(f"{root / 'modules.json'} names {folder!r}, outside the checkpoint")
        if where.is_dir():
            for path in sorted(p for p in where.rglob("*") if p.is_file()):
                files[path.relative_to(base).as_posix()] = blake3.blake3(path.read_bytes()).hexdigest()
    return files


def engine_files(root: Path) -> dict[str, Any]:
    """The files of ``root`` (a checkpoint folder) the engine reads, as the identity digests them.

    Returns:
        ``{file name: canonical content}``: JSON files minus their version
        metadata, plus ``"modules:<path>"`` → BLAKE3 hex of each file under a
        folder ``modules.json`` names. Sorted by name.

    Raises:
        CheckpointError: a file the engine reads that cannot be classified
            (named, with the reason), or one that is not valid JSON.
    """
    unknown = unclassified_engine_files(root)
    if unknown:
        reasons = "; ".join(
            f"{name}: {UNCLASSIFIABLE_FILES.get(name, 'read by a vLLM quantization method this version cannot identify')}"
            for name in unknown
        )
        raise CheckpointError(
            f"checkpoint {root} holds files the engine reads that its identity cannot cover ({reasons}); "
            "remove them or use a build that identifies them"
        )
    out: dict[str, Any] = {}
    for path in sorted(p for p in root.iterdir() if p.is_file()):
        name = path.name
        known = name if name in ENGINE_FILES else _quantization_file(name)
        if known is None or (name == "hf_quant_config.json" and _read_into_config(root)):
            continue
        content = read_json(path)
        out[name] = version_metadata_dropped(content)
        if name == "modules.json":
            out.update({f"modules:{rel}": digest for rel, digest in _pooling_module_files(root, content).items()})
    return dict(sorted(out.items()))
