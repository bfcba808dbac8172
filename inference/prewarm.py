"""Prewarm: fill a namespace's caches with representative prompts, then verify.

Pass 1 (fill) sends every prompt once under the namespace's ``cache_salt``.
Then, when the engine has a persistent tier, its in-memory prefix cache is
reset, so that pass 2 (verify) can only hit what the persistent tier holds.
A prompt is verified when pass 2 reports at least as many cached tokens as it
has full KV blocks before its last token: vLLM caches whole blocks only and
always recomputes the last prompt token (measured: 371 prompt tokens with
32-token blocks → 352 cached).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from inference.corpus import Conversation
from inference.engines.vllm_http import ChatResult


class ChatEngine(Protocol):
    """What prewarm and comparison need from an engine client."""

    def chat(
        self, messages: list[dict], *, cache_salt: str | None, max_tokens: int, tools: list[dict] | None = None
    ) -> ChatResult: ...

    def reset_prefix_cache(self) -> None: ...


def expected_cached_tokens(prompt_tokens: int, block_size: int) -> int:
    """Tokens a fully cached prompt reports: whole blocks before the last token."""
    return max(prompt_tokens - 1, 0) // block_size * block_size


@dataclass(frozen=True)
class FillOutcome:
    """Pass-1 result of one prompt."""

    index: int
    conversation_id: str
    prompt_tokens: int
    fill_cached_tokens: int
    expected_cached_tokens: int


@dataclass(frozen=True)
class VerifyOutcome:
    """Pass-2 result of one prompt; ``verified`` is None for an uncacheable
    prompt (shorter than one block)."""

    index: int
    verify_cached_tokens: int
    verified: bool | None


def prewarm_fill(
    engine: ChatEngine,
    conversations: list[Conversation],
    *,
    cache_salt: str,
    block_size: int,
    skip: Iterable[int] = (),
    on_fill: Callable[[FillOutcome], None],
) -> None:
    """Pass 1: send each prompt not in ``skip`` (indices already filled).

    ``on_fill`` is called after each prompt, so the caller can record it
    before the next one starts (a killed run resumes from there).

    Raises:
        EngineError: from the engine client.
    """
    done = set(skip)
    for index, conv in enumerate(conversations):
        if index in done:
            continue
        result = engine.chat(conv.messages, cache_salt=cache_salt, max_tokens=1, tools=conv.tools)
        on_fill(
            FillOutcome(
                index=index,
                conversation_id=conv.id,
                prompt_tokens=result.prompt_tokens,
                fill_cached_tokens=result.cached_tokens,
                expected_cached_tokens=expected_cached_tokens(result.prompt_tokens, block_size),
            )
        )


def prewarm_verify(
    engine: ChatEngine,
    conversations: list[Conversation],
    expected: dict[int, int],
    *,
    cache_salt: str,
    reset_memory: bool,
    skip: Iterable[int] = (),
    on_verify: Callable[[VerifyOutcome], None],
) -> None:
    """Pass 2: re-send each prompt and compare its cached tokens to ``expected``.

    Args:
        expected: index → expected cached tokens (from pass 1).
        reset_memory: reset the engine's in-memory prefix cache first, so the
            pass measures the persistent tier.
        skip: indices already verified by an earlier attempt.

    Raises:
        EngineError: from the engine client.
    """
    if reset_memory:
        engine.reset_prefix_cache()
    done = set(skip)
    for index, conv in enumerate(conversations):
        if index in done:
            continue
        result = engine.chat(conv.messages, cache_salt=cache_salt, max_tokens=1, tools=conv.tools)
        want = expected[index]
        on_verify(
            VerifyOutcome(
                index=index,
                verify_cached_tokens=result.cached_tokens,
                verified=None if want == 0 else result.cached_tokens >= want,
            )
        )
