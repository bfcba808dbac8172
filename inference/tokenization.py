"""Serialized model inputs and the diagnostic tokenization diff.

Before a cache is reused across two model versions (a ``verified_reuse``
release), the release must show that the serialized model inputs of the
diagnostic corpus (chat template applied, token ids) are identical under both
versions: KV blocks are keyed on token ids, so a different serialization means
every cached prefix belongs to another input.

Two kinds of tokenizers are served, chosen the way the engine chooses them:

- Mistral tokenizer files (``tekken.json``, ``tokenizer.model.v*``), whose
  chat format is rendered in ``mistral_common`` code, not from a template.
  The engine launcher starts vLLM in ``tokenizer_mode="mistral"`` whenever a
  checkpoint holds one (:mod:`inference.engines.launcher`).
- HF ``tokenizer.json`` checkpoints, whose chat format is the Jinja
  ``chat_template`` of ``tokenizer_config.json`` (or ``chat_template.jinja``),
  rendered by ``transformers``.

:func:`tokenization_diff` compares two tokenizers conversation by
conversation; :func:`serialized_inputs_digest` condenses one tokenizer's
serialized corpus into a digest that can be stored as evidence and compared
cheaply.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from inference.comparison import first_divergence
from inference.corpus import Conversation
from inference.errors import CheckpointError
from inference.identity import digest_frames
from inference.paths import is_mistral_tokenizer_file

# mistral_common (with pydantic, numpy, jsonschema, PIL, requests behind it) and
# transformers are imported where a tokenizer is loaded or used, not here: this
# module is reached at app load (cacheadmin.tasks -> services.releases), and
# mistral_common alone cost ~0.5 s (measured 470-770 ms) of every manage.py
# process (CLI command, worker) that never touches a tokenizer.
if TYPE_CHECKING:
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from transformers import PreTrainedTokenizerFast

#: Digest format version of :func:`serialized_inputs_digest`; bump when its encoding changes.
SERIALIZED_INPUTS_SCHEME = "kvcp-serialized-inputs/v1"
#: Tokens shown on each side of a first difference.
DEFAULT_WINDOW = 8
#: Brackets around the part of a diff window from the first difference on.
MARK_OPEN = "⟦"
MARK_CLOSE = "⟧"
#: vLLM keeps the last 9 characters of longer tool call ids before a Mistral
#: tokenizer sees them (``truncate_tool_call_ids`` in vLLM 0.32
#: ``vllm/tokenizers/mistral.py``, called by ``vllm/renderers/online_renderer.py``).
MISTRAL_TOOL_CALL_ID_LENGTH = 9

DiffStatus = Literal["equal", "different", "error"]


class ChatEncodingError(ValueError):
    """A tokenizer cannot serialize one conversation (e.g. tool calls on a
    SentencePiece v1 tokenizer, which has no tool format). The message names
    the tokenizer, the conversation and the reason."""

    def __init__(self, tokenizer: str, conversation_id: str, reason: str) -> None:
        self.tokenizer = tokenizer
        self.conversation_id = conversation_id
        self.reason = reason
        super().__init__(f"{tokenizer} cannot encode conversation {conversation_id!r}: {reason}")


@runtime_checkable
class ChatTokenizer(Protocol):
    """A tokenizer with its chat format: turns a conversation into the exact
    token ids the model reads."""

    def encode_chat(self, conversation: Conversation) -> list[int]:
        """Token ids of the conversation with the chat format applied and a
        generation prompt for the assistant's next turn.

        Raises:
            ChatEncodingError: this tokenizer cannot serialize the conversation.
        """
        ...

    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a plain prompt as the engine's completions endpoint tokenizes it
        (``add_special_tokens`` is that request field, default true there)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with control tokens written out (``[INST]``, ``<s>``...)."""
        ...

    def describe(self) -> str:
        """One line naming the tokenizer kind, version and file."""
        ...


