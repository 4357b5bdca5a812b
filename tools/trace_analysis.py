"""Why a step took as long as it did: bubble attribution, critical path, per-action statistics.

The problem: a rank trace says *when* each action ran, but the question a
performance engineer opens it with is *where did the step time go*.  "55%
bubble" against a textbook 20% explains nothing until it is split into
causes -- waiting for a peer that had not produced the data yet, data in
flight, the memory cap, an all-gather, the runtime's own time between
actions, or time outside the rank's step altogether.  No tool of the field
(torch's profiler, Megatron's timers, HTA) splits a pipeline bubble by cause;
the trace has what is needed: every action, send, receive and wait of every
rank on one clock.

Two views, both exact (they tile the step window, so their parts add up to the
step time to the nanosecond, tested on recorded traces of every schedule):

* **Attribution**, per rank and step: the rank's timeline inside the step's
  window is painted with one label per instant (an action beats a send beats a
  wait beats nothing) and the painted lengths are summed.  See
  :data:`DEFINITIONS` for every label.
* **Critical path**, per step: walked backwards from the last action to end,
  following action -> send -> receive -> waiting-action edges across ranks
  where a receive landed after the rank was free, and the rank's previous
  action otherwise.  Its segments tile the window too: compute (actions on the
  path), transfers (sends and data in flight on the path), runtime (the
  runtime's own time between path items), waiting (waits the walk cannot
  explain by a transfer: memory cap, unshard, a rank not yet in the step).

Alternatives considered: attributing idle time from the schedule (what the
simulator does) explains the plan, not the run; sampling stacks explains the
host, not the pipeline.  Painting recorded intervals needs no model of the
runtime and cannot double count.

Pure functions over :class:`~pipeloom.tools.trace_model.TraceModel`; nothing
here imports torch or textual.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..schedules.dataflow import producer_stage
from .trace_model import Span, TraceModel, _leaves

__all__ = [
    "DEFINITIONS",
    "WAIT_CAUSES",
    "Attribution",
    "attribute",
    "wait_causes",
    "CriticalPath",
    "critical_path",
    "ActionStats",
    "action_stats",
    "percentile",
    "select_steps",
]

WAIT_CAUSES = ("not_sent", "in_flight", "wakeup", "memory_cap", "unshard", "reduction", "sends", "peer_end", "layouts",
               "other")
"""Causes of a wait, in report order."""

DEFINITIONS = """\
Every rank's time in a step's window is split into parts that add up to the
window exactly (one label per instant; an action beats a send beats a wait; a
backward launched on a worker thread beside the forwards (host_overlap_backward,
on by default on GPUs) counts where the loop ran no action and no send):
  window       the job's time for the step: from the first rank's start of it to
               the last rank's end of it, cut where the next step starts (windows
               never overlap); the step time is its length
  action T     running actions of type T (F, B, I, W, OVERLAP_F_B, UNSHARD, ...)
  wait         the dispatcher asleep with nothing ready, by cause and peer:
    not_sent     the activation/gradient the next action needed was not yet sent
                 by the peer (before the transfer was announced)
    in_flight    announced by the peer, data not landed yet
    wakeup       the data had landed, the rank not yet back at work
    memory_cap   the next forward held back by the live-microbatch cap
    unshard      an FSDP all-gather not complete
    reduction    data-parallel gradient reduction (at the end of the step)
    sends        the rank's own sends completing at the end of the step
    peer_end     static shapes, at the end of the step: a peer that sends to this
                 rank has not yet said that its sends are done (it is still
                 running its part of the step: the rank named is the late one)
    layouts      static shapes, before the step: the ranks' input layouts being
                 agreed (a rank not yet at this step); traced before the step's
                 span, so the parts below count it as outside
    other        anything else the dispatcher named
  send         blocking in a send (after the action that produced the data)
  runtime      inside the rank's step but in no action, send or wait: the
               runtime's own time (dispatch, bookkeeping, handing data on)
  prev step    still finishing an earlier step (its tail after this window began)
  outside      not in a step at all: before the rank entered this step or after
               it left (the training loop, optimizer, data loading)
