"""``pipeloom schedule tune``: which configuration to run next, ranked by simulated step time.

The problem: a pipeline's step time depends on the schedule, the number of
microbatches and the stages per rank in ways that textbook bubble formulas
get wrong once the runtime's own time per action, transfer latency and stage
imbalance are real -- and trying every configuration on the cluster costs a
job per point.  A recorded run already measured the costs that matter (see
:mod:`pipeloom.tools.run_costs`); the simulator turns them into a step time
for any configuration in microseconds.

How a recorded run's costs are carried to another configuration (same
ranks, same global batch), and why each rule (measured on the CPU benchmark,
``benchmarks/tune_accuracy.py``, where the first version of this tuner was
off by -65% .. +430%):

* **compute** is ``fixed + per_byte x microbatch bytes`` per stage and type
  (:attr:`RunCosts.compute_fit`).  Scaling it with the microbatch size
  (``m0 / m``) assumed no fixed part, but a forward of 8 rows cost 0.57 of
  one of 32 rows on CPU, not 0.25 (kernel launches, autograd, the stage
  executor): more microbatches looked free.  The fit needs a profile with
  two microbatch sizes (steps alternating the full and the half batch, which
  pipeloom runs at the same microbatch count); with one size, compute is
  taken as proportional and the output says so;
* **stages**: the model is the sequence of the recorded stages; a candidate
  stage costs the part of the model it holds (with :class:`Layers`, the sum
  of its layers' shares, so an end stage with an embedding or a head stays
  heavy, and the split itself can be searched: :func:`search_split`);
* **types**: a split backward where the run had B: ``I = I_SHARE x B`` (the
  first stage, which needs no input gradient, ``FIRST_I_SHARE``), ``W`` the
  rest; the run's own share where it ran I and W;
* **runtime time per action** (the dispatcher, waking up; measured per rank)
  and **one send's blocking time** are per action and per send, whatever the
  payload: they do not scale (the send did not grow from 16 to 64 KiB);
* **transfers** take the link's own time, ``latency + bytes x time per
  byte``, fitted on the transfers that landed while the receiver *waited*
  for them (:attr:`RunCosts.link_latency_ns`).  The mean over all transfers
  also counts the time data sat at a busy receiver, which depends on the
  schedule (1-2 ms for 1F1B, 5-16 ms for LoopedBFS on the same machine), so
  it fits the recorded run and nothing else;
* **OVERLAP_F_B** takes its measured overlap, or sequential halves where the
  run had none (``UNMEASURED_OVERLAP``; measured 0.72-0.93 on CPU); on a GPU
  profile the pair pays the runtime's time per action once, not once per half;
* **host and device apart (GPUs)**: the host only launches an action and runs
  ahead of the device (``runtime/device.py``), and one traced run cannot
  show both sides: with a device sync per action (``check_finite``) the
  spans hold host and device serialised, without them only the launch.  A
  GPU profile is recorded both ways
  (:func:`~pipeloom.tools.run_costs.with_host_costs`) and each action costs
  the longer of its host path (launch + runtime + sends) and its device time;
  the step times (and the runtime's time per action) are the unsynced run's,
  which is why the calibration no longer has to absorb the syncs (x0.73 on
  2 x H100 with the synced profile alone);
* **the host's time per action, from the stage's own layers** (GPU
  profiles, with a layer model): fitted over the recorded stages when they
  hold different numbers of layers as ``fixed + sum of the layers' units``
  (:func:`host_fit`: blocks one unit, an embedding and a head their own), and
  a candidate action's host time is its fixed part once plus its own layers'
  units, so that twice the stages per rank means twice the fixed host work
  (V schedules were predicted 20-34% too fast on a host-bound GPU run when
  the fixed part moved with the layers) and a block moved to a stage adds a
  block's launch time to each of its actions, whatever recorded stage (or
  rank) it came from; the device side is shared by FLOPs
  (:func:`stage_compute`);
* **device times as the runtime learns them** (GPU traces whose runtime slept its learning steps,
  :func:`gpu_profile_costs`): each stage and type's least CUDA-event time, its compute alone, not the mean,
  which on a host-bound rank is the host's pace and for a backward launched beside a forward holds the
  forward's kernels (:func:`learned_device_costs`); the runtime's auto rule for ``host_overlap_backward``
  decides on the same times, so the tuner's does too.  The host's forwards are those launched alone: beside a
  backward a forward's span holds the contention the two-lane model adds (:func:`alone_host_costs`);
* **a split backward measured** where the profile had one
  (:func:`~pipeloom.tools.run_costs.merge_types`: a second profile run of a
  zero-bubble schedule): on the host pipeloom's I plans the weight work and W
  replays it, so I + W is not B;
* **calibration**: every simulated step time is multiplied by the recorded
  configuration's measured (median) over simulated step time
  (:func:`calibration`), so the tuner reproduces the run it was given and
  carries the rest of what the model misses as a ratio;
* **activation memory** at peak is the simulated peak of live
  microbatch-stages times the memory of one, scaled by ``m0 / m`` and
  ``v0 / v`` (a smaller stage holds fewer layers' activations); the memory of
  one recorded microbatch-stage is ``--activation-memory`` or, failing that,
  the stage-boundary activation size (a lower bound, said in the output).

Candidates the schedule rejects (too few microbatches for the ranks...) are
skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pipeloom.schedules import (
    SCHEDULE_NAMES,
    ActionType,
    Costs,
    ScheduleError,
    default_stages_per_rank,
    generate,
    lower,
    simulate,
)

from ..schedules.dataflow import consumer_stage
from ..schedules.dispatch import stage_streams as resolve_streams
from ..schedules.simulate import OVERLAP_CONTENTION as _SIM_OVERLAP_CONTENTION
from .run_costs import RunCosts

__all__ = ["TIE", "Candidate", "HostFit", "Layers", "TuneResult", "alone_host_costs", "calibration", "commit_horizon",
           "fixed_per_action", "format_tune", "gpu_profile_costs", "host_fit", "learned_device_costs", "learned_sleeps",
           "near_ties", "parse_size", "rank_candidates", "sampled_runs", "search_split", "stage_compute", "tune"]


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
    split: tuple[int, ...] | None = None
    """Layers per stage (with a layer model; else None: the recorded stages' costs divided evenly)."""
    searched: bool = False
    """``split`` is the layer split search's, not the even one."""
    overlapped_backwards: int = 0
    """Backwards (B) the simulation launched beside the forward after them in a step, over all ranks
    (``host_overlap_backward``: the runtime's auto rule on the profile's host and device costs; GPU profiles)."""
    backwards: int = 0
    """Backwards (B) in a step, over all ranks (of which ``overlapped_backwards``)."""

    def to_json(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "microbatches": self.microbatches, "stages_per_rank": self.stages_per_rank,
                "step_ns": self.step_ns, "bubble_fraction": self.bubble, "peak_live_microbatch_stages": self.peak_live,
                "peak_activation_bytes": self.peak_activation_bytes, "fits": self.fits,
                "split": list(self.split) if self.split is not None else None, "searched": self.searched,
                "overlapped_backwards": self.overlapped_backwards, "backwards": self.backwards}


@dataclass(frozen=True)
class TuneResult:
    candidates: tuple[Candidate, ...]
    """Every simulated candidate as :func:`rank_candidates` orders them: fastest first, except that a predicted
    tie at the head is ordered by the even split and memory (those over the memory cap last, ``fits`` False)."""
    skipped: tuple[str, ...]
    recorded: Candidate | None
    """The run's own configuration, simulated."""
    measured_step_ns: float
    memory_cap: int | None
    activation_memory: int
    activation_memory_is_proxy: bool
    calibration: float = 1.0
    """Factor applied to every simulated step time (:func:`calibration`)."""
    sizes_fitted: bool = False
    """The run had two microbatch sizes, so compute was carried as fixed + per-byte (else proportional)."""
    host_fixed_ns: dict[str, float] | None = None
    """Host time per action whatever its layers, by type (:func:`fixed_per_action`, at the recorded microbatch size);
    None where the profile could not separate it (its stages hold the same layers, or no layer model)."""
    host_units_ns: dict[str, dict[str, float]] | None = None
    """With ``host_fixed_ns``: the whole host fit by type, ``{"fixed": ns, "layer": ns per layer, "start": ...,
    "end": ...}`` (:meth:`HostFit.describe`)."""
    host_separate: bool = False
    """The profile had a host side recorded apart from the device side (``RunCosts.host``)."""
    device_model: str | None = None
    """With a host side: how host and device made a step (:data:`DEVICE_MODELS`)."""
    device_events: bool = False
    """With a host side: the device times were measured with CUDA events (the trace's ``device`` events), not
    taken from spans synchronised per action."""
    overlap_backward: bool | str | None = None
    """With the two-lane model: the runtime's ``host_overlap_backward`` the candidates were simulated with
    (``"auto"``: its default; None where it does not apply: CPU profiles, ``max``)."""

    @property
    def device_source(self) -> str:
        return ("device times from CUDA events" if self.device_events else
                "a run without and one with device syncs")

    def to_json(self) -> dict[str, Any]:
        return {"candidates": [c.to_json() for c in self.candidates], "skipped": list(self.skipped),
                "recorded": self.recorded.to_json() if self.recorded else None, "measured_step_ns": self.measured_step_ns,
                "memory_cap": self.memory_cap, "activation_memory": self.activation_memory,
                "activation_memory_is_proxy": self.activation_memory_is_proxy, "calibration": self.calibration,
                "sizes_fitted": self.sizes_fitted, "host_fixed_ns": self.host_fixed_ns, "host_units_ns": self.host_units_ns,
                "host_separate": self.host_separate,
                "device_model": self.device_model, "device_events": self.device_events,
                "overlap_backward": self.overlap_backward}


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


I_SHARE = 0.35
"""Share of a full backward that ``I`` takes where the run measured no split backward (W the rest):
pipeloom's W replays the parameter side of the graph, measured at 0.32-0.42 of ``I + W`` on Linear stacks
on CPU.  The first stage needs no input gradient: there ``I`` is ``FIRST_I_SHARE`` of the backward."""
FIRST_I_SHARE = 0.05
UNMEASURED_DEVICE_OVERLAP = 1.0
"""``Costs.overlap`` of an unmeasured OVERLAP_F_B on the device lane (two-lane model): its halves' kernels on two
streams share the SMs; taken as one after the other until measured."""
SAMPLES = 15
"""CPU profiles: each candidate is simulated this many times with every action's cost drawn from its type's
recorded dispersion (``RunCosts.dispersion``), and its step is the median of those makespans.

Why: a pipeline step is a network of waits, and the expected length of a network whose durations vary is longer
than the network of their means (a rank waits for the *later* of two things: E[max] >= max of E).  Checked on the
recorded runs of ``benchmarks/sim_accuracy.py`` (2 gloo ranks on a loaded 2-core machine, actions 0.3-3x their
mean): with mean costs every schedule was simulated 3-15% under its own measured mean step, most where a rank
waits on the other most often (two stages per rank: -9..-15%); drawing the durations halved that (-0.5..-9%).
On GPU profiles (a host side recorded apart) the means are used: their actions hardly vary."""
COMMIT_MS = 10.0
"""How far the runtime commits ahead of the device, at least, in ms of queued device time: ``gpu_commit_ms``'s default."""
COMMIT_LAUNCHES = 3.0
"""``gpu_commit_launches``'s default: the runtime's horizon also covers this many host launches of the slowest action
type (:func:`commit_horizon`)."""
COMMIT_CAP_MS = 250.0
"""The runtime's cap on that horizon (``runtime/device.py``)."""


def commit_horizon(min_ms: float, launches: float, host_ms: float, max_ms: float = COMMIT_CAP_MS) -> float:
    """The runtime's commit horizon (ms), as ``runtime/device.py``'s ``commit_horizon`` computes it once the host's
    launch times are learned: ``min_ms`` (``gpu_commit_ms``), or ``launches`` x ``host_ms`` (the slowest action
    type's mean launch time, its sends included) if more, at most ``max(max_ms, min_ms)``.  Written out here so
    that the tuner does not import torch; a test holds the two equal."""
    if launches <= 0 or host_ms <= 0:
        return min_ms
    return min(max(min_ms, launches * host_ms), max(max_ms, min_ms))
DEVICE_MODELS = ("lanes", "max")
"""How a GPU profile's host and device sides make a step (profiles recorded with a host side, ``RunCosts.host``):

* ``lanes`` (default): each rank's host launches its list in order, committing ahead of the device by at most
  the runtime's horizon of queued device work (:func:`commit_horizon`: 10 ms, or 3 launches of the slowest action
  type if more), and its device runs each action once launched and its inputs have landed, each stage's actions in
  launch order on the stage's own stream where the runtime gives each stage one (``overlap_streams`` auto:
  lists with OVERLAP_F_B or W actions, ``schedules.dispatch.stage_streams``; expert parallelism is not modelled),
  a ready one of one stage in a gap while another stage's input is late (``simulate(device_streams=True)``), one
  stream for the rank elsewhere (:func:`~pipeloom.schedules.simulate`'s ``device_costs``), as ``runtime/device.py``
  does; with static
  shapes no host waits for another's.  Host work of one action overlaps the device work of the ones before;
* ``max``: one lane per rank, each action the longer of its host path and its device time (the model before):
  the sum of per-action maxima, which over-predicts wherever the host is the slower side for some actions and
  the device for others, and puts the pipeline's cross-rank waits on the host.

CPU profiles have no host side: one lane, an action is its work."""
OVERLAP_BACKWARD = "auto"
"""How the two-lane model (``device_model`` ``lanes``) launches a full backward followed by a forward: as the runtime
does by default (``RuntimeOptions.host_overlap_backward`` None, "auto"), on a second host lane beside the forwards
after it where :func:`~pipeloom.schedules.dispatch.backward_overlap_pays` says so for the pair (always for two stages
on two streams; on one stream where the B's host launch outlasts the B's and the F's device times by ``OVERLAP_MARGIN``), judged on the
candidate's own host and device costs, plus the host-heavy pairs the runtime's trial keeps beside (``host_overlap_trial``:
``simulate(overlap_trial=True)`` tries them and keeps them where the step gets 3% shorter); each host lane :data:`~pipeloom.schedules.simulate.OVERLAP_CONTENTION` times
slower while both launch (``simulate(host_overlap_backward=...)``).  Without it the model predicted the inline step
on host-bound GPU configurations: ~25% too slow once the runtime overlapped (session J: 2 x H100, GPT size s, 1F1B
x0.78, Interleaved1F1B x0.75 of the inline step; ``benchmarks/host_overlap_sim.py``)."""
OVERLAP_CONTENTION = _SIM_OVERLAP_CONTENTION
"""The contention of the two host lanes the tuner simulates with (fitted on session J's GPU rows:
``benchmarks/host_overlap_sim.py``)."""
UNMEASURED_OVERLAP = 1.0
"""``Costs.overlap`` where the run had no OVERLAP_F_B to measure: its halves one after the other (measured
0.72-0.93 on CPU, where one thread runs both)."""


def _split_backward(b: float, first: bool) -> tuple[float, float]:
    i = b * (FIRST_I_SHARE if first else I_SHARE)
    return i, b - i


def _stage_types(run: RunCosts, stage: int, nbytes: float) -> dict[str, float]:
    """A recorded stage's compute per type for microbatches of ``nbytes`` activation bytes."""
    c = {}
    for t in ("F", "B", "I", "W"):
        fit = run.compute_fit.get((stage, t))
        if fit is None and (stage, t) in run.compute_ns:
            fit = (0.0, run.compute_ns[(stage, t)] / run.ref_bytes) if run.ref_bytes else (run.compute_ns[(stage, t)], 0.0)
        if fit is not None:
            c[t] = fit[0] + fit[1] * nbytes
    if "B" not in c and "I" in c and "W" in c:
        c["B"] = c["I"] + c["W"]
    if "F" not in c:
        c["F"] = c.get("B", 0.0) / 2
    c.setdefault("B", 2 * c["F"])
    return c


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


@dataclass(frozen=True)
class Layers:
    """The model as a sequence of layers the stage function can split anywhere (``split_by_fqn``, a layer list).

    ``weights``: the relative cost of each layer, in model order (an embedding, blocks, a head; e.g. their
    FLOPs per token, or all 1); ``recorded``: how many layers each stage of the recorded run held.  A
    recorded stage's measured cost is shared among its layers in proportion to their weights, which is what
    lets the tuner move a boundary: with equal weights, a recorded end stage that was slower than the others
    puts its extra cost on its own layers, so a split that gives that stage fewer layers is simulated right.
    """

    weights: tuple[float, ...]
    recorded: tuple[int, ...]
    ends: tuple[int, int] = (0, 0)
    """Layers at the start and at the end that the even split leaves out and gives to the first and the
    last stage (an embedding, a head): the even split is the rest's."""

    def __post_init__(self) -> None:
        if not self.weights or any(not (w >= 0) for w in self.weights):
            raise ValueError(f"layer weights must be numbers >= 0, one per layer (got {list(self.weights)})")
        if sum(self.recorded) != len(self.weights) or any(c < 1 for c in self.recorded):
            raise ValueError(f"the recorded split {list(self.recorded)} must give every recorded stage at least one "
                             f"layer and add up to the {len(self.weights)} layers")

    def even_split(self, num_stages: int) -> tuple[int, ...]:
        """The layers between ``ends`` split as evenly as possible (earlier stages take the remainder), plus the
        ends on the first and last stage."""
        out = list(Layers.even(len(self.weights) - sum(self.ends), num_stages))
        out[0] += self.ends[0]
        out[-1] += self.ends[1]
        return tuple(out)

    @staticmethod
    def even(num_layers: int, num_stages: int) -> tuple[int, ...]:
        """``num_layers`` split as evenly as possible, the earlier stages taking the remainder."""
        if num_layers < num_stages:
            raise ValueError(f"{num_layers} layers cannot fill {num_stages} stages")
        q, r = divmod(num_layers, num_stages)
        return tuple(q + (1 if i < r else 0) for i in range(num_stages))


def stage_compute(run: RunCosts, n: int, nbytes: float, bounds: Sequence[float] | None = None, *,
                  layers: Layers | None = None, split: Sequence[int] | None = None) -> list[dict[str, float]]:
    """Compute per type of ``n`` candidate stages for microbatches of ``nbytes`` bytes.

    With ``layers``, candidate stage ``j`` holds ``split[j]`` layers (default: the even split) and costs the
    sum of its layers' shares (see :class:`Layers`).  Without, the model is the sequence of the recorded
    stages, each spread evenly over its share of the model, and candidate stage ``j`` covers
    ``[bounds[j], bounds[j+1])`` of it (default: ``j/n .. (j+1)/n``), so an expensive recorded end stage
    (embedding, head) stays expensive in the candidate stage that holds that end.  ``B`` is split into
    ``I`` and ``W`` with the run's measured share where it ran a split backward, else :data:`I_SHARE`
    (:data:`FIRST_I_SHARE` on the first stage).
    """
    stages0 = sorted({s for s, _ in run.compute_ns})
    n0 = len(stages0)
    rec = [_stage_types(run, s, nbytes) for s in stages0]
    shares = [rec[k]["I"] / rec[k]["B"] for k in range(1, n0) if "I" in rec[k] and rec[k]["B"] > 0]
    share = sum(shares) / len(shares) if shares else I_SHARE
    first_share = rec[0]["I"] / rec[0]["B"] if n0 and "I" in rec[0] and rec[0]["B"] > 0 else FIRST_I_SHARE
    # I and W carried as measured where the run had both B and a split backward (profiles of two schedules,
    # :func:`~pipeloom.tools.run_costs.merge_types`): a split backward need not cost what a full one does
    # (on the host, I also plans the weight work and W replays it)
    types = ("F", "B", "I", "W") if all((s, t) in run.compute_ns for s in stages0 for t in ("B", "I", "W")) else ("F", "B")
    if layers is not None:
        if len(layers.recorded) != n0:
            raise ValueError(f"the recorded split {list(layers.recorded)} has {len(layers.recorded)} stages, the run {n0}")
        unit: list[tuple[float, float]] = []
        first = 0
        for k, cnt in enumerate(layers.recorded):
            w = list(layers.weights[first:first + cnt])
            if not sum(w):
                w = [1.0] * cnt  # a stage of weightless layers: its cost shared evenly
            unit += [{t: rec[k][t] * x / sum(w) for t in types} for x in w]
            first += cnt
        counts = list(split) if split is not None else list(layers.even_split(n))
        if len(counts) != n or sum(counts) != len(unit) or min(counts) < 1:
            raise ValueError(f"split {counts}: needs {n} stages of at least one layer adding up to {len(unit)}")
        per_stage = []
        first = 0
        for cnt in counts:
            per_stage.append({t: sum(u[t] for u in unit[first:first + cnt]) for t in types})
            first += cnt
    else:
        b = list(bounds) if bounds is not None else [j / n for j in range(n + 1)]
        per_stage = []
        for j in range(n):
            c = dict.fromkeys(types, 0.0)
            for k in range(n0):
                f = _overlap(b[j], b[j + 1], k / n0, (k + 1) / n0) * n0
                if f:
                    for t in types:
                        c[t] += f * rec[k][t]
            per_stage.append(c)
    if "I" not in types:
        for j, c in enumerate(per_stage):
            c["I"] = c["B"] * (first_share if j == 0 else share)
            c["W"] = c["B"] - c["I"]
    return per_stage


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """``x`` minimising ``|rows x - ys|`` (normal equations, Gaussian elimination); None when the columns are
    not independent (the recorded stages cannot tell the unknowns apart)."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] + [sum(r[i] * y for r, y in zip(rows, ys))] for i in range(k)]
    scale = max((abs(a[i][i]) for i in range(k)), default=0.0) or 1.0
    for c in range(k):
        piv = max(range(c, k), key=lambda i: abs(a[i][c]))
        if abs(a[piv][c]) <= 1e-9 * scale:
            return None
        a[c], a[piv] = a[piv], a[c]
        for i in range(k):
            if i != c and a[i][c]:
                f = a[i][c] / a[c][c]
                a[i] = [x - f * y for x, y in zip(a[i], a[c])]
    return [a[i][k] / a[i][i] for i in range(k)]


@dataclass(frozen=True)
class HostFit:
    """The host's time per action as a property of the runtime and the model (:func:`host_fit`): by type,
    ``fixed + sum over the stage's layers of unit[class]`` (ns, at one microbatch size), layers of equal weight
    forming a class (blocks; an embedding; a head)."""

    fixed: dict[str, float]
    """type -> the runtime's own time per action (executor, autograd's engine, stream waits), whatever its layers."""
    units: dict[str, tuple[float, ...]]
    """type -> host time per layer of each class (0 for a class the fit found free or could not see)."""
    classes: tuple[float, ...]
    """The weight of each class's layers (``Layers.weights``), in increasing order."""
    layer_class: tuple[int, ...]
    """The class of every layer, in model order."""
    first: dict[str, tuple[float, tuple[float, ...]]]
    """I and W of the recorded first stage (no input gradient: not the same work as elsewhere, left out of their
    fits): (its measured host time, its layers per class); a candidate first stage is that plus the units of the
    layers it holds more (or less)."""
    split_from_b: bool = False
    """The run recorded no split backward: I and W are shares of B above its fixed part (:data:`I_SHARE`,
    :data:`FIRST_I_SHARE`), each paying the fixed part."""
    speed: dict[int, float] = field(default_factory=dict)
    """rank -> its host's time for the same work relative to the lowest rank's (``host_fit(rank_speed=True)``;
    empty: all alike); :meth:`time` multiplies by it."""

    def counts(self, first: int, count: int) -> list[float]:
        """Layers per class of a stage holding layers ``first .. first + count - 1``."""
        row = [0.0] * len(self.classes)
        for li in range(first, first + count):
            row[self.layer_class[li]] += 1
        return row

    def time(self, t: str, row: Sequence[float], *, first_stage: bool = False, rank: int | None = None) -> float:
        """Host time of an action of type ``t`` (fitted: see :attr:`fixed`) of a stage with ``row`` layers per class
        (on ``rank``: times its :attr:`speed`)."""
        return self._time(t, row, first_stage) * (self.speed.get(rank, 1.0) if rank is not None else 1.0)

    def _time(self, t: str, row: Sequence[float], first_stage: bool) -> float:
        if t in ("I", "W") and self.split_from_b:  # never recorded: a share of B's time above its fixed part
            share = FIRST_I_SHARE if first_stage else I_SHARE
            share = share if t == "I" else 1 - share
            return self.fixed["B"] + share * max(0.0, self._time("B", row, False) - self.fixed["B"])
        if first_stage and t in self.first:
            ref, ref_row = self.first[t]
            return max(0.0, ref + sum((c - c0) * u for c, c0, u in zip(row, ref_row, self.units[t])))
        return self.fixed[t] + sum(c * u for c, u in zip(row, self.units[t]))

    def describe(self, layers: Layers) -> dict[str, dict[str, float]]:
        """type -> {"fixed": ns, "<class name>": ns per layer} (class names: "start" for the layers that only the
        first stage holds (``Layers.ends``), "end" for the last's, "layer" (or "layer wN") for the rest)."""
        n = len(self.layer_class)
        start = set(range(layers.ends[0]))
        end = set(range(n - layers.ends[1], n))
        names = []
        mids = [c for c in range(len(self.classes))
                if not {li for li in range(n) if self.layer_class[li] == c} <= (start | end)]
        for c in range(len(self.classes)):
            members = {li for li in range(n) if self.layer_class[li] == c}
            if members <= start:
                names.append("start")
            elif members <= end:
                names.append("end")
            else:
                names.append("layer" if len(mids) == 1 else f"layer w{self.classes[c]:g}")
        return {t: {"fixed": self.fixed[t], **{names[c]: u for c, u in enumerate(self.units[t])}} for t in self.fixed}


