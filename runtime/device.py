"""How an action is committed to the device: run now (CPU) or commit ahead on CUDA streams (GPU).

Problem.  On a CPU an action *is* its work: running it when its inputs have
arrived is the only sensible rule.  On a GPU running an action only enqueues
kernels.  Launching an action only when its input has *arrived* leaves the
GPU idle at every cross-rank dependency for the time the host needs to learn
of the arrival and launch the consumer, and a slow host path shows up
directly in the step time (measured: 7-14% slower than torch's static list
order on 2 GPUs for 1F1B, GPipe, Interleaved1F1B on a GPT with many small
microbatches).  torch enqueues everything in list order and lets stream waits
enforce the data dependencies, so its GPU queue never drains; but it cannot
reorder around a peer that is late.

Alternatives.  (a) Launch when arrived, plus a small fixed lookahead on
posted inputs (the first engine): a posted receive ahead of ready work on the
one compute stream blocks that work, and the receive itself could not start
before the compute queued ahead of its posting drained (NCCL orders its
stream after the *current* stream at posting).  (b) Walk the list like torch:
no dynamic order at all.  (c) Decide on the host by events, but *commit* an
action as soon as its inputs are *committed* - a local producer enqueued, or
a remote transfer announced by its sender (who enqueued its producer and its
send before announcing) with the receive posted - and let CUDA events and
stream waits enforce the data dependencies.  Reordering happens only among
actions not yet committed, so a peer that has not even enqueued its producer
still lets ready work go first.  That is (c), this module.

Deadlock freedom.  Every stream wait is on work already enqueued somewhere
(a local producer launched before, or a send the peer posted before it
announced it), so the waits follow real time and cannot form a cycle; NCCL's
pairing order is untouched (receives are still posted in the sender's
per-peer sequence, by the tensor plane).

Streams by role.  One fixed compute stream per local stage: every compute of
a stage runs there, so its forward, its backward and the gradient
accumulation (autograd runs AccumulateGrad on the stream where the node was
created: the stage's first forward) stay on one stream, and the halves of an
OVERLAP_F_B (always two different stages) really run concurrently; a rank
with one stage has nothing to overlap and runs it on the caller's stream (no
stream switch per action).  Receives
are posted with the *consumer's* stream current (as torch does): NCCL orders
its receive kernel after what that stream has queued, so the kernel starts
about when its data is needed.  Posting them on a separate transfer stream
(``early_receives``) lets the data land earlier, but the receive kernel then
sits on its SMs, spinning, until the sender's producer has run: measured on
2 H100s (1F1B, GPT, 16 microbatches), NCCL kernels were resident for 155 ms
of an 800 ms profile with a 10 ms horizon and 950 of 980 ms with 50 ms, and
the compute kernels took 3% and 30% longer.  The consumer's stream waits on
the receive's Work; a buffer allocated on another stream is recorded on it
(``record_stream``).  A local hand-off between two stages' streams is an
event.  At a step's start every stage stream waits on the caller's stream
(inputs, the optimizer's last update); at its end the caller's stream waits on
every stage stream (losses, gradients).  With data parallelism (collectives
launched on the current stream) or ``stage_streams=False`` every stage uses
the caller's stream.

Commit depth.  How far ahead to commit is measured in *device time*: each
action's GPU time is learned from CUDA events (per action type and stage,
over the first steps), and the dispatcher commits while the work queued and
not yet finished is below the horizon: ``horizon_ms``, or, once learned,
``launches`` times the host's longest mean launch time of an action type if
that is more (a queue shorter than one launch runs dry while the host
launches: measured on 2 H100s, a fixed 10 ms left 1F1B and GPipe 4.5-9%
behind torch on a GPT whose backward takes the host about 10 ms to launch;
30-60 ms were within 1%).  Enough to hide the host's launch time, small
enough that an action not committed yet can still be reordered.

Learning a device time.  Events around a launch measure the device's time
between them, which is the action's compute only if its kernels were queued
before the device reached them; on a host-bound rank whose input is already
there the device runs each kernel as soon as the host launches it, and the
pair measures the host's pace instead (measured, 4 x H200, GPT 1F1B: the last
rank's forward read 0.54 ms in one pipeline and 1.28 ms in an identical one
beside it, its backward 1.1 and 2.2 ms, which turned ``host_overlap_backward``
auto off on that rank alone and cost the step 30%).  So in each learning step,
before the first launch of each action type (an OVERLAP_F_B aside: its
other half runs on another stream), the stream first sleeps
(``torch.cuda._sleep``, calibrated once to ms) for 1.5 x the slowest launch
learned (4 ms at least, 25 at most) before the start event: that launch lands
in the sleep's shadow and its pair measures compute alone, and the least of
the samples is learned.  (A sleep before every launch let the device fall so
far behind that the host's launches blocked on the full launch queue: launch
times were learned 2-4x too long.)  It costs one sleep per action type in
each learning step.
``torch.cuda._sleep`` is not public; without it the times are learned as
before (the least of the learning steps' samples).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..schedules.dispatch import backward_overlap_pays  # (the rule's home: the simulator applies it too)

__all__ = ["DevicePolicy", "HostPolicy", "CudaPolicy", "make_policy", "commit_horizon", "backward_overlap_pays"]


class DevicePolicy:
    """The interface the actor uses; the CPU policy (run now, nothing queued)."""

    #: commit actions on committed (posted, not arrived) inputs
    commit_ahead = False
    #: GPUs: when set, every action's device time is measured (CUDA events, from after its input waits to
    #: its last kernel) and handed here as ``on_timed(meta, ms)`` once the events complete (tracing)
    on_timed: Any = None

    def begin_step(self) -> None:
        pass

    def end_step(self) -> None:
        pass

    def abandon_step(self) -> None:
        """The step failed (``end_step`` is not reached): forget what only held within it."""

    def on_stage(self, stage: int) -> contextlib.AbstractContextManager[Any]:
        """The context every compute of ``stage`` runs in (its stream on GPUs)."""
        return contextlib.nullcontext()

    def posting(self, stage: int) -> contextlib.AbstractContextManager[Any]:
        """The context receives for ``stage`` are posted in."""
        return contextlib.nullcontext()

    def sending_after(self, stage: int, end: Any) -> contextlib.AbstractContextManager[Any]:
        """The context sends of ``stage``'s outputs are posted in when their producer ended at ``end`` (a CUDA
        event recorded right after its launch) and the stage's stream may hold later work already."""
        return self.on_stage(stage)

    def start(self, key: tuple[Any, int], meta: Any = None) -> Any:
        """Before an action's launch; returns a token for :meth:`launched` (``meta``: what :attr:`on_timed`
        is handed with the action's device time, when set)."""
        return None

    def record_end(self, stage: int, token: Any, stream: Any = None) -> Any:
        """An action's end on ``stage``'s stream (``stream``, as :meth:`inputs_ready`), recorded right after its
        launch by whichever thread launched it (a backward on the worker), for :meth:`launched`'s ``end``; None
        on the host."""
        return None

    def flush(self) -> None:
        """Hand every action timed so far to :attr:`on_timed` (waiting for their device work)."""

    def relearn(self) -> None:
        """Between steps: the stages' work changed (``RuntimeOptions.cuda_graphs`` captured them), so what was
        learned of their host and device times no longer holds: learn it again over the next steps."""

    def inputs_ready(self, token: Any, stage: int, stream: Any = None) -> None:
        """After ``stage``'s stream was ordered after the inputs of the action of ``token``; ``stream``: that
        stream as the calling thread holds it (the worker thread: the policy's tracked stream is the loop's)."""

    def launched(self, key: tuple[Any, int], stages: Sequence[int], token: Any, end: Any = None) -> None:
        """After an action's launch on the streams of ``stages`` (``end``: its end, recorded on the first
        stage's stream by whoever launched it; default: recorded here, now)."""

    def host_time(self, key: tuple[Any, int], seconds: float) -> None:
        """How long the host took to launch an action (its compute and its sends)."""

    def wait_ms(self) -> float:
        """0 when another action may be committed now; else about how long (ms) until one may."""
        return 0.0

    def learned(self, key: tuple[Any, int]) -> tuple[float | None, float | None]:
        """An action type's learned (mean host launch ms, device ms); None where not learned yet (CPU: never;
        GPUs: the device time once the learning steps are over and timed)."""
        return None, None

    def shares_stream(self, a: int, b: int) -> bool:
        """Whether stages ``a`` and ``b`` compute on one stream (their kernels queue behind each other)."""
        return True

    def consume(self, stage: int, buffers: Sequence[torch.Tensor | None], works: Sequence[Any]) -> None:
        """Order ``stage``'s stream after a posted receive whose buffers it is about to read."""

    def handed(self, from_stage: int) -> Any:
        """A local hand-off from ``from_stage``'s stream: a token for :meth:`take_handed`."""
        return None

    def take_handed(self, token: Any, stage: int, tensors: Sequence[torch.Tensor | None]) -> None:
        pass

    def describe(self) -> str:
        return "run when ready (CPU)"


