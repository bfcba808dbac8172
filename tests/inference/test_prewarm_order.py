"""Prompts in flight at once, results in heat order on the caller's thread."""

from __future__ import annotations

import threading
import time

import pytest

from inference.prewarm import in_heat_order


def test_results_are_handled_in_heat_order_on_the_callers_thread_with_the_window_bounded() -> None:
    lock = threading.Lock()
    in_flight, peak, handled = [0], [0], []
    caller = threading.get_ident()
    # The first three sends wait for each other: the barrier breaks (and the test fails) unless three are in
    # flight at once, however slowly the threads are scheduled.
    first_window = threading.Barrier(3, timeout=30)

    def send(index: int) -> int:
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        if index in (5, 0, 7):
            first_window.wait()
        time.sleep(0.02 if index % 3 else 0.05)  # later ones often finish first
        with lock:
            in_flight[0] -= 1
        return index * 10

    def handle(index: int, result: int) -> None:
        assert threading.get_ident() == caller
        handled.append((index, result))

    in_heat_order([5, 0, 7, 1, 2, 9, 3], send, handle, concurrency=3)
    assert handled == [(5, 50), (0, 0), (7, 70), (1, 10), (2, 20), (9, 90), (3, 30)]
    assert peak[0] == 3


def test_a_failure_stops_submitting_and_is_raised() -> None:
    sent: list[int] = []

    def send(index: int) -> int:
        sent.append(index)
        if index == 2:
            raise RuntimeError("engine died")
        time.sleep(0.01)
        return index

    handled: list[int] = []
    with pytest.raises(RuntimeError, match="engine died"):
        in_heat_order(list(range(20)), send, lambda i, r: handled.append(i), concurrency=2)
    assert handled == [0, 1] and max(sent) <= 4


def test_one_at_a_time_is_plain_order() -> None:
    out: list[int] = []
    in_heat_order([2, 1], lambda i: i, lambda i, r: out.append(r), concurrency=1)
    assert out == [2, 1]
