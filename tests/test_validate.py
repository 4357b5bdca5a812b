"""Tests for the validator: valid schedules pass, each class of broken schedule is caught and located."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pipeloom.schedules import (
    Action,
    InvalidScheduleError,
    Schedule,
    ScheduleError,
    ScheduleProblem,
    check,
    dumps_csv,
    generate,
    loads_csv,
    loop_mapping,
    lower,
    merge_bw,
    parse_action,
    v_mapping,
    validate,
)

# (name, ranks, microbatches, stages per rank or None for the default)
CONFIGS = [
    ("GPipe", 1, 3, None),
    ("GPipe", 3, 5, None),
    ("1F1B", 2, 4, None),
    ("1F1B", 4, 8, None),
    ("1F1B", 4, 4, None),
    ("Interleaved1F1B", 2, 4, None),
    ("Interleaved1F1B", 4, 8, 3),
    ("Interleaved1F1B", 4, 6, None),
    ("Interleaved1F1B", 3, 3, None),
    ("LoopedBFS", 2, 3, None),
    ("LoopedBFS", 4, 8, 3),
    ("InterleavedZeroBubble", 2, 4, None),
    ("InterleavedZeroBubble", 4, 8, None),
    ("InterleavedZeroBubble", 4, 12, 3),
    ("ZBVZeroBubble", 2, 4, None),
    ("ZBVZeroBubble", 4, 8, None),
    ("ZBVZeroBubble", 4, 3, None),
    ("DualPipeV", 2, 4, None),
    ("DualPipeV", 4, 8, None),
    ("DualPipeV", 3, 10, None),
]
IDS = [f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in CONFIGS]


def named(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    return generate(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)


def where(schedule: Schedule, rank: int, text: str) -> int:
    """Position of the action spelled ``text`` in ``rank``'s list."""
    return [str(a) for a in schedule.actions[rank]].index(text)


def edit(schedule: Schedule, rank: int, change: Callable[[list[Action]], None]) -> Schedule:
    """A copy of ``schedule`` whose ``rank`` list was changed in place by ``change``."""
    actions = {r: list(a) for r, a in schedule.actions.items()}
    change(actions[rank])
    return schedule.with_actions(actions)


def delete(schedule: Schedule, rank: int, text: str) -> Schedule:
    pos = where(schedule, rank, text)
    return edit(schedule, rank, lambda lst: lst.pop(pos))


def move(schedule: Schedule, rank: int, text: str, before: str) -> Schedule:
    """Move ``text`` to just before ``before`` on ``rank``."""

    def change(lst: list[Action]) -> None:
        strs = [str(a) for a in lst]
        a = lst.pop(strs.index(text))
        lst.insert([str(x) for x in lst].index(before), a)

    return edit(schedule, rank, change)


def swap(schedule: Schedule, rank: int, x: str, y: str) -> Schedule:
    i, j = where(schedule, rank, x), where(schedule, rank, y)

    def change(lst: list[Action]) -> None:
        lst[i], lst[j] = lst[j], lst[i]

    return edit(schedule, rank, change)


def insert(schedule: Schedule, rank: int, text: str, after: str | None = None) -> Schedule:
    def change(lst: list[Action]) -> None:
        pos = len(lst) if after is None else [str(a) for a in lst].index(after) + 1
        lst.insert(pos, parse_action(text))

    return edit(schedule, rank, change)


def summary(problems: list[ScheduleProblem]) -> set[tuple[str, int | None, int | None, str]]:
    return {(p.kind, p.rank, p.position, str(p.action)) for p in problems}


def kinds(problems: list[ScheduleProblem]) -> set[str]:
    return {p.kind for p in problems}


def assert_reported(schedule: Schedule, kind: str, rank: int, position: int | None, action: str) -> list[ScheduleProblem]:
    """The problem is found, ``check`` raises, and its message locates it on a marked grid."""
    problems = validate(schedule)
    assert (kind, rank, position, action) in summary(problems), problems
    with pytest.raises(InvalidScheduleError) as info:
        check(schedule)
    err = info.value
    assert isinstance(err, ScheduleError)
    assert list(err.problems) == problems
    message = str(err)
    for p in problems:
        assert str(p) in message
    if position is not None:
        assert f">>{action}<<" in message
        assert f"rank {rank}, position {position} ({action})" in message
    return problems


# ---------------------------------------------------------------- valid schedules pass