def _nonneg_fit(rows: list[list[float]], ys: list[float]) -> tuple[float, list[float]] | None:
    """``ys ~ fixed + rows . units`` by least squares with every part >= 0 (exact: the best fit over the subsets of
    parts left free, the others at 0); None where the rows cannot tell the parts apart (the unconstrained system is
    singular).  A class whose unit would come out negative costs nothing; a negative fixed part is none.

    (Dropping every negative part at once and refitting, what this did before, can end at a worse fit than the
    best non-negative one when two parts trade off; with at most a few classes the subsets are few.)"""
    k = len(rows[0]) if rows else 0
    seen = [c for c in range(k) if any(r[c] for r in rows)]
    if not rows or _least_squares([[1.0] + [r[c] for c in seen] for r in rows], ys) is None:
        return None
    best: tuple[float, float, list[float]] | None = None
    n = len(seen) + 1  # the fixed part, then the classes seen
    for mask in range(1, 1 << n):
        use = [j for j in range(n) if mask >> j & 1]
        mat = [[1.0 if j == 0 else r[seen[j - 1]] for j in use] for r in rows]
        sol = _least_squares(mat, ys)
        if sol is None or any(x < 0 for x in sol):
            continue
        res = sum((sum(m * x for m, x in zip(row, sol)) - y) ** 2 for row, y in zip(mat, ys))
        fixed = sol[0] if use[0] == 0 else 0.0
        units = [0.0] * k
        for j, x in zip(use, sol):
            if j:
                units[seen[j - 1]] = x
        # the least residual (among equal ones, within rounding, the first found: the fewest parts)
        if best is None or res < best[0] * (1 - 1e-9) - 1e-12:
            best = (res, fixed, units)
    return None if best is None else (best[1], best[2])


