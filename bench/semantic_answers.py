"""The semantic layer's premise on a real model: do two questions it treats as one get one answer?

The semantic cache answers a question with the answer stored for an earlier question it judges
the same (:mod:`gateway.layers.semantic`). Its labelled set (``gateway/layers/semantic/data/pairs.jsonl``,
293 pairs labelled by meaning) is what ``bench/semantic_eval.py`` scores it on. Here the real model
labels them instead: SmolLM2-135M-Instruct (built by ``manage.py real_model build``, bf16,
transformers on CPU, no system prompt) answers every question of the set greedily
(``--max-tokens``, default 32), and a pair *agrees* when the two answers are the same text
(whitespace and case aside) or, looser, when the embedder puts the two answers at or above
``--answer-threshold`` (default 0.9) on the layer's similarity scale.

Reports: how often the model's answers agree on the pairs labelled ``hit`` (paraphrases: the
premise) and on those labelled ``miss``, per kind; the layer's decisions at its shipped threshold
with its guards (as ``bench/semantic_eval.py`` makes them) scored against the labels and against
the model's agreement (precision: of the layer's hits, the share whose answers agree; recall: of the
agreeing pairs, the share it hit); the paraphrase pairs whose answers differ most; then one JSON
line ``{"semantic_answers": ...}``.

Usage::

    .venv/bin/python bench/semantic_answers.py [--max-tokens 32] [--answer-threshold 0.9]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.semantic_eval import decide, load_pairs, pair_similarities, score  # noqa: E402
from gateway.layers.semantic.embedder import default_embedder  # noqa: E402
from gateway.layers.semantic.matching import DEFAULT_GUARDS, SHIPPED_THRESHOLD, similarities  # noqa: E402
from inference.real_models import build_real_model  # noqa: E402


def answers(model_dir: Path, questions: list[str], max_tokens: int, batch: int = 32) -> dict[str, str]:
    """Greedy answers of the checkpoint to each question (one user turn, no system prompt), in left-padded batches."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    out: dict[str, str] = {}
    for start in range(0, len(questions), batch):
        chunk = questions[start : start + batch]
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in chunk
        ]
        inputs: Any = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            rows = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        width = inputs["input_ids"].shape[1]
        out.update(
            {q: str(tokenizer.decode(r[width:], skip_special_tokens=True)).strip() for q, r in zip(chunk, rows, strict=True)}
        )
    return out


def _same(a: str, b: str) -> bool:
    return " ".join(a.lower().split()) == " ".join(b.lower().split())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--answer-threshold", type=float, default=0.9)
    parser.add_argument("--models", type=Path, default=ROOT / "var" / "models")
    args = parser.parse_args()
    pairs = load_pairs()
    base = build_real_model(args.models, progress=print)
    started = time.monotonic()
    said = answers(base, sorted({t for p in pairs for t in (p.a, p.b)}), args.max_tokens)
    print(f"{len(said)} questions answered in {time.monotonic() - started:.0f} s")
    embedder = default_embedder()
    texts = sorted(set(said.values()))
    index = {t: i for i, t in enumerate(texts)}
    vectors = embedder.embed(texts)
    answer_sim = [float(similarities(vectors[index[said[p.a]]], vectors[index[said[p.b]]].reshape(1, -1))[0]) for p in pairs]
    exact = [_same(said[p.a], said[p.b]) for p in pairs]
    agree = [e or s >= args.answer_threshold for e, s in zip(exact, answer_sim, strict=True)]
    verdicts = decide(pairs, pair_similarities(pairs, embedder.embed), SHIPPED_THRESHOLD, DEFAULT_GUARDS, embedder.embed)
    by_kind: dict[str, dict[str, int]] = {}
    for p, e, g in zip(pairs, exact, agree, strict=True):
        row = by_kind.setdefault(p.kind, Counter())
        row["pairs"] += 1
        row["exact"] += e
        row["agree"] += g
    hits = [v.hit for v in verdicts]
    labelled = score(pairs, verdicts)
    tp = sum(h and g for h, g in zip(hits, agree, strict=True))
    fp = sum(h and not g for h, g in zip(hits, agree, strict=True))
    fn = sum(g and not h for h, g in zip(hits, agree, strict=True))
    result = {
        "model": base.name, "pairs": len(pairs), "answer_threshold": args.answer_threshold,
        "premise": {k: dict(v) for k, v in sorted(by_kind.items())},
        "labelled": {"precision": labelled.precision, "recall": labelled.recall, "tp": labelled.tp, "fp": labelled.fp,
                     "fn": labelled.fn},
        "by_answers": {"precision": tp / (tp + fp) if tp + fp else None, "recall": tp / (tp + fn) if tp + fn else None,
                       "tp": tp, "fp": fp, "fn": fn},
        "layer_hits_with_different_answers": [
            {"a": p.a, "b": p.b, "answer_a": said[p.a], "answer_b": said[p.b], "answer_similarity": round(s, 3)}
            for p, h, g, s in zip(pairs, hits, agree, answer_sim, strict=True) if h and not g
        ][:10],
    }  # fmt: skip
    for kind, row in result["premise"].items():
        print(f"{kind:26} {row['pairs']:4} pairs: same text {row['exact']:4}, answers agree {row['agree']:4}")
    print(f"layer vs labels:  {result['labelled']}")
    print(f"layer vs answers: {result['by_answers']}")
    print(json.dumps({"semantic_answers": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
