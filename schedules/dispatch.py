"""The dispatch decision: which of a rank's pending actions runs next (pure, no processes, no clock).

Problem (issue 19).  pipeloom dispatches by readiness so that uneven work --
microbatches of different lengths, a slow or jittery rank -- does not leave a
rank idle behind a blocked list entry.  Measured (GPUs) and simulated
(``benchmarks/policy_room.py``), the dispatcher as it was -- *the first ready
action in list order* -- gains little and sometimes loses: an action taken
early while the list's head waits is not preemptible, so when the head's
input arrives a moment later the head (often on the critical path) is late
by the filler's whole duration.  A list scheduling anomaly: greedy is not
monotone.

Alternatives (all simulated on the seven schedules, 2 and 4 ranks, uneven
lengths, jitter, a slow rank: ``benchmarks/policy_room.py``, numbers in
benchmarks/RESULTS.md).  Each is a rule here, so the simulator runs exactly
the runtime's decision:

* ``ready`` -- the first ready action in list order (the old dispatcher).
  Gains where the schedule leaves memory headroom (GPipe: +2..6% on uneven
  lengths, +16% with a slow rank at 4 ranks), loses 1-4% on 1F1B and
  DualPipeV at 4 ranks and on interleaved zero-bubble with fixed lengths.
* ``critical`` -- among ready actions the one with the longest remaining
  dependency chain in the static plan (mean costs), W last.  Best on GPipe
  (+4..12% on uneven lengths at 4 ranks), worse than the list on every
  zero-bubble schedule, whose lists were built to place W where it is free.
* ``guarded`` -- *backfilling* as in HPC batch schedulers (EASY
  backfilling): the list's head runs as soon as it is ready; while it waits,
  a later ready action may run only if it fits in the hole the static plan
  leaves before the head on this rank (less what fillers already used), so
  it cannot make the head late in the plan; a head whose input is already
  in flight (announced by its sender) is waited for.  It never loses, and
  in simulation it almost never reorders either: with mean costs the plans
  of 1F1B-like and zero-bubble lists have no holes outside warm-up, and
  the holes that uneven work opens are not known in advance.
* ``auto`` -- per schedule, simulate ``ready``, ``guarded`` and ``critical``
  against the static order on uneven lengths, jitter and a slow rank
  (:func:`choose_rule`) and take one only where it wins by more than 2% on
  some workload and loses no more than 0.5% on any, fixed lengths included;
  else ``list``, the static order itself (a predicted gain of a percent or
  two is within what the simulator misses, and reordering is not free on a
  GPU).  The simulator is the policy's judge, once per schedule and
  transport, with the runtime's own send discipline (static shapes: outputs
  reach each peer in list order, and a reordered action runs only if its
  outputs are next in it) and, on CPU ranks, the notice delay: ``ready`` on
  GPipe at 4 ranks; ``critical`` on GPipe at 2 ranks (8 or 16 microbatches)
  on CPU ranks or with headers; ``list`` everywhere else (LoopedBFS at 4
  ranks took ``ready`` before the send order was simulated, which gains
  nothing once sends go in turn and loses 1-55% where they are held).

What none of them reaches: the lower bound (busiest rank's work, longest
chain) leaves 10-60% on uneven lengths, but most of it is out of reach of
*reordering* under the memory cap -- the ranks see the microbatches in the
same order, so a long one delays every rank in turn; what would close it is
changing which microbatch goes where (sorting lengths into the pipeline's
fill and drain), a data decision, not a dispatch one.

Guarantees, for every rule (the runtime relies on them; tests check them on
every named schedule):

* **Memory.**  A forward is eligible only if it is the first pending forward
  (forwards run in list order among themselves) and the rank holds fewer
  live microbatches than the static order's peak.  Forwards done are then a
  prefix of the list's forwards, and backwards done early only free memory,
  so at any moment ``live <= static_live(p)`` where ``p`` is the position of
  the first pending action: no rule holds more than the list would.
* **Deadlock freedom, in the validator's terms.**  The validator
  (``check_deadlock``) accepts a schedule when every rank running its list
  in order finishes, i.e. there is a global order of all actions consistent
  with each rank's list and every data dependency.  Suppose some rule got
  stuck: every rank's head (first pending action) waits.  Take the head
  ``h`` earliest in that global order.  Each input of ``h`` comes from an
  action ``d`` earlier in the global order; on ``d``'s rank, ``d`` precedes
  that rank's head in its list (else that head would precede ``d``, hence
  ``h``), and everything before a head is done -- so ``h``'s inputs are
  there.  ``h`` is also eligible: if it is a forward it is the first pending
  forward, and by the memory argument ``live <= static_live(p) <= peak - 1``
  before it.  Every rule runs an eligible ready head (``guarded`` runs the
  head first; ``ready`` takes the first ready eligible action in list
  order; ``critical`` some ready eligible action, there being one), so no
  rank is stuck.  The rules differ only in which *other*
  ready action may go first; none waits while its head is ready.
* **Pairing order.**  The rule decides compute only; transfers are
  sequenced per peer by the sender (``transport/tensor.py``) whatever the
  order, so dispatch never changes which receive matches which send.
* ``list`` is the deterministic mode: the head or nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .action import Action, ActionType
from .dataflow import consumer_stage
from .schedule import Schedule
from .simulate import Costs, simulate

__all__ = ["OVERLAP_MARGIN", "RULES", "Dispatcher", "OverlapTrial", "host_heavy", "RankPlan", "backward_overlap_pays", "choose_rule", "overlappable_backwards", "plan_ranks",
           "stage_streams", "static_peak"]

#: The dispatch rules: ``list`` (deterministic), ``ready`` (first ready in list order),
#: ``critical`` (longest planned remaining path first, W last), ``guarded`` (backfill the
#: head's planned wait), ``auto`` (one of ready/critical/guarded where simulation says it
#: pays, else list).
RULES = ("list", "ready", "critical", "guarded", "auto")

_F, _B, _I, _W, _OVL = ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.OVERLAP_F_B
_EPS = 1e-9


def static_peak(actions: Sequence[Action]) -> int:
    """Peak live microbatches (forward done, B or W not yet) if the list ran in order (at least 1)."""
    live = peak = 0
    for a in actions:
        for leaf in a.leaves():
            if leaf.type is _F:
                live += 1
                peak = max(peak, live)
            elif leaf.type is _B or leaf.type is _W:
                live -= 1
    return max(peak, 1)


def _is_forward(a: Action) -> bool:
    return a.type is _F or a.type is _OVL


@dataclass(frozen=True)
class RankPlan:
    """What the ``guarded`` rule knows of one rank's static plan, in the plan's time unit."""

    cost: Mapping[Action, float] = field(default_factory=dict)
    """Expected duration of each compute action of the rank."""
    wait: Mapping[Action, float] = field(default_factory=dict)
    """Idle time the static plan leaves on this rank right before the action (its hole)."""
    priority: Mapping[Action, float] = field(default_factory=dict)
    """Longest dependency chain from the action's start to the end of the step."""


