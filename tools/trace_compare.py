"""Planned against actual: a recorded step set against a simulated plan, action by action.

The simulator says how long a schedule *should* take under given costs; a
recorded run says how long it *did*.  With the plan's costs measured from the
run itself (``pipeloom schedule simulate --costs-from RUN.jsonl``), what is
left between the two is what the cost model does not know -- variance, the
runtime's own time, transfers slower than their mean -- and *where* it
appears is the useful part: the first action whose slip grows is where the
run left the plan.

An action is matched by rank and name (``1F3`` on rank 1 in both); times are
measured from each step window's start, so the slip of an action is
``actual start - planned start``.  Actions in only one of the two are listed
(a different schedule or microbatch count is refused first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .trace_model import TraceModel, format_ns

__all__ = ["ActionSlip", "Comparison", "compare", "format_comparison"]


@dataclass(frozen=True)
class ActionSlip:
    rank: int
    name: str
    planned_start: int
    actual_start: int
    planned_ns: int
    actual_ns: int
    grew: int
    """How much the slip grew over the rank's previous action (where the run left the plan)."""

    @property
    def slip(self) -> int:
        return self.actual_start - self.planned_start

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "name": self.name, "planned_start_ns": self.planned_start, "actual_start_ns": self.actual_start,
                "slip_ns": self.slip, "planned_ns": self.planned_ns, "actual_ns": self.actual_ns, "slip_growth_ns": self.grew}


@dataclass(frozen=True)
class Comparison:
    step: int
    planned_step_ns: int
    actual_step_ns: int
    slips: tuple[ActionSlip, ...]
    only_in_run: tuple[str, ...]
    only_in_plan: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "planned_step_ns": self.planned_step_ns, "actual_step_ns": self.actual_step_ns,
                "actions": [s.to_json() for s in self.slips], "only_in_run": list(self.only_in_run),
                "only_in_plan": list(self.only_in_plan)}


def compare(run: TraceModel, plan: TraceModel, *, step: int | None = None) -> Comparison:
    """Match ``step`` of ``run`` (default: its last training step) against ``plan``'s step (ValueError if they differ in kind)."""
    for key in ("schedule", "num_microbatches", "world_size"):
        a, b = run.header.get(key), plan.header.get(key)
        if a is not None and b is not None and a != b:
            raise ValueError(f"the run and the plan differ in {key}: {a!r} vs {b!r}")
    steps = run.train_steps or run.steps
    if not steps:
        raise ValueError("the run has no steps")
    step = steps[-1] if step is None else step
    if not plan.steps:
        raise ValueError("the plan has no steps")
    pstep = plan.steps[0]
    rlo, rhi = run.window(step)
    plo, phi = plan.window(pstep)
    planned = {(a.rank, a.name): a for r in plan.ranks for a in plan.actions_of(r, pstep)}
    actual = {(a.rank, a.name): a for r in run.ranks for a in run.actions_of(r, step)}
    slips: list[ActionSlip] = []
    for r in run.ranks:
        prev_slip = 0
        for a in run.actions_of(r, step):
            p = planned.get((r, a.name))
            if p is None:
                continue
            s = ActionSlip(r, a.name, p.start - plo, a.start - rlo, p.duration, a.duration, 0)
            s = ActionSlip(r, a.name, s.planned_start, s.actual_start, s.planned_ns, s.actual_ns, s.slip - prev_slip)
            prev_slip = s.slip
            slips.append(s)
    only_run = tuple(sorted(f"rank {r} {n}" for r, n in actual.keys() - planned.keys()))
    # zero-cost plan actions (REDUCE_GRAD without data parallelism) have no counterpart to miss
    only_plan = tuple(sorted(f"rank {r} {n}" for r, n in planned.keys() - actual.keys() if planned[(r, n)].duration > 0))
    return Comparison(step, phi - plo, rhi - rlo, tuple(slips), only_run, only_plan)


def format_comparison(c: Comparison, *, top: int = 10) -> str:
    diff = c.actual_step_ns - c.planned_step_ns
    pct = f" ({100 * diff / c.planned_step_ns:+.1f}%)" if c.planned_step_ns else ""
    lines = [f"run step {c.step}: {format_ns(c.actual_step_ns)}, plan {format_ns(c.planned_step_ns)}: "
             f"{'+' if diff >= 0 else ''}{format_ns(diff)}{pct}"]
    by_rank: dict[int, list[ActionSlip]] = {}
    for s in c.slips:
        by_rank.setdefault(s.rank, []).append(s)
    for r, lst in sorted(by_rank.items()):
        pd = sum(s.planned_ns for s in lst)
        ad = sum(s.actual_ns for s in lst)
        lines.append(f"rank {r}: {len(lst)} actions, slip at its last action {format_ns(lst[-1].slip)}, "
                     f"compute planned {format_ns(pd)} vs actual {format_ns(ad)}")
    rows = [("rank", "action", "planned start", "actual start", "slip", "grew", "planned", "actual")]
    chosen = sorted(c.slips, key=lambda s: -abs(s.slip))[:top] if top else list(c.slips)
    chosen.sort(key=lambda s: (s.rank, s.planned_start))
    for s in chosen:
        rows.append((str(s.rank), s.name, format_ns(s.planned_start), format_ns(s.actual_start), format_ns(s.slip),
                     format_ns(s.grew), format_ns(s.planned_ns), format_ns(s.actual_ns)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    title = "every action" if not top else f"the {len(chosen)} largest slips"
    lines += ["", f"{title} (slip = actual start - planned start, from the step's start; grew: over the rank's previous action):"]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in rows]
    growth = sorted(c.slips, key=lambda s: -s.grew)[:3]
    if growth and growth[0].grew > 0:
        lines += ["", "where the run left the plan (largest slip growth): "
                  + "; ".join(f"rank {s.rank} {s.name} +{format_ns(s.grew)}" for s in growth if s.grew > 0)]
    if c.only_in_run:
        lines.append("only in the run: " + ", ".join(c.only_in_run[:20]))
    if c.only_in_plan:
        lines.append("only in the plan: " + ", ".join(c.only_in_plan[:20]))
    return "\n".join(lines)