def host_fit(run: RunCosts, layers: Layers, nbytes: float, *, rank_speed: bool = False) -> HostFit | None:
    """The host's time per action as ``fixed + sum over the stage's layers of unit[class]``, by type (ns, at
    microbatches of ``nbytes``), fitted by least squares over the recorded stages of the run's host side
    (``run.host`` on GPUs, else the run itself); None where the recorded stages cannot tell the parts apart.

    Why: on a host-bound GPU job an action's host time is the runtime's own work per action (the stage executor,
    autograd's engine, stream waits) plus launching each of its layers' kernels from Python and autograd's
    engine: it grows with the layers the stage holds, by what each layer *launches*, not by its FLOPs (a
    vocabulary head is cheap to launch and expensive to run).  Sharing a recorded stage's time among its layers
    by FLOPs (what :func:`stage_compute` does, right for the device) moves the fixed part with the layers (halve
    the layers per stage and it halves, when each of twice as many actions pays it in full: two stages per rank
    were predicted 20-34% too fast on 2 x H100) and puts a head's launch time on the blocks beside it.  A
    candidate stage's host time is then a function of its own layers alone (:meth:`HostFit.time`), whatever
    recorded stage they came from.

    Layers of equal weight form a class; identifying ``fixed`` and a unit per class needs stages that hold
    different numbers of layers of a class (an uneven split of the profile: 2,1,3,2 blocks on four stages, or
    3,5 on two) -- an embedding and a head, each on one end stage only, are their own terms, fitted on their
    stage.  The first stage's I and W are left out of their fits (no input gradient: not the same work as
    elsewhere) and carried from the recorded first stage by unit differences.  A type the run did not record
    takes the fixed part of the one it is split from or merged into (I and W: B's, each sharing B's units as
    :data:`I_SHARE` does; B: the larger of I's and W's fixed parts, their units summed).  Negative parts are
    none (:func:`_nonneg_fit`).

    ``rank_speed``: also a host speed per rank (:attr:`HostFit.speed`), fitted where the same stages were recorded
    on different ranks (the run and the ``others`` of :func:`~pipeloom.tools.run_costs.merge_types`: Interleaved1F1B
    puts blocks 2,1,3,2 on ranks 0,1,0,1, ZBVZeroBubble on 0,1,1,0), and the units fitted on the times divided by
    their rank's speed, with every type's rows of every run.  Why it may matter: the units come from stages
    recorded on different ranks, so a rank whose host is slower for the same work biases them (a rank-1 host
    slower by d per action puts 1.5 d into the fixed part and takes d/2 from each block's unit with blocks
    2,1,3,2 on ranks 0,1,0,1: every stage of more blocks is then predicted too cheap).  Not the default: not yet
    checked on GPUs (``benchmarks/tune_grid.py``'s variant ``lanes-rankspeed``).

    The tuner applies it to GPU profiles only (a host side recorded apart, ``run.host``).  On the CPU
    benchmark (``benchmarks/tune_accuracy.py --profile 1F1B:8:3,5``: 2 gloo ranks on a shared 2-core
    machine) the two stages' difference held the ranks' different speeds more than any fixed part (F: none,
    B: 2.4-5.5 ms of a 21 ms action, varying by round), and the paired errors grew from a median of 4.7% to
    11.4% on the same traces; a CPU action is mostly its compute, and two ranks of one busy machine do not
    run alike.
    """
    src = run.host or run
    stages0 = sorted({s for s, _ in src.compute_ns})
    if len(layers.recorded) != len(stages0):
        return None
    weights = layers.weights
    classes = sorted({round(w, 9) for w in weights})
    cls = tuple(classes.index(round(w, 9)) for w in weights)
    empty = HostFit({}, {}, tuple(classes), cls, {})
    counts: list[list[float]] = []
    first = 0
    for cnt in layers.recorded:
        counts.append(empty.counts(first, cnt))
        first += cnt
    types = [t for t in ("F", "B", "I", "W") if all((s, t) in src.compute_ns for s in stages0)]
    if "F" not in types or not ("B" in types or ("I" in types and "W" in types)):
        return None

    def measured(rc: RunCosts, k: int, t: str) -> float:
        fit = rc.compute_fit.get((stages0[k], t))
        return fit[0] + fit[1] * nbytes if fit is not None else rc.compute_ns[(stages0[k], t)]

    def left_out(t: str) -> bool:
        return t in ("I", "W") and len(stages0) > 1

    # the rows of each type's fit: (layers per class, measured time, rank); with rank_speed also the other runs of
    # the same stages (merge_types: another schedule, other ranks), each type where it was measured
    sources: list[tuple[RunCosts, tuple[str, ...]]] = [(src, ())]
    if rank_speed and src.others:
        sources = [(src, src.borrowed)] + [(o, ()) for o in src.others]
    rows: dict[str, list[tuple[list[float], float, int]]] = {}
    for rc, skip in sources:
        place = list(rc.stage_to_rank)
        for t in ("F", "B", "I", "W"):
            if t in skip or not all((s, t) in rc.compute_ns for s in stages0):
                continue
            for k in range(len(stages0)):
                if not (left_out(t) and k == 0):
                    rows.setdefault(t, []).append((counts[k], measured(rc, k, t), place[stages0[k]] if stages0[k] < len(place) else 0))
    speed = _rank_speeds(rows.get("F", []), counts) if rank_speed else {}

    def sp(r: int) -> float:
        return speed.get(r, 1.0)

    fixed: dict[str, float] = {}
    units: dict[str, tuple[float, ...]] = {}
    first_ref: dict[str, tuple[float, tuple[float, ...]]] = {}
    for t in types:
        sol = _nonneg_fit([c for c, _, _ in rows[t]], [y / sp(r) for _, y, r in rows[t]])
        if sol is None:
            return None
        fixed[t], units[t] = sol[0], tuple(sol[1])
        if left_out(t):
            first_ref[t] = (measured(src, 0, t) / sp(src.stage_to_rank[stages0[0]] if src.stage_to_rank else 0),
                            tuple(counts[0]))
    if "B" not in fixed:
        fixed["B"] = max(fixed["I"], fixed["W"])
        units["B"] = tuple(a + b for a, b in zip(units["I"], units["W"]))
    derived = "I" not in fixed or "W" not in fixed
    if derived:  # a split backward never recorded: each half pays B's fixed part and a share of the rest
        for t, share in (("I", I_SHARE), ("W", 1 - I_SHARE)):
            fixed[t] = fixed["B"]
            units[t] = tuple(share * u for u in units["B"])
    return HostFit({t: fixed[t] for t in ("F", "B", "I", "W")}, {t: units[t] for t in ("F", "B", "I", "W")},
                   tuple(classes), cls, {} if derived else first_ref, split_from_b=derived, speed=speed)