@pytest.mark.parametrize(("name", "p", "m", "v"), CONFIGS, ids=IDS)
def test_named_schedules_validate_cleanly(name: str, p: int, m: int, v: int | None) -> None:
    schedule = named(name, p, m, v)
    variants = {
        "compute-only": schedule,
        "lowered": lower(schedule),
        "early receives": lower(schedule, recv_placement="early"),
        "fsdp": lower(schedule, fsdp=True),
        "fsdp prefetch 2, one resident": lower(
            schedule, fsdp=True, prefetch=2, max_resident=2 if name == "DualPipeV" else 1
        ),
        "fsdp, no comms": lower(schedule, comms=False, fsdp=True),
        "merged backward": lower(merge_bw(schedule), fsdp=True, prefetch=0),
    }
    for label, variant in variants.items():
        assert validate(variant) == [], label
        check(variant)
        again = loads_csv(dumps_csv(variant), stage_to_rank=variant.stage_to_rank)
        assert validate(again) == [], f"{label} via CSV"


TORCH_MULTI = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def torch_schedule(name: str, p: int, m: int, v: int = 2, *, with_comms: bool) -> Schedule:
    """torch's own schedule, as torch lowers it, with the placement its class uses."""
    visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    ops = visualizer.get_schedule_ops(name, p, m, num_stages_per_rank=v, with_comms=with_comms)
    actions = {rank: [parse_action(str(a)) for a in row if a is not None] for rank, row in enumerate(ops)}
    placement = v_mapping(p) if name in ("ZBVZeroBubble", "DualPipeV") else loop_mapping(p, v)
    return Schedule(actions, placement, m, name=name, lowered=with_comms)


TORCH_CONFIGS = [
    (name, p, m, v)
    for name in TORCH_MULTI
    for p, m, v in [(2, 4, 2), (4, 8, 2), (3, 6, 2), (2, 8, 3)]
    if v == 2 or name not in ("ZBVZeroBubble", "DualPipeV")  # V schedules hold exactly two stages per rank
]


@pytest.mark.parametrize(("name", "p", "m", "v"), TORCH_CONFIGS, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in TORCH_CONFIGS])
def test_torch_lowered_schedules_validate(name: str, p: int, m: int, v: int) -> None:
    lowered = torch_schedule(name, p, m, v, with_comms=True)
    # torch's lowering brings UNSHARD/RESHARD, REDUCE_GRAD and as-early-as-possible receives.
    types = {a.type.value for lst in lowered.actions.values() for a in lst}
    assert {"UNSHARD", "RESHARD", "REDUCE_GRAD", "RECV_F", "SEND_B"} <= types
    assert validate(lowered) == []
    assert validate(loads_csv(dumps_csv(lowered), stage_to_rank=lowered.stage_to_rank)) == []
    # And torch's compute-only order (with its REDUCE_GRADs) too.
    assert validate(torch_schedule(name, p, m, v, with_comms=False)) == []


def test_torch_lowered_schedule_with_a_broken_recv_is_caught() -> None:
    lowered = torch_schedule("Interleaved1F1B", 2, 4, with_comms=True)
    broken = delete(lowered, 1, "1RECV_F2")
    assert_reported(broken, "unmatched-send", 0, where(broken, 0, "0SEND_F2"), "0SEND_F2")


# ---------------------------------------------------------------- missing and duplicate


def test_missing_forward() -> None:
    broken = delete(named("1F1B", 2, 4), 1, "1F2")
    problems = assert_reported(broken, "missing", 1, None, "1F2")
    assert kinds(problems) == {"missing"}
    assert "1F2 is missing from rank 1" in str(pytest.raises(InvalidScheduleError, check, broken).value)


def test_missing_backward_and_weight() -> None:
    broken = delete(named("1F1B", 2, 4), 1, "1B1")
    assert kinds(assert_reported(broken, "missing", 1, None, "1B1")) == {"missing"}
    zbv = named("ZBVZeroBubble", 2, 4)
    broken = delete(zbv, 0, "3W2")
    assert kinds(assert_reported(broken, "missing", 0, None, "3W2")) == {"missing"}
    broken = delete(zbv, 0, "3I2")
    assert kinds(assert_reported(broken, "missing", 0, None, "3I2")) == {"missing"}


