"""What a rank trace says: spans, statistics, lane layout and the viewer's state.

Everything ``pipeloom trace`` shows is computed here, as plain functions over
plain data, so that the terminal UI, ``trace summary`` and the tests agree by
construction: the UI only formats what this module returns.  Nothing here
imports torch, zmq or textual; a trace of a 10,000-step job must open in a
fraction of a second and the tests of these numbers run in milliseconds.

Definitions (the numbers mean nothing without them)
---------------------------------------------------
* A step's **window** is the job's time for that step: from the first
  rank's ``step`` start to the last rank's ``step`` end, cut where the next
  step's window begins, so windows never overlap (for traces without
  ``step`` events, the span of that step's events).  Every rank is measured
  against the same window, so a rank that finishes early shows the rest of
  the step as bubble -- as in the textbook bubble fraction and in
  :func:`pipeloom.schedules.simulate`.
* **busy** is the time a rank's compute lane is occupied: the summed
  durations of its ``action`` events inside the window, except ``UNSHARD``
  (an all-gather on its own lane, as in the simulator).  Sends are made
  right *after* the action that produced the data (their blocking time is
  outside the action's span); receives complete in the background; neither
  adds to busy.
* **idle** = window - busy; **busy %** = busy / window; **bubble %** =
  idle / window.  **waiting** is the part the dispatcher spent asleep with
  nothing ready (``wait`` events).  The full split of the window -- actions
  by type, waits by cause and peer, sends, runtime, previous step, outside
  -- is :mod:`pipeloom.tools.trace_analysis`'s attribution, which adds up
  to the window exactly.
* The **step time** is the window's length.
* Eval steps (``"eval": true``) are left out of summaries unless asked for.

Why a separate view state: what is selected and which time range is shown is
the part of the UI that can be wrong in ways a screenshot does not reveal
(selection on the wrong rank after a step change, a zoom that drifts off the
trace).  :class:`ViewState` holds it, and the UI only maps keys to its
methods, so tests drive it directly as well as through the UI.
"""

from __future__ import annotations

import bisect
import importlib.util
import math
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ..schedules.dataflow import producer_stage

__all__ = [
    "Span",
    "TraceModel",
    "RankStats",
    "WaitInfo",
    "TraceSummary",
    "ActionDetails",
    "ViewState",
    "TraceBuffer",
    "trace_api",
    "load_trace",
    "summarize",
    "format_summary",
    "describe_action",
    "lane_cells",
    "transfer_name",
    "category",
    "format_ns",
]

CATEGORIES = ("F", "B", "I", "W", "OVERLAP_F_B", "comm", "FSDP", "REDUCE_GRAD", "wait")
"""Colour classes of spans, in legend order."""


