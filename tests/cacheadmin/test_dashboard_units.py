"""The human-unit filters every page uses (durations, percentages, ages, bytes)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.template import Context, Template

from cacheadmin.templatetags.cacheadmin_tags import age, duration_ms, iec_bytes, percent

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("value", "unit", "expected"),
    [
        (12, "ms", "12 ms"),
        (12.4, "ms", "12 ms"),
        (0.25, "ms", "0.25 ms"),
        (0, "ms", "0 ms"),
        (999, "ms", "999 ms"),
        (1400, "ms", "1.4 s"),
        (1.4, "s", "1.4 s"),
        (180, "s", "3 min"),
        (9000, "s", "2.5 h"),
        (4 * 86400, "s", "4 d"),
        (-1500, "ms", "-1.5 s"),
        (None, "ms", "—"),
        ("", "ms", "—"),
        ("nan", "ms", "—"),
        ("12", "ms", "12 ms"),
    ],
)
def test_duration_ms(value: object, unit: str, expected: str) -> None:
    assert duration_ms(value, unit) == expected


@pytest.mark.parametrize(("value", "expected"), [(0.125, "12.5 %"), (1, "100.0 %"), (0, "0.0 %"), (None, "—"), ("x", "—")])
def test_percent(value: object, expected: str) -> None:
    assert percent(value) == expected


def test_percent_decimals() -> None:
    assert percent(0.12345, 2) == "12.35 %"


@pytest.mark.parametrize(
    ("delta", "expected"),
    [
        (dt.timedelta(minutes=4, seconds=20), "4 min ago"),
        (dt.timedelta(seconds=42), "42 s ago"),
        (dt.timedelta(seconds=0), "just now"),
        (dt.timedelta(hours=3, minutes=50), "3 h ago"),
        (dt.timedelta(days=2, hours=1), "2 d ago"),
        (-dt.timedelta(minutes=2, seconds=10), "in 2 min"),
    ],
)
def test_age(delta: dt.timedelta, expected: str) -> None:
    assert age(NOW - delta, NOW) == expected


def test_age_missing() -> None:
    assert age(None, NOW) == "—"
    assert age("yesterday", NOW) == "—"


def test_filters_in_a_template() -> None:
    rendered = Template(
        "{% load cacheadmin_tags %}{{ b|iec_bytes }}|{{ ms|duration_ms }}|{{ s|duration_ms:'s' }}|{{ r|percent }}"
    ).render(Context({"b": 3 * 2**20 // 2, "ms": 12, "s": 90, "r": 0.5}))
    assert rendered == "1.5 MiB|12 ms|1.5 min|50.0 %"
    assert iec_bytes(None) == "—"
