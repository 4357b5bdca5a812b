"""The loop thread waits in gloo itself; a watchdog thread keeps the liveness check running meanwhile.

Problem.  On CPU every gloo receive is waited for by one thread per peer
(``transport/tensor.py``), which hands the landed transfer to the dispatcher's
thread (``runtime/landing.py``): one thread switch and one GIL hand-off per
transfer on the critical path, which torch's runtime, blocking in
``work.wait()`` on its main thread, does not pay.  On a latency-bound schedule
(1F1B on two ranks: every microbatch's activation and gradient cross on the
critical path) that hop is what kept pipeloom above torch.  With static shapes
(``RuntimeOptions.static_shapes=True`` on gloo) a step's receives are known
before it starts, so the dispatcher's thread can post them ahead and wait on
the one its next action needs directly -- the same single hop as torch.

The catch.  A gloo ``wait()`` cannot be given up: ``wait(timeout)`` that
expires closes the pair, and torch binds no ``Work.abort()``.  A loop thread
blocked in gloo on a peer that is alive but stopped (SIGSTOP, a hang in user
code) would wait forever: it reads no heartbeats, so it never judges the peer
lost -- the failure pipeloom exists to report.  (A peer that *dies* is no
problem: its connection closes and the wait raises at once.)

Alternatives.  (a) Bounded slices: not possible without closing the pair at
the first slice that expires.  (b) Keep the receiver threads (the hop stays).
(c) This module: while the loop thread is inside such a wait, a watchdog
thread stands in for the loop.  Every ``tick`` (0.1 s) it looks whether the
loop thread is still in the same wait as at the previous tick; if so, it runs
the actor's check on the loop's behalf (under a mutex the loop thread takes
when the wait returns, so the two never touch the actor's state at once):
drain the control plane (heartbeats, aborts, byes), then ask whether a rank
failed (an abort arrived) or the awaited peer is lost (the liveness check).
If so, the watchdog *breaks* the wait on purpose: a 1 ms wait on a fresh
receive from that peer expires, which closes the pair's connection, and the
blocked wait raises; the loop thread then raises the watchdog's error.  The
pair is lost, but the step is failing anyway (a Pipeline runs no step after
a failed one).  A slow peer is never broken: it sends heartbeats, and its own
stall timeout applies.  The watchdog wakes every tick, not once per wait: a
wait costs the loop thread a few attribute writes and one uncontended mutex.
Measured (``benchmarks/RESULTS.md``, "CPU host path, round 5"): with it,
``cpu_overhead.py``'s 1F1B went from 1.03-1.07x torch's step to 0.76x (CPU time
1.34-1.39x -> 0.91x), every other schedule to 0.52-0.72x.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["DirectWait"]


class DirectWait:
    """Waits on gloo ``Work`` objects on the calling (loop) thread, watched by a watchdog thread.

    ``check(peer)`` is called on the watchdog thread, with the loop thread blocked in a wait
    for ``peer`` (and kept out of the actor's state by the mutex): it returns the exception
    the loop thread is to raise when the wait must be broken (a rank failed, the peer is
    lost), else None.  ``breaker(peer)`` makes the blocked wait raise (closes the pair).
    """

    __slots__ = ("_tick", "_check", "_breaker", "_mu", "_serial", "_blocked", "_peer",
                 "_error", "_stop", "_thread", "_name", "broken")

    def __init__(
        self,
        *,
        name: str,
        check: Callable[[int], BaseException | None],
        breaker: Callable[[int], None],
        tick: float = 0.1,
    ) -> None:
        self._name = name
        self._tick = tick
        self._check = check
        self._breaker = breaker
        self._mu = threading.Lock()
        self._serial = 0
        #: the serial number of the wait the loop thread is in (0: none)
        self._blocked = 0
        self._peer = -1
        #: why the watchdog broke a wait (raised by the loop thread); sticky until taken
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: waits the watchdog broke (statistics, tests)
        self.broken = 0

    def wait(self, works: Sequence[Any], peer: int) -> None:
        """Wait for ``works`` (receives from ``peer``) on this thread.

        Raises the watchdog's error if it broke the wait (or broke one before and nobody
        took the error yet), else what the Works raise (RuntimeError: the connection closed).
        """
        if self._thread is None:
            self._start()
        self._serial += 1
        self._peer = peer
        self._blocked = self._serial
        failed: BaseException | None = None
        try:
            for w in works:
                w.wait()
        except RuntimeError as exc:
            failed = exc
        with self._mu:  # the watchdog is not running the actor's check now, and will not
            self._blocked = 0
            err, self._error = self._error, None
        if err is not None:
            raise err from failed
        if failed is not None:
            raise failed

    def close(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(1.0)

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen = 0  # the wait seen blocked at the previous tick
        while not self._stop.wait(self._tick):
            tok = self._blocked
            if not tok or tok != seen:
                seen = tok
                continue
            # the loop thread has been in this one wait for at least a whole tick
            err: BaseException | None = None
            with self._mu:
                if self._blocked != tok:
                    continue
                peer = self._peer
                try:
                    err = self._check(peer)
                except BaseException as exc:  # noqa: BLE001 - a failing check must still free the loop
                    err = exc
                if err is not None:
                    self._error = err
            if err is not None:
                self.broken += 1
                try:
                    self._breaker(peer)
                except Exception:  # noqa: BLE001 - the pair may be closed already
                    pass
                seen = 0
