"""Who produces what for whom: the pipeline's one dataflow rule, in one place.

Problem.  Every part of pipeloom needs the same rule: *the forward (F) of
stage s hands its activation to stage s+1; the backward (B, or its input
half I) of stage s hands its input gradient to stage s-1; W hands nothing on;
and a hand-over between two stages on the same rank is a plain in-memory
hand-off, not a transfer.*  Lowering inserts sends and receives by it, the
simulator and the validator check them by it, the actor counts its sends and
keys its inbox by it, and the tensor plane creates one process group per pair
of ranks that it connects.  Written out separately in each (``place[s + 1] !=
rank`` here, ``stage - 1 if kind == "F" else stage + 1`` there), the copies
could drift: a placement rule added to one and not the other would lower
schedules the runtime then deadlocks on.

Alternatives.  A method on ``Schedule``: but the actor's placement is in
global ranks (it differs from the schedule's with data parallelism), and the
trace tools have no ``Schedule`` at all.  A table computed once per placement
(:class:`Dataflow`), plus free functions for the stage arithmetic, both here:
that is this module.  Hot loops (lowering, validation) read the per-stage
tables (``activation_to``, ``gradient_to``...) built from the same rule, so
one home costs them no function call per action.

Standard library only (``pipeloom.schedules`` stays torch-free).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from .action import Action, ActionType

__all__ = [
    "ACTIVATION",
    "GRADIENT",
    "Dataflow",
    "TransferKey",
    "consumer_stage",
    "producer_stage",
    "transfer_kind",
]

ACTIVATION = "F"
"""Transfer kind of a forward's output (to the next stage)."""
GRADIENT = "B"
"""Transfer kind of a backward's (B or I) input gradient (to the previous stage)."""

_F, _B, _I = ActionType.F, ActionType.B, ActionType.I
_KIND_OF = {ActionType.F: ACTIVATION, ActionType.B: GRADIENT, ActionType.I: GRADIENT}


def transfer_kind(t: ActionType) -> str | None:
    """What a compute action of type ``t`` hands on: ``"F"`` (F), ``"B"`` (B, I), None (W, others)."""
    return _KIND_OF.get(t)


def _check_kind(kind: str) -> None:
    if kind != ACTIVATION and kind != GRADIENT:
        raise ValueError(f"transfer kind must be {ACTIVATION!r} or {GRADIENT!r} (got {kind!r})")


def consumer_stage(kind: str, stage: int, num_stages: int | None = None) -> int | None:
    """The stage that consumes ``stage``'s output of ``kind``: s+1 for ``"F"``, s-1 for ``"B"``.

    None past either end (the last stage's activation, stage 0's gradient);
    ``num_stages=None`` leaves the upper end unchecked.
    """
    _check_kind(kind)
    c = stage + 1 if kind == ACTIVATION else stage - 1
    if c < 0 or (num_stages is not None and c >= num_stages):
        return None
    return c


def producer_stage(kind: str, stage: int, num_stages: int | None = None) -> int | None:
    """The stage whose output of ``kind`` is ``stage``'s input: s-1 for ``"F"``, s+1 for ``"B"``.

    None past either end (stage 0's input is the batch; the last stage's
    gradient starts at its loss); ``num_stages=None`` leaves the upper end unchecked.
    """
    _check_kind(kind)
    p = stage - 1 if kind == ACTIVATION else stage + 1
    if p < 0 or (num_stages is not None and p >= num_stages):
        return None
    return p


class TransferKey(NamedTuple):
    """One hand-over of a step, named from its consumer (as the wire's ``xfer`` message does)."""

    step: int
    kind: str
    """``"F"`` (an activation) or ``"B"`` (an input gradient)."""
    stage: int
    """The consuming stage."""
    microbatch: int


