"""Costs measured on a recorded run, in the simulator's terms.

``pipeloom schedule simulate --costs-from RUN.jsonl`` and ``pipeloom schedule
tune`` need what a step *costs* on this model and machine, not what the
textbook assumes (F=1, B=2).  A recorded trace has it:

* **compute**: the mean duration of each action type per stage (an embedding
  stage and a vocabulary head cost differently), plus the rank's runtime time
  per action -- the dispatcher, handing data on, blocking sends -- spread
  evenly over its actions (the simulator has no runtime of its own, and on a
  CPU or with small stages that time is a large part of the step);
* **transfers**: the mean time from the end of a send (its blocking part
  is already in the sender's runtime time) to the data having landed, fitted
  as ``latency + bytes / bandwidth`` where the run moved payloads of several
  sizes (else latency only), and the mean payload size.  Simulate with
  receives placed early (``recv_placement="early"``): pipeloom posts a
  receive as soon as the sender announces it, not where the list has it;
* **what carries to other configurations** (``pipeloom schedule tune``):
  where the run had microbatches of two sizes (a profiling run alternating
  the full and the half batch), each action's duration fitted as ``fixed +
  per_byte x bytes`` on the per-size means (``compute_fit``; the means,
  step time and costs above are those of the full-size steps), and the
  link's own transfer time, fitted on the transfers that landed while the
  receiver waited for them (``link_latency_ns``, ``link_ns_per_byte``): the
  mean transfer time above also holds the time data sat at a busy receiver,
  which depends on the schedule;
* **OVERLAP_F_B**: ``overlap`` from the measured pair against its halves;
* **memory**: the most live microbatches per rank and, on GPUs, the CUDA
  peak, so a tuner can scale activation memory.

Costs are in nanoseconds (a plan made from them is written with
``time_unit_ns`` 1).  The first training step is left out when there are
others: it pays for connecting the pairs and warming the allocator.

Why means: the step time is a sum of actions and transfers, and a sum is
predicted by means.  Checked on the CPU benchmark
(``benchmarks/sim_accuracy.py``, every named schedule, 2 gloo ranks on a
shared 2-core machine): with the mean transfer time every simulated step time
was within 7% of the measured mean, both where compute dominates and where
the runtime does; the median transfer time (the receiver being busy makes the
distribution long-tailed) under-predicted by up to 38%.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from pipeloom.schedules import Costs

from .trace_model import TraceModel, summarize

__all__ = ["RunCosts", "costs_from_trace", "merge_types", "with_host_costs"]


@dataclass(frozen=True)
class RunCosts:
    """What :func:`costs_from_trace` measured (times in ns)."""

    costs: Costs
    action_costs: dict[tuple[int, str, int | None], float]
    """(stage, type, None) -> mean duration plus the rank's runtime time per action."""
    compute_ns: dict[tuple[int, str], float]
    """(stage, type) -> mean duration of the action alone."""
    overhead_per_action_ns: dict[int, float]
    """rank -> runtime, send and wake-up time per action."""
    schedule: str | None
    num_microbatches: int | None
    world_size: int
    stage_to_rank: list[int]
    steps: list[int]
    step_ns: float
    """Measured mean step time over ``steps``."""
    peak_live_mb: dict[int, int] = field(default_factory=dict)
    peak_bytes: dict[int, int] = field(default_factory=dict)
    """rank -> CUDA peak allocated (GPU runs only)."""
    runtime_per_action_ns: dict[int, float] = field(default_factory=dict)
    """rank -> the same without the sends (what does not depend on how much an action sends)."""
    send_per_transfer_ns: dict[int, float] = field(default_factory=dict)
    """rank -> mean blocking time of one send (of ``costs.activation_bytes`` on average)."""
    compute_fit: dict[tuple[int, str], tuple[float, float]] = field(default_factory=dict)
    """(stage, type) -> (fixed ns, ns per byte of the microbatch's activation): an action's duration as
    ``fixed + per_byte * bytes``, fitted where the run had microbatches of several sizes; else
    ``(0, mean / ref_bytes)`` (taken as proportional, see ``sizes_fitted``)."""
    sizes_fitted: bool = False
    """The run had microbatches of at least two sizes (a factor 1.25 apart), so ``compute_fit`` separates the
    fixed part of an action from the part that grows with the microbatch."""
    ref_bytes: int = 0
    """Activation bytes of one microbatch at the run's reference (largest) size: ``compute_ns``,
    ``step_ns`` and the costs are of the steps at that size."""
    link_latency_ns: float = 0.0
    """Time from the end of a send to the data having landed on a receiver that was waiting for it (the
    transfer itself, without the receiver's own lateness), fitted as ``latency + bytes * link_ns_per_byte``."""
    link_ns_per_byte: float = 0.0
    step_ns_median: float = 0.0
    """Median step time over the reference steps (robust to a burst of load on a shared machine)."""
    overlap_measured: bool = False
    """The run had OVERLAP_F_B pairs whose halves also ran alone, so ``costs.overlap`` is measured."""
    dispersion: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """type -> quantiles (:data:`DISPERSION_QUANTILES` of them) of an action's duration over the mean of its stage
    and type, on the reference steps: how much the same action varies from one microbatch and step to the next
    (a loaded CPU: 0.3-3x; a GPU: close to 1).  The tuner draws from it (:data:`~pipeloom.tools.schedule_tune.SAMPLES`)."""
    host: RunCosts | None = None
    """GPU: the costs of the same configuration recorded *without* device syncs (:func:`with_host_costs`), whose
    action spans are the host's launch time; this run's own spans (recorded with ``check_finite``, a device sync
    per action) are then the device side.  None on CPUs, where an action's span is both."""
    device_measured: bool = False
    """The action times are device times measured with CUDA events (the trace's ``device`` events,
    ``costs_from_trace(device=True)``), not spans synchronised by ``check_finite``: nothing of the host's
    launch, the sync or the checks is in them, fixed part included."""
    others: tuple[RunCosts, ...] = ()
    """Other recorded runs of the same stages (:func:`merge_types`: another schedule, its stages on other ranks),
    kept whole: fits over the stages may use their actions too (``schedule_tune.host_fit(rank_speed=True)``)."""
    borrowed: tuple[str, ...] = ()
    """The action types :func:`merge_types` took from ``others`` (their times are another run's, on its ranks)."""
    device_link_ns: tuple[float, float] | None = None
    """GPU (:func:`with_host_costs`): the device-side run's link, (latency ns, ns per byte), a transfer's time on
    the device lane of the two-lane model (the top-level link is the host run's: when a receiver's host learns of
    the data)."""

    @property
    def stages_per_rank(self) -> int:
        return max(1, len(self.stage_to_rank) // max(self.world_size, 1))

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {
            "costs": asdict(self.costs),
            "action_costs": {f"{s}{t}": v for (s, t, _), v in sorted(self.action_costs.items())},
            "overhead_per_action_ns": {str(k): v for k, v in sorted(self.overhead_per_action_ns.items())},
            "schedule": self.schedule,
            "num_microbatches": self.num_microbatches,
            "stage_to_rank": self.stage_to_rank,
            "steps": self.steps,
            "step_ns": self.step_ns,
        }


def costs_from_trace(model: TraceModel, *, skip_warmup: int | None = None, typical: bool = False,
                     device: bool = False) -> RunCosts:
    """Per-stage, per-type costs and transfer times of a recorded run (ValueError if it is a plan or has no actions).

    ``typical``: measure on the steps whose time is at most the median of the steps of their size (the typical
    steps), not on all of them: see :data:`TYPICAL`.  ``device``: an action's time is its device time from the
    trace's ``device`` events (a GPU run; ValueError where the trace has none), not its span; everything else
    (steps, runtime, transfers) is the same run's, so ``with_host_costs(costs_from_trace(t, device=True),
    costs_from_trace(t))`` is both sides from one traced run, without ``check_finite``'s syncs."""
    if model.source == "simulation":
        raise ValueError("costs come from a recorded run; this trace is a simulated plan")
    train = model.train_steps
    if not train:
        raise ValueError("the trace has no training step to measure")
    # by default the first training step is left out (one-time work); with ``cuda_graphs`` the second too: the
    # first ran eagerly (the graphs are captured after it) and the second uploads each graph at its first replay
    warm = 2 if (model.header.get("options") or {}).get("cuda_graphs") else 1
    skip = min(warm, len(train) - 1) if skip_warmup is None else min(skip_warmup, len(train) - 1)
    summary = summarize(model, skip_warmup=skip, critical=False)
    steps = list(summary.steps)
    chosen = set(steps)
    # The size of each microbatch, read from its activation transfers; the steps at the largest size are the
    # reference (a profiling run may alternate batch sizes so that fixed and per-row costs can be told apart).
    mb_bytes: dict[tuple[int, int], int] = {}
    for lst in model.transfers.values():
        for t in lst:
            if t.kind == "send" and t.event.get("kind") == "F" and isinstance(t.mb, int) and t.step in chosen:
                b = int(t.event.get("bytes", 0) or 0)
                if b > mb_bytes.get((t.step, t.mb), 0):
                    mb_bytes[(t.step, t.mb)] = b
    step_size: dict[int, int] = {}
    for (st, _), b in mb_bytes.items():
        step_size[st] = max(step_size.get(st, 0), b)
    ref_bytes = max(step_size.values(), default=0)
    ref_steps = {st for st in chosen if step_size.get(st, ref_bytes) >= 0.95 * ref_bytes} or chosen
    all_ref = ref_steps  # the step times (mean, median) stay those of every reference step
    if typical:
        quiet = _typical_steps(summary.step_times_ns, step_size, ref_bytes)
        chosen, ref_steps = quiet, (ref_steps & quiet) or ref_steps
        steps = sorted(chosen)
    durations: dict[tuple[int, str], list[int]] = {}
    ovl: list[tuple[str, str, int]] = []
    n_actions: dict[int, int] = {}
    beside: dict[tuple[int, str], list[int]] = {}
    sized: dict[tuple[int, str], list[tuple[int, int]]] = {}
    dev_ns = model.device_ns
    if device and not dev_ns:
        raise ValueError("the trace has no device times (`device` events): record it on GPUs with pipeloom's engine")
    for r, lst in model.actions.items():
        for a in lst:
            if a.step not in chosen:
                continue
            n_actions[r] = n_actions.get(r, 0) + 1
            dur = a.duration
            if device:
                d = dev_ns.get((r, a.step, a.name))
                if d is None:
                    continue
                dur = d
            if not device and a.event.get("beside") and isinstance(a.stage, int):
                # a backward launched on the worker thread beside forwards (host_overlap_backward): its span is
                # shared with theirs; the host cost of a backward is read from the inline ones where there are any
                if a.step in ref_steps:
                    beside.setdefault((a.stage, a.type), []).append(dur)
                continue
            if a.type in ("F", "B", "I", "W") and isinstance(a.stage, int):
                if a.step in ref_steps:
                    durations.setdefault((a.stage, a.type), []).append(dur)
                if isinstance(a.mb, int) and (a.step, a.mb) in mb_bytes:
                    sized.setdefault((a.stage, a.type), []).append((mb_bytes[(a.step, a.mb)], dur))
            elif a.type == "OVERLAP_F_B" and isinstance(a.event.get("sub"), list) and len(a.event["sub"]) == 2:
                ovl.append((str(a.event["sub"][0]), str(a.event["sub"][1]), dur))
    for k, v in beside.items():
        durations.setdefault(k, v)
    if not durations and not ovl:
        raise ValueError("the trace has no F/B/I/W actions to measure")
    compute = {k: sum(v) / len(v) for k, v in durations.items()}
    ratios: dict[str, list[float]] = {}
    for (stage, typ), v in durations.items():
        if compute[(stage, typ)] > 0:
            ratios.setdefault(typ, []).extend(d / compute[(stage, typ)] for d in v)
    dispersion = {t: _quantiles(v, DISPERSION_QUANTILES) for t, v in ratios.items()}
    sizes = sorted({b for v in sized.values() for b, _ in v})
    fitted = len(sizes) > 1 and sizes[0] > 0 and sizes[-1] >= 1.25 * sizes[0]
    compute_fit: dict[tuple[int, str], tuple[float, float]] = {}
    for k, mean in compute.items():
        fit = _affine(sized.get(k, [])) if fitted else None
        if fit is None:
            fit = (0.0, mean / ref_bytes) if ref_bytes else (mean, 0.0)
        compute_fit[k] = fit
    overhead: dict[int, float] = {}
    runtime: dict[int, float] = {}
    per_send: dict[int, float] = {}
    n_sends = {r: sum(1 for t in model.transfers.get(r, []) if t.kind == "send" and t.step in chosen) for r in model.ranks}
    attribution = summary.attribution
    if typical:
        from .trace_analysis import Attribution

        sums: dict[int, Any] = {}
        for st, a1 in summary.per_step:
            if st in chosen:
                sums.setdefault(a1.rank, Attribution(a1.rank)).add(a1)
        attribution = tuple(sums.values())
    for att in attribution:
        n = n_actions.get(att.rank, 0)
        sends = att.sends_ns + att.by_cause().get("sends", 0)
        rt = att.runtime_ns + att.by_cause().get("wakeup", 0)
        overhead[att.rank] = (rt + sends) / n if n else 0.0
        runtime[att.rank] = rt / n if n else 0.0
        per_send[att.rank] = sends / n_sends[att.rank] if n_sends.get(att.rank) else 0.0
    place = list(model.header.get("stage_to_rank") or [])
    action_costs: dict[tuple[int, str, int | None], float] = {}
    for (stage, typ), mean in compute.items():
        rank = place[stage] if stage < len(place) else None
        action_costs[(stage, typ, None)] = mean + (overhead.get(rank, 0.0) if rank is not None else 0.0)
    # overlap factor from measured pairs whose halves also ran alone
    overlap = 0.0
    import re

    leaf = re.compile(r"^(\d+)([A-Z]+)(\d+)$")
    fac = []
    for n1, n2, d in ovl:
        m1, m2 = leaf.match(n1), leaf.match(n2)
        if not (m1 and m2):
            continue
        c1 = compute.get((int(m1.group(1)), m1.group(2)))
        c2 = compute.get((int(m2.group(1)), m2.group(2)))
        if c1 and c2:
            fac.append(min(1.0, max(0.0, (d - max(c1, c2)) / min(c1, c2))))
    if fac:
        overlap = sum(fac) / len(fac)
    # transfers
    samples: list[tuple[int, int]] = []
    waited: list[tuple[int, int]] = []  # those that landed while the receiver was waiting: the link's own time
    wait_spans = {r: ([w.start for w in ws], [w.end for w in ws]) for r, ws in model.waits.items()}
    for send, recv in model.transfer_pairs():
        if send.step in chosen:
            sample = (int(send.event.get("bytes", 0) or 0), max(0, recv.end - send.end))
            starts, ends = wait_spans.get(recv.rank, ([], []))
            i = bisect.bisect_left(starts, recv.end) - 1
            was_waited = i >= 0 and recv.end <= ends[i] + 100_000
            if recv.event.get("posted"):
                # A receive posted ahead (static shapes on gloo) is traced as landed when the loop's wait for
                # it returned: when its consumer came to it, long after it arrived unless the consumer was
                # already waiting when it was sent.  Only those time the link; the others say only "at most
                # this" (a wait of a few tens of microseconds on a payload that had landed is still traced).
                was_waited = was_waited and starts[i] <= send.end
                if not was_waited:
                    continue
            if send.step in ref_steps:
                samples.append(sample)
            if was_waited:
                waited.append(sample)
    link = _affine(waited) if len({b for b, _ in waited}) > 1 else None
    if link is None:
        link = (statistics.mean(t for _, t in waited) if waited else 0.0, 0.0)
    latency, bandwidth, act_bytes = 0.0, None, 0
    if samples:
        act_bytes = int(round(sum(b for b, _ in samples) / len(samples)))
        sizes = {b for b, _ in samples}
        latency = float(statistics.mean(t for _, t in samples))
        if len(sizes) > 1:
            # least squares t = l + b / bw on the per-size means
            by: dict[int, list[int]] = {}
            for b, t in samples:
                by.setdefault(b, []).append(t)
            xs = sorted(by)
            ys = [statistics.mean(by[x]) for x in xs]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            sxx = sum((x - mx) ** 2 for x in xs)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
            if slope > 0:
                bandwidth = 1.0 / slope
                latency = max(0.0, my - slope * mx)
    costs = Costs(
        F=_mean_type(compute, "F"), B=_mean_type(compute, "B"), I=_mean_type(compute, "I"), W=_mean_type(compute, "W"),
        send_latency=latency, bandwidth=bandwidth, activation_bytes=act_bytes, overlap=overlap,
    )
    peak_live: dict[int, int] = {}
    peak_bytes: dict[int, int] = {}
    for r, evs in model.memory.items():
        for e in evs:
            if e.get("step") in chosen:
                peak_live[r] = max(peak_live.get(r, 0), int(e.get("live_mb", 0) or 0))
                if isinstance(e.get("peak"), int):
                    peak_bytes[r] = max(peak_bytes.get(r, 0), e["peak"])
    world = model.header.get("world_size")
    ref_times = [summary.step_times_ns[st] for st in sorted(all_ref) if st in summary.step_times_ns]
    return RunCosts(
        costs=costs,
        action_costs=action_costs,
        compute_ns=compute,
        overhead_per_action_ns=overhead,
        runtime_per_action_ns=runtime,
        send_per_transfer_ns=per_send,
        schedule=model.header.get("schedule"),
        num_microbatches=model.header.get("num_microbatches"),
        world_size=int(world) if isinstance(world, int) else len(model.ranks),
        stage_to_rank=place,
        steps=steps,
        overlap_measured=bool(fac),
        step_ns_median=statistics.median(ref_times) if ref_times else 0.0,
        step_ns=(sum(summary.step_times_ns[st] for st in all_ref if st in summary.step_times_ns)
                 / max(1, sum(1 for st in all_ref if st in summary.step_times_ns))) or summary.mean_step_ns,
        peak_live_mb=peak_live,
        peak_bytes=peak_bytes,
        compute_fit=compute_fit,
        dispersion=dispersion,
        sizes_fitted=fitted,
        ref_bytes=ref_bytes,
        link_latency_ns=link[0],
        link_ns_per_byte=link[1],
        device_measured=device,
    )


TYPICAL = 0.5
"""With ``typical``, the share of each size's steps costs are measured on: the fastest half (at most the median).

Why: on a shared machine a burst of load stretches a whole step, its actions and its transfers together, and
the tails are not alike: transfers that landed while their receiver waited took 0.2-24 ms on the CPU benchmark
(median 1.9 ms, mean 3.0 ms), actions' means were 1.2-1.4x their medians.  The tuner predicts the *typical*
(median) step and calibrates to the recorded run's median step; costs averaged over every step carry each
burst into the terms by their own tail, so a configuration with more exposed transfers was predicted slower
than one with more compute.  Means over the typical steps keep "a step is a sum: predict it with means" and
drop the bursts.  On a GPU, whose steps are steady, it changes little."""


DISPERSION_QUANTILES = 32


def _quantiles(values: list[float], n: int) -> tuple[float, ...]:
    """``n`` evenly spaced quantiles (midpoints) of ``values``, rescaled so that their mean is that of ``values``."""
    v = sorted(values)
    q = [v[min(len(v) - 1, int((i + 0.5) * len(v) / n))] for i in range(n)]
    mean, qm = sum(v) / len(v), sum(q) / len(q)
    return tuple(x * mean / qm for x in q) if qm > 0 else tuple(q)


def _typical_steps(times: dict[int, int], size: dict[int, int], ref_bytes: int) -> set[int]:
    """The steps at most the median time of the steps of their size (sizes within 5% pooled)."""
    groups: dict[int, list[int]] = {}
    for st in times:
        b = size.get(st, ref_bytes)
        key = next((k for k in groups if abs(k - b) <= 0.05 * max(k, b, 1)), b)
        groups.setdefault(key, []).append(st)
    out: set[int] = set()
    for sts in groups.values():
        med = statistics.median(times[st] for st in sts)
        out.update(st for st in sts if times[st] <= med)
    return out


def with_host_costs(device: RunCosts, host: RunCosts) -> RunCosts:
    """``device`` (a run recorded with a device sync per action: spans are device time) with ``host`` (the same
    configuration recorded without: spans are the host's launch time) as its host side.

    On a GPU the host only *launches* an action and runs ahead of the device (``runtime/device.py``), so an
    action costs the longer of its host path (launch, plus the runtime's dispatching, announcing and sending,
    which the syncs do not change but which are taken from ``host``, the undisturbed run) and its device time;
    one traced run cannot show both (without syncs the spans are host time, with them host and device
    serialised).  The step times and the transfers are ``host``'s: the syncs slow the step down, and on NCCL a
    receive's trace span ends when its header has come and the payload's receive is posted (committed), a
    host-side latency that the syncs only lengthen.  ValueError when the two runs are not of the same
    configuration.
    """
    same = (device.schedule, device.num_microbatches, list(device.stage_to_rank), device.world_size)
    other = (host.schedule, host.num_microbatches, list(host.stage_to_rank), host.world_size)
    if same != other:
        raise ValueError(f"the host-side run ({other[0]} m={other[1]}, stages on ranks {other[2]}) is not the "
                         f"configuration of the device-side run ({same[0]} m={same[1]}, stages on ranks {same[2]})")
    if set(host.compute_ns) != set(device.compute_ns):
        raise ValueError(f"the host-side run has actions {sorted(host.compute_ns)}, the device-side run "
                         f"{sorted(device.compute_ns)}: record the same configuration twice")
    return replace(device, host=replace(host, host=None), overhead_per_action_ns=host.overhead_per_action_ns,
                   runtime_per_action_ns=host.runtime_per_action_ns, send_per_transfer_ns=host.send_per_transfer_ns,
                   step_ns=host.step_ns, step_ns_median=host.step_ns_median, steps=host.steps, costs=host.costs,
                   link_latency_ns=host.link_latency_ns, link_ns_per_byte=host.link_ns_per_byte,
                   device_link_ns=(device.link_latency_ns, device.link_ns_per_byte))


def merge_types(run: RunCosts, other: RunCosts) -> RunCosts:
    """``run`` with the action types it did not record taken from ``other``, a run of the same stages under
    another schedule (e.g. 1F1B's or Interleaved1F1B's F and B, and ZBVZeroBubble's I and W).

    Why: a split backward is not a full one cut in two.  On the host, pipeloom's I also plans the weight-gradient
    work and W replays it, so a schedule of I and W pays more per microbatch than one of B, and no fixed share
    carries one to the other; a profile that ran both measures both.  Everything else (runtime, transfers,
    step times, the calibration's configuration) stays ``run``'s.  ValueError when the two runs do not have the
    same stages and ranks.
    """
    stages, others = sorted({s for s, _ in run.compute_ns}), sorted({s for s, _ in other.compute_ns})
    if stages != others or run.world_size != other.world_size:
        raise ValueError(f"the runs do not have the same stages and ranks ({len(stages)} stages on {run.world_size} "
                         f"ranks, and {len(others)} on {other.world_size})")
    have = {t for _, t in run.compute_ns}
    add = {k: v for k, v in other.compute_ns.items() if k[1] not in have}
    fit = dict(run.compute_fit)
    fit.update({k: v for k, v in other.compute_fit.items() if k[1] not in have})
    acts = dict(run.action_costs)
    acts.update({k: v for k, v in other.action_costs.items() if k[1] not in have})
    merged = replace(run, compute_ns={**run.compute_ns, **add}, compute_fit=fit, action_costs=acts,
                     dispersion={**{t: q for t, q in other.dispersion.items() if t not in have}, **run.dispersion},
                     sizes_fitted=run.sizes_fitted and other.sizes_fitted,
                     others=(*run.others, replace(other, host=None)),
                     borrowed=tuple(sorted({*run.borrowed, *(t for _, t in add)})))
    if run.host is not None and other.host is not None:
        merged = replace(merged, host=merge_types(run.host, other.host))
    return merged


def _affine(samples: list[tuple[int, int]]) -> tuple[float, float] | None:
    """Least squares ``t = a + b * x`` over (x, t) samples, on the per-x means (a step is a sum of
    actions: a sum is predicted by means, and on a loaded machine the tail is most of the mean); None where it cannot be
    fitted (one size).  A negative slope means the size does not matter: (mean, 0); a negative
    intercept means no fixed part: proportional through the origin."""
    by: dict[int, list[int]] = {}
    for x, t in samples:
        by.setdefault(x, []).append(t)
    if len(by) < 2:
        return None
    xs = sorted(by)
    ys = [statistics.mean(by[x]) for x in xs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if b <= 0:
        return (statistics.mean(t for _, t in samples), 0.0)
    a = my - b * mx
    if a < 0:
        return (0.0, sum(ys) / sum(xs))
    return (a, b)


def _mean_type(compute: dict[tuple[int, str], float], typ: str) -> float:
    v = [c for (_, t), c in compute.items() if t == typ]
    if v:
        return sum(v) / len(v)
    # a schedule without this type: a sensible stand-in from the others
    f = [c for (_, t), c in compute.items() if t == "F"]
    base = sum(f) / len(f) if f else 1.0
    return {"F": base, "B": 2 * base, "I": base, "W": base}[typ]
