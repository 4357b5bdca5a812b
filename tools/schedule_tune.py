"""``pipeloom schedule tune``: which configuration to run next, ranked by simulated step time.

The problem: a pipeline's step time depends on the schedule, the number of
microbatches and the stages per rank in ways that textbook bubble formulas
get wrong once the runtime's own time per action, transfer latency and stage
imbalance are real -- and trying every configuration on the cluster costs a
job per point.  A recorded run already measured the costs that matter (see
:mod:`pipeloom.tools.run_costs`); the simulator turns them into a step time
for any configuration in microseconds.

How a recorded run's costs are carried to another configuration (same
ranks, same global batch):

* **compute** scales with the microbatch size: a candidate with ``m``
  microbatches costs ``m0 / m`` times the recorded per-microbatch compute;
* **stages per rank**: with the recorded ``v0`` the recorded per-stage costs
  are kept (an embedding or a head stays where it was); with another ``v``
  the model's total compute is split evenly into ``p * v`` stages;
* **types**: a schedule that splits the backward (I, W) where the run had
  only B gets ``I = W = B / 2``, and the other way ``B = I + W``;
* **runtime time per action** (the dispatcher, waking up; measured per rank)
  does not scale: it is added to every action as measured -- which is why
  more microbatches or stages stop paying on a CPU or with small stages;
* **sends**: an action whose output goes to another rank (in the
  candidate's placement) also pays one send's blocking time, scaled with the
  payload;
* **transfers** take ``latency + bytes / bandwidth`` with the activation
  scaled like the microbatch (a run with one payload size gives no
  latency/bandwidth split: the whole time is taken as proportional to the
  bytes);
* **activation memory** at peak is the simulated peak of live
  microbatch-stages times the memory of one, scaled by ``m0 / m`` and
  ``v0 / v`` (a smaller stage holds fewer layers' activations); the memory of
  one recorded microbatch-stage is ``--activation-memory`` or, failing that,
  the stage-boundary activation size (a lower bound, said in the output).

Candidates the schedule rejects (too few microbatches for the ranks...) are
skipped with the reason.  The ranking is the simulator's; its accuracy on the
run's own configuration is printed beside it (measured vs simulated).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipeloom.schedules import (
    SCHEDULE_NAMES,
    ScheduleError,
    generate,
    lower,
    simulate,
)

from ..schedules.dataflow import consumer_stage
from .run_costs import RunCosts

__all__ = ["Candidate", "TuneResult", "tune", "format_tune", "parse_size"]


@dataclass(frozen=True)
class Candidate:
    schedule: str
    microbatches: int
    stages_per_rank: int
    step_ns: float
    bubble: float
    peak_live: int
    """Most live microbatch-stages on any rank."""
    peak_activation_bytes: int
    fits: bool

    def to_json(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "microbatches": self.microbatches, "stages_per_rank": self.stages_per_rank,
                "step_ns": self.step_ns, "bubble_fraction": self.bubble, "peak_live_microbatch_stages": self.peak_live,
                "peak_activation_bytes": self.peak_activation_bytes, "fits": self.fits}


@dataclass(frozen=True)
class TuneResult:
    candidates: tuple[Candidate, ...]
    """Every simulated candidate, fastest first (those over the memory cap included, ``fits`` False)."""
    skipped: tuple[str, ...]
    recorded: Candidate | None
    """The run's own configuration, simulated."""
    measured_step_ns: float
    memory_cap: int | None
    activation_memory: int
    activation_memory_is_proxy: bool

    def to_json(self) -> dict[str, Any]:
        return {"candidates": [c.to_json() for c in self.candidates], "skipped": list(self.skipped),
                "recorded": self.recorded.to_json() if self.recorded else None, "measured_step_ns": self.measured_step_ns,
                "memory_cap": self.memory_cap, "activation_memory": self.activation_memory,
                "activation_memory_is_proxy": self.activation_memory_is_proxy}


