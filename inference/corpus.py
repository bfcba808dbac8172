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

DATA_DIR = Path(__file__).parent / "data"
#: Bundled corpora by name.
CORPORA: dict[str, Path] = {"diagnostic": DATA_DIR / "diagnostic_corpus.jsonl"}


@dataclass(frozen=True)
class Conversation:
    """One chat conversation of a corpus."""

    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def load_corpus(name: str) -> list[Conversation]:
    """Load a bundled corpus by name.

    Raises:
        ValueError: unknown name, or a malformed line (its number is named).
    """
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; known: {', '.join(sorted(CORPORA))}")
    return read_corpus(CORPORA[name])


def read_corpus(path: Path) -> list[Conversation]:
    """Parse a JSONL corpus file.

    Raises:
        ValueError: a line that is not a conversation, a duplicate id, or a
            conversation that does not end on a user or tool turn.
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
        if not conv.messages or conv.messages[-1].get("role") not in {"user", "tool"}:
            raise ValueError(f"{path}:{number}: conversation {conv.id!r} must end on a user or tool turn")
        seen.add(conv.id)
        conversations.append(conv)
    return conversations