def plan_ranks(
    schedule: Schedule, costs: Costs | None = None, *, action_costs: Mapping[tuple[int, str, int | None], float] | None = None
) -> dict[int, RankPlan]:
    """Every rank's :class:`RankPlan`: the compute-only list simulated with ``costs`` (default :class:`Costs`)."""
    from .policy_sim import _bottom_levels, _compute_lists  # (policy_sim imports this module)

    costs = Costs() if costs is None else costs
    lists = _compute_lists(schedule)
    compute_only = Schedule(
        name=schedule.name, actions=lists, stage_to_rank=schedule.stage_to_rank, num_microbatches=schedule.num_microbatches
    ) if any(a.is_comm for acts in schedule.actions.values() for a in acts) else schedule
    base = {"F": costs.F, "B": costs.B, "I": costs.I, "W": costs.W}
    leaf_cost: dict[tuple[int, str, int], float] = {}
    for acts in lists.values():
        for a in acts:
            for x in a.leaves():
                if x.microbatch is None:
                    continue
                k = (x.stage, x.type.value, x.microbatch)
                v = None
                if action_costs:
                    v = action_costs.get(k, action_costs.get((x.stage, x.type.value, None)))
                leaf_cost[k] = base[x.type.value] if v is None else float(v)
    res = simulate(compute_only, costs, action_costs=leaf_cost)
    bottom = _bottom_levels(compute_only, leaf_cost, costs.transfer)
    plans: dict[int, RankPlan] = {}
    last: dict[int, float] = {}
    waits: dict[int, dict[Action, float]] = {r: {} for r in lists}
    for e in res.events:
        if e.lane != "compute":
            continue
        waits[e.rank][e.action] = max(0.0, e.start - last.get(e.rank, 0.0))
        last[e.rank] = e.end
    for r, acts in lists.items():
        cost = {a: max(leaf_cost[(x.stage, x.type.value, x.microbatch)] for x in a.leaves()) for a in acts}
        prio = {a: max(bottom.get((x.stage, x.type.value, x.microbatch), 0.0) for x in a.leaves()) for a in acts}
        plans[r] = RankPlan(cost=cost, wait=waits[r], priority=prio)
    return plans


