"""Serialized model inputs: the diagnostic tokenization diff names the exact first
difference between real tokenizer versions, and the digest moves with the ids only.

Expected values are computed here with mistral_common and tokenizers directly,
not with the code under test.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import struct
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import blake3
import pytest
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from inference.checkpoints import mistral_common_tokenizer_path
from inference.corpus import Conversation, load_corpus
from inference.errors import CheckpointError
from inference.identity import frame
from inference.tokenization import (
    MARK_CLOSE,
    MARK_OPEN,
    ChatEncodingError,
    ChatTokenizer,
    ConversationDiff,
    MistralChatTokenizer,
    load_chat_tokenizer,
    serialized_inputs_digest,
    summary,
    tokenization_diff,
)

CORPUS = load_corpus("diagnostic")
BY_ID = {c.id: c for c in CORPUS}
MC_VERSION = metadata.version("mistral_common")
TRANSFORMERS_VERSION = metadata.version("transformers")


@functools.cache
def chat(name: str) -> ChatTokenizer:
    """A mistral_common tokenizer through the code under test (loaded once per run)."""
    return load_chat_tokenizer(mistral_common_tokenizer_path(name))


@functools.cache
def reference(name: str) -> MistralTokenizer:
    return MistralTokenizer.from_file(str(mistral_common_tokenizer_path(name)))


def reference_ids(name: str, conv: Conversation) -> list[int] | str:
    """Token ids straight from mistral_common, or its error message."""
    try:
        request = ChatCompletionRequest.from_openai(copy.deepcopy(conv.messages), tools=copy.deepcopy(conv.tools))
        return reference(name).encode_chat_completion(request).tokens
    except Exception as exc:
        return str(exc)


def reference_decode(name: str, ids: list[int]) -> str:
    return reference(name).instruct_tokenizer.tokenizer.decode(ids, special_token_policy=SpecialTokenPolicy.KEEP) if ids else ""


def reference_diff(name_a: str, name_b: str, conv: Conversation, window: int = 8) -> ConversationDiff:
    """What the diff of one conversation must be, from mistral_common alone."""
    a, b = reference_ids(name_a, conv), reference_ids(name_b, conv)
    if isinstance(a, str) or isinstance(b, str):
        errors = []
        for side, name, ids in (("a", name_a, a), ("b", name_b, b)):
            if isinstance(ids, str):
                errors.append(f"{side}: {chat(name).describe()} cannot encode conversation {conv.id!r}: {ids}")
        return ConversationDiff(
            conv.id,
            "error",
            None if isinstance(a, str) else len(a),
            None if isinstance(b, str) else len(b),
            error="; ".join(errors),
        )
    at = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
    if a == b:
        return ConversationDiff(conv.id, "equal", len(a), len(b))
    lo = max(0, at - window)
    return ConversationDiff(
        conversation_id=conv.id,
        status="different",
        length_a=len(a),
        length_b=len(b),
        first_difference=at,
        window_a=f"{reference_decode(name_a, a[lo:at])}⟦{reference_decode(name_a, a[at : at + window])}⟧",
        window_b=f"{reference_decode(name_b, b[lo:at])}⟦{reference_decode(name_b, b[at : at + window])}⟧",
        ids_a_window=tuple(a[lo : at + window]),
        ids_b_window=tuple(b[lo : at + window]),
    )


def diff_by_id(name_a: str, name_b: str) -> dict[str, ConversationDiff]:
    diffs = tokenization_diff(chat(name_a), chat(name_b), CORPUS)
    assert [d.conversation_id for d in diffs] == [c.id for c in CORPUS]
    assert diffs == [reference_diff(name_a, name_b, c) for c in CORPUS]
    return {d.conversation_id: d for d in diffs}


def mistral_checkpoint(tmp_path: Path, name: str) -> Path:
    """A model directory as the demo builds them: config.json plus the tokenizer under vLLM's name."""
    source = mistral_common_tokenizer_path(name)
    target = tmp_path / f"ckpt-{name}"
    target.mkdir()
    (target / "config.json").write_text('{"model_type": "mistral"}')
    shutil.copyfile(
        source, target / ("tekken.json" if source.suffix == ".json" else f"tokenizer.model.{source.name.rsplit('.', 1)[-1]}")
    )
    return target


# --- mistral_common tokenizers -------------------------------------------------


