"""The schedule generators against torch 2.13 as the oracle.

For every configuration in the grid below, torch's class of the same name and
``generate`` must agree on whether the configuration is accepted, and, where
it is, on each rank's compute order (torch's ``None`` bubbles and
``REDUCE_GRAD`` stripped).  The oracle is torch's own classes built the way
its private ``_schedule_visualizer.get_schedule_ops`` builds them (tests only;
``test_oracle_is_get_schedule_ops`` checks the two agree), plus a replay of
``_step_microbatches`` for the two single-stage schedules, whose displayed
order is not what they run (see ``test_single_stage_matches_torch_runtime``).
"""

from __future__ import annotations

import logging
from unittest import mock

import pytest

from pipeloom.schedules import (
    SCHEDULE_NAMES,
    ActionType,
    Schedule,
    ScheduleConfigError,
    ScheduleError,
    canonical_name,
    default_stages_per_rank,
    generate,
    loop_mapping,
    placement_style,
    v_mapping,
)

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops  # noqa: E402
from torch.distributed.pipelining.stage import PipelineStage  # noqa: E402

SINGLE = ("GPipe", "1F1B")
LOOPED_MULTI = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


@pytest.fixture(autouse=True, scope="module")
def _quiet_torch_logs():
    # torch's schedules log at INFO/WARNING on every construction.
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


# ---------------------------------------------------------------- oracles


def _strip(order) -> list[str]:
    return [str(a) for a in order if a is not None and a.computation_type != torch_schedules.REDUCE_GRAD]


_STAGE = None


def _mock_stage(num_ranks: int, num_stages: int, rank: int = 0):
    """The mocked PipelineStage that get_schedule_ops builds, made once and reused.

    ``create_autospec`` costs ~10 ms, ten times the schedule construction it
    serves; one shared mock keeps hundreds of oracle calls inside the budget.
    """
    global _STAGE
    if _STAGE is None:
        _STAGE = mock.create_autospec(PipelineStage, instance=True)
    stage = _STAGE
    stage.group_rank = rank
    stage.group_size = num_ranks
    stage.submod = None
    stage.num_stages = num_stages
    stage.stage_index = rank
    return stage


def torch_orders(name: str, p: int, n: int, spr: int) -> list[list[str]]:
    """Each rank's compute order as torch's class builds it; raises where torch raises.

    The same construction as ``get_schedule_ops`` (checked by
    ``test_oracle_is_get_schedule_ops``), minus its per-call mock, and also for
    one stage per rank on the multi-stage classes, which get_schedule_ops
    refuses but the classes accept.
    """
    cls = torch_schedules.get_schedule_class(name)
    stage = _mock_stage(p, p * spr)
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        if spr != 1:
            raise ValueError("single-stage schedule")  # get_schedule_ops asserts the same
        inst = cls(stage, n)
    else:
        inst = cls([stage] * spr, n)
    return [_strip(inst.pipeline_order[r]) for r in range(p)]


def torch_runtime_order(name: str, p: int, n: int, rank: int) -> list[str]:
    """What ScheduleGPipe / Schedule1F1B ``_step_microbatches`` actually runs on ``rank``.

    The stage is a mock with no communication: we only record the order of
    ``forward_one_chunk`` and ``backward_one_chunk`` calls.
    """
    stage = _mock_stage(p, p, rank)
    for method in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
        getattr(stage, method).return_value = []
    sched = torch_schedules.get_schedule_class(name)(stage, n)
    sched._initialize_stage = lambda *args, **kwargs: None
    order: list[str] = []
    stage.forward_one_chunk.side_effect = lambda mb, *a, **k: order.append(f"{rank}F{mb}")
    stage.backward_one_chunk.side_effect = lambda mb, *a, **k: order.append(f"{rank}B{mb}")
    sched._step_microbatches([()] * n, [{}] * n)
    return order


def ours(name: str, p: int, n: int, spr: int) -> list[list[str]]:
    sched = generate(name, num_ranks=p, num_microbatches=n, stages_per_rank=spr)
    return [[str(a) for a in sched.actions[r]] for r in range(p)]


