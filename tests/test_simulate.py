"""Tests for the cost-model simulator: textbook bubble formulas, every action type, costs parsing."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest

from pipeloom.schedules import (
    Costs,
    Schedule,
    ScheduleError,
    SimulationResult,
    generate,
    loop_mapping,
    lower,
    parse_action,
    simulate,
    v_mapping,
)

UNIFORM = [Costs(F=1, B=2), Costs(F=1, B=1), Costs(F=2, B=3)]
UNIFORM_IDS = ["F1B2", "F1B1", "F2B3"]


def named(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    return generate(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)


def sched(*rows: str, placement: tuple[int, ...], m: int) -> Schedule:
    return Schedule({r: [parse_action(x) for x in row.split()] for r, row in enumerate(rows)}, placement, m)


def assert_bubble(result: SimulationResult, *, p: int, work: int, makespan: float, busy: float) -> None:
    """Exact: makespan and busy time, and idle/makespan == (p-1)/(work+p-1) as fractions."""
    assert result.makespan == makespan
    assert set(result.busy) == set(range(p))
    for r in range(p):
        assert result.busy[r] == busy
        assert result.idle[r] == makespan - busy
        assert Fraction(result.idle[r]) / Fraction(result.makespan) == Fraction(p - 1, work + p - 1)
        assert result.bubble_fraction[r] == pytest.approx((p - 1) / (work + p - 1), rel=1e-12)
    assert result.overall_bubble_fraction == pytest.approx((p - 1) / (work + p - 1), rel=1e-12)


# ---------------------------------------------------------------- textbook bubbles


@pytest.mark.parametrize("costs", UNIFORM, ids=UNIFORM_IDS)
@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 2), (2, 5), (3, 4), (4, 4), (4, 8), (8, 16), (6, 9)])
def test_single_stage_bubble_is_p_minus_1_over_m_plus_p_minus_1(name: str, p: int, m: int, costs: Costs) -> None:
    schedule = named(name, p, m)
    unit = costs.F + costs.B
    for variant in (schedule, lower(schedule), lower(schedule, fsdp=True, recv_placement="early")):
        result = simulate(variant, costs)
        assert_bubble(result, p=p, work=m, makespan=(m + p - 1) * unit, busy=m * unit)


@pytest.mark.parametrize("costs", UNIFORM, ids=UNIFORM_IDS)
@pytest.mark.parametrize(
    ("p", "m", "v"),
    [(2, 2, 2), (2, 4, 2), (2, 6, 2), (3, 3, 2), (3, 6, 2), (3, 9, 3), (4, 4, 2), (4, 6, 2), (4, 8, 2), (4, 8, 3), (4, 16, 4), (8, 16, 2)],
)
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p: int, m: int, v: int, costs: Costs) -> None:
    schedule = named("Interleaved1F1B", p, m, v)
    unit = costs.F + costs.B
    for variant in (schedule, lower(schedule, fsdp=True)):
        result = simulate(variant, costs)
        assert_bubble(result, p=p, work=v * m, makespan=(v * m + p - 1) * unit, busy=v * m * unit)


def test_zero_bubble_schedules_beat_interleaved_1f1b() -> None:
    costs = Costs(F=1, B=2, I=1, W=1)
    interleaved = simulate(named("Interleaved1F1B", 4, 8), costs).overall_bubble_fraction
    for name in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        assert simulate(named(name, 4, 8), costs).overall_bubble_fraction < interleaved, name


# ---------------------------------------------------------------- every schedule, every action


CONFIGS = [
    ("GPipe", 3, 4, None),
    ("1F1B", 4, 6, None),
    ("Interleaved1F1B", 4, 8, 3),
    ("LoopedBFS", 3, 5, 2),
    ("InterleavedZeroBubble", 4, 8, None),
    ("ZBVZeroBubble", 4, 8, None),
    ("ZBVZeroBubble", 3, 5, None),
    ("DualPipeV", 2, 4, None),
    ("DualPipeV", 4, 10, None),
]


def _work(schedule: Schedule, costs: Costs, rank: int) -> float:
    """Compute cost of a rank's list under ``costs`` (overlap = max of the halves)."""
    cost = {"F": costs.F, "B": costs.B, "I": costs.I, "W": costs.W}
    total = 0.0
    for a in schedule.actions[rank]:
        if a.sub_actions:
            total += max(cost[leaf.type.value] for leaf in a.sub_actions)
        elif a.is_compute:
            total += cost[a.type.value]
    return total


