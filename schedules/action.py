"""The action IR: one immutable value per thing a rank does in a pipeline step.

The string form is torch.distributed.pipelining's, so schedules move freely
between the two: ``2F0`` (stage 2, forward, microbatch 0), ``1I3``, ``0W3``,
``1B2``, ``0UNSHARD``, ``0RESHARD``, ``3SEND_F1``, ``2RECV_B0``,
``0REDUCE_GRAD`` and ``(0F3;3B1)OVERLAP_F_B`` for an overlapped pair.

Unlike torch's parser, ours is strict: ``1F0x`` or ``1UNSHARD3`` is an error
that quotes the string and says what was expected, never a silently truncated
action.  ``Action`` is a ``NamedTuple`` because schedules of 64 ranks x 256
microbatches hold hundreds of thousands of them: tuple construction and
hashing are several times cheaper than a frozen dataclass.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import NamedTuple

__all__ = [
    "Action",
    "ActionParseError",
    "ActionType",
    "parse_action",
    "COMPUTE_TYPES",
    "COMM_TYPES",
]


class ActionType(str, Enum):
    """What an action does; the value is its spelling in the string form."""

    F = "F"  #: forward
    I = "I"  #: backward for inputs (zero-bubble split, first half)  # noqa: E741
    W = "W"  #: backward for weights (zero-bubble split, second half)
    B = "B"  #: full backward (I and W together)
    UNSHARD = "UNSHARD"  #: all-gather an FSDP stage's parameters
    RESHARD = "RESHARD"  #: free an FSDP stage's unsharded parameters
    SEND_F = "SEND_F"  #: send a forward activation to the next stage
    RECV_F = "RECV_F"  #: receive a forward activation from the previous stage
    SEND_B = "SEND_B"  #: send an input gradient to the previous stage
    RECV_B = "RECV_B"  #: receive an output gradient from the next stage
    REDUCE_GRAD = "REDUCE_GRAD"  #: reduce a stage's gradients across replicas
    OVERLAP_F_B = "OVERLAP_F_B"  #: a forward and a backward run as one event

    def __str__(self) -> str:
        return self.value


COMPUTE_TYPES = frozenset({ActionType.F, ActionType.I, ActionType.W, ActionType.B, ActionType.OVERLAP_F_B})
COMM_TYPES = frozenset({ActionType.SEND_F, ActionType.RECV_F, ActionType.SEND_B, ActionType.RECV_B})
_NO_MICROBATCH = frozenset({ActionType.UNSHARD, ActionType.RESHARD, ActionType.REDUCE_GRAD})
_SUB_ACTION_TYPES = frozenset({ActionType.F, ActionType.I, ActionType.W, ActionType.B})


class ActionParseError(ValueError):
    """A string that is not an action; the message quotes it and says what was expected."""


class Action(NamedTuple):
    """One step of one rank: ``stage`` ``type`` ``microbatch``.

    For ``OVERLAP_F_B`` the work is in ``sub_actions`` (a forward and a
    backward, each an ordinary action); the container's ``stage`` is -1 and
    its ``microbatch`` None, as in torch.
    """

    stage: int
    type: ActionType
    microbatch: int | None = None
    sub_actions: tuple[Action, ...] = ()

    def __str__(self) -> str:
        if self.sub_actions:
            return "(" + ";".join(map(str, self.sub_actions)) + ")" + self.type.value
        if self.microbatch is None:
            return f"{self.stage}{self.type.value}"
        return f"{self.stage}{self.type.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @property
    def is_compute(self) -> bool:
        """F, I, W, B or OVERLAP_F_B: work that runs the stage's module."""
        return self.type in COMPUTE_TYPES

    @property
    def is_comm(self) -> bool:
        """A point-to-point send or receive."""
        return self.type in COMM_TYPES

    def leaves(self) -> tuple[Action, ...]:
        """The plain actions inside: the sub-actions of an overlap, else itself."""
        return self.sub_actions if self.sub_actions else (self,)

    @staticmethod
    def parse(text: str) -> Action:
        """Parse torch's string form; see :func:`parse_action`."""
        return parse_action(text)


_TYPE_ALTERNATION = "|".join(
    sorted((t.value for t in ActionType if t is not ActionType.OVERLAP_F_B), key=len, reverse=True)
)
_SIMPLE_RE = re.compile(rf"(\d+)({_TYPE_ALTERNATION})(\d*)")
_EXPECTED = (
    "expected [stage][type][microbatch] such as '2F0', '1SEND_B3', '0UNSHARD', "
    "or '(0F3;3B1)OVERLAP_F_B'; types: " + ", ".join(t.value for t in ActionType)
)


def _parse_simple(text: str, whole: str) -> Action:
    m = _SIMPLE_RE.fullmatch(text)
    if m is None:
        raise ActionParseError(f"invalid action {whole!r}: {_EXPECTED}")
    stage_s, type_s, mb_s = m.groups()
    kind = ActionType(type_s)
    if kind in _NO_MICROBATCH:
        if mb_s:
            raise ActionParseError(f"invalid action {whole!r}: {kind.value} takes no microbatch index (e.g. '{stage_s}{kind.value}')")
        return Action(int(stage_s), kind, None)
    if not mb_s:
        raise ActionParseError(f"invalid action {whole!r}: {kind.value} needs a microbatch index (e.g. '{stage_s}{kind.value}0')")
    return Action(int(stage_s), kind, int(mb_s))


def parse_action(text: str) -> Action:
    """Parse an action from torch's string form.

    Surrounding whitespace is ignored; anything else that does not fit the
    grammar raises :class:`ActionParseError` quoting the input.
    """
    s = text.strip()
    if not s:
        raise ActionParseError(f"invalid action {text!r}: empty; {_EXPECTED}")
    if s[0] != "(":
        return _parse_simple(s, text)
    close = s.find(")")
    if close < 0:
        raise ActionParseError(f"invalid action {text!r}: '(' is never closed; {_EXPECTED}")
    suffix = s[close + 1 :]
    if suffix != ActionType.OVERLAP_F_B.value:
        raise ActionParseError(
            f"invalid action {text!r}: a parenthesised group must be followed by 'OVERLAP_F_B', got {suffix!r}"
        )
    parts = [p.strip() for p in s[1:close].split(";")]
    if len(parts) != 2 or not all(parts):
        raise ActionParseError(
            f"invalid action {text!r}: OVERLAP_F_B holds exactly two actions separated by ';', e.g. '(0F3;3B1)OVERLAP_F_B'"
        )
    subs = tuple(_parse_simple(p, text) for p in parts)
    for sub in subs:
        if sub.type not in _SUB_ACTION_TYPES:
            raise ActionParseError(f"invalid action {text!r}: {sub} cannot be overlapped; only F, I, W and B can")
    if subs[0].type is not ActionType.F or subs[1].type not in (ActionType.B, ActionType.I):
        raise ActionParseError(
            f"invalid action {text!r}: OVERLAP_F_B pairs a forward with a backward, in that order ('(0F3;3B1)OVERLAP_F_B')"
        )
    return Action(-1, ActionType.OVERLAP_F_B, None, subs)