@pytest.mark.parametrize(
    ("name", "description"),
    [("v7", "SentencePiece v7 (tokenizer.model.v7)"), ("tekken-240911", "Tekken v3 (tekken.json)")],
)
def test_same_tokenizer_as_file_and_as_checkpoint_is_equal_everywhere(tmp_path: Path, name: str, description: str) -> None:
    from_dir = load_chat_tokenizer(mistral_checkpoint(tmp_path, name))
    diffs = tokenization_diff(chat(name), from_dir, CORPUS)
    assert [(d.conversation_id, d.status, d.length_a, d.length_b) for d in diffs] == [
        (c.id, "equal", len(reference_ids(name, c)), len(reference_ids(name, c))) for c in CORPUS
    ]
    assert all(d.first_difference is None and d.window_a == d.window_b == "" and d.error == "" for d in diffs)
    assert summary(diffs) == {"total": 9, "equal": 9, "different": 0, "error": 0, "identical": True}
    assert serialized_inputs_digest(chat(name), CORPUS) == serialized_inputs_digest(from_dir, CORPUS)
    assert from_dir.describe() == f"mistral_common {MC_VERSION} {description}"


def test_v3_vs_v7_differs_at_the_system_prompt_token() -> None:
    diffs = diff_by_id("v3", "v7")
    assert {d.status for d in diffs.values()} == {"different"}
    assert {d.first_difference for d in diffs.values()} == {1}
    billing = diffs["billing-en"]
    # Equal lengths, different content: v7 wraps the system prompt in its own control tokens.
    assert (billing.length_a, billing.length_b) == (1526, 1526)
    assert (billing.ids_a_window[1], billing.ids_b_window[1]) == (3, 16)
    assert billing.window_a == "<s>⟦[INST]▁You▁are▁the▁support▁assistant▁of▁North⟧"
    assert billing.window_b == "<s>⟦[SYSTEM_PROMPT]▁You▁are▁the▁support▁assistant▁of▁North⟧"
    assert diffs["tool-result"].window_a.startswith("<s>⟦[AVAILABLE_TOOLS]")
    assert summary(list(diffs.values())) == {"total": 9, "equal": 0, "different": 9, "error": 0, "identical": False}


def test_v1_vs_v3_differs_at_inst_and_v1_cannot_encode_tools() -> None:
    diffs = diff_by_id("v1", "v3")
    billing = diffs["billing-en"]
    assert (billing.first_difference, billing.length_a, billing.length_b) == (1, 1531, 1526)
    # v1 writes [INST] as plain text pieces; v3 has a control token for it.
    assert billing.ids_a_window[:4] == (1, 733, 16289, 28793)
    assert billing.window_a.startswith("<s>⟦▁[INST]▁You")
    assert billing.window_b.startswith("<s>⟦[INST]▁You")
    tool = diffs["tool-result"]
    assert (tool.status, tool.length_a, tool.length_b, tool.first_difference) == ("error", None, 1726, None)
    assert tool.error == (
        f"a: mistral_common {MC_VERSION} SentencePiece v1 (tokenizer.model.v1) cannot encode conversation 'tool-result': "
        "Tools not implemented for tokenizer V1"
    )
    assert summary(list(diffs.values())) == {"total": 9, "equal": 0, "different": 8, "error": 1, "identical": False}


def test_sentencepiece_vs_tekken_differs_in_control_token_ids_and_spacing() -> None:
    diffs = diff_by_id("v3", "tekken-240911")
    tool = diffs["tool-result"]
    # Same control token, different id: the text alone would hide this difference.
    assert tool.first_difference == 1
    assert (tool.ids_a_window[1], tool.ids_b_window[1]) == (6, 5)
    assert tool.window_a.startswith("<s>⟦[AVAILABLE_TOOLS]") and tool.window_b.startswith("<s>⟦[AVAILABLE_TOOLS]")
    billing = diffs["billing-en"]
    assert billing.first_difference == 2
    assert billing.window_a == "<s>[INST]⟦▁You▁are▁the▁support▁assistant▁of▁Northwind⟧"
    assert billing.window_b == "<s>[INST]⟦You are the support assistant of Northwind⟧"


def test_v2_vs_v3_differs_only_deep_in_the_tool_conversation() -> None:
    diffs = diff_by_id("v2", "v3")
    assert [cid for cid, d in diffs.items() if d.status != "equal"] == ["tool-result"]
    tool = diffs["tool-result"]
    assert (tool.first_difference, tool.length_a, tool.length_b) == (1626, 1703, 1726)
    assert f"{MARK_OPEN}}}}}]</s>[TOOL_RESULTS]" in tool.window_a  # v2 closes the call and sends the result
    assert f'{MARK_OPEN}}},▁"id":▁"a1B' in tool.window_b  # v3 writes the call id first
    assert len(tool.ids_a_window) == len(tool.ids_b_window) == 16


