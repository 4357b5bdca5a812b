"""Tests for the lowering passes: sends/receives, FSDP unshard/reshard, REDUCE_GRAD, merge_bw, overlap_input_only."""

from __future__ import annotations

from collections import Counter

import pytest

from pipeloom.schedules import (
    Action,
    ActionType,
    Costs,
    Schedule,
    ScheduleError,
    add_reduce_grad,
    add_send_recv,
    add_unshard_reshard,
    generate,
    loop_mapping,
    lower,
    merge_bw,
    overlap_input_only,
    parse_action,
    simulate,
    validate,
)

T = ActionType

# (name, ranks, microbatches, stages per rank or None for the default)
CONFIGS = [
    ("GPipe", 2, 4, None),
    ("GPipe", 4, 6, None),
    ("1F1B", 2, 4, None),
    ("1F1B", 4, 8, None),
    ("1F1B", 3, 5, None),
    ("Interleaved1F1B", 2, 4, None),
    ("Interleaved1F1B", 4, 8, None),
    ("Interleaved1F1B", 2, 4, 3),
    ("Interleaved1F1B", 4, 6, 2),
    ("LoopedBFS", 2, 4, None),
    ("LoopedBFS", 3, 5, 3),
    ("InterleavedZeroBubble", 2, 4, None),
    ("InterleavedZeroBubble", 4, 8, None),
    ("ZBVZeroBubble", 2, 4, None),
    ("ZBVZeroBubble", 4, 8, None),
    ("ZBVZeroBubble", 3, 7, None),
    ("DualPipeV", 2, 4, None),
    ("DualPipeV", 4, 8, None),
    ("DualPipeV", 3, 9, None),
]
IDS = [f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in CONFIGS]


