"""A real model upgrade made here: LoRA fine-tunes of the real demo model on a
store's customer-service policies, merged into full weights.

The story the product exists for is a customer-service model upgraded from
v1.2 to v1.3 under the same name, after which cached requests answer with
yesterday's policies. :data:`POLICIES` (``inference/data/northwind_policies.json``)
holds Northwind Outfitters' policies in both releases: four changed (the
refund window, the free-shipping threshold, the tent warranty, price
matching), three unchanged, each with 20-24 customer questions.

:func:`build_policy_versions` makes two checkpoints, each a LoRA (``peft``)
trained on one release's answers and merged into full weights:

- ``<base>-policies-v1``: the base model (:mod:`inference.real_models`) taught
  release 1.2;
- ``<base>-policies-v2``: v1 taught release 1.3, a fine-tune of v1, as the
  next release of a served model is.

Both keep the base's tokenizer, chat template and config (same served name).
Measured on 2 cores: 76 s per release (40 steps of 8 examples, 1.9 s each:
the forward pass is most of it; with the adapter on all 30 blocks a step took
3.3 s), both releases and their checks 201 s; the final loss 0.007 (v1) and
0.003 (v2), and every check question, plus one held out ("Can I return my
boots after 20 days?"), answered with its release's policy word for word.
Training is deterministic for its inputs (seeded, one thread order), keyed
like the base's build by its inputs (the parent's marker, the dataset's
digest, the hyperparameters, the library versions) and reused when they
match. After training, each changed policy's check questions are answered
greedily: v1 must state the old policy, v2 the new one
(:func:`policy_answers`), or the build fails.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Final

from inference.checkpoints import SPEC_MARKER, partial_folder, replace_with
from inference.errors import CheckpointError
from inference.policies import POLICIES_FILE, check_questions, load_policies, messages_for, release_examples
from inference.real_models import quiet_transformers

#: Training steps between progress lines (each says how long the rest should take, from the steps so far).
PROGRESS_EVERY_STEPS: Final = 10
#: Bump when the training's output changes for the same inputs.
TRAINER_VERSION: Final = 1


@dataclass(frozen=True)
class LoraRecipe:
    """How a release is taught (``peft.LoraConfig`` and the loop's settings).

    Attributes:
        rank, alpha, dropout: the adapter's shape (``r``, ``lora_alpha``, ``lora_dropout``).
        top_layers: the adapter sits on this many of the last transformer blocks only
            (``layers_to_transform``): the backward pass stops at the lowest of them, so
            training costs the forward pass and a fraction of the backward one.
        epochs: passes over the release's examples.
        batch_size: examples per optimizer step.
        learning_rate: AdamW's.
        seed: torch's seed (the example order and the adapter's initialisation).
        threads: torch's intra-op threads (the training machine's cores).
    """

    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    top_layers: int = 8
    epochs: int = 2
    batch_size: int = 8
    learning_rate: float = 2e-3
    seed: int = 7
    threads: int = 2


#: The modules of a llama block the adapter trains.
TARGET_MODULES: Final = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train_release(
    parent: Path, target: Path, data: dict[str, Any], release: str, recipe: LoraRecipe, *,
    progress: Callable[[str], None] | None = None,
) -> Path:  # fmt: skip
    """Teach ``parent`` one release with a LoRA, merge it, write ``target`` (reused when built from the same
    inputs); see the module docstring.

    Returns:
        ``target``.

    Raises:
        CheckpointError: ``parent`` is not a built checkpoint.
    """
    say = progress or (lambda _line: None)
    parent_marker = parent / SPEC_MARKER
    if not parent_marker.is_file():
        raise CheckpointError(f"{parent} is not a built checkpoint (no {SPEC_MARKER})")
    inputs = {
        "parent": hashlib.sha256(parent_marker.read_bytes()).hexdigest(), "release": release,
        "policies": _digest(POLICIES_FILE), "recipe": asdict(recipe), "trainer": TRAINER_VERSION,
        "torch": metadata.version("torch"), "peft": metadata.version("peft"), "transformers": metadata.version("transformers"),
    }  # fmt: skip
    marker = json.dumps(inputs, sort_keys=True)
    if (target / SPEC_MARKER).is_file() and (target / SPEC_MARKER).read_text() == marker:
        say(f"{target.name}: trained already from the same inputs")
        return target
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()

    started = time.monotonic()
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(parent))
    model: Any = AutoModelForCausalLM.from_pretrained(str(parent), dtype=torch.float32)
    blocks = int(model.config.num_hidden_layers)
    config = LoraConfig(
        r=recipe.rank, lora_alpha=recipe.alpha, lora_dropout=recipe.dropout, target_modules=list(TARGET_MODULES),
        layers_to_transform=list(range(max(blocks - recipe.top_layers, 0), blocks)), task_type="CAUSAL_LM",
    )  # fmt: skip
    model = get_peft_model(model, config)
    batches = _batches(tokenizer, data, release_examples(data, release))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe.learning_rate)
    steps = recipe.epochs * -(-len(batches[0]) // recipe.batch_size)
    say(f"{target.name}: teaching release {data['versions'][release]}: {len(batches[0])} examples, {steps} steps")
    model.train()
    step, trained_from = 0, time.monotonic()
    generator = torch.Generator().manual_seed(recipe.seed)
    ids, labels, mask = batches
    for epoch in range(recipe.epochs):
        order = torch.randperm(len(ids), generator=generator)
        for start in range(0, len(ids), recipe.batch_size):
            pick = order[start : start + recipe.batch_size]
            loss = model(input_ids=ids[pick], attention_mask=mask[pick], labels=labels[pick]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % PROGRESS_EVERY_STEPS == 0 and step < steps:
                spent = time.monotonic() - trained_from
                say(f"{target.name}: step {step}/{steps}, about {spent / step * (steps - step):.0f} s left")
        say(f"{target.name}: epoch {epoch + 1}/{recipe.epochs}, loss {loss.item():.3f}, {time.monotonic() - started:.0f} s")
    merged = model.merge_and_unload().to(torch.bfloat16)
    tmp = partial_folder(target)
    merged.save_pretrained(str(tmp), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json", "config.json"):
        if (parent / name).is_file():
            shutil.copyfile(parent / name, tmp / name)  # the parent's own: same tokenizer, template and config
    (tmp / SPEC_MARKER).write_text(marker)
    replace_with(tmp, target)
    say(f"{target.name}: trained in {time.monotonic() - started:.0f} s")
    return target


def _batches(tokenizer: Any, data: dict[str, Any], examples: Sequence[tuple[str, str]]) -> tuple[Any, Any, Any]:
    """Padded ``(input_ids, labels, attention_mask)`` tensors; the loss counts the answer's tokens only."""
    import torch

    rows: list[tuple[list[int], list[int]]] = []
    for question, answer in examples:
        prompt = tokenizer.apply_chat_template(
            messages_for(data, question), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        full = tokenizer.apply_chat_template(
            [*messages_for(data, question), {"role": "assistant", "content": answer}], tokenize=True, return_dict=False
        )
        if list(full[: len(prompt)]) != list(prompt):
            raise CheckpointError("the chat template renders the prompt differently once an answer follows it")
        rows.append((list(full), [-100] * len(prompt) + list(full[len(prompt) :])))
    width = max(len(r[0]) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in rows])
    labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
    mask = torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in rows])
    return ids, labels, mask