@pytest.mark.parametrize(("name", "p", "m", "v"), CONFIGS, ids=[f"{c[0]}-p{c[1]}-m{c[2]}" for c in CONFIGS])
def test_every_named_schedule_simulates_lowered_and_fsdp(name: str, p: int, m: int, v: int | None) -> None:
    schedule = named(name, p, m, v)
    costs = Costs(F=1, B=2, I=1, W=1)
    base = simulate(schedule, costs)
    for variant in (
        lower(schedule),
        lower(schedule, fsdp=True),
        lower(schedule, fsdp=True, prefetch=0, max_resident=2 if name == "DualPipeV" else 1, merge_bw=True),
        lower(schedule, fsdp=True, recv_placement="early"),
    ):
        result = simulate(variant, costs)
        if not variant.meta["lowering"]["merge_bw"]:
            # Free transfers and FSDP: lowering changes nothing.
            assert result.makespan == base.makespan
        for r in range(p):
            assert result.busy[r] == _work(variant, costs, r)
            assert 0 <= result.bubble_fraction[r] < 1
        # Every action of the lists appears as an event, transfers on the comm lane.
        events = Counter((e.rank, str(e.action)) for e in result.events)
        listed = Counter((r, str(a)) for r, lst in variant.actions.items() for a in lst)
        assert events == listed
        assert result.makespan == max(e.end for e in result.events)
        # Slower transfers and all-gathers only ever cost time.
        slow = simulate(variant, Costs(F=1, B=2, I=1, W=1, send_latency=0.25, unshard=0.5, reshard=0.1, reduce_grad=0.2))
        assert slow.makespan >= result.makespan
        assert all(slow.busy[r] > result.busy[r] for r in range(p))  # RESHARD and REDUCE_GRAD are on the compute lane


def test_torch_lowered_schedules_simulate() -> None:
    visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    for name in ("Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"):
        ops = visualizer.get_schedule_ops(name, 4, 8, with_comms=True)
        actions = {r: [parse_action(str(a)) for a in row if a is not None] for r, row in enumerate(ops)}
        placement = loop_mapping(4, 2) if name == "Interleaved1F1B" else v_mapping(4)
        lowered = Schedule(actions, placement, 8, name=name, lowered=True)
        costs = Costs(F=1, B=2, I=1, W=1)
        assert simulate(lowered, costs).makespan == simulate(named(name, 4, 8), costs).makespan, name


# ---------------------------------------------------------------- the model, piece by piece


def test_activations_live_until_their_backward_or_weight_gradient() -> None:
    for name, p, m in [("GPipe", 3, 5), ("1F1B", 4, 6)]:
        peak = simulate(named(name, p, m)).peak_live_activations
        expected = {r: m if name == "GPipe" else min(p - r, m) for r in range(p)}
        assert peak == expected
    split = sched("0F0 0I0 0F1 0W0 0I1 0W1", placement=(0,), m=2)
    assert simulate(split).peak_live_activations == {0: 2}  # I does not free; W does
    full = sched("0F0 0B0 0F1 0B1", placement=(0,), m=2)
    assert simulate(full).peak_live_activations == {0: 1}
    v = sched("0F0 1F0 1B0 0F1 (1F1;0B0)OVERLAP_F_B 1B1 0B1", placement=(0, 0), m=2)
    assert simulate(v).peak_live_activations == {0: 3}


def test_overlap_cost() -> None:
    v = sched("0F0 1F0 1B0 0F1 (1F1;0B0)OVERLAP_F_B 1B1 0B1", placement=(0, 0), m=2)
    assert simulate(v, Costs(F=1, B=2)).makespan == 1 + 1 + 2 + 1 + 2 + 2 + 2
    assert simulate(v, Costs(F=1, B=2, overlap=1)).makespan == 1 + 1 + 2 + 1 + 3 + 2 + 2
    assert simulate(v, Costs(F=1, B=2, overlap=0.5)).makespan == 1 + 1 + 2 + 1 + 2.5 + 2 + 2


