"""The semantic cache as the gateway uses it: admission, lookup (embed, search
the request's partition, judge candidates on the one similarity scale with
the guards) and storing an answer."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from gateway.layers.semantic.admission import DEFAULT_RULES, Rule, semantic_admission
from gateway.layers.semantic.entries import SemanticEntry, StoreUnavailable
from gateway.layers.semantic.matching import DEFAULT_GUARDS, SHIPPED_THRESHOLD, match
from gateway.layers.semantic.store import SemanticStore


class SemanticLayer:
    """One process's semantic layer over a shared store.

    Args:
        store: the entry store (shared by every gateway process).
        embedder: an object with ``embed(texts) -> ndarray (n, dim)`` (L2-normalized rows) and ``model_id``.
        threshold: the similarity a hit needs when the tenant's policy sets none (0..1).
        rules: admission rules (answers that depend on time, comparison, prediction bypass).
        guards: the guards every candidate must pass.
        k: candidates judged per lookup, best first.
    """

    #: What the gateway catches to bypass the layer when the store is down.
    Unavailable = StoreUnavailable

    def __init__(
        self, store: SemanticStore, embedder: Any, *, threshold: float = SHIPPED_THRESHOLD,
        rules: Sequence[Rule] = DEFAULT_RULES, guards: Sequence[str] = DEFAULT_GUARDS, k: int = 4,
    ) -> None:  # fmt: skip
        self.entries, self.embedder, self.threshold, self.rules, self.guards, self.k = (
            store,
            embedder,
            threshold,
            tuple(rules),
            tuple(guards),
            k,
        )

    def admission(self, text: str, *, personal_data: bool) -> tuple[bool, str]:
        """(admitted, reason) of a question (see :func:`gateway.layers.semantic.admission.semantic_admission`)."""
        return semantic_admission(text, rules=self.rules, personal_data=personal_data)

    def lookup(self, prefix: str, partition: str, text: str, threshold: float | None) -> tuple[np.ndarray, dict[str, Any] | None]:
        """Embed ``text`` and look for an answer to the same question in its partition.

        Returns:
            (its vector, for storing the answer on a miss; the cached record of the first
            candidate that matches, or None).

        Raises:
            StoreUnavailable: the store is down.
        """
        vector = self.embedder.embed([text])[0]
        limit = self.threshold if threshold is None else threshold
        for candidate in self.entries.search(prefix, partition, self.embedder.model_id, vector, k=self.k):
            verdict = match(
                text, candidate.entry.text, candidate.similarity, threshold=limit, guards=self.guards, embed=self.embedder.embed
            )
            if verdict.hit:
                return vector, json.loads(candidate.entry.response)
        return vector, None

    def store_answer(
        self, prefix: str, tenant: str, partition: str, vector: np.ndarray, text: str, value: bytes, tags: Sequence[str],
        *, ttl_s: float | None, max_bytes: int | None,
    ) -> None:  # fmt: skip
        """Keep an answer for later paraphrases of ``text`` (expires after ``ttl_s``; the namespace's budget applies).

        Raises:
            StoreUnavailable: the store is down.
        """
        now = time.time()
        entry = SemanticEntry(
            entry_id=secrets.token_hex(16), prefix=prefix, partition=partition, tenant=tenant, model_id=self.embedder.model_id,
            text=text, vector=np.asarray(vector, dtype=np.float32), response=value, tags=tuple(tags), created_at=now,
            expires_at=now + ttl_s if ttl_s else None,
        )  # fmt: skip
        self.entries.add(entry, max_bytes=max_bytes)

    def store(
        self, ns: Any, tenant: Any, partition: str, vector: np.ndarray, text: str, value: bytes, tags: Sequence[str]
    ) -> None:
        """:meth:`store_answer` for a namespace and tenant target of the routing snapshot."""
        self.store_answer(
            ns.storage_prefix, str(tenant.id), partition, vector, text, value, tags, ttl_s=ns.ttl_s, max_bytes=ns.max_bytes
        )
