"""transport/wakeup.py: a burst of rings is one write; a ring after a clear always wakes the waiter again."""

from __future__ import annotations

import os
import select
import threading

import pytest

from sluice.transport.wakeup import Wakeup


def readable(wake: Wakeup) -> bool:
    poller = select.poll()
    poller.register(wake.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def test_rings_before_a_clear_write_once_and_a_ring_after_it_wakes_again() -> None:
    wake = Wakeup()
    try:
        assert not readable(wake)
        for _ in range(5):
            wake.ring()
        assert readable(wake)
        assert wake._rung
        wake.clear()
        assert not readable(wake) and not wake._rung
        wake.ring()  # what changed after the waiter looked: it must wake for it
        assert readable(wake)
    finally:
        wake.close()


def test_a_burst_of_rings_costs_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[int] = []
    real = os.eventfd_write
    monkeypatch.setattr(os, "eventfd_write", lambda fd, value: (writes.append(value), real(fd, value)))
    wake = Wakeup()
    try:
        for _ in range(100):
            wake.ring()
        assert writes == [1]
        wake.clear()
        wake.ring()
        assert writes == [1, 1]
    finally:
        wake.close()


def test_rings_from_many_threads_never_leave_the_waiter_asleep() -> None:
    """Ringers and a waiter that clears and then looks at a counter: every increment is seen within the
    waiter's poll timeout, never by the timeout (a lost wake-up would show as a poll that timed out while
    an increment was unseen)."""
    wake = Wakeup()
    made = [0]
    seen = 0
    lock = threading.Lock()
    done = threading.Event()

    def ringer() -> None:
        for _ in range(2000):
            with lock:
                made[0] += 1
            wake.ring()
        done.set()

    threads = [threading.Thread(target=ringer) for _ in range(3)]
    for thread in threads:
        thread.start()
    poller = select.poll()
    poller.register(wake.fileno(), select.POLLIN)
    lost = 0
    try:
        while True:
            woke = bool(poller.poll(1000))
            wake.clear()
            with lock:
                now = made[0]
            if not woke and now > seen:
                lost += 1
            seen = now
            if seen == 6000:
                break
        assert lost == 0
    finally:
        for thread in threads:
            thread.join()
        wake.close()