def test_duplicate_actions() -> None:
    base = named("1F1B", 2, 4)
    broken = insert(base, 0, "0F1")
    assert kinds(assert_reported(broken, "duplicate", 0, len(broken.actions[0]) - 1, "0F1")) == {"duplicate"}
    # A full backward and a split one for the same microbatch.
    broken = insert(named("ZBVZeroBubble", 2, 4), 0, "3B0", after="3W0")
    assert_reported(broken, "duplicate", 0, where(broken, 0, "3I0"), "3I0")
    lowered = lower(base)
    broken = insert(lowered, 0, "0REDUCE_GRAD")
    assert_reported(broken, "duplicate", 0, len(broken.actions[0]) - 1, "0REDUCE_GRAD")


def test_missing_transfer_sides() -> None:
    lowered = lower(named("1F1B", 2, 4))
    broken = delete(delete(lowered, 0, "0SEND_F2"), 1, "1RECV_F2")
    problems = validate(broken)
    assert summary(problems) == {("missing", 0, None, "0SEND_F2"), ("missing", 1, None, "1RECV_F2")}


def test_missing_reduce_grad() -> None:
    broken = delete(lower(named("1F1B", 2, 4)), 1, "1REDUCE_GRAD")
    assert kinds(assert_reported(broken, "missing", 1, None, "1REDUCE_GRAD")) == {"missing"}


# ---------------------------------------------------------------- order on one rank


def test_backward_before_forward() -> None:
    broken = swap(named("1F1B", 2, 4), 1, "1F0", "1B0")
    assert kinds(assert_reported(broken, "dependency", 1, 0, "1B0")) == {"dependency"}


def test_weight_before_input_gradient() -> None:
    zbv = named("ZBVZeroBubble", 2, 4)
    broken = swap(zbv, 0, "3I0", "3W0")
    assert_reported(broken, "dependency", 0, where(broken, 0, "3W0"), "3W0")


def test_local_stage_handover_order_in_v_schedules() -> None:
    # Rank 1 of a 2-rank V schedule holds stages 1 and 2: 2F0 needs 1F0 first.
    zbv = named("ZBVZeroBubble", 2, 4)
    broken = move(zbv, 1, "2F0", before="1F0")
    assert_reported(broken, "dependency", 1, 0, "2F0")
    # ... and 1B needs stage 2's input gradient first.
    broken = move(zbv, 1, "1I0", before="2I0")
    problems = assert_reported(broken, "dependency", 1, where(broken, 1, "1I0"), "1I0")
    assert "2I0" in next(p.message for p in problems if p.kind == "dependency")


def test_both_halves_of_an_overlap_run_together() -> None:
    s = Schedule({0: [parse_action(x) for x in "0F0 (0F1;0B0)OVERLAP_F_B (1F0;1B0)OVERLAP_F_B 0B1".split()]}, (0, 0), 2)
    problems = validate(s)
    assert ("dependency", 0, 2, "(1F0;1B0)OVERLAP_F_B") in summary(problems)
    assert any("same OVERLAP_F_B" in p.message for p in problems)


def test_reduce_grad_before_last_backward() -> None:
    broken = move(lower(named("1F1B", 2, 4)), 0, "0REDUCE_GRAD", before="0B3")
    assert kinds(assert_reported(broken, "dependency", 0, where(broken, 0, "0REDUCE_GRAD"), "0REDUCE_GRAD")) == {"dependency"}


def test_out_of_range() -> None:
    broken = insert(named("1F1B", 2, 4), 0, "0F9")
    assert_reported(broken, "out-of-range", 0, 8, "0F9")
    broken = insert(named("1F1B", 2, 4), 0, "7UNSHARD")
    assert_reported(broken, "out-of-range", 0, 8, "7UNSHARD")


def test_wrong_rank() -> None:
    base = named("1F1B", 3, 4)

    def moved(actions: dict[int, list[Action]]) -> None:
        a = actions[2].pop([str(x) for x in actions[2]].index("2F1"))
        actions[1].append(a)

    actions = {r: list(a) for r, a in base.actions.items()}
    moved(actions)
    broken = base.with_actions(actions)
    problems = assert_reported(broken, "wrong-rank", 1, len(actions[1]) - 1, "2F1")
    assert kinds(problems) == {"wrong-rank"}  # not also "missing" on rank 2
    bad_placement = Schedule(base.actions, (0, 1, 5), 4)
    assert kinds(validate(bad_placement)) == {"wrong-rank"}


