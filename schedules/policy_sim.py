"""Simulate a dispatch *policy*, not only a list: how much could reordering gain on uneven work?

The problem (issue 19): pipeloom dispatches by readiness so that uneven work
-- microbatches of different lengths, a slow or jittery rank -- does not
leave a rank idle behind a blocked list entry.  Measured, it has not paid
yet.  Before changing the runtime's policy, measure the room: simulate the
same step under several policies with the same per-action costs, and report
how much the best one gains over the static order.  That is the ceiling a
better runtime policy can chase.

The model is :func:`pipeloom.schedules.simulate`'s compute-only one (a
transfer takes ``costs.transfer`` after its producer ends; a hand-over on one
rank is free), run as an event simulation where a rank that becomes free
*chooses* among its pending actions:

Each policy is the runtime's own decision, :class:`pipeloom.schedules.
dispatch.Dispatcher` (whose docstring argues the memory and deadlock
guarantees), so what is simulated is what runs:

* ``static``: rule ``list`` -- the list's next action, when it is ready
  (pipeloom's ``deterministic=True``; equals :func:`simulate` on the
  compute-only list);
* ``dynamic``: rule ``ready`` -- the first ready action in list order,
  forwards only in list order among themselves, a forward only while the
  rank's live microbatches are under the static order's peak;
* ``critical``: rule ``critical`` -- the same guarantees, but among ready
  actions the one with the longest remaining path to the end of the step
  (the plan's mean costs, or the caller's ``priority``), W last;
* ``guarded``: rule ``guarded`` -- the list's head when ready, a later
  action only inside the hole the static plan leaves before the head.

Costs vary per microbatch (``lengths``: a multiplier per microbatch, e.g.
sequence lengths drawn from a distribution, compute proportional to length)
and per action by rank jitter (``jitter``: multiplier ``1 + sigma * N(0, 1)``
drawn per action, at least 0.1), with ``slow`` multipliers per rank.  Every
policy of a trial sees the same draws.

Only compute actions are scheduled (F, B, I, W, OVERLAP_F_B); sends,
receives, FSDP and REDUCE_GRAD are left out of this model.

``notice``: a transfer that lands while its receiver is running an action
becomes usable only ``notice`` after that action ends.  That is how a CPU
rank works (compute runs on the event loop's thread; announcements are read
and receives completed between actions), and it is what makes the runtime's
rules reorder more than a model with instant arrival predicts: right after
an action, the list's next forward whose input landed meanwhile is not
ready yet, so ``ready`` runs a backward first.  Found in the traces of
``benchmarks/uneven.py``: without it the simulator predicted GPipe's gain
on bimodal lengths at 2 ranks as +3.8% from the run's own costs, +7.7%
with it (measured +10..13%); the static order's step time is within 2% either way.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .action import Action, ActionType
from .dataflow import Dataflow, consumer_stage, producer_stage
from .schedule import Schedule, ScheduleError
from .dispatch import Dispatcher, RankPlan, plan_ranks
from .simulate import Costs

__all__ = ["POLICIES", "PolicyResult", "draw_costs", "simulate_policy", "policy_ceiling"]

POLICIES = ("static", "dynamic", "critical", "guarded")

_F, _B, _I, _W = ActionType.F, ActionType.B, ActionType.I, ActionType.W


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    makespan: float
    busy: Mapping[int, float]
    peak_live: Mapping[int, int]
    reordered: int
    """Actions run ahead of an earlier-listed pending one."""


def draw_costs(
    schedule: Schedule,
    costs: Costs,
    *,
    lengths: Sequence[float] | None = None,
    jitter: float = 0.0,
    slow: Mapping[int, float] | None = None,
    rng: random.Random | None = None,
) -> dict[tuple[int, str, int], float]:
    """One trial's duration of every compute leaf ``(stage, type, microbatch)``."""
    rng = rng or random.Random(0)
    slow = slow or {}
    base = {"F": costs.F, "B": costs.B, "I": costs.I, "W": costs.W}
    out: dict[tuple[int, str, int], float] = {}
    for rank, acts in sorted(schedule.actions.items()):
        for a in acts:
            for leaf in a.leaves():
                t = leaf.type.value
                if t not in base or leaf.microbatch is None:
                    continue
                m = leaf.microbatch
                d = base[t] * (lengths[m] if lengths is not None else 1.0) * slow.get(rank, 1.0)
                if jitter:
                    d *= max(0.1, 1.0 + jitter * rng.gauss(0.0, 1.0))
                out[(leaf.stage, t, m)] = d
    return out