class MistralChatTokenizer:
    """A tokenizer file shipped for ``mistral_common`` (SentencePiece
    ``*.model.v*`` or Tekken ``tekken*.json``), encoded the way vLLM's mistral
    tokenizer mode does it: ``ChatCompletionRequest.from_openai`` then
    ``MistralTokenizer.encode_chat_completion`` in validation mode ``test``
    (vLLM 0.32 ``vllm/tokenizers/mistral.py`` through transformers'
    ``MistralCommonBackend.apply_chat_template``)."""

    def __init__(self, path: Path) -> None:
        """Load ``path``.

        Raises:
            CheckpointError: the file cannot be parsed as a mistral_common tokenizer.
        """
        # Lazy: start-up cost of every CLI/worker process (see the note on the imports above).
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        try:
            self._mistral: MistralTokenizer[Any, Any, Any, Any, Any] = MistralTokenizer.from_file(str(path))
        # The parsers behind from_file (sentencepiece's C++ loader, json,
        # tiktoken, mistral_common's own checks) raise unrelated exception types.
        except Exception as exc:
            raise CheckpointError(f"{path} cannot be read as a mistral_common tokenizer: {exc}") from exc
        self.path = path
        inner = self._mistral.instruct_tokenizer.tokenizer
        kind = "Tekken" if isinstance(inner, Tekkenizer) else "SentencePiece"
        self._description = f"mistral_common {metadata.version('mistral_common')} {kind} {inner.version.value} ({path.name})"

    def encode_chat(self, conversation: Conversation) -> list[int]:
        """See :meth:`ChatTokenizer.encode_chat`. mistral_common's formats have
        no separate generation prompt: the ids end on the last user or tool
        turn (e.g. ``[/INST]``), where the assistant's reply begins.

        Raises:
            ChatEncodingError: mistral_common refuses the conversation (its
                message names why, e.g. ``Tools not implemented for tokenizer V1``).
        """
        # Loaded already by __init__; local for the start-up cost of every CLI/worker process.
        from mistral_common.exceptions import MistralCommonException
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        messages = _truncate_tool_call_ids(copy.deepcopy(conversation.messages))
        try:
            request = ChatCompletionRequest.from_openai(messages, tools=copy.deepcopy(conversation.tools))
            return [int(i) for i in self._mistral.encode_chat_completion(request).tokens]
        # mistral_common stops on malformed input with assertions as well as
        # its own exceptions (vLLM's renderers/mistral.py catches the same);
        # pydantic's ValidationError is a ValueError.
        except (MistralCommonException, AssertionError, ValueError, KeyError, TypeError) as exc:
            raise ChatEncodingError(self.describe(), conversation.id, str(exc)) from exc

    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """See :meth:`ChatTokenizer.encode_text`: mistral_common's ``encode(text, bos=add_special_tokens,
        eos=False)``, as vLLM 0.32's ``MistralTokenizer.encode`` (``vllm/tokenizers/mistral.py``)."""
        inner = self._mistral.instruct_tokenizer.tokenizer
        return [int(i) for i in inner.encode(text, bos=add_special_tokens, eos=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """See :meth:`ChatTokenizer.decode`. SentencePiece text comes back as
        pieces (``▁`` marks a space, ``<0xE6>`` a byte), which is how
        mistral_common writes text when it keeps control tokens; it also
        keeps a leading space visible, which plain decoding drops."""
        # Loaded already by __init__; local for the start-up cost of every CLI/worker process.
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        if not ids:
            return ""
        return self._mistral.instruct_tokenizer.tokenizer.decode(list(ids), special_token_policy=SpecialTokenPolicy.KEEP)

    def drop_text_round_trip(self) -> None:
        """Stop :meth:`encode_chat` decoding its ids back to text.

        mistral_common 1.13's ``encode_instruct`` decodes every token list it
        has just encoded into ``Tokenized._text`` ("TODO: remove once 1.13.0
        lands", ``mistral_common/tokens/tokenizers/instruct.py``), which
        nothing here reads: for a 1,000-token prompt it is a third of the
        encoding's time (1.1 of 3.0 ms at p50, ``bench/routing_cost.py``).
        The ids are unchanged. For an instance of its own only (the gateway's
        router loads one per version): its ``_text`` is then empty.
        """
        self._mistral.instruct_tokenizer.decode = _no_text  # type: ignore[method-assign]

    def describe(self) -> str:
        """E.g. ``"mistral_common 1.13.1 SentencePiece v3 (tokenizer.model.v3)"``."""
        return self._description


class HFChatTokenizer:
    """An HF checkpoint's ``tokenizer.json`` with its Jinja chat template,
    rendered by ``transformers`` with ``add_generation_prompt=True``."""

    def __init__(self, directory: Path) -> None:
        """Load the tokenizer of ``directory``.

        ``PreTrainedTokenizerFast.from_pretrained`` (local files only) rather
        than the bare constructor: it turns ``added_tokens_decoder`` entries of
        ``tokenizer_config.json`` into added tokens and reads
        ``chat_template.jinja``, as the engine's own loading does.

        Raises:
            CheckpointError: the files cannot be read, or no chat template is set.
        """
        from transformers import PreTrainedTokenizerFast

        try:
            self._hf: PreTrainedTokenizerFast = PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
        # transformers and tokenizers raise OSError, ValueError, Exception
        # (tokenizers' Rust errors) and more for unreadable files.
        except Exception as exc:
            raise CheckpointError(f"{directory / 'tokenizer.json'} cannot be read as an HF tokenizer: {exc}") from exc
        if not self._hf.chat_template:
            raise CheckpointError(
                f"{directory} has an HF tokenizer.json but no chat template "
                "(no 'chat_template' in tokenizer_config.json, no chat_template.jinja)"
            )
        self.path = directory
        self._description = f"HF tokenizer.json ({directory.name}, transformers {metadata.version('transformers')})"

    def encode_chat(self, conversation: Conversation) -> list[int]:
        """See :meth:`ChatTokenizer.encode_chat`.

        Tool call arguments are handed to the template as JSON objects, as
        vLLM does for every HF chat template (``_postprocess_messages`` in
        vLLM 0.32 ``vllm/renderers/chat_utils.py``).

        Raises:
            ChatEncodingError: the template fails on the conversation (e.g. it
                calls ``raise_exception`` for tools it does not support).
        """
        from jinja2 import TemplateError

        messages = _tool_call_arguments_as_objects(copy.deepcopy(conversation.messages))
        try:
            ids = self._hf.apply_chat_template(
                messages,
                # transformers types tools as list[dict | Callable] (an invariant list: a list[dict[str, Any]] is refused).
                tools=copy.deepcopy(conversation.tools),  # type: ignore[arg-type]
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
        except (TemplateError, ValueError, KeyError, TypeError) as exc:
            raise ChatEncodingError(self.describe(), conversation.id, str(exc)) from exc
        # transformers types the result as any of str, list[int], list[str], list[list[int]] and BatchEncoding;
        # with tokenize=True and return_dict=False it is one conversation's list of ids.
        return [int(i) for i in ids]  # type: ignore[arg-type]

    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """See :meth:`ChatTokenizer.encode_text`: the HF tokenizer's ``encode``, as vLLM's renderer calls it."""
        return [int(i) for i in self._hf.encode(text, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int]) -> str:
        """See :meth:`ChatTokenizer.decode`."""
        text = self._hf.decode(list(ids), skip_special_tokens=False)
        assert isinstance(text, str)  # one flat list of ids decodes to one string
        return text

    def describe(self) -> str:
        """E.g. ``"HF tokenizer.json (my-model, transformers 5.19.0)"``."""
        return self._description


def _no_text(tokens: list[int], special_token_policy: Any = None) -> str:
    """An empty text in place of a decoding nobody reads (:meth:`MistralChatTokenizer.drop_text_round_trip`)."""
    return ""


def load_chat_tokenizer(path: Path) -> ChatTokenizer:
    """Load the chat tokenizer of a checkpoint directory or a tokenizer file.

    A directory holding ``tekken.json`` or ``tokenizer.model.v*`` is served by
    mistral_common, even when it also holds a ``tokenizer.json`` (the engine
    launcher starts vLLM in mistral mode then); among several such files
    mistral_common's ``get_one_valid_tokenizer_file`` picks the one vLLM
    loads (``tekken.json`` first). Otherwise a ``tokenizer.json`` is loaded
    with ``transformers``. A file is mistral_common's when mistral_common
    recognises it (``tekken*.json``, ``*.model``, ``*.model.v*``); a file
    named ``tokenizer.json`` stands for its directory.

    Callers confine user-given paths to the model roots first
    (:func:`inference.paths.resolve_checkpoint_dir`); mistral_common's bundled
    tokenizer files live outside them.

    Raises:
        CheckpointError: the path does not exist, holds no tokenizer, names a
            file that is not a tokenizer, a file that cannot be parsed, or an
            HF tokenizer without a chat template.
    """
    # Lazy: start-up cost of every CLI/worker process (see the note on the imports above).
    from mistral_common.tokens.tokenizers.sentencepiece import is_sentencepiece
    from mistral_common.tokens.tokenizers.tekken import is_tekken
    from mistral_common.tokens.tokenizers.utils import get_one_valid_tokenizer_file

    path = Path(path)
    if path.is_dir():
        names = sorted(p.name for p in path.iterdir() if p.is_file())
        mistral = [n for n in names if is_mistral_tokenizer_file(n)]
        if mistral:
            try:
                chosen = get_one_valid_tokenizer_file(mistral)
            except ValueError as exc:
                raise CheckpointError(
                    f"{path} holds no tokenizer file mistral_common can read among {', '.join(mistral)}"
                ) from exc
            return MistralChatTokenizer(path / chosen)
        if "tokenizer.json" in names:
            return HFChatTokenizer(path)
        raise CheckpointError(f"{path} holds no tokenizer: expected tekken.json, tokenizer.model.v* or tokenizer.json")
    if path.is_file():
        if is_tekken(path) or is_sentencepiece(path):
            return MistralChatTokenizer(path)
        if path.name == "tokenizer.json":
            return HFChatTokenizer(path.parent)
        raise CheckpointError(f"{path} is not a tokenizer file: expected tekken*.json, *.model.v* or tokenizer.json")
    raise CheckpointError(f"{path} does not exist")


def _truncate_tool_call_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keep the last :data:`MISTRAL_TOOL_CALL_ID_LENGTH` characters of tool call
    ids, as vLLM does before a Mistral tokenizer sees them (in place; returned)."""
    n = MISTRAL_TOOL_CALL_ID_LENGTH
    for message in messages:
        if message.get("role") == "assistant":
            for call in message.get("tool_calls") or []:
                if isinstance(call, dict) and isinstance(call.get("id"), str) and len(call["id"]) > n:
                    call["id"] = call["id"][-n:]
        elif message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            if isinstance(call_id, str) and len(call_id) > n:
                message["tool_call_id"] = call_id[-n:]
    return messages


def _tool_call_arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parse tool call ``arguments`` into JSON objects for HF templates (in
    place; returned), with vLLM's rules: empty ``tool_calls`` are dropped,
    missing, empty, malformed or non-object arguments become ``{}``."""
    for message in messages:
        if message.get("role") != "assistant" or not isinstance(message.get("tool_calls"), list):
            continue
        if not message["tool_calls"]:
            message.pop("tool_calls")
            continue
        for call in message["tool_calls"]:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            arguments = function.get("arguments")
            if isinstance(arguments, str) and arguments:
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    arguments = None
            function["arguments"] = arguments if isinstance(arguments, dict) else {}
    return messages


@dataclass(frozen=True)
class ConversationDiff:
    """How one conversation serializes under tokenizers ``a`` and ``b``.

    ``status`` is ``"equal"`` (same ids), ``"different"`` or ``"error"`` (one
    or both tokenizers cannot serialize it; ``error`` says why, per side).
    ``length_a``/``length_b`` are token counts (``None`` for a side that
    failed). ``first_difference`` is the index of the first differing token;
    when one sequence is a strict prefix of the other it is the shorter
    length. ``window_a``/``window_b`` decode up to ``window`` tokens before the
    first difference and up to ``window`` tokens from it on, the latter
    between :data:`MARK_OPEN` and :data:`MARK_CLOSE` (empty brackets: that
    side ends there); ``ids_a_window``/``ids_b_window`` are those token ids.
    """

    conversation_id: str
    status: DiffStatus
    length_a: int | None
    length_b: int | None
    first_difference: int | None = None
    window_a: str = ""
    window_b: str = ""
    ids_a_window: tuple[int, ...] = field(default_factory=tuple)
    ids_b_window: tuple[int, ...] = field(default_factory=tuple)
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        """All fields as JSON-ready data (id windows as lists)."""
        data = asdict(self)
        data["ids_a_window"] = list(self.ids_a_window)
        data["ids_b_window"] = list(self.ids_b_window)
        return data


def _window(tokenizer: ChatTokenizer, ids: list[int], at: int, window: int) -> tuple[str, tuple[int, ...]]:
    start, end = max(0, at - window), min(len(ids), at + window)
    text = tokenizer.decode(ids[start:at]) + MARK_OPEN + tokenizer.decode(ids[at:end]) + MARK_CLOSE
    return text, tuple(ids[start:end])


def _encode(tokenizer: ChatTokenizer, conversation: Conversation) -> list[int] | ChatEncodingError:
    try:
        return tokenizer.encode_chat(conversation)
    except ChatEncodingError as exc:
        return exc


def tokenization_diff(
    a: ChatTokenizer, b: ChatTokenizer, conversations: Sequence[Conversation], *, window: int = DEFAULT_WINDOW
) -> list[ConversationDiff]:
    """Compare how two tokenizers serialize each conversation.

    Args:
        a, b: the tokenizers of the two model versions.
        conversations: e.g. ``load_corpus("diagnostic")``.
        window: tokens shown on each side of a first difference (>= 1).

    Returns:
        One :class:`ConversationDiff` per conversation, in the given order. A
        conversation a tokenizer cannot serialize is reported with status
        ``"error"`` and ``error`` = ``"a: <message>"`` and/or ``"b: <message>"``
        joined by ``"; "``; the others are still compared.

    Raises:
        ValueError: ``window`` < 1.
    """
    if window < 1:
        raise ValueError(f"window must be at least 1 token, got {window}")
    diffs: list[ConversationDiff] = []
    for conversation in conversations:
        ids_a, ids_b = _encode(a, conversation), _encode(b, conversation)
        if isinstance(ids_a, ChatEncodingError) or isinstance(ids_b, ChatEncodingError):
            errors = [f"{side}: {ids}" for side, ids in (("a", ids_a), ("b", ids_b)) if isinstance(ids, ChatEncodingError)]
            diffs.append(
                ConversationDiff(
                    conversation_id=conversation.id,
                    status="error",
                    length_a=None if isinstance(ids_a, ChatEncodingError) else len(ids_a),
                    length_b=None if isinstance(ids_b, ChatEncodingError) else len(ids_b),
                    error="; ".join(errors),
                )
            )
            continue
        at = first_divergence(ids_a, ids_b)
        if at is None:
            diffs.append(ConversationDiff(conversation.id, "equal", len(ids_a), len(ids_b)))
            continue
        window_a, ids_a_window = _window(a, ids_a, at, window)
        window_b, ids_b_window = _window(b, ids_b, at, window)
        diffs.append(
            ConversationDiff(
                conversation_id=conversation.id,
                status="different",
                length_a=len(ids_a),
                length_b=len(ids_b),
                first_difference=at,
                window_a=window_a,
                window_b=window_b,
                ids_a_window=ids_a_window,
                ids_b_window=ids_b_window,
            )
        )
    return diffs


def serialized_inputs_digest(tokenizer: ChatTokenizer, conversations: Sequence[Conversation]) -> str:
    """BLAKE3 digest of a corpus's serialized model inputs under one tokenizer.

    Frames (:func:`inference.identity.frame`), conversations sorted by id (the
    evidence is about a set of conversations, not a file's line order):
    ``conversation`` = the id in UTF-8, ``token_ids`` = the ids as 4-byte
    big-endian unsigned integers, under the kind :data:`SERIALIZED_INPUTS_SCHEME`.
    Two tokenizers give the same digest exactly when every conversation
    serializes to the same ids, even if their files differ.

    Returns:
        64-char lowercase hex.

    Raises:
        ChatEncodingError: a conversation cannot be serialized (no digest can
            vouch for inputs that do not exist).
        ValueError: no conversations, or a duplicate conversation id.
    """
    if not conversations:
        raise ValueError("no conversations to digest")
    ids_by_id: dict[str, list[int]] = {}
    for conversation in conversations:
        if conversation.id in ids_by_id:
            raise ValueError(f"duplicate conversation id {conversation.id!r}")
        ids_by_id[conversation.id] = tokenizer.encode_chat(conversation)
    frames: list[tuple[str, bytes]] = []
    for conversation_id in sorted(ids_by_id):
        ids = ids_by_id[conversation_id]
        frames += [("conversation", conversation_id.encode("utf-8")), ("token_ids", struct.pack(f">{len(ids)}I", *ids))]
    return digest_frames(SERIALIZED_INPUTS_SCHEME, frames)


def summary(diffs: Sequence[ConversationDiff]) -> dict[str, Any]:
    """Counts of a diff by status.

    Returns:
        ``{"total": n, "equal": n, "different": n, "error": n, "identical":
        bool}``; ``identical`` holds when there is at least one conversation
        and all are equal (an empty corpus proves nothing).
    """
    counts = {status: sum(1 for d in diffs if d.status == status) for status in ("equal", "different", "error")}
    return {"total": len(diffs), **counts, "identical": bool(diffs) and counts["equal"] == len(diffs)}
