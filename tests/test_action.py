"""Unit tests of the action IR: parsing, printing, CSV I/O, placements and the grid view.

torch.distributed.pipelining is the reference for the string and CSV forms, so
several tests feed torch's own output through our loader.  Only the
private ``get_schedule_ops`` helper is touched, and only here, in tests.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from pipeloom.schedules import (
    Action,
    ActionParseError,
    ActionType,
    Schedule,
    ScheduleError,
    dump_csv,
    dumps_csv,
    format_grid,
    infer_stage_to_rank,
    load_csv,
    loads_csv,
    loop_mapping,
    parse_action,
    v_mapping,
)

F, I, W, B = ActionType.F, ActionType.I, ActionType.W, ActionType.B

# One example of every action type, with the value it must parse to.
EXAMPLES: list[tuple[str, Action]] = [
    ("2F0", Action(2, ActionType.F, 0)),
    ("1I3", Action(1, ActionType.I, 3)),
    ("0W3", Action(0, ActionType.W, 3)),
    ("1B2", Action(1, ActionType.B, 2)),
    ("0UNSHARD", Action(0, ActionType.UNSHARD)),
    ("0RESHARD", Action(0, ActionType.RESHARD)),
    ("3SEND_F1", Action(3, ActionType.SEND_F, 1)),
    ("2RECV_F0", Action(2, ActionType.RECV_F, 0)),
    ("1SEND_B3", Action(1, ActionType.SEND_B, 3)),
    ("2RECV_B0", Action(2, ActionType.RECV_B, 0)),
    ("0REDUCE_GRAD", Action(0, ActionType.REDUCE_GRAD)),
    ("12F345", Action(12, ActionType.F, 345)),
    (
        "(0F3;3B1)OVERLAP_F_B",
        Action(-1, ActionType.OVERLAP_F_B, None, (Action(0, ActionType.F, 3), Action(3, ActionType.B, 1))),
    ),
    (
        "(2F2;1I0)OVERLAP_F_B",
        Action(-1, ActionType.OVERLAP_F_B, None, (Action(2, ActionType.F, 2), Action(1, ActionType.I, 0))),
    ),
]


def _torch_rows(name: str, ranks: int, microbatches: int, stages_per_rank: int | None, with_comms: bool) -> list[list[object]]:
    """Every rank's list as torch 2.13 builds it (``None`` for a bubble)."""
    vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    return vis.get_schedule_ops(name, ranks, microbatches, stages_per_rank, with_comms=with_comms)


