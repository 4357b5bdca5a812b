"""Schedule generators: the compute order of torch 2.13's named pipeline schedules.

Why re-implement instead of importing torch's classes?  ``pipeloom.schedules``
must stay stdlib-only (it runs in the CLI, the validator and the simulator,
where building mock ``PipelineStage`` objects is not an option), and torch's
classes mix three concerns that pipeloom keeps apart: the compute order, the
``None`` bubbles that a lock-step runtime needs, and the lowering to sends,
receives and gradient reductions.  Here only the first is produced; bubbles are
meaningless to an event-driven runtime and lowering lives in ``lowering.py``.

The contract is strict compatibility: for every (ranks, microbatches, stages
per rank) that torch's class of the same name accepts, each rank's compute
order equals torch's with bubbles and ``REDUCE_GRAD`` removed; where torch's
constructor raises, :func:`generate` raises :class:`ScheduleConfigError` naming
the rule.  The algorithms are ports of torch's (``_get_1f1b_rank_ops``,
``_get_warmup_ops``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``...) so
that the correspondence can be checked line by line; ``tests/test_generators.py``
checks it against torch itself.

Where "what torch does" is ambiguous, we follow what torch *runs*:

* ``1F1B``: torch's ``Schedule1F1B._get_pipeline_order`` shows the last rank
  starting at ``F1`` (and ending with a nonexistent ``F{n}``); what its runtime
  ``_step_microbatches`` executes, and what we produce, is ``F0 B0 F1 B1 ...``.
* ``num_microbatches == 0`` is rejected for every schedule (torch's GPipe
  builds an empty order for it; there is nothing to run).
* ``stages_per_rank=1`` is accepted by Interleaved1F1B, LoopedBFS and
  InterleavedZeroBubble, as by torch's classes (only torch's visualizer
  helper insists on two or more).

Every generator is linear in the number of actions: a 64-rank, 2-stages-per-rank,
256-microbatch schedule (about 100k actions) takes tens of milliseconds.
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .action import Action, ActionType
from .schedule import Schedule, ScheduleError, loop_mapping, v_mapping

__all__ = [
    "SCHEDULE_NAMES",
    "ScheduleConfigError",
    "canonical_name",
    "default_stages_per_rank",
    "generate",
    "placement_style",
]

SCHEDULE_NAMES: tuple[str, ...] = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)

_SINGLE_STAGE = frozenset({"GPipe", "1F1B"})
_V_SHAPED = frozenset({"ZBVZeroBubble", "DualPipeV"})
_BY_LOWER: dict[str, str] = {}
for _name in SCHEDULE_NAMES:
    _BY_LOWER[_name.lower()] = _name
    _BY_LOWER["schedule" + _name.lower()] = _name  # torch's class names
del _name

_F = ActionType.F
_B = ActionType.B
_I = ActionType.I
_W = ActionType.W
_OVERLAP = ActionType.OVERLAP_F_B


class ScheduleConfigError(ScheduleError):
    """A configuration that the named schedule rejects; the message names the rule and the values."""


def canonical_name(name: str) -> str:
    """The canonical spelling of a schedule name.

    Case-insensitive, and torch's class names (``Schedule1F1B``,
    ``ScheduleInterleaved1F1B``) are accepted too, so that names copied from
    torch code or torchtitan configs work unchanged.
    """
    if isinstance(name, str):
        found = _BY_LOWER.get(name.strip().lower())
        if found is not None:
            return found
    raise ScheduleConfigError(
        f"unknown schedule {name!r}; known schedules: {', '.join(SCHEDULE_NAMES)} "
        "(case-insensitive; torch class names such as 'ScheduleInterleaved1F1B' work too)"
    )


def default_stages_per_rank(name: str) -> int:
    """Stages per rank when none is given: 1 for GPipe and 1F1B, 2 for the multi-stage schedules."""
    return 1 if canonical_name(name) in _SINGLE_STAGE else 2


def placement_style(name: str) -> str:
    """How stages map to ranks: ``"v"`` (rank r holds r and 2p-1-r) for ZBV and DualPipeV, else ``"loop"``."""
    return "v" if canonical_name(name) in _V_SHAPED else "loop"


# ---------------------------------------------------------------- validation


def _check_int(what: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleConfigError(f"{what} must be an integer >= {minimum} (got {value!r})")
    if value < minimum:
        raise ScheduleConfigError(f"{what} must be >= {minimum} (got {value})")
    return value


def _interleaved_rounds_ok(num_ranks: int, num_microbatches: int) -> bool:
    rounds = max(1, num_microbatches // num_ranks)
    return num_microbatches % rounds == 0


def _check_config(name: str, p: int, n: int, spr: int) -> None:
    """Raise ScheduleConfigError where torch 2.13's constructor of ``name`` raises."""
    if name in _SINGLE_STAGE and spr != 1:
        raise ScheduleConfigError(
            f"{name} runs exactly 1 stage per rank (got stages_per_rank={spr}); "
            "use Interleaved1F1B, LoopedBFS or InterleavedZeroBubble for several"
        )
    if name in _V_SHAPED and spr != 2:
        raise ScheduleConfigError(
            f"{name} needs exactly 2 stages per rank, rank r holding stages r and {2 * p - 1}-r "
            f"(got stages_per_rank={spr})"
        )
    if name == "1F1B" and n < p:
        raise ScheduleConfigError(
            f"1F1B needs num_microbatches >= num_ranks (got {n} microbatches for {p} ranks)"
        )
    if name == "DualPipeV" and n < 2 * p:
        raise ScheduleConfigError(
            f"DualPipeV needs num_microbatches >= 2 x num_ranks (got {n} microbatches for {p} ranks)"
        )
    if name in ("Interleaved1F1B", "InterleavedZeroBubble") and not _interleaved_rounds_ok(p, n):
        rounds = max(1, n // p)
        below = next(m for m in range(n - 1, 0, -1) if _interleaved_rounds_ok(p, m))
        above = next(m for m in range(n + 1, n + p + 1) if _interleaved_rounds_ok(p, m))
        raise ScheduleConfigError(
            f"{name} needs num_microbatches to be a multiple of its number of rounds, "
            f"max(1, num_microbatches // num_ranks) = {rounds} "
            f"(got {n} microbatches for {p} ranks; nearest accepted: {below} or {above})"
        )


# ---------------------------------------------------------------- generators
# Each takes (rank, num_ranks, num_microbatches, stages_per_rank) and returns
# that rank's compute actions in order.


def _gpipe(rank: int, p: int, n: int, spr: int) -> list[Action]:
    """All forwards, then all backwards, both in microbatch order (ScheduleGPipe._step_microbatches)."""
    return [Action(rank, _F, m) for m in range(n)] + [Action(rank, _B, m) for m in range(n)]


def _one_f_one_b(rank: int, p: int, n: int, spr: int) -> list[Action]:
    """What Schedule1F1B._step_microbatches executes, not what its _get_pipeline_order shows.

    Stage r warms up with ``min(n, p - r)`` forwards, then alternates one
    backward and one forward, then drains the remaining backwards.
    """
    warmup = min(n, p - rank)
    acts = [Action(rank, _F, m) for m in range(warmup)]
    fwd = warmup
    for bwd in range(n):
        acts.append(Action(rank, _B, bwd))
        if fwd < n:
            acts.append(Action(rank, _F, fwd))
            fwd += 1
    return acts


def _looped_bfs(rank: int, p: int, n: int, spr: int) -> list[Action]:
    """Every microbatch through each local stage in turn; backwards in reverse (ScheduleLoopedBFS)."""
    stages = range(rank, p * spr, p)
    acts = [Action(s, _F, m) for s in stages for m in range(n)]
    acts += [Action(s, _B, m) for s in reversed(stages) for m in reversed(range(n))]
    return acts


def _interleaved(rank: int, p: int, n: int, spr: int, *, zero_bubble: bool) -> list[Action]:
    """Port of torch's ``_get_1f1b_rank_ops`` as driven by ScheduleInterleaved1F1B/ZeroBubble.

    Microbatches go through the local stages in rounds of ``microbatches_per_round``;
    the zero-bubble variant splits each backward into I and W, and starts
    emitting the deferred Ws once ``rank`` 1F1B steps have passed.
    """
    rounds = max(1, n // p)
    per_round = n // rounds
    factor = 1 if zero_bubble else 2
    warmup = min((spr - 1) * per_round + factor * (p - 1 - rank), n * spr)
    microbatch_ops = spr * n
    fwd_bwd = microbatch_ops - warmup
    total = warmup + fwd_bwd + warmup  # warmup forwards, fwd_bwd pairs, warmup-many cooldown backwards
    bwd_type = _I if zero_bubble else _B
    w_after = rank  # num_1f1b_microbatches: steady steps before deferred Ws start

    fwd_mb = [0] * spr
    bwd_mb = [0] * spr
    pending_w: deque[Action] = deque()
    acts: list[Action] = []
    append = acts.append

    for op in range(total):
        if op < warmup + fwd_bwd:
            local = (op // per_round) % spr
            append(Action(local * p + rank, _F, fwd_mb[local]))
            fwd_mb[local] += 1
            if op < warmup:
                continue
        local = spr - 1 - ((op - warmup) // per_round) % spr
        stage = local * p + rank
        append(Action(stage, bwd_type, bwd_mb[local]))
        if zero_bubble:
            pending_w.append(Action(stage, _W, bwd_mb[local]))
            if op - warmup >= w_after:
                append(pending_w.popleft())
        bwd_mb[local] += 1
    acts.extend(pending_w)
    return acts


def _interleaved_1f1b(rank: int, p: int, n: int, spr: int) -> list[Action]:
    return _interleaved(rank, p, n, spr, zero_bubble=False)


def _interleaved_zero_bubble(rank: int, p: int, n: int, spr: int) -> list[Action]:
    return _interleaved(rank, p, n, spr, zero_bubble=True)


def _zbv_zero_bubble(rank: int, p: int, n: int, spr: int) -> list[Action]:
    """Port of ScheduleZBVZeroBubble._calculate_single_rank_operations.

    torch plans at least ``2p - 1`` microbatches so the V fills, then drops
    the actions of microbatches that do not exist; we do the same.
    """
    n_micro = max(2 * p - 1, n)
    s0, s1 = rank, 2 * p - 1 - rank
    acts: list[Action] = []
    append = acts.append
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        append(Action(s0, _F, f0))
        f0 += 1
    for _ in range(rank):
        append(Action(s1, _F, f1))
        f1 += 1
        append(Action(s0, _F, f0))
        f0 += 1
    for _ in range(p - rank):
        append(Action(s1, _F, f1))
        f1 += 1
        append(Action(s1, _I, b1))
        append(Action(s1, _W, b1))
        b1 += 1
    while f1 < f0 or f0 < n_micro:
        if f0 < n_micro:
            append(Action(s0, _F, f0))
            f0 += 1
        append(Action(s0, _I, b0))
        append(Action(s0, _W, b0))
        b0 += 1
        append(Action(s1, _F, f1))
        f1 += 1
        append(Action(s1, _I, b1))
        append(Action(s1, _W, b1))
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        append(Action(s0, _I, b0))
        b0 += 1
        append(Action(s1, _I, b1))
        b1 += 1
    for _ in range(p - rank):
        append(Action(s0, _I, b0))
        b0 += 1
        append(Action(s0, _W, w0))
        w0 += 1
    acts.extend(Action(s1, _W, m) for m in range(w1, b1))
    acts.extend(Action(s0, _W, m) for m in range(w0, b0))
    if n_micro == n:
        return acts
    return [a for a in acts if a.microbatch < n]  # type: ignore[operator]


def _dual_pipe_v(rank: int, p: int, n: int, spr: int) -> list[Action]:
    """Port of ScheduleDualPipeV._calculate_single_rank_operations (DeepSeek's DualPipe, V-shaped).

    Steady state pairs a forward of one local stage with a full backward of
    the other as one OVERLAP_F_B action; the tail splits backwards into I and
    W and uses the Ws to fill the drain.
    """
    stages = (rank, 2 * p - 1 - rank)
    fwd = {stages[0]: 0, stages[1]: 0}
    bwd = {stages[0]: 0, stages[1]: 0}  # torch's BACKWARD_INPUT counter, shared by B and I
    weights: deque[Action] = deque()  # Ws owed for Is already emitted, oldest first
    acts: list[Action] = []
    append = acts.append

    def forward(stage: int) -> Action:
        mb = fwd[stage]
        fwd[stage] = mb + 1
        return Action(stage, _F, mb)

    def backward(stage: int, kind: ActionType) -> Action:
        mb = bwd[stage]
        bwd[stage] = mb + 1
        if kind is _I:
            weights.append(Action(stage, _W, mb))
        return Action(stage, kind, mb)

    def overlap(f_stage: int, b_stage: int) -> None:
        append(Action(-1, _OVERLAP, None, (forward(f_stage), backward(b_stage, _B))))

    def weight_if_pending() -> None:
        if weights:
            append(weights.popleft())

    s0, s1 = stages
    for _ in range((p - rank - 1) * 2):  # step 1: F0
        append(forward(s0))
    for _ in range(rank + 1):  # step 2: F0 F1
        append(forward(s0))
        append(forward(s1))
    for _ in range(p - rank - 1):  # step 3: I1 W F1
        append(backward(s1, _I))
        weight_if_pending()
        append(forward(s1))
    for i in range(n - 2 * p + rank + 1):  # step 4: (F0;B1) (F1;B0)
        if i == 0 and rank == p - 1:
            append(forward(s0))  # torch keeps this pair apart to shrink the bubble
            append(backward(s1, _B))
        else:
            overlap(s0, s1)
        overlap(s1, s0)
    for _ in range(p - rank - 1):  # step 5: B1 (F1;B0)
        append(backward(s1, _B))
        overlap(s1, s0)
    step_6 = rank + 1  # step 6: B1 B0, switching to I halfway
    zb = False
    for i in range(step_6):
        if i == step_6 // 2 and rank % 2 == 1:
            zb = True
        append(backward(s1, _I if zb else _B))
        if i == step_6 // 2 and rank % 2 == 0:
            zb = True
        append(backward(s0, _I if zb else _B))
    for _ in range(p - rank - 1):  # step 7: W B0
        weight_if_pending()
        append(backward(s0, _I if zb else _B))
    for _ in range(rank + 1):  # step 8: W
        weight_if_pending()
    return acts


_GENERATORS: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "GPipe": _gpipe,
    "1F1B": _one_f_one_b,
    "Interleaved1F1B": _interleaved_1f1b,
    "LoopedBFS": _looped_bfs,
    "InterleavedZeroBubble": _interleaved_zero_bubble,
    "ZBVZeroBubble": _zbv_zero_bubble,
    "DualPipeV": _dual_pipe_v,
}


@contextmanager
def _no_gc_pauses() -> Iterator[None]:
    """Keep the cyclic garbage collector out of a burst of allocations.

    Building ~100k actions in a process that already holds torch's objects
    triggers a full collection that costs ~200 ms, ten times the generation
    itself.  Actions are acyclic tuples, so pausing the collector frees
    nothing late; it is re-enabled only if it was enabled.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def generate(
    name: str,
    *,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int | None = None,
) -> Schedule:
    """Build the compute-only schedule ``name`` for the given sizes.

    Each rank's list holds only F, B, I, W and OVERLAP_F_B actions, in the
    order torch 2.13's class of the same name runs them (no bubbles, no
    REDUCE_GRAD: those belong to the runtime and to lowering).  Raises
    :class:`ScheduleConfigError` for a configuration torch rejects.
    """
    canon = canonical_name(name)
    p = _check_int("num_ranks", num_ranks, 1)
    n = _check_int("num_microbatches", num_microbatches, 1)
    spr = default_stages_per_rank(canon) if stages_per_rank is None else _check_int("stages_per_rank", stages_per_rank, 1)
    _check_config(canon, p, n, spr)
    gen = _GENERATORS[canon]
    with _no_gc_pauses():
        actions = {rank: gen(rank, p, n, spr) for rank in range(p)}
    style = placement_style(canon)
    stage_to_rank = v_mapping(p) if style == "v" else loop_mapping(p, spr)
    return Schedule(
        actions=actions,
        stage_to_rank=stage_to_rank,
        num_microbatches=n,
        name=canon,
        lowered=False,
        meta={"stages_per_rank": spr, "placement": style},
    )