bubble = window - compute actions (all but UNSHARD); eval steps are left out
unless asked for.  The critical path tiles the window with compute, transfers,
runtime and waiting (on a rank, by cause) along action -> send -> receive ->
waiting-action edges."""


# ---------------------------------------------------------------- steps


def select_steps(model: TraceModel, *, step: int | None = None, skip_warmup: int = 0, include_eval: bool = False) -> list[int]:
    """The steps a summary measures: one ``step``, or every training step after the first ``skip_warmup``."""
    if step is not None:
        return [s for s in model.steps if s == step]
    steps = model.steps if include_eval else model.train_steps
    train = [s for s in model.train_steps]
    skipped = set(train[:skip_warmup])
    return [s for s in steps if s not in skipped]


# ---------------------------------------------------------------- wait causes

_PEER = re.compile(r"(?:from|on) rank (\d+)")


def _input_keys(action: Span) -> list[tuple[str, int, int]]:
    """(kind, consuming stage, microbatch) of the transfers an action may consume."""
    out = []
    for stage, typ, mb in _leaves(action):
        if stage is None or mb is None:
            continue
        if typ == "F":
            out.append(("F", stage, mb))
        elif typ in ("B", "I"):
            out.append(("B", stage, mb))
    return out


class _RankIndex:
    """One rank's spans indexed for the questions below."""

    def __init__(self, model: TraceModel, rank: int) -> None:
        self.rank = rank
        self.actions = model.actions.get(rank, [])
        self.starts = [a.start for a in self.actions]
        self.recv: dict[tuple[int, str, int, int], Span] = {}
        self.sends: list[Span] = []
        for t in model.transfers.get(rank, []):
            if t.kind == "recv" and t.mb is not None and t.stage is not None:
                self.recv[(t.step, str(t.event.get("kind", "F")), t.stage, t.mb)] = t
            elif t.kind == "send":
                self.sends.append(t)
        self.waits = model.waits.get(rank, [])
        self._sends: dict[tuple[Any, int, Any], int] | None = None

    def next_action(self, t: int, step: int) -> Span | None:
        i = bisect.bisect_left(self.starts, t)
        while i < len(self.actions) and self.actions[i].step != step:
            i += 1
        return self.actions[i] if i < len(self.actions) else None

    def sent_at(self, model: TraceModel, recv: Span) -> int | None:
        """When the send matching ``recv`` (source, this rank, step, seq) left its sender, if recorded."""
        if self._sends is None:
            self._sends = {}
            for lst in model.transfers.values():
                for t in lst:
                    if t.kind == "send" and isinstance(t.event.get("peer"), int) and t.event["peer"] == self.rank:
                        self._sends[(t.rank, t.step, t.event.get("seq"))] = t.end
        return self._sends.get((recv.event.get("peer"), recv.step, recv.event.get("seq")))

    def inputs(self, action: Span) -> list[Span]:
        return [x for k in _input_keys(action) if (x := self.recv.get((action.step, *k))) is not None]


def _text_cause(texts: Sequence[str]) -> tuple[str, int | None]:
    joined = " ".join(texts)
    low = joined.lower()
    if "sends to complete" in low:
        return "sends", None
    if "end of step" in low:
        m = _PEER.search(joined)
        return "peer_end", int(m.group(1)) if m else None
    if "input layouts" in low:
        return "layouts", None
    if "collectives to complete" in low or "reduce_grad" in low or "backward of stage" in low:
        return "reduction", None
    if "unshard" in low or "all-gather" in low:
        return "unshard", None
    if "memory (" in low:
        return "memory_cap", None
    m = _PEER.search(joined)
    if m and ("activation" in low or "gradient" in low):
        return "not_sent", int(m.group(1))
    return "other", None


