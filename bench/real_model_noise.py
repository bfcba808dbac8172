"""Comparison noise on a real model: the safe path's false alarms and the unsafe path's catches,
on real bf16 vLLM engines serving the demo's fine-tuned SmolLM2-135M-Instruct releases.

Builds (or reuses) the real model and its two policy releases (``manage.py real_model build``,
:func:`inference.finetune.build_policy_versions`) under ``--models`` (default ``var/models``),
then starts three engines (bf16, block size 32, eager):

- ``v2`` with prefix caching and vLLM's ExampleConnector on a disk tier folder of its own;
- ``v2-unsafe`` with prefix caching and the connector on ``v1``'s folder (a name-keyed cache);
- ``reference``: v2 with neither (the cold baseline and the cold-vs-cold control);

and ``v1`` with the connector on its own folder, to fill that folder. For each ``--round``
(default 3), with a fresh ``cache_salt``: v1 fills its folder with every prompt of the
``northwind`` corpus (156 customer questions; ``--corpus`` another, ``--prompts`` its first N), v2 fills its own, and then
:func:`inference.comparison.run_comparison` runs the corpus on ``v2`` (safe: its own state) and
on ``v2-unsafe`` (v1's state) against the reference, with ``--max-tokens`` (default 32).

Judged as comparison jobs judge engines computing in bfloat16 (the tolerance's floor
:func:`inference.comparison.logprob_floor`). Reports per round and in total: prompts, prompts with
cached tokens, deceptive hits (safe: the false alarms, goal 0), unsafe prompts that reused v1's KV
(each a cross-version hit: a comparison job flags every one by the namespace's identity) and how
many of them changed the answer beyond the noise (deceptive), the prompts whose cached text differs
from the reference's, and the largest logprob deltas (nats) of the safe runs and the smallest and
median of the unsafe ones; then one JSON line ``{"real_model_noise": ...}``.

Usage::

    .venv/bin/python bench/real_model_noise.py [--rounds 3] [--corpus northwind] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.comparison import PromptComparison, logprob_floor, run_comparison  # noqa: E402
from inference.corpus import load_corpus  # noqa: E402
from inference.engines.launcher import EngineSpec, LocalEngine, free_port  # noqa: E402
from inference.engines.vllm_http import VllmHttpClient  # noqa: E402
from inference.finetune import build_policy_versions  # noqa: E402
from inference.real_models import build_real_model  # noqa: E402

SERVED = "northwind-assistant"


def _engine(model: Path, folder: Path, name: str, *, cache: Path | None, prefix_caching: bool) -> LocalEngine:
    spec = EngineSpec(
        model_path=model, served_name=SERVED, dtype="bfloat16", log_path=folder / f"{name}.log", port=free_port(),
        block_size=32, max_model_len=2048, prefix_caching=prefix_caching, kv_storage_path=cache,
    )  # fmt: skip
    return LocalEngine(spec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--corpus", default="northwind")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=None, help="the corpus' first N prompts (default all)")
    parser.add_argument("--models", type=Path, default=ROOT / "var" / "models")
    args = parser.parse_args()
    base = build_real_model(args.models, progress=print)
    versions = build_policy_versions(base, progress=print)
    corpus = load_corpus(args.corpus)[: args.prompts]
    work = Path(tempfile.mkdtemp(prefix="kvcp-noise-"))
    tiers = {"v1": work / "tier-v1", "v2": work / "tier-v2"}
    engines = {
        "v1": _engine(versions["v1"], work, "v1", cache=tiers["v1"], prefix_caching=True),
        "v2": _engine(versions["v2"], work, "v2", cache=tiers["v2"], prefix_caching=True),
        "v2-unsafe": _engine(versions["v2"], work, "v2-unsafe", cache=tiers["v1"], prefix_caching=True),
        "reference": _engine(versions["v2"], work, "reference", cache=None, prefix_caching=False),
    }
    rounds: list[dict[str, Any]] = []
    try:
        began = time.monotonic()
        for engine in engines.values():
            engine.start()
        for name, engine in engines.items():
            print(f"{name} ready in {engine.wait_ready(600):.0f} s")
        print(f"engines ready after {time.monotonic() - began:.0f} s")
        clients = {n: VllmHttpClient(f"http://127.0.0.1:{e.spec.port}", SERVED) for n, e in engines.items()}
        for number in range(1, args.rounds + 1):
            salt = secrets.token_hex(8)
            for fill in ("v1", "v2"):
                for conv in corpus:
                    clients[fill].chat(conv.messages, cache_salt=salt, max_tokens=1)
            outcome: dict[str, list[PromptComparison]] = {"safe": [], "unsafe": []}
            for path, engine_name in (("safe", "v2"), ("unsafe", "v2-unsafe")):
                run_comparison(
                    clients[engine_name], clients["reference"], corpus, cache_salt=salt,
                    max_tokens=args.max_tokens, on_result=outcome[path].append, floor=logprob_floor("bfloat16"),
                )  # fmt: skip
            safe, unsafe = outcome["safe"], outcome["unsafe"]
            reused = [r for r in unsafe if r.cached_tokens > 0]
            row = {
                "round": number,
                "prompts": len(corpus),
                "safe_cached": sum(r.cached_tokens > 0 for r in safe),
                "safe_deceptive": sum(r.deceptive for r in safe),
                "safe_text_differs": sum(r.cached.text != r.reference.text for r in safe),
                "safe_max_delta": round(max(r.max_logprob_delta for r in safe), 5),
                # Every prompt that reused v1's KV is a cross-version hit (a comparison job flags it by the
                # namespace's identity); deceptive: its answer also moved beyond the noise.
                "unsafe_reused": len(reused),
                "unsafe_deceptive": sum(r.deceptive for r in reused),
                "unsafe_text_differs": sum(r.cached.text != r.reference.text for r in reused),
                "unsafe_min_delta": round(min((r.max_logprob_delta for r in reused), default=0.0), 5),
                "unsafe_median_delta": (
                    round(sorted(r.max_logprob_delta for r in reused)[len(reused) // 2], 5) if reused else None
                ),
                "control_unstable": sum(not r.control_tokens_equal for r in safe),
                "examples": [
                    {"id": r.conversation_id, "reference": r.reference.text, "cached": r.cached.text}
                    for r in reused if r.cached.text != r.reference.text
                ][:5],
            }  # fmt: skip
            rounds.append(row)
            print(json.dumps(row))
    finally:
        for engine in engines.values():
            engine.stop()
        shutil.rmtree(work, ignore_errors=True)
    total = {
        k: sum(r[k] for r in rounds) for k in ("prompts", "safe_cached", "safe_deceptive", "unsafe_reused", "unsafe_deceptive")
    }
    print(json.dumps({"real_model_noise": {"rounds": rounds, "total": total}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
