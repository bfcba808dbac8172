"""The real model on real vLLM engines: Northwind's assistant, release 1.2 (v1) and 1.3 (v2), in
bfloat16 on vLLM's CPU backend, and the unsafe upgrade against the safe one.

One engine under test serves v2 with vLLM's ExampleConnector on a disk tier that v1's engine
filled first (the unsafe upgrade: a tier keyed on token ids and model name); a reference engine of
v2 (no prefix cache, no connector) answers cold. Then the same tier is emptied of v1's state and
the engine's memory reset: v2 computes and stores its own KV and serves it (the safe path). Both
runs are judged as a comparison job judges bfloat16 engines.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from inference.comparison import PromptComparison, logprob_floor, run_comparison
from inference.corpus import load_corpus
from inference.engines.launcher import EngineSpec, LocalEngine, free_port
from inference.engines.vllm_http import VllmHttpClient
from inference.finetune import build_policy_versions
from inference.policies import load_policies

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SERVED = "northwind-assistant"


def _spec(model: Path, folder: Path, name: str, tier: Path | None) -> EngineSpec:
    return EngineSpec(
        model_path=model, served_name=SERVED, dtype="bfloat16", log_path=folder / f"{name}.log", port=free_port(),
        block_size=32, max_model_len=2048, prefix_caching=tier is not None, kv_storage_path=tier,
    )  # fmt: skip


def test_v2_on_v1_s_tier_reuses_v1_s_kv_and_on_its_own_tier_answers_as_cold(real_model: Path, tmp_path: Path) -> None:
    versions = build_policy_versions(real_model)
    data = load_policies()
    refund = next(p for p in data["policies"] if p["id"] == "refund-window")
    corpus = [c for c in load_corpus("northwind-sample") if c.id.startswith(("refund-window", "exchange"))]
    tier = tmp_path / "tier"
    engines = {
        "v1": LocalEngine(_spec(versions["v1"], tmp_path, "v1", tier)),
        "v2": LocalEngine(_spec(versions["v2"], tmp_path, "v2", tier)),
        "reference": LocalEngine(_spec(versions["v2"], tmp_path, "reference", None)),
    }
    try:
        for engine in engines.values():
            engine.start()
        for engine in engines.values():
            engine.wait_ready(600)
        client = {name: VllmHttpClient(engine.base_url, SERVED) for name, engine in engines.items()}
        question = corpus[0].messages
        # The changed policy, in words: v1 states release 1.2's refund window, v2 cold release 1.3's.
        assert refund["v1_marker"] in client["v1"].chat(question, cache_salt=None, max_tokens=32).text
        assert refund["v2_marker"] in client["reference"].chat(question, cache_salt=None, max_tokens=32).text
        for conv in corpus:  # v1 stores its KV of every prompt in the tier
            client["v1"].chat(conv.messages, cache_salt="v1", max_tokens=1)
        engines.pop("v1").stop()
        floor = logprob_floor("bfloat16")
        unsafe: list[PromptComparison] = []
        run_comparison(client["v2"], client["reference"], corpus, cache_salt="unsafe", max_tokens=32,
                       on_result=unsafe.append, floor=floor)  # fmt: skip
        # Every prompt reused v1's KV: its whole blocks came from the tier v1 filled.
        assert [r.cached_tokens for r in unsafe] == [(r.prompt_tokens - 1) // 32 * 32 for r in unsafe]
        assert all(r.cached_tokens > 0 and r.control_tokens_equal for r in unsafe)
        # The safe path: v1's state gone, the engine's memory reset; v2 stores and reuses its own.
        for entry in tier.iterdir():
            shutil.rmtree(entry)
        client["v2"].reset_prefix_cache()
        for conv in corpus:  # as a prewarm does: v2 computes and stores its own KV of every prompt
            client["v2"].chat(conv.messages, cache_salt="safe", max_tokens=1)
        safe: list[PromptComparison] = []
        run_comparison(client["v2"], client["reference"], corpus, cache_salt="safe", max_tokens=32,
                       on_result=safe.append, floor=floor)  # fmt: skip
        assert all(r.cached_tokens > 0 and r.tokens_equal and not r.deceptive for r in safe), [
            (r.conversation_id, r.max_logprob_delta, r.cached.text) for r in safe
        ]
        assert [r.cached.text for r in safe] == [r.reference.text for r in safe]
        assert refund["v2_marker"] in safe[0].cached.text
    finally:
        for engine in engines.values():
            engine.stop()
