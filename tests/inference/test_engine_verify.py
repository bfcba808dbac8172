"""Checks of what an engine reports against an identity (the comparison alone;
tests/cacheadmin/test_fleet.py runs it against real engines)."""

from __future__ import annotations

import pytest

from inference.corpus import load_corpus
from inference.engines.verify import (
    DRIFT_CACHE_LABELS,
    ExpectedEngine,
    MixedMetrics,
    cache_config_labels,
    compare_drift,
    compare_identity,
    drift_baseline,
)

PROBES = load_corpus("diagnostic")[:2]
LAYOUT = {
    "dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "block_size": 16, "engine_version": "vllm 0.32.0",
    "tensor_parallel_size": 2, "pipeline_parallel_size": 1, "quantization": None, "kv_cache_layout": "auto",
}  # fmt: skip
EXPECTED = ExpectedEngine.from_layout(LAYOUT, served_name="llama", prefix_caching=True)


class Ids:
    """A tokenizer whose ids are the message lengths (enough to compare)."""

    def encode_chat(self, conversation) -> list[int]:
        return [len(m["content"]) for m in conversation.messages if isinstance(m.get("content"), str)]


def facts(**change) -> dict:
    base = {
        "served_names": ["llama"],
        "models": {"id": "llama", "root": "/models/llama", "max_model_len": 8192},
        "cache_config": {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True", "kv_cache_layout": "None",
                         "prefix_caching_hash_algo": "sha256"},
        "version": "0.32.0",
        "server_info": {"dtype": "bfloat16", "tensor_parallel_size": 2, "pipeline_parallel_size": 1, "quantization": None},
        "tokens": {c.id: Ids().encode_chat(c) for c in PROBES},
        "output": " Paris",
    }  # fmt: skip
    base.update(change)
    return base


def failed(**change) -> dict[str, tuple]:
    checks = compare_identity(EXPECTED, facts(**change), tokenizer=Ids(), probes=PROBES, reference_output=" Paris")
    return {c.field: (c.expected, c.observed) for c in checks if not c.ok}


def test_an_engine_that_reports_the_identity_passes_every_check() -> None:
    checks = compare_identity(EXPECTED, facts(), tokenizer=Ids(), probes=PROBES, reference_output=" Paris")
    assert [c.field for c in checks] == [
        "served_name", "block_size", "kv_cache_dtype", "prefix_caching", "engine_version", "dtype",
        "tensor_parallel_size", "pipeline_parallel_size", "quantization", *[f"tokenizer:{c.id}" for c in PROBES], "output",
    ]  # fmt: skip
    assert all(c.ok for c in checks)


def test_each_difference_is_named_with_what_was_expected_and_seen() -> None:
    assert failed(served_names=["other"], models=None) == {"served_name": ("llama", "serves 1 other model name(s)")}
    assert failed(cache_config=None) == {"cache_config_info": ("present", None)}
    assert failed(cache_config={**facts()["cache_config"], "block_size": "32", "cache_dtype": "fp8"}) == {
        "block_size": ("16", "32"), "kv_cache_dtype": ("bfloat16", "fp8"),
    }  # fmt: skip
    assert failed(server_info={"dtype": "float16", "tensor_parallel_size": 1}) == {
        "dtype": ("bfloat16", "float16"), "tensor_parallel_size": (2, 1),
    }  # fmt: skip
    assert failed(version="0.31.1") == {"engine_version": ("0.32.0", "0.31.1")}
    # Generated text of the server checked is not repeated: its length only.
    assert failed(output=" Lyon") == {"output": (" Paris", "a different answer (5 characters, not shown)")}
    first = PROBES[0]
    want = Ids().encode_chat(first)
    other = failed(tokens={**facts()["tokens"], first.id: [*want[:1], 999, *want[2:]]})
    assert other == {f"tokenizer:{first.id}": (f"{len(want)} tokens", f"{len(want)} tokens, first difference at token 1")}
    missing = failed(tokens={**facts()["tokens"], first.id: "error: engine at x answered 404"})
    assert missing == {f"tokenizer:{first.id}": (f"{len(want)} tokens", "(a value of 31 characters, not shown)")}