def _first_difference(a: list[str], b: list[str]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"position {i}: torch {x}, ours {y}; torch {a[max(0, i - 3):i + 4]}, ours {b[max(0, i - 3):i + 4]}"
    return f"lengths differ: torch {len(a)}, ours {len(b)} (torch tail {a[-4:]}, ours tail {b[-4:]})"


# ---------------------------------------------------------------- the grid


def _microbatch_counts(p: int) -> list[int]:
    """From the smallest count to ~3x ranks, with non-multiples of the rank count."""
    return sorted({1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p - 1, 3 * p, 3 * p + 2} - {0})


def _grid() -> list[tuple[str, int, int, int]]:
    configs = []
    for name in SCHEDULE_NAMES:
        ranks = [1, 2, 3, 4, 5, 8]
        if name in LOOPED_MULTI:
            sprs = [1, 2, 3, 4]
        elif name in V_SHAPED:
            sprs = [2]
        else:
            sprs = [1]
        for p in ranks:
            for spr in sprs:
                for n in _microbatch_counts(p):
                    configs.append((name, p, n, spr))
    return configs


GRID = _grid()


@pytest.mark.parametrize(("name", "p", "n", "spr"), GRID, ids=[f"{c[0]}-r{c[1]}-mb{c[2]}-s{c[3]}" for c in GRID])
def test_matches_torch(name: str, p: int, n: int, spr: int) -> None:
    try:
        expected = torch_orders(name, p, n, spr)
    except Exception:  # torch rejects: so must we
        with pytest.raises(ScheduleConfigError):
            generate(name, num_ranks=p, num_microbatches=n, stages_per_rank=spr)
        return
    got = ours(name, p, n, spr)
    assert len(got) == p
    for rank in range(p):
        if name == "1F1B" and rank == p - 1:
            # torch's _get_pipeline_order shows the last rank starting at F1
            # (and ending with a nonexistent F{n}); its runtime runs F0 first.
            # test_single_stage_matches_torch_runtime covers this rank.
            continue
        assert got[rank] == expected[rank], f"rank {rank}: " + _first_difference(expected[rank], got[rank])


@pytest.mark.parametrize(
    ("name", "p", "n", "spr"),
    [("GPipe", 3, 5, 1), ("1F1B", 4, 6, 1), ("Interleaved1F1B", 4, 10, 3), ("LoopedBFS", 2, 3, 2),
     ("InterleavedZeroBubble", 3, 3, 2), ("ZBVZeroBubble", 3, 2, 2), ("DualPipeV", 2, 5, 2)],
)
def test_oracle_is_get_schedule_ops(name: str, p: int, n: int, spr: int) -> None:
    """The shared-mock oracle builds exactly what torch's get_schedule_ops returns."""
    assert torch_orders(name, p, n, spr) == [_strip(r) for r in get_schedule_ops(name, p, n, spr)]


@pytest.mark.parametrize("name", SINGLE)
@pytest.mark.parametrize(("p", "n"), [(1, 1), (1, 3), (2, 2), (2, 4), (2, 5), (3, 3), (3, 7), (4, 4), (4, 9), (5, 12)])
def test_single_stage_matches_torch_runtime(name: str, p: int, n: int) -> None:
    """GPipe and 1F1B against what torch's ``_step_microbatches`` executes.

    torch's displayed 1F1B order (``Schedule1F1B._get_pipeline_order``) has a
    bug on the last rank: for 2 ranks and 4 microbatches it shows rank 1 as
    ``1F1 1B0 1F2 1B1 ...`` -- F0 missing, an F4 that does not exist -- while
    the runtime runs ``1F0 1B0 1F1 1B1 ...``.  pipeloom follows the runtime.
    """
    got = ours(name, p, n, 1)
    for rank in range(p):
        assert got[rank] == torch_runtime_order(name, p, n, rank), f"rank {rank}"


def test_last_rank_1f1b_is_the_runtime_order() -> None:
    assert ours("1F1B", 2, 4, 1)[1] == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]


# ---------------------------------------------------------------- rejections