class Dispatcher:
    """One rank's dispatch rule over one step (call :meth:`begin_step` at each step's start).

    ``pick(pending, ready, live)`` returns the index in ``pending`` of the
    action to run now, or -1 to wait for the next event.  ``pending`` is the
    rank's list with the actions already run removed (list order kept);
    ``ready(a)`` says whether ``a``'s inputs are there (and, on a GPU,
    committable); ``in_flight(a)``, when given, whether an input ``a`` lacks
    is already announced by its sender (it will arrive without further
    compute anywhere).  The caller updates ``live`` (forwards done minus
    backwards that freed their activations) and runs what is picked.
    """

    def __init__(self, actions: Sequence[Action], *, rule: str = "ready", plan: RankPlan | None = None, train: bool = True) -> None:
        if rule not in RULES or rule == "auto":
            raise ValueError(f"dispatch rule {rule!r}: expected one of list, ready, critical, guarded (auto is resolved by choose_rule)")
        if rule in ("guarded", "critical") and plan is None:
            raise ValueError(f"dispatch rule {rule!r} needs the rank's plan (plan_ranks)")
        self.rule = rule
        self.plan = plan
        self.train = train
        #: the static order's peak of live microbatches: no rule holds more
        self.memory_limit = static_peak(actions)
        self._head: Action | None = None
        self._used = 0.0  # of the current head's planned wait, by fillers
        #: critical: this rank's actions by the rule's key, best first, so that a pick asks
        #: ``ready`` only until the first ready one (the host cost per action on a GPU)
        self._by_key: list[Action] = []
        self._known: set[int] = set()
        if rule == "critical":
            prio = plan.priority  # type: ignore[union-attr]
            order = sorted(range(len(actions)), key=lambda i: (actions[i].type is not _W, prio.get(actions[i], 0.0), -i), reverse=True)
            self._by_key = [actions[i] for i in order]
            self._known = {id(a) for a in actions}

    def begin_step(self) -> None:
        self._head = None
        self._used = 0.0

    def _eligible_forward(self, live: int) -> bool:
        return not self.train or live < self.memory_limit

    def pick(
        self,
        pending: Sequence[Action],
        ready: Callable[[Action], bool],
        live: int,
        in_flight: Callable[[Action], bool] | None = None,
    ) -> int:
        if not pending:
            return -1
        rule = self.rule
        head = pending[0]
        if rule == "list":
            return 0 if (not _is_forward(head) or self._eligible_forward(live)) and ready(head) else -1
        if rule == "ready":
            seen_forward = False
            for i, a in enumerate(pending):
                fwd = _is_forward(a)
                if not (fwd and (seen_forward or not self._eligible_forward(live))) and ready(a):
                    return i
                seen_forward = seen_forward or fwd
            return -1
        if rule == "critical":
            known = self._known
            if known and all(id(a) in known for a in pending):
                # the same choice as the scan below: the best key among ready eligible actions
                at = {id(a): i for i, a in enumerate(pending)}
                first_fwd = next((i for i, a in enumerate(pending) if _is_forward(a)), -1)
                fwd_ok = self._eligible_forward(live)
                for a in self._by_key:
                    i = at.get(id(a), -1)
                    if i < 0 or (_is_forward(a) and (i != first_fwd or not fwd_ok)):
                        continue
                    if ready(a):
                        return i
                return -1
            prio = self.plan.priority  # type: ignore[union-attr]
            best, best_key = -1, None
            seen_forward = False
            for i, a in enumerate(pending):
                fwd = _is_forward(a)
                if not (fwd and (seen_forward or not self._eligible_forward(live))) and ready(a):
                    key = (a.type is not _W, prio.get(a, 0.0), -i)
                    if best_key is None or key > best_key:
                        best, best_key = i, key
                seen_forward = seen_forward or fwd
            return best
        # guarded: the head when ready; else a filler that fits in what is left of its planned wait
        plan = self.plan
        assert plan is not None
        if head != self._head:
            self._head, self._used = head, 0.0
        head_fwd = _is_forward(head)
        if (not head_fwd or self._eligible_forward(live)) and ready(head):
            return 0
        if in_flight is not None and in_flight(head):
            return -1
        budget = plan.wait.get(head, 0.0) - self._used
        if budget <= _EPS:
            return -1
        cost, prio = plan.cost, plan.priority
        best, best_key = -1, None
        seen_forward = head_fwd
        for i in range(1, len(pending)):
            a = pending[i]
            fwd = _is_forward(a)
            if not (fwd and (seen_forward or not self._eligible_forward(live))):
                c = cost.get(a, 0.0)
                if c <= budget + _EPS and ready(a):
                    key = (a.type is not _W, prio.get(a, 0.0), -i)
                    if best_key is None or key > best_key:
                        best, best_key = i, key
            seen_forward = seen_forward or fwd
        if best > 0:
            self._used += cost.get(pending[best], 0.0)
        return best


