"""Settings read from the environment refuse what they cannot use, naming the variable:
the gateway's engine choice and the precise router's numbers among them."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from cacheadmin.env import env_choice, env_float, env_int
from tests.helpers import manage, subprocess_env

CHOICES = ("precise", "affinity", "round_robin")


@pytest.mark.parametrize(
    ("read", "raw", "message"),
    [
        (
            lambda: env_choice("KVCP_T", "precise", CHOICES),
            "fastest",
            "KVCP_T='fastest' is not one of precise, affinity, round_robin",
        ),
        (lambda: env_float("KVCP_T", 0.5, minimum=0.05), "0.01", "KVCP_T=0.01 is below its minimum 0.05"),
        (lambda: env_float("KVCP_T", 0.5), "inf", "KVCP_T='inf' is not a finite number"),
        (lambda: env_float("KVCP_T", 0.5), "half", "KVCP_T='half' is not a number"),
        (lambda: env_int("KVCP_T", 3, minimum=1), "2.5", "KVCP_T='2.5' is not an integer"),
        (lambda: env_int("KVCP_T", 3, minimum=1), "0", "KVCP_T=0 is below its minimum 1"),
    ],
)
def test_bad_values_are_refused_by_name(monkeypatch: pytest.MonkeyPatch, read, raw: str, message: str) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KVCP_T", raw)
    with pytest.raises(ImproperlyConfigured) as info:
        read()
    assert str(info.value) == message


def test_good_values_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCP_T", raising=False)
    assert (env_choice("KVCP_T", "precise", CHOICES), env_float("KVCP_T", 0.5), env_int("KVCP_T", 3)) == ("precise", 0.5, 3)
    monkeypatch.setenv("KVCP_T", "affinity")
    assert env_choice("KVCP_T", "precise", CHOICES) == "affinity"
    monkeypatch.setenv("KVCP_T", "2.5")
    assert env_float("KVCP_T", 0.5, minimum=0.05) == 2.5


def test_a_command_stops_on_an_unknown_engine_choice() -> None:
    done = manage("check", env=subprocess_env(GATEWAY_ENGINE_CHOICE="fastest"))
    assert (done.returncode, done.stderr) == (
        2,
        "manage.py: configuration error: GATEWAY_ENGINE_CHOICE='fastest' is not one of precise, affinity, round_robin\n",
    )