# (name, ranks, microbatches, stages per rank, text the message must contain)
REJECTED = [
    ("1F1B", 4, 3, None, "1F1B needs num_microbatches >= num_ranks (got 3 microbatches for 4 ranks)"),
    ("1F1B", 8, 1, None, "num_microbatches >= num_ranks"),
    ("DualPipeV", 2, 3, None, "DualPipeV needs num_microbatches >= 2 x num_ranks (got 3 microbatches for 2 ranks)"),
    ("DualPipeV", 4, 7, 2, "num_microbatches >= 2 x num_ranks"),
    ("DualPipeV", 1, 1, None, "num_microbatches >= 2 x num_ranks"),
    ("Interleaved1F1B", 2, 5, 2, "multiple of its number of rounds, max(1, num_microbatches // num_ranks) = 2"),
    ("Interleaved1F1B", 2, 5, 2, "nearest accepted: 4 or 6"),
    ("Interleaved1F1B", 3, 7, 3, "(got 7 microbatches for 3 ranks"),
    ("Interleaved1F1B", 4, 9, 4, "rounds"),
    ("InterleavedZeroBubble", 2, 5, 2, "InterleavedZeroBubble needs num_microbatches to be a multiple"),
    ("InterleavedZeroBubble", 3, 10, 2, "= 3"),
    ("ZBVZeroBubble", 2, 4, 3, "ZBVZeroBubble needs exactly 2 stages per rank"),
    ("DualPipeV", 2, 8, 4, "DualPipeV needs exactly 2 stages per rank"),
    ("Interleaved1F1B", 2, 0, 2, "num_microbatches must be >= 1"),
    ("LoopedBFS", 3, 0, 2, "num_microbatches must be >= 1"),
    ("ZBVZeroBubble", 3, 0, 2, "num_microbatches must be >= 1"),
    ("GPipe", 2, 4, 2, "GPipe runs exactly 1 stage per rank"),
]


@pytest.mark.parametrize(("name", "p", "n", "spr", "text"), REJECTED)
def test_rejected_like_torch(name: str, p: int, n: int, spr: int | None, text: str) -> None:
    with pytest.raises(Exception):  # noqa: B017 - torch raises ValueError or AssertionError
        get_schedule_ops(name, p, n, spr)
    with pytest.raises(ScheduleConfigError) as info:
        generate(name, num_ranks=p, num_microbatches=n, stages_per_rank=spr)
    assert text in str(info.value)
    assert isinstance(info.value, ScheduleError) and isinstance(info.value, ValueError)


def test_zero_microbatches_rejected_even_where_torch_builds_nothing() -> None:
    # torch's GPipe accepts 0 microbatches and builds empty lists; there is
    # nothing to run, so pipeloom rejects it like every other schedule.
    assert all(not [a for a in r if a is not None] for r in get_schedule_ops("GPipe", 2, 0))
    with pytest.raises(ScheduleConfigError, match="num_microbatches must be >= 1"):
        generate("GPipe", num_ranks=2, num_microbatches=0)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"num_ranks": 0, "num_microbatches": 4}, "num_ranks must be >= 1 (got 0)"),
        ({"num_ranks": 2, "num_microbatches": -1}, "num_microbatches must be >= 1 (got -1)"),
        ({"num_ranks": 2.0, "num_microbatches": 4}, "num_ranks must be an integer"),
        ({"num_ranks": True, "num_microbatches": 4}, "num_ranks must be an integer"),
        ({"num_ranks": 2, "num_microbatches": 4, "stages_per_rank": 0}, "stages_per_rank must be >= 1"),
    ],
)
def test_bad_sizes(kwargs: dict, text: str) -> None:
    with pytest.raises(ScheduleConfigError) as info:
        generate("LoopedBFS", **kwargs)
    assert text in str(info.value)


# ---------------------------------------------------------------- names


def test_canonical_name() -> None:
    assert canonical_name("interleaved1f1b") == "Interleaved1F1B"
    assert canonical_name("ScheduleInterleaved1F1B") == "Interleaved1F1B"
    assert canonical_name("Schedule1F1B") == "1F1B"
    assert canonical_name("SCHEDULEDUALPIPEV") == "DualPipeV"
    assert canonical_name("gpipe") == "GPipe"
    for name in SCHEDULE_NAMES:
        assert canonical_name(name) == name
        assert canonical_name("Schedule" + name) == name
        assert torch_schedules.get_schedule_class(name).__name__ == "Schedule" + name
    with pytest.raises(ScheduleConfigError) as info:
        canonical_name("ZeroBubbleV")
    assert "'ZeroBubbleV'" in str(info.value)
    assert all(name in str(info.value) for name in SCHEDULE_NAMES)


