"""Costs measured on a recorded run, in the simulator's terms.

``pipeloom schedule simulate --costs-from RUN.jsonl`` and ``pipeloom schedule
tune`` need what a step *costs* on this model and machine, not what the
textbook assumes (F=1, B=2).  A recorded trace has it:

* **compute**: the mean duration of each action type per stage (an embedding
  stage and a vocabulary head cost differently), plus the rank's runtime time
  per action -- the dispatcher, handing data on, blocking sends -- spread
  evenly over its actions (the simulator has no runtime of its own, and on a
  CPU or with small stages that time is a large part of the step);
* **transfers**: the mean time from the end of a send (its blocking part
  is already in the sender's runtime time) to the data having landed, fitted
  as ``latency + bytes / bandwidth`` where the run moved payloads of several
  sizes (else latency only), and the mean payload size.  Simulate with
  receives placed early (``recv_placement="early"``): pipeloom posts a
  receive as soon as the sender announces it, not where the list has it;
* **OVERLAP_F_B**: ``overlap`` from the measured pair against its halves;
* **memory**: the most live microbatches per rank and, on GPUs, the CUDA
  peak, so a tuner can scale activation memory.

Costs are in nanoseconds (a plan made from them is written with
``time_unit_ns`` 1).  The first training step is left out when there are
others: it pays for connecting the pairs and warming the allocator.

Why means: the step time is a sum of actions and transfers, and a sum is
predicted by means.  Checked on the CPU benchmark
(``benchmarks/sim_accuracy.py``, every named schedule, 2 gloo ranks on a
shared 2-core machine): with the mean transfer time every simulated step time
was within 7% of the measured mean, both where compute dominates and where
the runtime does; the median transfer time (the receiver being busy makes the
distribution long-tailed) under-predicted by up to 38%.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from pipeloom.schedules import Costs

from .trace_model import TraceModel, summarize

__all__ = ["RunCosts", "costs_from_trace"]


@dataclass(frozen=True)
class RunCosts:
    """What :func:`costs_from_trace` measured (times in ns)."""

    costs: Costs
    action_costs: dict[tuple[int, str, int | None], float]
    """(stage, type, None) -> mean duration plus the rank's runtime time per action."""
    compute_ns: dict[tuple[int, str], float]
    """(stage, type) -> mean duration of the action alone."""
    overhead_per_action_ns: dict[int, float]
    """rank -> runtime, send and wake-up time per action."""
    schedule: str | None
    num_microbatches: int | None
    world_size: int
    stage_to_rank: list[int]
    steps: list[int]
    step_ns: float
    """Measured mean step time over ``steps``."""
    peak_live_mb: dict[int, int] = field(default_factory=dict)
    peak_bytes: dict[int, int] = field(default_factory=dict)
    """rank -> CUDA peak allocated (GPU runs only)."""
    runtime_per_action_ns: dict[int, float] = field(default_factory=dict)
    """rank -> the same without the sends (what does not depend on how much an action sends)."""
    send_per_transfer_ns: dict[int, float] = field(default_factory=dict)
    """rank -> mean blocking time of one send (of ``costs.activation_bytes`` on average)."""

    @property
    def stages_per_rank(self) -> int:
        return max(1, len(self.stage_to_rank) // max(self.world_size, 1))

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {
            "costs": asdict(self.costs),
            "action_costs": {f"{s}{t}": v for (s, t, _), v in sorted(self.action_costs.items())},
            "overhead_per_action_ns": {str(k): v for k, v in sorted(self.overhead_per_action_ns.items())},
            "schedule": self.schedule,
            "num_microbatches": self.num_microbatches,
            "stage_to_rank": self.stage_to_rank,
            "steps": self.steps,
            "step_ns": self.step_ns,
        }


def costs_from_trace(model: TraceModel, *, skip_warmup: int | None = None) -> RunCosts:
    """Per-stage, per-type costs and transfer times of a recorded run (ValueError if it is a plan or has no actions)."""
    if model.source == "simulation":
        raise ValueError("costs come from a recorded run; this trace is a simulated plan")
    train = model.train_steps
    if not train:
        raise ValueError("the trace has no training step to measure")
    skip = (1 if len(train) > 1 else 0) if skip_warmup is None else min(skip_warmup, len(train) - 1)
    summary = summarize(model, skip_warmup=skip, critical=False)
    steps = list(summary.steps)
    chosen = set(steps)
    durations: dict[tuple[int, str], list[int]] = {}
    ovl: list[tuple[str, str, int]] = []
    n_actions: dict[int, int] = {}
    for r, lst in model.actions.items():
        for a in lst:
            if a.step not in chosen:
                continue
            n_actions[r] = n_actions.get(r, 0) + 1
            if a.type in ("F", "B", "I", "W") and isinstance(a.stage, int):
                durations.setdefault((a.stage, a.type), []).append(a.duration)
            elif a.type == "OVERLAP_F_B" and isinstance(a.event.get("sub"), list) and len(a.event["sub"]) == 2:
                ovl.append((str(a.event["sub"][0]), str(a.event["sub"][1]), a.duration))
    if not durations and not ovl:
        raise ValueError("the trace has no F/B/I/W actions to measure")
    compute = {k: sum(v) / len(v) for k, v in durations.items()}
    overhead: dict[int, float] = {}
    runtime: dict[int, float] = {}
    per_send: dict[int, float] = {}
    n_sends = {r: sum(1 for t in model.transfers.get(r, []) if t.kind == "send" and t.step in chosen) for r in model.ranks}
    for att in summary.attribution:
        n = n_actions.get(att.rank, 0)
        sends = att.sends_ns + att.by_cause().get("sends", 0)
        rt = att.runtime_ns + att.by_cause().get("wakeup", 0)
        overhead[att.rank] = (rt + sends) / n if n else 0.0
        runtime[att.rank] = rt / n if n else 0.0
        per_send[att.rank] = sends / n_sends[att.rank] if n_sends.get(att.rank) else 0.0
    place = list(model.header.get("stage_to_rank") or [])
    action_costs: dict[tuple[int, str, int | None], float] = {}
    for (stage, typ), mean in compute.items():
        rank = place[stage] if stage < len(place) else None
        action_costs[(stage, typ, None)] = mean + (overhead.get(rank, 0.0) if rank is not None else 0.0)
    # overlap factor from measured pairs whose halves also ran alone
    overlap = 0.0
    import re

    leaf = re.compile(r"^(\d+)([A-Z]+)(\d+)$")
    fac = []
    for n1, n2, d in ovl:
        m1, m2 = leaf.match(n1), leaf.match(n2)
        if not (m1 and m2):
            continue
        c1 = compute.get((int(m1.group(1)), m1.group(2)))
        c2 = compute.get((int(m2.group(1)), m2.group(2)))
        if c1 and c2:
            fac.append(min(1.0, max(0.0, (d - max(c1, c2)) / min(c1, c2))))
    if fac:
        overlap = sum(fac) / len(fac)
    # transfers
    samples: list[tuple[int, int]] = []
    for send, recv in model.transfer_pairs():
        if send.step in chosen:
            samples.append((int(send.event.get("bytes", 0) or 0), max(0, recv.end - send.end)))
    latency, bandwidth, act_bytes = 0.0, None, 0
    if samples:
        act_bytes = int(round(sum(b for b, _ in samples) / len(samples)))
        sizes = {b for b, _ in samples}
        latency = float(statistics.mean(t for _, t in samples))
        if len(sizes) > 1:
            # least squares t = l + b / bw on the per-size means
            by: dict[int, list[int]] = {}
            for b, t in samples:
                by.setdefault(b, []).append(t)
            xs = sorted(by)
            ys = [statistics.mean(by[x]) for x in xs]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            sxx = sum((x - mx) ** 2 for x in xs)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
            if slope > 0:
                bandwidth = 1.0 / slope
                latency = max(0.0, my - slope * mx)
    costs = Costs(
        F=_mean_type(compute, "F"), B=_mean_type(compute, "B"), I=_mean_type(compute, "I"), W=_mean_type(compute, "W"),
        send_latency=latency, bandwidth=bandwidth, activation_bytes=act_bytes, overlap=overlap,
    )
    peak_live: dict[int, int] = {}
    peak_bytes: dict[int, int] = {}
    for r, evs in model.memory.items():
        for e in evs:
            if e.get("step") in chosen:
                peak_live[r] = max(peak_live.get(r, 0), int(e.get("live_mb", 0) or 0))
                if isinstance(e.get("peak"), int):
                    peak_bytes[r] = max(peak_bytes.get(r, 0), e["peak"])
    world = model.header.get("world_size")
    return RunCosts(
        costs=costs,
        action_costs=action_costs,
        compute_ns=compute,
        overhead_per_action_ns=overhead,
        runtime_per_action_ns=runtime,
        send_per_transfer_ns=per_send,
        schedule=model.header.get("schedule"),
        num_microbatches=model.header.get("num_microbatches"),
        world_size=int(world) if isinstance(world, int) else len(model.ranks),
        stage_to_rank=place,
        steps=steps,
        step_ns=summary.mean_step_ns,
        peak_live_mb=peak_live,
        peak_bytes=peak_bytes,
    )


def _mean_type(compute: dict[tuple[int, str], float], typ: str) -> float:
    v = [c for (_, t), c in compute.items() if t == typ]
    if v:
        return sum(v) / len(v)
    # a schedule without this type: a sensible stand-in from the others
    f = [c for (_, t), c in compute.items() if t == "F"]
    base = sum(f) / len(f) if f else 1.0
    return {"F": base, "B": 2 * base, "I": base, "W": base}[typ]