def test_transfer_time_on_compute_only_and_lowered() -> None:
    gpipe = named("GPipe", 2, 1)
    for costs, per_transfer in [
        (Costs(F=1, B=2, send_latency=0.5), 0.5),
        (Costs(F=1, B=2, send_latency=0.5, bandwidth=50, activation_bytes=100), 2.5),
    ]:
        expected = 2 * 1 + 2 * 2 + 2 * per_transfer
        assert simulate(gpipe, costs).makespan == expected
        result = simulate(lower(gpipe), costs)
        assert result.makespan == expected
        comm = sorted((e.rank, str(e.action), e.start, e.end) for e in result.events if e.lane == "comm")
        assert comm == [
            (0, "0RECV_B0", 1.0, 2 * 1 + 2 + 2 * per_transfer),  # posted after 0F0, lands after 1B0
            (0, "0SEND_F0", 1.0, 1.0 + per_transfer),
            (1, "1RECV_F0", 0.0, 1.0 + per_transfer),
            (1, "1SEND_B0", 2 + 2 + per_transfer, 2 + 2 + 2 * per_transfer),
        ]


def test_receives_posted_late_expose_the_transfer() -> None:
    # Rank 1 posts the receive of 1F1 only after 1F0, and rank 0 that of 0B1
    # only after 0B0, so neither transfer overlaps compute: 2 x 0.5 more than
    # compute-only.  Early placement posts them in time.
    gpipe = named("GPipe", 2, 2)
    costs = Costs(F=1, B=2, send_latency=0.5)
    compute_only = simulate(gpipe, costs).makespan
    assert compute_only == 10.0
    assert simulate(lower(gpipe), costs).makespan == compute_only + 1.0
    assert simulate(lower(gpipe, recv_placement="early", costs=costs), costs).makespan == compute_only


def test_unshard_runs_on_its_own_lane_and_prefetch_hides_it() -> None:
    two_stages = sched("0F0 1F0 1B0 0B0", placement=(0, 0), m=1)
    costs = Costs(F=1, B=2, unshard=0.5)
    late = lower(two_stages, comms=False, reduce_grad=False, fsdp=True, prefetch=0)
    assert [str(a) for a in late.actions[0]][:4] == "0UNSHARD 0F0 1UNSHARD 1F0".split()
    # 0.5 (gather 0) + 1 + 0.5 (gather 1, issued after 0F0) + 1 + 2 + 2
    assert simulate(late, costs).makespan == 7.0
    early = lower(two_stages, comms=False, reduce_grad=False, fsdp=True, prefetch=1)
    # Both gathers issued at 0, one after the other on the FSDP lane: 1F0 waits for nothing.
    result = simulate(early, costs)
    assert result.makespan == 6.5
    fsdp = [(str(e.action), e.start, e.end) for e in result.events if e.lane == "fsdp"]
    assert fsdp == [("0UNSHARD", 0.0, 0.5), ("1UNSHARD", 0.5, 1.0)]
    assert result.busy[0] == 6.0  # gathers are not compute-lane time
    costly = simulate(early, Costs(F=1, B=2, unshard=0.5, reshard=0.25))
    assert costly.busy[0] == 6.5 and costly.makespan == 7.0


def test_events_are_ordered_and_consistent() -> None:
    result = simulate(lower(named("ZBVZeroBubble", 2, 4), fsdp=True), Costs(send_latency=0.1, unshard=0.2))
    by_rank: dict[int, list[float]] = {}
    for e in result.events:
        assert 0 <= e.start <= e.end <= result.makespan
        by_rank.setdefault(e.rank, []).append(e.start)
        if e.lane == "compute" and e.action.is_compute:
            assert e.end - e.start == pytest.approx({"F": 1, "I": 1, "W": 1, "B": 2}[e.action.type.value])
    for starts in by_rank.values():
        assert starts == sorted(starts)
    assert {e.lane for e in result.events} == {"compute", "comm", "fsdp"}


