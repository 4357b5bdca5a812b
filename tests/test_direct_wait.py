"""``runtime/direct_wait.py`` in one process: a watchdog that breaks a wait only when told the peer is gone.

The Works are fakes (a gloo wait that blocks until released, or raises once the
"pair" is closed); the real path (a SIGSTOPped, killed or failing peer while the
loop thread waits in gloo) is covered by tests/test_runtime_faults.py's
``static`` cases.
"""

from __future__ import annotations

import threading
import time

import pytest

from pipeloom.runtime.direct_wait import DirectWait


class FakeWork:
    """A gloo receive: ``wait()`` blocks until it lands or its pair is closed (then raises)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.closed = False

    def land(self) -> None:
        self.done.set()

    def close_pair(self) -> None:
        self.closed = True
        self.done.set()

    def wait(self) -> bool:
        self.done.wait()
        if self.closed:
            raise RuntimeError("Application timeout caused pair closure")
        return True


class Lost(RuntimeError):
    pass


def _watch(check, works: dict[int, FakeWork], broken: list[int]) -> DirectWait:
    def breaker(peer: int) -> None:
        broken.append(peer)
        works[peer].close_pair()

    return DirectWait(name="test-watch", check=check, breaker=breaker, tick=0.02)


def test_a_wait_that_lands_returns_and_a_slow_live_peer_is_never_broken() -> None:
    works = {1: FakeWork()}
    broken: list[int] = []
    checked: list[int] = []

    def check(peer: int) -> BaseException | None:
        checked.append(peer)
        return None  # alive: heartbeats keep coming

    dw = _watch(check, works, broken)
    try:
        threading.Timer(0.3, works[1].land).start()  # a slow peer: 15 ticks
        t0 = time.monotonic()
        dw.wait([works[1]], 1)
        assert time.monotonic() - t0 >= 0.25
        assert broken == [] and dw.broken == 0
        assert checked and set(checked) == {1}  # the watchdog judged the awaited peer meanwhile
        # a short wait is not even checked: it ends before the watchdog sees it twice
        n = len(checked)
        quick = FakeWork()
        quick.land()
        dw.wait([quick], 1)
        time.sleep(0.05)
        assert len(checked) == n
    finally:
        dw.close()


def test_a_lost_peer_breaks_the_wait_with_the_watchdogs_error() -> None:
    works = {1: FakeWork(), 2: FakeWork()}
    broken: list[int] = []
    lost_at = time.monotonic() + 0.2

    def check(peer: int) -> BaseException | None:
        return Lost(f"lost rank {peer}") if time.monotonic() >= lost_at else None

    dw = _watch(check, works, broken)
    try:
        with pytest.raises(Lost, match="lost rank 2") as info:
            dw.wait([works[2]], 2)
        assert time.monotonic() - lost_at < 0.5  # within a few ticks of the verdict
        assert broken == [2] and dw.broken == 1
        assert isinstance(info.value.__cause__, RuntimeError)  # the wait's own error, kept as the cause
    finally:
        dw.close()


def test_a_connection_that_closes_raises_its_own_error() -> None:
    # a peer that died: gloo's wait raises at once, nothing for the watchdog to do
    works = {1: FakeWork()}
    broken: list[int] = []
    dw = _watch(lambda peer: None, works, broken)
    try:
        threading.Timer(0.05, works[1].close_pair).start()
        with pytest.raises(RuntimeError, match="pair closure"):
            dw.wait([works[1]], 1)
        assert broken == []
    finally:
        dw.close()