def test_defaults_and_placement() -> None:
    assert {n: default_stages_per_rank(n) for n in SCHEDULE_NAMES} == {
        "GPipe": 1,
        "1F1B": 1,
        "Interleaved1F1B": 2,
        "LoopedBFS": 2,
        "InterleavedZeroBubble": 2,
        "ZBVZeroBubble": 2,
        "DualPipeV": 2,
    }
    assert [n for n in SCHEDULE_NAMES if placement_style(n) == "v"] == ["ZBVZeroBubble", "DualPipeV"]
    assert placement_style("schedulegpipe") == "loop"


def test_schedule_fields() -> None:
    s = generate("scheduleinterleaved1f1b", num_ranks=4, num_microbatches=8, stages_per_rank=3)
    assert isinstance(s, Schedule)
    assert s.name == "Interleaved1F1B" and not s.lowered and s.num_microbatches == 8
    assert s.stage_to_rank == loop_mapping(4, 3)
    assert sorted(s.actions) == [0, 1, 2, 3]
    v = generate("DualPipeV", num_ranks=3, num_microbatches=6)
    assert v.stage_to_rank == v_mapping(3)
    assert default_stages_per_rank("DualPipeV") == v.num_stages // v.num_ranks


# ---------------------------------------------------------------- sanity


SANITY = [
    (name, p, n)
    for name in SCHEDULE_NAMES
    for p, n in [(1, 2), (2, 4), (3, 7), (4, 8), (4, 12), (7, 14), (16, 64)]
    if not (name in ("Interleaved1F1B", "InterleavedZeroBubble") and (p, n) == (3, 7))
]


@pytest.mark.parametrize(("name", "p", "n"), SANITY)
def test_every_microbatch_runs_once(name: str, p: int, n: int) -> None:
    """Each (stage, microbatch) has one F and one backward (B, or I then W), on the stage's rank."""
    s = generate(name, num_ranks=p, num_microbatches=n)
    compute = {ActionType.F, ActionType.B, ActionType.I, ActionType.W}
    seen: dict[tuple[ActionType, int, int], int] = {}
    for rank, acts in s.actions.items():
        for a in acts:
            assert a.is_compute, a
            if a.type is ActionType.OVERLAP_F_B:
                assert [x.type for x in a.sub_actions][0] is ActionType.F
            for leaf in a.leaves():
                assert leaf.type in compute
                assert s.stage_to_rank[leaf.stage] == rank, f"{leaf} on rank {rank}"
                key = (leaf.type, leaf.stage, leaf.microbatch)
                if leaf.type is ActionType.W:
                    assert (ActionType.I, leaf.stage, leaf.microbatch) in seen, f"{leaf} before its I"
                if leaf.type in (ActionType.B, ActionType.I):
                    assert (ActionType.F, leaf.stage, leaf.microbatch) in seen, f"{leaf} before its F"
                assert key not in seen, f"{leaf} twice"
                seen[key] = rank
    for stage in range(s.num_stages):
        for mb in range(n):
            assert (ActionType.F, stage, mb) in seen
            full = (ActionType.B, stage, mb) in seen
            split = (ActionType.I, stage, mb) in seen
            assert full != split, f"stage {stage} mb {mb}: needs exactly one of B or I+W"
            assert split == ((ActionType.W, stage, mb) in seen)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_large_schedule_generates(name: str) -> None:
    """64 ranks x 2 stages per rank x 256 microbatches (its speed: benchmarks/schedule_speed.py)."""
    spr = default_stages_per_rank(name)
    s = generate(name, num_ranks=64, num_microbatches=256, stages_per_rank=spr)
    assert sum(len(a) for a in s.actions.values()) >= 64 * spr * 256 * 2 // 3