class HostPolicy(DevicePolicy):
    """CPU / gloo: an action runs when its inputs have arrived."""

    def consume(self, stage: int, buffers: Sequence[torch.Tensor | None], works: Sequence[Any]) -> None:
        # only with ``emulate_nccl_transport``: a receive the loop posted (the NCCL protocol on
        # gloo); the host waits for it, as torch's runtime does
        for w in works:
            w.wait()


def commit_horizon(min_ms: float, launches: float, host_ms: float, max_ms: float) -> float:
    """The commit horizon in force: ``min_ms``, or ``launches`` x ``host_ms`` (the slowest action
    type's mean host launch time) if more, at most ``max(max_ms, min_ms)``; ``launches`` 0: ``min_ms``."""
    if launches <= 0 or host_ms <= 0:
        return min_ms
    return min(max(min_ms, launches * host_ms), max(max_ms, min_ms))


#: launches of an action type averaged into its host launch time
_HOST_SAMPLES = 64


class _Timing:
    """Per (type, stage) GPU time in ms, learned from events over the first steps, and the
    host's launch time per (type, stage) (sum of seconds, count)."""

    __slots__ = ("est", "pending", "host", "first_seen", "seen")

    def __init__(self) -> None:
        self.est: dict[tuple[Any, int], float] = {}
        #: (key, start event, end event, learning?, meta for on_timed or None)
        #: (key, start event, end events (one per stream the action ran on), learning?, meta)
        self.pending: list[tuple[tuple[Any, int], Any, list[Any], bool, Any]] = []
        self.host: dict[tuple[Any, int], list[float]] = {}
        #: the step each action type was first launched in (its launches there are not learned)
        self.first_seen: dict[tuple[Any, int], int] = {}
        #: per action type: [steps it was started in, the last of them] (its device time is learned in its first ones)
        self.seen: dict[tuple[Any, int], list[int]] = {}

    def host_ms(self) -> float:
        """The longest mean launch time of an action type, in ms (0 before any was learned)."""
        # (a copy: the worker thread asks too, for a queued backward's learning sleep, while the loop may add a type)
        return max((t / n * 1e3 for t, n in list(self.host.values()) if n), default=0.0)

    def harvest(self, on_timed: Any = None) -> None:
        keep = []
        for item in self.pending:
            key, s, ends, learn, meta = item
            if all(e.query() for e in ends):
                # to the last of its streams' ends: an OVERLAP_F_B lasts as long as its longer half
                ms = max(s.elapsed_time(e) for e in ends)
                if learn:
                    old = self.est.get(key)
                    self.est[key] = ms if old is None else min(old, ms)  # the least: compute without stalls
                if meta is not None and on_timed is not None:
                    on_timed(meta, ms)
            else:
                keep.append(item)
        self.pending = keep