def _rank_speeds(rows: list[tuple[list[float], float, int]], counts: list[list[float]]) -> dict[int, float]:
    """Each rank's host time relative to the lowest rank's for the same work, from action times of the same
    stages measured on different ranks (``rows``: layers per class, time, rank); {} where no stage's layers were
    measured on two ranks (nothing tells a rank's speed from its layers' cost).  Alternately: fit the units on
    the times divided by their rank's speed, then each rank's speed as the least-squares ratio of its times to
    the fit's."""
    ranks = sorted({r for _, _, r in rows})
    seen: dict[tuple[float, ...], set[int]] = {}
    for c, _, r in rows:
        seen.setdefault(tuple(c), set()).add(r)
    if len(ranks) < 2 or not any(len(v) > 1 for v in seen.values()):
        return {}
    speed = dict.fromkeys(ranks, 1.0)
    for _ in range(50):
        sol = _nonneg_fit([c for c, _, _ in rows], [y / speed[r] for _, y, r in rows])
        if sol is None:
            return {}
        pred = [sol[0] + sum(a * u for a, u in zip(c, sol[1])) for c, _, _ in rows]
        new = {ranks[0]: 1.0}
        for rk in ranks[1:]:
            num = sum(y * q for (_, y, r), q in zip(rows, pred) if r == rk)
            den = sum(q * q for (_, _, r), q in zip(rows, pred) if r == rk)
            new[rk] = num / den if den > 0 and num > 0 else 1.0  # (never 0: times are divided by it)
        done = all(abs(new[r] - speed[r]) < 1e-9 for r in ranks)
        speed = new
        if done:
            break
    return speed


def fixed_per_action(run: RunCosts, layers: Layers, nbytes: float) -> dict[str, float] | None:
    """The host's time per action whatever the layers the action's stage holds, by type (ns, at microbatches of
    ``nbytes``): :attr:`HostFit.fixed` of :func:`host_fit`; None where the recorded stages cannot tell it from
    the layers' time."""
    fit = host_fit(run, layers, nbytes)
    return dict(fit.fixed) if fit is not None else None


def _less_fixed(run: RunCosts, fixed: dict[str, float]) -> RunCosts:
    """``run`` with the host's fixed part per action taken off each action's time: what is left scales with the
    layers and is shared among them by weight (:func:`stage_compute`)."""
    fit = {(s, t): (max(0.0, a - fixed.get(t, 0.0)), b) for (s, t), (a, b) in run.compute_fit.items()}
    ns = {(s, t): max(0.0, c - fixed.get(t, 0.0)) for (s, t), c in run.compute_ns.items()}
    return replace(run, compute_fit=fit, compute_ns=ns)


def _device_side(run: RunCosts, fixed: dict[str, float] | None) -> RunCosts:
    """The device time of a GPU profile's actions: as measured with CUDA events where the trace has them
    (``RunCosts.device_measured``); else the part of its synced spans that grows with the microbatch.

    A span recorded with a device sync per action (``check_finite``) holds the host's launch where the host was
    the slower, the sync itself and the finiteness checks' own launches and kernels; none of these grows with
    the rows, the device's compute does.  Where the profile had one microbatch size (nothing to tell them
    apart), the span less the host's fixed part per action."""
    if run.device_measured:  # CUDA events: device time alone, its fixed part included (nothing to take off)
        return run
    if run.sizes_fitted:
        fit = {k: (0.0, b) for k, (_, b) in run.compute_fit.items()}
        return replace(run, compute_fit=fit, compute_ns={k: b * run.ref_bytes for k, (_, b) in fit.items()})
    return _less_fixed(run, fixed or {})


