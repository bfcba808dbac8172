"""What a gateway process saw, accumulated in memory on the hot path and
drained in batches off it (the control plane writes them per minute).

Per namespace and layer (``response``, ``semantic``, ``prefix``): requests,
hits, misses, bypasses by reason, tokens and times. How the figures are read:

- response and semantic rows: ``prompt_tokens`` and ``output_tokens`` are the
  tokens their *hits* avoided computing (the usage the cached answer recorded);
- the prefix row (requests that reached an engine): the usage the engine
  reported, ``cached_prompt_tokens`` from ``usage.prompt_tokens_details``;
- cost savings rate of a layer = tokens it avoided / tokens asked for, where
  tokens asked for = every request's prompt and output tokens (served from a
  cache or not); the prefix layer avoids its cached prompt tokens;
- benefit ratio of a layer (response, semantic) = time its hits saved / time
  it cost, over the same rows::

      hits × (ttft_miss_ms_sum / ttft_miss_count − ttft_hit_ms_sum / ttft_hit_count)
      ─────────────────────────────────────────────────────────────────────────────
                          lookup_ms_sum + store_ms_sum

  where the miss TTFT is that of the requests that looked the layer up, missed
  and were answered by an engine (their cold TTFT), the hit TTFT that of its
  hits, ``lookup_ms_sum`` the time of every lookup of it (hits and misses) and
  ``store_ms_sum`` the time of every store of an engine's answer in it. It
  weighs what a hit saves by how often one happens: 1 is break-even, under 1
  the layer costs its requests more time than it saves them. None when there
  is nothing to divide by or no hit or miss TTFT yet. The prefix layer is the
  engines' own cache: it costs the gateway no lookup or store, so its benefit
  ratio is None (not applicable).
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gateway.layers import LAYERS
from gateway.templates import TemplateCounts

#: Bounds (ms) of the per-minute TTFT histogram: the Prometheus histogram's
#: (:data:`gateway.metrics.TTFT_BUCKETS_S`, in ms), then ``inf``. A request adds 1 to the
#: counter named by :func:`ttft_bucket`; the control plane keeps them as ``GatewayStat.ttft_buckets``.
TTFT_BOUNDS_MS = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)
#: Counter names of the histogram: this prefix and the bound (``ttft_le_25``, ``ttft_le_inf``).
TTFT_BUCKET_PREFIX = "ttft_le_"


def ttft_bucket(ms: float) -> str:
    """The counter of the histogram bucket a TTFT of ``ms`` milliseconds falls in (the first bound it does not exceed)."""
    for bound in TTFT_BOUNDS_MS:
        if ms <= bound:
            return f"{TTFT_BUCKET_PREFIX}{bound:g}"
    return f"{TTFT_BUCKET_PREFIX}inf"


@dataclass
class _Cell:
    counters: Counter[str] = field(default_factory=Counter)
    bypass: Counter[str] = field(default_factory=Counter)


#: One drained row: (namespace pk, layer, minute, counters, bypass reason → count).
Row = tuple[int, str, datetime, dict[str, float], dict[str, int]]


class Recorder:
    """Thread-safe accumulator of per-(namespace, layer, minute) increments,
    prefix heat and nothing else: no prompt text besides the heat's (which
    holds only requests without personal data)."""

    def __init__(self, *, max_heat: int = 500) -> None:
        self._lock = threading.Lock()
        self._cells: dict[tuple[int, str, datetime], _Cell] = defaultdict(_Cell)
        self._heat: dict[tuple[int, str], list[Any]] = {}
        self._max_heat = max_heat
        #: Receives every increment too (``gateway.metrics.GatewayMetrics``), outside the lock; None: nobody.
        self.metrics: Any = None
        #: Requests per prompt template, warm or cold (drained by the same flush).
        self.templates = TemplateCounts()

    @staticmethod
    def _minute(now: float | None) -> datetime:
        moment = datetime.now(UTC) if now is None else datetime.fromtimestamp(now, UTC)
        return moment.replace(second=0, microsecond=0)

    def add(self, namespace_pk: int, layer: str, *, now: float | None = None, **counters: float) -> None:
        """Add counter increments (names of ``GatewayStat`` counters) to this minute's cell."""
        with self._lock:
            cell = self._cells[(namespace_pk, layer, self._minute(now))]
            for name, value in counters.items():
                # Counter holds any numbers (TTFT seconds here); typeshed types its counts as int.
                cell.counters[name] += value  # type: ignore[assignment]
        if self.metrics is not None:
            self.metrics.added(namespace_pk, layer, counters)

    def bypass(self, namespace_pk: int, layer: str, reason: str, *, now: float | None = None) -> None:
        """Count a request that went past ``layer`` without looking, for ``reason``
        (a bounded constant: it is a metric label)."""
        with self._lock:
            cell = self._cells[(namespace_pk, layer, self._minute(now))]
            cell.counters["requests"] += 1
            cell.counters["bypasses"] += 1
            cell.bypass[reason] += 1
        if self.metrics is not None:
            self.metrics.bypassed(namespace_pk, layer, reason)

    def heat(self, namespace_pk: int, digest: str, messages: Any, tools: Any) -> None:
        """Count one request of a conversation prefix (by digest) as heat; at
        most ``max_heat`` distinct prefixes wait for a drain (the rest are
        dropped: heat is a ranking, not an account)."""
        with self._lock:
            held = self._heat.get((namespace_pk, digest))
            if held is not None:
                held[2] += 1
            elif len(self._heat) < self._max_heat:
                self._heat[(namespace_pk, digest)] = [messages, tools, 1]

    def drain(self) -> tuple[list[Row], list[tuple[int, str, Any, Any, int]]]:
        """Take every increment and heat count gathered so far.

        Returns:
            (stat rows, heat as (namespace pk, digest, messages, tools, hits)).
        """
        with self._lock:
            cells, self._cells = self._cells, defaultdict(_Cell)
            heat, self._heat = self._heat, {}
        rows: list[Row] = [(ns, layer, minute, dict(c.counters), dict(c.bypass)) for (ns, layer, minute), c in cells.items()]
        return rows, [(ns, digest, m, t, n) for (ns, digest), (m, t, n) in heat.items()]

    def restore(self, rows: list[Row], heat: list[tuple[int, str, Any, Any, int]]) -> None:
        """Put back what a failed flush drained, so a database outage loses nothing."""
        with self._lock:
            for ns, layer, minute, counters, bypass in rows:
                cell = self._cells[(ns, layer, minute)]
                cell.counters.update(counters)
                cell.bypass.update(bypass)
            for ns, digest, messages, tools, hits in heat:
                key = (ns, digest)
                held = self._heat.get(key)
                if held is None:
                    self._heat[key] = [messages, tools, hits]
                else:
                    held[2] += hits