def _compute_lists(schedule: Schedule) -> dict[int, list[Action]]:
    return {r: [a for a in acts if a.sub_actions or a.type in (_F, _B, _I, _W)] for r, acts in schedule.actions.items()}


def _bottom_levels(schedule: Schedule, dur: Mapping[tuple[int, str, int], float], xfer: float) -> dict[tuple[int, str, int], float]:
    """Longest path from the start of each leaf to the end of the step (dependency edges only)."""
    S = schedule.num_stages
    place = schedule.stage_to_rank
    memo: dict[tuple[int, str, int], float] = {}
    keys = set(dur)

    def succ(k: tuple[int, str, int]) -> list[tuple[tuple[int, str, int], float]]:
        s, t, m = k
        out = []
        if t == "F":
            c = consumer_stage("F", s, S)
            if c is not None:
                out.append(((c, "F", m), xfer if place[c] != place[s] else 0.0))
            else:
                out += [((s, "B", m), 0.0), ((s, "I", m), 0.0)]
        elif t in ("B", "I"):
            c = consumer_stage("B", s, S)
            if c is not None:
                g = xfer if place[c] != place[s] else 0.0
                out += [((c, "B", m), g), ((c, "I", m), g)]
            if t == "I":
                out.append(((s, "W", m), 0.0))
        return [(x, c) for x, c in out if x in keys]

    def level(k: tuple[int, str, int]) -> float:
        v = memo.get(k)
        if v is None:
            v = dur[k] + max((c + level(x) for x, c in succ(k)), default=0.0)
            memo[k] = v
        return v

    import sys

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 10 * len(keys) + 100))
    try:
        for k in keys:
            level(k)
    finally:
        sys.setrecursionlimit(old)
    return memo


def _lower_bound(schedule: Schedule, lists: Mapping[int, Sequence[Action]], dur: Mapping[tuple[int, str, int], float],
                 bottom: Mapping[tuple[int, str, int], float], xfer: float) -> float:
    """A makespan no dispatch order can beat: per rank, the earliest any of its actions can start, plus
    all its work, plus the shortest chain that must follow its last action; and the longest chain."""
    S = schedule.num_stages
    place = schedule.stage_to_rank
    top: dict[tuple[int, str, int], float] = {}

    def preds(k: tuple[int, str, int]) -> list[tuple[tuple[int, str, int], float]]:
        s, t, m = k
        if t == "F":
            p = producer_stage("F", s, S)
            out = [((p, "F", m), xfer if place[p] != place[s] else 0.0)] if p is not None else []
        elif t in ("B", "I"):
            out = [((s, "F", m), 0.0)]
            p = producer_stage("B", s, S)
            if p is not None:
                g = xfer if place[p] != place[s] else 0.0
                out += [((p, "B", m), g), ((p, "I", m), g)]
        else:
            out = [((s, "I", m), 0.0)]
        return [(x, c) for x, c in out if x in dur]

    for k in sorted(dur, key=lambda k: (0 if k[1] == "F" else 1, k[0] if k[1] == "F" else -k[0], k[1] == "W")):
        top[k] = max((top[p] + dur[p] + c for p, c in preds(k) if p in top), default=0.0)
    best = max(bottom.values(), default=0.0)
    for r, acts in lists.items():
        keys = [(x.stage, x.type.value, x.microbatch) for a in acts for x in a.leaves()]
        if not keys:
            continue
        work = sum(max(dur[(x.stage, x.type.value, x.microbatch)] for x in a.leaves()) for a in acts)  # type: ignore[index]
        head = min(top[k] for k in keys)  # type: ignore[index]
        tail = min(bottom[k] - dur[k] for k in keys)  # type: ignore[index]
        best = max(best, head + work + tail)
    return best