def _step_bytes(model: Any) -> dict[Any, int]:
    """(step, microbatch) -> that microbatch's size in bytes (its largest forward send, as
    :func:`~pipeloom.tools.run_costs.costs_from_trace` reads it), and step -> its largest microbatch's
    (``torch.tensor_split`` cuts a batch of 10 rows into 3, 3, 2, 2: a step's size alone would label the
    2-row microbatches full-size)."""
    size: dict[Any, int] = {}
    for lst in model.transfers.values():
        for t in lst:
            if t.kind == "send" and t.event.get("kind") == "F":
                b = int(t.event.get("bytes", 0) or 0)
                for k in (t.step, (t.step, t.mb)):
                    if b > size.get(k, 0):
                        size[k] = b
    return size


def learned_sleeps(model: Any) -> bool:
    """Whether a GPU trace's runtime learned its device times with a stream sleep in the learning steps
    (``RuntimeOptions.gpu_learn_sleep``, session K): the trace header carries the run's options (written since
    f47fc70, after the sleeps landed) and they do not turn it off."""
    opts = model.header.get("options")
    return isinstance(opts, dict) and opts.get("device", "cuda") != "cpu" and opts.get("gpu_learn_sleep", True) is not False


def learned_device_costs(model: Any, run: RunCosts) -> RunCosts:
    """The device side of a GPU trace (``run``: ``costs_from_trace(model, device=True)``) as the runtime learns it:
    each stage and type's least device time over the trace's steps (its compute alone), not the mean; ``run``
    unchanged where the trace's runtime did not sleep its learning steps (:func:`learned_sleeps`: then none of a
    host-bound rank's samples is its compute alone) or has no device times.

    Why (``benchmarks/tune_grid.py``, session L, 2 x H200, GPT size s, Interleaved1F1B profile): a CUDA-event pair
    times compute alone only where the kernels were queued before the device reached them; on a host-bound rank
    the device runs each kernel as the host launches it, so the mean device time is the host's pace (stage 2's
    forward 1.83 ms mean, 0.53 ms in the slept learning step), and a backward launched beside the next forward
    on one stream (``host_overlap_backward``) times the forward's kernels too (stage 2's B 3.38 ms mean, 1.37 ms
    slept).  Fed those, the auto rule (:func:`~pipeloom.schedules.dispatch.backward_overlap_pays`: the B's host
    launch against the B's and F's device times) kept every backward inline in every candidate, the profile's
    own configuration included, whose run launched 27-29 of its 32 backwards per rank and step beside a forward
    (the runtime decides on the slept times); the calibration (x0.828) then carried the profile's overlap gain
    to every schedule, V schedules (few or no B followed by an F) 5-18% under, and the device lane ran at the
    host's pace, one-stream schedules 10-30% over.  The two-lane model already holds a device action to its
    launch (it ends no earlier), so the host's pace needs no device time of its own.

    The least is taken per microbatch size over the steps of that size; backwards launched beside a forward
    (``beside``) are left out (their kernels share a stream with the forward's).  A stage and type whose least at
    a smaller size is below its least at the reference size and no less than its proportional share is fitted
    ``fixed + per byte`` through the two; elsewhere (a smaller size's least still at the host's pace: the learning
    steps, the only slept ones, run the full batch) the reference least is split as the median of those fits'
    fixed shares (none: proportional)."""
    if not run.device_measured or not model.device_ns or not learned_sleeps(model):
        return run
    size = _step_bytes(model)
    ref = run.ref_bytes or max(size.values(), default=0)
    if not ref:
        return run
    train = set(model.train_steps)
    least: dict[tuple[int, str], dict[int, float]] = {}  # (stage, type) -> size -> least ns
    for r, lst in model.actions.items():
        for a in lst:
            if a.type not in ("F", "B", "I", "W") or not isinstance(a.stage, int) or a.step not in train:
                continue
            if a.event.get("beside"):
                continue
            ns = model.device_ns.get((r, a.step, a.name))
            if ns is None or ns < 0:
                continue
            b = size.get((a.step, a.mb), size.get(a.step, ref))
            b = ref if b >= 0.95 * ref else b
            by = least.setdefault((a.stage, a.type), {})
            if ns < by.get(b, float("inf")):
                by[b] = float(ns)
    fits: dict[tuple[int, str], tuple[float, float]] = {}
    shares: list[float] = []
    for k, by in least.items():
        if ref not in by:
            continue
        d1 = by[ref]
        for b0, d0 in sorted(by.items()):
            if b0 < ref and d0 < d1 and d0 >= d1 * b0 / ref and d1 > 0:
                slope = (d1 - d0) / (ref - b0)
                fits[k] = (d1 - slope * ref, slope)
                shares.append(fits[k][0] / d1)
                break
    share = sorted(shares)[len(shares) // 2] if shares else 0.0
    compute = dict(run.compute_ns)
    fit = dict(run.compute_fit)
    acts = dict(run.action_costs)
    for k, by in least.items():
        if k not in compute or ref not in by:
            continue
        d1 = by[ref]
        fit[k] = fits.get(k, (share * d1, (1 - share) * d1 / ref))
        if (k[0], k[1], None) in acts:
            acts[(k[0], k[1], None)] += d1 - compute[k]
        compute[k] = d1
    return replace(run, compute_ns=compute, compute_fit=fit, action_costs=acts)


def alone_host_costs(model: Any, run: RunCosts) -> RunCosts:
    """The host side of a GPU trace (``run``: ``costs_from_trace(model)``) with each stage's forward costing its
    launch alone: measured on the forwards whose span no backward launched beside it (``beside``,
    ``host_overlap_backward``) overlaps, where the stage has any at the reference size.  ``run`` unchanged where
    nothing was launched beside.

    Why: the two-lane model slows both host lanes by :data:`OVERLAP_CONTENTION` while a backward and a forward
    launch at once; a forward's span recorded beside a backward already holds that contention (session L,
    Interleaved1F1B, 2 x H200: a stage's forwards 1.16-1.40x as long beside a backward as alone, 78-90 of every
    96 beside one), so measuring the host's forward on them counted it twice.  (The backwards' host costs are
    already the inline ones': :func:`~pipeloom.tools.run_costs.costs_from_trace`.)"""
    from .run_costs import _affine

    spans: dict[int, dict[int, list[tuple[int, int]]]] = {}  # rank -> step -> the beside backwards' spans
    for r, lst in model.actions.items():
        for a in lst:
            if a.event.get("beside"):
                spans.setdefault(r, {}).setdefault(a.step, []).append((a.start, a.end))
    if not spans:
        return run
    size = _step_bytes(model)
    ref = run.ref_bytes
    chosen = set(run.steps)
    full: dict[int, list[int]] = {}
    sized: dict[int, list[tuple[int, int]]] = {}
    for r, lst in model.actions.items():
        by_step = spans.get(r, {})
        for a in lst:
            if a.type != "F" or not isinstance(a.stage, int) or a.step not in chosen:
                continue
            if any(s < a.end and a.start < e for s, e in by_step.get(a.step, ())):
                continue
            b = size.get((a.step, a.mb), size.get(a.step, ref))
            if not ref or b >= 0.95 * ref:
                full.setdefault(a.stage, []).append(a.duration)
            if a.step in size:
                sized.setdefault(a.stage, []).append((b, a.duration))
    compute = dict(run.compute_ns)
    fit = dict(run.compute_fit)
    acts = dict(run.action_costs)
    for s, v in full.items():
        k = (s, "F")
        if k not in compute:
            continue
        mean = sum(v) / len(v)
        old = compute[k]
        got = _affine(sized.get(s, [])) if run.sizes_fitted else None
        if got is None:
            a0, b0 = fit.get(k, (0.0, old / ref if ref else 0.0))
            got = (a0 * mean / old, b0 * mean / old) if old > 0 else (mean, 0.0)
        fit[k] = got
        if (s, "F", None) in acts:
            acts[(s, "F", None)] += mean - old
        compute[k] = mean
    return replace(run, compute_ns=compute, compute_fit=fit, action_costs=acts)


def gpu_profile_costs(model: Any, *, typical: bool = True) -> RunCosts:
    """A GPU trace with device times (CUDA events) as the tuner takes it: both sides from the one run
    (:func:`~pipeloom.tools.run_costs.with_host_costs`), the device side as the runtime learns it
    (:func:`learned_device_costs`), the host's forwards as launched alone (:func:`alone_host_costs`)."""
    from .run_costs import costs_from_trace, with_host_costs

    dev = learned_device_costs(model, costs_from_trace(model, typical=typical, device=True))
    host = alone_host_costs(model, costs_from_trace(model, typical=typical))
    return with_host_costs(dev, host)


def _crosses(place: Sequence[int], s: int, t: str) -> bool:
    """Whether the output of ``t`` on stage ``s`` is sent to another rank."""
    if t not in ("F", "B", "I"):
        return False
    c = consumer_stage("F" if t == "F" else "B", s, len(place))
    return c is not None and place[c] != place[s]


def _action_costs(run: RunCosts, p: int, v: int, m: int, place: Sequence[int] | None = None,
                  bounds: Sequence[float] | None = None, *, layers: Layers | None = None,
                  split: Sequence[int] | None = None, lanes: bool = False, host_units: bool = True,
                  host_rank_speed: bool = False) -> Any:
    """Per-stage action costs of a candidate: compute for its microbatch size (fixed + per-byte part, see
    :func:`stage_compute`), plus the rank's runtime time per action, plus one send's blocking time where
    the output crosses ranks (a fixed cost per send: it did not grow with the payload on CPU).

    With a separate host side (``run.host``: a GPU profile recorded with and without device syncs,
    :func:`~pipeloom.tools.run_costs.with_host_costs`) an action costs the longer of its host path (launch +
    runtime + send) and its device time; there, with ``layers`` and a profile whose stages hold different
    layers, each action pays the host's fixed time per action once (:func:`fixed_per_action`), and only the
    rest is shared by layer weight.  Not on CPUs: see :func:`fixed_per_action`.

    ``lanes`` (with a host side): (host costs, device costs, the slowest launch) apart, for
    :func:`~pipeloom.schedules.simulate`'s ``device_costs`` (the runtime commits ahead: :data:`DEVICE_MODELS`),
    instead of the longer of the two.

    ``host_units`` False (comparisons only, e.g. ``benchmarks/tune_grid.py``'s variants): the host side as it was
    before :func:`host_fit`: the fixed part per action once, the rest of each recorded stage's host time shared
    among its layers by weight."""
    m0 = run.num_microbatches or m
    nbytes = run.ref_bytes * m0 / m
    runtime = run.runtime_per_action_ns or run.overhead_per_action_ns
    mean_rt = sum(runtime.values()) / max(len(runtime), 1)
    sends = run.send_per_transfer_ns
    mean_send = sum(sends.values()) / max(len(sends), 1) if sends else 0.0
    n = p * v
    place = list(place) if place is not None else [s % p for s in range(n)]
    same_ranks = p == run.world_size
    hfit = (host_fit(run, layers, nbytes, rank_speed=host_rank_speed and same_ranks)
            if layers is not None and run.host is not None else None)
    fixed = dict(hfit.fixed) if hfit is not None else None
    host: list[dict[str, float]] | None = None
    if run.host is not None:
        device = stage_compute(_device_side(run, fixed), n, nbytes, bounds, layers=layers, split=split)
        if hfit is not None and fixed is not None and not host_units:
            host = stage_compute(_less_fixed(run.host, fixed), n, nbytes, bounds, layers=layers, split=split)
            for c in host:
                for t in c:
                    c[t] += fixed[t]
        elif hfit is not None and layers is not None:
            # the host time of a candidate stage's action: fixed + its own layers' units (host_fit), whatever
            # recorded stage (and rank) they came from
            host = []
            first = 0
            for j, cnt in enumerate(list(split) if split is not None else list(layers.even_split(n))):
                row = hfit.counts(first, cnt)
                host.append({t: hfit.time(t, row, first_stage=j == 0, rank=place[j]) for t in device[j]})
                first += cnt
        else:
            host = stage_compute(run.host, n, nbytes, bounds, layers=layers, split=split)
    else:
        device = stage_compute(run, n, nbytes, bounds, layers=layers, split=split)
    out: dict[tuple[int, str, int | None], float] = {}
    dev: dict[tuple[int, str, int | None], float] = {}
    launch = 0.0  # the slowest launch (its sends included): what the runtime's commit horizon covers
    for s, c in enumerate(device):
        r = place[s]
        o = runtime.get(r, mean_rt) if same_ranks else mean_rt
        snd = sends.get(r, mean_send) if same_ranks else mean_send
        for t, x in c.items():
            send = snd if _crosses(place, s, t) else 0.0
            extra = o + send
            if host is None:  # CPU: an action is its work
                out[(s, t, None)] = x + extra
            elif lanes:  # GPU, committing ahead: the host's launch path and the device time, each on its lane
                out[(s, t, None)], dev[(s, t, None)] = host[s][t] + extra, x
                launch = max(launch, host[s][t] + send)
            else:  # GPU, one lane: the longer path counts
                out[(s, t, None)] = max(host[s][t] + extra, x)
    return (out, dev, launch) if lanes and host is not None else out


def _link_costs(run: RunCosts, m: int) -> Costs:
    """Transfers of a candidate: the link's measured latency + bytes x time per byte, at its microbatch size."""
    m0 = run.num_microbatches or m
    nbytes = max(1, int(run.ref_bytes * m0 / m))
    if not run.overlap_measured:
        run = replace(run, costs=replace(run.costs, overlap=UNMEASURED_OVERLAP))
    if run.link_latency_ns or run.link_ns_per_byte:
        bw = 1.0 / run.link_ns_per_byte if run.link_ns_per_byte > 0 else None
        return replace(run.costs, send_latency=run.link_latency_ns, bandwidth=bw, activation_bytes=nbytes)
    return replace(run.costs, activation_bytes=nbytes)


def sampled_runs(low: Any, costs: Costs, ac: dict[tuple[int, str, int | None], float],
                 dispersion: dict[str, tuple[float, ...]], m: int, samples: int, *, seed: str) -> list[Any]:
    """``samples`` simulations of ``low`` whose every action (stage, type, microbatch) costs its ``ac`` cost times a
    draw from the recorded dispersion of its type (``RunCosts.dispersion``; :data:`SAMPLES` says why), sorted by
    makespan; seeded by ``seed``, so repeatable."""
    import random
    import zlib

    rng = random.Random(zlib.crc32(seed.encode()))
    fallback = dispersion.get("B") or next(iter(dispersion.values()))
    results = []
    for _ in range(samples):
        drawn: dict[tuple[int, str, int | None], float] = {}
        for (s, t, _), c in ac.items():
            q = dispersion.get(t) or fallback
            for mb in range(m):
                drawn[(s, t, mb)] = c * rng.choice(q)
        results.append(simulate(low, costs, action_costs=drawn))
    results.sort(key=lambda r: r.makespan)
    return results


def _sampled(low: Any, costs: Costs, ac: dict[tuple[int, str, int | None], float], dispersion: dict[str, tuple[float, ...]],
             m: int, samples: int, *, seed: str) -> Any:
    """The simulation of median makespan among :func:`sampled_runs`."""
    runs = sampled_runs(low, costs, ac, dispersion, m, samples, seed=seed)
    return runs[len(runs) // 2]


def _simulate(run: RunCosts, name: str, p: int, v: int, m: int, *, layers: Layers | None = None,
              split: Sequence[int] | None = None, lowered: dict[Any, Any] | None = None,
              device_model: str = "lanes", commit_ns: float = COMMIT_MS * 1e6, commit_launches: float = COMMIT_LAUNCHES,
              samples: int = 0, stage_streams: bool | None = None, host_units: bool = True,
              host_rank_speed: bool = False, overlap_backward: bool | str | None = "auto",
              overlap_margin: float | None = None,
              overlap_pairs: Mapping[int, Collection[tuple[int, int]]] | None = None) -> tuple[Any, Any]:
    """(schedule, simulation) of one candidate with ``run``'s costs carried to it (ScheduleError if rejected).
    ``lowered``: a cache of lowered schedules by (name, p, v, m) (the split changes only the action costs).
    ``host_units`` False: the host side as before :func:`host_fit`'s units (for comparisons: see
    :func:`_action_costs`); ``host_rank_speed``: a host speed per rank (``host_fit(rank_speed=True)``).
    ``overlap_backward``: the runtime's ``host_overlap_backward`` (two-lane model only: a B launched on a second
    host lane beside the forwards after it, :data:`OVERLAP_BACKWARD`); "auto" (its default) decides per pair on
    the candidate's own host and device costs, False or None never, True always; ``overlap_margin``: the rule's
    margin (None: the runtime's, ``dispatch.OVERLAP_MARGIN``; a replay of a run recorded before it: 1.0);
    ``overlap_pairs``: per rank, the (B stage, F stage) pairs a run launched beside, replayed instead of the rule
    (two-lane model only)."""
    costs = _link_costs(run, m)
    key = (name, p, v, m)
    if lowered is not None and key in lowered:
        sched, low = lowered[key]
    else:
        sched = generate(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)
        low = lower(sched, comms=True, recv_placement="early", costs=costs)
        if lowered is not None:
            lowered[key] = (sched, low)
    lanes = device_model == "lanes" and run.host is not None
    ac = _action_costs(run, p, v, m, sched.stage_to_rank, layers=layers, split=split, lanes=lanes, host_units=host_units,
                       host_rank_speed=host_rank_speed)
    if not lanes:
        if run.host is not None and not run.overlap_measured:
            costs = replace(costs, overlap=_pair_overlap(run, ac))
        if samples > 1 and run.host is None and run.dispersion:
            return sched, _sampled(low, costs, ac, run.dispersion, m, samples, seed=f"{name}:{p}:{v}:{m}")
        return sched, simulate(low, costs, action_costs=ac)
    host, dev, launch = ac
    horizon = commit_horizon(commit_ns / 1e6, commit_launches, launch / 1e6) * 1e6
    if not run.overlap_measured:
        # the halves of an OVERLAP_F_B run on two stage streams: concurrent on the device, one after the other
        # on the host (which the two-lane model charges as it is: both launches)
        costs = replace(costs, overlap=UNMEASURED_DEVICE_OVERLAP)
    lat, per_byte = run.device_link_ns if run.device_link_ns is not None else (0.0, 0.0)
    return sched, simulate(low, costs, action_costs=host, device_costs=dev, commit_horizon=horizon,
                           device_transfer=lat + per_byte * costs.activation_bytes,
                           host_overlap=_pair_overlap(run, host),  # the host's time per action paid once per pair
                           device_streams=resolve_streams(stage_streams, [a for row in low.actions.values() for a in row]),
                           host_overlap_backward=overlap_backward or None,
                           overlap_contention=OVERLAP_CONTENTION, overlap_margin=overlap_margin,
                           overlap_pairs=overlap_pairs)


def _pair_overlap(run: RunCosts, ac: dict[tuple[int, str, int | None], float]) -> float:
    """``Costs.overlap`` of an unmeasured OVERLAP_F_B on a GPU profile: its halves one after the other on the host,
    but the runtime's time per action (dispatch, wake-up), in each half's cost, paid once for the pair:
    ``max + overlap x min = both - runtime``, with the mean runtime and the mean of the shorter halves."""
    rt = run.runtime_per_action_ns or run.overhead_per_action_ns
    o = sum(rt.values()) / max(len(rt), 1)
    stages = sorted({s for s, _, _ in ac})
    mins = [min(ac[(s, "F", None)], ac[(s, "B", None)]) for s in stages if (s, "F", None) in ac and (s, "B", None) in ac]
    short = sum(mins) / len(mins) if mins else 0.0
    return max(0.0, 1.0 - o / short) if short > 0 else UNMEASURED_OVERLAP


def calibration(run: RunCosts, *, measured_step_ns: float | None = None, layers: Layers | None = None,
                device_model: str = "lanes", commit_ms: float = COMMIT_MS, commit_launches: float = COMMIT_LAUNCHES,
                samples: int = SAMPLES, overlap_backward: bool | str | None = "auto",
                overlap_margin: float | None = None) -> float:
    """Measured over simulated step time of the run's own configuration, with the costs as carried to
    other configurations (1.0 where it cannot be simulated): what the cost model misses on the
    machine as a whole (contention, the runtime's reordering) is assumed to scale every step alike.
    ``measured_step_ns``: the step time to calibrate to, where the recorded run itself was slowed down
    (a profiling run that synchronised every action to time it on a GPU); default the run's median."""
    if not run.schedule or not run.num_microbatches:
        return 1.0
    measured = measured_step_ns or run.step_ns_median or run.step_ns
    if not measured:
        return 1.0
    try:
        _, res = _simulate(run, run.schedule, run.world_size, run.stages_per_rank, run.num_microbatches,
                           layers=layers, split=layers.recorded if layers is not None else None,
                           device_model=device_model, commit_ns=commit_ms * 1e6, commit_launches=commit_launches,
                           samples=samples, overlap_backward=overlap_backward, overlap_margin=overlap_margin)
    except (ScheduleError, ValueError):
        return 1.0
    return measured / res.makespan if res.makespan else 1.0


def search_split(run: RunCosts, name: str, p: int, v: int, m: int, layers: Layers, *,
                 max_simulations: int = 300, device_model: str = "lanes",
                 commit_ms: float = COMMIT_MS, commit_launches: float = COMMIT_LAUNCHES,
                 overlap_backward: bool | str | None = "auto",
                 overlap_margin: float | None = None) -> tuple[tuple[int, ...], float]:
    """The layer split of ``p * v`` stages with the shortest simulated step, by local search from the even
    split: move one layer across one boundary at a time while that shortens the step (each move one
    simulation, a few milliseconds).  Returns (layers per stage, simulated step time, uncalibrated)."""
    n = p * v
    cache: dict[Any, Any] = {}
    cur = list(layers.even_split(n))
    kw: dict[str, Any] = {"device_model": device_model, "commit_ns": commit_ms * 1e6, "commit_launches": commit_launches,
                          "overlap_backward": overlap_backward, "overlap_margin": overlap_margin}
    best = _simulate(run, name, p, v, m, layers=layers, split=cur, lowered=cache, **kw)[1].makespan
    sims, improved = 1, True
    while improved and sims < max_simulations:
        improved = False
        for j in range(n - 1):
            for d in (1, -1):  # one layer from stage j+1 to stage j, or back
                cand = list(cur)
                cand[j] += d
                cand[j + 1] -= d
                if min(cand[j], cand[j + 1]) < 1:
                    continue
                t = _simulate(run, name, p, v, m, layers=layers, split=cand, lowered=cache, **kw)[1].makespan
                sims += 1
                if t < best * (1 - 1e-9):
                    cur, best, improved = cand, t, True
    return tuple(cur), best


def tune(
    run: RunCosts,
    *,
    schedules: Sequence[str] = SCHEDULE_NAMES,
    microbatches: Sequence[int] | None = None,
    stages_per_rank: Sequence[int] | None = (1, 2),
    memory_cap: int | None = None,
    activation_memory: int | None = None,
    calibrate: bool = True,
    measured_step_ns: float | None = None,
    layers: Layers | None = None,
    search: int = 0,
    device_model: str = "lanes",
    commit_ms: float = COMMIT_MS,
    commit_launches: float = COMMIT_LAUNCHES,
    samples: int = SAMPLES,
    overlap_backward: bool | str | None = "auto",
    overlap_margin: float | None = None,
    calibration_margin: float | None = None,
) -> TuneResult:
    """Simulate every candidate configuration with ``run``'s costs; see the module docstring.

    ``stages_per_rank`` None: each schedule's default (1 for GPipe and 1F1B, 2 for the others).
    ``layers``: the model's layers (see :class:`Layers`), so that each candidate's stages hold whole layers
    (the even split); with ``search`` > 0 the ``search`` fastest candidates also get the best split
    :func:`search_split` finds, as extra candidates (``split`` set, ``searched`` True).
    ``device_model``: one of :data:`DEVICE_MODELS` (GPU profiles with a host side; ignored on CPU profiles);
    ``commit_ms``, ``commit_launches``: the runtime's ``gpu_commit_ms`` and ``gpu_commit_launches`` the candidates
    will run with (:func:`commit_horizon`).  ``samples``: simulations per
    candidate with drawn action costs, the median kept (:data:`SAMPLES`; CPU profiles only; 0 or 1: the means).
    ``overlap_backward``: the runtime's ``host_overlap_backward`` the candidates will run with (two-lane model:
    :data:`OVERLAP_BACKWARD`; "auto", the runtime's default, decides per pair on each candidate's costs);
    ``overlap_margin``: that rule's margin (None: the runtime's; see :func:`_simulate`); ``calibration_margin``:
    the margin the profiled run itself ran with, which the calibration replays it under (None: ``overlap_margin``;
    a profile recorded before session M: 1.0).
    The layer-split search compares splits on the means (hundreds of simulations).
    """
    if device_model not in DEVICE_MODELS:
        raise ValueError(f"device_model must be one of {', '.join(DEVICE_MODELS)} (got {device_model!r})")
    if overlap_backward not in (None, False, True, "auto"):
        raise ValueError(f"overlap_backward must be 'auto', True, False or None (got {overlap_backward!r})")
    kw: dict[str, Any] = {"device_model": device_model, "commit_ns": commit_ms * 1e6, "commit_launches": commit_launches,
                          "samples": samples, "overlap_backward": overlap_backward, "overlap_margin": overlap_margin}
    p = run.world_size
    m0 = run.num_microbatches or 1
    v0 = run.stages_per_rank
    if microbatches is None:
        microbatches = sorted({p, 2 * p, 4 * p, 8 * p, m0})
    act0 = activation_memory if activation_memory is not None else run.costs.activation_bytes
    proxy = activation_memory is None
    factor = (calibration(run, measured_step_ns=measured_step_ns, layers=layers, device_model=device_model,
                          commit_ms=commit_ms, commit_launches=commit_launches, samples=samples,
                          overlap_backward=overlap_backward,
                          overlap_margin=overlap_margin if calibration_margin is None else calibration_margin)
              if calibrate else 1.0)
    cands: list[Candidate] = []
    skipped: list[str] = []
    recorded: Candidate | None = None

    def candidate(name: str, m: int, v: int, sched: Any, res: Any, split: tuple[int, ...] | None,
                  searched: bool) -> Candidate:
        peak = max(res.peak_live_activations.values(), default=0)
        mem = int(peak * act0 * (m0 / m) * v0 / v)
        n_b = sum(1 for acts in sched.actions.values() for a in acts if a.type is ActionType.B)
        return Candidate(name, m, v, res.makespan * factor, res.overall_bubble_fraction, peak, mem,
                         memory_cap is None or mem <= memory_cap, split, searched,
                         sum(res.overlapped_backwards.values()), n_b)

    for name in schedules:
        for v in stages_per_rank if stages_per_rank is not None else (default_stages_per_rank(name),):
            for m in microbatches:
                try:
                    split = layers.even_split(p * v) if layers is not None else None
                    sched, res = _simulate(run, name, p, v, m, layers=layers, split=split, **kw)
                except (ScheduleError, ValueError) as exc:
                    skipped.append(f"{name} m={m} v={v}: {exc}")
                    continue
                c = candidate(name, m, v, sched, res, split, False)
                cands.append(c)
                if (name, m, list(sched.stage_to_rank)) == (run.schedule, m0, run.stage_to_rank):
                    recorded = c
    if layers is not None and search > 0:
        base = sorted((c for c in cands if c.fits), key=lambda c: c.step_ns)[:search]
        for c in base:
            split, _ = search_split(run, c.schedule, p, c.stages_per_rank, c.microbatches, layers,
                                    device_model=device_model, commit_ms=commit_ms, commit_launches=commit_launches,
                                    overlap_backward=overlap_backward, overlap_margin=overlap_margin)
            if split != c.split:
                sched, res = _simulate(run, c.schedule, p, c.stages_per_rank, c.microbatches, layers=layers, split=split, **kw)
                cands.append(candidate(c.schedule, c.microbatches, c.stages_per_rank, sched, res, split, True))
    cands = rank_candidates(cands)
    hfit = host_fit(run, layers, run.ref_bytes) if layers is not None and run.host is not None else None
    fixed = dict(hfit.fixed) if hfit is not None else None
    return TuneResult(tuple(cands), tuple(skipped), recorded, measured_step_ns or run.step_ns_median or run.step_ns,
                      memory_cap, act0, proxy, calibration=factor, sizes_fitted=run.sizes_fitted,
                      host_fixed_ns=fixed, host_units_ns=hfit.describe(layers) if hfit is not None and layers is not None else None,
                      host_separate=run.host is not None, device_events=run.device_measured,
                      device_model=device_model if run.host is not None else None,
                      overlap_backward=overlap_backward if run.host is not None and device_model == "lanes" else None)


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3f} ms"


def _size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_host_units(units: dict[str, dict[str, float]]) -> str:
    """``F 0.560 ms + per layer 0.300 ms, start 0.020 ms, end 0.900 ms; B ...`` (:attr:`TuneResult.host_units_ns`)."""
    out = []
    for t, parts in units.items():
        keys = sorted((k for k in parts if k != "fixed"), key=lambda k: (not k.startswith("layer"), k != "start", k))
        rest = [("per " + k if k.startswith("layer") else k) + f" {_ms(parts[k])}" for k in keys]
        out.append(f"{t} {_ms(parts['fixed'])}" + (" + " + ", ".join(rest) if rest else ""))
    return "; ".join(out)


TIE = 0.03
"""Candidates predicted within this fraction of the fastest are a tie: the model's per-configuration error on a
measured GPU grid was up to 6.8% (median 4.8%; ``benchmarks/tune_grid.py``, 2 x H200), and the fastest three of that
grid, predicted within 0.7% of each other, measured 68.1-73.7 ms.  :func:`format_tune` says so rather than let the
first row look decided, and :func:`rank_candidates` orders a tie by what is safest rather than by noise."""


def rank_candidates(candidates: Sequence[Candidate], tie: float = TIE) -> list[Candidate]:
    """Fitting candidates first, fastest predicted first; but the ones predicted within ``tie`` of the fastest
    (closer than the model resolves) go first in the order of what the prediction can be trusted on and what
    risks least: the even layer split before a searched one (an extrapolation from the profiled stages' costs
    to stage shapes nobody ran), then the least activation memory (peak bytes, then live microbatch-stages),
    then the predicted step.

    Why (``benchmarks/tune_grid.py``, two grids on 2 x H200, GPT size s): both times the search's split of 1F1B
    m=8 (5,3) was predicted 0.6% and 1.9% faster than the even split (4,4) and measured 1.7% and 12.0% slower
    (the second head to head over 24 alternating steps, 95% interval +0.0..+17.4%); a ranking by predicted step
    alone picked it."""
    ordered = sorted(candidates, key=lambda c: (not c.fits, c.step_ns))
    fits = [c for c in ordered if c.fits]
    if not fits or not fits[0].step_ns > 0:
        return ordered
    limit = fits[0].step_ns * (1 + tie)
    n = sum(1 for c in fits if c.step_ns <= limit)  # (sorted: the tie is the head)
    # (activation bytes where the profile gave them; else live microbatch-stages weighted by a microbatch-stage's
    # share of the model, peak_live / (m * v): GPipe m=8 holds 8/8 of the batch, 1F1B m=8 2/8, v=2 halves it)
    head = sorted(ordered[:n], key=lambda c: (c.searched, c.peak_activation_bytes,
                                               c.peak_live / max(1, c.microbatches * c.stages_per_rank), c.step_ns))
    return head + ordered[n:]


def near_ties(candidates: Sequence[Candidate], tie: float = TIE) -> list[int]:
    """Indices of the leading candidates (as :func:`rank_candidates` orders them) whose predicted step is within
    ``tie`` of the fastest of them."""
    if not candidates:
        return []
    fastest = min(c.step_ns for c in candidates)
    if not fastest > 0:
        return []
    out = []
    for i, c in enumerate(candidates):
        if c.step_ns > fastest * (1 + tie):
            break
        out.append(i)
    return out


def format_tune(r: TuneResult, *, top: int = 5, source: str = "") -> str:
    lines = []
    if r.recorded is not None and r.measured_step_ns:
        raw = r.recorded.step_ns / r.calibration if r.calibration else r.recorded.step_ns
        err = (raw - r.measured_step_ns) / r.measured_step_ns
        cal = f", calibrated {_ms(r.recorded.step_ns)}" if r.calibration != 1.0 else ""
        lines.append(f"recorded configuration {r.recorded.schedule} m={r.recorded.microbatches} v={r.recorded.stages_per_rank}: "
                     f"measured {_ms(r.measured_step_ns)} (median), simulated {_ms(raw)} ({err:+.1%}){cal}")
    fits = [c for c in r.candidates if c.fits]
    cap = f" under {_size(r.memory_cap)} of activations per rank" if r.memory_cap is not None else ""
    lines.append(f"top {min(top, len(fits))} of {len(r.candidates)} candidates{cap}, by simulated step time (a tie at the head: see below):")
    with_split = any(c.split is not None for c in r.candidates)
    beside = r.overlap_backward is not None  # the two-lane model: a column of the backwards launched beside a forward
    rows = [("#", "schedule", "microbatches", "stages/rank", *(("layers per stage",) if with_split else ()), "step time",
             "vs recorded", "bubble", "peak act. (mb-stages)", "peak act. memory", *(("B beside F",) if beside else ()))]
    for i, c in enumerate(fits[:top], 1):
        vs = f"{(c.step_ns / r.recorded.step_ns - 1):+.1%}" if r.recorded is not None and r.recorded.step_ns else "-"
        sp = ((",".join(map(str, c.split or ())) + (" (searched)" if c.searched else ""),) if with_split else ())
        rows.append((str(i), c.schedule, str(c.microbatches), str(c.stages_per_rank), *sp, _ms(c.step_ns), vs,
                     f"{c.bubble:.1%}", str(c.peak_live), _size(c.peak_activation_bytes),
                     *((f"{c.overlapped_backwards}/{c.backwards}" if c.backwards else "-",) if beside else ())))
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in rows]
    close = near_ties(fits[:top])
    if len(close) > 1:
        fastest = min(fits[i].step_ns for i in close)
        spread = max(fits[i].step_ns for i in close) / fastest - 1
        lines.append(f"#1-#{close[-1] + 1} are predicted within {spread:.1%} of each other, closer than the model resolves "
                     f"(TIE = {TIE:.0%}; its errors were up to 9% per configuration on 2-GPU grids, "
                     "benchmarks/RESULTS.md): ranked among themselves by the even layer split first, then the least "
                     "activation memory; measure them before choosing")
    over = [c for c in r.candidates if not c.fits]
    if over:
        best = over[0]
        lines.append(f"{len(over)} over the cap (fastest: {best.schedule} m={best.microbatches} v={best.stages_per_rank}, "
                     f"{_ms(best.step_ns)}, {_size(best.peak_activation_bytes)})")
    lines.append(f"step times calibrated by x{r.calibration:.3f} (the recorded configuration's measured over simulated); "
                 + ("compute carried as fixed + per-byte parts (the run had two microbatch sizes)" if r.sizes_fitted else
                    "one microbatch size recorded: compute taken as proportional to it (record steps of two batch sizes "
                    "to separate each action's fixed cost)"))
    if r.host_units_ns is not None:
        lines.append("host time per action: " + format_host_units(r.host_units_ns)
                     + " (fitted over the recorded stages; a candidate stage's action pays the fixed part once and the "
                     "units of its own layers)")
    elif r.host_fixed_ns is not None:
        lines.append("host time per action, whatever its layers: " + ", ".join(f"{t} {_ms(v)}" for t, v in r.host_fixed_ns.items())
                     + " (the rest shared among the layers)")
    else:
        lines.append("host time per action not separated from the layers' (needs a GPU profile with its host side "
                     "(--host-costs-from), a layer model and recorded stages holding different layers, e.g. an uneven "
                     "split): shared among the layers with the rest")
    if r.host_separate:
        how = ("each rank's host launches its list, committing ahead of its device (two lanes)" if r.device_model == "lanes"
               else "each action costs the longer of its host path and its device time (one lane)")
        lines.append(f"host and device recorded apart ({r.device_source}): {how}")
    if beside:
        how = {"auto": "where the runtime's auto rule launches them (its default: two stages on two streams always, "
                       "one stream where the B's host launch outlasts the B's and the F's device times by 25%, on each "
                       "candidate's costs)", True: "every one (host_overlap_backward=True)"}.get(r.overlap_backward)  # type: ignore[call-overload]
        lines.append("backwards followed by a forward: " + (
            f"launched beside it on a second host lane {how}; 'B beside F' counts them per step over all ranks "
            f"(host lanes x{OVERLAP_CONTENTION:g} slower while both launch)" if how else
            "launched inline (host_overlap_backward off)"))
    if r.activation_memory_is_proxy:
        lines.append(f"activation memory per recorded microbatch-stage: {_size(r.activation_memory)} = the stage-boundary "
                     "activation (a lower bound; give --activation-memory for the real figure)")
    if r.skipped:
        lines.append(f"skipped {len(r.skipped)} configurations the schedules reject, e.g. {r.skipped[0]}")
    return "\n".join(lines)