# ---------------------------------------------------------------- transfers


def test_receive_without_send_and_send_without_receive() -> None:
    lowered = lower(named("1F1B", 2, 4))
    broken = delete(lowered, 1, "1RECV_F2")
    assert kinds(assert_reported(broken, "unmatched-send", 0, where(broken, 0, "0SEND_F2"), "0SEND_F2")) == {"unmatched-send"}
    broken = delete(lowered, 0, "0SEND_F2")
    assert kinds(assert_reported(broken, "unmatched-recv", 1, where(broken, 1, "1RECV_F2"), "1RECV_F2")) == {"unmatched-recv"}
    broken = delete(lowered, 0, "0RECV_B3")
    assert kinds(assert_reported(broken, "unmatched-send", 1, where(broken, 1, "1SEND_B3"), "1SEND_B3")) == {"unmatched-send"}


def test_compute_before_its_receive() -> None:
    lowered = lower(named("1F1B", 2, 4))
    broken = move(lowered, 1, "1RECV_F2", before="1B2")  # now after 1F2
    assert kinds(assert_reported(broken, "late-recv", 1, where(broken, 1, "1F2"), "1F2")) == {"late-recv"}
    broken = move(lowered, 0, "0RECV_B1", before="0F3")  # now after 0B1
    assert_reported(broken, "late-recv", 0, where(broken, 0, "0B1"), "0B1")


def test_send_before_its_producer() -> None:
    broken = move(lower(named("1F1B", 2, 4)), 0, "0SEND_F2", before="0F2")
    assert kinds(assert_reported(broken, "dependency", 0, where(broken, 0, "0SEND_F2"), "0SEND_F2")) == {"dependency"}


def test_transfers_to_the_wrong_peer() -> None:
    # Stages 1 and 2 share rank 1 in a 2-rank V schedule: no transfer between them.
    zbv = lower(named("ZBVZeroBubble", 2, 4))
    broken = insert(insert(zbv, 1, "1SEND_F0", after="1F0"), 1, "2RECV_F0", after="1SEND_F0")
    problems = validate(broken)
    assert summary(problems) >= {
        ("wrong-peer", 1, where(broken, 1, "1SEND_F0"), "1SEND_F0"),
        ("wrong-peer", 1, where(broken, 1, "2RECV_F0"), "2RECV_F0"),
    }
    # Out of the ends of the pipeline.
    lowered = lower(named("1F1B", 2, 4))
    broken = insert(lowered, 1, "1SEND_F0", after="1F0")
    assert kinds(assert_reported(broken, "wrong-peer", 1, where(broken, 1, "1SEND_F0"), "1SEND_F0")) == {"wrong-peer"}
    broken = insert(lowered, 0, "0RECV_F0")
    assert_reported(broken, "wrong-peer", 0, len(broken.actions[0]) - 1, "0RECV_F0")


def test_receives_out_of_the_peers_send_order() -> None:
    lowered = lower(named("GPipe", 2, 4))
    assert [str(a) for a in lowered.actions[1][:4]] == "1RECV_F0 1F0 1RECV_F1 1F1".split()
    broken = move(lowered, 1, "1RECV_F1", before="1RECV_F0")  # both still before their forwards
    problems = assert_reported(broken, "recv-order", 1, 1, "1RECV_F0")
    assert kinds(problems) == {"recv-order"}
    assert "pair up in posting order" in problems[0].message


# ---------------------------------------------------------------- FSDP


def test_fsdp_compute_outside_unshard_reshard() -> None:
    lowered = lower(named("Interleaved1F1B", 2, 4), fsdp=True, prefetch=0)
    broken = delete(lowered, 0, "0UNSHARD")
    problems = assert_reported(broken, "fsdp", 0, where(broken, 0, "0F0"), "0F0")
    assert kinds(problems) == {"fsdp"}
    assert ("fsdp", 0, where(broken, 0, "0RESHARD"), "0RESHARD") in summary(problems)
    assert "sharded" in problems[0].message

    broken = delete(lowered, 0, "2RESHARD")
    assert kinds(assert_reported(broken, "fsdp", 0, where(broken, 0, "2UNSHARD"), "2UNSHARD")) == {"fsdp"}

    broken = move(lowered, 0, "0RESHARD", before="0B3")
    assert_reported(broken, "fsdp", 0, where(broken, 0, "0B3"), "0B3")

    broken = insert(lowered, 0, "0UNSHARD", after="0UNSHARD")
    assert_reported(broken, "fsdp", 0, 1, "0UNSHARD")


