"""Comparison: the same prompts with cache and without, to catch deceptive hits.

For each prompt, with greedy decoding:
- the reference engine (no prefix caching, no connector) runs it twice: the
  first run is the cold baseline, the second the cold-vs-cold control that
  measures numeric noise on this hardware;
- the engine under test runs it under the namespace's ``cache_salt``.

The prompt *diverges* when its generated token ids differ from the baseline,
or when the largest per-token logprob difference over the common tokens
exceeds the tolerance ``max(NOISE_FACTOR × control delta, floor)``, the floor
set by the dtype the engines compute in (:data:`LOGPROB_FLOORS`).
A **deceptive hit** is a diverging prompt whose cached run reported cached
tokens > 0 while the control itself was stable (same tokens): output changed
because of cached state, not noise.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from inference.corpus import Conversation
from inference.engines.vllm_http import ChatResult
from inference.prewarm import ChatEngine

#: How many times the control's noise a delta may be before it counts.
NOISE_FACTOR = 4.0
#: Smallest tolerance in nats, by the dtype the engines compute in. Cached and
#: recomputed prefill take different kernel paths (block-wise attention over
#: cached KV vs one pass), so results differ in the last bits even when the
#: cold-vs-cold control shows exactly zero, and by as much as the dtype's
#: precision allows. Measured on a real bfloat16 model on vLLM's CPU backend
#: (the main job's, ``bench/real_model_noise.py``): correct hits differed from
#: the cold answer by up to 0.0086 nats on questions the model was taught, and
#: by 0.052 on a live question it was not (less confident tokens move more);
#: the bfloat16 floor is NOISE_FACTOR times that. float16 keeps 3 more mantissa
#: bits than bfloat16 (8x finer); the float32 floor held on the tiny models.
LOGPROB_FLOORS: dict[str, float] = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 0.2}
#: The float32 floor (the default where the dtype is not known).
LOGPROB_FLOOR = LOGPROB_FLOORS["float32"]


def logprob_floor(dtype: str) -> float:
    """The tolerance floor in nats for engines computing in ``dtype`` (:data:`LOGPROB_FLOORS`); the
    largest one for a dtype it does not list (fp8 and other narrower types are at least as noisy)."""
    return LOGPROB_FLOORS.get(dtype, max(LOGPROB_FLOORS.values()))


@dataclass(frozen=True)
class PromptComparison:
    """Outcome of one prompt. Deltas in nats, times in milliseconds."""

    index: int
    conversation_id: str
    prompt_tokens: int
    cached_tokens: int
    tokens_equal: bool
    first_divergence: int | None
    max_logprob_delta: float
    control_tokens_equal: bool
    control_max_logprob_delta: float
    tolerance: float
    ttft_cold_ms: float
    ttft_warm_ms: float
    deceptive: bool
    reference: ChatResult
    cached: ChatResult


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def max_logprob_delta(a: ChatResult, b: ChatResult) -> float:
    """Largest |logprob difference| over the tokens both runs share, up to and
    including the first differing position."""
    diverge = first_divergence(a.token_ids, b.token_ids)
    upto = min(len(a.logprobs), len(b.logprobs)) if diverge is None else min(diverge + 1, len(a.logprobs), len(b.logprobs))
    return max((abs(x - y) for x, y in zip(a.logprobs[:upto], b.logprobs[:upto], strict=True)), default=0.0)


def compare_prompt(
    index: int,
    conv: Conversation,
    reference: ChatResult,
    control: ChatResult,
    cached: ChatResult,
    cached_again: ChatResult | None = None,
    *,
    floor: float = LOGPROB_FLOOR,
) -> PromptComparison:
    """Judge one prompt from its runs (pure function).

    TTFT is the faster of the two samples each way (cold: the reference run
    and the control; warm: the cached run and ``cached_again``), so a
    scheduling hiccup on a busy host does not decide the comparison; outputs
    are judged on the first cached run.
    """
    control_equal = reference.token_ids == control.token_ids
    control_delta = max_logprob_delta(reference, control)
    tolerance = max(NOISE_FACTOR * control_delta, floor)
    divergence = first_divergence(reference.token_ids, cached.token_ids)
    delta = max_logprob_delta(reference, cached)
    diverged = divergence is not None or delta > tolerance
    return PromptComparison(
        index=index,
        conversation_id=conv.id,
        prompt_tokens=cached.prompt_tokens,
        cached_tokens=cached.cached_tokens,
        tokens_equal=divergence is None,
        first_divergence=divergence,
        max_logprob_delta=delta,
        control_tokens_equal=control_equal,
        control_max_logprob_delta=control_delta,
        tolerance=tolerance,
        ttft_cold_ms=min(reference.ttft_ms, control.ttft_ms),
        ttft_warm_ms=min(cached.ttft_ms, cached_again.ttft_ms) if cached_again is not None else cached.ttft_ms,
        deceptive=diverged and cached.cached_tokens > 0 and control_equal,
        reference=reference,
        cached=cached,
    )


#: Seconds to let an engine go idle before timing requests on another one.
#: vLLM's worker busy-polls its shared-memory queue for 1 s after each request
#: (``SpinCondition.busy_loop_s`` in vllm/distributed/device_communicators/
#: shm_broadcast.py, vLLM 0.32). On a host with few cores that spin steals the
#: other engine's CPU: interleaving requests between two engines measured
#: 500-1,000 ms TTFT stalls here, against ~25-100 ms with this pause.
ENGINE_SETTLE_S = 1.2


def run_comparison(
    engine: ChatEngine,
    reference: ChatEngine,
    conversations: list[Conversation],
    *,
    cache_salt: str,
    max_tokens: int,
    skip: Iterable[int] = (),
    on_result: Callable[[PromptComparison], None],
    on_baseline: Callable[[int], None] = lambda index: None,
    settle_s: float = ENGINE_SETTLE_S,
    floor: float = LOGPROB_FLOOR,
) -> None:
    """Run every prompt not in ``skip`` both ways and report each outcome.

    Two phases, so each engine's timings are taken while the other is idle
    (see :data:`ENGINE_SETTLE_S`): the reference runs every prompt (cold and
    control, ``on_baseline`` after each), then, after ``settle_s``, the engine
    under test runs every prompt twice and ``on_result`` records each outcome
    before the next begins; ``floor`` is the tolerance's floor (:func:`logprob_floor` of the engines'
    dtype). A failure mid-run keeps every result already reported; a
    resumed run repeats only the prompts without a result.

    Raises:
        EngineError: from either engine client.
    """
    done = set(skip)
    todo = [(index, conv) for index, conv in enumerate(conversations) if index not in done]
    if not todo:
        return
    baselines: dict[int, tuple[ChatResult, ChatResult]] = {}
    time.sleep(settle_s)
    for index, conv in todo:
        cold = reference.chat(conv.messages, cache_salt=None, max_tokens=max_tokens, tools=conv.tools)
        control = reference.chat(conv.messages, cache_salt=None, max_tokens=max_tokens, tools=conv.tools)
        baselines[index] = (cold, control)
        on_baseline(index)
    time.sleep(settle_s)
    for index, conv in todo:
        warm = engine.chat(conv.messages, cache_salt=cache_salt, max_tokens=max_tokens, tools=conv.tools)
        again = engine.chat(conv.messages, cache_salt=cache_salt, max_tokens=max_tokens, tools=conv.tools)
        on_result(compare_prompt(index, conv, *baselines[index], warm, again, floor=floor))


def median_or_none(values: list[float]) -> float | None:
    """Median of ``values``, or None when empty."""
    return statistics.median(values) if values else None
