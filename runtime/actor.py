"""The rank actor: one asyncio loop that runs a rank's actions as their inputs arrive.

Why an actor and not a list walker.  torch's pipelining runtime walks each
rank's action list in order and blocks on every receive, so one late
activation stalls everything behind it even when a weight-gradient (W) or
another microbatch's backward could run.  Here the list is a *priority order*:
the dispatcher runs the highest-priority action whose dependencies are met,
and sleeps only when nothing is ready.  Arrivals (a receive completing on a
waiter thread, a control message) wake it; landed transfers queue up in
``runtime/landing.py``'s queue, which the dispatcher drains before each
choice and, on CPU, waits on directly for a short bounded slice when nothing
is ready (no event-loop round trip per transfer).

Invariants:
- Pairing order of point-to-point transfers is decided by the sender alone
  (see ``pipeloom.transport.tensor``); dispatch order never affects it.
- Which ready action runs is the dispatch rule's choice (``schedules/dispatch.py``,
  option ``dispatch``), pure and tested in one process: forwards run in list
  order and only while the rank holds fewer live microbatches than the static
  order's peak, so no rule uses more activation memory than the schedule
  promises, and none can deadlock a schedule the validator accepts.
- ``deterministic=True`` runs exactly the list order (for debugging and
  bit-exact comparison with torch).
- GPUs: running an action only launches kernels.  An action is *committed*
  as soon as its inputs are committed (a local producer launched, or a
  transfer announced by its sender with the receive posted), and stream waits
  on CUDA events enforce the data dependencies; the dispatcher reorders only
  what it has not committed, and commits while the device time queued is
  under a horizon.  Each local stage has its own compute stream, so the
  halves of an OVERLAP_F_B (two stages) run concurrently.  The policy lives
  in ``runtime/device.py`` (CPU: run when arrived).
- Failures: an exception in an action is wrapped with rank, step, stage,
  microbatch and action, broadcast to every peer as an ``abort`` message, and
  raised; a peer's abort is raised here as :class:`RemoteRankError`.

Static shapes (NCCL; ``RuntimeOptions.static_shapes``).  With a header per
transfer, a receiver commits a consumer only once the sender's header has
landed, so on a host-bound GPU job (many small microbatches) each host waits
for the other's at every cross-rank dependency: measured on 2 H100s (GPT,
32 microbatches, 1F1B), rank 0's dispatcher sat idle 20-40 ms of a 240-280 ms
step where torch's host never waits.  torch posts a receive before the
sender has produced anything and lets the device wait; it can because its
shapes are fixed and its order is the list's.  Here, once the transfers of a
step with the same inputs have been seen (auto: every rank's input layout,
agreed by one all-gather at the step's start; ``True``: every step after the
first of its kind), a step runs *headerless*: each rank sends to each peer in
its list order (an output produced out of order waits, on the device, for
the ones before it), and the receiver posts the receive with the learned
shapes and commits the consumer - but only for the first pending action of
the list, so every wait on a peer is one torch's static order would also
make at that point and the validator's deadlock freedom carries over (the
other actions still need inputs that are local or already posted).  A
transfer that does not match what was learned is never received into the
wrong buffers: its sender fills the posted receive with a placeholder and
fails the step; every sender ends a headerless step with one end header per
peer, which its peers wait for before finishing theirs, so no rank completes
a step on a placeholder.  Alternatives: predicting shapes but keeping the
headers (the host hop stays on the critical path), or posting receives
early on a separate stream (spinning NCCL kernels slowed compute by 3-30%).

Static shapes on gloo (``static_shapes=True``).  The same protocol on CPU, where
"committing" cannot mean a device wait: after the first step the loop thread posts
each peer's next ``gloo_prepost_depth`` payloads ahead (a gloo receive posted before
its send lands in a fifth of the time) and, when the list's head needs one, waits
for it in gloo itself (``_wait_direct``): one thread hop per transfer, as torch's
runtime, instead of gloo's thread -> a receiver thread -> the dispatcher's.  A posted
receive is not an arrived input, so only the head may wait on one (the same rule as
above).  Such a wait cannot be given up, so ``runtime/direct_wait.py``'s watchdog
stands in for the loop meanwhile (reads the control plane, judges the peer's
liveness) and breaks the wait, closing that pair, when a rank failed or the peer is
lost.  Measured in ``benchmarks/RESULTS.md`` ("CPU host path, round 5").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import functools
import hashlib
import logging
import sys
import time
import traceback
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..schedules import Action, ActionType, Dataflow, Schedule, consumer_stage, producer_stage
from ..schedules.dispatch import (Dispatcher, OverlapTrial, choose_rule, host_heavy, overlappable_backwards, plan_ranks, queueable_backwards,
                                  stage_streams)
from ..transport.control import ControlPlane
from ..transport.tensor import END, Landed, SendError, TensorPlane, TransferError, guard_exit_works, signature
from .device import DevicePolicy, backward_overlap_pays, make_policy
from .direct_wait import DirectWait
from .errors import PeerLostError, PipelineConfigError, PipelineError, RemoteRankError, StageError
from .landing import LandingQueue
from .liveness import PeerLiveness
from .options import RuntimeOptions
from .stage import StageExecutor
from .trace import TraceRecorder, clock_ns
from .trace import _OFFSET as _TRACE_OFFSET

__all__ = ["RankActor", "StepInputs", "ActorStatistics"]

log = logging.getLogger("pipeloom.actor")

_F, _B, _I, _W, _OVL = ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.OVERLAP_F_B


def _own_collectives(module: torch.nn.Module) -> bool:
    """Whether a stage's module visibly issues collectives of its own (host_overlap_backward auto stays off)."""
    # a parameter can be a DTensor only once its module was imported: importing it here would cost seconds
    # (sympy; a rank's constructor on a GPU host took over 8 s with a cold cache) for nothing
    mod = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(mod, "DTensor", None) if mod is not None else None
    if dtensor is not None and any(isinstance(p, dtensor) for p in module.parameters()):
        return True
    return any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules())


def _copy_out(raw: Any) -> Any:
    """A last stage's output kept for the caller, copied out of a CUDA graph's buffer (the next replay reuses it)."""
    if isinstance(raw, torch.Tensor):
        return raw.detach().clone()
    if isinstance(raw, (tuple, list)):
        return type(raw)(_copy_out(r) for r in raw)
    return raw


class _Beside(NamedTuple):
    """options.host_overlap_backward: a backward in flight on the worker thread."""

    action: Action
    future: Any
    #: the policy's timing key and token (GPUs), the host clock at its launch (perf_counter) and its trace start (ns)
    tkey: Any
    token: Any
    h0: float
    a0: int
    #: when it was handed to the worker (perf_counter)
    submitted: float


def _beside_only(ready: Any, queueable: Any, a: Action) -> bool:
    """options.host_overlap_backward: while a backward launches on the worker only forwards run beside it, and
    (host_queue_backwards) a backward that may be queued behind it."""
    if a.type is _F:
        return ready(a)
    return a.type is _B and (a.stage, a.microbatch) in queueable and ready(a)
#: data-parallel events, run through the ``collectives`` object (runtime/data_parallel.py)
_DP = frozenset({ActionType.UNSHARD, ActionType.RESHARD, ActionType.REDUCE_GRAD})
_UNSHARD, _RESHARD, _REDUCE_GRAD = ActionType.UNSHARD, ActionType.RESHARD, ActionType.REDUCE_GRAD
#: after a transport error on a transfer with a peer: how long to wait for the control plane to
#: confirm that the peer is gone (its connection's close is read every heartbeat interval)
_CONFIRM_LOST = 1.5
#: words of a transport error that says the connection to the peer broke (gloo's messages)
#: CPU, no collectives: the longest the dispatcher runs actions without giving the event loop a
#: turn (control messages: a peer's abort, a bye)
_YIELD_EVERY = 1e-3
#: static shapes, auto: how long the step's layout agreement is polled on the loop's thread before it waits
_AGREE_SPIN = 5e-5
#: static shapes, auto: how long a rank whose peer aborted during the layout agreement still waits for the
#: gather's own result (see ``_agree_layout``), in seconds
_AGREE_GRACE = 0.5
#: traced direct waits (gloo, static shapes) shorter than this are not written as wait events (the
#: data had landed: the wait only took it)
_TRACED_WAIT_NS = 20_000
_CONNECTION_BROKE = ("Connection closed", "Connection reset", "Broken pipe", "Connection refused", "Socket closed")


#: every actor alive in this process (for debug dumps)
_LIVE: weakref.WeakSet[RankActor] = weakref.WeakSet()


def debug_dump() -> str:
    """``debug_state()`` of every live actor in this process."""
    return "\n".join(a.debug_state() for a in list(_LIVE)) or "no pipeloom actor alive in this process"


@dataclass
class StepInputs:
    """One step's microbatches, as every rank receives them."""

    args: list[tuple[Any, ...]]
    kwargs: list[dict[str, Any]]
    targets: list[Any] | None
    #: a hashable key of the batch before it was cut (``split_microbatches``) that determines every
    #: microbatch's layout, or None; ``input_signature`` caches its digest by it
    layout_key: Any = None
    #: what the ranks' calls must agree on (batch rows, keyword names: ``pipeline.call_check``), checked
    #: with the step's input layouts where those are gathered
    call_check: int = 0
    #: a digest of this rank's stages' trainable set, parameter shapes and train/eval modes
    #: (``pipeline._stall_budget``), part of the layout that static shapes learn transfers by
    model_key: int = 0


@dataclass(frozen=True)
class ActorStatistics:
    """What the last step did (for tests, traces and benchmarks)."""

    actions_run: int
    out_of_order: int  #: actions run before an earlier-listed action
    idle_waits: int  #: times the dispatcher slept with nothing ready
    idle_seconds: float  #: the dispatcher with nothing ready, or (gloo, static shapes) waiting in gloo for a peer
    peak_live_microbatches: int
    #: transfers this rank sent without a header (NCCL, ``static_shapes``, after the first step of a kind)
    headerless_sends: int = 0
    #: static shapes: outputs produced ahead of their turn in a peer's send order, held until it came
    held_sends: int = 0
    #: options.host_overlap_backward: backwards launched on the worker thread beside the next forward
    overlapped_backwards: int = 0
    #: options.host_queue_backwards: of those, backwards queued on the worker behind another one
    queued_backwards: int = 0
    #: options.cuda_graphs: forwards replayed from a stage's CUDA graph (the rest ran eagerly)
    graphed_forwards: int = 0


class Wakeup:
    """What wakes the dispatcher: an ``asyncio.Event`` for one waiter, with a cheap timeout.

    ``asyncio.wait_for(event.wait(), t)`` creates a Task per wait; the
    dispatcher sleeps once per idle gap, hundreds of times a step, so this
    uses one future and one timer handle.  Loop thread only (like Event).
    """

    __slots__ = ("_flag", "_fut")

    def __init__(self) -> None:
        self._flag = False
        self._fut: asyncio.Future[bool] | None = None

    def set(self) -> None:
        self._flag = True
        f = self._fut
        if f is not None and not f.done():
            f.set_result(True)

    def clear(self) -> None:
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    async def wait_for(self, timeout: float) -> bool:
        """Until set (True) or ``timeout`` seconds have passed (False)."""
        if self._flag:
            return True
        loop = asyncio.get_running_loop()
        f = self._fut = loop.create_future()
        timer = loop.call_later(timeout, _expire, f)
        try:
            return await f
        finally:
            timer.cancel()
            self._fut = None


def _expire(f: asyncio.Future[bool]) -> None:
    if not f.done():
        f.set_result(False)


_AUTO_RULES: dict[tuple[Any, ...], str] = {}


#: static shapes, auto: input layouts remembered (their transfer tables; both kinds of step together), the oldest evicted
_KNOWN_LAYOUTS = 16


#: non-tensor values that are keyed by their value (a stable repr, like plain scalars'), not their type alone: a
#: ``dtype=torch.float32`` keyword input, an Enum mode, a slice may decide the stages' output shapes or dtypes
_VALUE_TYPES = (torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum, slice, range, complex, bytes)


