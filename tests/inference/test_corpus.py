"""Which chat conversations a corpus or a prefix-heat report may hold."""

from __future__ import annotations

import pytest

from inference.corpus import conversation_problem, load_corpus
from inference.policies import load_policies

USER = {"role": "user", "content": "Refund status?"}


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([], "must be a non-empty list of chat turns (JSON objects)"),
        ("hello", "must be a non-empty list of chat turns (JSON objects)"),
        ([USER, 7], "must be a non-empty list of chat turns (JSON objects)"),
        ([{"role": "robot", "content": "x"}], "turn 0: role must be one of assistant, system, tool, user"),
        ([{"role": "user"}], "turn 0: content is required (a string or a list of parts)"),
        ([{"role": "user", "content": 5}], "turn 0: content must be a string or a list of parts with a type"),
        ([{"role": "user", "content": [{"text": "x"}]}], "turn 0: content must be a string or a list of parts with a type"),
        ([{"role": "user", "content": "x", "extra": 1}], "turn 0: a user turn takes no 'extra'"),
        ([{"role": "system", "content": "x", "tool_calls": []}, USER], "turn 0: a system turn takes no 'tool_calls'"),
        ([USER, {"role": "assistant", "tool_calls": "f"}, USER], "turn 1: tool_calls must be a list of objects"),
        ([USER, {"role": "assistant", "content": None}, USER], "turn 1: content is required (a string or a list of parts)"),
        ([{"role": "tool", "content": "42", "tool_call_id": 3}], "turn 0: tool_call_id must be a string"),
        ([{"role": "user", "content": "x", "name": ["a"]}], "turn 0: name must be a string"),
        (
            [USER, {"role": "assistant", "content": "x"}],
            "the conversation must end on a user or tool turn (the prefix a request sends)",
        ),
    ],
)
def test_a_malformed_conversation_is_named_by_turn(messages: object, problem: str) -> None:
    assert conversation_problem(messages) == problem


def test_what_requests_send_is_a_conversation() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert (
        conversation_problem(
            [USER, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": "1", "tool_call_id": "c1"}]
        )
        is None
    )
    assert conversation_problem([{"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"}]) is None
    assert conversation_problem([{"role": "user", "content": ""}]) is None
    assert all(conversation_problem(c.messages) is None for c in load_corpus("diagnostic"))


def test_the_northwind_corpora_ask_every_policy_question_under_the_store_s_system_prompt() -> None:
    data = load_policies()
    everything, sample = load_corpus("northwind"), load_corpus("northwind-sample")
    assert len(everything) == sum(len(p["questions"]) for p in data["policies"]) == 156
    assert [c.id for c in sample] == [
        "refund-window-1", "free-shipping-1", "warranty-1", "price-match-1", "support-hours-1", "exchange-1",
        "gift-cards-1",
    ]  # fmt: skip
    first = sample[0]
    assert first.messages == [
        {"role": "system", "content": data["system"]},
        {"role": "user", "content": "How many days do I have to return an item?"},
    ]
    assert (first.note, sample[-1].note) == ("changed policy refund-window", "unchanged policy gift-cards")
    assert len({c.id for c in everything}) == 156 and all(conversation_problem(c.messages) is None for c in everything)


def test_an_unknown_corpus_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError) as refused:
        load_corpus("northwind-all")
    assert str(refused.value) == "unknown corpus 'northwind-all'; known: diagnostic, northwind, northwind-sample"