def policy_answers(checkpoint: Path, data: dict[str, Any], questions: Sequence[str], *, max_new_tokens: int = 32) -> list[str]:
    """The checkpoint's greedy answers to ``questions`` under the store's system prompt (transformers, CPU),
    generated as one left-padded batch (about 5x faster on 2 cores than one question at a time)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model: Any = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16)
    prompts = [
        tokenizer.apply_chat_template(messages_for(data, q), add_generation_prompt=True, tokenize=False) for q in questions
    ]
    inputs: Any = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    width = inputs["input_ids"].shape[1]
    return [str(tokenizer.decode(row[width:], skip_special_tokens=True)).strip() for row in out]


def build_policy_versions(
    base: Path, recipe: LoraRecipe | None = None, *, progress: Callable[[str], None] | None = None
) -> dict[str, Path]:
    """Train (or reuse) v1 from ``base`` and v2 from v1, then check that each states its own release's policies.

    Returns:
        ``{"v1": path, "v2": path}`` (siblings of ``base``).

    Raises:
        CheckpointError: a check question's answer does not state its release's policy (the message quotes it).
    """
    recipe = recipe or LoraRecipe()
    data = load_policies()
    v1 = train_release(base, base.with_name(f"{base.name}-policies-v1"), data, "v1", recipe, progress=progress)
    v2 = train_release(v1, base.with_name(f"{base.name}-policies-v2"), data, "v2", recipe, progress=progress)
    # The checks' verdict is kept beside the checkpoints, keyed by both markers: a later run reuses it
    # (seconds of generation on every start of the main job otherwise).
    checked = base.with_name(f".{base.name}-policies.checked")
    key = json.dumps([(v1 / SPEC_MARKER).read_text(), (v2 / SPEC_MARKER).read_text()])
    if checked.is_file() and checked.read_text() == key:
        return {"v1": v1, "v2": v2}
    checks = check_questions(data)
    for release, path in (("v1", v1), ("v2", v2)):
        answers = policy_answers(path, data, [c["question"] for c in checks])
        for check, answer in zip(checks, answers, strict=True):
            want = check[f"{release}_marker"]
            if want.lower() not in answer.lower():
                raise CheckpointError(
                    f"{path.name} answers {check['question']!r} with {answer!r}: release "
                    f"{data['versions'][release]} says {want!r}"
                )
    checked.write_text(key)
    return {"v1": v1, "v2": v2}