def wait_causes(model: TraceModel, wait: Span, index: _RankIndex | None = None) -> list[tuple[int, int, str, int | None]]:
    """``wait`` split into ``(start, end, cause, peer)`` pieces that tile it (see :data:`DEFINITIONS`).

    The cause is read from what ended the wait: the next action of the step on
    the rank and the receive of its input (announced at the receive's start,
    landed at its end), else from the reasons the dispatcher recorded.
    """
    idx = index or _RankIndex(model, wait.rank)
    texts = [str(x) for x in (wait.event.get("for") or [])]
    if any("input layouts" in t or "end of step" in t for t in texts):  # not waits for an action's input
        cause, peer = _text_cause(texts)
        return [(wait.start, wait.end, cause, peer)]
    nxt = idx.next_action(wait.end, wait.step)
    if nxt is not None:
        late = [x for x in idx.inputs(nxt) if x.end > wait.start]
        if late:
            x = max(late, key=lambda x: x.end)
            peer = x.event.get("peer")
            peer = peer if isinstance(peer, int) else None
            a, b = wait.start, wait.end
            sent = x.start
            if x.event.get("posted"):
                # static shapes: the receive was posted before anything was sent; the sender's send says
                # when it left (not sent until then), else all of it was waiting for the peer to send
                snd = idx.sent_at(model, x)
                sent = snd if snd is not None else x.end
            cut1 = min(max(sent, a), b)
            cut2 = min(max(x.end, a), b)
            pieces = [(a, cut1, "not_sent", peer), (cut1, cut2, "in_flight", peer), (cut2, b, "wakeup", None)]
            return [p for p in pieces if p[1] > p[0]] or [(a, b, "in_flight", peer)]
        names = {nxt.name, *(f"{s}{t}{m}" for s, t, m in _leaves(nxt))}
        own = [t for t in texts if t.split(":", 1)[0].strip() in names]
        if own:
            texts = own
    cause, peer = _text_cause(texts)
    if cause == "not_sent" and (peer == wait.rank or (nxt is not None and idx.inputs(nxt))):
        # a local hand-over, or the data had landed before the wait began: it waited for something else
        cause, peer = ("memory_cap", None) if any("memory (" in t for t in texts) else ("other", None)
    return [(wait.start, wait.end, cause, peer)]


# ---------------------------------------------------------------- painting

# priorities: higher wins where intervals overlap
_P_ACTION, _P_SEND, _P_BESIDE, _P_WAIT = 4, 3, 2, 1


