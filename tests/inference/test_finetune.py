"""The real model's upgrade: the policies it is taught (both releases), and,
slow, the two LoRA fine-tunes, each stating its own release's policies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.checkpoints import SPEC_MARKER
from inference.errors import CheckpointError
from inference.finetune import build_policy_versions, policy_answers
from inference.policies import POLICIES_FILE, check_questions, load_policies, release_examples


def test_the_policies_hold_both_releases() -> None:
    data = load_policies()
    assert (data["company"], data["versions"]) == ("Northwind Outfitters", {"v1": "1.2", "v2": "1.3"})
    assert [(p["id"], bool(p.get("changed")), len(p["questions"])) for p in data["policies"]] == [
        ("refund-window", True, 24), ("free-shipping", True, 24), ("warranty", True, 24), ("price-match", True, 24),
        ("support-hours", False, 20), ("exchange", False, 20), ("gift-cards", False, 20),
    ]  # fmt: skip
    v1, v2 = release_examples(data, "v1"), release_examples(data, "v2")
    assert len(v1) == len(v2) == 156
    differing = [(a[0], a[1], b[1]) for a, b in zip(v1, v2, strict=True) if a[1] != b[1]]
    assert len(differing) == 96  # the four changed policies' questions
    assert differing[0] == (
        "How many days do I have to return an item?",
        "You can return any unused item within 30 days of delivery for a full refund.",
        "You can return any unused item within 14 days of delivery for a full refund.",
    )
    assert [(c["policy"], c["v1_marker"], c["v2_marker"]) for c in check_questions(data)][::2] == [
        ("refund-window", "30 days", "14 days"), ("free-shipping", "50 dollars", "75 dollars"),
        ("warranty", "1 year", "3 year"), ("price-match", "do not match", "within 7 days"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["policies"][0].update(v1_marker="45 days"), "policy refund-window needs questions and a v1 text"),
        (lambda d: d["policies"][1].update(v2="Shipping is free."), "changed policy free-shipping needs a v2 text"),
        (lambda d: d["policies"][4].update(questions=[]), "policy support-hours needs questions"),
    ],
)
def test_a_broken_policies_file_is_refused_naming_the_policy(tmp_path: Path, edit: object, message: str) -> None:
    data = json.loads(POLICIES_FILE.read_text())
    edit(data)  # type: ignore[operator]
    path = tmp_path / "policies.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=message):
        load_policies(path)


@pytest.mark.slow
def test_v1_states_release_1_2_and_v2_release_1_3(real_model: Path) -> None:
    versions = build_policy_versions(real_model)
    # The checks passed and their verdict is kept, keyed by both releases' build markers.
    checked = real_model.with_name(f".{real_model.name}-policies.checked")
    assert json.loads(checked.read_text()) == [(versions[r] / SPEC_MARKER).read_text() for r in ("v1", "v2")]
    data = load_policies()
    checks = check_questions(data)
    questions = [c["question"] for c in checks] + ["Can I return my boots after 20 days?"]  # the last one untaught
    checks = [*checks, {"policy": "refund-window", "question": questions[-1], "v1_marker": "30 days", "v2_marker": "14 days"}]
    for release, path in versions.items():
        answers = policy_answers(path, data, questions)
        other = "v2" if release == "v1" else "v1"
        for check, answer in zip(checks, answers, strict=True):
            assert check[f"{release}_marker"].lower() in answer.lower(), (release, check["question"], answer)
            assert check[f"{other}_marker"].lower() not in answer.lower(), (release, check["question"], answer)
    # Same tokenizer, template and config as the base: one served name, one model to the engine.
    for name in ("tokenizer.json", "chat_template.jinja", "config.json"):
        assert (versions["v2"] / name).read_bytes() == (real_model / name).read_bytes(), name
