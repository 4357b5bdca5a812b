"""The dataflow rule (schedules/dataflow.py) and its agreement with lowering, the validator and the simulator."""

from __future__ import annotations

import pytest

from pipeloom.schedules import (
    Action,
    ActionType,
    Dataflow,
    TransferKey,
    check,
    consumer_stage,
    generate,
    lower,
    parse_action,
    producer_stage,
    transfer_kind,
)

A = parse_action


def test_stage_arithmetic() -> None:
    assert consumer_stage("F", 1, 4) == 2 and consumer_stage("B", 1, 4) == 0
    assert consumer_stage("F", 3, 4) is None and consumer_stage("B", 0, 4) is None
    assert producer_stage("F", 2, 4) == 1 and producer_stage("B", 2, 4) == 3
    assert producer_stage("F", 0, 4) is None and producer_stage("B", 3, 4) is None
    assert consumer_stage("F", 7) == 8  # no upper bound given
    with pytest.raises(ValueError, match="transfer kind must be 'F' or 'B' \\(got 'W'\\)"):
        consumer_stage("W", 1)
    assert [transfer_kind(t) for t in (ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.SEND_F)] == [
        "F", "B", "B", None, None]


def test_v_placement_tables() -> None:
    # V on 2 ranks: stages 0,3 on rank 0, stages 1,2 on rank 1
    flow = Dataflow((0, 1, 1, 0))
    assert flow.activation_to == (1, 1, 0, None)
    assert flow.gradient_to == (None, 0, 1, 1)
    assert flow.activation_from == (None, 0, 1, 1)
    assert flow.gradient_from == (1, 1, 0, None)
    # F of stage 1 goes to stage 2, on the same rank: nothing is sent
    assert flow.send_rank("F", 1, 1) is None and flow.send_rank("F", 0, 0) == 1 and flow.send_rank("F", 3, 0) is None
    assert flow.send_rank("B", 2, 1) is None and flow.send_rank("B", 3, 0) == 1 and flow.send_rank("B", 0, 0) is None
    assert flow.recv_rank("F", 3, 0) == 1 and flow.recv_rank("B", 0, 0) == 1 and flow.recv_rank("B", 1, 1) is None
    assert flow.links() == {(0, 1), (1, 0)}


def test_keys_and_sends_per_peer() -> None:
    flow = Dataflow((0, 1, 2))
    assert flow.output_key(A("0F3"), 5) == TransferKey(5, "F", 1, 3)
    assert flow.output_key(A("2F3"), 5) is None  # the last stage's output is the loss
    assert flow.output_key(A("2I1"), 0) == (0, "B", 1, 1)  # a plain tuple compares equal
    assert flow.output_key(A("0B1"), 0) is None and flow.output_key(A("1W1"), 0) is None
    assert flow.input_key(A("0F0"), 0) is None and flow.input_key(A("1F0"), 0) == TransferKey(0, "F", 1, 0)
    assert flow.input_key(A("2B0"), 0) is None and flow.input_key(A("1I0"), 0) == TransferKey(0, "B", 1, 0)
    acts = [A("1F0"), A("1F1"), A("1B0"), A("(1F2;1B1)OVERLAP_F_B"), A("1W0")]
    assert flow.sends_per_peer(1, acts) == {2: 3, 0: 2}
    assert flow.links() == {(0, 1), (1, 0), (1, 2), (2, 1)}


@pytest.mark.parametrize("name,ranks", [("1F1B", 3), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 4)])
def test_lowering_sends_exactly_what_the_rule_says(name: str, ranks: int) -> None:
    sched = generate(name, num_ranks=ranks, num_microbatches=8)
    low = lower(sched)
    check(low)
    flow = Dataflow(sched.stage_to_rank)
    for rank, acts in low.actions.items():
        sends: dict[int, int] = {}
        for a in acts:
            if a.type in (ActionType.SEND_F, ActionType.SEND_B):
                kind = "F" if a.type is ActionType.SEND_F else "B"
                dst = flow.send_rank(kind, a.stage, rank)
                assert dst is not None, f"rank {rank}: {a} crosses no ranks by the rule"
                sends[dst] = sends.get(dst, 0) + 1
        assert sends == flow.sends_per_peer(rank, sched.actions[rank])


def test_validator_names_a_send_the_rule_forbids() -> None:
    sched = generate("ZBVZeroBubble", num_ranks=2, num_microbatches=2)
    low = lower(sched)
    # stage 1's forward output goes to stage 2 on the same rank: a SEND_F there is wrong
    bad = {r: list(a) for r, a in low.actions.items()}
    i = next(i for i, a in enumerate(bad[1]) if a == Action(1, ActionType.F, 0))
    bad[1].insert(i + 1, Action(1, ActionType.SEND_F, 0))
    from pipeloom.schedules import validate

    problems = validate(low.with_actions(bad))
    assert any(p.kind == "wrong-peer" and "stage 2 is on the same rank" in p.message for p in problems), problems