def benefit_ratio(r: Mapping[str, float]) -> float | None:
    """A layer's benefit ratio from its summed counters (see the module docstring):
    hits × (mean miss TTFT − mean hit TTFT) / (lookup time + store time), all in ms;
    None without a hit TTFT, a miss TTFT or any lookup or store time."""
    hit_n, miss_n = r.get("ttft_hit_count", 0), r.get("ttft_miss_count", 0)
    cost = r.get("lookup_ms_sum", 0) + r.get("store_ms_sum", 0)
    if not hit_n or not miss_n or cost <= 0:
        return None
    saved_per_hit = r.get("ttft_miss_ms_sum", 0) / miss_n - r.get("ttft_hit_ms_sum", 0) / hit_n
    return r.get("hits", 0) * saved_per_hit / cost


def layer_figures(rows: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float | None]]:
    """Hit ratio, cost savings rate and benefit ratio per layer from summed figures.

    Args:
        rows: layer → summed ``GatewayStat`` counters (any subset of layers).

    Returns:
        layer → ``{"hit_ratio", "cost_savings_rate", "benefit_ratio", "ttft_hit_ms", "ttft_miss_ms", "lookup_ms",
        "store_ms", "saved_ms", "cost_ms"}`` (None where there is nothing to divide by; the prefix layer's
        ``benefit_ratio``, ``saved_ms`` and ``cost_ms`` always: it costs the gateway nothing). ``saved_ms`` is
        hits × (mean miss TTFT − mean hit TTFT), ``cost_ms`` lookup time + store time: the benefit ratio's
        two sides. See the module docstring.
    """

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    prefix = rows.get("prefix", {})
    asked = prefix.get("prompt_tokens", 0) + prefix.get("output_tokens", 0)
    for layer in LAYERS:
        asked += rows.get(layer, {}).get("prompt_tokens", 0) + rows.get(layer, {}).get("output_tokens", 0)
    out: dict[str, dict[str, float | None]] = {}
    for layer, r in rows.items():
        looked = r.get("hits", 0) + r.get("misses", 0)
        avoided = r.get("cached_prompt_tokens", 0) if layer == "prefix" else r.get("prompt_tokens", 0) + r.get("output_tokens", 0)
        hit_ms = ratio(r.get("ttft_hit_ms_sum", 0), r.get("ttft_hit_count", 0))
        miss_ms = ratio(r.get("ttft_miss_ms_sum", 0), r.get("ttft_miss_count", 0))
        benefit = None if layer == "prefix" else benefit_ratio(r)
        cost = r.get("lookup_ms_sum", 0) + r.get("store_ms_sum", 0)
        out[layer] = {
            "hit_ratio": ratio(r.get("hits", 0), looked),
            "cost_savings_rate": ratio(avoided, asked),
            "benefit_ratio": benefit,
            "ttft_hit_ms": hit_ms,
            "ttft_miss_ms": miss_ms,
            "lookup_ms": ratio(r.get("lookup_ms_sum", 0), r.get("lookup_count", 0)),
            "store_ms": ratio(r.get("store_ms_sum", 0), r.get("store_count", 0)),
            "saved_ms": r.get("hits", 0) * (miss_ms - hit_ms)
            if layer != "prefix" and hit_ms is not None and miss_ms is not None
            else None,
            "cost_ms": cost if layer != "prefix" else None,
        }
    return out