def parse_size(text: str) -> int:
    """``8GiB``, ``512MiB``, ``1e9`` -> bytes (ValueError on anything else)."""
    t = text.strip()
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}
    low = t.lower()
    for u, mult in units.items():
        if low.endswith(u):
            num = low[: -len(u)].strip()
            break
    else:
        num, mult = low, 1
    try:
        v = float(num)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 8GiB, 512MiB, 1000000)") from None
    if v <= 0:
        raise ValueError(f"a size must be > 0 (got {text!r})")
    return int(v * mult)


def _type_costs(compute: dict[tuple[int, str], float], stage: int) -> dict[str, float]:
    c = {t: compute[(stage, t)] for t in ("F", "B", "I", "W") if (stage, t) in compute}
    if "B" not in c and "I" in c and "W" in c:
        c["B"] = c["I"] + c["W"]
    if "B" in c:
        c.setdefault("I", c["B"] / 2)
        c.setdefault("W", c["B"] / 2)
    if "F" not in c:
        c["F"] = c.get("B", 0.0) / 2
    c.setdefault("B", 2 * c["F"])
    c.setdefault("I", c["B"] / 2)
    c.setdefault("W", c["B"] / 2)
    return c


def _crosses(place: Sequence[int], s: int, t: str) -> bool:
    """Whether the output of ``t`` on stage ``s`` is sent to another rank."""
    if t not in ("F", "B", "I"):
        return False
    c = consumer_stage("F" if t == "F" else "B", s, len(place))
    return c is not None and place[c] != place[s]


def _action_costs(run: RunCosts, p: int, v: int, m: int, place: Sequence[int] | None = None) -> dict[tuple[int, str, int | None], float]:
    """Per-stage action costs of a candidate: compute scaled by microbatch size, plus the rank's runtime
    time per action, plus one send's blocking time (scaled by the payload) where the output crosses ranks."""
    m0 = run.num_microbatches or m
    scale = m0 / m
    v0 = run.stages_per_rank
    place0 = run.stage_to_rank
    runtime = run.runtime_per_action_ns or run.overhead_per_action_ns
    mean_rt = sum(runtime.values()) / max(len(runtime), 1)
    sends = run.send_per_transfer_ns
    mean_send = sum(sends.values()) / max(len(sends), 1) if sends else 0.0
    stages0 = sorted({s for s, _ in run.compute_ns})
    place = list(place) if place is not None else [s % p for s in range(p * v)]
    out: dict[tuple[int, str, int | None], float] = {}
    if v == v0 and p == run.world_size and len(place) == len(place0):
        for s in stages0:
            r = place0[s] if s < len(place0) else None
            o = runtime.get(r, mean_rt) if r is not None else mean_rt
            snd = sends.get(r, mean_send) if r is not None else mean_send
            for t, c in _type_costs(run.compute_ns, s).items():
                out[(s, t, None)] = c * scale + o + (snd * scale if _crosses(place, s, t) else 0.0)
        return out
    total = {t: sum(_type_costs(run.compute_ns, s)[t] for s in stages0) for t in ("F", "B", "I", "W")}
    n = p * v
    for s in range(n):
        for t, c in total.items():
            out[(s, t, None)] = c / n * scale + mean_rt + (mean_send * scale if _crosses(place, s, t) else 0.0)
    return out