class _Painter:
    """A rank's host timeline as labelled intervals; ``paint(lo, hi)`` sums labels over a range."""

    def __init__(self, model: TraceModel, rank: int) -> None:
        self.model = model
        self.rank = rank
        self.index = _RankIndex(model, rank)
        ivs: list[tuple[int, int, int, tuple[Any, ...]]] = []
        for a in self.index.actions:
            # a backward launched on the worker thread beside the loop's forwards (host_overlap_backward): what
            # the loop did meanwhile goes first, the backward covers the rest (its waits, its runtime)
            ivs.append((a.start, a.end, _P_BESIDE if a.event.get("beside") else _P_ACTION, ("action", a.type)))
        for t in self.index.sends:
            ivs.append((t.start, t.end, _P_SEND, ("send",)))
        for w in self.index.waits:
            for a, b, cause, peer in wait_causes(model, w, self.index):
                ivs.append((a, b, _P_WAIT, ("wait", cause, peer)))
        ivs = [iv for iv in ivs if iv[1] > iv[0]]
        ivs.sort()
        self.ivs = ivs
        self.starts = [iv[0] for iv in ivs]
        self.max_len = max((iv[1] - iv[0] for iv in ivs), default=0)
        self.step_spans = model.step_spans.get(rank, {})
        self.step_order = sorted(self.step_spans.items(), key=lambda kv: kv[1][0])
        self._step_starts = [sp[0] for _, sp in self.step_order]

    def _events_in(self, lo: int, hi: int) -> list[tuple[int, int, int, tuple[Any, ...]]]:
        i = bisect.bisect_left(self.starts, lo - self.max_len)
        out = []
        while i < len(self.ivs) and self.ivs[i][0] < hi:
            iv = self.ivs[i]
            if iv[1] > lo:
                out.append(iv)
            i += 1
        return out

    def segments(self, lo: int, hi: int, step: int) -> list[tuple[int, int, tuple[Any, ...]]]:
        """``[lo, hi)`` as ``(start, end, label)`` pieces that tile it, for a window of ``step``."""
        if hi <= lo:
            return []
        out: list[tuple[int, int, tuple[Any, ...]]] = []
        own = self.step_spans.get(step)
        if own is None and step in self.model.windows:
            # no step event from this rank (a hand-built trace): its own events' extent
            mine = [iv for iv in self.ivs if iv[0] < hi and iv[1] > lo]
            own = (min(iv[0] for iv in mine), max(iv[1] for iv in mine)) if mine else None
        # the parts outside the rank's own step
        cuts = sorted({lo, hi} | ({min(max(own[0], lo), hi), min(max(own[1], lo), hi)} if own else set()))
        for a, b in zip(cuts, cuts[1:]):
            if b <= a:
                continue
            if own is not None and own[0] <= a and b <= own[1]:
                out += self._paint(a, b)
                continue
            # outside the rank's step: still in another (earlier) one, or in none
            c = a
            # steps of this rank that may overlap [a, b): those starting before b, latest first few
            k = bisect.bisect_left(self._step_starts, b)
            near = self.step_order[max(0, k - 3):k]
            for s, (sa, sb) in near:
                if s == step or sb <= a or sa >= b:
                    continue
                x0, x1 = max(sa, a), min(sb, b)
                if x0 > c:
                    out.append((c, x0, ("outside",)))
                if x1 > max(c, x0):
                    out.append((max(c, x0), x1, ("prev_step",)))
                c = max(c, x1)
            if c < b:
                out.append((c, b, ("outside",)))
        return [seg for seg in out if seg[1] > seg[0]]

    def _paint(self, lo: int, hi: int) -> list[tuple[int, int, tuple[Any, ...]]]:
        evs = self._events_in(lo, hi)
        if not evs:
            return [(lo, hi, ("runtime",))]
        points: list[tuple[int, int, int]] = []  # (time, +1/-1, event index)
        for k, (a, b, _p, _l) in enumerate(evs):
            points.append((max(a, lo), 1, k))
            points.append((min(b, hi), -1, k))
        points.sort(key=lambda p: (p[0], p[1]))
        active: set[int] = set()
        out: list[tuple[int, int, tuple[Any, ...]]] = []
        t = lo
        for when, delta, k in points:
            if when > t:
                label = max((evs[j] for j in active), key=lambda e: e[2])[3] if active else ("runtime",)
                if out and out[-1][2] == label and out[-1][1] == t:
                    out[-1] = (out[-1][0], when, label)
                else:
                    out.append((t, when, label))
                t = when
            if delta > 0:
                active.add(k)
            else:
                active.discard(k)
        if t < hi:
            out.append((t, hi, ("runtime",)))
        return out


# ---------------------------------------------------------------- attribution


