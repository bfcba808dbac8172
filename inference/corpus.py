"""Diagnostic corpora: JSONL chat conversations used to prewarm and compare.

Each line: ``{"id": str, "note": str, "messages": [...], "tools": [...]?}``
with OpenAI chat messages ending on a user or tool turn. The bundled
``diagnostic`` corpus covers an empty turn, a tool result, several scripts
(CJK, Cyrillic, emoji) and a long conversation whose continuation repeats a
prefix that includes earlier assistant text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.policies import load_policies, messages_for

DATA_DIR = Path(__file__).parent / "data"
#: Bundled corpora by name.
CORPORA: dict[str, Path] = {"diagnostic": DATA_DIR / "diagnostic_corpus.jsonl"}
#: Corpora made from the demo company's policies (:mod:`inference.policies`): name → questions per
#: policy (None: all 156). ``northwind-sample`` is the main job's; ``northwind`` measures noise.
POLICY_CORPORA: dict[str, int | None] = {"northwind": None, "northwind-sample": 1}


@dataclass(frozen=True)
class Conversation:
    """One chat conversation of a corpus."""

    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


#: Keys of an OpenAI chat message, by role (OpenAI Chat Completions API, "messages").
TURN_KEYS: dict[str, frozenset[str]] = {
    "system": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    "assistant": frozenset({"role", "content", "name", "tool_calls"}),
    "tool": frozenset({"role", "content", "tool_call_id"}),
}


def conversation_problem(messages: Any) -> str | None:
    """What makes ``messages`` not a conversation a request would send, or None.

    A non-empty list of OpenAI chat turns: each a JSON object with a known
    ``role``, only the keys that role takes (:data:`TURN_KEYS`), ``content`` a
    string or a list of typed parts (absent or null only on an assistant turn
    with ``tool_calls``), ``name``/``tool_call_id`` strings, ``tool_calls`` a
    list of objects; the last turn a user or tool turn (the prefix a request
    sends). The message names the turn by its index.
    """
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        return "must be a non-empty list of chat turns (JSON objects)"
    for index, turn in enumerate(messages):
        role = turn.get("role")
        if role not in TURN_KEYS:
            return f"turn {index}: role must be one of {', '.join(sorted(TURN_KEYS))}"
        unknown = sorted(set(turn) - TURN_KEYS[role])
        if unknown:
            return f"turn {index}: a {role} turn takes no {unknown[0][:40]!r}"
        content = turn.get("content")
        calls = turn.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            return f"turn {index}: tool_calls must be a list of objects"
        if content is None and not (role == "assistant" and calls):
            return f"turn {index}: content is required (a string or a list of parts)"
        if content is not None and not (
            isinstance(content, str)
            or (isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content))
        ):
            return f"turn {index}: content must be a string or a list of parts with a type"
        for key in ("name", "tool_call_id"):
            if key in turn and not isinstance(turn[key], str):
                return f"turn {index}: {key} must be a string"
    if messages[-1]["role"] not in {"user", "tool"}:
        return "the conversation must end on a user or tool turn (the prefix a request sends)"
    return None


def load_corpus(name: str) -> list[Conversation]:
    """Load a bundled corpus by name.

    Raises:
        ValueError: unknown name, or a malformed line (its number is named).
    """
    if name in POLICY_CORPORA:
        return policy_conversations(load_policies(), per_policy=POLICY_CORPORA[name])
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; known: {', '.join(sorted([*CORPORA, *POLICY_CORPORA]))}")
    return read_corpus(CORPORA[name])


def read_corpus(path: Path) -> list[Conversation]:
    """Parse a JSONL corpus file.

    Raises:
        ValueError: a line that is not a conversation, a duplicate id, or
            messages that :func:`conversation_problem` refuses.
    """
    conversations: list[Conversation] = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            conv = Conversation(
                id=str(raw["id"]), messages=list(raw["messages"]), tools=raw.get("tools"), note=raw.get("note", "")
            )
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a conversation: {exc}") from exc
        if conv.id in seen:
            raise ValueError(f"{path}:{number}: duplicate conversation id {conv.id!r}")
        problem = conversation_problem(conv.messages)
        if problem is not None:
            raise ValueError(f"{path}:{number}: conversation {conv.id!r}: {problem}")
        seen.add(conv.id)
        conversations.append(conv)
    return conversations


def policy_conversations(data: dict[str, Any], *, per_policy: int | None = None) -> list[Conversation]:
    """One conversation per question (the system prompt, then the question), policy by policy: every
    question, or the first ``per_policy`` of each. Ids are ``<policy id>-<question number>`` (from 1),
    and each note says whether the policy changed between the releases."""
    return [
        Conversation(
            id=f"{p['id']}-{n}", messages=messages_for(data, q),
            note=f"{'changed' if p.get('changed') else 'unchanged'} policy {p['id']}",
        )
        for p in data["policies"]
        for n, q in enumerate(p["questions"][:per_policy], start=1)
    ]  # fmt: skip