# ---------------------------------------------------------------- deadlocks


def test_compute_only_deadlock() -> None:
    base = named("1F1B", 2, 4)
    assert [str(a) for a in base.actions[0][:3]] == "0F0 0F1 0B0".split()
    assert [str(a) for a in base.actions[1][:3]] == "1F0 1B0 1F1".split()
    broken = swap(swap(base, 0, "0F1", "0B0"), 1, "1B0", "1F1")
    problems = assert_reported(broken, "deadlock", 0, 1, "0B0")
    assert ("deadlock", 1, 1, "1F1") in summary(problems)
    assert kinds(problems) == {"deadlock"}
    by_rank = {p.rank: p.message for p in problems}
    assert "1B0 at position 2 of rank 1" in by_rank[0] and "rank 1 is stuck at position 1 (1F1)" in by_rank[0]
    assert "0F1 at position 2 of rank 0" in by_rank[1]


def test_deadlock_from_two_swapped_receives() -> None:
    lowered = lower(named("1F1B", 2, 4))
    i, j = where(lowered, 0, "0RECV_B0"), where(lowered, 0, "0RECV_B2")
    broken = swap(lowered, 0, "0RECV_B0", "0RECV_B2")
    problems = validate(broken)
    deadlocks = [p for p in problems if p.kind == "deadlock"]
    assert summary(deadlocks) == {
        ("deadlock", 0, i, "0RECV_B2"),
        ("deadlock", 1, where(broken, 1, "1RECV_F2"), "1RECV_F2"),
    }
    msg = next(p.message for p in deadlocks if p.rank == 0)
    assert "waits for 1SEND_B2" in msg and "rank 1 is stuck" in msg
    assert j > i
    assert_reported(broken, "deadlock", 0, i, "0RECV_B2")


def test_deadlock_across_ranks_in_interleaved_lowered() -> None:
    lowered = lower(named("Interleaved1F1B", 4, 8))
    # Rank 0 waits for the gradient of microbatch 0 before sending microbatch 3's
    # activation, which the pipeline needs before that gradient can exist.
    first_recv_b = next(str(a) for a in lowered.actions[0] if a.type.value == "RECV_B")
    broken = move(lowered, 0, first_recv_b, before="0F3")
    problems = validate(broken)
    assert "deadlock" in kinds(problems)
    assert ("deadlock", 0, where(broken, 0, first_recv_b), first_recv_b) in summary(problems)


# ---------------------------------------------------------------- messages and speed


def test_message_lists_every_problem_and_bounds_the_grids() -> None:
    lowered = lower(named("1F1B", 4, 8))
    actions = {r: [a for a in lst if not (r == 2 and a.type.value == "RECV_F")] for r, lst in lowered.actions.items()}
    broken = lowered.with_actions(actions)
    problems = validate(broken)
    assert len(problems) == 8 and kinds(problems) == {"unmatched-send"}
    message = str(pytest.raises(InvalidScheduleError, check, broken).value)
    assert message.startswith("invalid schedule '1F1B' (4 ranks, 4 stages, 8 microbatches, lowered): 8 problems")
    assert message.count(">>1SEND_F") == 8
    broken = lowered.with_actions({r: [a for a in lst if a.type.value != "RECV_F"] for r, lst in lowered.actions.items()})
    message = str(pytest.raises(InvalidScheduleError, check, broken).value)
    assert "grids of the remaining 16 problems left out" in message


def test_validate_problems_survive_a_csv_round_trip() -> None:
    broken = swap(lower(named("Interleaved1F1B", 2, 4)), 1, "3RECV_F0", "1RECV_F1")
    again = loads_csv(dumps_csv(broken), stage_to_rank=broken.stage_to_rank)
    assert summary(validate(again)) == summary(validate(broken)) != set()


@pytest.mark.parametrize("name", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_a_large_schedule_lowers_and_validates_cleanly(name: str) -> None:
    # Its speed is shown by benchmarks/schedule_speed.py, not asserted here.
    lowered = lower(named(name, 64, 256, 2))
    assert validate(lowered) == []
    assert sum(len(a) for a in lowered.actions.values()) > 190_000