@dataclass
class Attribution:
    """Where one rank's time went over one step window (or a sum of several); ns."""

    rank: int
    window_ns: int = 0
    actions_ns: dict[str, int] = field(default_factory=dict)
    """Time in actions, by type."""
    waits_ns: dict[tuple[str, int | None], int] = field(default_factory=dict)
    """Time waiting, by (cause, peer); peer None where no peer is at stake."""
    sends_ns: int = 0
    """Blocking in sends."""
    runtime_ns: int = 0
    """Inside the step, in no action, send or wait."""
    prev_step_ns: int = 0
    """Still in an earlier step's tail."""
    outside_ns: int = 0
    """In no step."""

    @property
    def total_ns(self) -> int:
        return (sum(self.actions_ns.values()) + sum(self.waits_ns.values()) + self.sends_ns + self.runtime_ns
                + self.prev_step_ns + self.outside_ns)

    @property
    def compute_ns(self) -> int:
        """Action time on the compute lane (all but UNSHARD, whose all-gather runs beside it)."""
        return sum(v for k, v in self.actions_ns.items() if k != "UNSHARD")

    @property
    def waiting_ns(self) -> int:
        return sum(self.waits_ns.values())

    def by_cause(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (cause, _), v in self.waits_ns.items():
            out[cause] = out.get(cause, 0) + v
        return out

    def by_peer(self) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        for (cause, peer), v in self.waits_ns.items():
            if peer is not None:
                d = out.setdefault(peer, {})
                d[cause] = d.get(cause, 0) + v
        return out

    def add(self, other: Attribution) -> None:
        self.window_ns += other.window_ns
        for k, v in other.actions_ns.items():
            self.actions_ns[k] = self.actions_ns.get(k, 0) + v
        for k2, v in other.waits_ns.items():
            self.waits_ns[k2] = self.waits_ns.get(k2, 0) + v
        self.sends_ns += other.sends_ns
        self.runtime_ns += other.runtime_ns
        self.prev_step_ns += other.prev_step_ns
        self.outside_ns += other.outside_ns

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "window_ns": self.window_ns,
            "actions_ns": dict(sorted(self.actions_ns.items())),
            "waiting_ns": self.waiting_ns,
            "waits": [{"cause": c, "peer": p, "ns": v} for (c, p), v in sorted(self.waits_ns.items(), key=lambda kv: (WAIT_CAUSES.index(kv[0][0]), kv[0][1] if kv[0][1] is not None else -1))],
            "waiting_by_cause_ns": self.by_cause(),
            "waiting_by_peer_ns": {str(p): d for p, d in sorted(self.by_peer().items())},
            "sends_ns": self.sends_ns,
            "runtime_ns": self.runtime_ns,
            "prev_step_ns": self.prev_step_ns,
            "outside_ns": self.outside_ns,
            "total_ns": self.total_ns,
        }


class Attributor:
    """Attribution of any rank and step of one model (the painters are built once)."""

    def __init__(self, model: TraceModel) -> None:
        self.model = model
        self._painters: dict[int, _Painter] = {}
        self._by_step: dict[int, list[Span]] | None = None
        self._producers: dict[tuple[int, int, str, int, int], Span] | None = None
        self._sends: dict[tuple[int, int, int], Span] | None = None

    def producers(self) -> dict[tuple[int, int, str, int, int], Span]:
        if self._producers is None:
            self._producers = _producer_index(self.model)
        return self._producers

    def sends_by_key(self) -> dict[tuple[int, int, int], Span]:
        """(sender, receiver, seq) -> the send."""
        if self._sends is None:
            self._sends = {}
            for r, lst in self.model.transfers.items():
                for x in lst:
                    if x.kind == "send" and isinstance(x.event.get("peer"), int) and isinstance(x.event.get("seq"), int):
                        self._sends[(r, x.event["peer"], x.event["seq"])] = x
        return self._sends

    def actions_of_step(self, step: int) -> list[Span]:
        """Every rank's actions of ``step`` (indexed once)."""
        if self._by_step is None:
            self._by_step = {}
            for lst in self.model.actions.values():
                for a in lst:
                    self._by_step.setdefault(a.step, []).append(a)
        return self._by_step.get(step, [])

    def painter(self, rank: int) -> _Painter:
        p = self._painters.get(rank)
        if p is None:
            p = self._painters[rank] = _Painter(self.model, rank)
        return p

    def attribute(self, rank: int, step: int) -> Attribution:
        lo, hi = self.model.window(step)
        out = Attribution(rank, window_ns=hi - lo)
        for a, b, label in self.painter(rank).segments(lo, hi, step):
            d = b - a
            kind = label[0]
            if kind == "action":
                out.actions_ns[label[1]] = out.actions_ns.get(label[1], 0) + d
            elif kind == "wait":
                key = (label[1], label[2])
                out.waits_ns[key] = out.waits_ns.get(key, 0) + d
            elif kind == "send":
                out.sends_ns += d
            elif kind == "runtime":
                out.runtime_ns += d
            elif kind == "prev_step":
                out.prev_step_ns += d
            else:
                out.outside_ns += d
        return out


def attribute(model: TraceModel, rank: int, step: int) -> Attribution:
    """Where ``rank``'s time went in ``step``'s window (parts add up to the window exactly)."""
    return Attributor(model).attribute(rank, step)


# ---------------------------------------------------------------- critical path