def _layout(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), str(v.dtype), v.requires_grad)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, _VALUE_TYPES):
        return (type(v).__qualname__, repr(v))
    if isinstance(v, (list, tuple)):
        return tuple(_layout(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((str(k), _layout(x)) for k, x in v.items()))
    return type(v).__qualname__


#: ``input_signature``'s digests by ``StepInputs.layout_key`` (cleared when it holds this many)
_SIGNATURES: dict[Any, int] = {}
_MAX_SIGNATURES = 256


def input_signature(inputs: StepInputs) -> int:
    """A 63-bit digest of a step's input layout: every tensor's shape, dtype and requires_grad in
    every microbatch's args, kwargs and target, and plain scalars' values (same on every process).

    The layout walk, its repr and the hash cost ~190 us a step (16 microbatches); a batch
    cut by ``split_microbatches`` carries a key of its uncut layout (a few entries), which
    determines the walk's result, so the digest is computed once per key.
    """
    key = inputs.layout_key
    if key is not None:
        sig = _SIGNATURES.get(key)
        if sig is not None:
            return sig
    text = repr((_layout(inputs.args), _layout(inputs.kwargs), _layout(inputs.targets)))
    sig = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
    if key is not None:
        if len(_SIGNATURES) >= _MAX_SIGNATURES:
            _SIGNATURES.clear()
        _SIGNATURES[key] = sig
    return sig


def _describe_sig(sig: Any, mask: int) -> str:
    parts = []
    for j, ent in enumerate(sig):
        if ent is None:
            parts.append("None")
        else:
            parts.append(f"{ent[1]}{list(ent[0])}{' requires_grad' if mask >> j & 1 else ''}")
    return "(" + ", ".join(parts) + ")"


#: ``dispatch="auto"``: the notice delay of a CPU rank (it reads a landed transfer only between its
#: actions), in units of a forward, for ``choose_rule``'s simulation (benchmarks/uneven.py's 0.4 ms
#: against 8-10 ms forwards)
_CPU_NOTICE = 0.05


def _auto_rule(schedule: Schedule, *, static: bool, cuda: bool) -> str:
    """``dispatch="auto"``'s rule for ``schedule`` (simulated once per schedule, transport and process).

    The simulation runs the transport's own send discipline: with static shapes (the
    default) a rank's outputs reach each peer in the list's order and a reordered
    action runs only if its outputs are next in that order (``sends="in_turn"``;
    ``_sends_in_turn``, on gloo and NCCL); with headers each leaves when produced.
    A CPU rank notices a landed transfer only between actions, a GPU rank's host at once.

    GPU ranks keep the list (``list``): their host commits actions to the device ahead of it, in
    list order (``RuntimeOptions.gpu_commit_ms``), so a rule reorders only what is not yet
    committed, which the simulator does not model; and a rule other than ``list`` turns off
    what pays on GPUs only in list order (backwards launched beside forwards).  Measured, no
    simulated gain showed: GPipe at 2 ranks with ``critical`` -5.1..-0.0% (2 x H200, five
    workloads), GPipe at 4 ranks with ``ready`` -3.3..-1.0%, reordering nothing on three of
    four workloads (4 x H100, session R), where two identical list-order pipelines measured
    -4.3..-1.2% apart (the comparison's own bias: ``benchmarks/RESULTS.md``).  A rule named in
    ``RuntimeOptions.dispatch`` still runs as asked.
    """
    if cuda:
        return "list"
    sends = "in_turn" if static else "free"
    notice = 0.0 if cuda else _CPU_NOTICE
    key = (tuple(schedule.stage_to_rank), schedule.num_microbatches, tuple((r, tuple(a)) for r, a in sorted(schedule.actions.items())),
           sends, notice)
    rule = _AUTO_RULES.get(key)
    if rule is None:
        rule = _AUTO_RULES[key] = choose_rule(schedule, sends=sends, notice=notice)
    return rule


class RankActor:
    """Runs one rank's share of every step."""

    def __init__(
        self,
        *,
        rank: int,
        schedule: Schedule,
        stages: dict[int, StageExecutor],
        tensor_plane: TensorPlane,
        control: ControlPlane,
        device: torch.device,
        options: RuntimeOptions | None = None,
        trace: TraceRecorder | None = None,
        pp_rank: int | None = None,
        stage_to_rank: Sequence[int] | None = None,
        collectives: Any = None,
    ) -> None:
        # rank: global (control and tensor planes); pp_rank: this rank's schedule row
        # (differs with data parallelism); stage_to_rank: global ranks of this replica's stages.
        self.rank = rank
        self.options = options = RuntimeOptions() if options is None else options
        self.heartbeat_timeout = options.heartbeat_timeout
        self.stall_timeout = options.stall_timeout
        #: heartbeats, byes and the lost-peer decision (runtime/liveness.py)
        self.liveness = PeerLiveness(
            rank=rank, world_size=control.world_size, heartbeat_timeout=options.heartbeat_timeout, stall_timeout=options.stall_timeout,
        )
        self.schedule = schedule
        self.stages = stages
        #: options.defer_graph_teardown: the graphs of finished backwards (StageExecutor.backward leaves their
        #: nodes here), freed after the next action has launched, while the loop waits, or at the step's end
        self._graves: list[Any] = []
        if options.defer_graph_teardown:
            for ex in stages.values():
                if hasattr(ex, "graves"):
                    ex.graves = self._graves
        self.tensors = tensor_plane
        self.control = control
        self.device = device
        self.deterministic = options.deterministic
        self.stage_to_rank = schedule.stage_to_rank if stage_to_rank is None else tuple(stage_to_rank)
        #: who sends what to whom, in global ranks
        self.flow = Dataflow(self.stage_to_rank)
        row = rank if pp_rank is None else pp_rank
        #: UNSHARD/RESHARD/REDUCE_GRAD handler (data parallelism), or None
        self.collectives = collectives
        if collectives is not None:
            collectives.attach(self)
        self.last_stage = schedule.num_stages - 1
        self.train_actions, self.eval_actions = self._row_actions(row)
        #: the dispatch rule per step kind (train?): schedules/dispatch.py, which argues the guarantees
        rule = "list" if self.deterministic else options.dispatch
        if rule == "auto":
            rule = _auto_rule(schedule, static=options.static_shapes is not False and tensor_plane.header_group is not None,
                              cuda=device.type == "cuda")
        plan = plan_ranks(schedule)[row] if rule in ("guarded", "critical") else None
        self.dispatch_rule = rule
        self._dispatch = {
            True: Dispatcher(self.train_actions, rule=rule, plan=plan),
            False: Dispatcher(self.eval_actions, rule="list" if self.deterministic else "ready", train=False),
        }
        self.memory_limit = self._dispatch[True].memory_limit
        #: per step kind (train?): transfers each peer sends this rank in a step (gloo posts them
        #: at the step's start: transport/tensor.py)
        self._recvs_per_peer = {train: self._count_inputs(acts) for train, acts in ((True, self.train_actions), (False, self.eval_actions))}
        self._sends_per_peer = {train: self.flow.sends_per_peer(rank, acts) for train, acts in ((True, self.train_actions), (False, self.eval_actions))}
        #: NCCL with options.static_shapes: from the second step of a kind on, transfers without
        #: headers, sent and received in list order ("Static shapes" in the module docstring)
        self._static = options.static_shapes is not False and tensor_plane.header_group is not None
        #: static_shapes=None: the ranks agree at each step's start on their inputs' layout
        #: (``agree``: every rank's input signature, from one all-gather; set by the Pipeline)
        self._auto = options.static_shapes is None
        self.agree: Any = None
        #: this step runs without headers / is a training step
        self._spec = False
        self._held_sends = 0  #: static shapes: outputs held for their turn in this step (statistics)
        self._train_now = True
        #: static shapes: the first pending action (the only one committed on remote inputs not yet sent)
        self._head: Action | None = None
        #: static shapes: the peers whose end-of-step header has landed
        self._ends: set[int] = set()
        #: traced: when each peer's end of step landed (the last of the late ones is the wait's cause)
        self._end_at: dict[int, int] = {}
        if self._static:
            self._init_static(row)
        self.step_index = 0
        self._inbox: dict[tuple[int, str, int, int], list[torch.Tensor | None]] = {}
        #: CPU: transfers announced by their sender, not yet arrived
        self._announced: set[tuple[int, str, int, int]] = set()
        self._wake = Wakeup()
        #: how the receiver threads' landings reach the dispatcher (runtime/landing.py), per step
        self._landings: LandingQueue | None = None
        self._remote_error: PipelineError | None = None
        self._local_failure: BaseException | None = None
        self._started = False
        self._fwd_done: set[tuple[int, int]] = set()
        self._i_done: set[tuple[int, int]] = set()
        self.statistics: ActorStatistics | None = None
        self.trace = trace
        # How actions reach the device (runtime/device.py): CPU runs when ready; GPUs commit
        # ahead on committed inputs, one stream per stage (one shared stream with data
        # parallelism, whose collectives are launched on the current stream, unless the
        # collectives launch on their stage's stream: expert parallelism, whose all-to-alls
        # must run on the stages' own streams to overlap).
        self._cuda = device.type == "cuda"
        self._coll_on_stage = bool(getattr(collectives, "on_stage_streams", False))
        self.dev = make_policy(
            device,
            stages,
            stage_streams=((collectives is None or self._coll_on_stage)
                           and stage_streams(options.overlap_streams, self.train_actions, stage_collectives=self._coll_on_stage)),
            horizon_ms=options.gpu_commit_ms,
            early_receives=options.gpu_early_receives,
            launches=options.gpu_commit_launches,
            count_running=options.gpu_commit_running,
            learn_sleep=options.gpu_learn_sleep,
        )
        self._commit_ahead = self.dev.commit_ahead
        #: whether a compute must enter the policy's ``on_stage`` context (CPU: a null context, skipped per action)
        self._stage_context = type(self.dev).on_stage is not DevicePolicy.on_stage
        if trace is not None and self._commit_ahead:
            self.dev.on_timed = self._device_timed
        #: NCCL: headers through gloo, payloads received when their header lands (posted, committed)
        self._headers = tensor_plane.header_group is not None
        if self._headers and not self._commit_ahead and not (options.emulate_nccl_transport or options.static_shapes is not False):
            raise ValueError("a tensor plane with a header group needs the GPU device policy (payloads on NCCL), "
                             "or static shapes (auto or True) on gloo")
        #: gloo with that protocol (static shapes, auto or True): the loop thread waits for its payloads
        #: itself, watched by a thread that keeps the liveness check running (runtime/direct_wait.py)
        self._direct: DirectWait | None = None
        if self._headers and not self._commit_ahead:
            self._direct = DirectWait(name=f"pipeloom-watch-r{rank}", check=self._check_for_loop,
                                      breaker=tensor_plane.break_receives)
        #: gloo, static shapes: per peer, how many of its step's payloads the loop has consumed
        self._rx_used: dict[int, int] = {}
        #: traced, gloo static shapes: posted payloads not yet landed -> (post time, position, bytes)
        self._rx_posted: dict[tuple[int, str, int, int], tuple[int, int, int]] = {}
        #: traced: the running action, and where a direct wait at its start moved its span's start (-1: none)
        self._running: Action | None = None
        self._act_t0 = -1
        #: seconds of this step the loop thread waited in gloo for a peer's payload
        self._waited = 0.0
        #: GPU: receives posted (committed), not yet consumed: buffers, Works, spec
        self._posted: dict[tuple[int, str, int, int], tuple[list[torch.Tensor | None], list[Any], Any]] = {}
        #: GPU: local hand-offs between stage streams: the producer's event
        self._handoff: dict[tuple[int, str, int, int], Any] = {}
        #: GPU, first steps: the timing token of the action being launched (runtime/device.py)
        self._token: Any = None
        #: payloads produced by the action being run (producing stage, step, kind, to stage, mb,
        #: tensors), handed over once its compute is done
        self._outbox: list[tuple[int, int, str, int, int, Sequence[torch.Tensor | None]]] = []
        #: options.profile_ranges: a profiler range per action, by this name
        self._profile_ranges = options.profile_ranges
        self._range_names: dict[Action, str] = {}
        #: options.host_overlap_backward: a full backward launched on a worker thread beside the forwards
        #: after it (not with data/expert-parallel collectives, not traced: see the option)
        mode = options.host_overlap_backward
        # auto leaves out what the worker thread would change: profiler ranges (a profiler records ops on the
        # threads it was started on), and stages that issue collectives of their own (DTensor parameters,
        # SyncBatchNorm: from two threads the ranks of their group could issue them in different orders)
        auto_ok = (self._cuda and not options.profile_ranges
                   and not any(_own_collectives(ex.module) for ex in stages.values()))
        self._bg_ok = (mode is True or (mode is None and auto_ok)) and collectives is None
        #: auto (None): a pair on one stream only where the B's host launch outlasts the B's and the F's device times
        #: by dispatch.OVERLAP_MARGIN (_bg_pays)
        self._bg_auto = mode is None
        #: auto: (B's stage, F's stage) -> overlapped?, decided once the B's times are learned
        self._bg_decided: dict[tuple[int, int], bool] = {}
        #: what each one-stream decision read (B's host launch, B's and F's device times, ms): for tests and logs
        self._bg_inputs: dict[tuple[int, int], tuple[float, float, float]] = {}
        #: auto, options.host_overlap_trial: the pairs the rule keeps inline on a host-heavy rank, tried beside
        #: (schedules.dispatch.OverlapTrial; the periods are taken at each training step's start)
        self._trial = OverlapTrial() if self._bg_auto and self._bg_ok and options.host_overlap_trial else None
        self._bg_try: set[tuple[int, int]] = set()
        self._bg_unlearned = False  #: a pair met in this step was not decided yet (its times not learned)
        self._trial_t0: float | None = None  #: the last training step's start (None: the next period is not comparable)
        #: options.host_overlap_backward: the backwards (stage, microbatch) that may launch beside the forward after
        #: them without making a peer wait on their outputs forever (schedules/dispatch.py)
        #: options.host_queue_backwards: the backwards (stage, microbatch) that may be queued on the worker behind
        #: the backward the list runs just before them (their input from another rank)
        self._bq: frozenset[tuple[int, int]] = frozenset()
        if self._bg_ok and options.host_queue_backwards:
            pairs, queued = queueable_backwards(schedule)
            self._bg_pairs, self._bq = pairs[row], queued[row]
        else:
            self._bg_pairs = overlappable_backwards(schedule)[row] if self._bg_ok else frozenset()
        #: the first training step runs inline and tells whether the stages' forwards draw random numbers
        #: (then never overlapped: see _rng_state)
        self._bg_checked = False
        #: the check step's backwards ran module forwards (recomputation: activation checkpointing)
        self._bg_recomputes = False
        self._probing = False
        self._in_backward = False
        self._probe: Any = None
        #: (stage, CUDA event): while a backward finished on the worker hands its outputs on, their sends wait for
        #: that event rather than the stage's whole stream (device.sending_after)
        self._send_after: tuple[int, Any] | None = None
        self._bg_pool: concurrent.futures.ThreadPoolExecutor | None = None
        #: the backwards launched or queued on the worker and not finished yet (a failed step waits for them)
        self._bg_futs: list[concurrent.futures.Future[Any]] = []
        self._names: dict[Action, str] = {}
        #: the actions of the step in progress not yet run (for debug_state)
        self._pending: list[Action] = []
        _LIVE.add(self)
        #: what the loop is doing now, read by the heartbeat thread:
        #: ("idle" | "busy" | "waiting", action or wait description, since monotonic)
        self.state: tuple[str, str, float] = ("idle", "", time.monotonic())

    def _row_actions(self, row: int) -> tuple[list[Action], list[Action]]:
        """The training and evaluation action lists of schedule row ``row`` as this runtime runs them."""
        # Only compute drives execution; sends and receives are derived from it (they happen
        # when producers finish and receives are posted), and UNSHARD/RESHARD/REDUCE_GRAD are
        # no-ops without data parallelism.
        keep = _DP if self.collectives is not None else ()
        train = [a for a in self.schedule.actions[row] if a.is_compute or a.type in keep]
        ev = [
            leaf for a in train for leaf in a.leaves()
            if leaf.type is _F or (leaf.type in keep and leaf.type is not ActionType.REDUCE_GRAD)
        ]
        return train, ev

    def _sends_in_order(self, actions: Sequence[Action], src: int) -> dict[int, list[tuple[str, int, int]]]:
        """Per peer, the transfers global rank ``src`` sends it when running ``actions`` in list order."""
        out: dict[int, list[tuple[str, int, int]]] = {}
        for a in actions:
            for leaf in a.leaves():
                k = self.flow.output_key(leaf, 0)
                if k is None:
                    continue
                dst = self.stage_to_rank[k.stage]
                if dst != src:
                    out.setdefault(dst, []).append((k.kind, k.stage, k.microbatch))
        return out

    def _init_static(self, row: int) -> None:
        """Static shapes: every peer's send order (its list order), and the tables the first steps fill."""
        rows = {}  # global rank -> schedule row (the same stages)
        for s, g in enumerate(self.stage_to_rank):
            rows[g] = self.schedule.stage_to_rank[s]
        Key = tuple[str, int, int]
        #: per kind (train?), per peer: what this rank sends it, in order
        self._send_order: dict[bool, dict[int, list[Key]]] = {}
        #: per kind, per peer: what it sends this rank, in order, and each one's position
        self._recv_order: dict[bool, dict[int, list[Key]]] = {True: {}, False: {}}
        self._recv_pos: dict[bool, dict[int, dict[Key, int]]] = {True: {}, False: {}}
        mine = {True: self.train_actions, False: self.eval_actions}
        for train in (True, False):
            self._send_order[train] = self._sends_in_order(mine[train], self.rank)
        for g, r in rows.items():
            if g == self.rank:
                continue
            lists = dict(zip((True, False), self._row_actions(r)))
            for train in (True, False):
                seq = self._sends_in_order(lists[train], g).get(self.rank, [])
                if seq:
                    self._recv_order[train][g] = seq
                    self._recv_pos[train][g] = {k: i for i, k in enumerate(seq)}
        #: (kind, consuming stage) whose input comes from another rank
        self._remote_in = {(k[0], k[1]) for by in self._recv_order.values() for seq in by.values() for k in seq}
        #: learned in a step with headers, per (kind, every rank's input signature) (auto) or per
        #: kind: per transfer, (shapes, requires-grad bits) as received and (shapes, requires-grad
        #: mask) as sent; the last _KNOWN_LAYOUTS, oldest first (every rank evicts alike)
        self._known: OrderedDict[tuple[bool, Any], tuple[dict[Key, Any], dict[Key, Any]]] = OrderedDict()
        #: the tables of the step in progress (being learned, or used), and their key
        self._cur_rx: dict[Key, tuple[Any, tuple[bool, ...]]] = {}
        self._cur_tx: dict[Key, tuple[Any, int]] = {}
        self._cur_layout: tuple[bool, Any] = (True, None)
        # per step without headers: next position per peer (sent / received), outputs held
        # until every earlier transfer to their peer is sent
        self._tx_next: dict[int, int] = {}
        self._tx_held: dict[int, dict[Key, tuple[int, Sequence[torch.Tensor | None]]]] = {}
        self._rx_next: dict[int, int] = {}

    def _count_inputs(self, actions: Sequence[Action]) -> dict[int, int]:
        out: dict[int, int] = {}
        for a in actions:
            for leaf in a.leaves():
                key = self.flow.input_key(leaf, 0)
                if key is not None:
                    src = self.flow.recv_rank(key.kind, key.stage, self.rank)
                    if src is not None:
                        out[src] = out.get(src, 0) + 1
        return out

    def debug_state(self) -> str:
        """What this rank is doing and waiting for, for a human looking at a hang (any thread may call it)."""
        kind, what, since = self.state
        lines = [f"rank {self.rank} step {self.step_index - 1}: {kind} {what!r} for {time.monotonic() - since:.1f} s"]
        try:
            pending = list(self._pending)
            if pending:
                lines.append(f"  next actions: {', '.join(str(a) for a in pending[:6])}{' ...' if len(pending) > 6 else ''}")
                for d in self.describe_wait(pending, max(self.step_index - 1, 0), True)[:4]:
                    lines.append(f"  waiting for {d}")
            lines.append(f"  inputs arrived: {sorted(self._inbox)[:8]}")
            if self._posted:
                lines.append(f"  receives posted (committed on the GPU), not consumed: {sorted(self._posted)[:8]}")
            t = self.tensors
            lines.append(f"  transfers sent per peer: {dict(t._send_seq)}, receives posted or announced per peer: {dict(t._recv_seq)}, "
                         f"sends in flight: {len(t._inflight_sends)}")
            peers = ", ".join(f"rank {p} {st[0]}{' ' + st[1] if st[1] else ''}" for p, st in sorted(self.liveness.peer_states().items()))
            lines.append(f"  peers' last reported state: {peers or 'none yet'}")
        except Exception as exc:  # racing with the loop: show what we have
            lines.append(f"  (state changed while reading: {exc!r})")
        return "\n".join(lines)

    # ------------------------------------------------------------ messages
    def start(self) -> None:
        if self._started:
            return
        self._wake = Wakeup()
        self.control.start(self._on_message)
        self._started = True

    def _on_message(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        src = msg["src"]
        self.liveness.seen(src)
        if kind == "heartbeat":
            self.liveness.heartbeat(src, msg["state"], msg["what"], msg["for_s"], stall_s=msg["stall_s"], step=msg["step"],
                                    train=msg["train"])
            return
        if kind == "bye":
            self.liveness.bye(src, msg["steps"], msg["cause"])
            self._wake.set()  # a waiting rank re-checks whether it still needs the peer
            return
        if kind == "xfer":  # protocol 3 and older
            self._fail_remote(PeerLostError(
                f"rank {src} announced a transfer on the control plane, but transfers carry their own header on the "
                "tensor plane since protocol 4: the ranks run different pipeloom versions", rank=self.rank, peer=src))
            return
        if kind == "abort":
            if self.control.bye_cause < 0:
                self.control.bye_cause = src  # (said in this rank's bye: a peer may read that before this abort)
            self._fail_remote(
                RemoteRankError(
                    rank=self.rank,
                    failed_rank=src,
                    step=msg["step"],
                    stage=msg["stage"],
                    microbatch=msg["mb"],
                    action=msg["action"],
                    error=msg["error"],
                    remote_traceback=msg["traceback"],
                )
            )

    def _landed(self, got: Landed | None, err: TransferError | None) -> None:
        """gloo: a transfer has landed (its receiver thread calls this on the loop), or failed."""
        if err is not None or got is None:
            assert err is not None
            # a broken connection: give the control plane a moment to say why (a 'bye', a closed socket)
            lost = self._lost_peer(err.peer, f"receiving transfer {err.seq} from rank {err.peer}", err)
            self._fail_remote(lost if lost is not None else PeerLostError(str(err), rank=self.rank, peer=err.peer))
            return
        if got.kind == END:  # static shapes: the peer sent all of the step's payloads
            self._ends.add(got.src)
            if self.trace is not None:
                self._end_at[got.src] = clock_ns()  # (traced: which late peer ended last, see _run_step)
            self._wake.set()
            return
        key = (got.step, got.kind, got.stage, got.microbatch)
        if got.stage not in self.stages or self.flow.recv_rank(got.kind, got.stage, self.rank) != got.src:
            self._fail_remote(PeerLostError(
                f"rank {got.src} sent {got.kind} of stage {got.stage} microbatch {got.microbatch} (step {got.step}, "
                f"transfer {got.seq}), which this rank does not receive from it: the ranks disagree on the schedule",
                rank=self.rank, peer=got.src))
            return
        self._announced.discard(key)
        if self._headers:
            # NCCL: the header came through gloo; post the payload's receive now, committed (the
            # consumer's stream waits on it), in header order = the order the peer sent
            if self._static:
                self._cur_rx[(got.kind, got.stage, got.microbatch)] = (got.shapes, got.requires_grad)
            with self.dev.posting(got.stage):
                buffers, works = self.tensors.recv_payload(got.src, got.shapes)
            self._posted[key] = (buffers, works, got.requires_grad)
            if self.trace is not None:
                nbytes = sum(b.numel() * b.element_size() for b in buffers if b is not None)
                self.trace.transfer("recv", got.step, got.src, got.stage, got.microbatch, got.kind, got.seq, nbytes,
                                    got.header_ns + _TRACE_OFFSET, clock_ns())
            self._wake.set()
            return
        buffers = got.buffers
        if got.kind == "F":
            for b, rg in zip(buffers, got.requires_grad):
                if b is not None and rg:
                    b.requires_grad_(True)
        self._inbox[key] = buffers
        if self.trace is not None:
            self.trace.transfer("recv", got.step, got.src, got.stage, got.microbatch, got.kind, got.seq, got.nbytes,
                                got.header_ns + _TRACE_OFFSET, got.done_ns + _TRACE_OFFSET)
        self._wake.set()

    def _announce(self, key: tuple[int, str, int, int]) -> None:
        """gloo: an unpredicted transfer's header has arrived; its payload is on the way."""
        if key not in self._inbox:
            self._announced.add(key)
            self._wake.set()

    def error_between_steps(self) -> PipelineError | None:
        """Outside a step (a collective of the training loop's: ``last_loss``, ``clip_grad_norm_``): read the
        control plane now and return the failure a peer reported (its abort), if any.  A rank whose step failed
        after this one had finished its own reports it only there; a collective waiting for that rank would
        otherwise wait out its whole bound and name nobody."""
        try:
            self.control.drain()
        except Exception:  # noqa: BLE001 - a closed control plane: the collective's own error says it
            pass
        return self._remote_error

    def _fail_remote(self, err: PipelineError) -> None:
        if self._remote_error is None:
            self._remote_error = err
        self._wake.set()

    # ------------------------------------------------------------ readiness
    def _have(self, key: tuple[int, str, int, int]) -> bool:
        if key in self._inbox:
            return True
        posted = self._posted.get(key)
        if posted is None:
            return False
        if self._spec and self._direct is not None:
            # gloo, static shapes: a receive posted ahead is there once its Works completed (landed,
            # or failed: the wait at _take raises then); one not landed only the list's head may wait
            # for (see _ready)
            return all(w.is_completed() for w in posted[1])
        return True

    def _take(self, key: tuple[int, str, int, int], stage: int, defer: bool = False) -> Any:
        """An input of ``stage``: arrived, or (GPU) committed, with the stage's stream ordered after it.

        ``defer`` (a backward queued on the worker): returns (the buffers, the posted receive's Works) without
        ordering the stream after them (the worker does); (arrived buffers, []) where nothing is to wait for."""
        got = self._inbox.pop(key, None)
        if got is not None:
            if self._handoff:
                token = self._handoff.pop(key, None)
                if token is not None:
                    self.dev.take_handed(token, stage, got)
            return (got, []) if defer else got
        if self._spec and key not in self._posted:
            self._post_static(key)
        buffers, works, rgs = self._posted.pop(key)
        if self._direct is not None:
            trace = self.trace
            if trace is None:
                self._wait_direct(key, works)
            else:
                # The wait is the rank's, not the action's: traced as a wait (what for, from when to when)
                # and as the transfer's landing; the action's span starts after it if nothing of the
                # action ran before (an OVERLAP_F_B's second half waits inside its span).
                w0 = clock_ns()
                w1 = self._wait_direct(key, works, clock=True)
                src = self.flow.recv_rank(key[1], key[2], self.rank)
                posted = self._rx_posted.pop(key, None)
                if posted is not None:
                    t_post, seq, nbytes = posted
                    trace.transfer("recv", key[0], src, key[2], key[3], key[1], seq, nbytes, t_post, w1, posted=True)
                if w1 - w0 >= _TRACED_WAIT_NS:
                    trace.wait(key[0], w0, w1, [self._waiting_for(self._name(self._running), key, src)])
                if self._act_t0 == -1:
                    self._act_t0 = w1
        elif defer:
            return buffers, works
        else:
            self.dev.consume(stage, buffers, works)
        if key[1] == "F":
            for b, rg in zip(buffers, rgs):
                if b is not None and rg:
                    b.requires_grad_(True)
        return (buffers, []) if defer else buffers

    def _wait_direct(self, key: tuple[int, str, int, int], works: list[Any], *, clock: bool = False) -> int:
        """gloo, NCCL protocol: wait on this thread for the payload of ``key`` (runtime/direct_wait.py).

        The rank reports itself waiting meanwhile (its heartbeats must not make it look
        stalled in an action to the other peers); a peer lost during the wait is named.
        Static shapes: then keeps ``gloo_prepost_depth`` of the peer's next payloads posted.
        ``clock``: return :func:`clock_ns` at the moment the wait returned (the trace's landing
        time and the end of its wait: posting the next receives is the runtime's work, not
        waiting), else 0.
        """
        step, kind, stage, mb = key
        src = self.flow.recv_rank(kind, stage, self.rank)
        assert src is not None and self._direct is not None
        busy = self.state
        t0 = time.perf_counter()
        self.state = ("waiting", busy[1], time.monotonic())
        try:
            self._direct.wait(works, src)
        except PipelineError as err:  # the watchdog broke the wait: the peer is lost, or a rank failed
            if isinstance(err, PeerLostError):
                self._remote_error = err
                self.broadcast_abort(err, None, step)
            raise self._annotate_wait(err, self._pending, step, self._waiting_for(busy[1], key, src)) from None
        except RuntimeError as exc:  # gloo: the connection closed
            what = f"receiving {kind} of stage {stage} microbatch {mb} (step {step}) from rank {src}"
            err = self._lost_peer(src, what, exc) or PeerLostError(f"{what} failed: {exc}", rank=self.rank, peer=src)
            self._remote_error = err
            self.broadcast_abort(err, None, step)
            raise self._annotate_wait(err, self._pending, step, self._waiting_for(busy[1], key, src)) from exc
        finally:
            self.state = busy
            self._waited += time.perf_counter() - t0
        landed = clock_ns() if clock else 0
        if self._spec:
            used = self._rx_used[src] = self._rx_used.get(src, 0) + 1
            self._post_ahead(src, step, used)
        return landed

    @staticmethod
    def _waiting_for(action: str, key: tuple[int, str, int, int], src: int) -> str:
        """What a failed direct wait says this rank was waiting for: the running action's input."""
        _, kind, stage, mb = key
        return f"{action}: {'activation' if kind == 'F' else 'gradient'} for stage {stage} microbatch {mb} from rank {src}"

    def _post_ahead(self, src: int, step: int, used: int) -> None:
        """gloo, static shapes: keep ``gloo_prepost_depth`` of ``src``'s next payloads posted (a gloo
        receive posted before its data is sent lands in about a fifth of the time)."""
        order = self._recv_order[self._train_now].get(src, ())
        last = min(len(order), used + self.options.gloo_prepost_depth) - 1
        if last >= self._rx_next.get(src, 0):
            self._post_static((step, *order[last]))

    def _check_for_loop(self, peer: int) -> BaseException | None:
        """The watchdog, while this rank's loop thread waits in gloo for ``peer``: read the control
        plane and judge the peer's liveness on the loop's behalf (runtime/direct_wait.py)."""
        self.control.drain()
        if self._remote_error is not None:  # a rank failed (its abort came), or a peer was found lost
            return self._remote_error
        lost = self.liveness.check(self.step_index - 1, disconnected=self.control.disconnected,
                                   events_read_at=self.control.monitors_read_at, needed={peer})
        if lost is None:
            stuck = self._other_kind(self.step_index - 1) or self._all_waiting(self.step_index - 1)
            if stuck is not None:
                self._remote_error = stuck
                self.broadcast_abort(stuck, None, self.step_index - 1)
            return stuck
        root = self._abort_behind(lost.peer)
        return root if root is not None else PeerLostError(lost.reason, rank=self.rank, peer=lost.peer)

    def _device_timed(self, meta: tuple[int, str, str, int, int | None, int], ms: float) -> None:
        """Traced GPU runs: an action's device time, once its CUDA events completed (see ``runtime/trace.py``)."""
        if self.trace is not None:
            step, name, type_, stage, mb, t = meta
            self.trace.device(step, name, type_, stage, mb, t, int(ms * 1e6))

    def flush_device_times(self) -> None:
        """Traced GPU runs: the device times of every action launched so far, into the trace (waits for them)."""
        self.dev.flush()

    def close(self) -> None:
        """Stop this actor's threads (the watchdog of direct waits, the backward worker)."""
        if self._direct is not None:
            self._direct.close()
        if self._bg_pool is not None:
            self._bg_pool.shutdown(wait=True)
            self._bg_pool = None

    def _post_static(self, key: tuple[int, str, int, int]) -> None:
        """Static shapes: post the receives of the peer's transfers up to ``key``, in its send order.

        Each on its consumer's stream, shaped as in the first step of this kind; nothing has
        to have been sent yet (the consumer's stream waits for the data on the device).
        """
        step, kind, stage, mb = key
        src = self.flow.recv_rank(kind, stage, self.rank)
        train = self._train_now
        pos = self._recv_pos[train].get(src, {}).get((kind, stage, mb)) if src is not None else None
        first = self._rx_next.get(src, 0) if src is not None else 0
        if pos is None or pos < first:
            raise PipelineError(
                f"rank {self.rank}: static shapes: {kind} of stage {stage} microbatch {mb} (step {step}) is not "
                f"the next transfer expected from rank {src} (internal error: the send orders disagree)"
            )
        order = self._recv_order[train][src]
        sig = self._cur_rx
        for i in range(first, pos + 1):
            k = order[i]
            shapes, rg = sig[k]
            with self.dev.posting(k[1]):
                buffers, works = self.tensors.recv_payload(src, shapes)
            self._posted[(step, *k)] = (buffers, works, rg)
            if self.trace is not None:
                t = clock_ns()
                nbytes = sum(b.numel() * b.element_size() for b in buffers if b is not None)
                if self._direct is not None:  # gloo: traced when it has landed (its direct wait returned)
                    self._rx_posted[(step, *k)] = (t, i, nbytes)
                else:  # NCCL: committed now; it lands on the device
                    self.trace.transfer("recv", step, src, k[1], k[2], k[0], i, nbytes, t, t, posted=True)
        self._rx_next[src] = pos + 1

    def _in_flight(self, a: Action) -> bool:
        """Whether an input ``a`` lacks is announced by its sender (the transfer is under way)."""
        if not self._announced:
            return False
        step = self.step_index - 1
        for leaf in a.leaves():
            key = self.flow.input_key(leaf, step)
            if key is not None and key in self._announced:
                return True
        return False

    def _ready(self, a: Action, step: int, live: int, train: bool, head: bool = False) -> bool:
        """Whether ``a`` can run (CPU) or be committed (GPU) now.

        Static shapes: an input from another rank counts as ready (its receive is posted
        when the consumer is committed, before the sender has even produced it) only for the
        list's first pending action (``head``): committing a later one ahead of it could put
        a wait on a peer in front of work that peer needs (both engines of a pair blocked).
        """
        c = self.collectives
        if c is not None and not c.ready(a):  # DP events; computes of a stage not yet unsharded
            return False
        t = a.type
        if t is _F:
            if train and live >= self.memory_limit:
                return False
            key = self.flow.input_key(a, step)
            return key is None or self._have(key) or (
                (head or a is self._head) and ("F", a.stage) in self._remote_in)
        if t is _B or t is _I:
            if (a.stage, a.microbatch) not in self._fwd_done:
                return False
            key = self.flow.input_key(a, step)
            return key is None or self._have(key) or (
                (head or a is self._head) and ("B", a.stage) in self._remote_in)
        if t is _W:
            return (a.stage, a.microbatch) in self._i_done
        if t is _OVL:
            f, b = a.sub_actions
            h = head or a is self._head
            return self._ready(f, step, live, train, h) and self._ready(b, step, live, train, h)
        return True

    # ------------------------------------------------------------ execution
    def _emit(self, from_stage: int, step: int, kind: str, to_stage: int, mb: int, tensors: Sequence[torch.Tensor | None]) -> None:
        """Hand a payload of stage ``from_stage`` to stage ``to_stage``: locally, or announced and sent."""
        dst = self.stage_to_rank[to_stage]
        if dst == self.rank:
            if kind == "F":
                local = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in tensors]
            else:
                local = list(tensors)
            key = (step, kind, to_stage, mb)
            self._inbox[key] = local
            if self._commit_ahead:
                sa = self._send_after  # (a backward finished on the worker: its own end, not its stream's tail)
                self._handoff[key] = (self.dev.handed(from_stage) if sa is None or sa[0] != from_stage
                                      else (self.dev.stream(from_stage), sa[1]))
            return
        if self._spec:
            self._send_in_order(dst, from_stage, step, (kind, to_stage, mb), tensors)
            return
        if self._static:  # a step with headers: learn what the later steps send without them
            _, sig, mask = signature(tensors, kind, to_stage, mb, sendable=False)
            self._cur_tx[(kind, to_stage, mb)] = (sig, mask)
        self._send_one(dst, from_stage, step, kind, to_stage, mb,
                       lambda: self.tensors.send_transfer(dst, step, kind, to_stage, mb, tensors)[:2])

    def _send_one(self, dst: int, from_stage: int, step: int, kind: str, to_stage: int, mb: int, send: Any) -> None:
        """Run ``send`` (-> sequence number or position, bytes) on the producer's stream; a broken
        connection becomes the peer's loss (broadcast), and the send is traced."""
        t0 = clock_ns() if self.trace is not None else 0
        try:
            sa = self._send_after
            # NCCL orders the payload's send after the producer's stream (a backward finished on the worker: after
            # its own end only, not what was launched on its stream since)
            with self.dev.on_stage(from_stage) if sa is None or sa[0] != from_stage else self.dev.sending_after(*sa):
                seq, nbytes = send()
        except RuntimeError as exc:
            err = self._lost_peer(dst, f"sending {kind} of stage {to_stage} microbatch {mb} (step {step})", exc)
            if err is None:
                raise
            self._remote_error = err
            self.broadcast_abort(err, None, step)
            raise err from exc
        if self.trace is not None:
            self.trace.transfer("send", step, dst, to_stage, mb, kind, seq, nbytes, t0, clock_ns())

    def _ready_in_turn(self, ready: Any, step: int, a: Action) -> bool:
        return ready(a) and self._sends_in_turn(a, step)

    def _sends_in_turn(self, a: Action, step: int) -> bool:
        """Static shapes: whether every output ``a`` sends to another rank is next in that peer's send order
        (so it leaves when produced, not held behind an output of an earlier-listed action)."""
        due: dict[int, list[tuple[str, int, int]]] = {}
        for leaf in a.leaves():
            key = self.flow.output_key(leaf, step)
            if key is None:
                continue
            dst = self.stage_to_rank[key.stage]
            if dst != self.rank:
                due.setdefault(dst, []).append((key.kind, key.stage, key.microbatch))
        orders = self._send_order[self._train_now]
        for dst, keys in due.items():
            i = self._tx_next.get(dst, 0)
            if set(orders.get(dst, ())[i:i + len(keys)]) != set(keys):
                return False
        return True

    def _send_in_order(self, dst: int, from_stage: int, step: int, k: tuple[str, int, int], tensors: Sequence[torch.Tensor | None]) -> None:
        """Static shapes: send ``k`` once every transfer before it in the list order to ``dst`` is sent.

        The peer posts its receives in that order without headers, so an output produced out
        of order waits here (its data stays on the device) for the ones before it.
        """
        held = self._tx_held.setdefault(dst, {})
        held[k] = (from_stage, tensors)
        order = self._send_order[self._train_now].get(dst, ())
        i = self._tx_next.get(dst, 0)
        if i < len(order) and order[i] != k:
            self._held_sends += 1
        while i < len(order) and order[i] in held:
            nk = order[i]
            fs, ts = held.pop(nk)
            self._tx_next[dst] = i = i + 1
            self._send_static(dst, fs, step, i - 1, nk, ts)

    def _send_static(self, dst: int, from_stage: int, step: int, pos: int, k: tuple[str, int, int],
                     tensors: Sequence[torch.Tensor | None]) -> None:
        kind, to_stage, mb = k
        train = self._train_now
        exp, exp_mask = self._cur_tx[k]
        # (no sendable copies here: a copy's kernel must run where the send is posted, on the producer's
        # stream, which ``send`` does inside ``_send_one``; here it would run on whatever stream is current and
        # could read a non-contiguous output before its producer wrote it: GPUs, a stream per stage)
        real, sig, mask = signature(tensors, kind, to_stage, mb, sendable=False)
        if sig != exp or mask != exp_mask:
            with self.dev.on_stage(from_stage):
                self.tensors.send_placeholder(dst, exp)  # the peer's posted receive completes
            what = "activation" if kind == "F" else "gradient"
            raise ValueError(
                f"static shapes (static_shapes={self.options.static_shapes}), but the {what} that stage {from_stage} sends to stage {to_stage} "
                f"(rank {dst}) for microbatch {mb} in step {step} has {_describe_sig(sig, mask)}, while the first "
                f"{'training' if train else 'evaluation'} step{' with the same inputs' if self._auto else ''} had "
                f"{_describe_sig(exp, exp_mask)}; "
                + ("a stage whose outputs change shape while its inputs do not (data-dependent shapes) needs "
                   "RuntimeOptions(static_shapes=False)" if self._auto else
                   "with static_shapes=True every step of a kind must hand over the same shapes: pass static_shapes=None "
                   "(auto) or False when they change")
            )
        self._send_one(dst, from_stage, step, kind, to_stage, mb, lambda: (pos, self.tensors.send(dst, real)))

    def _peer_failure(self, exc: BaseException, a: Action, step: int) -> PipelineError | None:
        """A compute whose collective broke (an MoE all-to-all over gloo): the peer's failure, if that is the cause.

        A collective inside a compute (expert parallelism) fails with "Connection closed"
        when an ep peer stopped on its own error and exited; this rank's loop was inside the
        collective meanwhile, so the peer's abort message is still unread.  Read the control
        plane for a short, bounded while: the peer's abort is raised as the RemoteRankError
        it is, a peer whose control connection closed is named as lost; anything else
        returns None (this rank's own failure).
        """
        if not any(words in str(exc) for words in _CONNECTION_BROKE):
            return None
        deadline = time.monotonic() + _CONFIRM_LOST
        while True:
            try:
                self.control.drain()  # an abort from the peer may be waiting unread
            except Exception:  # noqa: BLE001 - only a better message is at stake
                pass
            if self._remote_error is not None:
                return self._remote_error
            gone = sorted(self.control.disconnected)
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if not gone:
            return None
        err = PeerLostError(f"{a} (step {step}) failed: rank {gone[0]}'s control connection closed: the process exited or "
                            f"was killed ({str(exc).splitlines()[0][:200]})", rank=self.rank, peer=gone[0])
        self._remote_error = err
        self.broadcast_abort(err, a, step)
        return err

    def _lost_peer(self, peer: int, what: str, exc: BaseException) -> PipelineError | None:
        """A transport error on a transfer with ``peer``: a PeerLostError naming it, if it is gone.

        A send to a rank that was just killed fails (gloo: "Connection closed by
        peer") before this rank's heartbeat thread has read the closed control
        connection, so the control plane gets a short, bounded while to confirm
        (a 'bye', or the connection's close).  An error that itself says the
        connection broke names the peer even unconfirmed: it is the link to that
        peer that failed, not this rank's code.  Anything else returns None (a
        local error, e.g. a tensor the backend cannot send).

        A peer that failed says so before it closes (its abort comes before its 'bye' on
        the control plane): that abort, once read, is returned as the RemoteRankError it
        is, whatever broke meanwhile - the root cause, not its consequence.
        """
        deadline = time.monotonic() + _CONFIRM_LOST
        while True:
            try:
                self.control.drain()  # a 'bye' from it may be waiting unread
            except Exception:  # noqa: BLE001 - only a better message is at stake
                pass
            if isinstance(self._remote_error, RemoteRankError):
                return self._remote_error
            left = self.liveness.left(peer)
            gone = peer in self.control.disconnected
            if left is not None or gone or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if left is not None:
            root = self._abort_behind(peer)  # (it closed on another rank's abort, not read here yet)
            if root is not None:
                return root
            why = f"it closed its Pipeline after {left} step(s) while this rank is in step {self.step_index - 1}"
        elif gone:
            why = "its control connection closed: the process exited or was killed"
        elif any(words in str(exc) for words in _CONNECTION_BROKE):
            why = f"the connection to it broke ({str(exc).splitlines()[0][:300]})"
        else:
            return None
        return PeerLostError(f"{what} failed: {why}", rank=self.rank, peer=peer)

    def _run(self, a: Action, step: int, inputs: StepInputs, train: bool, results: dict[int, Any] | None, losses: dict[int, torch.Tensor]) -> None:
        t = a.type
        if t is _OVL:
            # the halves are two stages: on GPUs two streams, so their kernels may overlap
            for leaf in a.sub_actions:
                self._run(leaf, step, inputs, train, results, losses)
            return
        if t is _UNSHARD or t is _RESHARD or t is _REDUCE_GRAD:  # (_DP; an identity test is cheaper than a set's hash)
            if self._coll_on_stage:
                with self.dev.on_stage(a.stage):  # ordered after the stage's backward on its stream
                    self.collectives.run(a, step)
            else:
                self.collectives.run(a, step)
            return
        if self._stage_context:
            with self.dev.on_stage(a.stage):
                self._compute(a, step, inputs, train, results, losses)
        else:  # (the policy's on_stage is a null context: CPU)
            self._compute(a, step, inputs, train, results, losses)

    def _recompute_probe(self, module: torch.nn.Module, args: Any) -> None:
        """A process-wide forward pre-hook in host_overlap_backward's check step (any thread: on GPUs the
        autograd engine's device thread runs a checkpoint's recomputation)."""
        if self._in_backward:
            self._bg_recomputes = True

    def _after_draws(self, step: int, n_bg: int) -> None:
        """host_overlap_backward: this training step's forwards drew random numbers (the generators moved)."""
        self._bg_ok = False
        if not n_bg:  # (the check step, or no pair overlapped): inline from now on
            log.info("rank %d: the stages draw random numbers in their forwards: host_overlap_backward stays off "
                     "(an activation checkpoint's recomputation restores the generator's state around it; a "
                     "forward drawing from it meanwhile would change the recomputed masks)", self.rank)
            return
        if not self._bg_recomputes:
            # the check step's backwards ran no module forward (no activation checkpoint): drawing beside
            # them took the list's masks; inline from now on all the same (a recomputation of a plain
            # function is not seen by the check)
            log.warning("rank %d step %d: the stages' forwards started drawing random numbers (none in the first "
                        "training step); host_overlap_backward is off from the next step (the backwards recompute "
                        "nothing, so this step's masks are the inline run's)", self.rank, step)
            return
        err = PipelineError(
            f"rank {self.rank} step {step}: host_overlap_backward: the stages' forwards drew random numbers in "
            f"this step (none in the training steps before it) while {n_bg} backward(s) ran beside them, and the "
            "backwards recompute (activation checkpointing); a recomputation restores the generator's state around "
            "itself, so its masks may differ from the forward's: this step's gradients are not trusted. Turn "
            "host_overlap_backward off (RuntimeOptions(host_overlap_backward=False); auto, the default, "
            "overlaps on GPUs) for a model whose forwards draw random numbers (dropout)")
        self.broadcast_abort(err, None, step)
        raise err

    def _rng_state(self) -> torch.Tensor:
        """The default generators' state: the CPU's, and this rank's GPU's (host_overlap_backward's check)."""
        cpu = torch.get_rng_state()
        return torch.cat([cpu, torch.cuda.get_rng_state(self.device)]) if self._cuda else cpu

    def relearn(self) -> None:
        """Between steps: the stages' launches changed (CUDA graphs captured): learn their times again, and decide
        again where backwards launch (host_overlap_backward auto) once they are learned."""
        self.dev.relearn()
        self._bg_decided.clear()
        self._bg_inputs.clear()
        self._bg_try.clear()
        if self._trial is not None:
            self._trial.reset()

    def _bg_pays(self, b_stage: int, f_stage: int) -> bool:
        """host_overlap_backward auto: whether B of ``b_stage`` is launched beside the F of ``f_stage`` after
        it (``device.backward_overlap_pays``), decided once per pair when its times are learned."""
        key = (b_stage, f_stage)
        got = self._bg_decided.get(key)
        if got is not None:
            # (the rule's "no" for a host-heavy pair: beside while its trial says so, see OverlapTrial)
            return got or (self._trial is not None and self._trial.on and key in self._bg_try)
        one = self.dev.shares_stream(b_stage, f_stage)
        host_ms, b_ms = self.dev.learned((_B, b_stage)) if one else (None, None)
        host_f, f_ms = self.dev.learned((_F, f_stage)) if one else (None, None)
        got = backward_overlap_pays(one, host_ms, b_ms, f_ms)
        if got is None:
            self._bg_unlearned = True
            return False  # not learned yet: inline, decided later
        if one:
            self._bg_inputs[key] = (host_ms, b_ms, f_ms)  # type: ignore[assignment]
            tried = not got and self._trial is not None and host_heavy(host_ms, host_f, b_ms, f_ms)
            if tried:
                self._bg_try.add(key)
            log.info("rank %d: host_overlap_backward auto: B of stage %d (host launch %.2f ms, device %.2f ms) %s "
                     "beside the F of stage %d (host launch %.2f ms, device %.2f ms) on one stream%s", self.rank, b_stage,
                     host_ms, b_ms, "launched" if got else "not launched", f_stage, host_f or 0.0, f_ms,
                     " (host-heavy: to be tried beside)" if tried else "")
        self._bg_decided[key] = got
        return got

    def _trial_step(self, train: bool) -> None:
        """At a step's start (options.host_overlap_trial): the previous training step's period to the trial, and
        its blocks begun once every pair met is decided and some are to be tried."""
        trial = self._trial
        if trial is None:
            return
        if not train:
            self._trial_t0 = None  # (an evaluation step in between: the next period is not comparable)
            return
        decided, self._bg_unlearned = not self._bg_unlearned, False  # (every pair the last step met was decided)
        now = time.perf_counter()
        t0, self._trial_t0 = self._trial_t0, now
        if t0 is None:
            return
        was = trial.phase
        trial.record(now - t0)
        if was == "wait" and decided and self._bg_try:
            trial.start()
            log.info("rank %d: host_overlap_backward auto: trying the host-heavy pairs %s beside (blocks of %d steps)",
                     self.rank, sorted(self._bg_try), trial.steps)
        elif was == "run" and trial.phase == "done":
            log.info("rank %d: host_overlap_backward auto: the pairs %s %s beside (%s)", self.rank, sorted(self._bg_try),
                     "stay" if trial.kept else "do not stay", trial.state())

    def _launch_bg(self, a: Action, step: int, tkey: Any, token: Any, h0: float, a0: int, queued: bool = False) -> _Beside:
        """options.host_overlap_backward: take B's input here, launch its backward on the worker thread.

        ``queued`` (host_queue_backwards): behind another backward on the worker; the wait for its posted
        input is left to the worker, after that one's launch, so that on one stream it does not land among
        the other's kernels (and hold them until this input comes)."""
        mb = a.microbatch
        assert mb is not None
        works: list[Any] = []
        buffers: Any = None
        with self.dev.on_stage(a.stage) if self._stage_context else contextlib.nullcontext():
            if a.stage == self.last_stage:
                grads = None
            elif queued:
                grads, works = self._take((step, "B", a.stage, mb), a.stage, defer=True)
                buffers = grads
            else:
                grads = self._take((step, "B", a.stage, mb), a.stage)
            if token is not None and not queued:  # (queued: the worker records the start, after the one before)
                self.dev.inputs_ready(token, a.stage)
            stream = self.dev.stream(a.stage) if self._cuda else None
        if self._act_t0 > a0:  # (traced: a direct wait for its input moves its span's start, as inline)
            a0 = self._act_t0
        if self._bg_pool is None:
            self._bg_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"pipeloom-backward-r{self.rank}")
        # the caller's autocast (thread-local) as the inline backward would see it: a custom Function's backward
        # or a recomputation runs under it
        dt = self.device.type
        cast = torch.get_autocast_dtype(dt) if torch.is_autocast_enabled(dt) else None
        fut = self._bg_pool.submit(self._bg_backward, self.stages[a.stage], mb, grads, stream, cast, works, buffers,
                                   token if queued else None, a.stage, token)
        self._bg_futs.append(fut)
        return _Beside(a, fut, tkey, token, h0, a0, time.perf_counter())

    def _bg_backward(self, stage: StageExecutor, mb: int, grads: Any, stream: Any, cast: torch.dtype | None,
                     works: list[Any], buffers: Any, start: Any, stage_id: int, token: Any) -> tuple[list[torch.Tensor | None], Any, int, float]:
        """On the worker: the backward's launch; its input gradients, the end of its kernels on the stream (a
        CUDA event recorded here, before any forward launched meanwhile on one stream counts as its own) and
        the host clock when it returned (its trace span's end).  ``start``: the token whose start (and learning
        sleep) is recorded here, after the input's wait (a queued backward: on the loop it could land among the
        kernels of the backward before it, still launching on one stream); None where the loop recorded it."""
        t0 = time.perf_counter()
        if stream is not None:  # the current device and stream are the thread's own: the stage's, as on the loop
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(stream)
        if works:  # (queued: its input's wait, here after the backward before it on the stream)
            for w in works:
                w.wait()
            if stream is not None and getattr(self.dev, "early_receives", False):
                for b in buffers:
                    if b is not None:
                        b.record_stream(stream)
        if start is not None:
            self.dev.inputs_ready(start, stage_id, stream)
        if cast is None:
            grads_in = stage.backward(mb, grads)
        else:
            with torch.autocast(self.device.type, dtype=cast):
                grads_in = stage.backward(mb, grads)
        end = self.dev.record_end(stage_id, token, stream) if stream is not None else None
        return grads_in, end, clock_ns(), time.perf_counter() - t0

    def _finish_bg(self, bg: _Beside, step: int) -> None:
        """The backward launched by :meth:`_launch_bg` is done on the host: hand its input gradients on."""
        a, fut, tkey, token, h0, a0, _ = bg
        try:
            in_grads, end, t_end, launch_s = fut.result()
        except PipelineError:
            raise
        except Exception as exc:
            raise self._abort(exc, a, step) from exc
        self._bg_futs.remove(fut)  # (not before: an interrupt in the wait leaves it to run_step's failure path)
        if self.trace is not None:  # its span from its launch on the loop to the worker's return, beside the forwards'
            self.trace.action(step, self._name(a), a.type.value, a.stage, a.microbatch, a0, t_end, None, beside=True)
        if a.stage > 0:
            self._outbox.append((a.stage, step, "B", consumer_stage("B", a.stage), a.microbatch, in_grads))
        if tkey is not None:
            self.dev.launched(tkey, [a.stage], token, end=end)
        s0 = time.perf_counter()
        if self._outbox:
            self._send_after = (a.stage, end) if end is not None else None
            try:
                self._send_outbox(a, step)
            finally:
                self._send_after = None
        if tkey is not None:
            # its launch on the worker and its sends, not the forwards the loop launched meanwhile (the auto rule
            # and the commit horizon read these)
            self.dev.host_time(tkey, (bg.submitted - h0) + launch_s + (time.perf_counter() - s0))

    def _send_outbox(self, a: Action, step: int) -> None:
        """Hand on the payloads ``a`` produced (after its compute: its trace span ends before the sends)."""
        outbox, self._outbox = self._outbox, []
        try:
            with (torch.profiler.record_function("PP:send") if self._profile_ranges else contextlib.nullcontext()):
                for item in outbox:
                    self._emit(*item)
        except PipelineError:
            raise
        except Exception as exc:
            raise self._abort(exc, a, step) from exc

    def _name(self, a: Action) -> str:
        """``str(a)``, once per action (the state the heartbeats report is set twice per action)."""
        name = self._names.get(a)
        if name is None:
            name = self._names[a] = str(a)
        return name

    def _range_name(self, a: Action) -> str:
        name = self._range_names.get(a)
        if name is None:
            name = self._range_names[a] = f"PP:{a}"
        return name

    def _compute(self, a: Action, step: int, inputs: StepInputs, train: bool, results: dict[int, Any] | None, losses: dict[int, torch.Tensor]) -> None:
        t = a.type
        stage = self.stages[a.stage]
        mb = a.microbatch
        assert mb is not None
        if t is _F:
            if a.stage == 0:
                args = inputs.args[mb]
            else:
                args = tuple(self._take((step, "F", a.stage, mb), a.stage))
            if self._token is not None:
                self.dev.inputs_ready(self._token, a.stage)
            target = inputs.targets[mb] if (inputs.targets is not None and a.stage == self.last_stage) else None
            outputs, raw, loss = stage.forward(mb, args, inputs.kwargs[mb], target, train=train)
            if a.stage == self.last_stage:
                if results is not None:
                    if stage.graphs is not None and stage.graphs.slots:  # (a replay's output is its slot's buffer)
                        raw = _copy_out(raw)
                    results[mb] = raw.detach() if isinstance(raw, torch.Tensor) else raw
                if loss is not None:
                    # (a replayed output's loss may be a view of its slot's buffer: loss_fn returning the output)
                    losses[mb] = loss.detach().clone() if stage.graphs is not None and stage.graphs.slots else loss.detach()
            else:
                self._outbox.append((a.stage, step, "F", consumer_stage("F", a.stage), mb, outputs))
            if train:
                self._fwd_done.add((a.stage, mb))
            return
        if t is _B or t is _I:
            grads = None if a.stage == self.last_stage else self._take((step, "B", a.stage, mb), a.stage)
            if self._token is not None:
                self.dev.inputs_ready(self._token, a.stage)
            if t is _B:
                if self._probing:  # (host_overlap_backward's check step: does a backward run module forwards?)
                    self._in_backward = True
                    try:
                        in_grads = stage.backward(mb, grads)
                    finally:
                        self._in_backward = False
                else:
                    in_grads = stage.backward(mb, grads)
            else:
                in_grads = stage.backward_input(mb, grads)
                self._i_done.add((a.stage, mb))
            if a.stage > 0:
                self._outbox.append((a.stage, step, "B", consumer_stage("B", a.stage), mb, in_grads))
            return
        if t is _W:
            if self._token is not None:
                self.dev.inputs_ready(self._token, a.stage)
            stage.backward_weight(mb)
            return
        raise AssertionError(f"unexpected action {a}")

    async def run_step(self, inputs: StepInputs, *, train: bool = True,
                       keep_outputs: bool = True) -> tuple[dict[int, Any], dict[int, torch.Tensor]]:
        """Run this rank's actions for one step; return (outputs, losses) by microbatch
        (the outputs empty with ``keep_outputs=False``: none is held past its loss).

        If the step fails here (for whatever reason, a peer's included), what the
        peers still expect from this rank in the step is filled with abort
        headers (``TensorPlane.abort_step``), so no receive of theirs stays
        pending in gloo.
        """
        try:
            return await self._run_step(inputs, train, keep_outputs)
        except BaseException:
            self._trial_t0 = None  # (a failed step's period says nothing of the launches)
            futs, self._bg_futs = self._bg_futs, []
            for fut in futs:  # backwards still launching on the worker: let them end before the step is torn down
                try:
                    fut.result()
                except BaseException:  # noqa: BLE001 - the step's own failure is what is raised
                    pass
            self._graves.clear()
            if self._probe is not None:  # (host_overlap_backward's check step failed: its process-wide hook goes)
                self._probe.remove()
                self._probe, self._probing = None, False
            if self._landings is not None:
                self._landings.release()  # later landings (a peer's failure) still reach the loop
            self.dev.abandon_step()
            if self._direct is not None and self._posted:
                # gloo, static shapes: receives this loop posted ahead that the failed step will never
                # consume; nobody fills them (the peers' abort_step fills what headers announce), so the
                # exit guard must end the process itself rather than let finalization destroy them
                guard_exit_works([w for _, works, _ in self._posted.values() for w in works])
                self._posted.clear()
            try:
                self.tensors.abort_step()
            except Exception:  # noqa: BLE001 - the failure being raised is what matters
                log.exception("rank %d: filling the peers' receives after a failed step failed", self.rank)
            raise

    async def _run_step(self, inputs: StepInputs, train: bool, keep_outputs: bool = True) -> tuple[dict[int, Any], dict[int, torch.Tensor]]:
        self.start()
        step = self.step_index
        self.step_index += 1
        if self._remote_error is not None:
            raise self._remote_error
        self._trial_step(train)
        self.control.position = (step, train)
        self.liveness.start_step()
        self._liveness_interval = self.liveness.check_interval
        pending = self._pending = list(self.train_actions if train else self.eval_actions)
        self._train_now = train
        spec = False
        if self._static:
            # (traced: the agreement's wait is a wait before the step's span; the span begins after it, where every
            # rank has ended its previous step, so step windows on the trace stay apart)
            layout = (train, await self._agree_layout(inputs, step, train) if self._auto else None)
            tables = self._known.get(layout)
            spec = tables is not None
            if spec:
                self._known.move_to_end(layout)
                self._cur_rx, self._cur_tx = tables
            else:
                self._cur_rx, self._cur_tx = {}, {}
            self._cur_layout = layout
        elif self.agree is not None:
            # static_shapes=False: no layouts to learn, but the ranks' calls are checked as with auto
            await self._agree_layout(inputs, step, train)
        self._spec = spec
        self._head = None
        # their landings queue up for the dispatcher (runtime/landing.py)
        landings = self._landings = LandingQueue(asyncio.get_running_loop())
        if spec:
            # static shapes, a step after the first of its kind: no headers (transfers in list
            # order) but one per peer at the end, which says that all of them were sent
            self._tx_next, self._tx_held, self._rx_next = {}, {}, {}
            self._held_sends = 0
            self._ends = set()
            self.tensors.begin_step(step, train, dict.fromkeys(self._recv_order[train], 1),
                                    dict.fromkeys(self._send_order[train], 1), self._landed, loop=landings)
            if self._direct is not None:
                # gloo: post each peer's first payloads now, before it sends them
                self._rx_used, self._rx_posted = {}, {}
                for src in self._recv_order[train]:
                    self._post_ahead(src, step, 0)
        else:
            # post this step's receives (gloo) or headers (NCCL): each peer's count is known from the schedule
            self.tensors.begin_step(step, train, self._recvs_per_peer[train], self._sends_per_peer[train], self._landed,
                                    self._announce if self._dispatch[train].rule == "guarded" else None, loop=landings)
        # CPU on gloo, no collectives (whose completions come through the loop): wait for a
        # landing on the dispatcher's thread first, for a bounded slice
        park = self.options.gloo_park_ms * 1e-3 if not self._commit_ahead and self.collectives is None else 0.0
        coll = self.collectives
        if coll is not None:
            coll.begin_step(self.train_actions if train else self.eval_actions)
        self._fwd_done = set()
        self._waited = 0.0
        self._i_done = set()
        # (not cleared: a faster peer's transfers of the next step may be posted already)
        dev = self.dev
        commit_ahead = self._commit_ahead
        dev.begin_step()
        results: dict[int, Any] | None = {} if keep_outputs else None
        losses: dict[int, torch.Tensor] = {}
        live = 0
        peak = 0
        ran = out_of_order = waits = 0
        idle = 0.0
        wake = self._wake
        dispatcher = self._dispatch[train]
        dispatcher.begin_step()
        # (gloo, static shapes: see the pick below)
        direct_order = spec and self._direct is not None and dispatcher.rule != "list"
        # NCCL, static shapes, a rule that reorders: only actions whose outputs to other ranks are
        # next in their send order (else the output is held for its turn and the peer, which posts
        # its receives in that order, waits for it: simulated, holding makes GPipe's and LoopedBFS's
        # reordering rules 18-55% slower than the list; schedules/policy_sim.py sends="held")
        in_turn_only = spec and self._direct is None and dispatcher.rule != "list"
        in_flight = self._in_flight if dispatcher.rule == "guarded" else None
        trace = self.trace
        step_start = clock_ns() if trace is not None else 0
        last_liveness = time.monotonic()
        landings.inline()  # back to the loop after the step, or in run_step after a failure
        lazy_yield = coll is None
        last_yield = time.perf_counter()
        ready_base, ready_live = None, -1
        # options.host_overlap_backward, with the list's order: the backward in flight on the worker
        # thread (action, future, timing key, token, launch start) while the forwards after it launch here
        bg_ok = self._bg_ok and self._bg_checked and dispatcher.rule == "list"
        # every training step: did the forwards draw random numbers? (see host_overlap_backward)
        rng0 = self._rng_state() if self._bg_ok and train else None
        if rng0 is not None and not self._bg_checked:
            # the check step (inline): a module forward while a backward runs is a recomputation (activation
            # checkpointing), which restores the generators' state around itself (see _after_draws)
            self._probe = torch.nn.modules.module.register_module_forward_pre_hook(self._recompute_probe)
            self._probing = True
        bgq: deque[_Beside] = deque()  # in flight on the worker, in list order (host_queue_backwards: up to 2)
        bq = self._bq
        last: Action | None = None  # the action dispatched last (a queued backward follows the in-flight one directly)
        n_bg = n_q = 0
        graves = self._graves
        while pending or bgq:
            if bgq and (not pending or bgq[0].future.done()):
                self._finish_bg(bgq.popleft(), step)
                continue
            if landings:
                landings.drain()
            if self._remote_error is not None:
                raise self._annotate_wait(self._remote_error, pending, step)
            # GPU: commit only while the device time queued is under the horizon, so what is
            # not committed yet can still be reordered around a late peer.
            hold = dev.wait_ms() if commit_ahead else 0.0
            # The rule (schedules/dispatch.py) picks among ready actions; forwards stay in list
            # order under the live-microbatch cap, so no rule holds more than the list would.
            if spec:
                self._head = pending[0]
            pick = -1
            if not hold:
                if live != ready_live:  # (one partial per value of ``live``, not per turn)
                    ready_base, ready_live = functools.partial(self._ready, step=step, live=live, train=train), live
                ready = ready_base
                if bgq:  # only the forwards after a backward in flight run beside it (and, queued, the next backward)
                    ready = functools.partial(_beside_only, ready, bq if (len(bgq) < 2 and last is bgq[-1].action) else ())
                if direct_order:
                    # gloo, static shapes, a rule that reorders: an action whose inputs are here (local,
                    # or posted ahead and landed) goes first, if its outputs can leave at once (sends to
                    # a peer go in the list's order: an output produced ahead of its turn is held, and a
                    # peer waits for it longer than the reordering gains); the head waits in gloo for a
                    # payload that has not landed only when nothing else is ready
                    # (the head's outputs are always in turn: everything listed before it has run)
                    ready = functools.partial(self._ready_in_turn, ready, step)
                    self._head = None
                    pick = dispatcher.pick(pending, ready, live, in_flight)
                    self._head = pending[0]
                elif in_turn_only:
                    ready = functools.partial(self._ready_in_turn, ready, step)
                if pick < 0:
                    pick = dispatcher.pick(pending, ready, live, in_flight)
            if pick < 0 and bgq:
                self._finish_bg(bgq.popleft(), step)  # (its host launch: the next action waits for it, or for it to send)
                continue
            if pick < 0 and graves:
                graves.clear()  # (nothing to run: the finished backwards' graphs are freed now, then look again)
                continue
            if pick < 0:
                if not hold:
                    waits += 1
                wake.clear()
                t0 = time.perf_counter()
                self._wait_state(self._name(pending[0]))
                w0 = clock_ns() if trace is not None else 0
                waiting_for = self.describe_wait(pending, step, train) if trace is not None else None
                # Held by the commit horizon: re-check when about that much device time has run.
                timeout = max(hold * 1e-3, 2e-4) if hold else self._liveness_interval
                # (options.profile_ranges: the wait is a range too, "PP:hold ..." when the horizon holds)
                with (torch.profiler.record_function(f"PP:{'hold' if hold else 'wait'} {self._name(pending[0])}")
                      if self._profile_ranges else contextlib.nullcontext()):
                    if park and landings.park(park):
                        pass  # a transfer landed while this thread waited for it (drained at the top)
                    elif landings.to_loop():
                        try:
                            woken = await wake.wait_for(timeout)
                        finally:
                            landings.inline()
                        if not woken:
                            now = time.monotonic()
                            if now - last_liveness >= self._liveness_interval:
                                last_liveness = now
                                self._check_liveness(pending, step)
                if trace is not None:
                    trace.wait(step, w0, clock_ns(), waiting_for)  # type: ignore[arg-type]
                idle += time.perf_counter() - t0
                continue
            a = pending.pop(pick)
            if pick:
                out_of_order += 1
            self.state = ("busy", self._name(a), time.monotonic())
            self._running = a
            a0 = clock_ns() if trace is not None else 0
            self._act_t0 = -1  # (traced: where a direct wait at the action's start moves its span's start)
            leaves = a.leaves()
            if commit_ahead:
                tkey = (a.type, leaves[0].stage)
                h0 = time.perf_counter()
                # (traced: the action's device time comes back through _device_timed)
                token = self._token = dev.start(tkey, None if trace is None else (
                    step, self._name(a), a.type.value, leaves[0].stage, leaves[0].microbatch, a0))
            else:
                token = self._token = None
            last = a
            n_graves = len(graves)  # (freed once this action has launched and sent)
            queued = bool(bgq)  # (the ready filter let only a queueable backward through beside one in flight)
            launch_bg = bg_ok and a.type is _B and (queued or (bool(pending) and (
                (pending[0].type is _F and (a.stage, a.microbatch) in self._bg_pairs
                 and (not self._bg_auto or self._bg_pays(a.stage, pending[0].stage)))
                or (pending[0].type is _B and (pending[0].stage, pending[0].microbatch) in bq))))
            try:
                if launch_bg:
                    bgq.append(self._launch_bg(a, step, tkey if commit_ahead else None, token,
                                               h0 if commit_ahead else 0.0, a0, queued=queued))
                elif self._profile_ranges:  # (options.profile_ranges: a profiler range per action)
                    with torch.profiler.record_function(self._range_name(a)):
                        self._run(a, step, inputs, train, results, losses)
                else:
                    self._run(a, step, inputs, train, results, losses)
                if coll is not None:
                    coll.done(a)
            except PipelineError:
                raise
            except Exception as exc:
                lost = self._peer_failure(exc, a, step)
                if lost is not None:
                    raise lost from exc
                raise self._abort(exc, a, step) from exc
            if launch_bg:  # launched, sent and timed when the worker is done (_finish_bg)
                n_bg += 1
                n_q += queued
                ran += 1
                live -= 1  # (its activations are being released: the next forward may take its place)
                if len(graves) > 2:  # (backwards in a row on the worker: the graphs waiting to be freed cut to two)
                    del graves[:-2]
                continue
            if commit_ahead:
                dev.launched(tkey, [x.stage for x in leaves], token)
            if trace is not None:
                leaf = leaves[0]
                if self._act_t0 > a0:
                    a0 = self._act_t0
                trace.action(step, str(a), a.type.value, leaf.stage, leaf.microbatch, a0, clock_ns(),
                             [str(x) for x in a.sub_actions] if a.sub_actions else None)
            if self._outbox:  # the outputs, handed on after the compute
                self._send_outbox(a, step)
            if commit_ahead:
                dev.host_time(tkey, time.perf_counter() - h0)
            if n_graves:
                del graves[:n_graves]
            ran += 1
            if train:
                for leaf in leaves:
                    if leaf.type is _F:
                        live += 1
                    elif leaf.type is _B or leaf.type is _W:
                        live -= 1
                peak = max(peak, live)
            # Let the loop deliver arrivals (control messages, completions) that came in while this
            # action ran, before choosing the next.  Landed transfers need no loop turn (the
            # landing queue is drained above), so without collectives (whose completions come
            # through the loop) the loop gets a turn at least every ``_YIELD_EVERY`` seconds and
            # whenever the dispatcher waits: on a host-bound GPU job a turn per action is host
            # time the device waits for.
            if lazy_yield:
                now = time.perf_counter()
                if now - last_yield < _YIELD_EVERY:
                    continue
                last_yield = now
            await asyncio.sleep(0)
        landings.release()
        graves.clear()
        if spec:
            if any(self._tx_held.values()):
                left = {d: sorted(h) for d, h in self._tx_held.items() if h}
                raise PipelineError(f"rank {self.rank} step {step}: static shapes: transfers never sent (internal error): {left}")
            for peer in self._send_order[train]:
                self.tensors.send_end(peer, step)
            late = [p for p in self._recv_order[train] if p not in self._ends]
            d0 = clock_ns() if trace is not None and late else 0
            await self._await_ends(step, train)
            if d0:  # (traced: the wait for a peer still running its part of the step is a wait, not runtime)
                # the peer whose end landed last named first: the one the wait was for (trace_analysis reads it)
                late.sort(key=lambda p: -self._end_at.get(p, 0))
                trace.wait(step, d0, clock_ns(), [f"peers' end of step: from rank {p}" for p in late])
        if coll is not None and coll.outstanding:
            # Reductions still in flight: wait for them without blocking the loop.
            self.state = ("waiting", "data-parallel collectives", time.monotonic())
            d0 = clock_ns() if trace is not None else 0
            await coll.drain(lambda: self._collectives_check(step), self._liveness_interval)
            if trace is not None:
                trace.wait(step, d0, clock_ns(), ["data-parallel collectives to complete"])
        if self.tensors.pending_sends:
            self.state = ("waiting", "sends to complete", time.monotonic())
            d0 = clock_ns() if trace is not None else 0
            try:
                if self._cuda or self.tensors.sends_landed() or (
                        spec and self._direct is not None and self._ends.issuperset(self._send_order[train])):
                    # NCCL: orders the caller's stream, never blocks the host; gloo: every send has
                    # landed at its peer (the peers' headers said so; static shapes: every peer sent
                    # to has ended its step, so it consumed them all, and posted its end header's
                    # receive at its step's start): completes at once
                    self.tensors.drain_sends()
                else:
                    await self._drain_sends(landings, park, step)
            except SendError as exc:
                err = self._lost_peer(exc.peer, f"completing the sends to rank {exc.peer} (step {step})", exc)
                if err is None:
                    raise
                self._remote_error = err
                self.broadcast_abort(err, None, step)
                raise err from exc
            if trace is not None:
                trace.wait(step, d0, clock_ns(), ["sends to complete"])
        dev.end_step()
        if rng0 is not None:
            if self._probe is not None:
                self._probe.remove()
                self._probe, self._probing = None, False
            self._bg_checked = True
            if not torch.equal(rng0, self._rng_state()):
                self._after_draws(step, n_bg)
        if self._static and not spec:
            self._learn_done(train)
        self.state = ("idle", "", time.monotonic())
        if trace is not None:
            if self.device.type == "cuda":
                trace.memory(step, peak, torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device))
            else:
                trace.memory(step, peak)
            trace.step(step, step_start, clock_ns(), train=train)
        self.statistics = ActorStatistics(ran, out_of_order, waits, idle + self._waited, peak,
                                          sum(self._tx_next.values()) if spec else 0, self._held_sends, n_bg, n_q)
        self.control.steps_done = self.step_index
        return (results if results is not None else {}), losses

    async def _await_ends(self, step: int, train: bool) -> None:
        """Static shapes: wait until every peer that sends to this rank said its sends are done.

        A peer whose transfer could not be sent as predicted fails its step instead (its
        abort reaches this rank): without this wait this rank could finish the step on
        the placeholder it received.
        """
        want = self._recv_order[train].keys()
        await self._wait_until(lambda: self._ends.issuperset(want), step, "peers' end of step")

    async def _wait_until(self, done: Any, step: int, what: str) -> None:
        """Sleep on the wake-up until ``done()``: a peer's failure raises, a lost peer is named
        (liveness checked every interval).  ``done`` must turn true only when ``_wake`` is set."""
        if done():
            return
        self._wait_state(what)
        last = time.monotonic()
        while not done():
            if self._remote_error is not None:
                raise self._remote_error
            self._wake.clear()
            if not await self._wake.wait_for(self._liveness_interval) and time.monotonic() - last >= self._liveness_interval:
                last = time.monotonic()
                # (named by what is awaited here: with nothing pending, describe_wait would guess
                # "data-parallel collectives", which a job without them never waits for)
                self._check_liveness([], step, waiting=what)

    def _learn_done(self, train: bool) -> None:
        """Static shapes: a step with headers completed; later steps of its layout go without them."""
        missing = [(p, k) for p, seq in self._recv_order[train].items() for k in seq if k not in self._cur_rx]
        missing += [(p, k) for p, seq in self._send_order[train].items() for k in seq if k not in self._cur_tx]
        if missing:  # every rank ran the whole step: each transfer was sent and received
            raise PipelineError(f"rank {self.rank}: static shapes: transfers not seen in a whole step (internal error): {missing[:4]}")
        self._known[self._cur_layout] = (self._cur_rx, self._cur_tx)
        while len(self._known) > _KNOWN_LAYOUTS:
            self._known.popitem(last=False)

    async def _agree_layout(self, inputs: StepInputs, step: int, train: bool) -> tuple[int, ...]:
        """Static shapes, auto: every rank's input signature, gathered (one all-gather per step).

        Keyed by all of them, because a rank's transfers depend on other ranks' inputs (the
        first stage's batch shapes every activation) and a rank may be given no inputs.  The
        signature's lowest bit says whether the rank runs a training step: ranks that disagree
        on it (one calls ``step()``, another ``eval()``) all fail here, at the step's start,
        with each side named (otherwise the end-of-step header catches it on one rank only,
        after the step's headerless transfers).
        """
        # (the model's digest too: a stage frozen whole for some steps hands on an activation that needs no gradient
        # from the same inputs; keyed by the inputs alone, such a step was served the learned table and failed as
        # if its shapes were data-dependent)
        sig = ((input_signature(inputs) ^ inputs.model_key) >> 1 << 1) | int(train)
        if self.agree is None:  # (an actor built without a Pipeline: its own inputs only)
            return (sig,)
        try:
            g = self.agree((sig, inputs.call_check))  # (runtime/pipeline.py _gather_ints: an all-gather in flight)
            w0 = clock_ns() if self.trace is not None and not g.done() else 0
            if not g.done():
                # the ranks start their steps about together: a short spin usually sees it complete,
                # without a thread hop; else the loop waits (liveness checked) for gloo's callback
                until = time.perf_counter() + _AGREE_SPIN
                while not g.done() and time.perf_counter() < until:
                    pass
            if not g.done():
                loop, wake = asyncio.get_running_loop(), self._wake

                def woken() -> None:  # (gloo's thread; the loop may be closed by then: a failed step)
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(wake.set)

                g.on_done(woken)
                try:
                    try:
                        await self._wait_until(g.done, step, "the ranks' input layouts")
                    except RemoteRankError:
                        # A peer that failed on the gather's result (the ranks disagree on the kind of
                        # step) aborts as soon as its side completes, which can reach this rank before
                        # its own side does: the gather is complete but for its delivery here. Judge it
                        # here too, so that every side names the disagreement (a peer that failed before
                        # joining leaves it pending: its abort stands after the grace).
                        until = time.monotonic() + _AGREE_GRACE
                        while not g.done() and time.monotonic() < until:
                            self._wake.clear()
                            await self._wake.wait_for(_AGREE_GRACE / 10)
                        if not g.done():
                            raise
                except BaseException:
                    # a peer failed before joining: the gather stays pending in gloo; the exit guard
                    # keeps it from being finalized (which would end the process with terminate)
                    guard_exit_works([g.work])
                    raise
            if w0 and self.trace is not None:  # (a wait for the ranks not yet at this step, not runtime)
                self.trace.wait(step, w0, clock_ns(), ["the ranks' input layouts"])
            gathered = g.result()
            got = tuple(v[0] for v in gathered)
        except PipelineError:
            raise
        except RuntimeError as exc:  # gloo: a rank of the all-gather is gone (its connection closed)
            err = self._lost_any(f"agreeing on step {step}'s input layouts", exc)
            if err is None:
                raise
            self._remote_error = err
            self.broadcast_abort(err, None, step)
            raise err from exc
        kinds = [x & 1 for x in got]
        if len(set(kinds)) > 1:
            tr = ", ".join(str(r) for r, k in enumerate(kinds) if k)
            ev = ", ".join(str(r) for r, k in enumerate(kinds) if not k)
            raise PipelineError(
                f"rank {self.rank} step {step}: the ranks disagree on the kind of step: rank(s) {tr} run a training "
                f"step (Pipeline.step) and rank(s) {ev} an evaluation step (Pipeline.eval); every rank must make the "
                "same calls in the same order"
            )
        self._check_calls([v[1] for v in gathered], step, inputs)
        return got

    def _check_calls(self, checks: Sequence[int], step: int, inputs: StepInputs) -> None:
        """Every rank's ``call_check`` (``pipeline.call_check``): the same batch rows where a rank passed a batch,
        the same keyword names everywhere; else every rank raises the same PipelineConfigError here."""
        rows = {r: c >> 32 for r, c in enumerate(checks) if c >> 32}
        if len(set(rows.values())) > 1:
            by: dict[int, list[int]] = {}
            for r, n in rows.items():
                by.setdefault(n, []).append(r)
            said = ", ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} pass{'' if len(rs) > 1 else 'es'} "
                             f"{n} rows" for n, rs in by.items())
            raise PipelineConfigError(
                f"rank {self.rank} step {step}: the ranks pass batches of different sizes (rows along dim 0 of the "
                f"first input tensor, else of the target): {said}; every rank must pass the same batch (each rank "
                "cuts it into the microbatches of its own stages: the last stage would pair one rank's microbatch "
                "outputs with other rows of the target)"
            )
        names = [c & 0xFFFFFFFF for c in checks]
        if len(set(names)) > 1:
            by = {}
            for r, n in enumerate(names):
                by.setdefault(n, []).append(r)
            groups = " | ".join(", ".join(map(str, rs)) for rs in by.values())
            mine = sorted(inputs.kwargs[0]) if inputs.kwargs else []
            raise PipelineConfigError(
                f"rank {self.rank} step {step}: the ranks pass different keyword inputs (ranks {groups} differ; this "
                f"rank passes {mine or 'none'}); every stage gets every keyword input, on every rank, so every rank "
                "must pass the same ones (a rank's stages would otherwise run another model)"
            )

    def _lost_any(self, what: str, exc: BaseException) -> PeerLostError | None:
        """A transport error in a collective of every rank: the PeerLostError of whichever peer is gone
        (a 'bye', or its control connection closed, within the short confirmation while), else None."""
        deadline = time.monotonic() + _CONFIRM_LOST
        peers = [p for p in range(self.control.world_size) if p != self.rank]
        while True:
            try:
                self.control.drain()
            except Exception:  # noqa: BLE001 - only a better message is at stake
                pass
            for p in peers:
                if self.liveness.left(p) is not None or p in self.control.disconnected:
                    return self._lost_peer(p, what, exc)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    async def _drain_sends(self, landings: LandingQueue, park: float, step: int) -> None:
        """gloo, end of a step: wait until its sends have completed; SendError as ``drain_sends`` raises it.

        The waits run on an executor thread (a send to a peer that never posts
        its receive would block the loop, and gloo's wait cannot be given up);
        the thread's completion comes back through the landing queue, which the
        dispatcher's thread parks on as it does for a landing (a round trip
        through the loop's selector and an asyncio future cost a few hundred
        microseconds at the end of every step on a loaded 2-core machine).
        While it waits on the loop, the liveness check runs as in the step.
        """
        done: list[BaseException | None] = []
        wake = self._wake

        def finished(err: BaseException | None) -> None:
            done.append(err)
            wake.set()

        def work() -> None:
            err: BaseException | None = None
            try:
                self.tensors.drain_sends()
            except BaseException as exc:  # noqa: BLE001 - handed to the loop's thread
                err = exc
            try:
                landings.call_soon_threadsafe(finished, err)
            except RuntimeError:  # the loop is closed: the job is being torn down
                pass

        landings.inline()
        try:
            asyncio.get_running_loop().run_in_executor(None, work)
            last_liveness = time.monotonic()
            while not done:
                wake.clear()
                if park and landings.park(park):
                    landings.drain()
                    continue
                if not landings.to_loop():
                    landings.drain()
                    continue
                try:
                    woken = await wake.wait_for(self._liveness_interval)
                finally:
                    landings.inline()
                landings.drain()
                now = time.monotonic()
                if not woken and now - last_liveness >= self._liveness_interval:
                    last_liveness = now
                    self._check_liveness([], step)
        finally:
            landings.release()
        if done[0] is not None:
            raise done[0]

    def describe_wait(self, pending: Sequence[Action], step: int, train: bool = True) -> list[str]:
        """What the first few pending actions are waiting for, by stage and microbatch."""
        out = []
        for a in pending[:3]:
            for leaf in a.leaves():
                key = self.flow.input_key(leaf, step)
                if key is not None and key not in self._inbox:
                    p = producer_stage(key.kind, leaf.stage)
                    src = self.stage_to_rank[p]  # type: ignore[index]
                    what = f"activation of stage {p}" if key.kind == "F" else f"gradient from stage {p}"
                    out.append(f"{leaf}: {what} microbatch {leaf.microbatch} {'from' if key.kind == 'F' else 'on'} rank {src}")
                elif leaf.type is _F and train:
                    out.append(f"{leaf}: memory (live microbatches at the schedule's peak {self.memory_limit})")
        if self.collectives is not None:
            out += [d for a in pending[:3] if (d := self.collectives.describe(a))]
        if not pending:
            return out or ["data-parallel collectives to complete"]
        return out or [f"{pending[0]}: an earlier action"]

    def _collectives_check(self, step: int) -> None:
        """While waiting for collectives at the end of a step: stop on any failure or lost peer."""
        if self._remote_error is not None:
            raise self._annotate_wait(self._remote_error, [], step)
        self._check_liveness([], step)

    def _check_liveness(self, pending: list[Action], step: int, waiting: str | None = None) -> None:
        """Raise PeerLostError if a peer is lost (see runtime/liveness.py for the decision); ``waiting``: what
        this rank waits for, as the error says it (default: what ``pending`` waits for)."""
        lost = self.liveness.check(step, disconnected=self.control.disconnected, events_read_at=self.control.monitors_read_at,
                                   needed=self._needed_peers(pending, step))
        if lost is None and (stuck := self._other_kind(step) or self._all_waiting(step)) is not None:
            self._remote_error = stuck
            self.broadcast_abort(stuck, None, step)
            raise stuck
        if lost is not None:
            root = self._abort_behind(lost.peer)
            if root is not None:  # the peer left because another rank failed: that failure, heard, not re-broadcast
                raise self._annotate_wait(root, pending, step, waiting) from None
            err = PeerLostError(lost.reason, rank=self.rank, peer=lost.peer)
            self._remote_error = err
            self.broadcast_abort(err, None, step)
            # from None: raised while handling the wait's TimeoutError, which is no part of the story
            raise self._annotate_wait(err, pending, step, waiting) from None

    def _wait_state(self, what: str) -> None:
        """Report this rank waiting for ``what``; a wait for the same thing that goes on (the dispatcher looks again
        each liveness interval) keeps its start, so that its duration in the heartbeats is the wait's own."""
        st = self.state
        if st[0] != "waiting" or st[1] != what:
            self.state = ("waiting", what, time.monotonic())

    def _other_kind(self, step: int) -> PipelineError | None:
        """A peer running this step as the other kind of step (its heartbeat says so): the error every rank raises
        for it (the per-step agreement's wording), or None."""
        peers = self.liveness.other_kind(step, self._train_now)
        if not peers:
            return None
        train, evals = ([self.rank], peers) if self._train_now else (peers, [self.rank])
        return PipelineError(
            f"rank {self.rank} step {step}: the ranks disagree on the kind of step: rank(s) {', '.join(map(str, train))} "
            f"run a training step (Pipeline.step) and rank(s) {', '.join(map(str, evals))} an evaluation step "
            "(Pipeline.eval) (seen in their heartbeats); every rank must make the same calls in the same order")

    def _all_waiting(self, step: int) -> PipelineError | None:
        """Every rank waiting in ``step``, none running an action, for longer than the stall budget in force (at
        least the heartbeat timeout): nothing can move (``PeerLiveness.all_waiting``), an error naming each
        rank's wait; else None.  (The stall budget, not less: a rank whose device runs a long queue, or a very
        large transfer in flight, waits with nothing of its own to run.)"""
        state, what, since = self.state
        if state != "waiting" or self.control.world_size < 2:
            return None
        after = max(self.options.heartbeat_timeout, float(self.control.stall_budget))
        why = self.liveness.all_waiting(step, what, time.monotonic() - since, after)
        if why is None:
            return None
        return PipelineError(
            f"rank {self.rank} step {step}: every rank has been waiting for over {after:g} s and none runs an action: "
            f"{why}. Nothing can move: the ranks' calls disagree in a way no check saw (one rank in Pipeline.eval "
            "while another is in Pipeline.step, with static_shapes=True: no per-step agreement compares them), or a "
            "transfer was never sent")

    def _abort_behind(self, peer: int) -> RemoteRankError | None:
        """A peer found gone because it closed its Pipeline in this step (its 'bye') most often stopped because
        another rank failed; that rank's abort, sent to every rank, may reach this one after the bye (ZeroMQ keeps
        each sender's order, not an order across senders: a full-suite run under load had the PP x DP fault test's
        rank 2 name rank 0, which had closed on rank 1's abort, instead of rank 1).  The control plane is read for
        a short while (``_CONFIRM_LOST``) for that abort: the root cause, not its consequence.  None if the peer
        did not say bye (it died: nothing to wait for), its bye names no abort heard (it closed for a reason of
        its own: no wait), or that abort did not come."""
        if self._remote_error is not None:
            return self._remote_error if isinstance(self._remote_error, RemoteRankError) else None
        if self.liveness.left(peer) is None or self.liveness.left_after_abort_of(peer) is None:
            return None
        deadline = time.monotonic() + _CONFIRM_LOST
        while True:
            try:
                self.control.drain()
            except Exception:  # noqa: BLE001 - only a better message is at stake
                pass
            if isinstance(self._remote_error, RemoteRankError):
                return self._remote_error
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _needed_peers(self, pending: Sequence[Action], step: int) -> set[int] | None:
        """The peers this rank still waits on for an input in this step (None: every peer).

        Liveness is only this rank's business for those: a peer that has done its
        part of the step and then died or stopped takes nothing from this rank now
        (the ranks that still need it will name it, and their abort reaches this
        rank; in the next step this rank needs it again and names it itself).
        With data-parallel collectives, or with nothing pending (the end of a
        step), every peer counts.  A receive posted but not landed still needs
        its sender (on NCCL it never completes if the sender died).
        """
        if self.collectives is not None or not pending:
            return None
        need: set[int] = set()
        for a in pending:
            for leaf in a.leaves():
                key = self.flow.input_key(leaf, step)
                if key is not None and key not in self._inbox:
                    src = self.stage_to_rank[producer_stage(key.kind, leaf.stage)]  # type: ignore[index]
                    if src != self.rank:
                        need.add(src)
        return need

    def _annotate_wait(self, err: PipelineError, pending: list[Action], step: int, waiting: str | None = None) -> PipelineError:
        if isinstance(err, PeerLostError) and not getattr(err, "_annotated", False):
            err._annotated = True  # type: ignore[attr-defined]
            if waiting is None:
                waiting = "; ".join(self.describe_wait(pending, step))
            err.waiting_for = waiting  # type: ignore[attr-defined]
            err.args = (f"{err.args[0]} (step {step}; this rank was waiting for {waiting}; {len(pending)} actions left)",)
        return err

    def _abort(self, exc: BaseException, a: Action, step: int) -> StageError:
        leaf = a.leaves()[0]
        tb = "".join(traceback.format_exception(exc))
        err = StageError(
            f"{type(exc).__name__}: {exc}",
            rank=self.rank,
            step=step,
            stage=None if a.type is _OVL else leaf.stage,
            microbatch=None if a.type is _OVL else leaf.microbatch,
            action=str(a),
        )
        err.remote_traceback = tb  # type: ignore[attr-defined]
        self.broadcast_abort(exc, a, step, tb=tb)
        return err

    def broadcast_abort(self, exc: BaseException, a: Action | None, step: int, *, tb: str | None = None) -> None:
        """Tell every peer that this rank failed (once), so they stop instead of waiting.

        A peer's abort heard here is not passed on: it went to every rank from its source.
        """
        if self._local_failure is not None or isinstance(exc, RemoteRankError):
            return
        self._local_failure = exc
        leaf = a.leaves()[0] if a is not None else None
        single = a is not None and a.type is not _OVL
        if tb is None:
            tb = "".join(traceback.format_exception(exc))
        try:
            self.control.broadcast(
                "abort",
                step=step,
                stage=leaf.stage if single and leaf is not None else None,
                mb=leaf.microbatch if single and leaf is not None else None,
                action=None if a is None else str(a),
                error=f"{type(exc).__name__}: {exc}"[:60000],
                traceback=tb[-60000:],
            )
        except Exception:  # the abort is best effort; the local error is what matters
            log.exception("rank %d: could not broadcast the abort", self.rank)
