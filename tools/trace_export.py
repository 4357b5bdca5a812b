"""Traces into other shapes: Chrome's Trace Event Format, and a simulation into a trace.

Chrome trace JSON
-----------------
Perfetto and ``chrome://tracing`` both open the Trace Event Format, so it is
the export (rather than Perfetto's protobuf, which needs a schema compiler and
gains nothing at these sizes).  The layout follows what torch's pipelining
profiler shows, so the two can be compared side by side:

* one process per rank (``pid`` = rank, named ``rank R``);
* named tracks (``tid``): ``steps``, ``critical path``, ``compute``,
  ``fsdp``, ``comm send``, ``comm recv``, ``waits``.  Slices on one track must
  nest; receives from several peers (or a receive announced while the previous
  one still lands) overlap, so receives are *async* slices (``"ph": "b"`` /
  ``"e"``, one id each) and never need extra rows; other overlapping slices go
  to extra rows named ``comm send (2)``...;
* complete events (``"ph": "X"``) named as torch names them: ``PP:1F3``,
  ``PP:1SEND_F3`` (named from the producing stage), ``PP:2RECV_F3`` (the
  consuming stage); ``args`` carry stage, microbatch, step, bytes, peer, seq;
* a flow arrow (``"ph": "s"`` / ``"f"``, ``"bp": "e"``, one id per pair) from
  each send (matched to its receive on source rank, destination rank, seq) to
  the action that consumed the data, starting where the send starts and
  ending where the consumer starts (``args.landed_us``: when the data landed);
* ``--per-rank``: one file per rank with ``distributedInfo`` (rank, world
  size), the layout Holistic Trace Analysis loads;
* memory events as counters (``"ph": "C"``): live microbatches, and CUDA
  allocated/peak bytes where recorded;
* each step's **critical path** (see :mod:`pipeloom.tools.trace_analysis`) on
  its own track, ``critical path``, in its own category ``critical_path``:
  one slice per segment (``compute: 1F3``, ``transfer: ...``, ``waiting: ...``)
  on the rank where it happened; and each rank's **attribution** of the step
  time (actions by type, waits by cause and peer, sends, runtime, outside)
  in the ``args`` of its ``step`` slice.

``ts``/``dur`` are microseconds (the format's unit) from the trace's first
event, as floats with nanosecond resolution.

Simulations as traces
---------------------
:func:`simulation_trace` writes :func:`pipeloom.schedules.simulate`'s timed
events in the trace format (``"source": "simulation"``), so a plan opens in
the same viewer as a run.  Simulated time has no unit; ``time_unit_ns`` (by
default 1,000,000: one cost unit = 1 ms, recorded in the header) scales it.
The simulator records no waits, so every gap on a rank's compute lane becomes
a wait for the inputs of the action after it -- in a static schedule that is
exactly why the rank was idle.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ..schedules.dataflow import consumer_stage, producer_stage, transfer_kind
from .trace_model import Span, TraceModel, trace_api

if TYPE_CHECKING:
    from pipeloom.schedules import Costs, Schedule, SimulationResult

__all__ = ["chrome_trace", "per_rank_traces", "simulation_trace", "SIMULATION_UNIT_NS"]

SIMULATION_UNIT_NS = 1_000_000
"""Default scale of simulated time: one cost unit is one millisecond."""

_TRACKS = ("steps", "critical path", "compute", "fsdp", "comm send", "comm recv", "waits")


def _track(span: Span) -> str:
    if span.kind == "wait":
        return "waits"
    if span.kind == "send":
        return "comm send"
    if span.kind == "recv":
        return "comm recv"
    return "fsdp" if span.type == "UNSHARD" else "compute"


class _Tracks:
    """Per-rank thread ids: one per named track, plus extra rows where slices would overlap."""

    def __init__(self) -> None:
        self.tids: dict[tuple[int, str], int] = {}
        self._busy_until: dict[tuple[int, str], list[tuple[int, int]]] = {}  # (rank, track) -> [(row end, tid)]
        self.meta: list[dict[str, Any]] = []

    def _new(self, rank: int, name: str) -> int:
        tid = len([k for k in self.tids if k[0] == rank])
        self.tids[(rank, name)] = tid
        self.meta.append({"ph": "M", "pid": rank, "tid": tid, "name": "thread_name", "args": {"name": name}})
        self.meta.append({"ph": "M", "pid": rank, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
        return tid

    def named(self, rank: int, name: str) -> int:
        tid = self.tids.get((rank, name))
        return tid if tid is not None else self._new(rank, name)

    def place(self, rank: int, track: str, start: int, end: int) -> int:
        """The first row of ``track`` on ``rank`` free at ``start`` (a new one if none is)."""
        rows = self._busy_until.setdefault((rank, track), [])
        for i, (until, tid) in enumerate(rows):
            if until <= start:
                rows[i] = (end, tid)
                return tid
        name = track if not rows else f"{track} ({len(rows) + 1})"
        tid = self.named(rank, name)
        rows.append((end, tid))
        return tid


def chrome_trace(model: TraceModel) -> dict[str, Any]:
    """The trace as a Trace Event Format object (``json.dump`` it; Perfetto opens it)."""
    t0 = model.t0

    def us(t: int) -> float:
        return round((t - t0) / 1000.0, 3)

    tracks = _Tracks()
    out: list[dict[str, Any]] = []
    for r in model.ranks:
        tracks.meta.append({"ph": "M", "pid": r, "name": "process_name", "args": {"name": f"rank {r}"}})
        tracks.meta.append({"ph": "M", "pid": r, "name": "process_sort_index", "args": {"sort_index": r}})
        for name in _TRACKS:  # fixed order of the named tracks
            tracks.named(r, name)
    for ev in model.events:
        if ev.get("ev") == "step" and isinstance(ev.get("start"), int) and isinstance(ev.get("end"), int):
            r, s = ev["rank"], ev.get("step")
            out.append(
                {"ph": "X", "name": f"step {s}", "cat": "step", "pid": r, "tid": tracks.named(r, "steps"),
                 "ts": us(ev["start"]), "dur": round(us(ev["end"]) - us(ev["start"]), 3), "args": {"step": s}}
            )
    tid_of: dict[int, tuple[int, int]] = {}  # id(span) -> (pid, tid)
    spans = [sp for d in (model.actions, model.transfers, model.waits) for lst in d.values() for sp in lst]
    spans.sort(key=lambda sp: (sp.start, -sp.end))
    for n_recv, sp in enumerate(x for x in spans if x.kind == "recv"):
        # receives overlap (several peers, announced while another lands): async slices, one id each
        e = sp.event
        common = {"cat": "comm recv", "name": f"PP:{sp.name}", "id": n_recv, "pid": sp.rank, "tid": tracks.named(sp.rank, "comm recv")}
        out.append({"ph": "b", "ts": us(sp.start), **common,
                    "args": {"step": sp.step, "stage": sp.stage, "mb": sp.mb, "kind": e.get("kind"), "peer": e.get("peer"),
                             "seq": e.get("seq"), "bytes": e.get("bytes")}})
        out.append({"ph": "e", "ts": us(sp.end), **common})
    spans = [sp for sp in spans if sp.kind != "recv"]
    for sp in spans:
        tid = tracks.place(sp.rank, _track(sp), sp.start, sp.end)
        tid_of[id(sp)] = (sp.rank, tid)
        e = sp.event
        args: dict[str, Any] = {"step": sp.step}
        if sp.kind == "action":
            name, cat = f"PP:{sp.name}", "compute"
            args.update(stage=sp.stage, mb=sp.mb, type=sp.type)
            if e.get("sub"):
                args["sub"] = list(e["sub"])
        elif sp.kind == "wait":
            name, cat = "wait", "wait"
            args["for"] = list(e.get("for", []) or [])
        else:
            name, cat = f"PP:{sp.name}", "comm"
            args.update(stage=sp.stage, mb=sp.mb, kind=e.get("kind"), peer=e.get("peer"), seq=e.get("seq"), bytes=e.get("bytes"))
        out.append({"ph": "X", "name": name, "cat": cat, "pid": sp.rank, "tid": tid, "ts": us(sp.start),
                    "dur": round(us(sp.end) - us(sp.start), 3), "args": args})
    consumers = _consumers(model)
    for n, (send, recv) in enumerate(model.transfer_pairs()):
        spid, stid = tid_of[id(send)]
        consumer = consumers.get((recv.rank, recv.step, str(recv.event.get("kind", "F")), recv.stage, recv.mb))
        if consumer is None:
            continue
        rpid, rtid = tid_of[id(consumer)]
        # The arrow starts strictly inside the send and ends on the action that consumed the data
        # (a receive is an async slice, which flow events cannot bind to).
        s_ts = us(send.start) + (0.0005 if send.duration > 1 else 0.0)
        f_ts = us(consumer.start) + (0.0005 if consumer.duration > 1 else 0.0)
        common = {"name": "transfer", "cat": "flow", "id": n}
        out.append({"ph": "s", "pid": spid, "tid": stid, "ts": round(s_ts, 4), **common})
        out.append({"ph": "f", "bp": "e", "pid": rpid, "tid": rtid, "ts": round(f_ts, 4), "args": {"landed_us": us(recv.end)}, **common})
    for r, evs in model.memory.items():
        for ev in evs:
            if not isinstance(ev.get("t"), int):
                continue
            out.append({"ph": "C", "name": "live microbatches", "pid": r, "ts": us(ev["t"]), "args": {"live_mb": ev.get("live_mb", 0)}})
            if ev.get("allocated") is not None:
                out.append({"ph": "C", "name": "memory", "pid": r, "ts": us(ev["t"]),
                            "args": {"allocated": ev["allocated"], "peak": ev.get("peak") or 0}})
    _explain(model, out, tracks, us)
    other = {k: v for k, v in model.header.items() if isinstance(v, (str, int, float, bool))}
    other["trace_start_ns"] = t0
    return {"traceEvents": tracks.meta + out, "displayTimeUnit": "ms", "otherData": other}


def _consumers(model: TraceModel) -> dict[tuple[int, int, str, Any, Any], Span]:
    """(rank, step, kind, consuming stage, mb) -> the action that consumed that transfer."""
    from .trace_analysis import _input_keys

    out: dict[tuple[int, int, str, Any, Any], Span] = {}
    for r, lst in model.actions.items():
        for a in lst:
            for kind, stage, mb in _input_keys(a):
                out.setdefault((r, a.step, kind, stage, mb), a)
    return out


def per_rank_traces(model: TraceModel, doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """``doc`` (:func:`chrome_trace`'s) split into one document per rank, each with ``distributedInfo``.

    Holistic Trace Analysis (HTA) reads a folder of per-rank files and takes
    each one's rank from ``distributedInfo``; flow arrows between ranks do not
    survive the split (each file keeps its own half).
    """
    world = model.header.get("world_size") or len(model.ranks)
    out: dict[int, dict[str, Any]] = {}
    for r in model.ranks:
        evs = [e for e in doc["traceEvents"] if e.get("pid") == r]
        out[r] = {"traceEvents": evs, "displayTimeUnit": doc.get("displayTimeUnit", "ms"),
                  "otherData": doc.get("otherData", {}),
                  "distributedInfo": {"rank": r, "world_size": world, "backend": "pipeloom",
                                      "pp_rank": r, "pp_world_size": world}}
    return out


def _explain(model: TraceModel, out: list[dict[str, Any]], tracks: _Tracks, us: Any) -> None:
    """The critical path (its own category and track) and each rank's attribution (on its step slices)."""
    from .trace_analysis import Attributor, critical_path

    att = Attributor(model)
    present = [r for r in model.ranks if r not in model.missing_ranks]
    by_step_rank = {(s, r): att.attribute(r, s) for s in model.steps for r in present}
    for e in out:
        if e.get("cat") == "step":
            a = by_step_rank.get((e["args"].get("step"), e["pid"]))
            if a is not None:
                e["args"]["attribution_ns"] = a.to_json()
                e["args"]["eval"] = e["args"].get("step") in model.eval_steps
    for s in model.steps:
        cp = critical_path(model, s, attributor=att)
        for seg in cp.segments:
            if seg.rank < 0 or seg.duration <= 0:
                continue
            out.append({"ph": "X", "name": f"{seg.kind}: {seg.name}", "cat": "critical_path", "pid": seg.rank,
                        "tid": tracks.named(seg.rank, "critical path"), "ts": us(seg.start),
                        "dur": round(us(seg.end) - us(seg.start), 3),
                        "args": {"step": s, "kind": seg.kind, "peer": seg.peer}})


# ---------------------------------------------------------------- simulation


def _inputs_text(action: Any, place: tuple[int, ...] | list[int], last_stage: int) -> list[str]:
    out = []
    for leaf in action.leaves():
        s, t, m = leaf.stage, leaf.type.value, leaf.microbatch
        kind = transfer_kind(leaf.type)
        p = None if kind is None else producer_stage(kind, s, last_stage + 1)
        if kind == "F" and p is not None:
            out.append(f"{leaf}: activation of stage {p} microbatch {m} from rank {place[p]}")
        elif kind == "B" and p is not None:
            out.append(f"{leaf}: gradient from stage {p} microbatch {m} on rank {place[p]}")
        elif t == "W":
            out.append(f"{leaf}: {s}I{m}")
        elif t in ("B", "I"):
            out.append(f"{leaf}: the forward {s}F{m}")
    return out or [f"{action}: its inputs"]


def simulation_trace(
    schedule: Schedule,
    result: SimulationResult,
    costs: Costs,
    *,
    time_unit_ns: int = SIMULATION_UNIT_NS,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Header and events of a simulated step (``step`` 0), in the trace format; see the module docstring."""
    api = trace_api()
    place = list(schedule.stage_to_rank)
    last = len(place) - 1
    header = api.make_header(
        world_size=schedule.num_ranks,
        schedule=schedule.name,
        num_microbatches=schedule.num_microbatches,
        stage_to_rank=place,
        source="simulation",
        time_unit_ns=time_unit_ns,
        costs=asdict(costs),
    )

    def ns(t: float) -> int:
        return int(round(t * time_unit_ns))

    events: list[dict[str, Any]] = []
    transfers: list[tuple[float, int, int, str, int, int, Any, Any]] = []
    compute: dict[int, list[Any]] = {r: [] for r in schedule.actions}
    for e in result.events:
        a = e.action
        t = a.type.value
        if e.lane == "comm":
            s, m = a.stage, a.microbatch
            kind = "F" if t.endswith("_F") else "B"
            if t.startswith("SEND"):
                consumer = consumer_stage(kind, s)
                src, dst = e.rank, place[consumer]  # type: ignore[index]
            else:
                consumer, src, dst = s, place[producer_stage(kind, s)], e.rank  # type: ignore[index]
            transfers.append((e.start, src, dst, kind, consumer, m if m is not None else 0, e, t.startswith("SEND")))
            continue
        leaf = a.leaves()[0]
        ev: dict[str, Any] = {"ev": "action", "rank": e.rank, "step": 0, "name": str(a), "type": t, "stage": leaf.stage,
                              "mb": leaf.microbatch, "start": ns(e.start), "end": ns(e.end)}
        if a.sub_actions:
            ev["sub"] = [str(x) for x in a.sub_actions]
        events.append(ev)
        if e.lane == "compute":
            compute[e.rank].append(e)
    # seq numbers per (source, destination) in send order, as the runtime assigns them
    sends = sorted((x for x in transfers if x[7]), key=lambda x: (x[0], x[4], x[5]))
    seq_of: dict[tuple[str, int, int], int] = {}
    counters: dict[tuple[int, int], int] = {}
    for _, src, dst, kind, consumer, m, _e, _ in sends:
        seq_of[(kind, consumer, m)] = counters.get((src, dst), 0)
        counters[(src, dst)] = counters.get((src, dst), 0) + 1
    for _, src, dst, kind, consumer, m, e, is_send in transfers:
        events.append(
            {"ev": "send" if is_send else "recv", "rank": e.rank, "step": 0, "peer": dst if is_send else src, "stage": consumer,
             "mb": m, "kind": kind, "seq": seq_of.get((kind, consumer, m), -1), "bytes": costs.activation_bytes,
             "start": ns(e.start), "end": ns(e.end)}
        )
    for r, lst in compute.items():
        lst.sort(key=lambda e: e.start)
        prev = 0.0
        for e in lst:
            if e.start > prev:
                events.append({"ev": "wait", "rank": r, "step": 0, "start": ns(prev), "end": ns(e.start),
                               "for": _inputs_text(e.action, place, last)})
            prev = max(prev, e.end)
        events.append({"ev": "memory", "rank": r, "step": 0, "t": ns(result.makespan), "live_mb": result.peak_live_activations.get(r, 0)})
        events.append({"ev": "step", "rank": r, "step": 0, "start": 0, "end": ns(result.makespan)})
    events.sort(key=lambda ev: (ev.get("start", ev.get("t", 0)), ev["rank"]))
    return header, events