def simulate_policy(
    schedule: Schedule,
    policy: str,
    durations: Mapping[tuple[int, str, int], float],
    *,
    transfer: float = 0.0,
    priority: Mapping[tuple[int, str, int], float] | None = None,
    plans: Mapping[int, RankPlan] | None = None,
    notice: float = 0.0,
    sends: str = "free",
) -> PolicyResult:
    """One step of ``schedule`` under ``policy`` with the given leaf ``durations`` (see the module docstring).

    ``sends``: how a rank's outputs leave for another rank.  ``"free"`` (the
    header protocol, ``static_shapes=False``): each as soon as it is produced.
    ``"held"`` (static shapes on NCCL: the peer posts its receives in the
    list's order, without headers): in the list's order per peer, an output
    produced ahead of its turn waits for the earlier ones.  ``"in_turn"``
    (static shapes on gloo, the CPU default): held as well, and an action other
    than the rank's next listed one runs only if its outputs to other ranks are
    next in their order (``RankActor._sends_in_turn``), so nothing is held.

    ``notice`` models a rank that learns of an arriving transfer only between
    its actions (pipeloom's CPU ranks run compute on the event loop's thread,
    so an announcement that comes in during an action is read, and its
    receive posted and completed, after the action ends): a transfer that
    lands while its receiver is busy is usable ``notice`` after that action
    ends, so at the decision right after it, the transfer is not yet there
    and a rule that does not wait for the head takes something else.  0 (the
    default): usable on landing.

    Every policy runs the runtime's own decision
    (:class:`pipeloom.schedules.dispatch.Dispatcher`: ``static`` is rule
    ``list``, ``dynamic`` ``ready``, ``critical`` and ``guarded`` the rules of
    those names).  ``plans`` is what ``critical`` and ``guarded`` know of the
    step (:func:`~pipeloom.schedules.dispatch.plan_ranks`); default: the plan
    from the mean duration of each stage and type in ``durations`` (what a
    runtime learns over steps), not the draw itself; ``priority`` (bottom
    levels by leaf) replaces the plan's priorities for ``critical``.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
    if sends not in SENDS:
        raise ValueError(f"unknown sends {sends!r}; one of {', '.join(SENDS)}")
    place = schedule.stage_to_rank
    flow = Dataflow(place)
    S = len(place)
    lists = _compute_lists(schedule)
    pending = {r: list(v) for r, v in lists.items()}
    live = dict.fromkeys(lists, 0)
    peak = dict.fromkeys(lists, 0)
    busy = dict.fromkeys(lists, 0.0)
    avail: dict[tuple[str, int, int], float] = {}  # ("F"|"G"|"I", stage, mb) -> when usable on the consumer's rank
    if policy in ("guarded", "critical") and plans is None:
        plans = plan_ranks(schedule, Costs(send_latency=transfer), action_costs=mean_costs(durations))
    if policy == "critical" and priority is not None and plans is not None:  # the caller's priorities instead
        plans = {r: RankPlan(cost=p.cost, wait=p.wait, priority={
            a: max(priority.get((x.stage, x.type.value, x.microbatch), 0.0) for x in a.leaves()) for a in lists[r]
        }) for r, p in plans.items()}
    dispatchers = {r: Dispatcher(v, rule=_RULE_OF[policy], plan=None if plans is None else plans.get(r)) for r, v in lists.items()}
    reordered = 0
    makespan = 0.0
    #: per rank, the (start, end) of every action started so far, in time order
    spans: dict[int, list[tuple[float, float]]] = {r: [] for r in lists}
    span_starts: dict[int, list[float]] = {r: [] for r in lists}
    remote = {"F", "G"}
    # per rank and peer: the remote outputs in the list's order (what a peer posts receives for),
    # how many have left, and the outputs produced but held for their turn
    order: dict[int, dict[int, list[tuple[str, int, int]]]] = {r: {} for r in lists}
    sent = {r: dict.fromkeys(range(len(place) and max(place) + 1), 0) for r in lists}
    held: dict[int, dict[tuple[str, int, int], float]] = {r: {} for r in lists}
    if sends != "free":
        for r, acts in lists.items():
            for a in acts:
                for key, dst in _remote_outputs(a, flow, r):
                    order[r].setdefault(dst, []).append(key)

    def in_turn(rank: int, a: Action) -> bool:
        due: dict[int, list[tuple[str, int, int]]] = {}
        for key, dst in _remote_outputs(a, flow, rank):
            due.setdefault(dst, []).append(key)
        for dst, keys in due.items():
            i = sent[rank][dst]
            if set(order[rank][dst][i:i + len(keys)]) != set(keys):
                return False
        return True

    def emit(rank: int, key: tuple[str, int, int], dst: int, t: float) -> None:
        """Output ``key`` of ``rank`` produced at ``t`` for ``dst``: usable there ``transfer`` after it leaves."""
        if sends == "free":
            avail[key] = t + transfer
            return
        seq = order[rank][dst]
        held[rank][key] = t
        i = sent[rank][dst]
        while i < len(seq) and seq[i] in held[rank]:
            k = seq[i]
            # (an earlier output leaves when produced; a later one no earlier than it)
            left = max(held[rank].pop(k), avail.get(seq[i - 1], 0.0) - transfer if i else 0.0)
            avail[k] = left + transfer
            i += 1
        sent[rank][dst] = i

    def usable(rank: int, kind: str, t: float) -> float:
        """When ``rank`` can use an input that lands at ``t``: later if the rank was busy then."""
        if not notice or kind not in remote:
            return t
        i = bisect.bisect_left(span_starts[rank], t) - 1  # the last action started before t
        if i >= 0:
            s0, e0 = spans[rank][i]
            if s0 < t < e0:
                return e0 + notice
        return t

    def need(rank: int, leaf: Action) -> list[tuple[str, int, int]]:
        s, t, m = leaf.stage, leaf.type, leaf.microbatch
        assert m is not None
        if t is _F:
            p = producer_stage("F", s, S)
            return [("F", p, m)] if p is not None else []
        if t is _B or t is _I:
            p = producer_stage("B", s, S)
            return [("Fd", s, m)] + ([("G", p, m)] if p is not None else [])
        return [("I", s, m)]

    def ready_at(rank: int, a: Action) -> float | None:
        """When every input of ``a`` is usable (None: one is not produced yet)."""
        t = 0.0
        for leaf in a.leaves():
            for key in need(rank, leaf):
                v = avail.get(key)
                if v is None:
                    return None
                t = max(t, usable(rank, key[0], v))
        return t

    def dur_of(a: Action) -> float:
        ds = []
        for leaf in a.leaves():
            k = (leaf.stage, leaf.type.value, leaf.microbatch)
            if k not in durations:
                raise ScheduleError(f"no duration for {leaf} (rank {place[leaf.stage]})")
            ds.append(durations[k])
        return max(ds) if len(ds) > 1 else ds[0]  # OVERLAP_F_B: perfect overlap

    def pick(rank: int, now: float) -> tuple[int, float | None]:
        """Index of the action to start at ``now`` (-1: none), and the earliest future time worth re-checking."""
        acts = pending[rank]

        def ready(a: Action) -> bool:
            t = ready_at(rank, a)
            if t is None or t > now:
                return False
            return sends != "in_turn" or a is acts[0] or in_turn(rank, a)

        def in_flight(a: Action) -> bool:
            return ready_at(rank, a) is not None  # produced, still travelling

        i = dispatchers[rank].pick(acts, ready, live[rank], in_flight)
        if i >= 0:
            return i, None
        later = [t for a in acts if (t := ready_at(rank, a)) is not None and t > now]
        return -1, (min(later) if later else None)

    waiting: set[int] = set()
    heap: list[tuple[float, int]] = [(0.0, r) for r in sorted(lists)]
    heapq.heapify(heap)
    free_at = dict.fromkeys(lists, 0.0)
    while heap:
        now, rank = heapq.heappop(heap)
        if now < free_at[rank] or not pending[rank]:
            continue
        i, nxt = pick(rank, now)
        if i < 0:
            if nxt is not None:
                heapq.heappush(heap, (nxt, rank))
            else:
                waiting.add(rank)
            continue
        a = pending[rank].pop(i)
        if i:
            reordered += 1
        d = dur_of(a)
        end = now + d
        spans[rank].append((now, end))
        span_starts[rank].append(now)
        busy[rank] += d
        free_at[rank] = end
        makespan = max(makespan, end)
        for leaf in a.leaves():
            s, t, m = leaf.stage, leaf.type, leaf.microbatch
            assert m is not None
            if t is _F:
                live[rank] += 1
                peak[rank] = max(peak[rank], live[rank])
                avail[("Fd", s, m)] = end
                dst = flow.activation_to[s]
                if dst is not None:
                    if dst != rank:
                        emit(rank, ("F", s, m), dst, end)
                    else:
                        avail[("F", s, m)] = end
            else:
                if t is _B or t is _I:
                    dst = flow.gradient_to[s]
                    if dst is not None:
                        if dst != rank:
                            emit(rank, ("G", s, m), dst, end)
                        else:
                            avail[("G", s, m)] = end
                    if t is _I:
                        avail[("I", s, m)] = end
                if t is _B or t is _W:
                    live[rank] -= 1
        heapq.heappush(heap, (end, rank))
        for w in list(waiting):  # something new was produced: let blocked ranks look again
            waiting.discard(w)
            heapq.heappush(heap, (max(free_at[w], now), w))
    stuck = [r for r, p in pending.items() if p]
    if stuck:
        raise ScheduleError(f"policy {policy!r} cannot finish schedule {schedule.name!r}: ranks {stuck} stuck at "
                            + ", ".join(f"{pending[r][0]}" for r in stuck))
    return PolicyResult(policy, makespan, busy, peak, reordered)


_RULE_OF = {"static": "list", "dynamic": "ready", "critical": "critical", "guarded": "guarded"}

#: ``simulate_policy``'s ``sends`` models (see there)
SENDS = ("free", "held", "in_turn")


def _remote_outputs(a: Action, flow: Dataflow, rank: int) -> list[tuple[tuple[str, int, int], int]]:
    """The outputs of ``a``'s leaves that go to another rank, as (avail key, destination rank)."""
    out = []
    for leaf in a.leaves():
        s, t, m = leaf.stage, leaf.type, leaf.microbatch
        if t is _F:
            dst = flow.activation_to[s]
            if dst is not None and dst != rank:
                out.append((("F", s, m), dst))
        elif t is _B or t is _I:
            dst = flow.gradient_to[s]
            if dst is not None and dst != rank:
                out.append((("G", s, m), dst))
    return out


