"""Rank traces: what every rank did, when, and what it waited for.

Format (``pipeloom-trace`` version 1): JSON Lines.  The first line is a header
object, every other line one event object.  JSON Lines because a trace is
appended to while the job runs (a live viewer tails it), survives a crash up
to the last flushed step, and is readable by anything.

Header::

    {"format": "pipeloom-trace", "version": 1, "world_size": 2,
     "schedule": "1F1B", "num_microbatches": 8, "stage_to_rank": [0, 1],
     "clock": "ns", "source": "run" | "simulation", "time_unit_ns": 1}

A run's header also carries ``"options"``: the RuntimeOptions that planning it
needs (``gpu_commit_ms``, ``gpu_commit_launches``, ``host_overlap_backward``,
``overlap_streams``, ``gpu_learn_sleep``, ``dispatch``), the auto overlap rule's ``overlap_margin``
(``schedules.dispatch.OVERLAP_MARGIN``; absent before session M: 1.0) and ``"device"`` (``cpu`` or ``cuda``).
A file written by the launcher's collector adds ``"live": "tcp://HOST:PORT"``
(where ``pipeloom trace attach`` subscribes); a simulated plan adds
``"time_unit_ns"`` (ns per simulated time unit) and ``"costs"``.

Events (times in nanoseconds on a clock shared by all ranks of one host:
``time.monotonic_ns()`` shifted by the rank's wall-clock offset measured at
start, so ranks line up and a rank's own times never go backwards)::

    {"ev": "action", "rank": 0, "step": 3, "name": "1F3", "type": "F",
     "stage": 1, "mb": 3, "start": ..., "end": ...}
    {"ev": "wait",   "rank": 0, "step": 3, "start": ..., "end": ...,
     "for": ["1F4 input from rank 0"]}
    {"ev": "send" | "recv", "rank": 0, "step": 3, "peer": 1, "stage": 2,
     "mb": 3, "kind": "F" | "B", "seq": 17, "bytes": 4096,
     "start": ..., "end": ...}
    {"ev": "memory", "rank": 0, "step": 3, "t": ..., "live_mb": 2,
     "allocated": bytes, "peak": bytes}      # CUDA numbers on GPU only
    {"ev": "step", "rank": 0, "step": 3, "start": ..., "end": ...}
                                             # + "eval": true for Pipeline.eval()
    {"ev": "collective", "rank": 0, "step": 3, "name": "2REDUCE_GRAD",
     "kind": "all-gather" | "reduce-scatter" | "all-reduce", "stage": 2,
     "bytes": 4096, "start": ..., "end": ...}   # data parallelism
    {"ev": "device", "rank": 0, "step": 3, "name": "1F3", "type": "F",
     "stage": 1, "mb": 3, "t": ..., "ns": 1830000}   # GPUs only

A ``device`` event is an action's time on the GPU, measured with CUDA events
from after its stream waited for its inputs to after its last kernel (the
compute alone, without waits on a peer); ``t`` is the action's host start,
so it sorts beside it.  It is recorded when the events have completed: a
step or more after the action, and at the latest when the Pipeline closes.
The host span of an action (its ``action`` event) is its launch; the two
together are what ``pipeloom schedule tune`` models on GPUs.

A ``wait``'s ``for`` names what the first pending actions lack, one string
each, ``"{action}: {what}"``: ``activation of stage S microbatch M from rank
R``, ``gradient from stage S microbatch M on rank R``, ``memory (live
microbatches at the schedule's peak N)``, an ``UNSHARD``/all-gather, a
``REDUCE_GRAD``; the end of a step adds waits ``for`` ``["data-parallel
collectives to complete"]`` and ``["sends to complete"]``.  ``pipeloom trace
summary`` attributes every wait to a cause and a peer from these and from the
receive that ended it.

A step's span covers the rank's whole ``run_step`` (every action, send and
wait of the step is inside it); eval steps carry ``"eval": true`` so that the
tools leave them out of training statistics.

Static shapes (no transfer headers) trace a receive with ``"posted": true``:
its start is when the receiver posted it, before the sender had sent
anything (on NCCL its end is that moment too: it lands on the device); a
send and its receive match on (source, destination, step, seq), seq being
then the transfer's place in the step's list order.

A collective's start is when its action launched it and its end when the
dispatcher saw it complete (the action span itself only covers the launch).

``type`` is one of F, B, I, W, OVERLAP_F_B, UNSHARD, RESHARD, REDUCE_GRAD;
for OVERLAP_F_B ``stage``/``mb`` are those of the forward half and
``sub`` lists both halves' names.  A send's start is when it was posted and
its end when the payload left; a receive's start is when its announcement
arrived (buffers posted) and its end when the data landed.  Names follow
torch's profiler (``PP:`` is added by the Chrome export).

Recording cost: events are tuples appended to a list (no formatting on the
hot path) and serialised once per step; with tracing off the actor holds
``None`` and every record call site is a single ``is not None`` test.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = [
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "TraceRecorder",
    "TraceFile",
    "read_trace",
    "write_trace",
    "clock_ns",
    "make_header",
    "append_events",
    "FileSink",
    "StreamSink",
    "read_header",
    "check_batch",
    "expand_paths",
]

TRACE_FORMAT = "pipeloom-trace"
TRACE_VERSION = 1

def _wall_offset(samples: int = 16) -> int:
    """``time.time_ns() - time.monotonic_ns()``, from the sample whose wall-clock read was bracketed most tightly
    by two monotonic reads.  One pair of reads, as before, took any preemption between them into the offset: on a
    loaded machine two ranks' aligned clocks then disagreed by more than 0.1 ms (a send seen to start after its
    receive had ended)."""
    best: tuple[int, int] | None = None
    for _ in range(samples):
        a = time.monotonic_ns()
        w = time.time_ns()
        b = time.monotonic_ns()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) // 2)
    assert best is not None
    return best[1]


_OFFSET = _wall_offset()


def clock_ns() -> int:
    """Monotonic nanoseconds on the wall-clock scale (aligned across ranks of a host)."""
    return time.monotonic_ns() + _OFFSET


class TraceRecorder:
    """Collects one rank's events; ``drain()`` hands them over as dicts once per step."""

    __slots__ = ("rank", "_events")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._events: list[dict[str, Any]] = []

    def action(self, step: int, name: str, type_: str, stage: int, mb: int | None, start: int, end: int, sub: list[str] | None = None,
               *, beside: bool = False) -> None:
        ev = {"ev": "action", "rank": self.rank, "step": step, "name": name, "type": type_, "stage": stage, "mb": mb, "start": start, "end": end}
        if sub:
            ev["sub"] = sub
        if beside:  # (options.host_overlap_backward: launched on the worker thread while the loop ran the forwards)
            ev["beside"] = True
        self._events.append(ev)

    def device(self, step: int, name: str, type_: str, stage: int, mb: int | None, t: int, ns: int) -> None:
        self._events.append({"ev": "device", "rank": self.rank, "step": step, "name": name, "type": type_, "stage": stage,
                             "mb": mb, "t": t, "ns": ns})

    def wait(self, step: int, start: int, end: int, waiting_for: list[str]) -> None:
        self._events.append({"ev": "wait", "rank": self.rank, "step": step, "start": start, "end": end, "for": waiting_for})

    def transfer(self, ev: str, step: int, peer: int, stage: int, mb: int, kind: str, seq: int, nbytes: int, start: int, end: int,
                 posted: bool = False) -> None:
        e = {"ev": ev, "rank": self.rank, "step": step, "peer": peer, "stage": stage, "mb": mb, "kind": kind, "seq": seq, "bytes": nbytes,
             "start": start, "end": end}
        if posted:
            e["posted"] = True
        self._events.append(e)

    def memory(self, step: int, live_mb: int, allocated: int | None = None, peak: int | None = None) -> None:
        ev: dict[str, Any] = {"ev": "memory", "rank": self.rank, "step": step, "t": clock_ns(), "live_mb": live_mb}
        if allocated is not None:
            ev["allocated"], ev["peak"] = allocated, peak
        self._events.append(ev)

    def collective(self, step: int, name: str, kind: str, stage: int, nbytes: int, start: int, end: int) -> None:
        self._events.append(
            {"ev": "collective", "rank": self.rank, "step": step, "name": name, "kind": kind, "stage": stage, "bytes": nbytes, "start": start, "end": end}
        )

    def step(self, step: int, start: int, end: int, *, train: bool = True) -> None:
        ev: dict[str, Any] = {"ev": "step", "rank": self.rank, "step": step, "start": start, "end": end}
        if not train:
            ev["eval"] = True
        self._events.append(ev)

    def drain(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events


@dataclass
class TraceFile:
    """A whole trace in memory: the header and every event."""

    header: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return int(self.header.get("world_size", 1 + max((e["rank"] for e in self.events), default=0)))

    def of_kind(self, ev: str) -> Iterator[dict[str, Any]]:
        return (e for e in self.events if e["ev"] == ev)


def make_header(*, world_size: int, schedule: str, num_microbatches: int, stage_to_rank: Iterable[int], source: str = "run", **extra: Any) -> dict[str, Any]:
    return {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "world_size": world_size,
        "schedule": schedule,
        "num_microbatches": num_microbatches,
        "stage_to_rank": list(stage_to_rank),
        "clock": "ns",
        "source": source,
        **extra,
    }


def write_trace(path: str | os.PathLike[str] | IO[str], header: dict[str, Any], events: Iterable[dict[str, Any]]) -> None:
    """Write a complete trace file."""
    def _write(f: IO[str]) -> None:
        f.write(json.dumps(header, separators=(",", ":")) + "\n")
        for e in events:
            f.write(json.dumps(e, separators=(",", ":")) + "\n")

    if hasattr(path, "write"):
        _write(path)  # type: ignore[arg-type]
    else:
        with open(path, "w") as f:  # type: ignore[arg-type]
            _write(f)


def append_events(f: IO[str], events: Iterable[dict[str, Any]]) -> None:
    for e in events:
        f.write(json.dumps(e, separators=(",", ":")) + "\n")
    f.flush()


def expand_paths(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[str]:
    """The files a list of trace paths means.

    ``PATH`` that does not exist but ``PATH.rank0``... do is the trace path
    given to a job that ran without the collecting launcher (under torchrun
    every rank writes ``PATH.rank{R}``, see :class:`FileSink`): it stands for
    all of them, so the path given to the job works with every ``pipeloom
    trace`` command.
    """
    import glob
    import re

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[str] = []
    for p in map(os.fspath, paths):
        if not os.path.exists(p):
            ranks = [q for q in glob.glob(glob.escape(p) + ".rank*") if re.fullmatch(r"\.rank\d+", q[len(p):])]
            if ranks:
                out += sorted(ranks, key=lambda q: int(q[len(p) + 5:]))
                continue
        out.append(p)
    return out


#: Header fields that every file of one trace must agree on.
_MUST_AGREE = ("source", "world_size", "schedule", "num_microbatches")


def read_trace(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> TraceFile:
    """Read one trace file, or several per-rank files of one job (merged, headers must agree).

    A truncated last line (a job killed mid-write) is ignored; any other
    malformed line raises ValueError naming the file and line.  Files whose
    headers disagree on the source (a simulated plan and a recorded run), the
    world size, the schedule or the microbatch count are not one job: that is
    a ValueError naming both files (``pipeloom trace compare`` sets a run
    against a plan).
    """
    paths = expand_paths(paths)
    header: dict[str, Any] | None = None
    first = ""
    events: list[dict[str, Any]] = []
    for path in paths:
        with open(path) as f:
            lines = f.read().split("\n")
        if not lines or not lines[0].strip():
            raise ValueError(f"{path}: empty file, not a {TRACE_FORMAT}")
        try:
            h = json.loads(lines[0])
        except ValueError:
            raise ValueError(f"{path}: line 1 is not JSON; a {TRACE_FORMAT} starts with a header object") from None
        if not isinstance(h, dict) or h.get("format") != TRACE_FORMAT:
            raise ValueError(f"{path}: not a {TRACE_FORMAT} (header format={h.get('format') if isinstance(h, dict) else h!r})")
        if h.get("version") != TRACE_VERSION:
            raise ValueError(f"{path}: {TRACE_FORMAT} version {h.get('version')} is not supported (this reads {TRACE_VERSION})")
        if header is None:
            header, first = h, str(path)
        else:
            for key in _MUST_AGREE:
                if h.get(key, "run" if key == "source" else None) != header.get(key, "run" if key == "source" else None):
                    a, b = header.get(key, "run" if key == "source" else None), h.get(key, "run" if key == "source" else None)
                    hint = (" (a simulated plan and a recorded run are not one trace: compare them with "
                            "`pipeloom trace compare RUN PLAN`)" if key == "source" else "")
                    raise ValueError(f"{first} and {path} are not files of one job: {key} {a!r} vs {b!r}{hint}")
        body = [ln for ln in lines[1:]]
        while body and not body[-1].strip():
            body.pop()
        for i, ln in enumerate(body, start=2):
            if not ln.strip():
                continue
            try:
                e = json.loads(ln)
            except ValueError:
                if i == len(body) + 1:  # a torn final line
                    break
                raise ValueError(f"{path}: line {i} is not JSON") from None
            if not isinstance(e, dict) or "ev" not in e or "rank" not in e:
                raise ValueError(f"{path}: line {i} is not a trace event (needs 'ev' and 'rank')")
            events.append(e)
    assert header is not None
    events.sort(key=lambda e: e.get("start", e.get("t", 0)))
    return TraceFile(header, events)


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Only the header of a trace file (e.g. for the ``live`` address a collector wrote there)."""
    with open(path) as f:
        first = f.readline()
    try:
        h = json.loads(first)
    except ValueError:
        raise ValueError(f"{path}: line 1 is not JSON; a {TRACE_FORMAT} starts with a header object") from None
    if not isinstance(h, dict) or h.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path}: not a {TRACE_FORMAT}")
    return h


def check_batch(msg: Any) -> dict[str, Any]:
    """Validate one decoded stream batch (what :class:`StreamSink` sends); ValueError says why.

    A batch is ``{"v": 1, "type": "trace", "src": rank, "header": {...} | None,
    "events": [...], "dropped": n}``; every event must be an object with
    ``ev`` and ``rank``, as in a file.  Readers of the stream (the launcher's
    collector, ``pipeloom trace attach``) call this on everything they get,
    because a socket is untrusted input.
    """
    if not isinstance(msg, dict):
        raise ValueError(f"a trace batch is a map, not {type(msg).__name__}")
    if msg.get("v") != 1 or msg.get("type") != "trace":
        raise ValueError(f"not a version-1 trace batch (v={msg.get('v')!r}, type={msg.get('type')!r})")
    src = msg.get("src")
    if not isinstance(src, int) or isinstance(src, bool) or src < 0:
        raise ValueError(f"bad source rank {src!r}")
    header = msg.get("header")
    if header is not None and (not isinstance(header, dict) or header.get("format") != TRACE_FORMAT):
        raise ValueError(f"batch from rank {src}: the header is not a {TRACE_FORMAT} header")
    events = msg.get("events")
    if not isinstance(events, list):
        raise ValueError(f"batch from rank {src}: 'events' is not a list")
    for e in events:
        if not isinstance(e, dict) or not isinstance(e.get("ev"), str) or not isinstance(e.get("rank"), int):
            raise ValueError(f"batch from rank {src}: an event without 'ev' and 'rank'")
    dropped = msg.get("dropped", 0)
    if not isinstance(dropped, int) or dropped < 0:
        raise ValueError(f"batch from rank {src}: bad 'dropped' count {dropped!r}")
    return msg


# ---------------------------------------------------------------- sinks
class FileSink:
    """Appends a rank's events to its own JSON Lines file, from a writer thread.

    Used without a collecting launcher (e.g. under torchrun): rank R writes
    ``PATH`` when it is the only rank, else ``PATH.rank{R}``; ``pipeloom
    trace`` reads several per-rank files of one job as one trace.
    """

    def __init__(self, path: str, rank: int, world_size: int, header: dict[str, Any]) -> None:
        import queue
        import threading

        self.path = path if world_size == 1 else f"{path}.rank{rank}"
        self._q: queue.SimpleQueue[list[dict[str, Any]] | None] = queue.SimpleQueue()
        self._f = open(self.path, "w")
        self._f.write(json.dumps(header, separators=(",", ":")) + "\n")
        self._f.flush()
        self._thread = threading.Thread(target=self._run, name="pipeloom-trace-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            batch = self._q.get()
            if batch is None:
                break
            append_events(self._f, batch)
        self._f.close()

    def emit(self, events: list[dict[str, Any]]) -> None:
        if events:
            self._q.put(events)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)


class StreamSink:
    """Streams a rank's events to the launcher's collector over ZeroMQ (signed msgpack batches).

    The collector (``pipeloom launch --trace FILE``) writes one file per job
    and republishes the batches to live viewers (``pipeloom trace attach``).
    Sending never blocks the rank: if the collector falls behind, batches
    beyond the queue limit are dropped and counted in the next batch.
    """

    BATCH = 2000  #: events per message (keeps frames well under the 1 MiB limit)

    def __init__(self, endpoint: str, rank: int, header: dict[str, Any], secret: bytes) -> None:
        import zmq

        from ..transport.messages import sign

        self._sign = sign
        self._key = secret
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        self._sock.connect(endpoint)
        self.rank = rank
        self._header: dict[str, Any] | None = header
        self.dropped = 0

    def emit(self, events: list[dict[str, Any]]) -> None:
        import msgpack

        for i in range(0, max(len(events), 1), self.BATCH):
            msg = {"v": 1, "type": "trace", "src": self.rank, "header": self._header, "events": events[i : i + self.BATCH], "dropped": self.dropped}
            try:
                self._sock.send(self._sign(self._key, msgpack.packb(msg, use_bin_type=True)), self._zmq.NOBLOCK)
                self._header = None
            except self._zmq.Again:
                self.dropped += len(events[i : i + self.BATCH])

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
