"""Which requests may use the semantic cache at all.

A paraphrase hit serves an answer written for another moment or another
question. For an answer that depends on *when* it is asked ("latest version",
"weather today"), on a *comparison* ("X vs Y", where the candidate may compare
Y with X or with Z) or on a *prediction* ("will rates fall next year"), a
stale or wrong hit costs more than the saved generation, so such requests
bypass the layer (the exact-match response cache and the engine's prefix
cache still apply). Requests carrying personal data bypass it too: their
answers are about one person and must never be served to a paraphrase of
someone else's question. The caller decides what is personal data and passes
the fact in.

Rules are case-insensitive regular expressions searched in the request's
text; the first rule that matches names the bypass reason. Rule names are
operator-configured and few, so the reason is a bounded metric label.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

REASON_ADMITTED = "admitted"
REASON_PERSONAL_DATA = "personal_data"
#: The reason of a question outside the embedder's languages (:mod:`gateway.layers.semantic.language`).
REASON_LANGUAGE = "language_unsupported"
#: The reason of a question whose meaning may rest on characters an embedder does not read
#: (emoji, other symbols, nothing but punctuation: :func:`gateway.layers.semantic.language.unreadable`).
REASON_SYMBOLS = "symbols_unsupported"
#: Reasons the layer reports itself, which no configured rule may take.
RESERVED_REASONS = (REASON_ADMITTED, REASON_PERSONAL_DATA, REASON_LANGUAGE, REASON_SYMBOLS)
#: Rule names must look like metric label values: lower-case letters, digits and underscores.
_RULE_NAME = re.compile(r"[a-z][a-z0-9_]{0,62}")


class AdmissionConfigError(ValueError):
    """A rule or rule list is malformed; the message names the field (e.g. ``rules[2].pattern``)."""


@dataclass(frozen=True)
class Rule:
    """A bypass rule: requests whose text matches ``pattern`` skip the semantic layer with reason ``name``.

    Attributes:
        name: the reason reported, ``[a-z][a-z0-9_]*`` (at most 63 characters),
            not one of :data:`RESERVED_REASONS`.
        pattern: a regular expression (Python ``re`` syntax), searched case-insensitively.

    Raises:
        AdmissionConfigError: bad name, or a pattern that is not a string or does not compile.
    """

    name: str
    pattern: str
    _compiled: re.Pattern[str] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _RULE_NAME.fullmatch(self.name):
            raise AdmissionConfigError(f"name must match [a-z][a-z0-9_]* (at most 63 characters), got {self.name!r}")
        if self.name in RESERVED_REASONS:
            raise AdmissionConfigError(f"name {self.name!r} is reserved for the admission's own reasons")
        if not isinstance(self.pattern, str) or not self.pattern:
            raise AdmissionConfigError(f"pattern of rule {self.name!r} must be a non-empty string, got {self.pattern!r}")
        try:
            compiled = re.compile(self.pattern, re.IGNORECASE)
        except re.error as exc:
            raise AdmissionConfigError(f"pattern of rule {self.name!r} is not a valid regular expression: {exc}") from exc
        object.__setattr__(self, "_compiled", compiled)

    def matches(self, text: str) -> bool:
        """Whether the rule's pattern occurs anywhere in ``text`` (case-insensitive)."""
        return self._compiled.search(text) is not None


_MONTHS = (
    r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sep(?:t(?:ember)?)?|oct(?:ober)?"
    r"|nov(?:ember)?|dec(?:ember)?)"
)