def choose_rule(
    schedule: Schedule,
    costs: Costs | None = None,
    *,
    trials: int = 4,
    seed: int = 0,
    min_gain: float = 0.02,
    max_loss: float = 0.005,
    max_actions: int = 1200,
    sends: str = "free",
    notice: float = 0.0,
) -> str:
    """``auto``'s choice for ``schedule``: ``ready``, ``critical`` or ``guarded`` where one pays, else ``list``.

    Simulated against the static order (rule ``list``) on four workloads
    (lengths uniform in 0.25..1 of the longest, per-action jitter sigma 0.2,
    each ``trials`` seeded draws; rank 1 1.5x slower; fixed lengths): a rule
    is taken only if it beats the static order by more than ``min_gain`` on
    some uneven workload and is slower than it by no more than ``max_loss``
    on *any* workload, fixed lengths included; of several such, the one with
    the larger best gain (on a tie the simpler: ready, then guarded, then
    critical).  Otherwise ``list``: the static order itself, so that where
    the simulator sees no clear gain the default costs nothing (a reordered
    action on a GPU, or a rule's bookkeeping on the host, is not free, and
    a predicted gain under ~2% is within what the model misses: measured on
    GPUs, the old ``ready`` rule was 5% slower on ZBVZeroBubble where it
    was simulated +0.3%).  The work of a real run is not known at start-up,
    so the decision is about the shape of the schedule (how much it lets
    reordering do), not the run.  Deterministic: every rank computes the
    same.  Costs 0.01-2 s; a schedule of more than ``max_actions`` compute
    actions is not simulated and gets ``list``.

    ``sends`` and ``notice``: :func:`~pipeloom.schedules.policy_sim.simulate_policy`'s
    models of the transport (``runtime/actor.py`` ``_auto_rule`` passes the
    runtime's: ``"in_turn"`` with static shapes, a CPU rank's notice delay).
    """
    from .policy_sim import _compute_lists, policy_ceiling

    if sum(len(v) for v in _compute_lists(schedule).values()) > max_actions:
        return "list"  # too large to simulate at start-up (quadratic): the static order
    costs = Costs(send_latency=0.05) if costs is None else costs  # default: a transfer is 1/20 of a forward
    pols = ("static", "dynamic", "guarded", "critical")
    slow = {1: 1.5} if len(schedule.actions) > 1 else None
    runs = [
        policy_ceiling(schedule, costs, policies=pols, trials=trials, seed=seed, length_range=(0.25, 1.0), sends=sends, notice=notice),
        policy_ceiling(schedule, costs, policies=pols, trials=trials, seed=seed, length_range=None, jitter=0.2, sends=sends, notice=notice),
        policy_ceiling(schedule, costs, policies=pols, trials=1, seed=seed, length_range=None, slow=slow, sends=sends, notice=notice),
    ]
    fixed = policy_ceiling(schedule, costs, policies=pols, trials=1, seed=seed, length_range=None, sends=sends, notice=notice)
    best, best_gain = "static", min_gain
    for p in pols[1:]:  # on a tie, the simpler rule stays
        if any(r[p] > (1.0 + max_loss) * r["static"] for r in (*runs, fixed)):
            continue
        gain = max(r["static"] / r[p] - 1.0 for r in runs)
        if gain > best_gain + 1e-9:
            best, best_gain = p, gain
    return {"static": "list", "dynamic": "ready", "critical": "critical", "guarded": "guarded"}[best]


