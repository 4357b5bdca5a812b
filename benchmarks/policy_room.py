"""How much could a dispatch policy gain over the static list order? (issue 19, "measure the room")

Simulated, no hardware: every named schedule at 2 and 4 ranks runs one step
under each policy with the *same* per-action costs, drawn per trial from a
workload (microbatch lengths from a distribution, compute proportional to
length; per-action jitter; a slow rank).  Policies (``pipeloom.schedules.
policy_sim``; ``ready`` and ``guarded`` run the runtime's own
``schedules/dispatch.py``):

* ``ready`` -- the first ready action in list order (forwards in order,
  live-microbatch cap): the runtime's old dispatcher;
* ``critical`` -- longest planned remaining dependency chain first, W last;
* ``guarded`` -- the head as soon as it is ready, a later action only inside
  the hole the static plan (mean costs) leaves before the head;
* ``auto`` -- what the runtime's default does for this schedule:
  ``choose_rule`` picks ``ready``, ``critical``, ``guarded`` or ``list`` once, from a
  simulation with *default* costs and uniform lengths, not the workload's;

Every policy is the runtime's own rule (``schedules/dispatch.py``) and knows
only the mean cost per stage and action type, not the draw.
* ``best`` -- each draw's best of the above (an oracle choosing per step);
* ``bound`` -- no order can beat it (busiest rank's work plus its unavoidable
  head and tail, or the longest chain): not necessarily reachable under the
  memory cap.

Gains are ``static / policy - 1`` of the mean step time (positive: faster).

    python benchmarks/policy_room.py [--trials 30] [--microbatches 8] [--markdown]
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Sequence

from pipeloom.schedules import SCHEDULE_NAMES, Costs, generate
from pipeloom.schedules.dispatch import choose_rule
from pipeloom.schedules.policy_sim import _bottom_levels, _compute_lists, _lower_bound, draw_costs, simulate_policy

__all__ = ["WORKLOADS", "main", "room"]

POLICIES = ("static", "dynamic", "critical", "guarded")
SHOWN = {"dynamic": "ready", "critical": "critical", "guarded": "guarded"}


def _uniform(rng: random.Random, m: int) -> list[float]:
    return [rng.uniform(0.25, 1.0) for _ in range(m)]


def _bimodal(rng: random.Random, m: int) -> list[float]:
    return [1.0 if rng.random() < 0.3 else 0.25 for _ in range(m)]


def _longtail(rng: random.Random, m: int) -> list[float]:
    return [min(1.0, 0.15 * rng.lognormvariate(0.0, 0.8)) / 0.15 / 6.0 + 0.05 for _ in range(m)]


#: name -> (lengths drawer or None, jitter sigma, slow ranks {rank: factor})
WORKLOADS: dict[str, tuple[Callable[[random.Random, int], list[float]] | None, float, dict[int, float]]] = {
    "uniform": (_uniform, 0.0, {}),
    "bimodal": (_bimodal, 0.0, {}),
    "longtail": (_longtail, 0.0, {}),
    "jitter": (None, 0.2, {}),
    "slow-rank": (None, 0.0, {1: 1.5}),
    "fixed": (None, 0.0, {}),
}


def room(name: str, ranks: int, workload: str, *, trials: int, microbatches: int, seed: int = 0,
         costs: Costs | None = None) -> dict[str, float]:
    """Mean step time per policy (and ``best``, ``bound``, ``auto``) for one schedule and workload."""
    costs = Costs(F=1, B=2, I=1, W=1, send_latency=0.05) if costs is None else costs
    sched = generate(name, num_ranks=ranks, num_microbatches=microbatches)
    draw, jitter, slow = WORKLOADS[workload]
    rng = random.Random(seed)
    lists = _compute_lists(sched)
    totals = dict.fromkeys([*POLICIES, "best", "bound"], 0.0)
    for _ in range(trials):
        lengths = None
        if draw is not None:
            raw = draw(rng, microbatches)
            mean = sum(raw) / len(raw)
            lengths = [x / mean for x in raw]  # same total work as uniform lengths
        durs = draw_costs(sched, costs, lengths=lengths, jitter=jitter, slow=slow, rng=rng)
        prio = _bottom_levels(sched, durs, costs.transfer)
        # every policy is the runtime's rule, knowing only the mean cost per stage and type (not the draw)
        got = {p: simulate_policy(sched, p, durs, transfer=costs.transfer).makespan for p in POLICIES}
        for p, v in got.items():
            totals[p] += v
        totals["best"] += min(got.values())
        totals["bound"] += _lower_bound(sched, lists, durs, prio, costs.transfer)
    out = {p: v / trials for p, v in totals.items()}
    rule = choose_rule(sched)
    out["auto"] = out[{"list": "static", "ready": "dynamic", "critical": "critical", "guarded": "guarded"}[rule]]
    out["auto_rule"] = rule  # type: ignore[assignment]
    return out


def _gain(static: float, v: float) -> str:
    return f"{static / v - 1:+.1%}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--schedules", default=",".join(SCHEDULE_NAMES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(f"policy room: {args.microbatches} microbatches, {args.trials} draws, costs F=1 B=2 I=1 W=1 transfer 0.05; "
          "gain = static / policy - 1 (mean step time)\n")
    print("| schedule | ranks | workload | ready | critical | guarded | auto (rule) | best | bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ranks in (int(x) for x in args.ranks.split(",")):
        for name in args.schedules.split(","):
            for wl in args.workloads.split(","):
                r = room(name, ranks, wl, trials=args.trials if wl != "fixed" else 1, microbatches=args.microbatches, seed=args.seed)
                st = r["static"]
                cells = [_gain(st, r[p]) for p in ("dynamic", "critical", "guarded")]
                print(f"| {name} | {ranks} | {wl} | " + " | ".join(cells)
                      + f" | {_gain(st, r['auto'])} ({r['auto_rule']}) | {_gain(st, r['best'])} | {_gain(st, r['bound'])} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