def test_a_deadlocked_schedule_cannot_be_simulated() -> None:
    base = named("1F1B", 2, 4)
    actions = {r: list(a) for r, a in base.actions.items()}
    actions[0][1], actions[0][2] = actions[0][2], actions[0][1]  # 0B0 before 0F1
    actions[1][1], actions[1][2] = actions[1][2], actions[1][1]  # 1F1 before 1B0
    with pytest.raises(ScheduleError, match="never finish") as info:
        simulate(base.with_actions(actions))
    assert "rank 0 at position 1 (0B0)" in str(info.value)
    assert "check()" in str(info.value)


# ---------------------------------------------------------------- Costs


def test_costs_parse() -> None:
    costs = Costs.parse("F=1,B=2,I=1,W=1,latency=0.1")
    assert costs == Costs(F=1, B=2, I=1, W=1, send_latency=0.1)
    assert Costs.parse("") == Costs()
    assert Costs.parse(" bw = 1e9 , bytes=4096, unshard=0.5, overlap=1 ") == Costs(
        bandwidth=1e9, activation_bytes=4096, unshard=0.5, overlap=1
    )
    assert Costs.parse("bandwidth=none").bandwidth is None
    assert Costs(bandwidth=2, activation_bytes=10, send_latency=1).transfer == 6
    for bad, match in [
        ("F=1,Q=2", "KEY=VALUE with KEY one of"),
        ("F", "KEY=VALUE"),
        ("F=x", "not a number"),
        ("F=1,F=2", "given twice"),
        ("B=-1", ">= 0"),
        ("bandwidth=0", "bandwidth must be > 0"),
        ("F=inf", "finite"),
    ]:
        with pytest.raises(ValueError, match=match):
            Costs.parse(bad)


# -- committing ahead (GPUs): a host lane and a device lane per rank


def _lane_costs(f: float, b: float, stages: int = 1) -> dict[tuple[int, str, None], float]:
    return {(s, t, None): (f if t == "F" else b) for s in range(stages) for t in ("F", "B")}


def test_two_lanes_commit_horizon_by_hand() -> None:
    """One rank, F0 F1 F2 B0 B1 B2; host F 1, B 3; device F 3, B 1 (worked out by hand).

    Unbounded: the host launches F0-F2 at 0..3 and B0-B2 at 3..12; the device runs the Fs at 0..9, B0 at
    9..10, B1 at 10..11, and B2 ends with its launch: 12.  Horizon 3 (ms of queued device time): F1 is
    committed at once (3 queued), F2 waits for F0's end (3), B0 for F1's (6), then the launches of B are the
    longer path: 15.  Horizon 0: each action waits for the device to drain, so it costs the longer of its
    host and device time: 3 x 6 = 18, the one-lane model's sum of maxima."""
    s = named("GPipe", 1, 3)
    host, dev = _lane_costs(1, 3), _lane_costs(3, 1)
    got = {h: simulate(s, Costs(), action_costs=host, device_costs=dev, commit_horizon=h).makespan
           for h in (float("inf"), 3.0, 0.0)}
    assert got == {float("inf"): 12.0, 3.0: 15.0, 0.0: 18.0}
    one_lane = simulate(s, Costs(), action_costs={k: max(host[k], dev[k]) for k in host})
    assert one_lane.makespan == 18.0
    res = simulate(s, Costs(), action_costs=host, device_costs=dev)
    assert res.busy[0] == 12.0  # the device lane's work: 3 x 3 + 3 x 1
    ev = [e for e in res.events if e.lane == "compute"]
    assert [(str(e.action), e.start, e.end) for e in ev][:4] == [("0F0", 0, 3), ("0F1", 3, 6), ("0F2", 6, 9), ("0B0", 9, 10)]