def _torch_csv(rows: list[list[object]]) -> str:
    """Write rows exactly as torch's ``_dump_csv`` does: ``csv.writer`` over the action objects."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    for row in rows:
        writer.writerow(row)
    return buf.getvalue()


# ---------------------------------------------------------------- parsing and printing


@pytest.mark.parametrize(("text", "expected"), EXAMPLES, ids=[t for t, _ in EXAMPLES])
def test_parse_and_print_round_trip(text: str, expected: Action) -> None:
    action = parse_action(text)
    assert action == expected
    assert str(action) == text
    assert parse_action(str(action)) == action
    assert Action.parse(text) == action


def test_every_action_type_has_an_example() -> None:
    assert {a.type for _, a in EXAMPLES} == set(ActionType)


def test_surrounding_whitespace_is_ignored() -> None:
    assert parse_action("  1F0\t") == Action(1, F, 0)
    assert parse_action(" (0F3; 3B1)OVERLAP_F_B ") == parse_action("(0F3;3B1)OVERLAP_F_B")


def test_overlap_container_matches_torch_conventions() -> None:
    overlap = parse_action("(0F3;3B1)OVERLAP_F_B")
    assert overlap.stage == -1
    assert overlap.microbatch is None
    assert overlap.leaves() == (Action(0, F, 3), Action(3, B, 1))
    assert overlap.is_compute and not overlap.is_comm


def test_leaves_of_a_plain_action_is_itself() -> None:
    a = Action(1, F, 0)
    assert a.leaves() == (a,)


@pytest.mark.parametrize(
    ("text", "compute", "comm"),
    [("1F0", True, False), ("1I0", True, False), ("1W0", True, False), ("1B0", True, False),
     ("1SEND_F0", False, True), ("1RECV_B0", False, True), ("1UNSHARD", False, False), ("1REDUCE_GRAD", False, False)],
)
def test_compute_and_comm_classification(text: str, compute: bool, comm: bool) -> None:
    a = parse_action(text)
    assert (a.is_compute, a.is_comm) == (compute, comm)


def test_action_type_prints_as_its_spelling() -> None:
    assert str(ActionType.SEND_F) == "SEND_F"
    assert repr(Action(1, F, 0)) == "Action(1F0)"


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("1F0x", "expected [stage][type][microbatch]"),
        ("0UNSHARD3", "takes no microbatch"),
        ("0REDUCE_GRAD1", "takes no microbatch"),
        ("1F", "needs a microbatch"),
        ("1SEND_F", "needs a microbatch"),
        ("F0", "expected [stage][type][microbatch]"),
        ("-1F0", "expected [stage][type][microbatch]"),
        ("1X0", "expected [stage][type][microbatch]"),
        ("1f0", "expected [stage][type][microbatch]"),
        ("(0F1;1F2)OVERLAP_F_B", "pairs a forward with a backward"),
        ("(3B1;0F3)OVERLAP_F_B", "pairs a forward with a backward"),
        ("(0F1;1SEND_B2)OVERLAP_F_B", "cannot be overlapped"),
        ("(0F1;1B2", "never closed"),
        ("(0F1;1B2OVERLAP_F_B", "never closed"),
        ("(0F1;1B2)", "must be followed by 'OVERLAP_F_B'"),
        ("(0F1;1B2)OVERLAP", "must be followed by 'OVERLAP_F_B'"),
        ("(0F1)OVERLAP_F_B", "exactly two actions"),
        ("(0F1;1B2;2B3)OVERLAP_F_B", "exactly two actions"),
        ("(0F1;)OVERLAP_F_B", "exactly two actions"),
        ("", "empty"),
        ("   ", "empty"),
    ],
)
def test_strict_parser_rejects_and_quotes_the_input(text: str, hint: str) -> None:
    with pytest.raises(ActionParseError) as info:
        parse_action(text)
    message = str(info.value)
    assert repr(text) in message
    assert hint in message


def test_parse_error_is_a_value_error() -> None:
    # Callers that only know ValueError (argparse type= converters, for one) still catch it.
    assert issubclass(ActionParseError, ValueError)


def test_hashing_and_equality() -> None:
    a = parse_action("1F0")
    assert a == Action(1, F, 0)
    assert hash(a) == hash(Action(1, F, 0))
    assert a != Action(1, F, 1)
    assert a != Action(0, F, 0)
    assert a != Action(1, B, 0)
    assert Action(0, ActionType.UNSHARD) != Action(0, ActionType.RESHARD)
    overlap = parse_action("(0F3;3B1)OVERLAP_F_B")
    assert overlap == parse_action("(0F3;3B1)OVERLAP_F_B")
    assert overlap != parse_action("(0F3;3I1)OVERLAP_F_B")
    assert len({parse_action(t) for t, _ in EXAMPLES} | {parse_action(t) for t, _ in EXAMPLES}) == len(EXAMPLES)
    assert {a: "x"}[Action(1, F, 0)] == "x"


def test_actions_are_immutable() -> None:
    a = Action(1, F, 0)
    with pytest.raises(AttributeError):
        a.stage = 2  # type: ignore[misc]


def test_torch_action_strings_parse_to_the_same_text() -> None:
    rows = _torch_rows("DualPipeV", 2, 4, 2, with_comms=True)
    seen: set[ActionType] = set()
    for row in rows:
        for torch_action in row:
            if torch_action is None:
                continue
            ours = parse_action(str(torch_action))
            assert str(ours) == str(torch_action)
            seen.add(ours.type)
    assert ActionType.OVERLAP_F_B in seen and ActionType.SEND_B in seen and ActionType.UNSHARD in seen


def test_torch_parses_our_strings() -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for text, _ in EXAMPLES:
        assert str(schedules._Action.from_str(text)) == text


# ---------------------------------------------------------------- CSV I/O

COMPUTE_CSV = "0F0,0F1,,0B0,,0B1\n,1F0,1B0,1F1,1B1\n"
LOWERED_CSV = (
    "0UNSHARD,0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD,0RESHARD\n"
    "1UNSHARD,1RECV_F0,1F0,1B0,1SEND_B0,1REDUCE_GRAD,1RESHARD\n"
)


def test_load_compute_only_csv_skips_bubbles() -> None:
    sched = loads_csv(COMPUTE_CSV)
    assert [str(a) for a in sched.actions[0]] == ["0F0", "0F1", "0B0", "0B1"]
    assert [str(a) for a in sched.actions[1]] == ["1F0", "1B0", "1F1", "1B1"]
    assert sched.stage_to_rank == (0, 1)
    assert sched.num_microbatches == 2
    assert sched.num_ranks == 2 and sched.num_stages == 2
    assert sched.lowered is False
    assert sched.name == "custom"


def test_none_cells_are_bubbles_too() -> None:
    assert loads_csv("0F0,None,0B0\n").actions[0] == [Action(0, F, 0), Action(0, B, 0)]


def test_compute_only_round_trip() -> None:
    sched = loads_csv(COMPUTE_CSV)
    again = loads_csv(dumps_csv(sched))
    assert again.actions == sched.actions
    assert again.stage_to_rank == sched.stage_to_rank
    assert dumps_csv(sched) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"


def test_lowered_round_trip() -> None:
    sched = loads_csv(LOWERED_CSV)
    assert sched.lowered is True
    assert dumps_csv(sched) == LOWERED_CSV
    assert loads_csv(dumps_csv(sched)).actions == sched.actions
    assert [str(a) for a in sched.compute_only().actions[1]] == ["1F0", "1B0"]
    assert sched.compute_only().lowered is False


def test_overlap_cells_are_quoted_free_and_round_trip() -> None:
    text = "0F0,(0F1;0B0)OVERLAP_F_B,0B1\n1F0,1B0,1F1,1B1\n"
    sched = loads_csv(text)
    assert sched.actions[0][1].type is ActionType.OVERLAP_F_B
    assert dumps_csv(sched) == text


def test_dump_and_load_files(tmp_path: Path) -> None:
    sched = loads_csv(LOWERED_CSV)
    path = tmp_path / "s.csv"
    dump_csv(sched, path)
    assert load_csv(path).actions == sched.actions
    assert load_csv(str(path)).actions == sched.actions
    buf = io.StringIO()
    dump_csv(sched.actions, buf)
    assert buf.getvalue() == LOWERED_CSV
    with open(path, newline="") as f:
        assert load_csv(f).actions == sched.actions


@pytest.mark.parametrize(
    ("name", "ranks", "microbatches", "stages_per_rank", "mapping"),
    [
        ("Interleaved1F1B", 2, 4, 2, loop_mapping(2, 2)),
        ("InterleavedZeroBubble", 2, 4, 2, loop_mapping(2, 2)),
        ("LoopedBFS", 4, 8, 2, loop_mapping(4, 2)),
        ("ZBVZeroBubble", 2, 4, 2, v_mapping(2)),
        ("DualPipeV", 4, 8, 2, v_mapping(4)),
    ],
)
@pytest.mark.parametrize("with_comms", [False, True], ids=["compute", "comms"])
def test_csv_written_by_torch_loads_into_the_same_actions(
    name: str, ranks: int, microbatches: int, stages_per_rank: int, mapping: tuple[int, ...], with_comms: bool
) -> None:
    rows = _torch_rows(name, ranks, microbatches, stages_per_rank, with_comms)
    text = _torch_csv(rows)
    if not with_comms and name != "DualPipeV":
        assert any(a is None for row in rows for a in row)  # torch writes these bubbles as empty cells
    sched = loads_csv(text, num_ranks=ranks)
    for rank, row in enumerate(rows):
        assert [str(a) for a in sched.actions[rank]] == [str(a) for a in row if a is not None]
    assert sched.stage_to_rank == mapping
    assert sched.num_microbatches == microbatches
    assert sched.lowered is with_comms
    # ... and what we write, torch's own loader reads back to the same strings.
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for rank, line in enumerate(csv.reader(io.StringIO(dumps_csv(sched)))):
        assert [str(schedules._Action.from_str(cell)) for cell in line] == [str(a) for a in sched.actions[rank]]


def test_torch_dump_csv_file_loads(tmp_path: Path) -> None:
    """A file written by a real torch schedule object's ``_dump_csv``."""
    pipelining = pytest.importorskip("torch.distributed.pipelining")
    from unittest import mock

    stage = mock.create_autospec(pipelining.stage.PipelineStage, instance=True)
    stage.group_rank = 0
    stage.group_size = 2
    stage.num_stages = 4
    stage.submod = None
    torch_schedule = pipelining.schedules.ScheduleZBVZeroBubble([stage, stage], 4)
    # torch writes the compute-only order with bubbles, and the lowered order.
    for fmt, order, lowered in [
        ("compute_only", torch_schedule.pipeline_order, False),
        ("compute_comms", torch_schedule.pipeline_order_with_comms, True),
    ]:
        path = tmp_path / f"{fmt}.csv"
        torch_schedule._dump_csv(str(path), format=fmt)
        sched = load_csv(path, num_ranks=2)
        for rank in range(2):
            assert [str(a) for a in sched.actions[rank]] == [str(a) for a in order[rank] if a is not None]
        assert sched.stage_to_rank == v_mapping(2)
        assert sched.lowered is lowered


