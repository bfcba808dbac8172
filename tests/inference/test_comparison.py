"""Judging one prompt: what counts as a deceptive hit (pure function)."""

from __future__ import annotations

from inference.comparison import (
    LOGPROB_FLOOR,
    LOGPROB_FLOORS,
    NOISE_FACTOR,
    compare_prompt,
    first_divergence,
    logprob_floor,
    max_logprob_delta,
)
from inference.corpus import Conversation, load_corpus
from inference.engines.vllm_http import ChatResult
from inference.prewarm import expected_cached_tokens

CONV = Conversation(id="c", messages=[{"role": "user", "content": "x"}])


def run(tokens: list[int], logprobs: list[float], cached: int = 0) -> ChatResult:
    return ChatResult(token_ids=tokens, logprobs=logprobs, prompt_tokens=100, cached_tokens=cached, ttft_ms=5.0)


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_logprob_delta_stops_at_first_divergence() -> None:
    a = run([1, 2, 3], [-1.0, -2.0, -3.0])
    b = run([1, 5, 3], [-1.5, -2.25, -9.0])
    assert max_logprob_delta(a, b) == 0.5


def test_hit_with_other_tokens_is_deceptive() -> None:
    ref = run([1, 2, 3], [-1.0, -1.0, -1.0])
    out = compare_prompt(0, CONV, ref, ref, run([1, 2, 4], [-1.0, -1.0, -2.0], cached=64))
    assert (out.deceptive, out.tokens_equal, out.first_divergence, out.tolerance) == (True, False, 2, LOGPROB_FLOOR)


def test_divergence_without_cached_tokens_is_not_a_deceptive_hit() -> None:
    ref = run([1, 2, 3], [-1.0, -1.0, -1.0])
    out = compare_prompt(0, CONV, ref, ref, run([1, 2, 4], [-1.0, -1.0, -2.0], cached=0))
    assert out.deceptive is False and out.tokens_equal is False


def test_same_tokens_logprob_beyond_noise_is_deceptive_within_noise_is_not() -> None:
    ref = run([1, 2], [-1.0, -1.0])
    control = run([1, 2], [-1.0, -1.01])  # noise 0.01 → tolerance 0.04
    assert compare_prompt(0, CONV, ref, control, run([1, 2], [-1.0, -1.03], cached=32)).deceptive is False
    out = compare_prompt(0, CONV, ref, control, run([1, 2], [-1.0, -1.05], cached=32))
    assert out.deceptive is True
    assert abs(out.tolerance - NOISE_FACTOR * 0.01) < 1e-12


def test_unstable_control_is_noise_not_a_deceptive_hit() -> None:
    ref = run([1, 2], [-1.0, -1.0])
    control = run([1, 3], [-1.0, -1.0])
    assert compare_prompt(0, CONV, ref, control, run([1, 4], [-1.0, -1.0], cached=32)).deceptive is False


def test_expected_cached_tokens_counts_whole_blocks_before_last_token() -> None:
    assert expected_cached_tokens(371, 32) == 352
    assert expected_cached_tokens(33, 32) == 32
    assert expected_cached_tokens(32, 32) == 0
    assert expected_cached_tokens(0, 32) == 0


def test_diagnostic_corpus_covers_the_required_cases() -> None:
    corpus = {c.id: c for c in load_corpus("diagnostic")}
    assert any(m["content"] == "" for m in corpus["empty-turn"].messages)
    assert corpus["tool-result"].messages[-1]["role"] == "tool"
    assert "我的" in corpus["cjk-zh"].messages[-1]["content"]
    assert "Сколько" in corpus["cyrillic"].messages[-1]["content"]
    assert "🚨" in corpus["emoji"].messages[-1]["content"]
    long1, long2 = corpus["long-1"].messages, corpus["long-2"].messages
    assert long2[: len(long1)] == long1
    assert any(m["role"] == "assistant" for m in long1)


class RecordingEngine:
    """Stands in for an engine client: records the order of calls (the phase
    ordering is what this unit is about; real engines are in tests/cacheadmin)."""

    def __init__(self, name: str, calls: list[tuple[str, str]], tokens: list[int]) -> None:
        self.name, self.calls, self.tokens = name, calls, tokens

    def chat(self, messages, *, cache_salt, max_tokens, tools=None) -> ChatResult:
        self.calls.append((self.name, messages[-1]["content"]))
        return ChatResult(token_ids=self.tokens, logprobs=[-1.0] * len(self.tokens), prompt_tokens=100, cached_tokens=64)

    def reset_prefix_cache(self) -> None:
        pass


def test_run_comparison_times_each_engine_while_the_other_is_idle() -> None:
    from inference.comparison import run_comparison

    calls: list[tuple[str, str]] = []
    convs = [Conversation(id=f"c{i}", messages=[{"role": "user", "content": f"p{i}"}]) for i in range(3)]
    results = []
    run_comparison(
        RecordingEngine("test", calls, [1, 2]),
        RecordingEngine("ref", calls, [1, 3]),
        convs,
        cache_salt="s",
        max_tokens=2,
        skip={1},
        on_result=results.append,
        settle_s=0,
    )
    assert calls == [("ref", "p0"), ("ref", "p0"), ("ref", "p2"), ("ref", "p2")] + [("test", "p0")] * 2 + [("test", "p2")] * 2
    assert [(r.index, r.deceptive, r.first_divergence) for r in results] == [(0, True, 1), (2, True, 1)]


def test_ttft_is_the_faster_of_two_samples_each_way() -> None:
    def timed(ms: float, cached: int = 0) -> ChatResult:
        return ChatResult(token_ids=[1], logprobs=[-1.0], prompt_tokens=100, cached_tokens=cached, ttft_ms=ms)

    out = compare_prompt(0, CONV, timed(90.0), timed(80.0), timed(30.0, 64), timed(20.0, 64))
    assert (out.ttft_cold_ms, out.ttft_warm_ms) == (80.0, 20.0)
    assert compare_prompt(0, CONV, timed(90.0), timed(95.0), timed(30.0, 64)).ttft_warm_ms == 30.0


def test_the_tolerance_floor_follows_the_engines_dtype() -> None:
    assert [logprob_floor(d) for d in ("float32", "float16", "bfloat16", "fp8_e4m3")] == [1e-3, 3e-2, 0.2, 0.2]
    assert LOGPROB_FLOOR == LOGPROB_FLOORS["float32"]
    # A real bfloat16 model's correct hit moved a token's logprob by 0.052 nats (a live question it was not
    # taught): within bfloat16's floor, a deceptive hit under float32's.
    ref = run([1, 2], [-1.0, -0.6])
    cached = run([1, 2], [-1.0, -0.6 - 0.052], cached=32)
    assert compare_prompt(0, CONV, ref, ref, cached, floor=logprob_floor("bfloat16")).deceptive is False
    assert compare_prompt(0, CONV, ref, ref, cached).deceptive is True
    # A changed token is a divergence whatever the floor.
    assert compare_prompt(0, CONV, ref, ref, run([1, 3], [-1.0, -0.6], cached=32), floor=0.2).deceptive is True
