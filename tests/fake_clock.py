"""A host clock the tests move by hand (liveness decisions, the GPU commit horizon): no waiting, no flakiness."""

from __future__ import annotations


class FakeClock:
    """Callable like ``time.monotonic``/``time.perf_counter`` (seconds); starts at 100 s."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_ms(self, ms: float) -> None:
        self.now += ms * 1e-3
