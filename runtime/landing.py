"""How landed transfers reach the dispatcher: a queue the loop drains itself, and a bounded direct wait.

Problem.  Each gloo transfer lands on a receiver thread (one per peer,
``transport/tensor.py``), which handed it to the event loop with
``call_soon_threadsafe``: a write to the loop's self-pipe, a wake of the loop
from its selector, a read of the pipe and a callback, then the dispatcher's
future resolved -- per transfer, even when the loop was busy running an action
and would have looked at its inbox right after anyway.  On the 2-core machine
where ``benchmarks/cpu_overhead.py`` runs, every one of those hops is a
context switch or a syscall that torch's runtime (which blocks in
``work.wait()`` on its own thread) does not pay.

Alternatives.  (a) Let the loop thread wait on the gloo ``Work`` itself: a
gloo receive completes only for the thread that waits on it, and a wait cannot
be abandoned (an expired ``wait(timeout)`` closes the pair), so the loop could
be stuck on a dead peer without reading its control messages.  (b) Batch the
loop wakes (one drain per burst): keeps the selector round trip on the
critical path when the dispatcher is idle.  (c) This module: the receiver
threads append to a queue; the dispatcher drains it before each choice
(no wake needed while it is busy), and only while it sleeps on the loop is one
drain scheduled with ``call_soon_threadsafe`` (one per burst, not one per
transfer).  When nothing is ready, the dispatcher may first *park*: block its
thread on a lock the next landing releases, for a short bounded slice
(``RuntimeOptions.gloo_park_ms``), then fall back to sleeping on the loop, so
control messages (aborts, byes) and the liveness check still get the loop
within that slice.  A landing during a park costs one futex wake, the same
hop torch's runtime pays.

Invariants.  Every item put is called exactly once, on the thread that
drains (the loop's), in the order it was put.  An item put while the queue is
neither inline nor parked is always followed by a drain scheduled on the loop
(the state flags and the queue change together under one mutex), so a landing
is never stranded: not between steps, not after a failed step (the queue goes
back to loop mode in a ``finally``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["LandingQueue"]


class LandingQueue:
    """Calls from receiver threads, run on the loop: drained inline, parked on, or scheduled.

    Looks like an event loop to the receiver threads (``call_soon_threadsafe``),
    which is all ``TensorPlane.begin_step`` needs of its ``loop`` argument.

    Modes, set by the loop thread: *inline* (the dispatcher is running and calls
    :meth:`drain` before each choice: a put only appends), *parked* (the
    dispatcher's thread is blocked in :meth:`park`: a put releases it), and
    otherwise *loop* (a put schedules one :meth:`drain` on ``loop`` unless one
    is already scheduled).
    """

    __slots__ = ("_loop", "_items", "_mu", "_bell", "_inline", "_parked", "_scheduled")

    def __init__(self, loop: Any) -> None:
        self._loop = loop
        self._items: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._mu = threading.Lock()
        #: held unless a put is waking a parked loop thread (a binary semaphore)
        self._bell = threading.Lock()
        self._bell.acquire()
        self._inline = False
        self._parked = False
        self._scheduled = False

    # -- receiver threads ----------------------------------------------------
    def call_soon_threadsafe(self, fn: Callable[..., None], *args: Any) -> None:
        """Have ``fn(*args)`` called on the loop thread (RuntimeError if the loop is closed)."""
        with self._mu:
            self._items.append((fn, args))
            if self._parked:
                self._parked = False
                self._bell.release()
                return
            if self._inline or self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._scheduled_drain)

    # -- loop thread ---------------------------------------------------------
    @property
    def parked(self) -> bool:
        """Whether the loop thread is blocked in :meth:`park` now (a hint for the receiver threads)."""
        return self._parked

    def __bool__(self) -> bool:
        """Whether items wait to be drained (a racy hint: :meth:`drain` is always safe)."""
        return bool(self._items)

    def drain(self) -> int:
        """Call every queued item, in order; returns how many ran."""
        items = self._items
        n = 0
        while items:
            fn, args = items.popleft()
            fn(*args)
            n += 1
        return n

    def _scheduled_drain(self) -> None:
        with self._mu:
            self._scheduled = False
        self.drain()

    def inline(self) -> None:
        """The dispatcher runs and drains before each choice: puts need not wake anything."""
        self._inline = True

    def to_loop(self) -> bool:
        """The dispatcher is about to sleep on the loop: later puts schedule a drain.

        Returns False (and stays inline) if items are already queued: drain them
        instead of sleeping.
        """
        with self._mu:
            if self._items:
                return False
            self._inline = False
            return True

    def release(self) -> None:
        """The dispatcher is done (its step ended or failed): what is queued or put later is drained on the loop."""
        with self._mu:
            self._inline = False
            if not self._items or self._scheduled or self._parked:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._scheduled_drain)
        except RuntimeError:  # the loop is closed: the job is being torn down
            pass

    def park(self, timeout: float) -> bool:
        """Block this thread until an item is put or ``timeout`` seconds pass; True if items are queued.

        The caller drains after; the loop does not run meanwhile (callers bound ``timeout``).
        """
        with self._mu:
            if self._items:
                return True
            self._parked = True
        if not self._bell.acquire(True, timeout):
            with self._mu:
                if self._parked:  # nobody rang
                    self._parked = False
                    return bool(self._items)
            # a put rang between the timeout and the mutex: take the ring (released under the mutex)
            self._bell.acquire()
        return True
