"""The schedule validator: every way a schedule can be wrong, found before it runs.

A broken schedule on real ranks is the worst kind of failure: a hang until a
collective timeout, or silently wrong gradients when a receive pairs with the
wrong send.  :func:`validate` finds those problems in one process, in time
linear in the number of actions, and :func:`check` turns them into one error
whose message lists every problem with its rank, list position and action,
and shows the rank-by-step grid with the offending cell marked.

What is checked (the ``kind`` of each :class:`ScheduleProblem`):

``out-of-range``
    a stage outside the placement or a microbatch outside ``0..M-1``.
``wrong-rank``
    an action of a stage on a rank that does not hold the stage.
``missing`` / ``duplicate``
    every (stage, microbatch) needs one F and one B, or one I and one W; a
    lowered schedule also needs a send and a receive for every transfer
    between stages on different ranks; ``REDUCE_GRAD``, when used at all, once
    per stage.
``dependency``
    an action before something it needs on its own rank: I/B before the F of
    the same stage and microbatch, W before I, F of stage s before F of s-1
    when both live on this rank, a backward before the backward of s+1 on this
    rank, a send before the compute that produces it, ``REDUCE_GRAD`` before
    the stage's last backward.  Both halves of an ``OVERLAP_F_B`` run
    together, so neither may need the other.
``late-recv``
    a compute that uses an input received later in its rank's list.
``unmatched-send`` / ``unmatched-recv``
    a transfer with only one side in the schedule.
``wrong-peer``
    a transfer that has no peer stage (``SEND_F`` of the last stage, ``RECV_F``
    of stage 0...) or that goes between two stages on the same rank, where
    the tensor is handed over in memory.
``recv-order``
    receives from one peer in another order than that peer sends them.
    Point-to-point transfers between two ranks are tagless and FIFO (NCCL, and
    torch's runtime posts them in list order), so this pairs the wrong
    tensors: a crash on a shape mismatch, or silently wrong gradients.
``fsdp``
    on a stage that uses FSDP (has any ``UNSHARD``/``RESHARD``), compute while
    not unsharded, an ``UNSHARD`` of an unsharded stage, a ``RESHARD`` of a
    sharded one, or an ``UNSHARD`` never resharded.
``deadlock``
    ranks that cannot all finish when each runs its list in order.  Sends are
    asynchronous (they never block, as with ``isend``); a receive blocks until
    its matching send has run; in a compute-only schedule, a compute blocks
    until the compute on another rank that produces its input has run.  All
    ranks are simulated together; each stuck rank is reported with the action
    it is blocked on and what that waits for.

Whether a schedule is "lowered" (must carry transfers) is read from its
content, not its flag: it is when it holds any send or receive.  A schedule
from torch (with UNSHARD/RESHARD, REDUCE_GRAD and as-early-as-possible
receives) is therefore accepted as it is.

Problems are found independently and reported together: a missing action is
reported once, and the checks that would have needed it stay quiet rather
than repeating it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from .action import Action, ActionType
from .dataflow import Dataflow, consumer_stage, producer_stage
from .schedule import Schedule, ScheduleError, format_grid

__all__ = ["InvalidScheduleError", "ScheduleProblem", "check", "validate"]

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
_REDUCE_GRAD = ActionType.REDUCE_GRAD

#: How many problems get their own grid in :class:`InvalidScheduleError`'s message.
MAX_GRIDS = 8
#: Columns of each grid in the message: enough context, still readable.
GRID_STEPS = 24


@dataclass(frozen=True)
class ScheduleProblem:
    """One thing wrong with a schedule, located in it.

    Attributes:
        rank: the rank whose list holds (or should hold) the action.
        position: index of the action in that rank's list; None for an action
            that is missing altogether.
        action: the offending action (for ``missing``, the one that should be there).
        kind: a short code, e.g. ``"dependency"`` (see the module docstring).
        message: what is wrong and what it relates to, in words.
    """

    rank: int | None
    position: int | None
    action: Action | None
    kind: str
    message: str

    def __str__(self) -> str:
        where = f"rank {self.rank}" if self.rank is not None else "schedule"
        where += f", position {self.position}" if self.position is not None else " (not in the list)"
        what = f", action {self.action}" if self.action is not None else ""
        return f"{where}{what}: {self.kind}: {self.message}"


class InvalidScheduleError(ScheduleError):
    """A schedule that fails validation; ``problems`` holds every problem found."""

    def __init__(self, message: str, problems: Sequence[ScheduleProblem], schedule: Schedule) -> None:
        super().__init__(message)
        self.problems = tuple(problems)
        self.schedule = schedule


# ---------------------------------------------------------------- the checks


class _Checker:
    """One validation run.  Positions of every action, by kind, in flat arrays.

    A (stage, microbatch) pair is the int key ``stage * M + microbatch``.  The
    arrays hold the position of the action in the list of the rank that holds
    the stage (-1: absent); actions on a wrong rank are reported and left out,
    so every position in an array is comparable with every other of the same
    stage.
    """

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.actions = schedule.actions
        self.place = schedule.stage_to_rank
        #: who consumes and who produced each stage's activation and gradient (the one dataflow rule)
        self.flow = Dataflow(self.place)
        self.S = len(self.place)
        self.M = schedule.num_microbatches
        self.problems: list[ScheduleProblem] = []
        n = self.S * self.M
        self.pF = [-1] * n
        self.pB = [-1] * n
        self.pI = [-1] * n
        self.pW = [-1] * n
        self.pSF = [-1] * n
        self.pRF = [-1] * n
        self.pSB = [-1] * n
        self.pRB = [-1] * n
        self.pRG = [-1] * self.S
        self.misplaced: set[tuple[ActionType, int]] = set()
        self.recvs: dict[int, list[tuple[int, Action, int]]] = {}  # rank -> (pos, action, key) in list order
        self.fsdp_ranks: list[int] = []
        self.has_comms = False
        self.has_reduce = False

    def add(self, rank: int | None, pos: int | None, action: Action | None, kind: str, message: str) -> None:
        self.problems.append(ScheduleProblem(rank, pos, action, kind, message))

    # ------------------------------------------------------------ pass 1: where is everything

    def check_placement(self) -> bool:
        ranks = set(self.actions)
        bad = sorted({r for r in self.place if r not in ranks})
        if bad:
            self.add(
                None,
                None,
                None,
                "wrong-rank",
                f"the placement puts stages on ranks {bad}, which have no action list "
                f"(ranks present: {sorted(ranks)})",
            )
            return False
        return True

    def scan(self) -> None:
        """Record every action's position; report range, rank and duplicate problems."""
        S, M, place = self.S, self.M, self.place
        arrays = {
            _F: self.pF,
            _B: self.pB,
            _I: self.pI,
            _W: self.pW,
            _SEND_F: self.pSF,
            _RECV_F: self.pRF,
            _SEND_B: self.pSB,
            _RECV_B: self.pRB,
        }
        add = self.add
        for rank in sorted(self.actions):
            acts = self.actions[rank]
            recvs: list[tuple[int, Action, int]] = []
            self.recvs[rank] = recvs
            fsdp = False
            for pos, a in enumerate(acts):
                s, t, m, subs = a
                if subs:
                    leaves: Sequence[Action] = subs
                elif t is _UNSHARD or t is _RESHARD or t is _REDUCE_GRAD:
                    if not 0 <= s < S:
                        add(rank, pos, a, "out-of-range", f"stage {s} does not exist (stages 0..{S - 1})")
                    elif place[s] != rank:
                        add(rank, pos, a, "wrong-rank", f"stage {s} lives on rank {place[s]}, not rank {rank}")
                    elif t is _REDUCE_GRAD:
                        self.has_reduce = True
                        if self.pRG[s] != -1:
                            add(rank, pos, a, "duplicate", f"stage {s} already reduces its gradients at position {self.pRG[s]}")
                        else:
                            self.pRG[s] = pos
                    else:
                        fsdp = True
                    continue
                else:
                    leaves = (a,)
                for leaf in leaves:
                    s, t, m, _ = leaf
                    if not 0 <= s < S or m is None or not 0 <= m < M:
                        what = f"stage {s} does not exist (stages 0..{S - 1})" if not 0 <= s < S else (
                            f"microbatch {m} does not exist (microbatches 0..{M - 1})"
                        )
                        add(rank, pos, a, "out-of-range", what)
                        continue
                    arr = arrays.get(t)
                    if arr is None:
                        add(rank, pos, a, "out-of-range", f"{leaf} cannot be part of an OVERLAP_F_B; only F, I, W and B can")
                        continue
                    k = s * M + m
                    if place[s] != rank:
                        add(rank, pos, a, "wrong-rank", f"stage {s} lives on rank {place[s]}, not rank {rank}")
                        self.misplaced.add((t, k))
                        continue
                    if arr[k] != -1:
                        add(rank, pos, a, "duplicate", f"{leaf} already appears at position {arr[k]} of rank {rank}")
                        continue
                    arr[k] = pos
                    if t is _RECV_F or t is _RECV_B or t is _SEND_F or t is _SEND_B:
                        self.has_comms = True
                        if t is _RECV_F or t is _RECV_B:
                            recvs.append((pos, leaf, k))
            if fsdp:
                self.fsdp_ranks.append(rank)

    # ------------------------------------------------------------ pass 2: completeness and order

    def check_compute(self) -> None:
        """One F and one B (or I and W) per (stage, microbatch), in an order that works."""
        S, M, place = self.S, self.M, self.place
        pF, pB, pI, pW, pRF, pRB = self.pF, self.pB, self.pI, self.pW, self.pRF, self.pRB
        misplaced = self.misplaced
        comms = self.has_comms
        add = self.add
        flow = self.flow
        for s in range(S):
            r = place[s]
            acts = self.actions.get(r, ())
            prev_local = flow.activation_from[s] == r  # input activation handed over in memory
            next_local = flow.gradient_from[s] == r  # output gradient handed over in memory
            for m in range(M):
                k = s * M + m
                f = pF[k]
                if f == -1:
                    if (_F, k) not in misplaced:
                        add(r, None, Action(s, _F, m), "missing", f"stage {s} never runs the forward of microbatch {m}")
                elif s > 0:
                    if prev_local:
                        g = pF[k - M]
                        if g >= f:
                            add(r, f, acts[f], "dependency", _after("its input, from", Action(s - 1, _F, m), g, f))
                    elif comms:
                        g = pRF[k]
                        if g > f:
                            add(r, f, acts[f], "late-recv", f"its input is received by {Action(s, _RECV_F, m)} at position {g}, later in the list")
                b, i, w = pB[k], pI[k], pW[k]
                if b != -1:
                    if i != -1 or w != -1:
                        other = i if i != -1 else w
                        add(r, other, acts[other], "duplicate", f"microbatch {m} of stage {s} already runs a full backward {Action(s, _B, m)} at position {b}")
                    bk = b
                elif i != -1:
                    bk = i
                    if w == -1 and (_W, k) not in misplaced:
                        add(r, None, Action(s, _W, m), "missing", f"stage {s} runs {Action(s, _I, m)} at position {i} but never its weight gradient")
                    elif w != -1 and w <= i:
                        add(r, w, acts[w], "dependency", _after("it needs", Action(s, _I, m), i, w))
                else:
                    bk = -1
                    if w != -1:
                        if (_I, k) not in misplaced:
                            add(r, None, Action(s, _I, m), "missing", f"stage {s} runs {Action(s, _W, m)} at position {w} but never its input gradient")
                    elif (_B, k) not in misplaced and (_I, k) not in misplaced:
                        add(r, None, Action(s, _B, m), "missing", f"stage {s} never runs the backward of microbatch {m} (B, or I and W)")
                if bk == -1:
                    continue
                if f != -1 and f >= bk:
                    add(r, bk, acts[bk], "dependency", _after("it needs", Action(s, _F, m), f, bk))
                if s < S - 1:
                    if next_local:
                        g = pB[k + M] if pB[k + M] != -1 else pI[k + M]
                        if g >= bk:
                            prod = Action(s + 1, _B if pB[k + M] != -1 else _I, m)
                            add(r, bk, acts[bk], "dependency", _after("its output gradient, from", prod, g, bk))
                    elif comms:
                        g = pRB[k]
                        if g > bk:
                            add(r, bk, acts[bk], "late-recv", f"its output gradient is received by {Action(s, _RECV_B, m)} at position {g}, later in the list")

    def check_comms(self) -> None:
        """Every transfer between ranks has both sides, after its producer, and nothing else does."""
        S, M, place, flow = self.S, self.M, self.place, self.flow
        pF, pB, pI, pSF, pRF, pSB, pRB = self.pF, self.pB, self.pI, self.pSF, self.pRF, self.pSB, self.pRB
        add = self.add
        for s in range(S):
            r = place[s]
            acts = self.actions.get(r, ())
            # Forward edge s -> s+1 (SEND_F(s, m) here, RECV_F(s+1, m) there), backward edge s -> s-1.
            f_dst, f_src = flow.send_rank("F", s, r), flow.recv_rank("F", s, r)
            b_dst, b_src = flow.send_rank("B", s, r), flow.recv_rank("B", s, r)
            f_to, b_to = consumer_stage("F", s, S), consumer_stage("B", s, S)
            f_from, b_from = producer_stage("F", s, S), producer_stage("B", s, S)
            for m in range(M):
                k = s * M + m
                sp = pSF[k]
                if f_dst is None:
                    if sp != -1:
                        why = "the last stage has no next stage" if f_to is None else f"stage {f_to} is on the same rank; the activation is handed over in memory"
                        add(r, sp, acts[sp], "wrong-peer", why)
                else:
                    ck = f_to * M + m  # type: ignore[operator]
                    self._pair(r, f_dst, Action(s, _SEND_F, m), sp, Action(f_to, _RECV_F, m), pRF[ck], k, ck)  # type: ignore[arg-type]
                    if sp != -1 and pF[k] != -1 and pF[k] >= sp:
                        add(r, sp, acts[sp], "dependency", _after("it sends the output of", Action(s, _F, m), pF[k], sp))
                rp = pRF[k]
                if rp != -1 and f_src is None:
                    why = "stage 0 has no previous stage" if f_from is None else f"stage {f_from} is on the same rank; the activation is handed over in memory"
                    add(r, rp, acts[rp], "wrong-peer", why)
                sp = pSB[k]
                if b_dst is None:
                    if sp != -1:
                        why = "stage 0 has no previous stage" if b_to is None else f"stage {b_to} is on the same rank; the gradient is handed over in memory"
                        add(r, sp, acts[sp], "wrong-peer", why)
                else:
                    ck = b_to * M + m  # type: ignore[operator]
                    self._pair(r, b_dst, Action(s, _SEND_B, m), sp, Action(b_to, _RECV_B, m), pRB[ck], k, ck)  # type: ignore[arg-type]
                    if sp != -1:
                        g = pB[k] if pB[k] != -1 else pI[k]
                        if g != -1 and g >= sp:
                            prod = Action(s, _B if pB[k] != -1 else _I, m)
                            add(r, sp, acts[sp], "dependency", _after("it sends the input gradient of", prod, g, sp))
                rp = pRB[k]
                if rp != -1 and b_src is None:
                    why = "the last stage has no next stage" if b_from is None else f"stage {b_from} is on the same rank; the gradient is handed over in memory"
                    add(r, rp, acts[rp], "wrong-peer", why)

    def _pair(self, src: int, dst: int, send: Action, sp: int, recv: Action, rp: int, sk: int, rk: int) -> None:
        send_gone = sp == -1 and (send.type, sk) not in self.misplaced
        recv_gone = rp == -1 and (recv.type, rk) not in self.misplaced
        if sp != -1 and recv_gone:
            self.add(src, sp, send, "unmatched-send", f"rank {dst} never posts the matching {recv}; the transfer never completes")
        elif rp != -1 and send_gone:
            self.add(dst, rp, recv, "unmatched-recv", f"rank {src} never posts the matching {send}; this receive waits forever")
        elif send_gone and recv_gone:
            self.add(src, None, send, "missing", f"stage {recv.stage} on rank {dst} needs this transfer (and {recv} there)")
            self.add(dst, None, recv, "missing", f"stage {recv.stage} needs the transfer {send} from rank {src}")

    def check_recv_order(self) -> None:
        """Receives from each peer in the order that peer sends them (FIFO pairing)."""
        M, flow = self.M, self.flow
        pSF, pSB = self.pSF, self.pSB
        for rank in sorted(self.recvs):
            last: dict[int, tuple[int, Action]] = {}  # peer -> (send position, receive) of the latest receive
            for pos, recv, k in self.recvs[rank]:
                s = recv.stage
                kind = "F" if recv.type is _RECV_F else "B"
                src = flow.recv_rank(kind, s, rank)
                if src is None:
                    continue
                p = producer_stage(kind, s)
                pk = p * M + recv.microbatch  # type: ignore[operator]
                if recv.type is _RECV_F:
                    sp, send = pSF[pk], Action(p, _SEND_F, recv.microbatch)  # type: ignore[arg-type]
                else:
                    sp, send = pSB[pk], Action(p, _SEND_B, recv.microbatch)  # type: ignore[arg-type]
                if sp == -1:
                    continue
                prev = last.get(src)
                if prev is not None and prev[0] > sp:
                    self.add(
                        rank,
                        pos,
                        recv,
                        "recv-order",
                        f"rank {src} sends {send} (position {sp}) before the transfer received earlier by "
                        f"{prev[1]} (its send is at position {prev[0]}); transfers between two ranks pair up in "
                        "posting order, so these two would receive each other's tensors",
                    )
                else:
                    last[src] = (sp, recv)

    def check_reduce_grad(self) -> None:
        """If REDUCE_GRAD is used, once per stage and after the stage's last backward."""
        if not self.has_reduce:
            return
        S, M = self.S, self.M
        for s in range(S):
            r = self.place[s]
            pos = self.pRG[s]
            if pos == -1:
                self.add(r, None, Action(s, _REDUCE_GRAD, None), "missing", f"other stages reduce their gradients but stage {s} never does")
                continue
            keys = range(s * M, (s + 1) * M)
            last = max(max((self.pB[k] for k in keys), default=-1), max((self.pW[k] for k in keys), default=-1))
            if last > pos:
                acts = self.actions[r]
                self.add(r, pos, acts[pos], "dependency", _after("the gradients are final only after", acts[last], last, pos))

    def check_fsdp(self) -> None:
        """On FSDP stages, compute only between an UNSHARD and the next RESHARD."""
        S = self.S
        for rank in self.fsdp_ranks:
            first = len(self.problems)
            self._check_fsdp_rank(rank, S)
            self.problems[first:] = sorted(self.problems[first:], key=lambda p: p.position or 0)

    def _check_fsdp_rank(self, rank: int, S: int) -> None:
        acts = self.actions[rank]
        place = self.place
        fsdp_stages = {
            a.stage for a in acts if (a.type is _UNSHARD or a.type is _RESHARD) and 0 <= a.stage < S and place[a.stage] == rank
        }
        state = [0] * S  # 0 never unsharded, 1 unsharded, 2 resharded
        unshard_at = [-1] * S
        outside_since = [-1] * S  # start of the current run of compute while sharded
        counts = [0] * S
        runs: list[tuple[int, int, int]] = []  # (stage, first position, actions in the run)
        for pos, a in enumerate(acts):
            t = a.type
            if t is _UNSHARD or t is _RESHARD:
                s = a.stage
                if s not in fsdp_stages:
                    continue  # out of range or on the wrong rank: reported by the scan
                if outside_since[s] != -1:
                    runs.append((s, outside_since[s], counts[s]))
                    outside_since[s] = -1
                if t is _UNSHARD:
                    if state[s] == 1:
                        self.add(rank, pos, a, "fsdp", f"stage {s} is already unsharded (by the UNSHARD at position {unshard_at[s]})")
                    state[s] = 1
                    unshard_at[s] = pos
                else:
                    if state[s] != 1:
                        self.add(rank, pos, a, "fsdp", f"stage {s} is not unsharded here; a RESHARD must follow an UNSHARD")
                    state[s] = 2
            elif a.sub_actions or t is _F or t is _B or t is _I or t is _W:
                for leaf in a.leaves():
                    s = leaf.stage
                    if s in fsdp_stages and state[s] != 1:
                        if outside_since[s] == -1:
                            outside_since[s] = pos
                            counts[s] = 0
                        counts[s] += 1
        for s in sorted(fsdp_stages):
            if outside_since[s] != -1:
                runs.append((s, outside_since[s], counts[s]))
            if state[s] == 1:
                pos = unshard_at[s]
                self.add(rank, pos, acts[pos], "fsdp", f"stage {s} is unsharded here and never resharded")
        for s, pos, count in runs:
            more = f" (and so do its next {count - 1} compute actions)" if count > 1 else ""
            self.add(
                rank,
                pos,
                acts[pos],
                "fsdp",
                f"stage {s} computes while its parameters are sharded{more}; it needs an UNSHARD before and a RESHARD after",
            )

    # ------------------------------------------------------------ pass 3: all ranks together

    def check_deadlock(self) -> None:
        """Run every rank's list in order, all together; report the ranks that never finish."""
        M, flow = self.M, self.flow
        pF, pB, pI, pSF, pSB = self.pF, self.pB, self.pI, self.pSF, self.pSB
        ranks = sorted(self.actions)
        # Per rank, the cross-rank waits in list order: (position, peer rank, peer position).
        waits: dict[int, list[tuple[int, int, int]]] = {}
        for rank in ranks:
            w: list[tuple[int, int, int]] = []
            if self.has_comms:
                for pos, recv, k in self.recvs[rank]:
                    s = recv.stage
                    if recv.type is _RECV_F:
                        src = flow.recv_rank("F", s, rank)
                        if src is not None and pSF[k - M] != -1:  # SEND_F of stage s-1
                            w.append((pos, src, pSF[k - M]))
                    else:
                        src = flow.recv_rank("B", s, rank)
                        if src is not None and pSB[k + M] != -1:  # SEND_B of stage s+1
                            w.append((pos, src, pSB[k + M]))
            else:
                for s in self.schedule.stages_of(rank):
                    prev_remote = flow.recv_rank("F", s, rank)
                    next_remote = flow.recv_rank("B", s, rank)
                    for m in range(M):
                        k = s * M + m
                        if prev_remote is not None and pF[k] != -1 and pF[k - M] != -1:
                            w.append((pF[k], prev_remote, pF[k - M]))
                        if next_remote is not None:
                            bk = pB[k] if pB[k] != -1 else pI[k]
                            g = pB[k + M] if pB[k + M] != -1 else pI[k + M]
                            if bk != -1 and g != -1:
                                w.append((bk, next_remote, g))
                w.sort()
            waits[rank] = w

        done = {rank: 0 for rank in ranks}  # how many actions of the rank have run
        cursor = {rank: 0 for rank in ranks}
        sleepers: dict[int, list[tuple[int, int]]] = {rank: [] for rank in ranks}  # peer -> heap of (position awaited, rank)
        blocked: dict[int, tuple[int, int, int]] = {}
        ready = list(ranks)
        while ready:
            rank = ready.pop()
            w = waits[rank]
            j = cursor[rank]
            while j < len(w) and done[w[j][1]] > w[j][2]:
                j += 1
            cursor[rank] = j
            reached = w[j][0] if j < len(w) else len(self.actions[rank])
            if reached > done[rank]:
                done[rank] = reached
                heap = sleepers[rank]
                while heap and heap[0][0] < reached:
                    ready.append(heapq.heappop(heap)[1])
            if j < len(w):
                blocked[rank] = w[j]
                heapq.heappush(sleepers[w[j][1]], (w[j][2], rank))
            else:
                blocked.pop(rank, None)

        for rank in ranks:
            if done[rank] >= len(self.actions[rank]):
                continue
            pos, peer, peer_pos = blocked[rank]
            acts = self.actions[rank]
            waited = self.actions[peer][peer_pos]
            peer_at = done[peer]
            if peer_at < len(self.actions[peer]):
                peer_state = f"rank {peer} is stuck at position {peer_at} ({self.actions[peer][peer_at]})"
            else:
                peer_state = f"rank {peer} has finished"  # cannot happen: it would have run the awaited action
            self.add(
                rank,
                pos,
                acts[pos],
                "deadlock",
                f"blocked: waits for {waited} at position {peer_pos} of rank {peer}, which never runs: {peer_state}",
            )

    def run(self) -> list[ScheduleProblem]:
        if not self.check_placement():
            return self.problems
        self.scan()
        self.check_compute()
        if self.has_comms:
            self.check_comms()
            self.check_recv_order()
        self.check_reduce_grad()
        self.check_fsdp()
        self.check_deadlock()
        return self.problems