@pytest.mark.parametrize("name,v", [("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2)])
def test_two_lanes_reduce_to_one_when_launches_are_free(name: str, v: int) -> None:
    """Host time 0: the device lane is the one-lane simulation of the device costs, transfers included."""
    low = lower(named(name, 2, 4, v), comms=True, recv_placement="early")
    c = Costs(F=1, B=2, I=1, W=1, send_latency=0.25)
    dev = {(s, t, None): x for s in range(4 if v == 2 else 2) for t, x in (("F", 1.0), ("B", 2.0), ("I", 1.0), ("W", 1.0))}
    zero = {k: 0.0 for k in dev}
    assert simulate(low, c, action_costs=zero, device_costs=dev).makespan == pytest.approx(
        simulate(low, c, action_costs=dev).makespan)


def test_two_lanes_hosts_never_wait_for_each_other() -> None:
    """Device time 0: the host-bound step is the busiest host's launches, with no pipeline bubble on the host
    (a receive is posted and its consumer committed before the sender has produced: static shapes); one lane
    puts the whole pipeline's waits on it."""
    low = lower(named("1F1B", 2, 4), comms=True, recv_placement="early")
    c = Costs(send_latency=0.1)
    host, zero = _lane_costs(1, 2, 2), {k: 0.0 for k in _lane_costs(1, 2, 2)}
    two = simulate(low, c, action_costs=host, device_costs=zero)
    assert two.makespan == pytest.approx(4 * (1 + 2) + 0.1)  # rank 1's launches, after rank 0's first F lands
    assert simulate(low, c, action_costs=host).makespan > two.makespan + 2
    with pytest.raises(ValueError, match="commit_horizon"):
        simulate(low, c, action_costs=host, device_costs=zero, commit_horizon=-1.0)


def test_two_lanes_overlap_pair_on_the_host() -> None:
    """An OVERLAP_F_B's host time is ``max + host_overlap x min`` of its halves' launches (1: both in full);
    its device time takes ``costs.overlap``."""
    low = lower(named("DualPipeV", 2, 4, 2), comms=True, recv_placement="early")
    host = {(s, t, None): 1.0 for s in range(4) for t in ("F", "B", "I", "W")}
    zero = {k: 0.0 for k in host}
    pairs = sum(1 for a in low.actions[0] if a.sub_actions)
    assert pairs > 0
    # host-bound with no host waiting on another's: the step is the busiest host's launches, each pair
    # max + host_overlap x min of its two unit launches
    for h in (1.0, 0.5, 0.0):
        launches = max(sum((1.0 + h) if a.sub_actions else 1.0 for a in acts if a.is_compute) for acts in low.actions.values())
        got = simulate(low, Costs(), action_costs=host, device_costs=zero, host_overlap=h).makespan
        assert got == pytest.approx(launches)
    assert simulate(low, Costs(), action_costs=host, device_costs=zero).makespan == pytest.approx(16.0 + pairs)


def test_device_gap() -> None:
    from pipeloom.schedules.simulate import _gap

    busy = [(0.0, 2.0), (3.0, 5.0)]
    assert _gap(busy, 1.0, 1.0) == 2.0  # fits between the two spans
    assert _gap(busy, 1.0, 2.0) == 5.0  # does not: after the second
    assert _gap(busy, 5.5, 9.0) == 5.5 and _gap([], 4.0, 1.0) == 4.0 and _gap(busy, 2.5, 0.5) == 2.5


@pytest.mark.parametrize("name,v", [("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)])
def test_two_lanes_stage_streams(name: str, v: int) -> None:
    """One stream per stage: with one stage per rank it is the one device lane; with two, a stage whose input is
    late no longer holds up the other's launched work (ZBVZeroBubble: 33.5 -> 31 with transfers of 1.5)."""
    low = lower(named(name, 2, 4, v), comms=True, recv_placement="early")
    dev = {(s, t, None): x for s in range(2 * v) for t, x in (("F", 1.0), ("B", 2.0), ("I", 1.0), ("W", 1.0))}
    host = {k: 0.2 for k in dev}
    one, streams = (simulate(low, Costs(), action_costs=host, device_costs=dev, device_transfer=1.5,
                             device_streams=x) for x in (False, True))
    if v == 1:
        assert streams.makespan == one.makespan and streams.events == one.events
    else:
        assert streams.makespan <= one.makespan and streams.busy == one.busy
    if name == "ZBVZeroBubble":
        assert (one.makespan, streams.makespan) == (33.5, 31.0)
    for r in low.actions:  # the device never runs two actions at once
        spans = sorted((e.start, e.end) for e in streams.events if e.rank == r and e.lane == "compute" and e.end > e.start)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))