#: The rules applied when none are configured (docs/gateway/semantic-cache.md lists them);
#: each rule errs towards bypassing (a bypass costs a possible hit, a stale hit serves a wrong answer).
DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(
        name="time_dependent",
        pattern=(
            r"\b(?:today|tonight|now|nowadays|these days|at the moment|right now|so far|as of|up[- ]to[- ]date"
            # "current directory" or "current user" is a place in a program, not a moment.
            r"|current(?:ly)?\b(?! (?:working )?(?:directory|folder|dir|user|line|file|branch|thread|process|context"
            r"|element|page))"
            r"|latest|newest|recent(?:ly)?|most recent|breaking|trending|real[- ]time"
            r"|live (?:scores?|results?|updates?|stream|coverage|prices?)"
            r"|this (?:morning|afternoon|evening|week|weekend|month|quarter|year|season)"
            r"|last (?:night|week|weekend|month|quarter|year)|yesterday|tomorrow"
            r"|weather|stock price|exchange rate"
            r"|mondays?|tuesdays?|wednesdays?|thursdays?|fridays?|saturdays?|sundays?)\b"
            # Dates: 2025-03-14, 14/03/2025, "March 14", "14 March", "14th of March" (not "3/4": a cup of flour, not a date).
            r"|\b\d{4}-\d{1,2}-\d{1,2}\b|\b\d{1,2}/\d{1,2}/\d{2,4}\b"
            rf"|\b{_MONTHS}\.? \d{{1,2}}(?:st|nd|rd|th)?\b|\b\d{{1,2}}(?:st|nd|rd|th)? (?:of )?{_MONTHS}\b"
        ),
    ),
    Rule(
        name="comparison",
        pattern=(
            r"\b(?:compar(?:e|ed|es|ing|ison|isons)|versus|vs\.?|pros and cons"
            r"|differences? between|(?:better|worse|faster|slower|cheaper|safer|easier|harder|stronger|bigger|smaller"
            r"|more \w+|less \w+) than"
            r"|which (?:\w+ ){0,3}(?:is|are|was|should|would)\b.{0,40}\b(?:better|best|faster|fastest|cheaper|cheapest"
            r"|safer|safest|easier|worse|worst|more|less|preferred|recommended))\b"
        ),
    ),
    Rule(
        name="prediction",
        pattern=(
            r"\b(?:will|won't|going to|gonna|forecasts?|forecasting|predict(?:s|ed|ion|ions)?|projections?|projected"
            r"|outlook|expected to|expect(?:s|ed)? (?:the|a|it|prices|rates)|likely to|odds|chances? of"
            r"|in the future|next (?:week|month|quarter|year|season|decade|election))\b"
        ),
    ),
)


def rules_from_config(value: list[dict[str, str]]) -> tuple[Rule, ...]:
    """Build rules from configuration, e.g. ``[{"name": "pricing", "pattern": r"\\bprice"}]``.

    Args:
        value: a list of objects, each with exactly the string keys ``name``
            and ``pattern`` (an empty list disables every rule).

    Returns:
        The rules in the given order.

    Raises:
        AdmissionConfigError: not a list, an entry not an object, a missing or
            unknown key, a bad name or regular expression (message names
            ``rules[i].<field>``), or a name used twice.
    """
    if not isinstance(value, list):
        raise AdmissionConfigError(f"rules must be a list of {{name, pattern}} objects, got {type(value).__name__}")
    rules: list[Rule] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(value):
        where = f"rules[{index}]"
        if not isinstance(entry, dict):
            raise AdmissionConfigError(f"{where} must be an object with name and pattern, got {type(entry).__name__}")
        missing = sorted({"name", "pattern"} - entry.keys())
        unknown = sorted(str(k) for k in entry.keys() - {"name", "pattern"})
        if missing:
            raise AdmissionConfigError(f"{where}: missing {', '.join(missing)}")
        if unknown:
            raise AdmissionConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")
        name, pattern = entry["name"], entry["pattern"]
        if not isinstance(name, str) or not _RULE_NAME.fullmatch(name) or name in RESERVED_REASONS:
            raise AdmissionConfigError(
                f"{where}.name must match [a-z][a-z0-9_]* (at most 63 characters) and not be"
                f" one of {', '.join(repr(r) for r in RESERVED_REASONS)}, got {name!r}"
            )
        if name in seen:
            raise AdmissionConfigError(f"{where}.name: {name!r} is already the name of rules[{seen[name]}]")
        if not isinstance(pattern, str) or not pattern:
            raise AdmissionConfigError(f"{where}.pattern must be a non-empty string, got {pattern!r}")
        try:
            re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise AdmissionConfigError(f"{where}.pattern is not a valid regular expression: {exc}") from exc
        seen[name] = index
        rules.append(Rule(name=name, pattern=pattern))
    return tuple(rules)


def semantic_admission(text: str, *, rules: Sequence[Rule] = DEFAULT_RULES, personal_data: bool = False) -> tuple[bool, str]:
    """Whether a request may use the semantic cache (lookup and store).

    Args:
        text: the request's last user message.
        rules: bypass rules, first match wins.
        personal_data: the caller found personal data in the request.

    Returns:
        ``(True, "admitted")``, ``(False, "personal_data")`` (checked first),
        or ``(False, rule.name)`` of the first matching rule.

    Raises:
        AdmissionConfigError: ``text`` not a string, ``personal_data`` not a
            bool, or a rule that is not a :class:`Rule`.
    """
    if not isinstance(text, str):
        raise AdmissionConfigError(f"text must be a string, got {type(text).__name__}")
    if not isinstance(personal_data, bool):
        raise AdmissionConfigError(f"personal_data must be a bool, got {type(personal_data).__name__}")
    if personal_data:
        return False, REASON_PERSONAL_DATA
    for index, rule in enumerate(rules):
        if not isinstance(rule, Rule):
            raise AdmissionConfigError(f"rules[{index}] must be a Rule, got {type(rule).__name__}")
        if rule.matches(text):
            return False, rule.name
    return True, REASON_ADMITTED
