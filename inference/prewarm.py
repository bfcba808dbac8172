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

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from inference.corpus import Conversation
from inference.engines.vllm_http import ChatResult


class ChatEngine(Protocol):
    """What prewarm and comparison need from an engine client."""

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        cache_salt: str | None,
        max_tokens: int,
        tools: list[dict[str, Any]] | None = None,
    ) -> ChatResult: ...

    def reset_prefix_cache(self) -> None: ...


R = TypeVar("R")

#: Prompts in flight at once by default. Measured with bench/prewarm.py on
#: 2 cores: one at a time filled 100 prompts at 25-33 req/s, eight in flight
#: at 49-63 req/s (the engine batches concurrent prefills), four at 46.5.
DEFAULT_CONCURRENCY = 4


def in_heat_order(
    indices: Sequence[int], send: Callable[[int], R], handle: Callable[[int, R], None], *, concurrency: int
) -> None:
    """``send`` each index with up to ``concurrency`` in flight, submitted in
    the given (heat) order, and ``handle`` each result on the caller's thread
    in that same order (so a caller can record it in its own database
    connection, and a killed run resumes after the last recorded one).

    The first exception (from ``send`` or ``handle``) stops submitting; the
    requests in flight are left to finish and the exception is raised.
    """
    if concurrency <= 1:
        for index in indices:
            handle(index, send(index))
        return
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="prewarm") as pool:
        # Everything is queued at once in heat order: the pool keeps exactly
        # ``concurrency`` in flight, and one slow answer at the head does not
        # leave the others' slots empty while it is awaited.
        futures: list[tuple[int, Future[R]]] = [(index, pool.submit(send, index)) for index in indices]
        try:
            for index, future in futures:
                handle(index, future.result())
        except BaseException:
            for _, future in futures:
                future.cancel()
            raise


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
    concurrency: int = DEFAULT_CONCURRENCY,
) -> None:
    """Pass 1: send each prompt not in ``skip`` (indices already filled), hottest
    first, up to ``concurrency`` at once (:func:`in_heat_order`).

    ``on_fill`` is called on this thread for each prompt in order, so the
    caller can record it (a killed run resumes after the recorded ones).

    Raises:
        EngineError: from the engine client.
    """
    done = set(skip)

    def send(index: int) -> ChatResult:
        conv = conversations[index]
        return engine.chat(conv.messages, cache_salt=cache_salt, max_tokens=1, tools=conv.tools)

    def handle(index: int, result: ChatResult) -> None:
        on_fill(
            FillOutcome(
                index=index,
                conversation_id=conversations[index].id,
                prompt_tokens=result.prompt_tokens,
                fill_cached_tokens=result.cached_tokens,
                expected_cached_tokens=expected_cached_tokens(result.prompt_tokens, block_size),
            )
        )

    in_heat_order([i for i in range(len(conversations)) if i not in done], send, handle, concurrency=concurrency)


def prewarm_verify(
    engine: ChatEngine,
    conversations: list[Conversation],
    expected: dict[int, int],
    *,
    cache_salt: str,
    reset_memory: bool,
    skip: Iterable[int] = (),
    on_verify: Callable[[VerifyOutcome], None],
    concurrency: int = DEFAULT_CONCURRENCY,
) -> None:
    """Pass 2: re-send each prompt and compare its cached tokens to ``expected``,
    up to ``concurrency`` at once, results handled in order on this thread.

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

    def send(index: int) -> ChatResult:
        conv = conversations[index]
        return engine.chat(conv.messages, cache_salt=cache_salt, max_tokens=1, tools=conv.tools)

    def handle(index: int, result: ChatResult) -> None:
        want = expected[index]
        on_verify(
            VerifyOutcome(
                index=index,
                verify_cached_tokens=result.cached_tokens,
                verified=None if want == 0 else result.cached_tokens >= want,
            )
        )

    in_heat_order([i for i in range(len(conversations)) if i not in done], send, handle, concurrency=concurrency)