def trace_api() -> ModuleType:
    """``pipeloom.runtime.trace`` without importing torch.

    ``pipeloom.runtime/__init__`` imports the actor and with it torch (seconds
    of start-up), while the trace format module itself is stdlib-only.  Until
    the runtime package imports lazily, load the module file under its own
    name; a later ``import pipeloom.runtime`` finds it in ``sys.modules`` and
    reuses it, so there is only ever one ``TraceFile`` class.
    """
    name = "pipeloom.runtime.trace"
    mod = sys.modules.get(name)
    if mod is not None:
        return mod
    pkg = importlib.util.find_spec("pipeloom.runtime")  # imports ``pipeloom`` (torch-free), not the runtime
    assert pkg is not None and pkg.submodule_search_locations
    path = os.path.join(list(pkg.submodule_search_locations)[0], "trace.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def load_trace(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> TraceModel:
    """Read one trace file or several per-rank files of one job into a :class:`TraceModel`."""
    tf = trace_api().read_trace(paths)
    return TraceModel(tf.header, tf.events)


# ---------------------------------------------------------------- spans


@dataclass(frozen=True, eq=False)
class Span:
    """One interval on one rank: an action, a wait, or a transfer (times in ns on the trace's clock)."""

    kind: str
    """``action``, ``wait``, ``send`` or ``recv``."""
    rank: int
    step: int
    start: int
    end: int
    name: str
    """Torch's spelling: ``1F3``, ``1SEND_F3`` (producer side), ``2RECV_F3`` (consumer side), ``wait``."""
    type: str
    """The action type (``F`` ... ``REDUCE_GRAD``), ``SEND_F``/``RECV_B``..., or ``WAIT``."""
    stage: int | None
    mb: int | None
    event: Mapping[str, Any] = field(repr=False)
    """The trace event it came from."""

    @property
    def duration(self) -> int:
        return self.end - self.start


def transfer_name(ev: Mapping[str, Any]) -> str:
    """Torch's name for a send or receive event.

    A send is named from the producing stage (stage 1's forward output to
    stage 2, microbatch 3: ``1SEND_F3``), a receive from the consuming stage
    (``2RECV_F3``), as in torch's lowered schedules; the event itself carries
    the consuming stage.
    """
    kind = ev.get("kind", "F")
    stage = int(ev.get("stage", 0))
    mb = ev.get("mb")
    mb_s = "" if mb is None else str(mb)
    if ev["ev"] == "send":
        # (a trace from disk may be malformed: name what it says rather than fail)
        producer = producer_stage(kind, stage) if kind in ("F", "B") else None
        if producer is None:
            return f"?SEND_{kind}{mb_s}"
        return f"{producer}SEND_{kind}{mb_s}"
    return f"{stage}RECV_{kind}{mb_s}"


def category(span: Span) -> str:
    """Colour class of a span (one of :data:`CATEGORIES`)."""
    if span.kind == "wait":
        return "wait"
    if span.kind in ("send", "recv"):
        return "comm"
    if span.type in ("UNSHARD", "RESHARD"):
        return "FSDP"
    if span.type in CATEGORIES:
        return span.type
    return "comm" if "SEND" in span.type or "RECV" in span.type else "F"


def _span(ev: Mapping[str, Any]) -> Span | None:
    kind = ev.get("ev")
    try:
        rank, step, start, end = int(ev["rank"]), int(ev.get("step", 0)), int(ev["start"]), int(ev["end"])
    except (KeyError, TypeError, ValueError):
        return None
    if kind == "action":
        return Span("action", rank, step, start, end, str(ev.get("name", "?")), str(ev.get("type", "?")), ev.get("stage"), ev.get("mb"), ev)
    if kind == "wait":
        return Span("wait", rank, step, start, end, "wait", "WAIT", None, None, ev)
    if kind in ("send", "recv"):
        name = transfer_name(ev)
        typ = f"{'SEND' if kind == 'send' else 'RECV'}_{ev.get('kind', 'F')}"
        return Span(kind, rank, step, start, end, name, typ, ev.get("stage"), ev.get("mb"), ev)
    return None


_start = lambda s: s.start  # noqa: E731


class TraceModel:
    """A trace indexed for viewing: spans by rank and kind, step windows, the time origin.

    Built once from a header and events (``read_trace``'s output); a live
    viewer rebuilds it when new events arrive, which is linear in the events.
    """

    def __init__(self, header: Mapping[str, Any], events: Iterable[Mapping[str, Any]]) -> None:
        self.header = dict(header)
        self.events: list[Mapping[str, Any]] = list(events)
        ranks: set[int] = set()
        self.actions: dict[int, list[Span]] = {}
        self.waits: dict[int, list[Span]] = {}
        self.transfers: dict[int, list[Span]] = {}
        self.memory: dict[int, list[Mapping[str, Any]]] = {}
        step_ev: dict[int, list[tuple[int, int]]] = {}
        self.step_spans: dict[int, dict[int, tuple[int, int]]] = {}
        """rank -> step -> (start, end) of the rank's own ``step`` event."""
        self.eval_steps: set[int] = set()
        """Steps recorded by ``Pipeline.eval()`` (``"eval": true``)."""
        self.device_ns: dict[tuple[int, int, str], int] = {}
        """GPU runs: (rank, step, action name) -> the action's device time (its ``device`` event), ns."""
        extent: dict[int, list[int]] = {}  # step -> [min start, max end] of its spans
        t_lo, t_hi = math.inf, -math.inf
        for ev in self.events:
            kind = ev.get("ev")
            if not isinstance(ev.get("rank"), int):
                continue
            ranks.add(ev["rank"])
            if kind == "memory":
                self.memory.setdefault(ev["rank"], []).append(ev)
                t = ev.get("t")
                if isinstance(t, int):
                    t_lo, t_hi = min(t_lo, t), max(t_hi, t)
                continue
            if kind == "device":  # GPUs: an action's device time (runtime/trace.py)
                try:
                    self.device_ns[(ev["rank"], int(ev["step"]), str(ev["name"]))] = int(ev["ns"])
                except (KeyError, TypeError, ValueError):
                    pass
                continue
            if kind == "step":
                try:
                    span = (int(ev["start"]), int(ev["end"]))
                    step_ev.setdefault(int(ev["step"]), []).append(span)
                    self.step_spans.setdefault(ev["rank"], {})[int(ev["step"])] = span
                    if ev.get("eval"):
                        self.eval_steps.add(int(ev["step"]))
                except (KeyError, TypeError, ValueError):
                    pass
                continue
            sp = _span(ev)
            if sp is None:
                continue
            t_lo, t_hi = min(t_lo, sp.start), max(t_hi, sp.end)
            ext = extent.setdefault(sp.step, [sp.start, sp.end])
            ext[0], ext[1] = min(ext[0], sp.start), max(ext[1], sp.end)
            bucket = self.actions if sp.kind == "action" else self.waits if sp.kind == "wait" else self.transfers
            bucket.setdefault(sp.rank, []).append(sp)
        for d in (self.actions, self.waits, self.transfers):
            for lst in d.values():
                lst.sort(key=_start)
        world = self.header.get("world_size")
        if isinstance(world, int) and world > 0:
            ranks.update(range(world))
        self.ranks: list[int] = sorted(ranks)
        with_events = {r for d in (self.actions, self.waits, self.transfers, self.step_spans) for r in d}
        self.missing_ranks: list[int] = sorted(set(self.ranks) - with_events) if with_events else []
        """Ranks of the job (``world_size``) with no event at all: their file was not given, or they died first."""
        # Windows: from the first rank's start of a step to the last rank's end of
        # it, cut where the next step begins, so that windows never overlap.
        spans: dict[int, tuple[int, int]] = {}
        for s in set(step_ev) | set(extent):
            if s in step_ev:
                spans[s] = (min(a for a, _ in step_ev[s]), max(b for _, b in step_ev[s]))
            else:
                spans[s] = (extent[s][0], extent[s][1])
            t_lo, t_hi = min(t_lo, spans[s][0]), max(t_hi, spans[s][1])
        self.windows: dict[int, tuple[int, int]] = {}
        order = sorted(spans, key=lambda s: (spans[s][0], s))
        for i, s in enumerate(order):
            lo, hi = spans[s]
            if i + 1 < len(order):
                hi = max(lo, min(hi, spans[order[i + 1]][0]))
            self.windows[s] = (lo, hi)
        self.steps: list[int] = sorted(self.windows)
        self.t0 = int(t_lo) if t_lo != math.inf else 0
        self.t_end = int(t_hi) if t_hi != -math.inf else self.t0
        self._action_ends = {r: [a.end for a in lst] for r, lst in self.actions.items()}

    # -- queries

    @property
    def source(self) -> str:
        return str(self.header.get("source", "run"))

    def actions_of(self, rank: int, step: int | None = None) -> list[Span]:
        lst = self.actions.get(rank, [])
        return lst if step is None else [a for a in lst if a.step == step]

    def window(self, step: int) -> tuple[int, int]:
        return self.windows.get(step, (self.t0, self.t_end))

    def complete_steps(self) -> list[int]:
        """Steps every rank has finished (has a ``step`` event for): a live view follows the newest of these,
        not a step only some ranks' events of have arrived."""
        ranks = [r for r in self.ranks if r not in self.missing_ranks]
        if not self.step_spans:
            return list(self.steps)
        return [s for s in self.steps if all(s in self.step_spans.get(r, {}) for r in ranks)]

    @property
    def train_steps(self) -> list[int]:
        """The steps that are not eval steps."""
        return [s for s in self.steps if s not in self.eval_steps]

    def step_at(self, t: float) -> int | None:
        """The step whose window holds time ``t`` (None: between steps or outside the trace)."""
        for s in self.steps:
            lo, hi = self.windows[s]
            if lo <= t < hi or (t == hi and s == self.steps[-1]):
                return s
        return None

    def waits_before(self, action: Span) -> list[Span]:
        """The waits on the action's rank between the previous action's end and this one's start."""
        lst = self.actions.get(action.rank, [])
        i = _index_of(lst, action)
        prev_end = lst[i - 1].end if i > 0 else -math.inf
        return [w for w in self.waits.get(action.rank, []) if w.start >= prev_end and w.end <= action.start]

    def sends_during(self, action: Span) -> list[Span]:
        return [t for t in self.transfers.get(action.rank, []) if t.kind == "send" and action.start <= t.start <= action.end]

    def inputs_of(self, action: Span) -> list[Span]:
        """The receives that delivered this action's inputs (activation for F, gradient for B/I)."""
        wanted = set()
        for stage, typ, mb in _leaves(action):
            if typ == "F":
                wanted.add(("F", stage, mb))
            elif typ in ("B", "I"):
                wanted.add(("B", stage, mb))
        return [
            t
            for t in self.transfers.get(action.rank, [])
            if t.kind == "recv" and t.step == action.step and (t.event.get("kind"), t.stage, t.mb) in wanted
        ]

    def transfer_pairs(self) -> list[tuple[Span, Span]]:
        """Every send with its matching receive, matched on (source rank, destination rank, step, seq): without
        headers (static shapes) seq is the transfer's place in its step's list order, not a running count."""
        recvs: dict[tuple[int, int, int, int], Span] = {}
        for lst in self.transfers.values():
            for t in lst:
                if t.kind == "recv" and isinstance(t.event.get("seq"), int) and isinstance(t.event.get("peer"), int):
                    recvs[(t.event["peer"], t.rank, t.step, t.event["seq"])] = t
        pairs = []
        for r in sorted(self.transfers):
            for t in self.transfers[r]:
                if t.kind == "send" and isinstance(t.event.get("peer"), int):
                    other = recvs.get((t.rank, t.event["peer"], t.step, t.event.get("seq", -1)))
                    if other is not None:
                        pairs.append((t, other))
        return pairs


def _index_of(lst: list[Span], span: Span) -> int:
    i = bisect.bisect_left(lst, span.start, key=_start)
    while i < len(lst) and lst[i] is not span:
        i += 1
    return i if i < len(lst) else -1


_LEAF = re.compile(r"^(\d+)([A-Z_]+?)(\d+)?$")


def _leaves(action: Span) -> list[tuple[int | None, str, int | None]]:
    sub = action.event.get("sub")
    if isinstance(sub, list) and sub:
        out: list[tuple[int | None, str, int | None]] = []
        for name in sub:
            m = _LEAF.match(str(name))
            if m:
                out.append((int(m.group(1)), m.group(2), int(m.group(3)) if m.group(3) else None))
        return out
    return [(action.stage, action.type, action.mb)]


# ---------------------------------------------------------------- statistics


@dataclass(frozen=True)
class RankStats:
    """One rank over the selected steps (ns)."""

    rank: int
    window_ns: int
    """Summed step windows (the same for every rank)."""
    busy_ns: int
    idle_ns: int
    waiting_ns: int
    busy_fraction: float
    bubble_fraction: float
    actions: int
    bytes_sent: int
    bytes_received: int


@dataclass(frozen=True)
class WaitInfo:
    """One wait: where, how long, what for, and which action ran after it."""

    rank: int
    step: int
    start_ns: int
    """Relative to the trace start."""
    duration_ns: int
    waiting_for: tuple[str, ...]
    before: str | None
    """The first action the rank ran after the wait."""


@dataclass(frozen=True)
class TraceSummary:
    """What ``pipeloom trace summary`` prints and the UI's summary pane shows."""

    source: str
    schedule: str | None
    steps: tuple[int, ...]
    """The steps measured."""
    ranks: tuple[RankStats, ...]
    step_times_ns: Mapping[int, int]
    longest_waits: tuple[WaitInfo, ...]
    attribution: tuple[Any, ...] = ()
    """Per rank, where its time went over the steps measured (:class:`~pipeloom.tools.trace_analysis.Attribution`)."""
    per_step: tuple[Any, ...] = ()
    """The same per (rank, step)."""
    critical: tuple[Any, ...] = ()
    """The critical path of each step measured (:class:`~pipeloom.tools.trace_analysis.CriticalPath`)."""
    action_stats: tuple[Any, ...] = ()
    missing_ranks: tuple[int, ...] = ()
    """Ranks of the job without any event (their file not given?): left out of every number."""
    left_out: str = ""
    """Which steps were left out and why (eval, warm-up)."""

    @property
    def mean_step_ns(self) -> float:
        return sum(self.step_times_ns.values()) / len(self.step_times_ns) if self.step_times_ns else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Idle over ranks x window: the share of the machine left unused."""
        total = sum(r.window_ns for r in self.ranks)
        return sum(r.idle_ns for r in self.ranks) / total if total else 0.0

    def to_json(self) -> dict[str, Any]:
        from .trace_analysis import step_percentiles

        return {
            "source": self.source,
            "schedule": self.schedule,
            "steps": list(self.steps),
            "left_out": self.left_out,
            "missing_ranks": list(self.missing_ranks),
            "step_time_percentiles_ns": step_percentiles(self.step_times_ns),
            "attribution": [a.to_json() for a in self.attribution],
            "attribution_per_step": [{"step": s, **a.to_json()} for s, a in self.per_step],
            "critical_path": [c.to_json() for c in self.critical],
            "action_stats": [x.to_json() for x in self.action_stats],
            "bubble_fraction": self.bubble_fraction,
            "mean_step_ns": self.mean_step_ns,
            "step_times_ns": {str(k): v for k, v in sorted(self.step_times_ns.items())},
            "ranks": [
                {
                    "rank": r.rank,
                    "window_ns": r.window_ns,
                    "busy_ns": r.busy_ns,
                    "idle_ns": r.idle_ns,
                    "waiting_ns": r.waiting_ns,
                    "busy_fraction": r.busy_fraction,
                    "bubble_fraction": r.bubble_fraction,
                    "actions": r.actions,
                    "bytes_sent": r.bytes_sent,
                    "bytes_received": r.bytes_received,
                }
                for r in self.ranks
            ],
            "longest_waits": [
                {
                    "rank": w.rank,
                    "step": w.step,
                    "start_ns": w.start_ns,
                    "duration_ns": w.duration_ns,
                    "for": list(w.waiting_for),
                    "before": w.before,
                }
                for w in self.longest_waits
            ],
        }


def summarize(
    model: TraceModel,
    *,
    step: int | None = None,
    top: int = 5,
    skip_warmup: int = 0,
    include_eval: bool = False,
    critical: bool = True,
) -> TraceSummary:
    """Per-rank busy/idle/bubble and attribution, step times, critical paths, traffic and the ``top`` longest waits.

    ``step``: only that step; else every training step after the first
    ``skip_warmup`` (eval steps too with ``include_eval``).  See the module
    docstring and :data:`~pipeloom.tools.trace_analysis.DEFINITIONS`.
    """
    from .trace_analysis import Attribution, Attributor, action_stats, critical_path, select_steps

    steps = tuple(select_steps(model, step=step, skip_warmup=skip_warmup, include_eval=include_eval))
    left = []
    if step is None:
        ev = [s for s in model.eval_steps if s in model.windows]
        if ev and not include_eval:
            left.append(f"{len(ev)} eval step{'s' if len(ev) != 1 else ''}")
        if skip_warmup:
            left.append(f"the first {min(skip_warmup, len(model.train_steps))} training step(s) (warm-up)")
    chosen = set(steps)
    step_times = {s: model.windows[s][1] - model.windows[s][0] for s in steps}
    window = sum(step_times.values())
    ranks = []
    waits: list[WaitInfo] = []
    att = Attributor(model)
    attribution = []
    per_step = []
    present = [r for r in model.ranks if r not in model.missing_ranks]
    for r in present:
        acts = [a for a in model.actions.get(r, []) if a.step in chosen]
        total = Attribution(r)
        for s in steps:
            a1 = att.attribute(r, s)
            per_step.append((s, a1))
            total.add(a1)
        attribution.append(total)
        busy = total.compute_ns
        ws = [w for w in model.waits.get(r, []) if w.step in chosen]
        xs = [t for t in model.transfers.get(r, []) if t.step in chosen]
        idle = window - busy
        ranks.append(
            RankStats(
                rank=r,
                window_ns=window,
                busy_ns=busy,
                idle_ns=idle,
                waiting_ns=total.waiting_ns,
                busy_fraction=busy / window if window else 0.0,
                bubble_fraction=idle / window if window else 0.0,
                actions=len(acts),
                bytes_sent=sum(int(t.event.get("bytes", 0)) for t in xs if t.kind == "send"),
                bytes_received=sum(int(t.event.get("bytes", 0)) for t in xs if t.kind == "recv"),
            )
        )
        all_acts = model.actions.get(r, [])
        for w in ws:
            i = bisect.bisect_left(all_acts, w.end, key=_start)
            nxt = all_acts[i].name if i < len(all_acts) else None
            waits.append(WaitInfo(r, w.step, w.start - model.t0, w.duration, tuple(map(str, w.event.get("for", []) or [])), nxt))
    waits.sort(key=lambda w: (-w.duration_ns, w.rank, w.start_ns))
    schedule = model.header.get("schedule")
    return TraceSummary(
        source=model.source,
        schedule=None if schedule is None else str(schedule),
        steps=steps,
        ranks=tuple(ranks),
        step_times_ns=step_times,
        longest_waits=tuple(waits[:top]),
        attribution=tuple(attribution),
        per_step=tuple(per_step),
        critical=tuple(critical_path(model, s, attributor=att) for s in steps) if critical else (),
        action_stats=tuple(action_stats(model, steps)),
        missing_ranks=tuple(model.missing_ranks),
        left_out=", ".join(left),
    )


def format_ns(ns: float) -> str:
    """A duration for people: ``1.234 ms``, ``56.7 us``, ``2.500 s``."""
    a = abs(ns)
    if a >= 1e9:
        return f"{ns / 1e9:.3f} s"
    if a >= 1e6:
        return f"{ns / 1e6:.3f} ms"
    if a >= 1e3:
        return f"{ns / 1e3:.1f} us"
    return f"{ns:.0f} ns"


def format_pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


_TYPE_ORDER = ("F", "I", "B", "W", "OVERLAP_F_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]


def format_attribution(summary: TraceSummary) -> list[str]:
    """The "where the time went" table: each rank's row adds up to 100% of the step time."""
    atts = summary.attribution
    if not atts or not any(a.window_ns for a in atts):
        return []
    from .trace_analysis import WAIT_CAUSES

    types = sorted({t for a in atts for t in a.actions_ns}, key=lambda t: (_TYPE_ORDER.index(t) if t in _TYPE_ORDER else 99, t))
    causes = [c for c in WAIT_CAUSES if any(a.by_cause().get(c) for a in atts)]
    rest = [("send", "sends_ns"), ("runtime", "runtime_ns"), ("prev step", "prev_step_ns"), ("outside", "outside_ns")]
    rest = [(n, f) for n, f in rest if any(getattr(a, f) for a in atts)]
    head = ("rank", *types, *(f"wait:{c}" for c in causes), *(n for n, _ in rest), "total")
    rows = [head]
    for a in atts:
        w = a.window_ns or 1
        bc = a.by_cause()
        rows.append((str(a.rank), *(format_pct(a.actions_ns.get(t, 0) / w) for t in types),
                     *(format_pct(bc.get(c, 0) / w) for c in causes), *(format_pct(getattr(a, f) / w) for _, f in rest),
                     format_pct(a.total_ns / w)))
    out = ["where the time went (% of the step time; every row adds up to it; `pipeloom trace summary --help` defines each part):"]
    out += _table(rows)
    peers = []
    for a in atts:
        for peer, d in sorted(a.by_peer().items()):
            parts = ", ".join(f"{c.replace('_', ' ')} {format_ns(v)}" for c, v in sorted(d.items(), key=lambda kv: -kv[1]))
            peers.append(f"rank {a.rank} on rank {peer}: {format_ns(sum(d.values()))} ({parts})")
    if peers:
        out.append("waiting by peer: " + "; ".join(peers))
    return out


def format_summary(summary: TraceSummary) -> str:
    """The text form of a summary (``pipeloom trace summary`` and the UI's pane)."""
    from .trace_analysis import step_percentiles

    steps = summary.steps
    if not steps:
        what = "no steps"
    elif len(steps) == 1:
        what = f"step {steps[0]}"
    else:
        what = f"{len(steps)} steps ({steps[0]}..{steps[-1]})"
    head = f"{summary.schedule or 'trace'} ({summary.source}), {what}: "
    head += f"step time {format_ns(summary.mean_step_ns)}" + (" mean" if len(steps) > 1 else "")
    head += f", bubble {format_pct(summary.bubble_fraction)}"
    if summary.left_out:
        head += f" (left out: {summary.left_out})"
    lines = [head]
    for r in summary.missing_ranks:
        lines.append(f"rank {r}: no events (its per-rank file not given, or it died before tracing): left out of every number")
    rows = [("rank", "busy", "idle", "busy %", "bubble %", "waiting", "actions", "sent", "received")]
    for r in summary.ranks:
        rows.append(
            (
                str(r.rank),
                format_ns(r.busy_ns),
                format_ns(r.idle_ns),
                format_pct(r.busy_fraction),
                format_pct(r.bubble_fraction),
                format_ns(r.waiting_ns),
                str(r.actions),
                format_bytes(r.bytes_sent),
                format_bytes(r.bytes_received),
            )
        )
    lines += [""] + _table(rows)
    att = format_attribution(summary)
    if att:
        lines += [""] + att
    if summary.critical:
        lines += ["", "critical path:"]
        crit = list(summary.critical)
        if len(crit) > 4:
            slowest = max(crit, key=lambda c: c.window[1] - c.window[0])
            n = len(crit)
            tot = {k: sum(c.total(k) for c in crit) / n for k in ("compute", "transfer", "runtime", "waiting")}
            lines.append(f"  mean over {n} steps: compute {format_ns(tot['compute'])} + transfers {format_ns(tot['transfer'])} + "
                         f"runtime {format_ns(tot['runtime'])} + waiting {format_ns(tot['waiting'])}")
            crit = [slowest]
            lines.append("  slowest " + crit[0].line())
        else:
            lines += ["  " + c.line() for c in crit]
    if len(steps) > 1:
        p = step_percentiles(summary.step_times_ns)
        lines += ["", f"step times: mean {format_ns(p['mean'])}, p50 {format_ns(p['p50'])}, p90 {format_ns(p['p90'])}, "
                      f"max {format_ns(p['max'])}, min {format_ns(p['min'])} ({p['count']} steps)"]
    if summary.action_stats:
        rows = [("rank", "stage", "type", "n", "mean", "p50", "p90", "max")]
        for x in summary.action_stats:
            rows.append((str(x.rank), "-" if x.stage is None else str(x.stage), x.type, str(x.count), format_ns(x.mean),
                         format_ns(x.p50), format_ns(x.p90), format_ns(x.max)))
        lines += ["", "action durations:"] + _table(rows)
    if summary.longest_waits:
        lines += ["", "longest waits:"]
        for w in summary.longest_waits:
            why = "; ".join(w.waiting_for) or "?"
            before = f" before {w.before}" if w.before else ""
            lines.append(f"  {format_ns(w.duration_ns):>10}  rank {w.rank} step {w.step} at {format_ns(w.start_ns)}{before}: {why}")
    return "\n".join(lines)


# ---------------------------------------------------------------- one action


@dataclass(frozen=True)
class ActionDetails:
    """Everything the detail pane says about one action (times relative to the trace start)."""

    span: Span
    start_ns: int
    end_ns: int
    waits: tuple[Span, ...]
    """Waits between the previous action on the rank and this one."""
    inputs: tuple[Span, ...]
    """Receives that delivered its inputs."""
    sends: tuple[Span, ...]
    """Sends it made (its outputs to other ranks)."""

    @property
    def waited_ns(self) -> int:
        return sum(w.duration for w in self.waits)

    def lines(self) -> list[str]:
        a = self.span
        out = [
            f"{a.name}  ({a.type})",
            f"rank {a.rank}  stage {a.stage}  mb {a.mb}  step {a.step}",
            f"start {format_ns(self.start_ns)}  end {format_ns(self.end_ns)}  duration {format_ns(a.duration)}",
        ]
        if a.event.get("sub"):
            out.append("halves: " + ", ".join(map(str, a.event["sub"])))
        if self.waits:
            out.append(f"waited {format_ns(self.waited_ns)} before it:")
            for w in self.waits:
                out.append(f"  {format_ns(w.duration)}: " + ("; ".join(map(str, w.event.get("for", []) or [])) or "?"))
        else:
            out.append("no wait before it")
        for t in self.inputs:
            e = t.event
            out.append(f"input {t.name}: {format_bytes(int(e.get('bytes', 0)))} from rank {e.get('peer')} (seq {e.get('seq')}), {format_ns(t.duration)} in flight")
        for t in self.sends:
            e = t.event
            out.append(f"sent {t.name}: {format_bytes(int(e.get('bytes', 0)))} to rank {e.get('peer')} (seq {e.get('seq')}), {format_ns(t.duration)}")
        return out


def describe_action(model: TraceModel, action: Span) -> ActionDetails:
    return ActionDetails(
        span=action,
        start_ns=action.start - model.t0,
        end_ns=action.end - model.t0,
        waits=tuple(model.waits_before(action)),
        inputs=tuple(model.inputs_of(action)),
        sends=tuple(model.sends_during(action)),
    )


# ---------------------------------------------------------------- layout


def lane_cells(spans: Sequence[Span], start: int, end: int, width: int) -> list[int | None]:
    """Which span each of ``width`` character cells shows, for the time range ``[start, end)``.

    Cell ``i`` covers ``[start + i*dt, start + (i+1)*dt)``; it shows the span
    that covers most of it, so a span shorter than a cell still appears when
    nothing longer shares the cell.  Returns indices into ``spans`` (None:
    nothing there).
    """
    cells: list[int | None] = [None] * width
    if width <= 0 or end <= start:
        return cells
    best = [0.0] * width
    dt = (end - start) / width
    for idx, sp in enumerate(spans):
        if sp.end < start or sp.start >= end:
            continue
        lo = min(width - 1, int((max(sp.start, start) - start) // dt))
        hi = min(width - 1, max(lo, math.ceil((min(sp.end, end) - start) / dt) - 1))
        for c in range(lo, hi + 1):
            c0 = start + c * dt
            cover = min(sp.end, c0 + dt) - max(sp.start, c0)
            cover = max(cover, 1e-9)  # zero-length spans still claim an empty cell
            if cover > best[c]:
                best[c], cells[c] = cover, idx
    return cells


# ---------------------------------------------------------------- view state

MIN_WIDTH_NS = 1_000
"""The narrowest time range the view zooms to (1 us)."""


class ViewState:
    """What the viewer shows and what is selected; every key of the UI is one method here.

    ``view_start``/``view_end`` is the time range drawn (ns, the trace's
    clock); ``rank`` the selected lane; ``index`` the selected action in that
    rank's list (None: the rank has no action); ``step`` the step the summary
    pane measures (the selected action's step once one is selected).
    ``follow`` (live mode) keeps the view on the newest step as it arrives;
    any navigation turns it off.
    """

    def __init__(self, model: TraceModel, *, follow: bool = False) -> None:
        self.model = model
        self.follow = follow
        self.rank_pos = 0
        self.index: int | None = None
        self.step: int | None = None
        self.view_start, self.view_end = model.t0, max(model.t_end, model.t0 + MIN_WIDTH_NS)
        if model.steps:
            self._go_step((model.complete_steps() or model.steps)[-1] if follow else model.steps[0])

    # -- what is selected

    @property
    def rank(self) -> int | None:
        ranks = self.model.ranks
        return ranks[self.rank_pos] if ranks else None

    @property
    def selected(self) -> Span | None:
        r = self.rank
        if r is None or self.index is None:
            return None
        lst = self.model.actions.get(r, [])
        return lst[self.index] if 0 <= self.index < len(lst) else None

    @property
    def width(self) -> int:
        return self.view_end - self.view_start

    # -- zoom and pan

    def _clamp(self, start: float, width: float) -> None:
        lo, hi = self.model.t0, max(self.model.t_end, self.model.t0 + MIN_WIDTH_NS)
        width = min(max(width, MIN_WIDTH_NS), hi - lo)
        start = min(max(start, lo), hi - width)
        self.view_start, self.view_end = int(start), int(start + width)

    def zoom(self, factor: float) -> None:
        """``factor`` > 1 zooms in (a narrower range) around the selected action if shown, else the centre."""
        self.follow = False
        sel = self.selected
        if sel is not None and self.view_start <= (sel.start + sel.end) / 2 <= self.view_end:
            centre = (sel.start + sel.end) / 2
        else:
            centre = (self.view_start + self.view_end) / 2
        width = self.width / factor
        self._clamp(centre - width / 2, width)

    def pan(self, fraction: float) -> None:
        """Move the range by ``fraction`` of its width (negative: earlier)."""
        self.follow = False
        self._clamp(self.view_start + fraction * self.width, self.width)
        self._sync_step()

    def home(self) -> None:
        self.follow = False
        self._clamp(self.model.t0, self.width)
        self._sync_step()

    def end(self) -> None:
        self.follow = False
        self._clamp(self.model.t_end - self.width, self.width)
        self._sync_step()

    def _sync_step(self) -> None:
        """After the view moved: the current step is the one under the view's centre; a selection
        that left the view moves to the rank's action nearest the centre (so the panes follow the view)."""
        centre = (self.view_start + self.view_end) / 2
        s = self.model.step_at(centre)
        if s is None:
            return
        self.step = s
        sel = self.selected
        if sel is not None and sel.end >= self.view_start and sel.start <= self.view_end:
            if sel.step == s:
                return
        r = self.rank
        lst = self.model.actions.get(r, []) if r is not None else []
        in_step = [k for k, a in enumerate(lst) if a.step == s]
        if in_step:
            self.index = min(in_step, key=lambda k: abs((lst[k].start + lst[k].end) / 2 - centre))

    def fit(self) -> None:
        """Show the current step whole (or the whole trace without steps)."""
        if self.step is not None:
            lo, hi = self.model.window(self.step)
            self._clamp(lo, hi - lo)
        else:
            self._clamp(self.model.t0, self.model.t_end - self.model.t0)

    # -- steps

    def _go_step(self, step: int) -> None:
        self.step = step
        self.fit()
        r = self.rank
        if r is None:
            return
        lst = self.model.actions.get(r, [])
        i = next((k for k, a in enumerate(lst) if a.step == step), None)
        self.index = i

    def step_by(self, delta: int) -> None:
        """Select the next (``delta`` > 0) or previous step: show it whole, select its first action on this rank."""
        self.follow = False
        steps = self.model.steps
        if not steps:
            return
        if self.step is None or self.step not in steps:
            pos = 0
        else:
            pos = min(max(steps.index(self.step) + delta, 0), len(steps) - 1)
        self._go_step(steps[pos])

    # -- selection

    def _show(self, sp: Span) -> None:
        """Pan (keeping the zoom) so that ``sp`` is in view."""
        if sp.start < self.view_start or sp.end > self.view_end:
            w = self.width
            if sp.duration > w:
                self._clamp(sp.start, w)
            else:
                self._clamp((sp.start + sp.end) / 2 - w / 2, w)

    def move_action(self, delta: int) -> None:
        """Select the next/previous action on the selected rank (across steps)."""
        self.follow = False
        r = self.rank
        if r is None:
            return
        lst = self.model.actions.get(r, [])
        if not lst:
            return
        i = 0 if self.index is None else min(max(self.index + delta, 0), len(lst) - 1)
        self.index = i
        self.step = lst[i].step
        self._show(lst[i])

    def move_rank(self, delta: int, *, wrap: bool = False) -> None:
        """Select another rank; its action nearest in time to the current selection (same step first)."""
        self.follow = False
        ranks = self.model.ranks
        if not ranks:
            return
        old = self.selected
        pos = self.rank_pos + delta
        self.rank_pos = pos % len(ranks) if wrap else min(max(pos, 0), len(ranks) - 1)
        lst = self.model.actions.get(ranks[self.rank_pos], [])
        if not lst:
            self.index = None
            return
        step: int | None
        if old is not None:
            t, step = (old.start + old.end) / 2, old.step
        else:
            t, step = (self.view_start + self.view_end) / 2, self.step

        def distance(k: int) -> tuple[int, float]:
            a = lst[k]
            d = 0.0 if a.start <= t <= a.end else min(abs(a.start - t), abs(a.end - t))
            return (0 if a.step == step else 1, d)

        self.index = min(range(len(lst)), key=distance)
        self.step = lst[self.index].step
        self._show(lst[self.index])

    # -- live updates

    def update(self, model: TraceModel) -> None:
        """Take a newer model (live mode), keeping the selection and range, or following the newest step."""
        sel = self.selected
        rank = self.rank
        self.model = model
        if rank is not None and rank in model.ranks:
            self.rank_pos = model.ranks.index(rank)
        else:
            self.rank_pos = min(self.rank_pos, max(len(model.ranks) - 1, 0))
        if self.follow and model.steps:
            target = model.complete_steps()[-1:] or model.steps[:1]
            if self.step != target[0] or sel is None:
                self._go_step(target[0])
            else:
                self.fit()
            return
        if sel is not None:
            lst = model.actions.get(sel.rank, [])
            i = bisect.bisect_left(lst, sel.start, key=_start)
            self.index = i if i < len(lst) and lst[i].start == sel.start else None
        elif self.index is None and self.step is None and model.steps:
            self._go_step(model.steps[0])


# ---------------------------------------------------------------- live traces


def _event_key(e: Mapping[str, Any]) -> tuple[Any, ...]:
    return (e.get("ev"), e.get("rank"), e.get("step"), e.get("start", e.get("t")), e.get("end"), e.get("name"), e.get("seq"))


class TraceBuffer:
    """A trace that grows: the history read from a file plus batches arriving live.

    A batch may repeat events already held -- the file was read while the
    collector was appending, or a publisher resent -- so events are kept once
    (keyed by kind, rank, step, times, name and seq).  The header is the
    first one seen; batches published by a collector carry the job's header,
    so a viewer that attaches late still gets it.
    """

    def __init__(self, header: Mapping[str, Any] | None = None, events: Iterable[Mapping[str, Any]] = ()) -> None:
        self.header: dict[str, Any] | None = dict(header) if header is not None else None
        self.events: list[Mapping[str, Any]] = []
        self._seen: set[tuple[Any, ...]] = set()
        self.rejected = 0
        self.dropped: dict[int, int] = {}
        self.add(events)

    def add(self, events: Iterable[Mapping[str, Any]]) -> int:
        """Add events not held yet; returns how many were new."""
        n = 0
        for e in events:
            k = _event_key(e)
            if k in self._seen:
                continue
            self._seen.add(k)
            self.events.append(e)
            n += 1
        return n

    def add_batch(self, msg: Any) -> int:
        """Add a decoded stream batch (validated first; a bad one is counted and raises ValueError)."""
        try:
            trace_api().check_batch(msg)
        except ValueError:
            self.rejected += 1
            raise
        if self.header is None and msg.get("header") is not None:
            self.header = dict(msg["header"])
        if msg.get("dropped"):
            self.dropped[msg["src"]] = max(self.dropped.get(msg["src"], 0), int(msg["dropped"]))
        return self.add(msg["events"])

    def model(self) -> TraceModel:
        api = trace_api()
        header = self.header or {"format": api.TRACE_FORMAT, "version": api.TRACE_VERSION, "source": "run"}
        return TraceModel(header, sorted(self.events, key=lambda e: e.get("start", e.get("t", 0))))