class Dataflow:
    """The rule applied to one placement (``stage_to_rank``: stage -> rank, in whatever rank numbering).

    Per-stage tables, None where there is no such stage:

    * ``activation_to[s]`` / ``gradient_to[s]``: the rank that consumes stage
      ``s``'s activation (the rank of s+1) / input gradient (the rank of s-1);
    * ``activation_from[s]`` / ``gradient_from[s]``: the rank that produced
      stage ``s``'s input activation (s-1) / output gradient (s+1).

    A hand-over crosses ranks when that rank differs from the rank running the
    action: :meth:`send_rank` and :meth:`recv_rank` answer with the peer, or
    None for "nothing to send/receive" (no such stage, or the same rank).
    """

    __slots__ = ("stage_to_rank", "num_stages", "activation_to", "gradient_to", "activation_from", "gradient_from")

    def __init__(self, stage_to_rank: Sequence[int]) -> None:
        place = self.stage_to_rank = tuple(stage_to_rank)
        n = self.num_stages = len(place)

        def rank_of(stage: int | None) -> int | None:
            return None if stage is None else place[stage]

        self.activation_to = tuple(rank_of(consumer_stage(ACTIVATION, s, n)) for s in range(n))
        self.gradient_to = tuple(rank_of(consumer_stage(GRADIENT, s, n)) for s in range(n))
        self.activation_from = tuple(rank_of(producer_stage(ACTIVATION, s, n)) for s in range(n))
        self.gradient_from = tuple(rank_of(producer_stage(GRADIENT, s, n)) for s in range(n))

    def __repr__(self) -> str:
        return f"Dataflow(stage_to_rank={self.stage_to_rank!r})"

    def consumer_rank(self, kind: str, stage: int) -> int | None:
        """The rank holding the consumer of ``stage``'s output of ``kind`` (None: no consumer)."""
        _check_kind(kind)
        return (self.activation_to if kind == ACTIVATION else self.gradient_to)[stage]

    def producer_rank(self, kind: str, stage: int) -> int | None:
        """The rank holding the producer of ``stage``'s input of ``kind`` (None: no producer stage)."""
        _check_kind(kind)
        return (self.activation_from if kind == ACTIVATION else self.gradient_from)[stage]

    def send_rank(self, kind: str, stage: int, rank: int) -> int | None:
        """The peer that ``rank`` sends ``stage``'s output of ``kind`` to; None: nothing crosses ranks."""
        dst = self.consumer_rank(kind, stage)
        return None if dst == rank else dst

    def recv_rank(self, kind: str, stage: int, rank: int) -> int | None:
        """The peer that ``rank`` receives ``stage``'s input of ``kind`` from; None: nothing crosses ranks."""
        src = self.producer_rank(kind, stage)
        return None if src == rank else src

    def output_key(self, action: Action, step: int) -> TransferKey | None:
        """What a compute leaf hands on (to the consumer stage, on any rank); None if nothing."""
        kind = _KIND_OF.get(action.type)
        if kind is None or action.microbatch is None:
            return None
        c = consumer_stage(kind, action.stage, self.num_stages)
        return None if c is None else TransferKey(step, kind, c, action.microbatch)

    def input_key(self, action: Action, step: int) -> TransferKey | None:
        """The hand-over a compute leaf waits for (from the producer stage, on any rank); None if none.

        F of stage s > 0 waits for the activation of s-1; B or I of stage s
        below the last waits for the gradient of s+1 (both keyed by ``s``, the consumer).
        """
        # (the dispatcher asks this for every readiness check: the tables, no arithmetic)
        stage, t, mb, _ = action
        if mb is None:
            return None
        if t is _F:
            return None if self.activation_from[stage] is None else TransferKey(step, ACTIVATION, stage, mb)
        if t is _B or t is _I:
            return None if self.gradient_from[stage] is None else TransferKey(step, GRADIENT, stage, mb)
        return None

    def sends_per_peer(self, rank: int, actions: Iterable[Action]) -> dict[int, int]:
        """How many transfers ``rank`` sends to each peer when it runs ``actions`` (OVERLAP_F_B counted by its halves)."""
        out: dict[int, int] = {}
        for a in actions:
            for leaf in a.leaves():
                kind = _KIND_OF.get(leaf.type)
                if kind is None:
                    continue
                dst = self.send_rank(kind, leaf.stage, rank)
                if dst is not None:
                    out[dst] = out.get(dst, 0) + 1
        return out

    def links(self) -> set[tuple[int, int]]:
        """Every ordered pair ``(src, dst)`` of ranks that a transfer may go between (both directions)."""
        out: set[tuple[int, int]] = set()
        for s in range(self.num_stages):
            for dst in (self.activation_to[s], self.gradient_to[s]):
                src = self.stage_to_rank[s]
                if dst is not None and dst != src:
                    out.add((src, dst))
        return out
