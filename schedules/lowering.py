"""Lowering passes: from a compute-only schedule to the list a rank executes.

A generator says *what* each rank computes and in which order.  Before a rank
can run that list it also needs to know when to move tensors (``SEND_F``,
``RECV_F``, ``SEND_B``, ``RECV_B``), when to gather and free FSDP parameters
(``UNSHARD``, ``RESHARD``) and when a stage's gradients are final
(``REDUCE_GRAD``).  Each of those concerns is one pure function
``Schedule -> Schedule`` here, and :func:`lower` chains them.

Design choices, and why:

* **Sends go right after their producer; receives, by default, right before
  their consumer.**  torch's ``_add_send_recv`` instead simulates all ranks in
  lock step and drops each receive where the matching send happened (as
  early as possible), which costs a round per time step for every rank.  Placing the
  receive just before the compute that reads it is linear, and it cannot
  deadlock when the compute-only order does not: a rank then waits for
  exactly what its compute would have waited for anyway.  In pipeloom's
  runtime the list is a priority order and receives are posted as soon as the
  sender announces a transfer, so a late position costs no overlap there.
  For runtimes that post receives in list order (torch's),
  ``recv_placement="early"`` posts each receive as soon as the simulated
  timeline says the receiver would be waiting for it; with the costs it is
  given, the lowered schedule then simulates exactly as fast as the
  compute-only one.
* **Receives from one peer keep that peer's send order.**  Point-to-point
  transfers between two ranks are tagless and FIFO (NCCL; torch's runtime
  posts them in list order), so the n-th receive from a peer must be the n-th
  thing that peer sends.  When a compute needs a receive that is not the next
  one from its peer, the earlier receives are placed first.  That never adds
  waiting: the peer sent those before the one we need.
* **No transfer between two stages on the same rank** (stage p-1 and p of a
  V schedule): the activation or gradient is handed over in memory.
* **FSDP: prefetch counted in stage switches, eviction by next use.**  An
  all-gather is worth issuing as soon as the rank is about to work on another
  stage, so ``prefetch`` counts changes of stage in the compute order, not
  actions.  Under a ``max_resident`` limit the stage needed again furthest
  in the future is resharded first (Belady's rule, optimal for a known
  future), and a prefetch never evicts a stage needed sooner than the one it
  fetches.  RESHARD follows the stage's last compute and the REDUCE_GRAD
  right behind it, as in torch.
* **Every pass is idempotent**: it first drops the actions of the kinds it
  adds, then adds them again, so lowering an already lowered (or torch-lowered)
  schedule is safe.
* **Passes do not validate.**  A broken compute order yields a lowered
  schedule whose problems :func:`pipeloom.schedules.validate` reports with
  positions; raising here would only hide where the problem is.  They raise
  only for what they cannot place at all (a stage outside the placement) and
  for early receive placement of an order that deadlocks.

All passes are linear in the number of actions (early placement adds a sort):
64 ranks x 2 stages x 256 microbatches, about 200k actions once lowered, takes
about 0.2-0.3 s (0.4-0.7 s with early placement).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import replace

from .action import COMM_TYPES, Action, ActionType
from .dataflow import Dataflow, consumer_stage
from .schedule import Schedule, ScheduleError
from .simulate import Costs, lane_times

__all__ = [
    "add_reduce_grad",
    "add_send_recv",
    "add_unshard_reshard",
    "lower",
    "merge_bw",
]

_F = ActionType.F
_B = ActionType.B
_I = ActionType.I
_W = ActionType.W
_OVERLAP = ActionType.OVERLAP_F_B
_SEND_F = ActionType.SEND_F
_RECV_F = ActionType.RECV_F
_SEND_B = ActionType.SEND_B
_RECV_B = ActionType.RECV_B
_UNSHARD = ActionType.UNSHARD
_RESHARD = ActionType.RESHARD
_REDUCE_GRAD = ActionType.REDUCE_GRAD
#: Costs that early receive placement assumes when given none: a transfer as
#: long as a forward, so receives are posted with some slack.
EARLY_COSTS = Costs(send_latency=1.0)

_SENDS = frozenset({_SEND_F, _SEND_B})
_FSDP_TYPES = frozenset({_UNSHARD, _RESHARD})
_TRAILING = frozenset({_SEND_F, _SEND_B, _REDUCE_GRAD})  # what may follow a stage's last compute


def _malformed(rank: int, pos: int, action: Action, num_stages: int) -> str:
    return (
        f"rank {rank}, position {pos}, action {action}: cannot lower a compute action whose stage is outside "
        f"the placement (stages 0..{num_stages - 1}) or that has no microbatch"
    )


# ---------------------------------------------------------------- sends and receives


def add_send_recv(schedule: Schedule, *, recv_placement: str = "late", costs: Costs | None = None) -> Schedule:
    """Add the point-to-point transfers between stages on different ranks.

    After each F of stage s whose next stage lives elsewhere: ``SEND_F(s, m)``;
    on the next stage's rank, ``RECV_F(s+1, m)`` before its F.  After each B or
    I (the input-gradient producer) of stage s > 0 whose previous stage lives
    elsewhere: ``SEND_B(s, m)``; on that rank, ``RECV_B(s-1, m)`` before its
    backward.  Both halves of an ``OVERLAP_F_B`` produce and consume.  Existing
    transfers are dropped first.  The result has ``lowered=True``.

    ``recv_placement``:

    * ``"late"`` (default): each receive right before its consumer (after the
      earlier receives from the same peer).  Linear, and deadlock-free whenever
      the compute order is; posted late, so a runtime that posts receives in
      list order cannot overlap the transfer with earlier compute.
    * ``"early"``: each receive where the receiver is when its send is
      posted, so the transfer overlaps the receiver's compute (torch's default
      does the same in lock-step ticks).  The ranks' timeline is simulated
      under ``costs`` (default :data:`EARLY_COSTS`: a transfer as long as a
      forward, for some slack; see
      :func:`~pipeloom.schedules.simulate.lane_times`), and a receive goes
      right after the receiver's actions that end by the time its send is
      posted.  That is safe: everything the send depends on has ended by
      then, so nothing after that point on the receiver can be among it.  It
      also keeps per-peer send order (a peer posts its sends in time order).
      Raises :class:`ScheduleError` if the compute order cannot finish.
    """
    if recv_placement not in ("late", "early"):
        raise ValueError(f"recv_placement must be 'late' or 'early' (got {recv_placement!r})")
    flow = Dataflow(schedule.stage_to_rank)
    num_stages = flow.num_stages
    # who consumes (to) and who produced (from) each stage's activation and gradient
    act_to, grad_to, act_from, grad_from = flow.activation_to, flow.gradient_to, flow.activation_from, flow.gradient_from
    actions = schedule.actions

    # Pass 1: sends after their producers, and for every (src, dst) pair the
    # stream of receives in the order src sends them.  A receive is located
    # by an int key (microbatch * num_stages + stage) in one dict per direction.
    with_sends: dict[int, list[Action]] = {}
    streams: list[list[Action]] = []
    stream_src: list[int] = []
    stream_dst: list[int] = []
    stream_send_pos: list[list[int]] = []  # position of each stream entry's send in the sender's list
    stream_of: dict[tuple[int, int], int] = {}
    recv_f_at: dict[int, tuple[int, int]] = {}  # key of RECV_F(s, m) -> (stream, index)
    recv_b_at: dict[int, tuple[int, int]] = {}

    def stream_for(src: int, dst: int) -> int:
        sid = stream_of.get((src, dst))
        if sid is None:
            sid = stream_of[(src, dst)] = len(streams)
            streams.append([])
            stream_src.append(src)
            stream_dst.append(dst)
            stream_send_pos.append([])
        return sid

    for rank, acts in actions.items():
        out: list[Action] = []
        append = out.append
        for pos, a in enumerate(acts):
            t = a.type
            if t in COMM_TYPES:
                continue
            append(a)
            if t is _OVERLAP:
                leaves: Sequence[Action] = a.sub_actions
            elif t is _F or t is _B or t is _I:
                leaves = (a,)
            else:
                continue
            for leaf in leaves:
                s, lt, m, _ = leaf
                if not 0 <= s < num_stages or m is None:
                    raise ScheduleError(_malformed(rank, pos, a, num_stages))
                if lt is _F:
                    dst = act_to[s]
                    if dst is not None and dst != rank:
                        c = consumer_stage("F", s)
                        append(Action(s, _SEND_F, m))
                        sid = stream_for(rank, dst)
                        recv_f_at[m * num_stages + c] = (sid, len(streams[sid]))
                        streams[sid].append(Action(c, _RECV_F, m))
                        stream_send_pos[sid].append(len(out) - 1)
                elif lt is _B or lt is _I:
                    dst = grad_to[s]
                    if dst is not None and dst != rank:
                        c = consumer_stage("B", s)
                        append(Action(s, _SEND_B, m))
                        sid = stream_for(rank, dst)
                        recv_b_at[m * num_stages + c] = (sid, len(streams[sid]))
                        streams[sid].append(Action(c, _RECV_B, m))
                        stream_send_pos[sid].append(len(out) - 1)
        with_sends[rank] = out

    # For early placement: per receiving rank, the receives in the order they
    # may be posted, each as (list position it may go before, send time, stream, index).
    early: dict[int, list[tuple[int, float, int, int]]] = {}
    if recv_placement == "early":
        marks = lane_times(schedule.with_actions(with_sends), EARLY_COSTS if costs is None else costs)
        for sid, sends in enumerate(stream_send_pos):
            src, dst = stream_src[sid], stream_dst[sid]
            dst_marks = marks[dst]
            pending = early.setdefault(dst, [])
            for idx, spos in enumerate(sends):
                sent_at = marks[src][spos]
                pending.append((bisect_right(dst_marks, sent_at), sent_at, sid, idx))
        for pending in early.values():
            pending.sort()

    # Pass 2: receives go in; each stream is flushed in order, so that
    # receives from one peer follow that peer's send order.
    flushed = [0] * len(streams)
    lowered: dict[int, list[Action]] = {}
    for rank, acts in with_sends.items():
        out = []
        append = out.append
        pending = early.get(rank, [])
        next_early = 0
        for i, a in enumerate(acts):
            # Early: every receive whose send happens before this action would start.
            while next_early < len(pending) and pending[next_early][0] <= i:
                _, _, sid, idx = pending[next_early]
                next_early += 1
                start = flushed[sid]
                if idx >= start:
                    out.extend(streams[sid][start : idx + 1])
                    flushed[sid] = idx + 1
            t = a.type
            if t is _OVERLAP:
                leaves = a.sub_actions
            elif t is _F or t is _B or t is _I:
                leaves = (a,)
            else:
                append(a)
                continue
            for leaf in leaves:
                s, lt, m, _ = leaf
                if m is None:  # cannot happen: pass 1 raised
                    continue
                if lt is _F:
                    src = act_from[s]
                    if src is None or src == rank:
                        continue
                    loc = recv_f_at.get(m * num_stages + s)
                elif lt is _W or (src := grad_from[s]) is None or src == rank:
                    continue
                else:
                    loc = recv_b_at.get(m * num_stages + s)
                if loc is None:  # no producer anywhere: the validator reports it
                    continue
                sid, idx = loc
                start = flushed[sid]
                if idx >= start:
                    out.extend(streams[sid][start : idx + 1])
                    flushed[sid] = idx + 1
            append(a)
        lowered[rank] = out
    # Receives nobody consumes (their consumer is missing) still pair with the
    # sends, so that the validator reports the missing compute, not a hang.
    for sid, stream in enumerate(streams):
        if flushed[sid] < len(stream):
            lowered[stream_dst[sid]].extend(stream[flushed[sid] :])
    return schedule.with_actions(lowered, lowered=True)


# ---------------------------------------------------------------- gradient reduction


def add_reduce_grad(schedule: Schedule) -> Schedule:
    """Add ``REDUCE_GRAD(s)`` right after the last backward of each stage.

    The last backward is the last B or W of the stage on its rank, counting the
    backward half of an ``OVERLAP_F_B`` (an I alone does not finish the weight
    gradients).  Sends that directly follow that action stay in front of the
    reduction, so the peer waiting for them is not delayed.  Existing
    ``REDUCE_GRAD`` actions are dropped first.
    """
    result: dict[int, list[Action]] = {}
    for rank, acts in schedule.actions.items():
        base = [a for a in acts if a.type is not _REDUCE_GRAD]
        last_bw: dict[int, int] = {}
        for pos, a in enumerate(base):
            t = a.type
            if t is _B or t is _W:
                last_bw[a.stage] = pos
            elif t is _OVERLAP:
                for leaf in a.sub_actions:
                    if leaf.type is _B or leaf.type is _W:
                        last_bw[leaf.stage] = pos
        after: dict[int, list[Action]] = {}
        for stage, pos in sorted(last_bw.items()):
            while pos + 1 < len(base) and base[pos + 1].type in _SENDS:
                pos += 1
            after.setdefault(pos, []).append(Action(stage, _REDUCE_GRAD, None))
        out: list[Action] = []
        for pos, a in enumerate(base):
            out.append(a)
            extra = after.get(pos)
            if extra:
                out.extend(extra)
        result[rank] = out
    return schedule.with_actions(result)


# ---------------------------------------------------------------- merging I and W


def merge_bw(schedule: Schedule) -> Schedule:
    """Replace an I immediately followed by the W of the same stage and microbatch by one B.

    A split backward only pays off when something runs between its halves;
    back to back, one full backward is cheaper (one autograd pass).  Meant for
    compute-only lists, where "immediately" means adjacent compute.
    """
    result: dict[int, list[Action]] = {}
    for rank, acts in schedule.actions.items():
        out: list[Action] = []
        n = len(acts)
        pos = 0
        while pos < n:
            a = acts[pos]
            if a.type is _I and pos + 1 < n:
                nxt = acts[pos + 1]
                if nxt.type is _W and nxt.stage == a.stage and nxt.microbatch == a.microbatch:
                    out.append(Action(a.stage, _B, a.microbatch))
                    pos += 2
                    continue
            out.append(a)
            pos += 1
        result[rank] = out
    return schedule.with_actions(result)


def overlap_input_only(schedule: Schedule) -> Schedule:
    """Pair each ``OVERLAP_F_B``'s forward with the input half of its backward; the weight half right after.

    ``(aFx;bBy)OVERLAP_F_B`` becomes ``(aFx;bIy)OVERLAP_F_B`` then ``bWy``.  Why: in
    DualPipeV's pairs the backward half is about twice the forward half, so once
    the forward is done the rest of the backward (its communication included: an
    expert-parallel stage's all-to-alls) runs with nothing beside it.  The input
    half (I) carries all of the backward's communication and the activation
    gradient the peer waits for; the weight half (W) is local compute.  Paired with
    I, the halves are about equal, and W follows at once, so memory is freed where
    the full backward would have freed it.  The gradients are the same (the exact
    I/W split: ``runtime/stage.py``).  Other actions are unchanged.
    """
    result: dict[int, list[Action]] = {}
    for rank, acts in schedule.actions.items():
        out: list[Action] = []
        for a in acts:
            if a.type is _OVERLAP and len(a.sub_actions) == 2 and a.sub_actions[1].type is _B:
                f, b = a.sub_actions
                out.append(Action(-1, _OVERLAP, None, (f, Action(b.stage, _I, b.microbatch))))
                out.append(Action(b.stage, _W, b.microbatch))
            else:
                out.append(a)
        result[rank] = out
    return schedule.with_actions(result)


# ---------------------------------------------------------------- FSDP


def _stages_used(a: Action) -> tuple[int, ...]:
    if a.type is _OVERLAP:
        stages = tuple(sorted({leaf.stage for leaf in a.sub_actions}))
        return stages
    return (a.stage,)


def _fsdp_rank(acts: Sequence[Action], prefetch: int, max_resident: int | None, rank: int) -> list[Action]:
    """UNSHARD/RESHARD for one rank's list (see :func:`add_unshard_reshard`)."""
    base = [a for a in acts if a.type not in _FSDP_TYPES]
    # Segments: maximal runs of compute actions that use the same stages.
    # Prefetch distance is counted in segments ("stage switches").
    seg_start: list[int] = []
    seg_need: list[tuple[int, ...]] = []
    uses: dict[int, list[int]] = {}  # stage -> segments that use it, increasing
    last_compute: dict[int, int] = {}
    for pos, a in enumerate(base):
        if not a.is_compute:
            continue
        need = _stages_used(a)
        if not seg_need or seg_need[-1] != need:
            seg_start.append(pos)
            seg_need.append(need)
            for s in need:
                uses.setdefault(s, []).append(len(seg_need) - 1)
        for s in need:
            last_compute[s] = pos
    if not seg_need:
        return base
    limit = max_resident if max_resident is not None else len(uses)
    widest = max(len(need) for need in seg_need)
    if limit < widest:
        raise ScheduleError(
            f"rank {rank}: max_resident={max_resident} is less than the {widest} stages that one "
            "OVERLAP_F_B action computes at once"
        )

    # Where each stage's final RESHARD goes: after its last compute, past the
    # sends and REDUCE_GRADs that directly follow it (they still belong to it).
    final_pos: dict[int, int] = {}
    final_seg: dict[int, int] = {}
    for s, pos in last_compute.items():
        while pos + 1 < len(base) and base[pos + 1].type in _TRAILING:
            pos += 1
        final_pos[s] = pos
        final_seg[s] = uses[s][-1]

    before: dict[int, list[Action]] = {}
    after: dict[int, list[Action]] = {}
    resident: dict[int, None] = {}  # insertion-ordered set of unsharded stages
    next_idx = {s: 0 for s in uses}  # index into uses[s] of the next use >= current segment

    def next_use(s: int, seg: int) -> int:
        lst = uses[s]
        i = next_idx[s]
        while i < len(lst) and lst[i] < seg:
            i += 1
        next_idx[s] = i
        return lst[i] if i < len(lst) else 1 << 60

    def try_prefetch(seg: int, out: list[Action], current: tuple[int, ...]) -> None:
        """Unshard the stages of the next `prefetch` segments, evicting only what is needed later."""
        for ahead in range(seg + 1, min(seg + 1 + prefetch, len(seg_need))):
            for s in seg_need[ahead]:
                if s in resident:
                    continue
                if len(resident) >= limit:
                    victims = [v for v in resident if v not in current]
                    if not victims:
                        return
                    victim = max(victims, key=lambda v: next_use(v, seg + 1))
                    if next_use(victim, seg + 1) <= ahead:
                        return  # evicting would only trade one fetch for an earlier one
                    del resident[victim]
                    out.append(Action(victim, _RESHARD, None))
                resident[s] = None
                out.append(Action(s, _UNSHARD, None))

    for seg, need in enumerate(seg_need):
        out = before.setdefault(seg_start[seg], [])
        for s in need:
            if s in resident:
                continue
            while len(resident) >= limit:
                victims = [v for v in resident if v not in need]
                victim = max(victims, key=lambda v: next_use(v, seg))
                del resident[victim]
                out.append(Action(victim, _RESHARD, None))
            resident[s] = None
            out.append(Action(s, _UNSHARD, None))
        try_prefetch(seg, out, need)
        # Stages whose last use is in this segment are resharded right after
        # it; the room they free is offered to prefetching at once.
        for s in need:
            if final_seg[s] == seg:
                tail = after.setdefault(final_pos[s], [])
                del resident[s]
                tail.append(Action(s, _RESHARD, None))
                if seg + 1 < len(seg_need):
                    try_prefetch(seg, tail, need)

    out_list: list[Action] = []
    for pos, a in enumerate(base):
        pre = before.get(pos)
        if pre:
            out_list.extend(pre)
        out_list.append(a)
        post = after.get(pos)
        if post:
            out_list.extend(post)
    return out_list


def add_unshard_reshard(schedule: Schedule, *, prefetch: int = 1, max_resident: int | None = None) -> Schedule:
    """Add FSDP ``UNSHARD``/``RESHARD`` so every compute runs on unsharded parameters.

    On each rank, a stage is unsharded before its first compute, the
    all-gather issued ``prefetch`` stage switches ahead (0: right before use),
    and resharded right after its last compute on the rank (after the sends
    and ``REDUCE_GRAD`` that directly follow it).  With ``max_resident``, at
    most that many stages are unsharded at once: when room is needed, the
    resident stage needed again furthest in the future is resharded and
    unsharded again before its next use (Belady's rule, optimal for a known
    future).  A prefetch never evicts a stage needed sooner than the one it
    fetches.  Every UNSHARD is matched by a later RESHARD.
    """
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 (got {prefetch})")
    if max_resident is not None and max_resident < 1:
        raise ValueError(f"max_resident must be >= 1 or None (got {max_resident})")
    result = {rank: _fsdp_rank(acts, prefetch, max_resident, rank) for rank, acts in schedule.actions.items()}
    return schedule.with_actions(result)


# ---------------------------------------------------------------- all together


_merge_bw = merge_bw


def lower(
    schedule: Schedule,
    *,
    comms: bool = True,
    fsdp: bool = False,
    prefetch: int = 1,
    max_resident: int | None = None,
    reduce_grad: bool = True,
    merge_bw: bool = False,
    recv_placement: str = "late",
    costs: Costs | None = None,
) -> Schedule:
    """Lower a schedule to what each rank executes; the result has ``lowered=True``.

    Starts from the compute order (existing transfers, FSDP and reduction
    actions are dropped), then: ``merge_bw`` (optional) on the compute list;
    ``REDUCE_GRAD`` after each stage's last backward; FSDP ``UNSHARD`` /
    ``RESHARD`` (with ``fsdp``), which keeps the reshard after the reduction;
    and finally the sends and receives, so sends sit right after their
    producers, ahead of the reduction.  The options are recorded in
    ``meta["lowering"]``.
    """
    out = schedule.compute_only()
    if merge_bw:
        out = _merge_bw(out)
    if reduce_grad:
        out = add_reduce_grad(out)
    if fsdp:
        out = add_unshard_reshard(out, prefetch=prefetch, max_resident=max_resident)
    if comms:
        out = add_send_recv(out, recv_placement=recv_placement, costs=costs)
    options: Mapping[str, object] = {
        "comms": comms,
        "fsdp": fsdp,
        "prefetch": prefetch,
        "max_resident": max_resident,
        "reduce_grad": reduce_grad,
        "merge_bw": merge_bw,
        "recv_placement": recv_placement,
    }
    return replace(out, lowered=True, meta={**schedule.meta, "lowering": options})