def test_digest_is_blake3_of_labelled_id_frames_sorted_by_conversation() -> None:
    hasher = blake3.blake3(frame("kind", b"kvcp-serialized-inputs/v1"))
    for cid in sorted(BY_ID):
        ids = reference_ids("v3", BY_ID[cid])
        hasher.update(frame("conversation", cid.encode()) + frame("token_ids", b"".join(struct.pack(">I", i) for i in ids)))
    assert serialized_inputs_digest(chat("v3"), CORPUS) == hasher.hexdigest()
    assert serialized_inputs_digest(chat("v3"), CORPUS[::-1]) == hasher.hexdigest()


def test_digest_follows_the_ids_not_the_files() -> None:
    # Two Tekken releases that serialize this corpus identically.
    assert serialized_inputs_digest(chat("tekken-240718"), CORPUS) == serialized_inputs_digest(chat("tekken-240911"), CORPUS)
    assert serialized_inputs_digest(chat("v2"), CORPUS) != serialized_inputs_digest(chat("v3"), CORPUS)
    without_tools = [c for c in CORPUS if c.id != "tool-result"]
    assert serialized_inputs_digest(chat("v2"), without_tools) == serialized_inputs_digest(chat("v3"), without_tools)


def test_digest_refuses_what_it_cannot_vouch_for() -> None:
    with pytest.raises(ChatEncodingError) as info:
        serialized_inputs_digest(chat("v1"), CORPUS)
    assert info.value.conversation_id == "tool-result"
    with pytest.raises(ValueError, match="^no conversations to digest$"):
        serialized_inputs_digest(chat("v3"), [])
    with pytest.raises(ValueError, match="^duplicate conversation id 'cjk-zh'$"):
        serialized_inputs_digest(chat("v3"), [BY_ID["cjk-zh"], BY_ID["cjk-zh"]])
    with pytest.raises(ValueError, match="^window must be at least 1 token, got 0$"):
        tokenization_diff(chat("v3"), chat("v3"), CORPUS, window=0)


def with_tool_call_id(conv: Conversation, call_id: str) -> Conversation:
    messages = copy.deepcopy(conv.messages)
    messages[2]["tool_calls"][0]["id"] = call_id
    messages[3]["tool_call_id"] = call_id
    return Conversation(id=conv.id, messages=messages, tools=conv.tools)


def test_long_tool_call_ids_are_cut_to_nine_characters_and_bad_ones_refused() -> None:
    tool = BY_ID["tool-result"]
    # An OpenAI-style id: vLLM keeps its last 9 characters, which are the corpus's id.
    assert chat("v3").encode_chat(with_tool_call_id(tool, "call_a1B2c3D4e")) == reference_ids("v3", tool)
    assert tool.messages[2]["tool_calls"][0]["id"] == "a1B2c3D4e"  # the corpus is not modified
    with pytest.raises(ChatEncodingError) as info:
        chat("v3").encode_chat(with_tool_call_id(tool, "call-1"))
    assert str(info.value) == (
        f"mistral_common {MC_VERSION} SentencePiece v3 (mistral_instruct_tokenizer_240323.model.v3) cannot encode "
        "conversation 'tool-result': Tool call id was call-1 but must be a-z, A-Z, 0-9, with a length of 9."
    )


def test_loader_errors_name_the_path(tmp_path: Path) -> None:
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    cases = {
        empty: f"{empty} holds no tokenizer: expected tekken.json, tokenizer.model.v* or tokenizer.json",
        tmp_path / "missing": f"{tmp_path / 'missing'} does not exist",
        empty
        / "config.json": f"{empty / 'config.json'} is not a tokenizer file: expected tekken*.json, *.model.v* or tokenizer.json",
    }
    for path, message in cases.items():
        with pytest.raises(CheckpointError) as info:
            load_chat_tokenizer(path)
        assert str(info.value) == message
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.model.v3").write_bytes(b"not a sentencepiece model")
    with pytest.raises(CheckpointError, match="cannot be read as a mistral_common tokenizer: ") as info:
        load_chat_tokenizer(broken)
    assert str(info.value).startswith(f"{broken / 'tokenizer.model.v3'} cannot be read")


# --- HF tokenizer.json checkpoints ------------------------------------------------

SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|human|>", "<|assistant|>", "<|tool|>", "<|tools|>", "<|end|>"]
#: @USER@ is the one marker two variants differ by; @PROMPT@ the generation prompt.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }} {% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}@USER@{% else %}<|{{ m.role }}|>{% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }} days = {{ c.function.arguments.days }}{% endfor %}"
    "<|end|>{% endfor %}"
    "{% if add_generation_prompt %}@PROMPT@{% endif %}"
)
TEMPLATE_A = TEMPLATE.replace("@USER@", "<|user|>").replace("@PROMPT@", "<|assistant|>")


@pytest.fixture(scope="module")
def hf_tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A WordLevel tokenizer.json trained on the corpus text, markers as special tokens."""
    texts = []
    for conv in CORPUS:
        for message in conv.messages:
            texts.append(message.get("content") or "")
            texts += [f"{c['function']['name']} {c['function']['arguments']}" for c in message.get("tool_calls") or []]
        texts.append(json.dumps(conv.tools or []))
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts + ["days = 7"], trainers.WordLevelTrainer(special_tokens=SPECIALS))
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture
def hf_checkpoint(tmp_path: Path, hf_tokenizer_json: Path) -> Callable[..., Path]:
    def make(name: str, template: str | None, *, jinja_file: bool = False) -> Path:
        target = tmp_path / name
        target.mkdir()
        shutil.copyfile(hf_tokenizer_json, target / "tokenizer.json")
        config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}
        if template is not None and jinja_file:
            (target / "chat_template.jinja").write_text(template)
        elif template is not None:
            config["chat_template"] = template
        (target / "tokenizer_config.json").write_text(json.dumps(config))
        return target

    return make


def wordlevel_ids(tokenizer_json: Path, text: str) -> list[int]:
    return Tokenizer.from_file(str(tokenizer_json)).encode(text).ids


def test_hf_encoding_is_the_rendered_template_tokenized(hf_checkpoint: Callable[..., Path], hf_tokenizer_json: Path) -> None:
    tokenizer = load_chat_tokenizer(hf_checkpoint("a", TEMPLATE_A) / "tokenizer.json")
    conv = BY_ID["tool-result"]
    system, user, _, result = (m["content"] for m in conv.messages)
    # Tool call arguments reach the template as an object (days = 7), and the generation prompt closes it.
    text = (
        f"<s><|tools|>get_bucket_usage <|end|><|system|>{system}<|end|><|user|>{user}<|end|>"
        f"<|assistant|>get_bucket_usage days = 7<|end|><|tool|>{result}<|end|><|assistant|>"
    )
    assert tokenizer.encode_chat(conv) == wordlevel_ids(hf_tokenizer_json, text)
    assert tokenizer.describe() == f"HF tokenizer.json (a, transformers {TRANSFORMERS_VERSION})"


def test_hf_identical_copies_and_template_file_are_equal(hf_checkpoint: Callable[..., Path]) -> None:
    a = load_chat_tokenizer(hf_checkpoint("a", TEMPLATE_A))
    for other in (hf_checkpoint("copy", TEMPLATE_A), hf_checkpoint("jinja", TEMPLATE_A, jinja_file=True)):
        b = load_chat_tokenizer(other)
        diffs = tokenization_diff(a, b, CORPUS)
        assert summary(diffs) == {"total": 9, "equal": 9, "different": 0, "error": 0, "identical": True}
        assert serialized_inputs_digest(a, CORPUS) == serialized_inputs_digest(b, CORPUS)


def test_hf_one_marker_changed_gives_the_exact_first_difference(
    hf_checkpoint: Callable[..., Path], hf_tokenizer_json: Path
) -> None:
    a = load_chat_tokenizer(hf_checkpoint("a", TEMPLATE_A))
    b = load_chat_tokenizer(hf_checkpoint("b", TEMPLATE_A.replace("<|user|>", "<|human|>")))
    diffs = {d.conversation_id: d for d in tokenization_diff(a, b, CORPUS)}
    system = CORPUS[0].messages[0]["content"]
    # Every conversation shares the system prompt; the first user marker comes right after it.
    at = len(wordlevel_ids(hf_tokenizer_json, f"<s><|system|>{system}<|end|>"))
    at_tools = len(wordlevel_ids(hf_tokenizer_json, f"<s><|tools|>get_bucket_usage <|end|><|system|>{system}<|end|>"))
    assert {cid: d.first_difference for cid, d in diffs.items()} == {c.id: at_tools if c.tools else at for c in CORPUS}
    assert all(d.status == "different" and d.length_a == d.length_b for d in diffs.values())
    billing = diffs["billing-en"]
    assert billing.window_a.split(MARK_OPEN)[1].startswith("<|user|> How much would")
    assert billing.window_b.split(MARK_OPEN)[1].startswith("<|human|> How much would")
    assert billing.window_a.split(MARK_OPEN)[0] == billing.window_b.split(MARK_OPEN)[0]
    assert billing.window_a.split(MARK_OPEN)[0].endswith("in the ticket . <|end|>")
    assert len(billing.ids_a_window) == 16


def test_hf_strict_prefix_differs_at_the_shorter_length(hf_checkpoint: Callable[..., Path], hf_tokenizer_json: Path) -> None:
    with_prompt = load_chat_tokenizer(hf_checkpoint("a", TEMPLATE_A))
    without_prompt = load_chat_tokenizer(hf_checkpoint("d", TEMPLATE_A.replace("<|assistant|>{% endif %}", "{% endif %}")))
    assistant_id = Tokenizer.from_file(str(hf_tokenizer_json)).token_to_id("<|assistant|>")
    diffs = tokenization_diff(with_prompt, without_prompt, CORPUS, window=3)
    for d in diffs:
        assert d.status == "different"
        assert d.first_difference == d.length_b == d.length_a - 1
        assert d.window_a.endswith(f"{MARK_OPEN}<|assistant|>{MARK_CLOSE}")
        assert d.window_b.endswith(f"<|end|>{MARK_OPEN}{MARK_CLOSE}")
        assert d.ids_a_window == (*d.ids_b_window, assistant_id) and len(d.ids_b_window) == 3
    # Swapping the sides swaps the windows.
    swapped = tokenization_diff(without_prompt, with_prompt, CORPUS[:1], window=3)[0]
    first = diffs[0]
    assert (swapped.first_difference, swapped.length_a, swapped.length_b) == (first.length_b, first.length_b, first.length_a)
    assert (swapped.window_a, swapped.window_b) == (first.window_b, first.window_a)


def test_hf_without_chat_template_is_refused(hf_checkpoint: Callable[..., Path]) -> None:
    path = hf_checkpoint("plain", None)
    with pytest.raises(CheckpointError) as info:
        load_chat_tokenizer(path)
    assert str(info.value) == (
        f"{path} has an HF tokenizer.json but no chat template "
        "(no 'chat_template' in tokenizer_config.json, no chat_template.jinja)"
    )


def test_hf_template_refusing_tools_is_a_per_conversation_error(hf_checkpoint: Callable[..., Path]) -> None:
    a = load_chat_tokenizer(hf_checkpoint("a", TEMPLATE_A))
    no_tools = "{% if tools %}{{ raise_exception('this template has no tool format') }}{% endif %}" + TEMPLATE_A
    b = load_chat_tokenizer(hf_checkpoint("no-tools", no_tools))
    diffs = {d.conversation_id: d for d in tokenization_diff(a, b, CORPUS)}
    tool = diffs["tool-result"]
    assert (tool.status, tool.length_b, tool.first_difference) == ("error", None, None)
    assert tool.length_a == len(a.encode_chat(BY_ID["tool-result"]))
    assert tool.error == (
        f"b: HF tokenizer.json (no-tools, transformers {TRANSFORMERS_VERSION}) cannot encode conversation 'tool-result': "
        "this template has no tool format"
    )
    assert summary(list(diffs.values())) == {"total": 9, "equal": 8, "different": 0, "error": 1, "identical": False}


@pytest.mark.parametrize("name", ["v3", "v7", "tekken-240911"])
def test_dropping_the_text_round_trip_leaves_every_id_as_it_was(name: str) -> None:
    fast = load_chat_tokenizer(mistral_common_tokenizer_path(name))
    assert isinstance(fast, MistralChatTokenizer)
    fast.drop_text_round_trip()
    for conv in CORPUS:
        try:
            want = chat(name).encode_chat(conv)
        except ChatEncodingError as exc:
            with pytest.raises(ChatEncodingError, match=re.escape(str(exc).split(": ", 1)[-1][:40])):
                fast.encode_chat(conv)
            continue
        assert fast.encode_chat(conv) == want == reference_ids(name, conv), conv.id
    # Its text is what is dropped: mistral_common decodes every encoding back into Tokenized._text.
    request = ChatCompletionRequest.from_openai([{"role": "user", "content": "Bonjour"}])
    assert fast._mistral.encode_chat_completion(request).text == ""  # type: ignore[attr-defined]
    assert reference(name).encode_chat_completion(request).text != ""
