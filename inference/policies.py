"""The demo company's customer-service policies, in two releases, and the
questions customers ask about them (``inference/data/northwind_policies.json``).

Northwind Outfitters' release 1.2 and 1.3 differ in four policies (the refund
window, the free-shipping threshold, the tent warranty, price matching); three
are unchanged. Each policy has 20-24 customer questions. They teach the demo's
real model its releases (:mod:`inference.finetune`) and make the ``northwind``
corpora (:func:`policy_conversations`) that prewarm and compare it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

from inference.errors import CheckpointError

#: The policies, both releases, and the questions customers ask about them.
POLICIES_FILE: Final = Path(__file__).parent / "data" / "northwind_policies.json"


def load_policies(path: Path = POLICIES_FILE) -> dict[str, Any]:
    """The policies file, checked: every policy has an id, its release-1.2 text and marker, questions, and a
    changed one its 1.3 text and marker (markers must occur in their texts).

    Raises:
        CheckpointError: the file cannot be read or breaks one of those rules (the message names the policy).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("policies"), list):
        raise CheckpointError(f"{path}: an object with a list of policies is expected")
    for p in data["policies"]:
        pid = p.get("id", "?")
        if not p.get("questions") or p.get("v1_marker", "\0") not in p.get("v1", ""):
            raise CheckpointError(f"{path}: policy {pid} needs questions and a v1 text holding its v1_marker")
        if p.get("changed") and p.get("v2_marker", "\0") not in p.get("v2", ""):
            raise CheckpointError(f"{path}: changed policy {pid} needs a v2 text holding its v2_marker")
    return data


def release_examples(data: dict[str, Any], release: str) -> list[tuple[str, str]]:
    """``(question, answer)`` pairs teaching ``release`` (``"v1"`` or ``"v2"``): each question answered
    with its policy's text in that release (an unchanged policy keeps its v1 text)."""
    return [(q, p[release] if release in p else p["v1"]) for p in data["policies"] for q in p["questions"]]


def check_questions(data: dict[str, Any], per_policy: int = 2) -> list[dict[str, str]]:
    """The questions whose answers tell the releases apart: the first ``per_policy`` of each changed policy."""
    return [
        {"policy": p["id"], "question": q, "v1_marker": p["v1_marker"], "v2_marker": p["v2_marker"]}
        for p in data["policies"]
        if p.get("changed")
        for q in p["questions"][:per_policy]
    ]


def messages_for(data: dict[str, Any], question: str) -> list[dict[str, str]]:
    """A chat request for one question: the store's system prompt, then the question."""
    return [{"role": "system", "content": data["system"]}, {"role": "user", "content": question}]