def test_nothing_a_server_answered_is_repeated_in_a_check() -> None:
    """Found: adopting a fake server repeated its /metrics labels and /version in the 409."""
    secret = "SECRET-XYZZY-42"
    cache = {**facts()["cache_config"], "block_size": secret, "cache_dtype": secret, "enable_prefix_caching": secret}
    checks = failed(cache_config=cache, version=secret, output=secret, server_info={"dtype": secret, "quantization": secret})
    assert secret not in repr(checks)
    assert checks["block_size"] == ("16", "(a value of 15 characters, not shown)")
    assert checks["engine_version"] == ("0.32.0", "(a value of 15 characters, not shown)")
    baseline = drift_baseline(facts())
    drifted = compare_drift(baseline, facts(version=secret, output=secret, models={"id": secret, "root": secret}))
    assert secret not in repr([c.as_dict() for c in drifted])


def test_drift_is_any_change_from_the_verified_reading() -> None:
    baseline = drift_baseline(facts())
    assert all(c.ok for c in compare_drift(baseline, facts()))
    moved = facts(models={"id": "llama", "root": "/models/llama-v2", "max_model_len": 8192})
    assert [c.field for c in compare_drift(baseline, moved) if not c.ok] == ["models"]
    regrown = facts(cache_config={**facts()["cache_config"], "kv_cache_memory_bytes": "1"})  # not an identity label
    assert all(c.ok for c in compare_drift(baseline, regrown))


def test_cache_config_labels_are_read_from_the_exposition() -> None:
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",enable_prefix_caching="True"} 1.0\n'
    )
    assert cache_config_labels(text) == {"block_size": "32", "cache_dtype": "auto", "enable_prefix_caching": "True"}
    assert cache_config_labels("# nothing here\n") is None


def test_an_exposition_mixed_with_other_processes_cache_configurations_is_not_read() -> None:
    """An engine that inherited another process's PROMETHEUS_MULTIPROC_DIR exposes every
    writer's cache_config_info: which one is the engine's cannot be told."""
    head = "# HELP vllm:cache_config_info Information\n# TYPE vllm:cache_config_info gauge\n"
    ours = 'vllm:cache_config_info{block_size="32",engine="0",enable_prefix_caching="True"} 1.0\n'
    reference = 'vllm:cache_config_info{block_size="32",engine="0",enable_prefix_caching="False"} 1.0\n'
    with pytest.raises(MixedMetrics, match="2 different cache configurations"):
        cache_config_labels(head + reference + ours)
    # Data-parallel ranks of one engine: one configuration under two engine labels.
    rank1 = ours.replace('engine="0"', 'engine="1"')
    assert cache_config_labels(head + ours + rank1) == {"block_size": "32", "enable_prefix_caching": "True"}


def test_a_reading_that_could_not_be_taken_is_no_drift() -> None:
    baseline = drift_baseline(facts())
    unread = facts(cache_config=None, version=None, output=None, unreadable={"/metrics": "mixed", "/version": "x",
                                                                               "/v1/completions": "no answer"})  # fmt: skip
    checks = compare_drift(baseline, unread)
    failed_checks = [c for c in checks if not c.ok]
    assert {c.field for c in failed_checks} == {"version", "output", *(f"cache_config:{k}" for k in DRIFT_CACHE_LABELS)}
    assert not any(c.readable for c in failed_checks)
    # The same readings taken, and different: a change.
    changed = compare_drift(baseline, facts(cache_config={**facts()["cache_config"], "enable_prefix_caching": "False"}))
    assert [(c.field, c.readable) for c in changed if not c.ok] == [("cache_config:enable_prefix_caching", True)]
    # A model list read without the served name: the engine changed, whatever else was unread.
    gone = compare_drift(baseline, facts(models=None, version=None, unreadable={"/version": "x"}))
    assert [(c.field, c.readable) for c in gone if not c.ok] == [("models", True), ("version", False)]
    identity = compare_identity(EXPECTED, unread, tokenizer=Ids(), probes=PROBES, reference_output=" Paris")
    assert [(c.field, c.readable) for c in identity if not c.ok] == [
        ("cache_config_info", False), ("engine_version", False), ("output", False),
    ]  # fmt: skip