@dataclass(frozen=True)
class PathSegment:
    """One piece of a critical path: ``kind`` is compute, transfer, runtime or waiting."""

    kind: str
    rank: int
    start: int
    end: int
    name: str
    """The action's name (compute), the transfer's (transfer), or what was waited for."""
    peer: int | None = None
    """For waiting: the rank waited on, where known."""

    @property
    def duration(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class CriticalPath:
    """The chain of work that set a step's length; its segments tile the window."""

    step: int
    window: tuple[int, int]
    segments: tuple[PathSegment, ...]
    actions: tuple[Span, ...]
    """The actions on the path, in time order."""

    def total(self, kind: str) -> int:
        return sum(s.duration for s in self.segments if s.kind == kind)

    def waiting_by_rank(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.segments:
            if s.kind == "waiting":
                key = f"on rank {s.peer}" if s.peer is not None else f"({s.name})"
                out[key] = out.get(key, 0) + s.duration
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "step_ns": self.window[1] - self.window[0],
            "compute_ns": self.total("compute"),
            "transfers_ns": self.total("transfer"),
            "runtime_ns": self.total("runtime"),
            "waiting_ns": self.total("waiting"),
            "waiting_by": self.waiting_by_rank(),
            "actions": [f"{a.rank}:{a.name}" for a in self.actions],
        }

    def line(self) -> str:
        from .trace_model import format_ns

        lo, hi = self.window
        text = (f"step {self.step} = {format_ns(hi - lo)}: compute {format_ns(self.total('compute'))} + transfers "
                f"{format_ns(self.total('transfer'))} + runtime {format_ns(self.total('runtime'))}")
        w = self.waiting_by_rank()
        if w:
            text += " + " + " + ".join(f"waiting {k} {format_ns(v)}" for k, v in sorted(w.items(), key=lambda kv: -kv[1]))
        return text


def _producer_index(model: TraceModel) -> dict[tuple[int, int, str, int, int], Span]:
    """(rank, step, stage, leaf type, mb) -> the action that computed it."""
    out: dict[tuple[int, int, str, int, int], Span] = {}
    for r, lst in model.actions.items():
        for a in lst:
            for s, t, m in _leaves(a):
                if s is not None and m is not None:
                    out[(r, a.step, t, s, m)] = a
    return out


def critical_path(model: TraceModel, step: int, *, attributor: Attributor | None = None) -> CriticalPath:
    """The critical path of ``step`` (see the module docstring)."""
    att = attributor or Attributor(model)
    lo, hi = model.window(step)
    segs: list[PathSegment] = []
    path_actions: list[Span] = []
    t = hi
    sends_by_key = att.sends_by_key()
    producers = att.producers()

    def gap(rank: int, a: int) -> None:
        """Cover ``[a, t)`` with what ``rank`` did then."""
        nonlocal t
        a = max(a, lo)
        if a >= t:
            return
        for s0, s1, label in reversed(att.painter(rank).segments(a, t, step)):
            kind = label[0]
            if kind == "send":
                segs.append(PathSegment("transfer", rank, s0, s1, "send"))
            elif kind == "wait":
                cause, peer = label[1], label[2]
                if cause == "wakeup":
                    segs.append(PathSegment("runtime", rank, s0, s1, "wakeup"))
                else:
                    segs.append(PathSegment("waiting", rank, s0, s1, cause, peer))
            elif kind == "action":
                segs.append(PathSegment("compute", rank, s0, s1, label[1]))
            elif kind == "runtime":
                segs.append(PathSegment("runtime", rank, s0, s1, "runtime"))
            else:
                segs.append(PathSegment("waiting", rank, s0, s1, f"rank {rank} {'finishing the previous step' if kind == 'prev_step' else 'not in the step'}", None))
        t = a

    # the action whose end (clipped to the window) is the latest
    cands = [a for a in att.actions_of_step(step) if a.start < hi]
    if not cands:
        return CriticalPath(step, (lo, hi), (PathSegment("waiting", -1, lo, hi, "no actions"),), ())
    cur: Span | None = max(cands, key=lambda a: (min(a.end, hi), a.start))
    gap(cur.rank, min(cur.end, hi))
    guard = 0
    while cur is not None and guard < 100_000:
        guard += 1
        a = cur
        s0 = max(a.start, lo)
        if s0 < t:
            segs.append(PathSegment("compute", a.rank, s0, t, a.name))
            t = s0
        path_actions.append(a)
        if t <= lo:
            break
        idx = att.painter(a.rank).index
        i = bisect.bisect_left(idx.starts, a.start)
        prev = next((idx.actions[j] for j in range(i - 1, -1, -1) if idx.actions[j].step == step), None)
        free_at = prev.end if prev is not None else model.step_spans.get(a.rank, {}).get(step, (lo, lo))[0]
        late = [x for x in idx.inputs(a) if x.end > free_at]
        nxt: Span | None = None
        if late:
            x = max(late, key=lambda x: x.end)
            src = x.event.get("peer")
            send = sends_by_key.get((src, a.rank, x.event.get("seq"))) if isinstance(src, int) else None
            kind = str(x.event.get("kind", "F"))
            pstage = producer_stage(kind, x.stage) if kind in ("F", "B") else None
            producer = None
            if isinstance(src, int) and x.mb is not None:
                for ptype in (("F",) if kind == "F" else ("I", "B")):
                    producer = producers.get((src, step, ptype, pstage, x.mb))
                    if producer is not None:
                        break
            if send is not None and producer is not None and producer.end <= t:
                gap(a.rank, x.end)  # landed -> started: the rank waking up and dispatching
                x0 = max(min(send.start, x.start), lo)
                if x0 < t:
                    segs.append(PathSegment("transfer", a.rank, x0, t, f"{send.name} -> {x.name}"))
                    t = x0
                gap(src, producer.end)
                nxt = producer
        if nxt is None:
            if prev is not None and prev.end <= t:
                gap(a.rank, prev.end)
                nxt = prev
            else:
                gap(a.rank, lo)
        cur = nxt
    if t > lo:  # defensive: whatever is left is the first rank's start
        segs.append(PathSegment("runtime", -1, lo, t, "start"))
    segs.reverse()
    path_actions.reverse()
    merged: list[PathSegment] = []
    for seg in segs:
        if seg.duration <= 0:
            continue
        last = merged[-1] if merged else None
        if last is not None and seg.kind == last.kind == "runtime" and seg.rank == last.rank and last.end == seg.start:
            merged[-1] = PathSegment("runtime", seg.rank, last.start, seg.end, "runtime")
        else:
            merged.append(seg)
    segs = merged
    return CriticalPath(step, (lo, hi), tuple(segs), tuple(path_actions))


# ---------------------------------------------------------------- statistics


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (``q`` in 0..100)."""
    if not sorted_values:
        return math.nan
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


@dataclass(frozen=True)
class ActionStats:
    """Durations of one kind of action on one rank and stage (ns)."""

    rank: int
    stage: int | None
    type: str
    count: int
    mean: float
    p50: float
    p90: float
    max: float

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "stage": self.stage, "type": self.type, "count": self.count, "mean_ns": self.mean,
                "p50_ns": self.p50, "p90_ns": self.p90, "max_ns": self.max}


def action_stats(model: TraceModel, steps: Iterable[int]) -> list[ActionStats]:
    """mean/p50/p90/max duration per (rank, stage, type) over ``steps``."""
    chosen = set(steps)
    groups: dict[tuple[int, int, str], list[int]] = {}
    for r, lst in model.actions.items():
        for a in lst:
            if a.step in chosen:
                groups.setdefault((r, a.stage if isinstance(a.stage, int) else -1, a.type), []).append(a.duration)
    out = []
    for (r, st, typ), ds in sorted(groups.items()):
        ds.sort()
        out.append(ActionStats(r, None if st < 0 else st, typ, len(ds), sum(ds) / len(ds), percentile(ds, 50), percentile(ds, 90), ds[-1]))
    return out


def step_percentiles(step_times: Mapping[int, int]) -> dict[str, float]:
    v = sorted(step_times.values())
    if not v:
        return {}
    return {"count": len(v), "mean": sum(v) / len(v), "min": v[0], "p50": percentile(v, 50), "p90": percentile(v, 90), "max": v[-1]}