def mean_costs(durations: Mapping[tuple[int, str, int], float]) -> dict[tuple[int, str, int | None], float]:
    """The mean duration per ``(stage, type, None)`` of per-microbatch ``durations``."""
    sums: dict[tuple[int, str, int | None], list[float]] = {}
    for (s, t, _m), v in durations.items():
        sums.setdefault((s, t, None), []).append(v)
    return {k: sum(v) / len(v) for k, v in sums.items()}


def policy_ceiling(
    schedule: Schedule,
    costs: Costs,
    *,
    policies: Sequence[str] = POLICIES,
    trials: int = 20,
    seed: int = 0,
    length_range: tuple[float, float] | None = (0.25, 1.0),
    jitter: float = 0.0,
    slow: Mapping[int, float] | None = None,
    sends: str = "free",
    notice: float = 0.0,
) -> dict[str, float]:
    """Mean makespan per policy over ``trials`` draws (lengths uniform in ``length_range`` x max, jitter, slow ranks).

    ``sends`` and ``notice``: :func:`simulate_policy`'s.

    Two more entries: ``best``, the mean of each trial's best policy; and
    ``bound``, the mean of a lower bound no order can beat (the busiest
    rank's work, or the longest dependency chain, whichever is longer) --
    the ceiling of any reordering, not necessarily reachable.
    """
    rng = random.Random(seed)
    lists = _compute_lists(schedule)
    totals = dict.fromkeys([*policies, "best", "bound"], 0.0)
    for _ in range(trials):
        lengths = None
        if length_range is not None:
            lo, hi = length_range
            raw = [rng.uniform(lo, hi) for _ in range(schedule.num_microbatches)]
            mean = sum(raw) / len(raw)
            lengths = [x / mean for x in raw]  # same total work as uniform lengths
        durs = draw_costs(schedule, costs, lengths=lengths, jitter=jitter, slow=slow, rng=rng)
        prio = _bottom_levels(schedule, durs, costs.transfer)
        got = [simulate_policy(schedule, p, durs, transfer=costs.transfer, priority=prio, sends=sends, notice=notice).makespan for p in policies]
        for p, v in zip(policies, got):
            totals[p] += v
        totals["best"] += min(got)
        totals["bound"] += _lower_bound(schedule, lists, durs, prio, costs.transfer)
    return {p: v / trials for p, v in totals.items()}

