"""A cost-model simulator: how long a schedule takes, where ranks idle, how much they hold.

Every rank runs its list in order (the static schedule), starting each action
as soon as the rank is free and the action's inputs are there.  That is
pipeloom's deterministic mode; the event-driven runtime may do better by
running a ready action ahead of a blocked one.  The result gives the makespan,
each rank's busy and idle time (so the pipeline bubble), the peak number of
live activations per rank, and the timed events for a trace viewer.

Why another simulator: torch's ``_simulate_comms_compute`` counts lock-step
ticks of unit length and rejects ``UNSHARD`` and ``OVERLAP_F_B``, so it fails
on every built-in schedule once lowered.  This one takes real costs and every
action type, and is linear in the number of actions.

The model, action by action (documented here because numbers mean nothing
without it):

* **Compute** (F, I, W, B) occupies the rank's *compute lane* for its cost.
  ``OVERLAP_F_B`` occupies it for ``max(f, b) + overlap * min(f, b)``: 0 means
  perfect overlap, 1 means one after the other (torch's runtime).
* **Inputs.**  F(s, m) needs stage s-1's output, I/B(s, m) needs F(s, m) and
  stage s+1's input gradient (the last stage only its own F), W needs I.
  Between stages on one rank the hand-over is free.  Between ranks, a
  compute-only schedule pays the transfer time right after the producer ends
  (as if every receive were posted in time); a lowered one moves data only
  through its sends and receives.
* **Transfers** (lowered schedules) run on a separate lane, like NCCL's
  asynchronous point-to-point ops: ``SEND`` and ``RECV`` take no compute time
  and are posted when the rank reaches them in its list; the transfer starts
  once both sides are posted and takes ``send_latency + activation_bytes /
  bandwidth``; the consuming compute waits for it to finish.  So a receive
  listed right before its consumer exposes the transfer, one listed earlier
  hides it behind compute.
* **FSDP.**  ``UNSHARD`` issues an all-gather on the rank's *FSDP lane*
  (all-gathers of one rank run one after another) lasting ``unshard``; it
  costs the compute lane nothing, but later compute of that stage waits for it
  to finish -- which is what prefetching hides.  ``RESHARD`` (freeing memory)
  and ``REDUCE_GRAD`` occupy the compute lane for ``reshard`` and
  ``reduce_grad``.
* **Activations** are live from the start of their F to the end of their
  backward: B, or W when the backward is split (I computes the input
  gradient, but W still reads the activations); a B launched beside the
  forwards after it (``host_overlap_backward``) holds its own until its
  launch is over, so a rank may hold one more microbatch's activations.

**Committing ahead (GPUs, ``device_costs``).**  On a GPU pipeloom's host only
*launches* an action and commits ahead of the device (``runtime/device.py``):
an action whose inputs are committed is enqueued while the device time queued
and not yet run is at most ``commit_horizon``, and CUDA stream waits enforce
the data dependencies; with static shapes (every step after the first) a
receive is posted and its consumer committed before the sender has produced,
so no host waits for another's.  One lane per rank that charges each action
the longer of its host and device time gets this wrong both ways: where F is
host-bound and B device-bound (or the reverse) the host's launches overlap
the device's work, and the sum of per-action maxima over-predicts (the GPU
profile simulated 1.4x its measured step, calibration x0.715 on 2 x H100).
With ``device_costs`` each rank has two lanes: the *host lane* runs the list
in order, each action for its ``action_costs`` (launch, the runtime's own
time, its sends), starting no earlier than when the queued device work falls
to ``commit_horizon``; the *device lane* runs it when the device is free,
the launch has begun and its inputs have landed (a local producer's device
end; a transfer ``device_transfer`` after both its producer's device end and
the receiver's device position where the receive was posted: NCCL queues the
receive behind its stream's work), and it ends no earlier than its launch.
The step ends when both lanes are done.  Without ``device_costs`` (CPUs: an
action *is* its work) one lane, as above.

**Host-overlapped backwards (``host_overlap_backward``, two lanes only).**
The runtime may launch a full backward B on a worker thread while its loop
launches the forwards after it (``RuntimeOptions.host_overlap_backward``,
auto on GPUs): on a host-bound GPU job the B's launch and the next F's
launch then take the time of about one of them.  A model without it
predicted such a step ~25% too slow (session J).  Here a B that its rank's
list follows with a plain F (comm actions between them aside), whose pair
:func:`~pipeloom.schedules.dispatch.overlappable_backwards` keeps and whose
``(B stage, F stage)`` the rule accepts (``"auto"``:
:func:`~pipeloom.schedules.dispatch.backward_overlap_pays`, the runtime's own
function, on the stages' mean host and device costs, two stages sharing a
stream unless ``device_streams`` and they differ; True: every kept pair), is
launched on a *second host lane*: the main lane moves on at once to the
forwards after it; while both lanes launch, each runs ``overlap_contention``
times slower (processor sharing of one interpreter: 1 no contention, 2 no
gain); the next non-forward (a B, I, W, OVERLAP_F_B, FSDP or reduction
action) and the list's end wait for the B's launch to end, and the B's
sends are posted then (on the device lane, as any send).  Device side: on
one stream (one device lane, or the B's own stage) the kernels of the
forwards launched before the B's launch ended run among the B's, so the
B's device end is ``max(its launch end, its device start + its device time +
those forwards' device times)`` -- the forwards are not delayed, the B (whose
input gradient the previous rank waits for) is; those forwards start no
earlier than the B's device start (the stream waits on the B's input).  On
separate streams the B takes a device gap once its launch allows, like any
other launch.  Approximations: a B's device work is counted in the commit
horizon as if it ran alone; its kernels are taken as launched evenly over
its launch.  (A B stays in flight while the simulation waits for a
forward's input: ``overlappable_backwards`` keeps only pairs where no
forward of the run after the B waits on its outputs.)  None or False
(default): no second lane; every result above stands unchanged.

``busy`` is compute-lane time (compute, RESHARD, REDUCE_GRAD; the device lane
with ``device_costs``); ``idle`` is the rest of the makespan; ``bubble_fraction`` is ``idle / makespan`` per rank.
With uniform costs and free communication this reproduces the textbook bubble
fractions exactly: ``(p-1)/(m+p-1)`` for GPipe and 1F1B and ``(p-1)/(v*m+p-1)``
for interleaved 1F1B.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields, replace
from functools import partial
from operator import itemgetter
from typing import Any, ClassVar, NamedTuple

from .action import Action, ActionType
from .dataflow import Dataflow, consumer_stage
from .schedule import Schedule, ScheduleError

__all__ = ["ActionCosts", "Costs", "SimulationResult", "TimedEvent", "lane_times", "simulate"]

_F = ActionType.F
_B = ActionType.B
_I = ActionType.I
_W = ActionType.W
_SEND_F = ActionType.SEND_F
_RECV_F = ActionType.RECV_F
_SEND_B = ActionType.SEND_B
_RECV_B = ActionType.RECV_B
_UNSHARD = ActionType.UNSHARD
_RESHARD = ActionType.RESHARD


OVERLAP_CONTENTION = 1.4
"""``simulate(overlap_contention=...)``'s default: how much slower each host lane launches while a backward and the
forwards beside it are launched at once (1: as fast as alone; 2: the two threads share one interpreter evenly, no
gain: two Python threads launching kernels contend for the GIL, except where one waits in the autograd engine or
the CUDA driver).  Fitted on session J's GPU rows (``benchmarks/host_overlap_sim.py``: the simulated
overlap/inline ratio of each measured pair, GPT on 2 and 4 x H100, with each stage's learned host and device
times): 1.39 by least squares over the six pairs where a rank overlapped (rms residual 0.075 of the ratio);
size s alone 1.31, size l alone 1.80: one value does not fit both models, see benchmarks/RESULTS.md."""


@dataclass(frozen=True)
class Costs:
    """Durations of actions and transfers, in one arbitrary time unit."""

    F: float = 1.0
    """Forward of one stage on one microbatch."""
    B: float = 2.0
    """Full backward (input and weight gradients)."""
    I: float = 1.0  # noqa: E741
    """Backward for the input gradient only (zero-bubble split)."""
    W: float = 1.0
    """Backward for the weight gradient only."""
    send_latency: float = 0.0
    """Fixed time of every point-to-point transfer."""
    bandwidth: float | None = None
    """Bytes per time unit of a transfer; None: transfers take only ``send_latency``."""
    activation_bytes: int = 0
    """Size of an activation (and of its gradient) crossing a stage boundary, in bytes."""
    unshard: float = 0.0
    """FSDP all-gather of one stage's parameters (on the FSDP lane)."""
    reshard: float = 0.0
    """Freeing a stage's unsharded parameters (on the compute lane)."""
    reduce_grad: float = 0.0
    """Reducing one stage's gradients across replicas (on the compute lane)."""
    overlap: float = 0.0
    """OVERLAP_F_B takes ``max(f, b) + overlap * min(f, b)``: 0 perfect overlap, 1 sequential."""

    #: Short spellings accepted by :meth:`parse`.
    ALIASES: ClassVar[Mapping[str, str]] = {
        "latency": "send_latency",
        "bw": "bandwidth",
        "bytes": "activation_bytes",
        "act": "activation_bytes",
    }

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "bandwidth":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"cost {f.name} must be a finite number >= 0 (got {value!r})")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes per time unit, or None for free transfers (got {self.bandwidth})")

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Costs from ``"F=1,B=2,I=1,W=1,latency=0.1"`` (the CLI's ``--costs``).

        Keys are the field names (``F B I W send_latency bandwidth
        activation_bytes unshard reshard reduce_grad overlap``) or the aliases
        ``latency``, ``bw``, ``bytes``/``act``; unnamed fields keep their
        defaults; ``bandwidth=none`` means free transfers.
        """
        names = {f.name for f in fields(cls)}
        values: dict[str, float | int | None] = {}
        for item in text.split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, raw = item.partition("=")
            key, raw = key.strip(), raw.strip()
            key = cls.ALIASES.get(key, key)
            if not sep or key not in names:
                valid = ", ".join(sorted(names | set(cls.ALIASES)))
                raise ValueError(f"invalid cost {item!r}: expected KEY=VALUE with KEY one of {valid}")
            if key in values:
                raise ValueError(f"cost {key!r} given twice in {text!r}")
            if key == "bandwidth" and raw.lower() in ("none", "inf", ""):
                values[key] = None
                continue
            try:
                number = float(raw)
            except ValueError:
                raise ValueError(f"invalid cost {item!r}: {raw!r} is not a number") from None
            values[key] = int(number) if key == "activation_bytes" and number.is_integer() else number
        return cls(**values)  # type: ignore[arg-type]

    @property
    def transfer(self) -> float:
        """Duration of one point-to-point transfer of an activation or gradient."""
        if self.bandwidth is None:
            return self.send_latency
        return self.send_latency + self.activation_bytes / self.bandwidth


class TimedEvent(NamedTuple):
    """One action's time span on one lane of one rank (for traces)."""

    rank: int
    action: Action
    start: float
    end: float
    lane: str = "compute"  #: "compute", "comm" (transfers) or "fsdp" (all-gathers)


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` found; per-rank values are keyed by rank.

    Attributes:
        makespan: time from the first action's start to the last event's end.
        busy: time each rank's compute lane is occupied.
        idle: ``makespan - busy``.
        bubble_fraction: ``idle / makespan`` (0 when the makespan is 0).
        peak_live_activations: most activations (microbatch-stages) held at once.
        events: every action's time span, in start order per rank.
        overlapped_backwards: per rank, the B actions launched on the second host lane.
    """

    makespan: float
    busy: Mapping[int, float]
    idle: Mapping[int, float]
    bubble_fraction: Mapping[int, float]
    peak_live_activations: Mapping[int, int]
    events: tuple[TimedEvent, ...] = field(repr=False, default=())
    overlapped_backwards: Mapping[int, int] = field(default_factory=dict)
    """Per rank, the backwards launched beside the forwards after them (``host_overlap_backward``; empty without)."""
    overlap_decided: Mapping[int, Mapping[tuple[int, int], bool]] = field(default_factory=dict)
    """``host_overlap_backward="auto"``: per rank, each (B stage, F stage) pair met and whether it went beside."""
    overlap_tried: Mapping[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    """``overlap_trial``: per rank, the host-heavy pairs the rule kept inline that were tried beside (they went
    beside in this result where ``overlap_decided`` says True)."""

    @property
    def overall_bubble_fraction(self) -> float:
        """Idle time over ``ranks x makespan``: the share of the machine left unused."""
        total = self.makespan * len(self.idle)
        return sum(self.idle.values()) / total if total else 0.0


_new_event = partial(tuple.__new__, TimedEvent)  # skips NamedTuple's Python-level __new__
_START = itemgetter(2)

# Keys of the values ranks wait for: kind * N + stage * M + microbatch.
_END_F, _END_G, _END_I, _ARR_F, _ARR_B = range(5)
_WAIT_TEXT = {
    _END_F: "the forward {s}F{m}",
    _END_G: "the input gradient of {s}B{m} or {s}I{m}",
    _END_I: "{s}I{m}",
    _ARR_F: "the transfer received by {s}RECV_F{m}",
    _ARR_B: "the transfer received by {s}RECV_B{m}",
}


ActionCosts = Mapping[tuple[int, str, "int | None"], float]
"""Durations by ``(stage, type, microbatch)``; microbatch None: every microbatch of that stage and type."""


def simulate(schedule: Schedule, costs: Costs | None = None, *, action_costs: ActionCosts | None = None,
             device_costs: ActionCosts | None = None, commit_horizon: float = math.inf,
             device_transfer: float | None = None, host_overlap: float = 1.0,
             device_streams: bool = False, host_overlap_backward: bool | str | None = None,
             overlap_contention: float = OVERLAP_CONTENTION,
             overlap_pairs: Mapping[int, Collection[tuple[int, int]]] | None = None,
             overlap_margin: float | None = None, overlap_trial: bool = True) -> SimulationResult:
    """Simulate ``schedule`` under ``costs`` (default :class:`Costs`).

    ``action_costs`` overrides the compute costs of F, B, I and W per stage
    (key ``(stage, "F", None)``) or per stage and microbatch (``(stage, "F",
    3)``, looked up first): costs measured on a recorded run differ by stage
    (an embedding, a vocabulary head) and by microbatch (varying lengths).

    ``device_costs`` (same keys): the device time of each action; then
    ``action_costs`` (or ``costs``) are the host's launch time, and the ranks
    commit ahead (module docstring): ``commit_horizon`` is how much queued
    device time the host may run ahead by (pipeloom's ``gpu_commit_ms``),
    ``device_transfer`` a transfer's time on the device lane (default
    ``costs.transfer``), ``host_overlap`` the host's ``overlap`` of an
    ``OVERLAP_F_B`` (1: it launches both halves; ``costs.overlap`` is the
    device's).  ``device_streams``: each stage's actions run in launch order
    on its own stream (pipeloom's engine), and the device takes each in the
    earliest gap long enough once its stream, launch and inputs allow, so a
    stage whose input is late does not hold up another's (default: one
    device lane in launch order).  The events are the device lane's.

    ``host_overlap_backward`` (with ``device_costs``; the module docstring's
    "Host-overlapped backwards"): None or False (default) every action is
    launched by the one host lane, as above; ``"auto"`` a B followed in its
    rank's list by an F is launched on a second host lane beside the forwards
    after it where the runtime's auto rule says so for the pair
    (:func:`~pipeloom.schedules.dispatch.backward_overlap_pays` on the mean
    host and device costs of the two stages, two stages on two streams when
    ``device_streams``); True every such pair (the runtime's ``True``).  Only
    pairs :func:`~pipeloom.schedules.dispatch.overlappable_backwards` keeps.
    ``overlap_pairs``: per rank, the ``(B stage, F stage)`` pairs to overlap
    instead of the rule's (a recorded run's decisions).  ``overlap_contention``:
    how much slower each of the two host lanes launches while both do (1: not
    at all, 2: one interpreter shared evenly; :data:`OVERLAP_CONTENTION`).
    ``overlap_margin``: the auto rule's margin (None: the runtime's,
    :data:`~pipeloom.schedules.dispatch.OVERLAP_MARGIN`; 1.0 replays a run
    recorded before session M).  ``overlap_trial`` (with ``"auto"``; the runtime's
    ``RuntimeOptions.host_overlap_trial``, on by default): the pairs the rule
    keeps inline on a host-heavy rank (:func:`~pipeloom.schedules.dispatch.host_heavy`)
    go beside if that makes the simulated step at least 3% shorter
    (:class:`~pipeloom.schedules.dispatch.OverlapTrial`'s gain), as the runtime's
    trial keeps them where its measured steps got that much faster.

    Accepts compute-only and lowered schedules, with or without FSDP actions,
    ``REDUCE_GRAD`` and ``OVERLAP_F_B``.  Raises :class:`ScheduleError` when
    the ranks cannot all finish (run :func:`pipeloom.schedules.check` for the
    precise problems).
    """
    costs = Costs() if costs is None else costs
    lowered = any(a.is_comm for acts in schedule.actions.values() for a in acts)
    if device_costs is not None and not commit_horizon >= 0:
        raise ValueError(f"commit_horizon must be >= 0 (got {commit_horizon!r})")
    if host_overlap_backward not in (None, False, True, "auto"):
        raise ValueError(f"host_overlap_backward must be None, False, True or 'auto' (got {host_overlap_backward!r})")
    bg_mode = overlap_pairs if overlap_pairs is not None else (host_overlap_backward or None)
    if bg_mode is not None and device_costs is None:
        raise ValueError("host_overlap_backward and overlap_pairs need device_costs: the second host lane launches "
                         "beside the device lane (two-lane model)")
    if not (isinstance(overlap_contention, (int, float)) and 1.0 <= overlap_contention <= 2.0):
        raise ValueError(f"overlap_contention must be a number from 1 (no contention) to 2 (one interpreter shared "
                         f"evenly) (got {overlap_contention!r})")
    def run(mode: Any, trial: bool = False) -> SimulationResult:
        return _run(schedule, costs, lowered=lowered, marks=None, record=True, action_costs=action_costs,
                    device_costs=device_costs, horizon=commit_horizon, device_transfer=device_transfer,
                    host_overlap=host_overlap, device_streams=device_streams, bg_mode=mode,
                    contention=float(overlap_contention), margin=overlap_margin, trial=trial)

    base = run(bg_mode, trial=bg_mode == "auto" and overlap_trial)
    if not base.overlap_tried:
        return base
    from .dispatch import OverlapTrial  # (here: dispatch imports this module)

    pairs = {r: {p for p, on in got.items() if on} | set(base.overlap_tried.get(r, ())) for r, got in base.overlap_decided.items()}
    tried = run(pairs)
    if tried.makespan < (1.0 - OverlapTrial().gain) * base.makespan:
        decided = {r: {p: on or p in base.overlap_tried.get(r, ()) for p, on in got.items()} for r, got in base.overlap_decided.items()}
        return replace(tried, overlap_decided=decided, overlap_tried=base.overlap_tried)
    return base


def lane_times(schedule: Schedule, costs: Costs | None = None) -> dict[int, list[float]]:
    """For each rank, its compute-lane clock right after each action of its list.

    Cross-rank inputs are modelled as in a compute-only schedule (transfers
    start when their producer ends) and sends and receives in the lists are
    ignored: this is the timeline a lowering pass uses to decide where a
    receive can go (see ``add_send_recv(recv_placement="early")``).
    """
    marks: dict[int, list[float]] = {r: [] for r in schedule.actions}
    _run(schedule, Costs() if costs is None else costs, lowered=False, marks=marks, record=False)
    return marks


def _run(
    schedule: Schedule,
    costs: Costs,
    *,
    lowered: bool,
    marks: dict[int, list[float]] | None,
    record: bool,
    action_costs: ActionCosts | None = None,
    device_costs: ActionCosts | None = None,
    horizon: float = math.inf,
    device_transfer: float | None = None,
    host_overlap: float = 1.0,
    device_streams: bool = False,
    bg_mode: bool | str | Mapping[int, Collection[tuple[int, int]]] | None = None,
    contention: float = 1.0,
    margin: float | None = None,
    trial: bool = False,
) -> SimulationResult:
    """The simulation proper; ``marks`` collects lane clocks, ``record`` the events; ``trial`` (``bg_mode="auto"``):
    note the host-heavy pairs the rule keeps inline (``SimulationResult.overlap_tried``)."""
    actions = schedule.actions
    place = schedule.stage_to_rank
    flow = Dataflow(place)
    act_from, grad_from = flow.activation_from, flow.gradient_from  # who produced each stage's inputs
    S = len(place)
    M = schedule.num_microbatches
    N = S * M
    xfer = costs.transfer
    leaf_cost = {_F: costs.F, _B: costs.B, _I: costs.I, _W: costs.W}
    cost_of = _cost_lookup(action_costs, leaf_cost) if action_costs else None
    two_lane = device_costs is not None
    dev_cost = _cost_lookup(device_costs, leaf_cost) if two_lane else None
    dev_xfer = (costs.transfer if device_transfer is None else device_transfer) if two_lane else 0.0
    dclock = {r: 0.0 for r in schedule.actions}  # device lane (two_lane): when it is free
    queued: dict[int, list[tuple[float, float]]] = {r: [] for r in schedule.actions}  # committed (device end, duration)
    streams = two_lane and device_streams
    sfree: dict[tuple[int, int], float] = {}  # (rank, stage) -> when its stream is free (streams)
    gaps: dict[int, list[tuple[float, float]]] = {r: [] for r in schedule.actions}  # device busy spans (streams)
    overlap = costs.overlap
    # host-overlapped backwards (bg_mode): the B in flight on each rank's second host lane, the pairs allowed
    bg: dict[int, _Bg | None] = dict.fromkeys(actions)
    bg_pairs = None
    if bg_mode is not None and two_lane:
        # (here, not at the top: dispatch imports this module)
        from .dispatch import backward_overlap_pays as pays
        from .dispatch import host_heavy as heavy
        from .dispatch import overlappable_backwards

        bg_pairs = overlappable_backwards(schedule)
    bg_decided: dict[tuple[int, int, int], bool] = {}
    bg_tried: dict[int, list[tuple[int, int]]] = {}  # (trial) per rank, the host-heavy pairs the rule kept inline
    bg_count = dict.fromkeys(actions, 0)

    # value[kind * N + k]: when the value became available (None: not yet).
    value: list[float | None] = [None] * (5 * N)
    unsharded_at: dict[int, float] = {}  # stage -> end of its latest all-gather
    send_post: dict[int, tuple[float, Action]] = {}  # transfer slot -> (when its send was posted, the send)
    recv_post: dict[int, tuple[float, Action]] = {}  # transfer slot -> (when its receive was posted, the receive)
    waiters: dict[int, list[int]] = {}
    ranks = sorted(actions)
    pos = {r: 0 for r in ranks}
    clock = {r: 0.0 for r in ranks}
    fsdp_lane = {r: 0.0 for r in ranks}
    busy = {r: 0.0 for r in ranks}
    live = {r: 0 for r in ranks}
    peak = {r: 0 for r in ranks}
    events: dict[int, list[TimedEvent]] = {r: [] for r in ranks}
    new_event = _new_event
    makespan = 0.0
    blocked_on: dict[int, int] = {}
    ready: list[int] = list(reversed(ranks))

    def publish(key: int, t: float) -> None:
        value[key] = t
        woken = waiters.pop(key, None)
        if woken:
            ready.extend(woken)

    def input_time(rank: int, leaf: Action) -> tuple[float | None, int]:
        """When the inputs of a compute leaf are there, or (None, key waited for)."""
        s, t, m, _ = leaf
        if m is None:
            raise ScheduleError(f"cannot simulate {leaf} on rank {rank}: a compute action needs a microbatch")
        k = s * M + m
        ready_t = 0.0
        if t is _F:
            src = act_from[s]
            if src is not None:
                if src == rank or not lowered:
                    key = _END_F * N + k - M  # the producer's (stage s-1) forward
                    v = value[key]
                    if v is None:
                        return None, key
                    ready_t = v if src == rank else v + xfer
                else:
                    key = _ARR_F * N + k
                    v = value[key]
                    if v is None:
                        return None, key
                    ready_t = v
        elif t is _B or t is _I:
            key = _END_F * N + k
            v = value[key]
            if v is None:
                return None, key
            ready_t = v
            src = grad_from[s]
            if src is not None:
                if src == rank or not lowered:
                    key = _END_G * N + k + M  # the producer's (stage s+1) input gradient
                    v = value[key]
                    if v is None:
                        return None, key
                    v = v if src == rank else v + xfer
                else:
                    key = _ARR_B * N + k
                    v = value[key]
                    if v is None:
                        return None, key
                ready_t = max(ready_t, v)
        else:  # W
            key = _END_I * N + k
            v = value[key]
            if v is None:
                return None, key
            ready_t = v
        if s in unsharded_at:
            ready_t = max(ready_t, unsharded_at[s])
        return ready_t, -1

    def bg_decide(rank: int, b_stage: int, f_stage: int) -> bool:
        """Whether a B of ``b_stage`` is launched beside the F of ``f_stage`` after it (decided once per pair)."""
        if isinstance(bg_mode, Mapping):
            return (b_stage, f_stage) in bg_mode.get(rank, ())
        if bg_mode is True:
            return True
        got = bg_decided.get((rank, b_stage, f_stage))
        if got is None:
            assert dev_cost is not None
            host = cost_of if cost_of is not None else (lambda x: leaf_cost[x.type])

            def mean(f: Callable[[Action], float], st: int, typ: ActionType) -> float:
                return sum(f(Action(st, typ, mb)) for mb in range(M)) / max(M, 1)

            # the runtime's rule on its learned means: a stage's host launch and device times
            one = not streams or b_stage == f_stage
            hb, db, df = mean(host, b_stage, _B), mean(dev_cost, b_stage, _B), mean(dev_cost, f_stage, _F)
            got = bool(pays(one, hb, db, df, *(() if margin is None else (margin,))))
            bg_decided[(rank, b_stage, f_stage)] = got
            if trial and one and not got and heavy(hb, mean(host, f_stage, _F), db, df):
                bg_tried.setdefault(rank, []).append((b_stage, f_stage))
        return got

    def bg_advance(b: _Bg, t: float) -> None:
        """The B's launch alone on its lane up to ``t`` (the main lane idle or waiting for it)."""
        if b.hend is None and t > b.t:
            if t - b.t >= b.left:
                b.hend, b.left = b.t + b.left, 0.0
            else:
                b.left -= t - b.t
            b.t = t

    def bg_corun(b: _Bg, t0: float, work: float) -> float:
        """A launch of ``work`` on the main lane from ``t0`` beside the B's: both ``contention`` times slower while
        both run.  Returns the main lane's launch end."""
        bg_advance(b, t0)
        if b.hend is not None:
            return t0 + work
        if work < b.left:
            b.left -= work
            b.t = t0 + work * contention
            return b.t
        b.hend = b.t = t0 + b.left * contention
        rest, b.left = work - b.left, 0.0
        return b.hend + rest

    def bg_finish(rank: int, b: _Bg) -> None:
        """The B's launch is over (``b.hend``): its device span, its outputs, its deferred sends."""
        a, ddur = b.action, b.ddur
        hend = b.hend
        assert hend is not None
        if streams:  # its stage's stream, in a device gap like any launch; forwards of its stage ran among its kernels
            ready_t = max(b.start, b.h0, hend - ddur, b.sfree0)
            dend = _gap(gaps[rank], ready_t, ddur) + ddur
            if b.inter:
                dend = max(dend, ready_t + ddur + b.inter)
            if ddur > 0:
                bisect.insort(gaps[rank], (dend - ddur, dend))
            sfree[(rank, a.stage)] = max(sfree.get((rank, a.stage), 0.0), dend)
        else:  # one stream: the forwards launched beside it ran among its kernels, before its last one
            dend = max(hend, b.ds + ddur + b.inter)
        for f_start, f_dend in b.queued:
            # the B's kernels launched after the F's first one run after the F's (a stream waiting for the F's
            # input holds them too): that share of its device time, launched evenly over its launch
            dend = max(dend, f_dend + ddur * max(0.0, hend - f_start) / max(hend - b.h0, 1e-12))
        dclock[rank] = max(dclock[rank], dend)
        if record:
            events[rank].append(new_event((rank, a, max(b.ds, dend - ddur), dend, "compute")))
        busy[rank] += ddur
        live[rank] -= 1  # its activations held until it is done: one more microbatch's while forwards ran beside it
        bg[rank] = None
        publish(_END_G * N + a.stage * M + (a.microbatch or 0), dend)
        for slot, send in b.sends:
            send_post[slot] = (dend, send)
            if slot in recv_post:
                land(slot)

    def run(rank: int) -> None:
        nonlocal makespan
        acts = actions[rank]
        i = pos[rank]
        now = clock[rank]
        evs = events[rank].append if record else None
        n = len(acts)
        mark = marks[rank].append if marks is not None else None
        while i < n:
            a = acts[i]
            s, t, m, subs = a
            b = bg[rank]
            if b is not None and (subs or not (t is _F or a.is_comm)):
                # a non-forward waits for the B's launch (then the B's outputs leave)
                bg_advance(b, now)
                if b.hend is None:
                    b.hend = b.t + b.left
                now = max(now, b.hend)
                bg_finish(rank, b)
                b = None
            if subs or t is _F or t is _B or t is _I or t is _W:
                leaves = subs if subs else (a,)
                start = now
                for leaf in leaves:
                    when, key = input_time(rank, leaf)
                    if when is None:
                        # (a B in flight stays so: overlappable_backwards keeps only pairs where no forward of the
                        # run after the B waits on its outputs, even through other ranks)
                        waiters.setdefault(key, []).append(rank)
                        blocked_on[rank] = key
                        pos[rank], clock[rank] = i, now
                        return
                    if when > start:
                        start = when
                if subs:
                    if cost_of is None:
                        c1, c2 = leaf_cost[subs[0].type], leaf_cost[subs[1].type]
                    else:
                        c1, c2 = cost_of(subs[0]), cost_of(subs[1])
                    dur = max(c1, c2) + overlap * min(c1, c2)
                else:
                    dur = leaf_cost[t] if cost_of is None else cost_of(a)
                if dev_cost is not None:
                    # host: launches in list order once the queued device work is down to the horizon (its
                    # inputs are committed: a local producer earlier in the list; a remote one posted)
                    if subs:
                        dur = max(c1, c2) + host_overlap * min(c1, c2)  # the host launches both halves
                        d1, d2 = dev_cost(subs[0]), dev_cost(subs[1])
                        ddur = max(d1, d2) + overlap * min(d1, d2)
                    else:
                        ddur = dev_cost(a)
                    q = queued[rank]  # committed (device end, device time), by end: the queue drains front first
                    k0 = 0
                    while k0 < len(q) and q[k0][0] <= now:
                        k0 += 1
                    del q[:k0]  # finished before the host got here: never counted again
                    load = sum(d for _, d in q)
                    hstart = now
                    for e, d in q:
                        if load <= horizon:
                            break
                        hstart, load = e, load - d
                    launch_bg = False
                    if b is not None:  # a forward launched beside the B in flight
                        hend = bg_corun(b, hstart, dur)
                        # on one stream, launched before the B's last kernel: its kernels queue among the B's
                        shared = (not streams or s == b.action.stage) and (b.hend is None or hstart < b.hend)
                    else:
                        hend = hstart + dur
                        if bg_pairs is not None and t is _B and not subs and (s, m) in bg_pairs[rank]:
                            j = i + 1
                            while j < n and acts[j].is_comm:
                                j += 1
                            nxt = acts[j] if j < n else None
                            launch_bg = (nxt is not None and nxt.type is _F and not nxt.sub_actions
                                         and bg_decide(rank, s, nxt.stage))
                    if launch_bg:
                        # on the second host lane: the main lane moves on to the forwards at once
                        nb = bg[rank] = _Bg(a, dur, hstart, start, ddur)
                        if streams:
                            nb.sfree0 = sfree.get((rank, s), 0.0)
                            nb.ds = max(start, hstart, nb.sfree0)
                        else:
                            nb.ds = dclock[rank] = max(start, dclock[rank], hstart)
                        bisect.insort(q, (nb.ds + ddur, ddur))  # (the horizon's account: its end as if alone)
                        bg_count[rank] += 1
                        now = hstart
                        i += 1
                        continue
                    # the device runs the kernels as they are launched: it ends no earlier than its launch
                    # (a host-bound action's device time lies at the end of its launch)
                    if streams:
                        # its stage's stream (both halves' for a pair) runs in launch order; the device takes the
                        # earliest gap at least that long: a later launch of another stage may run first
                        sts = [leaf.stage for leaf in leaves]
                        ready_t = max(start, hstart, hend - ddur, *(sfree.get((rank, x), 0.0) for x in sts))
                        dstart = _gap(gaps[rank], ready_t, ddur)
                        dend = dstart + ddur
                        if ddur > 0:
                            bisect.insort(gaps[rank], (dstart, dend))
                        for x in sts:
                            sfree[(rank, x)] = dend
                        dclock[rank] = max(dclock[rank], dend)
                    else:
                        dstart = max(start, dclock[rank], hstart, hend - ddur)
                        dend = dclock[rank] = dstart + ddur
                    bisect.insort(q, (dend, ddur))
                    if evs is not None:
                        evs(new_event((rank, a, dstart, dend, "compute")))
                    busy[rank] += ddur
                    if b is not None:
                        if shared:  # (the F's kernels queue among the B's: see bg_finish)
                            b.inter += ddur
                            b.queued.append((hstart, dend))
                        if b.hend is not None and b.hend <= hend:
                            bg_finish(rank, b)
                    start, dur, now = dstart, 0.0, hend  # the device lane's span is recorded; the host moves on
                end = start + dur if dev_cost is None else dend
                for leaf in leaves:
                    ls, lt, lm, _ = leaf
                    k = ls * M + (lm or 0)  # input_time checked the microbatch
                    if lt is _F:
                        live[rank] += 1
                        if live[rank] > peak[rank]:
                            peak[rank] = live[rank]
                        publish(_END_F * N + k, end)
                    elif lt is _I:
                        publish(_END_G * N + k, end)
                        publish(_END_I * N + k, end)
                    else:
                        if lt is _B:
                            publish(_END_G * N + k, end)
                        live[rank] -= 1
                if dev_cost is None:
                    if evs is not None:
                        evs(new_event((rank, a, start, end, "compute")))
                    busy[rank] += dur
                    now = end
            elif not lowered and (t is _SEND_F or t is _SEND_B or t is _RECV_F or t is _RECV_B):
                pass  # transfers are implied by the compute dependencies
            elif t is _SEND_F or t is _SEND_B:
                if m is None:
                    raise ScheduleError(f"cannot simulate {a} on rank {rank}: a transfer needs a microbatch")
                # A transfer is known by its receiving side: slot k (+ N for gradients).
                k = s * M + m
                c = consumer_stage("F" if t is _SEND_F else "B", s, S)
                if c is None:
                    raise ScheduleError(f"cannot simulate {a} on rank {rank}: stage {s} has no stage to send it to")
                if t is _SEND_F:
                    need, slot = _END_F * N + k, c * M + m
                else:
                    need, slot = _END_G * N + k, c * M + m + N
                produced = value[need]
                if produced is None and b is not None and need == _END_G * N + b.action.stage * M + (b.action.microbatch or 0):
                    b.sends.append((slot, a))  # the B in flight: its outputs leave when its launch is over
                    i += 1
                    continue
                if produced is None:  # a send listed before its producer: wait for the data
                    waiters.setdefault(need, []).append(rank)
                    blocked_on[rank] = need
                    pos[rank], clock[rank] = i, now
                    return
                send_post[slot] = (produced if two_lane else max(now, produced), a)  # two lanes: on the device
                if slot in recv_post:
                    land(slot)
            elif t is _RECV_F or t is _RECV_B:
                if m is None:
                    raise ScheduleError(f"cannot simulate {a} on rank {rank}: a transfer needs a microbatch")
                slot = s * M + m + (0 if t is _RECV_F else N)
                # NCCL: behind the work queued on its stream (the consumer stage's, with streams)
                recv_post[slot] = ((sfree.get((rank, s), 0.0) if streams else dclock[rank]) if two_lane else now, a)
                if slot in send_post:
                    land(slot)
            elif t is _UNSHARD:
                start = max(now, fsdp_lane[rank])
                end = start + costs.unshard
                fsdp_lane[rank] = end
                unsharded_at[s] = end
                if end > makespan:
                    makespan = end
                if evs is not None:
                    evs(new_event((rank, a, start, end, "fsdp")))
            else:  # RESHARD, REDUCE_GRAD: on the compute lane
                dur = costs.reshard if t is _RESHARD else costs.reduce_grad
                if evs is not None:
                    evs(new_event((rank, a, now, now + dur, "compute")))
                busy[rank] += dur
                now += dur
            if mark is not None:
                mark(now)
            i += 1
        b = bg[rank]
        if b is not None:  # the list's end waits for the B's launch
            bg_advance(b, now)
            if b.hend is None:
                b.hend = b.t + b.left
            now = max(now, b.hend)
            bg_finish(rank, b)
        pos[rank], clock[rank] = i, now
        if now > makespan:
            makespan = now
        if dclock[rank] > makespan:
            makespan = dclock[rank]
        blocked_on.pop(rank, None)

    def land(slot: int) -> None:
        """A transfer whose send and receive are both posted: it arrives ``xfer`` later."""
        nonlocal makespan
        sent, send = send_post[slot]
        posted, recv = recv_post[slot]
        start = sent if sent > posted else posted
        end = start + (dev_xfer if two_lane else xfer)
        if end > makespan:
            makespan = end
        if record:
            sender = place[send.stage]
            events[sender].append(new_event((sender, send, start, end, "comm")))
            receiver = place[recv.stage]
            events[receiver].append(new_event((receiver, recv, posted, end, "comm")))
        publish(slot + _ARR_F * N if slot < N else slot - N + _ARR_B * N, end)

    while ready:
        run(ready.pop())

    stuck = [r for r in ranks if pos[r] < len(actions[r])]
    if stuck:
        details = "; ".join(
            f"rank {r} at position {pos[r]} ({actions[r][pos[r]]}) waits for {_describe_wait(blocked_on.get(r), N, M)}"
            for r in stuck
        )
        raise ScheduleError(
            f"cannot simulate schedule {schedule.name!r}: ranks never finish ({details}); "
            "run pipeloom.schedules.check() on it for the exact problems"
        )

    all_events = tuple(e for r in ranks for e in sorted(events[r], key=_START))
    idle = {r: makespan - busy[r] for r in ranks}
    bubble = {r: (idle[r] / makespan if makespan else 0.0) for r in ranks}
    return SimulationResult(
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_fraction=bubble,
        peak_live_activations=peak,
        events=all_events,
        overlapped_backwards=bg_count if bg_pairs is not None else {},
        overlap_decided={r: {(b, f): on for (rr, b, f), on in bg_decided.items() if rr == r} for r in {k[0] for k in bg_decided}},
        overlap_tried={r: tuple(v) for r, v in bg_tried.items()},
    )


def _gap(busy: list[tuple[float, float]], t: float, dur: float) -> float:
    """The earliest start >= ``t`` of a span ``dur`` long that overlaps none of the sorted ``busy`` spans."""
    i = bisect.bisect_right(busy, (t, math.inf)) - 1
    if i >= 0 and busy[i][1] > t:
        t = busy[i][1]
    for b0, b1 in busy[i + 1 if i >= 0 else 0:]:
        if b1 <= t:
            continue
        if b0 >= t + dur:
            break
        t = max(t, b1)
    return t


def _cost_lookup(action_costs: ActionCosts, leaf_cost: Mapping[ActionType, float]) -> Callable[[Action], float]:
    """``action -> cost`` from ``(stage, type, microbatch or None) -> cost`` (ValueError on a bad entry)."""
    by_type = {t.value: t for t in (_F, _B, _I, _W)}
    table: dict[tuple[int, ActionType, int | None], float] = {}
    for (st, typ, mb), v in action_costs.items():
        if typ not in by_type or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"action cost {(st, typ, mb)!r} = {v!r}: needs a type F, B, I or W and a finite cost >= 0")
        table[(st, by_type[typ], mb)] = float(v)

    def cost_of(leaf: Action) -> float:
        v = table.get((leaf.stage, leaf.type, leaf.microbatch))
        if v is None:
            v = table.get((leaf.stage, leaf.type, None))
        return leaf_cost[leaf.type] if v is None else v

    return cost_of


def _describe_wait(key: int | None, n: int, m_count: int) -> str:
    if key is None or not m_count:
        return "nothing it can name"
    kind, k = divmod(key, n)
    s, m = divmod(k, m_count)
    return _WAIT_TEXT[kind].format(s=s, m=m)



class _Bg:
    """A backward in flight on a rank's second host lane (``host_overlap_backward``)."""

    __slots__ = ("action", "ddur", "ds", "h0", "hend", "inter", "left", "queued", "sends", "sfree0", "start", "t")

    def __init__(self, action: Action, left: float, h0: float, start: float, ddur: float) -> None:
        self.action = action
        self.left = left  # host launch work not done yet (time units at full speed)
        self.t = h0  # the time up to which ``left`` is accounted
        self.h0 = h0  # launch start
        self.start = start  # its inputs landed (device)
        self.ddur = ddur
        self.hend: float | None = None  # launch end, once known
        self.ds = h0  # device start (one stream: the device queue it joins)
        self.sfree0 = 0.0  # its stage's stream free (streams)
        self.inter = 0.0  # device time of forwards whose kernels queue among its own (launched before its last)
        self.sends: list[tuple[int, Action]] = []  # its sends, posted when its launch is over
        self.queued: list[tuple[float, float]] = []  # those on its stream: (launch start, device end)