def _after(what: str, needed: Action, needed_pos: int, pos: int) -> str:
    if needed_pos == pos:
        return f"{what} {needed}, which runs in the same OVERLAP_F_B action; the two halves run together"
    return f"{what} {needed}, which comes later, at position {needed_pos}"


# ---------------------------------------------------------------- public API


def validate(schedule: Schedule) -> list[ScheduleProblem]:
    """Every problem found in ``schedule`` (empty when it is valid).

    Works on compute-only and lowered schedules alike, whether generated,
    lowered here, loaded from CSV or produced by torch.  Problems come grouped
    by check, each group in rank and position order.
    """
    return _Checker(schedule).run()


def check(schedule: Schedule) -> None:
    """Raise :class:`InvalidScheduleError` listing every problem, or return when valid.

    The message names each problem's rank, position and action, then shows
    the rank-by-step grid with the offending cell marked for the first
    problems (a grid per problem would bury the list for badly broken inputs).
    """
    problems = validate(schedule)
    if not problems:
        return
    raise InvalidScheduleError(describe_problems(schedule, problems), problems, schedule)


def describe_problems(schedule: Schedule, problems: Sequence[ScheduleProblem]) -> str:
    """The message of :func:`check`: the list of problems, then marked grids."""
    n = len(problems)
    head = (
        f"invalid schedule {schedule.name!r} ({schedule.num_ranks} ranks, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} microbatches, {'lowered' if _has_comms(schedule) else 'compute-only'}): "
        f"{n} problem{'s' if n != 1 else ''}"
    )
    lines = [head]
    lines += [f"  {i + 1}. {p}" for i, p in enumerate(problems)]
    shown = 0
    for i, p in enumerate(problems):
        if shown == MAX_GRIDS:
            lines.append(f"\n(grids of the remaining {n - i} problems left out)")
            break
        if p.rank is None or p.rank not in schedule.actions:
            continue
        shown += 1
        if p.position is None:
            lines.append(f"\nproblem {i + 1}: {p.action} is missing from rank {p.rank}:")
            lines.append(format_grid({p.rank: schedule.actions[p.rank]}, max_steps=GRID_STEPS))
        else:
            lines.append(f"\nproblem {i + 1}: rank {p.rank}, position {p.position} ({p.action}):")
            lines.append(format_grid(schedule, mark=(p.rank, p.position), max_steps=GRID_STEPS))
    return "\n".join(lines)


def _has_comms(schedule: Schedule) -> bool:
    return any(a.is_comm for acts in schedule.actions.values() for a in acts)