#: ``backward_overlap_pays``'s safety factor: a backward goes beside a forward on one stream only where its
#: host launch outlasts both device times by this much.  The cost of a wrong "beside" on a device-bound rank
#: (the forward's kernels delay every input gradient the previous rank waits for) is far larger than the gain
#: of a right one near the boundary, and the host time it reads is a mean over a few noisy learning steps.
#: 4 x H200, GPT size l, 1F1B (session M): one rank of four learned a host launch of 1.18x and, in a second
#: run, another 1.05x its B's and F's device times, launched beside, and the step took 1.32x and 1.36x torch's
#: (the inline runs of sessions K and L: 0.99-1.01).  Every recorded size-s decision (host-bound) read
#: 1.5-6.3x on the inner ranks; the last rank's 1.03-1.46x flip to inline.
OVERLAP_MARGIN = 1.25


def backward_overlap_pays(shares_stream: bool, host_b: float | None, device_b: float | None,
                          device_f: float | None, margin: float = OVERLAP_MARGIN) -> bool | None:
    """``RuntimeOptions.host_overlap_backward`` auto: whether a B is launched on the worker beside the F after it.

    On two streams yes (their kernels run side by side).  On one stream the F's kernels queue
    among the B's: the B's input gradients, which the previous rank waits for, leave no later
    only if the device can run both while the host is still launching the B, i.e. the B's mean
    host launch time (``host_b``, ms) exceeds the B's and the F's device times together
    (``device_b``, ``device_f``) by ``margin`` (default ``OVERLAP_MARGIN``; 1.0 was the rule before session M,
    which replays of runs recorded then use); None while any is not learned.  (4 x GPUs,
    GPT 1F1B: size s launches a B in 2.1-2.5 ms that runs 0.6-1.4 ms, an F 0.3-0.9 ms: overlapped,
    x0.76 of the inline step on H200; size l launches in 3.6-4.0 ms, runs 3.9-6.0 ms: inline;
    overlapped regardless it took x1.41-1.50, and one rank overlapped by a margin of 1.05-1.18 took
    x1.32-1.36.  A launch against the B's device time alone let the device-bound ranks through.)

    Pure, and here rather than in ``runtime/device.py`` so that the simulator
    (``simulate(host_overlap_backward="auto")``) applies the runtime's own rule.
    """
    if not shares_stream:
        return True
    if host_b is None or device_b is None or device_f is None:
        return None
    return host_b > margin * (device_b + device_f)


