"""runtime/landing.py: how receiver threads' landings reach the dispatcher, in one process with real threads and a real loop."""

from __future__ import annotations

import asyncio
import threading
import time

from pipeloom.runtime.landing import LandingQueue


def _put_from_thread(q: LandingQueue, fn: object, *args: object, delay: float = 0.0) -> threading.Thread:
    def run() -> None:
        if delay:
            time.sleep(delay)
        q.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]

    t = threading.Thread(target=run)
    t.start()
    return t


async def test_inline_puts_wait_for_the_dispatcher_to_drain_them_in_order() -> None:
    q = LandingQueue(asyncio.get_running_loop())
    q.inline()
    got: list[int] = []
    for i in range(3):
        _put_from_thread(q, got.append, i).join()
    await asyncio.sleep(0.05)  # inline: nothing was scheduled on the loop
    assert got == [] and q
    assert q.drain() == 3
    assert got == [0, 1, 2] and not q


async def test_puts_in_loop_mode_are_drained_by_the_loop_once_per_burst() -> None:
    loop = asyncio.get_running_loop()
    q = LandingQueue(loop)
    got: list[int] = []
    done = asyncio.Event()
    scheduled = 0
    real = loop.call_soon_threadsafe

    class CountingLoop:
        def call_soon_threadsafe(self, fn: object, *args: object) -> object:
            nonlocal scheduled
            scheduled += 1
            return real(fn, *args)  # type: ignore[arg-type]

    q._loop = CountingLoop()  # count the loop wakes the queue asks for
    assert q.to_loop()

    def burst() -> None:
        for i in range(5):
            q.call_soon_threadsafe(got.append, i)
        q.call_soon_threadsafe(done.set)

    t = threading.Thread(target=burst)
    t.start()
    t.join()
    await asyncio.wait_for(done.wait(), 5)
    assert got == [0, 1, 2, 3, 4]
    assert scheduled == 1  # one drain for the burst, not one wake per item


async def test_to_loop_refuses_while_items_are_queued() -> None:
    q = LandingQueue(asyncio.get_running_loop())
    q.inline()
    got: list[str] = []
    _put_from_thread(q, got.append, "a").join()
    assert not q.to_loop()  # drain first rather than sleep with an item queued
    q.drain()
    assert q.to_loop() and got == ["a"]


async def test_park_returns_when_a_put_comes_and_times_out_otherwise() -> None:
    q = LandingQueue(asyncio.get_running_loop())
    q.inline()
    got: list[int] = []
    t0 = time.perf_counter()
    assert not q.park(0.02)  # nothing put: the bounded wait expires
    assert time.perf_counter() - t0 >= 0.015
    t = _put_from_thread(q, got.append, 7, delay=0.02)
    t0 = time.perf_counter()
    assert q.park(5.0)
    assert time.perf_counter() - t0 < 2.0  # woken by the put, not the timeout
    t.join()
    assert got == [] and q.drain() == 1 and got == [7]
    # the ring was consumed: the next park waits again
    assert not q.park(0.01)


async def test_a_put_racing_a_park_timeout_is_never_lost() -> None:
    q = LandingQueue(asyncio.get_running_loop())
    q.inline()
    got: list[int] = []
    n = 300
    t = threading.Thread(target=lambda: [q.call_soon_threadsafe(got.append, i) or time.sleep(1e-5 * (i % 7)) for i in range(n)])
    t.start()
    deadline = time.monotonic() + 20
    while len(got) < n and time.monotonic() < deadline:
        if q.park(1e-5 * (len(got) % 5)):  # timeouts as short as the puts' gaps
            q.drain()
    t.join()
    q.drain()
    assert got == list(range(n))
    assert not q.park(0.001)  # no ring left over


async def test_release_hands_queued_and_later_items_to_the_loop() -> None:
    q = LandingQueue(asyncio.get_running_loop())
    q.inline()
    got: list[str] = []
    done = asyncio.Event()
    _put_from_thread(q, got.append, "queued").join()
    q.release()  # the dispatcher stopped (its step ended or failed) with an item queued
    _put_from_thread(q, got.append, "later").join()
    _put_from_thread(q, done.set).join()
    await asyncio.wait_for(done.wait(), 5)
    assert got == ["queued", "later"]


async def test_a_closed_loop_raises_to_the_putter() -> None:
    loop = asyncio.new_event_loop()
    loop.close()
    q = LandingQueue(loop)
    try:
        q.call_soon_threadsafe(print)
    except RuntimeError:
        pass  # the receiver thread ignores it (the job is being torn down)
    else:
        raise AssertionError("a put into a closed loop must raise RuntimeError")
