"""How fast are the pure schedule layers?  generate + lower + validate per named schedule.

A launcher builds, lowers and validates the schedule on every start, and
``pipeloom schedule`` does it on every call, so it has to stay cheap at
realistic sizes.  The target: under 2 s for 64 ranks x 2 stages per rank x 256
microbatches.  Single-stage schedules (GPipe, 1F1B) run with 1 stage per rank
at the same rank count, so they hold half as many actions.

Several sizes are timed so the table shows whether the cost per action stays
flat (linear growth) or climbs (something quadratic crept in).  Each size is
run ``--repeat`` times and the fastest run is reported, which is the least
noisy estimate on a shared machine.

Usage::

    python benchmarks/schedule_speed.py [--repeat N] [--names A,B] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pipeloom.schedules import SCHEDULE_NAMES, default_stages_per_rank, generate, lower, validate

__all__ = ["Timing", "time_schedule", "main"]

#: (ranks, stages per rank for multi-stage schedules, microbatches); the last is the target size.
SIZES: tuple[tuple[int, int, int], ...] = ((8, 2, 32), (16, 2, 64), (32, 2, 128), (64, 2, 256))
TARGET_SECONDS = 2.0


@dataclass(frozen=True)
class Timing:
    """The fastest of several runs of one schedule at one size; times in seconds."""

    name: str
    ranks: int
    stages_per_rank: int
    microbatches: int
    actions: int  #: actions in the lowered schedule
    generate_s: float
    lower_s: float
    validate_s: float

    @property
    def total_s(self) -> float:
        return self.generate_s + self.lower_s + self.validate_s

    @property
    def us_per_action(self) -> float:
        return 1e6 * self.total_s / self.actions if self.actions else 0.0


def time_schedule(name: str, ranks: int, stages_per_rank: int, microbatches: int, *, repeat: int = 3) -> Timing:
    """Time generate, lower and validate for one schedule; keep the fastest full run."""
    best: Timing | None = None
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        schedule = generate(name, num_ranks=ranks, num_microbatches=microbatches, stages_per_rank=stages_per_rank)
        t1 = time.perf_counter()
        lowered = lower(schedule)
        t2 = time.perf_counter()
        problems = validate(lowered)
        t3 = time.perf_counter()
        if problems:
            print(f"warning: {name} {ranks}x{stages_per_rank}x{microbatches}: {len(problems)} problems, "
                  f"first: {problems[0]}", file=sys.stderr)
        actions = sum(len(acts) for acts in lowered.actions.values())
        run = Timing(name, ranks, stages_per_rank, microbatches, actions, t1 - t0, t2 - t1, t3 - t2)
        if best is None or run.total_s < best.total_s:
            best = run
    assert best is not None
    return best


def _stages_for(name: str, wanted: int) -> int:
    """Multi-stage schedules get ``wanted`` stages per rank; single-stage ones get 1."""
    return wanted if default_stages_per_rank(name) > 1 else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; the fastest is reported (default 3)")
    parser.add_argument("--names", default=None, help="comma-separated schedule names (default: all)")
    parser.add_argument("--quick", action="store_true", help="only the target size, one run")
    args = parser.parse_args(argv)
    names = args.names.split(",") if args.names else list(SCHEDULE_NAMES)
    sizes = SIZES[-1:] if args.quick else SIZES
    repeat = 1 if args.quick else args.repeat

    header = f"{'schedule':<24} {'P':>3} {'V':>2} {'M':>4} {'actions':>8} {'generate':>9} {'lower':>8} {'validate':>9} {'total s':>8} {'us/action':>10}"
    print(f"generate + lower + validate, fastest of {repeat} run(s), Python {sys.version.split()[0]}")
    print(header)
    print("-" * len(header))
    slow: list[Timing] = []
    for name in names:
        for ranks, v, microbatches in sizes:
            t = time_schedule(name, ranks, _stages_for(name, v), microbatches, repeat=repeat)
            print(
                f"{t.name:<24} {t.ranks:>3} {t.stages_per_rank:>2} {t.microbatches:>4} {t.actions:>8} "
                f"{t.generate_s:>9.3f} {t.lower_s:>8.3f} {t.validate_s:>9.3f} {t.total_s:>8.3f} {t.us_per_action:>10.2f}"
            )
            if (ranks, v, microbatches) == SIZES[-1] and t.total_s > TARGET_SECONDS:
                slow.append(t)
    print()
    print("V = stages per rank (single-stage schedules such as GPipe and 1F1B run with V = 1).")
    if slow:
        print(f"over the {TARGET_SECONDS:g} s target at {'x'.join(map(str, SIZES[-1]))}: " + ", ".join(t.name for t in slow))
        return 1
    print(f"all under the {TARGET_SECONDS:g} s target at {'x'.join(map(str, SIZES[-1]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