def host_heavy(host_b: float | None, host_f: float | None, device_b: float | None, device_f: float | None) -> bool:
    """Whether a rank's host launches a B and the F after it in more time than its device runs them (ms, learned
    means): inline, such a rank's device waits on its host every microbatch, whatever ``backward_overlap_pays``
    says about the B alone.  The candidates of :class:`OverlapTrial`."""
    if None in (host_b, host_f, device_b, device_f):
        return False
    return host_b + host_f > device_b + device_f  # type: ignore[operator]


class OverlapTrial:
    """``RuntimeOptions.host_overlap_trial``: try the host-heavy pairs beside, keep them where the steps got faster.

    ``backward_overlap_pays`` judges a pair from learned times alone, and near its margin they do not tell
    which way pays: a host-bound rank kept inline may lose 10% (2 x H200, a GPT of size s with a 128k head,
    1F1B: the last rank's B launched in 3.7 ms against 2.6 + 1.7 ms of device time, inline, step x1.05-1.08 of
    torch's; beside, x0.93), while a rank that read 1.05-1.18x and went beside took a device-bound step to 1.32x
    (session M).  So the rule's "no" for a pair whose B and F take the host longer than the device
    (:func:`host_heavy`) is put to the test: once every pair is decided, ``blocks`` blocks of ``steps`` training
    steps alternate between the rule's choice and those pairs beside (base, trial, base, trial, ...), and the
    pairs stay beside only if the median step period of the trial blocks is at least ``gain`` below the base
    blocks'.  A step period is the time from one training step's start to the next's, so the caller's work
    between steps counts alike in both.  Pure: the actor feeds it the periods."""

    def __init__(self, steps: int = 2, blocks: int = 4, gain: float = 0.03) -> None:
        self.steps, self.blocks, self.gain = steps, blocks, gain
        #: "wait" (pairs not all decided, or none to try) -> "run" (blocks alternating) -> "done"
        self.phase = "wait"
        self.block = 0  #: the block running (even: base, odd: trial)
        self.periods: tuple[list[float], list[float]] = ([], [])  #: (base, trial) step periods, seconds
        self._in_block = 0
        self.kept: bool | None = None  #: done: the pairs stay beside?

    @property
    def on(self) -> bool:
        """Whether the candidate pairs launch beside in the step starting now."""
        return (self.phase == "run" and self.block % 2 == 1) or (self.phase == "done" and bool(self.kept))

    def start(self) -> None:
        """Every pair is decided and some are candidates: the blocks begin with the next step."""
        if self.phase == "wait":
            self.phase = "run"

    def reset(self) -> None:
        """The learned times were dropped (``RankActor.relearn``): decide and try again."""
        self.__init__(self.steps, self.blocks, self.gain)  # type: ignore[misc]

    def record(self, period: float | None) -> None:
        """The step that just ended took ``period`` seconds (start to the next start); None: not comparable (an
        evaluation step in between, another input layout): the block runs one more step."""
        if self.phase != "run" or period is None:
            return
        self.periods[self.block % 2].append(period)
        self._in_block += 1
        if self._in_block < self.steps:
            return
        self._in_block = 0
        self.block += 1
        if self.block >= self.blocks:
            base, trial = (sorted(p)[len(p) // 2] for p in self.periods)
            self.kept = trial < (1.0 - self.gain) * base
            self.phase = "done"

    def state(self) -> dict[str, object]:
        return {"phase": self.phase, "on": self.on, "kept": self.kept, "base_ms": [round(p * 1e3, 2) for p in self.periods[0]],
                "trial_ms": [round(p * 1e3, 2) for p in self.periods[1]]}


def stage_streams(option: bool | None, actions: Sequence[Action], *, stage_collectives: bool = False) -> bool:
    """``RuntimeOptions.overlap_streams`` for a rank's list: one compute stream per local stage, or all on one.

    ``None`` (auto): a stream per stage where the list has ``OVERLAP_F_B`` actions, whose halves (two stages)
    are meant to run at once, or weight-gradient (W) actions, fillers off the critical path that a second
    stream runs beside another stage's input gradient or forward (ZBVZeroBubble, InterleavedZeroBubble).
    Elsewhere (Interleaved1F1B, LoopedBFS: F and B only) a rank's stages share one stream: two streams let
    the device run one stage's kernels among another's, and where each kernel fills the GPU that slows the
    action a peer waits for (its output leaves later) and adds nothing.  2 x H200, GPT, same process
    (``benchmarks/RESULTS.md``): Interleaved1F1B size l 237.0 / 241.5 ms on one stream, 255.7 / 258.2 on two
    (torch 247.3 / 253.5), size s level; ZBVZeroBubble size l 326.8 ms on two, 344.4 on one, size s level;
    DualPipeV size l 4% faster on two (an earlier round).  ``stage_collectives``: the stages issue
    collectives of their own on their streams (expert parallelism's all-to-alls): auto keeps a stream per
    stage, so that one stage's exchange runs while another computes.  Pure, so that the simulator and the
    tuner apply the runtime's own choice.
    """
    if option is not None:
        return option
    if stage_collectives:
        return True
    return any(a.type is ActionType.OVERLAP_F_B or a.type is ActionType.W for a in actions)


def overlappable_backwards(schedule: Schedule) -> dict[int, frozenset[tuple[int, int]]]:
    """Per rank, the backwards ``(stage, microbatch)`` that ``RuntimeOptions.host_overlap_backward`` may launch
    beside the forward after them without a deadlock.

    With the option a B that a rank's compute list follows with a plain F runs on a worker thread while
    the loop runs the F, and the B's outputs leave only once the F has been dispatched (its input arrived,
    or on GPUs posted ahead of the device).  That adds, for each such pair, an edge "F dispatched -> B's
    output sent" to the order the list already imposes, for every forward of the run of forwards after the
    B (while it is in flight the loop may dispatch any of them).  If the F's input itself depends on that output
    (a custom list ``0F0 0B0 0F1 ...`` / ``1F0 1B0 1F1 ...``: rank 1's F1 needs rank 0's F1, which rank 0
    runs after its B0, which needs rank 1's B0 gradient), the ranks would wait on each other forever.
    This builds the happens-before graph of every rank's compute list (list order plus each output to its
    consumer) with the pairs' edges added, and keeps the pairs greedily in list order while the graph
    stays acyclic.  The generated schedules keep every pair (tests/test_dispatch.py).
    """
    return _beside_plan(schedule, False)[0]


def queueable_backwards(schedule: Schedule) -> tuple[dict[int, frozenset[tuple[int, int]]], dict[int, frozenset[tuple[int, int]]]]:
    """``RuntimeOptions.host_queue_backwards``: per rank, (the backwards that may launch beside the forwards
    after them, the backwards ``(stage, microbatch)`` that may be queued on the worker behind the backward the
    list runs just before them).

    A queued backward's input must come from another rank (or none: the last stage), so that taking it
    never waits on a local producer in flight; while the first is in flight the loop dispatches the
    queued one and the forwards after it, so each of those gets an edge to the first's outputs' consumers,
    and the pairs and queued backwards are kept greedily in list order while the happens-before graph stays
    acyclic, as in :func:`overlappable_backwards` (which this extends: its pairs are kept first).
    """
    return _beside_plan(schedule, True)


def _beside_plan(schedule: Schedule, queue: bool) -> tuple[dict[int, frozenset[tuple[int, int]]], dict[int, frozenset[tuple[int, int]]]]:
    """(overlappable_backwards, queueable_backwards) of ``schedule``: see them."""
    nodes: list[tuple[int, int]] = []
    index: dict[tuple[int, int], int] = {}
    where: dict[tuple[ActionType, int, int], int] = {}  # (type, stage, mb) of a leaf -> its action's node
    lists: dict[int, list[Action]] = {}
    for rank, acts in schedule.actions.items():
        lists[rank] = [a for a in acts if a.is_compute]
        for k, a in enumerate(lists[rank]):
            index[(rank, k)] = len(nodes)
            nodes.append((rank, k))
            for leaf in a.leaves():
                if leaf.microbatch is not None:
                    where[(leaf.type, leaf.stage, leaf.microbatch)] = index[(rank, k)]
    n_stages = schedule.num_stages
    base: list[set[int]] = [set() for _ in nodes]
    outs: dict[int, set[int]] = {}  # a node's data edges (to its outputs' consumers)
    for rank, acts in lists.items():
        for k, a in enumerate(acts):
            u = index[(rank, k)]
            if k + 1 < len(acts):
                base[u].add(index[(rank, k + 1)])
            for leaf in a.leaves():
                mb = leaf.microbatch
                if leaf.type is ActionType.F:
                    c = consumer_stage("F", leaf.stage, n_stages)
                    targets = [where.get((ActionType.F, c, mb))] if c is not None else []
                elif leaf.type in (ActionType.B, ActionType.I):
                    c = consumer_stage("B", leaf.stage, n_stages)
                    targets = ([where.get((ActionType.B, c, mb)), where.get((ActionType.I, c, mb))]
                               if c is not None else [])
                else:
                    targets = []
                for v in targets:
                    if v is not None and v != u:
                        outs.setdefault(u, set()).add(v)
    place = schedule.stage_to_rank

    def remote_input(rank: int, a: Action) -> bool:  # a B's gradient comes from another rank, or none comes
        return a.stage == n_stages - 1 or place[a.stage + 1] != rank

    # candidates: a plain B followed by a plain F on the same rank ("F"), and (queue) a plain B followed by a
    # plain B whose input comes from another rank ("B": the second queued behind the first on the worker)
    cands = [(rank, k, "F") for rank, acts in lists.items() for k in range(len(acts) - 1)
             if acts[k].type is ActionType.B and acts[k + 1].type is ActionType.F]
    if queue:
        cands += [(rank, k, "B") for rank, acts in lists.items() for k in range(len(acts) - 1)
                  if acts[k].type is ActionType.B and acts[k + 1].type is ActionType.B and remote_input(rank, acts[k + 1])]
    chosen: set[tuple[int, int, str]] = set()

    def acyclic(pairs: set[tuple[int, int, str]]) -> bool:
        succ = [set(b) for b in base]
        for u, vs in outs.items():
            succ[u] |= vs
        for rank, k, kind in pairs:  # the B's outputs may leave after everything dispatched while it is in flight
            b = index[(rank, k)]
            acts = lists[rank]
            j = k + 1
            if kind == "B":  # the next backward, queued behind it, then the forwards after that one
                for v in outs.get(b, ()):
                    succ[index[(rank, j)]].add(v)
                j += 1
            while j < len(acts) and acts[j].type is ActionType.F:  # (only forwards run beside a backward)
                for v in outs.get(b, ()):
                    succ[index[(rank, j)]].add(v)
                j += 1
        indeg = [0] * len(nodes)
        for vs in succ:
            for v in vs:
                indeg[v] += 1
        ready = [u for u, d in enumerate(indeg) if d == 0]
        seen = 0
        while ready:
            u = ready.pop()
            seen += 1
            for v in succ[u]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    ready.append(v)
        return seen == len(nodes)

    if cands and acyclic(set(cands)):
        chosen = set(cands)
    else:
        for pair in cands:
            if acyclic(chosen | {pair}):
                chosen.add(pair)
    out: dict[int, frozenset[tuple[int, int]]] = {}
    queued: dict[int, frozenset[tuple[int, int]]] = {}
    for rank in lists:
        keep = {(lists[rank][k].stage, lists[rank][k].microbatch) for r, k, kind in chosen if r == rank and kind == "F"}
        out[rank] = frozenset((s, mb) for s, mb in keep if mb is not None)
        keep = {(lists[rank][k + 1].stage, lists[rank][k + 1].microbatch) for r, k, kind in chosen if r == rank and kind == "B"}
        queued[rank] = frozenset((s, mb) for s, mb in keep if mb is not None)
    return out, queued
