"""A schedule: every rank's ordered list of actions, plus where each stage lives.

A ``Schedule`` is plain data.  Generators build one, lowering passes return a
new one, the validator and simulator read one, and the runtime takes one rank's
list of it as that rank's priority order.  Bubbles (torch's ``None`` slots) are
not stored: in an event-driven runtime the gaps come from dependencies, not
from placeholders.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TextIO

from .action import Action, ActionParseError, parse_action

__all__ = [
    "Schedule",
    "ScheduleError",
    "loop_mapping",
    "v_mapping",
    "infer_stage_to_rank",
    "format_grid",
    "load_csv",
    "loads_csv",
    "dump_csv",
    "dumps_csv",
]


class ScheduleError(ValueError):
    """A schedule that cannot be built, loaded or run; the message says where and why."""


def loop_mapping(num_ranks: int, stages_per_rank: int = 1) -> tuple[int, ...]:
    """Stage s lives on rank ``s % num_ranks`` (GPipe, 1F1B, the interleaved schedules)."""
    return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))


def v_mapping(num_ranks: int) -> tuple[int, ...]:
    """Rank r holds stages r and 2p-1-r (ZBVZeroBubble, DualPipeV)."""
    return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(2 * num_ranks))


@dataclass(frozen=True)
class Schedule:
    """Every rank's action list and the stage-to-rank placement.

    Attributes:
        actions: rank -> its actions in priority order (no ``None`` bubbles).
        stage_to_rank: stage index -> the rank that holds it.
        num_microbatches: microbatches per step.
        name: the generator's name, or ``"custom"`` for a loaded schedule.
        lowered: True once communication actions have been added.
    """

    actions: Mapping[int, Sequence[Action]]
    stage_to_rank: tuple[int, ...]
    num_microbatches: int
    name: str = "custom"
    lowered: bool = False
    meta: Mapping[str, object] = field(default_factory=dict)

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages that ``rank`` holds, in increasing order."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def with_actions(self, actions: Mapping[int, Sequence[Action]], *, lowered: bool | None = None) -> Schedule:
        """A copy with other action lists (what a lowering pass returns)."""
        return replace(self, actions=actions, lowered=self.lowered if lowered is None else lowered)

    def compute_only(self) -> Schedule:
        """Drop communication, FSDP and reduction actions, keeping the compute order."""
        return self.with_actions({r: [a for a in acts if a.is_compute] for r, acts in self.actions.items()}, lowered=False)

    def __str__(self) -> str:
        return format_grid(self)


def infer_stage_to_rank(actions: Mapping[int, Sequence[Action]]) -> tuple[int, ...]:
    """Work out the placement from which rank runs each stage's actions.

    Raises ScheduleError if a stage appears on two ranks or a stage index in
    ``0..max`` appears nowhere.
    """
    owner: dict[int, int] = {}
    for rank, acts in actions.items():
        for pos, action in enumerate(acts):
            for leaf in action.leaves():
                prev = owner.setdefault(leaf.stage, rank)
                if prev != rank:
                    raise ScheduleError(
                        f"rank {rank}, position {pos}, action {action}: stage {leaf.stage} also appears on rank {prev}; "
                        "a stage lives on exactly one rank"
                    )
    if not owner:
        raise ScheduleError("the schedule has no actions")
    missing = [s for s in range(max(owner) + 1) if s not in owner]
    if missing:
        raise ScheduleError(f"stages {missing} appear on no rank (stages must be numbered 0..{max(owner)} without gaps)")
    return tuple(owner[s] for s in range(len(owner)))


def _infer_num_microbatches(actions: Mapping[int, Sequence[Action]]) -> int:
    mbs = [leaf.microbatch for acts in actions.values() for a in acts for leaf in a.leaves() if leaf.microbatch is not None]
    return max(mbs) + 1 if mbs else 0


# ---------------------------------------------------------------- grid view

def format_grid(
    schedule: Schedule | Mapping[int, Sequence[Action]],
    *,
    mark: tuple[int, int] | None = None,
    max_steps: int | None = None,
) -> str:
    """The rank-by-step grid: one row per rank, one column per list position.

    ``mark=(rank, position)`` brackets that cell with ``>>...<<`` and adds a
    caret line under the column, so an error message can point at it.
    """
    actions = schedule.actions if isinstance(schedule, Schedule) else schedule
    ranks = sorted(actions)
    width = max((len(str(a)) for acts in actions.values() for a in acts), default=2)
    if mark is not None:
        width += 4
    longest = max((len(actions[r]) for r in ranks), default=0)
    steps = longest if max_steps is None else min(longest, max_steps)
    start = 0
    if mark is not None and max_steps is not None and mark[1] >= steps:
        start = max(0, mark[1] - steps // 2)
    cols = range(start, min(longest, start + steps))
    label_w = len(f"rank {ranks[-1]}") if ranks else 6
    lines = [" " * label_w + " | " + " ".join(f"{c:>{width}}" for c in cols)]
    for r in ranks:
        cells = []
        for c in cols:
            text = str(actions[r][c]) if c < len(actions[r]) else ""
            if mark == (r, c):
                text = f">>{text}<<"
            cells.append(f"{text:>{width}}")
        lines.append(f"{'rank ' + str(r):<{label_w}} | " + " ".join(cells))
    if mark is not None and mark[1] in cols:
        idx = list(cols).index(mark[1])
        lines.append(" " * (label_w + 3 + idx * (width + 1)) + "^" * width)
    if len(cols) < longest:
        lines.append(f"(steps {cols.start}..{cols.stop - 1} of {longest})")
    return "\n".join(lines)


# ---------------------------------------------------------------- CSV I/O

def _parse_rows(rows: Iterable[Sequence[str]], source: str) -> dict[int, list[Action]]:
    actions: dict[int, list[Action]] = {}
    for rank, row in enumerate(rows):
        acts: list[Action] = []
        for col, cell in enumerate(row):
            cell = cell.strip()
            if not cell or cell == "None":  # torch writes bubbles as empty cells
                continue
            try:
                acts.append(parse_action(cell))
            except ActionParseError as exc:
                raise ScheduleError(f"{source}: row {rank + 1} (rank {rank}), column {col + 1}: {exc}") from None
        actions[rank] = acts
    return actions


def loads_csv(
    text: str,
    *,
    source: str = "<csv>",
    num_ranks: int | None = None,
    stage_to_rank: Sequence[int] | None = None,
) -> Schedule:
    """Parse a schedule in torch's CSV format: one row per rank, one action per cell.

    Works for compute-only and lowered schedules alike.  The placement is
    inferred from the rows unless ``stage_to_rank`` is given; ``num_ranks``
    checks the row count.
    """
    actions = _parse_rows(csv.reader(io.StringIO(text)), source)
    if num_ranks is not None and len(actions) != num_ranks:
        raise ScheduleError(f"{source}: has {len(actions)} rows (ranks), expected {num_ranks}")
    if not actions:
        raise ScheduleError(f"{source}: no rows; a schedule CSV has one row per rank")
    placement = tuple(stage_to_rank) if stage_to_rank is not None else infer_stage_to_rank(actions)
    lowered = any(not a.is_compute for acts in actions.values() for a in acts)
    return Schedule(actions, placement, _infer_num_microbatches(actions), name="custom", lowered=lowered)


def load_csv(
    path: str | os.PathLike[str] | TextIO,
    *,
    num_ranks: int | None = None,
    stage_to_rank: Sequence[int] | None = None,
) -> Schedule:
    """Read a schedule CSV file (see :func:`loads_csv`)."""
    if hasattr(path, "read"):
        return loads_csv(path.read(), source=getattr(path, "name", "<csv>"), num_ranks=num_ranks, stage_to_rank=stage_to_rank)  # type: ignore[union-attr]
    with open(path, newline="") as f:  # type: ignore[arg-type]
        return loads_csv(f.read(), source=os.fspath(path), num_ranks=num_ranks, stage_to_rank=stage_to_rank)  # type: ignore[arg-type]


def dumps_csv(schedule: Schedule | Mapping[int, Sequence[Action]]) -> str:
    """The schedule in torch's CSV format (what ``_load_csv`` reads)."""
    actions = schedule.actions if isinstance(schedule, Schedule) else schedule
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for rank in sorted(actions):
        writer.writerow([str(a) for a in actions[rank]])
    return buf.getvalue()


def dump_csv(schedule: Schedule | Mapping[int, Sequence[Action]], path: str | os.PathLike[str] | TextIO) -> None:
    """Write the schedule as CSV to a path or an open text file."""
    text = dumps_csv(schedule)
    if hasattr(path, "write"):
        path.write(text)  # type: ignore[union-attr]
        return
    with open(path, "w", newline="") as f:  # type: ignore[arg-type]
        f.write(text)

