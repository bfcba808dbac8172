"""A request's block hashes as the engine will compute them: tokenized with the
model version's own tokenizer and chat template (loaded once per version, off
the request path), hashed with the engine's scheme and the namespace's salt
(:mod:`inference.block_hashes`).

A request whose tokens the gateway cannot reproduce exactly is *unpredictable*
and routed by affinity instead, with the reason: images or audio in it
(multimodal blocks carry keys from the processor), options that change the
rendered prompt (``continue_final_message``, ``chat_template``,
``chat_template_kwargs``, ``documents``, ``add_generation_prompt`` false),
several prompts in one completions request, or a tokenizer not loaded (yet).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from inference.block_hashes import HashScheme, UnpredictableHashes, block_hashes
from inference.corpus import Conversation
from inference.errors import CheckpointError
from inference.tokenization import ChatEncodingError, ChatTokenizer, MistralChatTokenizer, load_chat_tokenizer

log = logging.getLogger("gateway")

#: Chat request fields that change the rendered prompt in ways not reproduced here.
RENDER_OPTIONS: Final = ("continue_final_message", "chat_template", "chat_template_kwargs", "documents", "mm_processor_kwargs")


@dataclass(frozen=True)
class Prediction:
    """A request's tokens, or why there are none.

    Attributes:
        token_ids: the prompt as the engine tokenizes it (empty when ``reason`` is set).
        reason: why the request is unpredictable, or None.
    """

    token_ids: tuple[int, ...] = ()
    reason: str | None = None

    def hashes(self, scheme: HashScheme, cache_salt: str | None, *, limit: int | None = None) -> list[int]:
        """The event-form hashes of the prompt's full blocks (see :func:`inference.block_hashes.block_hashes`).

        Raises:
            UnpredictableHashes: the scheme's algorithm cannot be reproduced.
        """
        return block_hashes(self.token_ids, scheme, cache_salt=cache_salt, limit=limit)


class Tokenizers:
    """Model versions' chat tokenizers, by checkpoint path, loaded on a thread of
    their own (a tokenizer loads in 0.1-1 s; a request never waits for one)."""

    def __init__(self) -> None:
        self._loaded: dict[str, ChatTokenizer | None] = {}
        self._loading: set[str] = set()
        self._lock = threading.Lock()

    def get(self, path: str, *, wait: bool = False) -> ChatTokenizer | None:
        """The tokenizer of ``path`` when loaded; else None, and its loading starts
        (``wait``: load it now, on this thread, as ``gateway explain`` does)."""
        found = self._loaded.get(path)
        if found is not None or path in self._loaded:
            return found
        if wait:
            return self.load(path)
        with self._lock:
            if path in self._loading:
                return None
            self._loading.add(path)
        threading.Thread(target=self.load, args=(path,), name="tokenizer-load", daemon=True).start()
        return None

    def load(self, path: str) -> ChatTokenizer | None:
        """Load ``path`` now (None when it cannot be: the version is then routed by affinity)."""
        try:
            tokenizer: ChatTokenizer | None = load_chat_tokenizer(Path(path))
            if isinstance(tokenizer, MistralChatTokenizer):
                tokenizer.drop_text_round_trip()  # this instance only encodes
        except CheckpointError as exc:
            log.warning("routing by affinity for %s: its tokenizer cannot be loaded: %s", path, exc)
            tokenizer = None
        with self._lock:
            self._loaded[path] = tokenizer
            self._loading.discard(path)
        return tokenizer


def _multimodal(messages: Any) -> bool:
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(isinstance(p, Mapping) and p.get("type") not in (None, "text") for p in content):
            return True
    return False


def _text_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Messages with text parts joined, as vLLM renders a list of text parts for a string template."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        out.append({**message, "content": content})
    return out


def predict(tokenizer: ChatTokenizer | None, endpoint: str, payload: Mapping[str, Any]) -> Prediction:
    """The tokens of ``payload`` (what the engine gets) as the engine computes them.

    Args:
        tokenizer: the version's tokenizer, or None (not loaded).
        endpoint: ``"chat"`` or ``"completions"``.
        payload: the request body sent to the engine.
    """
    if tokenizer is None:
        return Prediction(reason="tokenizer_not_loaded")
    try:
        if endpoint == "chat":
            messages = payload.get("messages")
            if not isinstance(messages, list) or not messages:
                return Prediction(reason="no_messages")
            if _multimodal(messages):
                return Prediction(reason="multimodal")
            if any(payload.get(k) for k in RENDER_OPTIONS) or payload.get("add_generation_prompt", True) is not True:
                return Prediction(reason="render_options")
            conversation = Conversation(id="route", messages=_text_messages(messages), tools=payload.get("tools"))
            return Prediction(tuple(tokenizer.encode_chat(conversation)))
        prompt = payload.get("prompt")
        special = payload.get("add_special_tokens", True) is not False
        if isinstance(prompt, str):
            return Prediction(tuple(tokenizer.encode_text(prompt, add_special_tokens=special)))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return Prediction(tuple(prompt))
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return Prediction(tuple(tokenizer.encode_text(prompt[0], add_special_tokens=special)))
        return Prediction(reason="several_prompts")
    except (ChatEncodingError, UnpredictableHashes, ValueError, TypeError, KeyError) as exc:
        log.debug("unpredictable request: %s", exc)
        return Prediction(reason="tokenizer_refused")
