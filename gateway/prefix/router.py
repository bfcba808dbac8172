"""Precise prefix routing: each engine of the namespace scored by the run of the
request's leading blocks it holds (its KV events say so, :mod:`gateway.prefix.index`),
weighted by medium, against its load.

For a request of ``n`` full blocks, engine ``e`` holding a run of ``h_e``
leading blocks of weight ``w_e`` (:func:`gateway.prefix.index.weighted`) and
carrying ``load_e`` requests::

    cost(e) = (n - w_e) + load_weight * load_e * max(n, 1)

that is the blocks it must compute, plus the work queued ahead of the request
in the same unit (each request in flight counted as one more of this size,
``load_weight`` of it: by default a quarter, since a queued request's
prefill overlaps others' decoding, and each request moved off the engine
holding its prefix copies that prefix into a second cache, where under
pressure it evicts another's; measured in ``bench/affinity.py``: at 0.5
precise balanced the engines 47/53 but computed as many tokens as affinity,
at 0.25 0.82x of them at 55/45, at 0.1 0.65x at 70/30). The cheapest engine
wins. Ties go to the
rendezvous hash of the request's first block that no engine holds (its
*divergence block*; the prompt's leading text when it has no full block), so
templates that share a long common preamble (company rules, tool
definitions) spread over the engines by what follows it, each template's
requests staying together, where the approximate choice's 512 leading
characters would send them all to one engine.

Like llm-d's precise prefix-cache scorer (which scores pods by the longest
cached prefix of vLLM's own block hashes, cache_salt included) combined with
its load scorers, and Dynamo's KV router (tier weights: device 1.0, host
0.75, disk 0.25; cost = prefill blocks + decode load).

When no engine's index is usable (none published, older than the staleness
limit, a stream with a gap) or the request is unpredictable
(:mod:`gateway.prefix.predict`), the approximate choice stands, and the
decision says why.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gateway.prefix.index import BlockIndex, confirmed, weighted
from gateway.prefix.predict import Prediction, Tokenizers, predict
from gateway.routing import EngineTarget, NamespaceTarget, choose_engine, prompt_affinity_text, rendezvous_score
from inference.block_hashes import HashScheme, UnpredictableHashes

#: Routing modes a decision reports (the ``x-kvcp-routing`` header, the metric's ``mode`` label).
PRECISE, APPROXIMATE = "precise", "approximate"
#: Default weight of an engine's load against its cached blocks (see the module docstring).
LOAD_WEIGHT: Final = 0.25


@dataclass(frozen=True)
class Scored:
    """One candidate engine's score.

    Attributes:
        engine: the engine.
        blocks: leading blocks of the request it holds (any medium, speculative entries included).
        confirmed: of those, the ones its own KV events confirm (the rest are speculative entries').
        weight: those blocks weighted by medium.
        load: requests in flight there (this process's count, or the engine's own when larger).
        cost: :func:`cost` (lower wins).
        index: why its index was not used (``no_index``, ``stale``, ``incomplete``), or None.
    """

    engine: EngineTarget
    blocks: int
    weight: float
    load: int
    cost: float
    index: str | None = None
    confirmed: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (``gateway explain``)."""
        return {"engine": self.engine.name, "engine_id": self.engine.id, "cached_blocks": self.blocks,
                "confirmed_blocks": self.confirmed, "weighted_blocks": round(self.weight, 3), "load": self.load,
                "cost": round(self.cost, 3), "index": self.index or "used"}  # fmt: skip


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why.

    Attributes:
        engine: the chosen engine.
        mode: :data:`PRECISE` or :data:`APPROXIMATE`.
        reason: why the approximate choice stood (``unpredictable:<why>``, ``index:<why>``,
            ``hash_scheme``), None for a precise one.
        blocks: the request's full blocks (0 when unpredictable).
        block_size: tokens per block of the chosen engine (0 when unknown).
        predicted_blocks: leading blocks the chosen engine was predicted to hold (its KV events'
            and its live speculative entries', which yield to its events: :meth:`BlockIndex.held`).
        prompt_tokens: the predicted prompt length (0 when unpredictable).
        candidates: every candidate's score, best first (empty for an approximate choice).
    """

    engine: EngineTarget
    mode: str
    reason: str | None = None
    blocks: int = 0
    block_size: int = 0
    predicted_blocks: int = 0
    prompt_tokens: int = 0
    candidates: tuple[Scored, ...] = field(default_factory=tuple)

    @property
    def predicted_cached_tokens(self) -> int:
        """Prompt tokens the engine should report as cached: the predicted blocks, of which the
        prompt's last token is never one (vLLM computes it again to produce the first output)."""
        if not self.block_size or not self.prompt_tokens:
            return 0
        return min(self.predicted_blocks, (self.prompt_tokens - 1) // self.block_size) * self.block_size

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (``gateway explain``, records)."""
        return {"engine": self.engine.name, "mode": self.mode, "reason": self.reason, "blocks": self.blocks,
                "predicted_cached_tokens": self.predicted_cached_tokens,
                "candidates": [c.as_dict() for c in self.candidates]}  # fmt: skip


def cost(blocks: int, weight: float, load: int, load_weight: float) -> float:
    """See the module docstring: blocks to compute plus queued work, in blocks."""
    return (blocks - weight) + load_weight * load * max(blocks, 1)


def scheme_of(engine: EngineTarget) -> HashScheme | None:
    """The engine's :class:`HashScheme` from its verified facts, or None when they are unknown or unreproducible."""
    if engine.block_size < 1 or not engine.hash_algorithm:
        return None
    try:
        return HashScheme(engine.block_size, engine.hash_algorithm)
    except UnpredictableHashes:
        return None


class PrefixRouter:
    """The precise choice of one gateway process.

    Args:
        index: this process's block index mirror.
        tokenizers: the versions' tokenizers.
        load_weight: see :data:`LOAD_WEIGHT`.
    """

    def __init__(self, index: BlockIndex, tokenizers: Tokenizers | None = None, *, load_weight: float = LOAD_WEIGHT) -> None:
        self.index, self.tokenizers, self.load_weight = index, tokenizers or Tokenizers(), load_weight
        #: Engine id -> requests running and waiting as its own metrics last said (None: not read).
        self.engine_load: dict[int, int] = {}

    def prediction(self, ns: NamespaceTarget, endpoint: str, payload: Mapping[str, Any], *, wait: bool = False) -> Prediction:
        """The request's tokens (the version's tokenizer, loaded in the background on first use, or now with ``wait``)."""
        if not ns.tokenizer_path:
            return Prediction(reason="no_tokenizer")
        return predict(self.tokenizers.get(ns.tokenizer_path, wait=wait), endpoint, payload)

    def decide(
        self, ns: NamespaceTarget, engines: Sequence[EngineTarget], endpoint: str, payload: Mapping[str, Any],
        in_flight: Mapping[int, int], *, speculate: bool = True,
    ) -> Decision:  # fmt: skip
        """Choose among ``engines`` (non-empty) for ``payload``; see the module docstring.

        Args:
            speculate: mark the request's blocks as held by the winner (live traffic); off for ``explain``,
                which also loads the tokenizer before deciding rather than fall back while it loads.
        """
        affinity = prompt_affinity_text(payload)

        def approximate(reason: str) -> Decision:
            return Decision(choose_engine(engines, affinity, in_flight), APPROXIMATE, reason)

        prediction = self.prediction(ns, endpoint, payload, wait=not speculate)
        if prediction.reason is not None:
            return approximate(f"unpredictable:{prediction.reason}")
        now_wall, now = time.time(), time.monotonic()
        usable = {e.id: self.index.usable(e.id, now_wall) for e in engines}
        if all(why is not None for why in usable.values()):
            return approximate(f"index:{sorted(set(usable.values()))[0]}")  # type: ignore[type-var]
        hashes_of: dict[HashScheme, list[int]] = {}
        scored = []
        for engine in engines:
            scheme = scheme_of(engine)
            if scheme is None:
                return approximate("hash_scheme")
            if scheme not in hashes_of:
                hashes_of[scheme] = prediction.hashes(scheme, ns.cache_salt)
            hashes = hashes_of[scheme]
            held = self.index.held(engine.id, hashes, now) if usable[engine.id] is None else []
            load = max(in_flight.get(engine.id, 0), self.engine_load.get(engine.id, 0))
            w = weighted(held)
            scored.append(Scored(engine, len(held), w, load, cost(len(hashes), w, load, self.load_weight),
                                 usable[engine.id], confirmed(held)))  # fmt: skip
        deepest = max(s.blocks for s in scored)
        tie_key = affinity
        if hashes_of:
            first = next(iter(hashes_of.values()))
            if first:
                tie_key = format(first[min(deepest, len(first) - 1)], "x")
        scored.sort(key=lambda s: (s.cost, -rendezvous_score(tie_key, s.engine)))
        best = scored[0]
        hashes = hashes_of[scheme_of(best.engine)]  # type: ignore[index]
        if speculate and hashes:
            self.index.speculate(best.engine.id, hashes, now)
        return Decision(best.engine, PRECISE, None, len(hashes), best.engine.block_size, best.blocks,
                        len(prediction.token_ids), tuple(scored))  # fmt: skip