def tune(
    run: RunCosts,
    *,
    schedules: Sequence[str] = SCHEDULE_NAMES,
    microbatches: Sequence[int] | None = None,
    stages_per_rank: Sequence[int] = (1, 2),
    memory_cap: int | None = None,
    activation_memory: int | None = None,
) -> TuneResult:
    """Simulate every candidate configuration with ``run``'s costs; see the module docstring."""
    p = run.world_size
    m0 = run.num_microbatches or 1
    v0 = run.stages_per_rank
    if microbatches is None:
        microbatches = sorted({p, 2 * p, 4 * p, 8 * p, m0})
    act0 = activation_memory if activation_memory is not None else run.costs.activation_bytes
    proxy = activation_memory is None
    cands: list[Candidate] = []
    skipped: list[str] = []
    recorded: Candidate | None = None
    for name in schedules:
        for v in stages_per_rank:
            for m in microbatches:
                try:
                    sched = generate(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)
                except ScheduleError as exc:
                    skipped.append(f"{name} m={m} v={v}: {exc}")
                    continue
                scale = m0 / m
                costs = run.costs
                if costs.bandwidth is None and costs.activation_bytes:
                    # one payload size measured: let the transfer time follow the payload
                    costs = replace(costs, bandwidth=costs.activation_bytes / max(costs.send_latency, 1e-9), send_latency=0.0)
                costs = replace(costs, activation_bytes=max(1, int(costs.activation_bytes * scale)))
                try:
                    low = lower(sched, comms=True, recv_placement="early", costs=costs)
                    res = simulate(low, costs, action_costs=_action_costs(run, p, v, m, sched.stage_to_rank))
                except ScheduleError as exc:
                    skipped.append(f"{name} m={m} v={v}: {exc}")
                    continue
                peak = max(res.peak_live_activations.values(), default=0)
                mem = int(peak * act0 * scale * v0 / v)
                c = Candidate(name, m, v, res.makespan, res.overall_bubble_fraction, peak, mem,
                              memory_cap is None or mem <= memory_cap)
                cands.append(c)
                if (name, m, list(sched.stage_to_rank)) == (run.schedule, m0, run.stage_to_rank):
                    recorded = c
    cands.sort(key=lambda c: (not c.fits, c.step_ns))
    return TuneResult(tuple(cands), tuple(skipped), recorded, run.step_ns, memory_cap, act0, proxy)


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3f} ms"


def _size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_tune(r: TuneResult, *, top: int = 5, source: str = "") -> str:
    lines = []
    if r.recorded is not None and r.measured_step_ns:
        err = (r.recorded.step_ns - r.measured_step_ns) / r.measured_step_ns
        lines.append(f"recorded configuration {r.recorded.schedule} m={r.recorded.microbatches} v={r.recorded.stages_per_rank}: "
                     f"measured {_ms(r.measured_step_ns)}, simulated {_ms(r.recorded.step_ns)} ({err:+.1%})")
    fits = [c for c in r.candidates if c.fits]
    cap = f" under {_size(r.memory_cap)} of activations per rank" if r.memory_cap is not None else ""
    lines.append(f"top {min(top, len(fits))} of {len(r.candidates)} candidates{cap}, by simulated step time:")
    rows = [("#", "schedule", "microbatches", "stages/rank", "step time", "vs recorded", "bubble", "peak act. (mb-stages)", "peak act. memory")]
    for i, c in enumerate(fits[:top], 1):
        vs = f"{(c.step_ns / r.recorded.step_ns - 1):+.1%}" if r.recorded is not None and r.recorded.step_ns else "-"
        rows.append((str(i), c.schedule, str(c.microbatches), str(c.stages_per_rank), _ms(c.step_ns), vs, f"{c.bubble:.1%}",
                     str(c.peak_live), _size(c.peak_activation_bytes)))
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in rows]
    over = [c for c in r.candidates if not c.fits]
    if over:
        best = over[0]
        lines.append(f"{len(over)} over the cap (fastest: {best.schedule} m={best.microbatches} v={best.stages_per_rank}, "
                     f"{_ms(best.step_ns)}, {_size(best.peak_activation_bytes)})")
    if r.activation_memory_is_proxy:
        lines.append(f"activation memory per recorded microbatch-stage: {_size(r.activation_memory)} = the stage-boundary "
                     "activation (a lower bound; give --activation-memory for the real figure)")
    if r.skipped:
        lines.append(f"skipped {len(r.skipped)} configurations the schedules reject, e.g. {r.skipped[0]}")
    return "\n".join(lines)

