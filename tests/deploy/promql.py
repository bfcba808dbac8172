"""The metric names a PromQL expression reads, so rule and dashboard files can
be checked against the metric catalogue without a PromQL parser.

Not a parser: it removes what cannot be a metric name (strings, label
matchers, range and subquery brackets, offsets, grouping label lists, numbers,
keywords) and takes the identifiers left. An identifier followed by ``(`` must
be a PromQL function or aggregation (anything else is reported, so a
misspelt function is caught too). Grammar from
https://prometheus.io/docs/prometheus/latest/querying/basics/ and /functions/.
"""

from __future__ import annotations

import re

#: PromQL functions and aggregation operators (Prometheus 2.42).
FUNCTIONS = frozenset(
    """
    abs absent absent_over_time ceil changes clamp clamp_max clamp_min day_of_month day_of_week
    day_of_year days_in_month delta deriv exp floor histogram_count histogram_fraction
    histogram_quantile histogram_sum holt_winters hour idelta increase irate label_join
    label_replace ln log2 log10 minute month predict_linear rate resets round scalar sgn sort
    sort_desc sqrt time timestamp vector year avg_over_time min_over_time max_over_time
    sum_over_time count_over_time quantile_over_time stddev_over_time stdvar_over_time
    last_over_time present_over_time acos acosh asin asinh atan atanh cos cosh sin sinh tan tanh
    deg pi rad
    sum min max avg group stddev stdvar count count_values bottomk topk quantile
    """.split()
)
#: Binary set operators and modifiers that are not followed by a label list.
KEYWORDS = frozenset({"and", "or", "unless", "bool", "inf", "nan"})

_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_OFFSET = re.compile(r"\boffset\s+-?[0-9a-zA-Z$_]+|@\s*(?:start\(\)|end\(\)|[0-9.]+)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_BARE_MODIFIER = re.compile(r"\b(?:group_left|group_right)\b")
_NUMBER = re.compile(r"(?<![\w:])(?:0x[0-9a-fA-F]+|[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class PromQLNameError(ValueError):
    """An identifier called like a function that PromQL does not have."""


def metric_names(expr: str) -> frozenset[str]:
    """The metric (or recording rule) names ``expr`` selects.

    ``expr``: a PromQL expression; Grafana variables (``$namespace``,
    ``$__rate_interval``) may appear inside strings or brackets.
    Raises ``PromQLNameError`` when a name is called as a function but is
    neither a PromQL function nor an aggregation.
    """
    text = _STRING.sub(" ", expr)
    # Matchers hold no nested braces once strings are gone; brackets may hold
    # a subquery's ``[5m:1m]`` but never another bracket.
    text = _MATCHERS.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _BARE_MODIFIER.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names: set[str] = set()
    for match in _IDENT.finditer(text):
        word = match.group(0)
        if word in KEYWORDS:  # ``and (x)``, ``unless (x)``: an operator before a parenthesis
            continue
        if text[match.end() :].lstrip().startswith("("):
            if word not in FUNCTIONS:
                raise PromQLNameError(f"{word}(...) is not a PromQL function or aggregation in: {expr}")
            continue
        names.add(word)
    return frozenset(names)


def label_values_metric(query: str) -> str:
    """The metric of a Grafana ``label_values(METRIC, LABEL)`` variable query.

    Raises ``PromQLNameError`` when ``query`` has another form.
    """
    match = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{[^{}]*\})?\s*,\s*\w+\s*\)\s*", query)
    if match is None:
        raise PromQLNameError(f"not a label_values(METRIC, LABEL) query: {query}")
    return match.group(1)