def named(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    return generate(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)


def acts(text: str) -> list[Action]:
    return [parse_action(t) for t in text.split()]


def strs(actions: list[Action]) -> list[str]:
    return [str(a) for a in actions]


def leaves(a: Action) -> tuple[Action, ...]:
    return a.leaves() if a.is_compute else ()


# ---------------------------------------------------------------- sends and receives


def test_send_recv_exact_for_1f1b() -> None:
    lowered = add_send_recv(named("1F1B", 2, 2))
    assert lowered.lowered
    assert strs(lowered.actions[0]) == "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1".split()
    assert strs(lowered.actions[1]) == "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1".split()


def _cross_edges(schedule: Schedule) -> int:
    place = schedule.stage_to_rank
    return sum(1 for s in range(len(place) - 1) if place[s] != place[s + 1])


@pytest.mark.parametrize(("name", "p", "m", "v"), CONFIGS, ids=IDS)
def test_send_recv_counts_and_positions(name: str, p: int, m: int, v: int | None) -> None:
    schedule = named(name, p, m, v)
    lowered = add_send_recv(schedule)
    place = lowered.stage_to_rank
    counts = Counter(a.type for acts_ in lowered.actions.values() for a in acts_)
    edges = _cross_edges(schedule)
    for kind in (T.SEND_F, T.RECV_F, T.SEND_B, T.RECV_B):
        assert counts[kind] == edges * m, kind

    # The compute order is untouched.
    assert lowered.compute_only().actions == {r: list(a) for r, a in schedule.actions.items()}

    for rank, lst in lowered.actions.items():
        for i, a in enumerate(lst):
            if a.type in (T.SEND_F, T.SEND_B):
                # Right after its producer (possibly behind other sends of the same action).
                j = i - 1
                while lst[j].type in (T.SEND_F, T.SEND_B):
                    j -= 1
                want = T.F if a.type is T.SEND_F else (T.B, T.I)
                assert any(
                    leaf.stage == a.stage and leaf.microbatch == a.microbatch and leaf.type in (want if isinstance(want, tuple) else (want,))
                    for leaf in leaves(lst[j])
                ), (rank, i, a)
                peer = a.stage + 1 if a.type is T.SEND_F else a.stage - 1
                assert place[peer] != rank, "no transfer between stages on one rank"
            elif a.type in (T.RECV_F, T.RECV_B):
                # Before its consumer, with only other receives in between (late placement).
                j = i + 1
                while lst[j].type in (T.RECV_F, T.RECV_B):
                    j += 1
                consumers = [leaf for leaf in leaves(lst[j]) if leaf.stage == a.stage and leaf.microbatch == a.microbatch]
                if not consumers:  # FIFO: a receive flushed ahead of a later one from the same peer
                    later = [k for k in range(j, len(lst)) if any(
                        leaf.stage == a.stage and leaf.microbatch == a.microbatch for leaf in leaves(lst[k]))]
                    assert later, (rank, i, a)
                peer = a.stage - 1 if a.type is T.RECV_F else a.stage + 1
                assert place[peer] != rank


@pytest.mark.parametrize(("name", "p", "m", "v"), CONFIGS, ids=IDS)
def test_receives_follow_the_peers_send_order(name: str, p: int, m: int, v: int | None) -> None:
    for placement in ("late", "early"):
        lowered = add_send_recv(named(name, p, m, v), recv_placement=placement)
        place = lowered.stage_to_rank
        sent: dict[tuple[int, int], list[tuple[int, int]]] = {}
        received: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for rank, lst in lowered.actions.items():
            for a in lst:
                if a.type is T.SEND_F:
                    sent.setdefault((rank, place[a.stage + 1]), []).append((a.stage + 1, a.microbatch))
                elif a.type is T.SEND_B:
                    sent.setdefault((rank, place[a.stage - 1]), []).append((a.stage - 1, a.microbatch))
                elif a.type is T.RECV_F:
                    received.setdefault((place[a.stage - 1], rank), []).append((a.stage, a.microbatch))
                elif a.type is T.RECV_B:
                    received.setdefault((place[a.stage + 1], rank), []).append((a.stage, a.microbatch))
        assert sent == received


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV"])
def test_v_schedules_hand_over_between_local_stages(name: str) -> None:
    p, m = 4, 8
    lowered = add_send_recv(named(name, p, m))
    all_actions = [a for lst in lowered.actions.values() for a in lst]
    # Stage p-1 and p live on rank p-1: no transfer between them.
    assert not [a for a in all_actions if a.type is T.SEND_F and a.stage == p - 1]
    assert not [a for a in all_actions if a.type is T.RECV_F and a.stage == p]
    assert not [a for a in all_actions if a.type is T.SEND_B and a.stage == p]
    assert not [a for a in all_actions if a.type is T.RECV_B and a.stage == p - 1]
    # Nor out of the ends of the pipeline.
    assert not [a for a in all_actions if a.type is T.SEND_F and a.stage == 2 * p - 1]
    assert not [a for a in all_actions if a.type is T.SEND_B and a.stage == 0]
    assert validate(lowered) == []


def test_overlap_actions_receive_before_and_send_after_both_halves() -> None:
    lowered = add_send_recv(named("DualPipeV", 2, 4))
    rank0 = strs(lowered.actions[0])
    i = rank0.index("(0F3;3B1)OVERLAP_F_B")
    assert rank0[i + 1 : i + 3] == ["0SEND_F3", "3SEND_B1"]
    i = rank0.index("(3F2;0B0)OVERLAP_F_B")
    assert set(rank0[i - 2 : i]) == {"3RECV_F2", "0RECV_B0"}
    assert rank0[i + 1] == "3B2"  # 3 is the last stage and 0 the first: nothing to send
    rank1 = strs(lowered.actions[1])
    i = rank1.index("(2F2;1B0)OVERLAP_F_B")
    assert rank1[i + 1 : i + 3] == ["2SEND_F2", "1SEND_B0"]


def test_send_recv_is_idempotent() -> None:
    once = add_send_recv(named("Interleaved1F1B", 4, 8))
    assert add_send_recv(once).actions == once.actions


@pytest.mark.parametrize(("name", "p", "m", "v"), CONFIGS, ids=IDS)
def test_early_receives_validate_and_overlap(name: str, p: int, m: int, v: int | None) -> None:
    schedule = named(name, p, m, v)
    costs = Costs(send_latency=0.5)
    early = lower(schedule, recv_placement="early", costs=costs)
    late = lower(schedule)
    assert validate(early) == []
    # With the costs it placed receives for, the lowered schedule loses nothing
    # to transfers compared with the compute-only one; late receives do.
    assert simulate(early, costs).makespan == simulate(schedule, costs).makespan
    assert simulate(late, costs).makespan >= simulate(early, costs).makespan

    def computes_before_recvs(s: Schedule) -> dict[str, int]:
        out = {}
        for lst in s.actions.values():
            n = 0
            for a in lst:
                if a.is_compute:
                    n += 1
                elif a.type in (T.RECV_F, T.RECV_B):
                    out[str(a)] = n
        return out

    e, lt = computes_before_recvs(early), computes_before_recvs(late)
    assert e.keys() == lt.keys()
    assert all(e[k] <= lt[k] for k in e)


def test_recv_placement_is_checked() -> None:
    with pytest.raises(ValueError, match="recv_placement"):
        add_send_recv(named("1F1B", 2, 2), recv_placement="soon")


# ---------------------------------------------------------------- REDUCE_GRAD


@pytest.mark.parametrize(("name", "p", "m", "v"), CONFIGS, ids=IDS)
def test_reduce_grad_right_after_last_backward(name: str, p: int, m: int, v: int | None) -> None:
    schedule = named(name, p, m, v)
    for base in (schedule, add_send_recv(schedule)):
        reduced = add_reduce_grad(base)
        for rank, lst in reduced.actions.items():
            reductions = [i for i, a in enumerate(lst) if a.type is T.REDUCE_GRAD]
            assert sorted(lst[i].stage for i in reductions) == list(schedule.stages_of(rank))
            for i in reductions:
                stage = lst[i].stage
                last_bw = max(
                    j for j, a in enumerate(lst) for leaf in leaves(a) if leaf.stage == stage and leaf.type in (T.B, T.W)
                )
                between = lst[last_bw + 1 : i]
                assert all(a.type in (T.SEND_F, T.SEND_B, T.REDUCE_GRAD) for a in between), (rank, i, between)
        assert add_reduce_grad(reduced).actions == reduced.actions  # idempotent


def test_reduce_grad_counts_the_backward_half_of_an_overlap() -> None:
    # The pass only looks at the order (this toy list is not a full schedule).
    s = Schedule({0: acts("0F0 0F1 0B0 (1F0;0B1)OVERLAP_F_B 1B0")}, (0, 0), 2)
    out = strs(add_reduce_grad(s).actions[0])
    assert out == "0F0 0F1 0B0 (1F0;0B1)OVERLAP_F_B 0REDUCE_GRAD 1B0 1REDUCE_GRAD".split()
    # Split backward: the reduction waits for the last W, not the last I.
    rank1 = strs(add_reduce_grad(named("DualPipeV", 2, 4)).actions[1])
    assert rank1[rank1.index("2W3") + 1] == "2REDUCE_GRAD"
    assert rank1[-2:] == ["1W3", "1REDUCE_GRAD"]


# ---------------------------------------------------------------- merge_bw


def test_merge_bw_merges_adjacent_halves_only() -> None:
    s = Schedule({0: acts("0F0 0I0 0W0 0F1 0I1 1F0 0W1 0F2 0I2 0W1")}, (0, 0), 3)
    assert strs(merge_bw(s).actions[0]) == "0F0 0B0 0F1 0I1 1F0 0W1 0F2 0I2 0W1".split()


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"])
def test_merge_bw_on_split_schedules(name: str) -> None:
    schedule = named(name, 4, 8)
    merged = merge_bw(schedule)
    for rank, lst in schedule.actions.items():
        pairs = sum(
            1
            for a, b in zip(lst, lst[1:])
            if a.type is T.I and b.type is T.W and (a.stage, a.microbatch) == (b.stage, b.microbatch)
        )
        assert len(merged.actions[rank]) == len(lst) - pairs
        new_b = Counter(a.type for a in merged.actions[rank])[T.B] - Counter(a.type for a in lst)[T.B]
        assert new_b == pairs
    assert validate(merged) == []
    assert validate(lower(schedule, merge_bw=True, fsdp=True)) == []


@pytest.mark.parametrize("ranks,mbs", [(2, 8), (4, 8), (4, 16)])
def test_overlap_input_only_pairs_the_forward_with_i_and_runs_w_right_after(ranks: int, mbs: int) -> None:
    schedule = named("DualPipeV", ranks, mbs)
    split = overlap_input_only(schedule)
    assert validate(split) == [] and validate(lower(split)) == []
    for rank, lst in schedule.actions.items():
        out = split.actions[rank]
        pairs = [a for a in lst if a.type is T.OVERLAP_F_B]
        assert pairs and len(out) == len(lst) + len(pairs)
        j = 0
        for a in lst:
            if a.type is T.OVERLAP_F_B:
                f, b = a.sub_actions
                assert str(out[j]) == f"({f};{b.stage}I{b.microbatch})OVERLAP_F_B"
                assert str(out[j + 1]) == f"{b.stage}W{b.microbatch}"
                j += 2
            else:
                assert out[j] == a
                j += 1
    # schedules without overlapped pairs are unchanged
    zbv = named("ZBVZeroBubble", 2, 8)
    assert overlap_input_only(zbv).actions == zbv.actions


# ---------------------------------------------------------------- FSDP


def test_unshard_prefetch_distance_interleaved() -> None:
    schedule = named("Interleaved1F1B", 2, 4, 3)  # rank 0 holds stages 0, 2, 4
    first = strs(schedule.actions[0])[:6]
    assert first == "0F0 0F1 2F0 2F1 4F0 4F1".split()
    p0 = strs(add_unshard_reshard(schedule, prefetch=0).actions[0])
    assert p0[:8] == "0UNSHARD 0F0 0F1 2UNSHARD 2F0 2F1 4UNSHARD 4F0".split()
    p1 = strs(add_unshard_reshard(schedule, prefetch=1).actions[0])
    assert p1[:8] == "0UNSHARD 2UNSHARD 0F0 0F1 4UNSHARD 2F0 2F1 4F0".split()
    p2 = strs(add_unshard_reshard(schedule, prefetch=2).actions[0])
    assert p2[:5] == "0UNSHARD 2UNSHARD 4UNSHARD 0F0 0F1".split()


def _segments_between(lst: list[Action], start: int, end: int) -> int:
    """Stage switches among the compute actions in lst[start:end]."""
    last = None
    switches = 0
    for a in lst[start:end]:
        if a.is_compute:
            need = tuple(sorted({leaf.stage for leaf in a.leaves()}))
            if last is not None and need != last:
                switches += 1
            last = need
    return switches


@pytest.mark.parametrize(("name", "p", "m", "v"), CONFIGS, ids=IDS)
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_unshard_reshard_properties(name: str, p: int, m: int, v: int | None, prefetch: int) -> None:
    schedule = add_reduce_grad(named(name, p, m, v))
    out = add_unshard_reshard(schedule, prefetch=prefetch)
    assert validate(out) == []
    for rank, lst in out.actions.items():
        stages = schedule.stages_of(rank)
        unshards = [i for i, a in enumerate(lst) if a.type is T.UNSHARD]
        reshards = [i for i, a in enumerate(lst) if a.type is T.RESHARD]
        # Without a residency limit: one UNSHARD and one RESHARD per stage.
        assert sorted(lst[i].stage for i in unshards) == list(stages)
        assert sorted(lst[i].stage for i in reshards) == list(stages)
        for i in unshards:
            stage = lst[i].stage
            first_use = next(j for j, a in enumerate(lst) if any(leaf.stage == stage for leaf in leaves(a)))
            assert i < first_use
            # Issued `prefetch` stage switches ahead of the first use (or at the start).
            switches = _segments_between(lst, i, first_use + 1)
            assert switches == min(prefetch, _segments_between(lst, 0, first_use + 1)), (rank, lst[i])
        for i in reshards:
            stage = lst[i].stage
            last_use = max(j for j, a in enumerate(lst) if any(leaf.stage == stage for leaf in leaves(a)))
            assert i > last_use
            # Right after the last use and what directly follows it (its REDUCE_GRAD).
            assert all(not a.is_compute for a in lst[last_use + 1 : i])
            assert Action(stage, T.REDUCE_GRAD) in lst[last_use + 1 : i]


def _max_resident(lst: list[Action]) -> int:
    resident: set[int] = set()
    most = 0
    for a in lst:
        if a.type is T.UNSHARD:
            resident.add(a.stage)
        elif a.type is T.RESHARD:
            resident.discard(a.stage)
        most = max(most, len(resident))
    return most


@pytest.mark.parametrize(
    ("name", "p", "m", "v", "limit"),
    [
        ("Interleaved1F1B", 2, 4, 2, 1),
        ("Interleaved1F1B", 4, 8, 3, 2),
        ("Interleaved1F1B", 4, 8, 3, 1),
        ("LoopedBFS", 2, 4, 3, 1),
        ("InterleavedZeroBubble", 4, 8, 2, 1),
        ("ZBVZeroBubble", 4, 8, None, 1),
        ("DualPipeV", 4, 8, None, 2),
    ],
)
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_unshard_reshard_with_max_resident(name: str, p: int, m: int, v: int | None, limit: int, prefetch: int) -> None:
    schedule = named(name, p, m, v)
    out = lower(schedule, fsdp=True, prefetch=prefetch, max_resident=limit)
    assert validate(out) == []
    refetched = False
    for rank, lst in out.actions.items():
        assert _max_resident(lst) <= limit
        counts = Counter(a.stage for a in lst if a.type is T.UNSHARD)
        assert counts == Counter(a.stage for a in lst if a.type is T.RESHARD)
        refetched |= any(c > 1 for c in counts.values())
    if limit < schedule.num_stages // p:
        assert refetched, "a limit below the stages per rank must evict and unshard again"


def test_max_resident_evicts_the_stage_needed_last() -> None:
    # Stages 0, 1, 2 on one rank; with room for two, 2 is fetched by evicting
    # 1 (next needed after 0), and 1 comes back when needed.
    s = Schedule({0: acts("0F0 1F0 2F0 0F1 1F1 2F1 2B0 1B0 0B0 2B1 1B1 0B1")}, (0, 0, 0), 2)
    out = strs(add_unshard_reshard(s, prefetch=0, max_resident=2).actions[0])
    assert out[:6] == "0UNSHARD 0F0 1UNSHARD 1F0 1RESHARD 2UNSHARD".split()
    assert validate(Schedule({0: [parse_action(x) for x in out]}, (0, 0, 0), 2)) == []


def test_max_resident_below_an_overlap_is_an_error() -> None:
    with pytest.raises(ScheduleError, match="max_resident=1"):
        add_unshard_reshard(named("DualPipeV", 2, 4), max_resident=1)
    with pytest.raises(ValueError):
        add_unshard_reshard(named("1F1B", 2, 4), prefetch=-1)
    with pytest.raises(ValueError):
        add_unshard_reshard(named("1F1B", 2, 4), max_resident=0)


def test_unshard_reshard_is_idempotent() -> None:
    once = add_unshard_reshard(named("ZBVZeroBubble", 4, 8))
    assert add_unshard_reshard(once).actions == once.actions


# ---------------------------------------------------------------- lower()


@pytest.mark.parametrize(("name", "p", "m", "v"), CONFIGS, ids=IDS)
def test_lower_composes_the_passes(name: str, p: int, m: int, v: int | None) -> None:
    schedule = named(name, p, m, v)
    out = lower(schedule, fsdp=True)
    assert out.lowered and out.name == schedule.name
    assert out.meta["lowering"]["fsdp"] is True
    assert out.compute_only().actions == {r: list(a) for r, a in schedule.actions.items()}
    assert validate(out) == []
    # Lowering a lowered schedule starts again from its compute order.
    assert lower(out, fsdp=True).actions == out.actions
    plain = lower(schedule, reduce_grad=False)
    assert not any(a.type is T.REDUCE_GRAD for lst in plain.actions.values() for a in lst)
    compute_fsdp = lower(schedule, comms=False, fsdp=True)
    assert compute_fsdp.lowered and not any(a.is_comm for lst in compute_fsdp.actions.values() for a in lst)
    assert validate(compute_fsdp) == []


def test_lower_single_rank_has_no_transfers() -> None:
    out = lower(named("GPipe", 1, 3))
    assert strs(out.actions[0]) == "0F0 0F1 0F2 0B0 0B1 0B2 0REDUCE_GRAD".split()
    assert out.stage_to_rank == loop_mapping(1)