def test_malformed_cell_reports_row_rank_and_column() -> None:
    with pytest.raises(ScheduleError) as info:
        loads_csv("0F0,0F1\n1F0,1X0\n", source="bad.csv")
    message = str(info.value)
    assert "bad.csv" in message
    assert "row 2 (rank 1), column 2" in message
    assert "'1X0'" in message


def test_malformed_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "broken.csv"
    path.write_text("0F0,0UNSHARD3\n")
    with pytest.raises(ScheduleError, match=r"broken\.csv: row 1 \(rank 0\), column 2"):
        load_csv(path)


def test_wrong_row_count_is_reported() -> None:
    with pytest.raises(ScheduleError, match="has 2 rows.*expected 3"):
        loads_csv(COMPUTE_CSV, num_ranks=3)


def test_empty_csv_is_reported() -> None:
    with pytest.raises(ScheduleError, match="no rows"):
        loads_csv("")


def test_explicit_placement_overrides_inference() -> None:
    sched = loads_csv(COMPUTE_CSV, stage_to_rank=[0, 1])
    assert sched.stage_to_rank == (0, 1)


# ---------------------------------------------------------------- placements


def test_loop_mapping() -> None:
    assert loop_mapping(4) == (0, 1, 2, 3)
    assert loop_mapping(4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert loop_mapping(2, 3) == (0, 1, 0, 1, 0, 1)


def test_v_mapping() -> None:
    assert v_mapping(2) == (0, 1, 1, 0)
    assert v_mapping(3) == (0, 1, 2, 2, 1, 0)
    for p in (1, 4, 8):
        mapping = v_mapping(p)
        assert len(mapping) == 2 * p
        assert all(mapping.count(r) == 2 for r in range(p))


def test_stages_of() -> None:
    sched = Schedule({0: [], 1: [], 2: []}, v_mapping(3), 1)
    assert sched.stages_of(0) == (0, 5)
    assert sched.stages_of(2) == (2, 3)


def test_infer_stage_to_rank() -> None:
    actions = {0: [Action(0, F, 0), Action(3, F, 0)], 1: [Action(1, F, 0), parse_action("(2F0;1B0)OVERLAP_F_B")]}
    assert infer_stage_to_rank(actions) == (0, 1, 1, 0)


def test_infer_stage_to_rank_rejects_a_stage_on_two_ranks() -> None:
    actions = {0: [Action(0, F, 0), Action(1, B, 0)], 1: [Action(1, F, 0)]}
    with pytest.raises(ScheduleError) as info:
        infer_stage_to_rank(actions)
    message = str(info.value)
    assert "stage 1" in message and "rank 0" in message and "rank 1" in message
    assert "position 0" in message and "1F0" in message


def test_infer_stage_to_rank_rejects_an_overlap_that_spans_a_foreign_stage() -> None:
    actions = {0: [Action(0, F, 0)], 1: [Action(1, F, 0), parse_action("(1F1;0B0)OVERLAP_F_B")]}
    with pytest.raises(ScheduleError, match="stage 0 also appears on rank 0"):
        infer_stage_to_rank(actions)


def test_infer_stage_to_rank_rejects_gaps() -> None:
    with pytest.raises(ScheduleError, match=r"stages \[1\] appear on no rank"):
        infer_stage_to_rank({0: [Action(0, F, 0)], 1: [Action(2, F, 0)]})


def test_infer_stage_to_rank_rejects_nothing() -> None:
    with pytest.raises(ScheduleError, match="no actions"):
        infer_stage_to_rank({0: [], 1: []})


# ---------------------------------------------------------------- grid view


def test_format_grid_lists_every_rank() -> None:
    grid = format_grid(loads_csv(COMPUTE_CSV))
    lines = grid.splitlines()
    assert lines[1].startswith("rank 0 |") and lines[2].startswith("rank 1 |")
    assert lines[1].split() == ["rank", "0", "|", "0F0", "0F1", "0B0", "0B1"]
    assert str(loads_csv(COMPUTE_CSV)) == grid


def test_format_grid_marks_the_cell() -> None:
    sched = loads_csv(COMPUTE_CSV)
    grid = format_grid(sched, mark=(1, 2))
    lines = grid.splitlines()
    assert ">>1F1<<" in lines[2]
    assert grid.count(">>") == 1
    caret = lines[-1]
    assert set(caret.strip()) == {"^"}
    # The carets sit under the marked cell.
    start = caret.index("^")
    assert lines[2][start : start + len(caret.strip())].strip() == ">>1F1<<"


def test_format_grid_windows_long_schedules_around_the_mark() -> None:
    acts = {0: [Action(0, F, m) for m in range(50)] + [Action(0, B, m) for m in range(50)]}
    grid = format_grid(acts, mark=(0, 80), max_steps=10)
    assert ">>0B30<<" in grid
    assert "(steps 75..84 of 100)" in grid
    assert "0F0 " not in grid


def test_format_grid_of_an_empty_mapping() -> None:
    assert isinstance(format_grid({}), str)