class _OnStream:
    """``torch.cuda.stream(s)`` for the policy's own switches, without its device lookups.

    ``torch.cuda.stream`` asks for the current stream and the device index on
    every entry (tens of microseconds on a GPU host, a few times per action);
    inside a step every switch goes through the policy, which therefore knows
    the current stream and only calls ``torch.cuda.set_stream``.
    """

    __slots__ = ("policy", "stream", "prev")

    def __init__(self, policy: CudaPolicy, stream: Any) -> None:
        self.policy = policy
        self.stream = stream
        self.prev: Any = None

    def __enter__(self) -> Any:
        p = self.policy
        self.prev = p._cur
        if self.stream is not p._cur:
            torch.cuda.set_stream(self.stream)
            p._cur = self.stream
        return self.stream

    def __exit__(self, *exc: object) -> None:
        p = self.policy
        if p._cur is not self.prev:
            torch.cuda.set_stream(self.prev)
            p._cur = self.prev


class CudaPolicy(DevicePolicy):
    """GPUs: commit ahead on stream-ordered inputs, one compute stream per stage (see the module docstring)."""

    commit_ahead = True

    def __init__(
        self,
        device: torch.device,
        stages: Iterable[int],
        *,
        stage_streams: bool = True,
        horizon_ms: float = 10.0,
        learn_steps: int = 2,
        default_ms: float = 1.0,
        early_receives: bool = False,
        launches: float = 0.0,
        max_horizon_ms: float = 250.0,
        count_running: bool = True,
        clock: Any = time.perf_counter,
        pad_learning: bool = True,
    ) -> None:
        self.device = device
        #: learning steps: the stream sleeps before an action's start event (see "Learning a device time");
        #: _sleep cycles per ms, calibrated at the first step (None: not yet; 0: unavailable)
        self.pad_learning = pad_learning
        self._cycles_per_ms: float | None = None
        #: count the device time the queue's head has already run as no longer queued (see :meth:`queued_ms`)
        self.count_running = count_running
        self._clock = clock
        self.early_receives = early_receives
        #: the configured horizon (``gpu_commit_ms``) and the one in force (see ``_set_horizon``)
        self.min_horizon_ms = self.horizon_ms = horizon_ms
        self.launches = launches
        self.max_horizon_ms = max(max_horizon_ms, horizon_ms)
        self.learn_steps = learn_steps
        self.default_ms = default_ms
        stages = sorted(stages)
        # A rank with one stage has nothing to overlap its compute with: its stage runs on the caller's
        # stream, so no action pays the stream switches (set_stream twice per compute, send and
        # receive: ~6 pybind calls per action on a GPU host) and the step's start and end need no
        # cross-stream waits.  (The same arrangement as stage_streams=False, which data parallelism
        # uses and the NCCL tests cover.)
        if len(stages) < 2:
            stage_streams = False
        #: stage -> its stream; None: the caller's current stream
        self.streams: dict[int, Any] = {s: (torch.cuda.Stream(device=device) if stage_streams else None) for s in stages}
        self._distinct = [s for s in dict.fromkeys(self.streams.values()) if s is not None]
        self._xfer = torch.cuda.Stream(device=device)
        #: sends of outputs whose producer's stream may hold later work (see sending_after), created when first used
        self._sends: Any = None
        self._caller: Any = None
        #: inside a step: the current stream (every switch goes through :class:`_OnStream`); None outside
        self._cur: Any = None
        self._steps = 0
        self._timing = _Timing()
        #: (estimated ms, end events, host clock at its launch) of every committed action not known finished
        self._queue: deque[tuple[float, list[Any], float]] = deque()
        self._queued_ms = 0.0
        #: host clock: when the queue's head may have begun on the device (see :meth:`queued_ms`), and the last poll
        self._head_since = 0.0
        self._polled = 0.0
        #: host launch times learned in this step (the horizon is recomputed at its end)
        self._host_changed = False

    # -- step boundaries ----------------------------------------------------
    def begin_step(self) -> None:
        self._caller = self._cur = torch.cuda.current_stream(self.device)
        if self.pad_learning and self._cycles_per_ms is None:
            self._cycles_per_ms = self._calibrate_sleep()
        for s in self._distinct:
            s.wait_stream(self._caller)

    def _calibrate_sleep(self) -> float:
        """``torch.cuda._sleep``'s cycles per ms on this device (a few ms on the transfer stream, synchronized
        once); 0 where it is missing or measures nothing."""
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is None:
            return 0.0
        cycles = 2_000_000
        with torch.cuda.stream(self._xfer):
            sleep(cycles)  # (the first launch may load the kernel: not timed)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(self._xfer)
            sleep(cycles)
            b.record(self._xfer)
        b.synchronize()
        ms = a.elapsed_time(b)
        return cycles / ms if ms > 0 else 0.0

    def _pad(self, stream: Any) -> None:
        """Learning: the stream sleeps while the host launches the action (see "Learning a device time")."""
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(self._pad_ms() * self._cycles_per_ms))

    def _pad_ms(self) -> float:
        """How long the stream sleeps before a learning step's action: 1.5 x the slowest launch learned, 4-25 ms."""
        return min(max(1.5 * self._timing.host_ms(), 4.0), 25.0)

    def relearn(self) -> None:
        self.flush()
        self._timing = _Timing()
        self._host_changed = True  # (the horizon follows the new launch times once learned)

    def abandon_step(self) -> None:
        # the tracked current stream held only inside the step; a late header landing after the
        # failure must not restore a stream from it
        self._cur = None

    def end_step(self) -> None:
        caller = self._caller or torch.cuda.current_stream(self.device)
        for s in self._distinct:
            caller.wait_stream(s)
        self._cur = None
        self._steps += 1
        if self._timing.pending:
            self._timing.harvest(self.on_timed)
        if self._host_changed:
            self._host_changed = False
            self._set_horizon()

    def _set_horizon(self) -> None:
        """At the end of a step that learned launch times: the queue must outlast the host's longest launch.

        While the host launches one action (Python, the autograd engine's launches, the
        sends), the device runs what is queued; a horizon shorter than that launch lets the
        queue run dry at every such action.  ``launches`` of the slowest action type's mean
        launch time keep it fed with a margin for the host's jitter; capped, so a stalled
        learning step cannot commit the whole step ahead.
        """
        self.horizon_ms = commit_horizon(self.min_horizon_ms, self.launches, self._timing.host_ms(), self.max_horizon_ms)

    # -- streams --------------------------------------------------------------
    def stream(self, stage: int) -> Any:
        s = self.streams.get(stage)
        if s is not None:
            return s
        # inside a step every switch goes through the policy, which knows the current stream (no device lookup)
        return self._cur if self._cur is not None else torch.cuda.current_stream(self.device)

    def on_stage(self, stage: int) -> contextlib.AbstractContextManager[Any]:
        s = self.streams.get(stage)
        if s is None:
            return contextlib.nullcontext()
        # outside a step (a header landing early) the current stream is not known here
        return _OnStream(self, s) if self._cur is not None else torch.cuda.stream(s)

    def posting(self, stage: int) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self._xfer) if self.early_receives else self.on_stage(stage)

    def sending_after(self, stage: int, end: Any) -> contextlib.AbstractContextManager[Any]:
        # (a backward launched on the worker: by the time its outputs are sent the worker or the loop may have
        # launched more on its stream; NCCL orders a send after the current stream, so a stream of its own
        # that waits for the producer's end only)
        if end is None:
            return self.on_stage(stage)
        if self._sends is None:
            self._sends = torch.cuda.Stream(device=self.device)
        self._sends.wait_event(end)
        return _OnStream(self, self._sends) if self._cur is not None else torch.cuda.stream(self._sends)

    def consume(self, stage: int, buffers: Sequence[torch.Tensor | None], works: Sequence[Any]) -> None:
        s = self.stream(stage)
        with self.on_stage(stage):
            for w in works:
                w.wait()  # NCCL: this stream waits for the receive; the host does not
        if self.early_receives:
            for b in buffers:
                if b is not None:
                    b.record_stream(s)  # allocated on the transfer stream, read (and freed) here

    def handed(self, from_stage: int) -> Any:
        s = self.stream(from_stage)
        ev = torch.cuda.Event()
        ev.record(s)
        return (s, ev)

    def take_handed(self, token: Any, stage: int, tensors: Sequence[torch.Tensor | None]) -> None:
        if token is None:
            return
        src, ev = token
        dst = self.stream(stage)
        if dst == src:
            return
        dst.wait_event(ev)
        for t in tensors:
            if t is not None and t.is_cuda:
                t.record_stream(dst)

    # -- commit depth ---------------------------------------------------------
    def start(self, key: tuple[Any, int], meta: Any = None) -> Any:
        """While learning, or for every action with :attr:`on_timed` set: a token [start event (recorded by
        :meth:`inputs_ready`), meta, learning?, sleep before the start?]."""
        # learned over the first ``learn_steps`` steps the action type appears in (not the pipeline's first
        # steps: evaluation steps before training would leave the backwards never timed)
        seen = self._timing.seen
        got = seen.get(key)
        if got is None:
            got = seen[key] = [0, -1]
        first_in_step = got[1] != self._steps
        if first_in_step:
            got[0] += 1
            got[1] = self._steps
        learn = got[0] <= self.learn_steps
        if not learn and self.on_timed is None:
            return None
        # the stream sleeps before the first launch of the type in each learning step only: one padded sample per
        # step is enough for the least, and a sleep before every launch let the device fall so far behind that
        # the host's launches blocked on a full queue (2 x H200: launch times learned 2-4x too long)
        # (not an OVERLAP_F_B: its other half runs on another stream, unslept, and would end before the start)
        return [None, meta if self.on_timed is not None else None, learn, learn and first_in_step and key[0] != "OVERLAP_F_B"]

    def flush(self) -> None:
        if self._timing.pending:
            for _, _, ends, _, _ in self._timing.pending:
                for e in ends:
                    e.synchronize()
            self._timing.harvest(self.on_timed)

    def inputs_ready(self, token: Any, stage: int, stream: Any = None) -> None:
        # recorded after the stream waits on the action's inputs, so that the time learned is
        # the action's own compute, not the wait for its producer.  On the worker thread the caller passes its
        # stream: a rank with one stage computes on the current stream, which stream() answers from the loop's
        # tracked one, and that may be the send stream while the loop hands a finished backward's outputs on
        if token is not None and token[0] is None:
            s = stream if stream is not None else self.stream(stage)
            if token[3] and self._cycles_per_ms:  # learning: compute alone, not the host's pace
                self._pad(s)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(s)
            token[0] = ev

    def record_end(self, stage: int, token: Any, stream: Any = None) -> Any:
        # timed iff the action's start event exists *now*: a queued backward's start is recorded on the worker
        # after its input's wait, later than the loop decided to launch it (both events of a timed pair must
        # be created with enable_timing, or elapsed_time raises); on the worker's own stream (see inputs_ready)
        end = torch.cuda.Event(enable_timing=token is not None and token[0] is not None)
        end.record(stream if stream is not None else self.stream(stage))
        return end

    def launched(self, key: tuple[Any, int], stages: Sequence[int], token: Any, end: Any = None) -> None:
        s = self.stream(stages[0])
        timed = token is not None and token[0] is not None
        if end is None:
            end = torch.cuda.Event(enable_timing=timed)
            end.record(s)
        ends = [end]
        for st in stages[1:]:  # the other half of an OVERLAP_F_B, on its own stream
            other = self.stream(st)
            if other != s:
                ev = torch.cuda.Event(enable_timing=timed)
                ev.record(other)
                ends.append(ev)
        if timed:
            self._timing.pending.append((key, token[0], ends, token[2], token[1]))
        est = self._timing.est.get(key, self.default_ms)
        now = self._clock()
        if not self._queue:
            self._head_since = now  # into an empty queue: it begins about now
        self._queue.append((est, ends, now))
        self._queued_ms += est

    def host_time(self, key: tuple[Any, int], seconds: float) -> None:
        # Learned from the step after the first one an action type appears in (that step's
        # launches include one-time work: allocations, kernel selection), over its first
        # ``_HOST_SAMPLES`` launches; an action type first seen later (a training step after
        # evaluation steps) is learned then, and the horizon follows at that step's end.
        t = self._timing
        first = t.first_seen.get(key)
        if first is None:
            t.first_seen[key] = self._steps
            return
        if first == self._steps:
            return
        acc = t.host.get(key)
        if acc is None:
            t.host[key] = [seconds, 1]
        elif acc[1] < _HOST_SAMPLES:
            acc[0] += seconds
            acc[1] += 1
        else:
            return
        self._host_changed = True

    def queued_ms(self) -> float:
        """Estimated device time (ms) of the committed actions not known to have finished.

        The head of the queue is counted for what is left of it: its estimate less the time
        since it may have begun (the predecessor was last seen running half-way between the
        poll that found it done and the poll before).  Counting the head whole until its end
        event completes made an action longer than the horizon hold every commit behind it
        until it finished: the device then ran dry for the host's launch of the next action
        (the last stage of 1F1B: each forward after a long backward).  An estimate that runs
        out early (the head waits on a transfer) commits more, never less.
        """
        q = self._queue
        now = self._clock()
        popped = False
        while q and all(e.query() for e in q[0][1]):
            self._queued_ms -= q.popleft()[0]
            popped = True
        if not q:
            self._queued_ms = 0.0
            self._polled = now
            return 0.0
        if popped:  # (never before its own launch)
            mid = (self._polled + now) * 0.5
            self._head_since = mid if mid > q[0][2] else q[0][2]
        self._polled = now
        if not self.count_running:
            return self._queued_ms
        ran = (now - self._head_since) * 1e3
        head = q[0][0]
        return self._queued_ms - (ran if ran < head else head)

    def wait_ms(self) -> float:
        over = self.queued_ms() - self.horizon_ms
        return over if over > 0 else 0.0

    def learned(self, key: tuple[Any, int]) -> tuple[float | None, float | None]:
        t = self._timing
        if any(p[3] and p[0] == key for p in t.pending):
            t.harvest(self.on_timed)  # (asked once per decision: take what has completed since the last step's end)
        acc = t.host.get(key)
        # the device time once its learning steps are over and every launch of theirs was timed: before,
        # it may hold the first step's alone (one-time work: 2 x H100, a host-bound rank's B read as 3x)
        seen = t.seen.get(key)
        done = (seen is not None and (seen[0] > self.learn_steps or (seen[0] == self.learn_steps and seen[1] < self._steps))
                and not any(p[3] and p[0] == key for p in t.pending))
        return (acc[0] / acc[1] * 1e3 if acc and acc[1] else None), (t.est.get(key) if done else None)

    def shares_stream(self, a: int, b: int) -> bool:
        return self.streams.get(a) is self.streams.get(b)

    def describe(self) -> str:
        per = "one stream per stage" if self._distinct else "the caller's stream"
        recv = "a transfer stream" if self.early_receives else "the consumer's stream"
        learned = (f", or {self.launches:g} x the slowest action's host launch time once learned" if self.launches > 0 else "")
        return (f"commit ahead on CUDA ({per}, receives posted on {recv}, horizon {self.horizon_ms:g} ms of queued device time"
                f"{learned})")


def make_policy(
    device: torch.device, stages: Iterable[int], *, stage_streams: bool, horizon_ms: float, early_receives: bool = False,
    launches: float = 0.0, count_running: bool = True, learn_sleep: bool = True,
) -> DevicePolicy:
    if device.type != "cuda":
        return HostPolicy()
    return CudaPolicy(device, stages, stage_streams=stage_streams, horizon_ms=horizon_ms, early_receives=early_receives,
                      launches=launches, count_running=count_running, pad_learning=learn_sleep)
