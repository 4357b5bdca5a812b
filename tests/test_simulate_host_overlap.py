"""The two-lane model's host-overlapped backwards (``simulate(host_overlap_backward=...)``, issue 13)."""

from __future__ import annotations

import itertools

import pytest
from pipeloom.schedules import (
    SCHEDULE_NAMES,
    Costs,
    ScheduleError,
    default_stages_per_rank,
    generate,
    lower,
    simulate,
)
from pipeloom.schedules.dispatch import backward_overlap_pays, overlappable_backwards
from pipeloom.schedules.simulate import OVERLAP_CONTENTION


def _costs(stages: int, f: tuple[float, float], b: tuple[float, float]) -> tuple[dict, dict]:
    """(host, device) costs per stage: ``f`` and ``b`` are (host launch, device time)."""
    host = {(s, t, None): c[0] for s in range(stages) for t, c in (("F", f), ("B", b))}
    dev = {(s, t, None): c[1] for s in range(stages) for t, c in (("F", f), ("B", b))}
    return host, dev


def _lowered(name: str, p: int = 2, m: int = 8, v: int | None = None):
    sched = generate(name, num_ranks=p, num_microbatches=m, stages_per_rank=v or default_stages_per_rank(name))
    return lower(sched, comms=True, recv_placement="early", costs=Costs())


def _sim(low, host, dev, **kw):
    return simulate(low, Costs(), action_costs=host, device_costs=dev, commit_horizon=10.0, device_transfer=0.05,
                    device_streams=True, **kw)


HOST_BOUND = ((2.0, 0.5), (4.0, 1.4))  # GPT size s on H100: a B launches in 4 ms and runs 1.4
DEVICE_BOUND = ((1.0, 2.0), (2.0, 4.0))


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B"])
def test_overlapped_backward_shortens_a_host_bound_step(name: str) -> None:
    low = _lowered(name)
    host, dev = _costs(low.num_stages, *HOST_BOUND)
    inline = _sim(low, host, dev)
    auto = _sim(low, host, dev, host_overlap_backward="auto")
    assert auto.makespan < inline.makespan * 0.9
    # every pair the runtime may overlap is overlapped (the rule says yes on both stream layouts here)
    pairs = overlappable_backwards(low)
    assert dict(auto.overlapped_backwards) == {r: len(pairs[r]) for r in pairs}
    assert sum(auto.overlapped_backwards.values()) > 0
    # contention: each host lane slower while both launch; at 2 (one interpreter shared evenly) nothing is gained
    steps = [_sim(low, host, dev, host_overlap_backward="auto", overlap_contention=c).makespan for c in (1.0, 1.5, 2.0)]
    assert steps[0] < steps[1] < steps[2] == pytest.approx(inline.makespan)


def test_one_rank_host_bound_exact() -> None:
    """One rank, F0 B0 F1 B1 F2 B2, host F 1 B 4, device F 1 B 1, no contention: each B's launch hides the next
    F's (the next B waits for it), and the B's device span ends with its launch."""
    sched = generate("1F1B", num_ranks=1, num_microbatches=3)
    host = {(0, "F", None): 1.0, (0, "B", None): 4.0}
    dev = {(0, "F", None): 1.0, (0, "B", None): 1.0}
    assert simulate(sched, Costs(), action_costs=host, device_costs=dev).makespan == pytest.approx(15.0)
    res = simulate(sched, Costs(), action_costs=host, device_costs=dev, host_overlap_backward=True,
                   overlap_contention=1.0)
    # host: F0 [0,1], B0 [1,5] beside F1 [1,2], B1 [5,9] beside F2 [5,6], B2 [9,13] (the last: no F after it)
    assert res.makespan == pytest.approx(13.0)
    assert res.overlapped_backwards == {0: 2}
    ends = {str(e.action): e.end for e in res.events}
    assert ends["0B0"] == pytest.approx(5.0) and ends["0B1"] == pytest.approx(9.0) and ends["0F1"] == pytest.approx(2.0)
    # B0's activations are held until its launch is over, F1's taken meanwhile: one microbatch more than inline
    assert res.peak_live_activations == {0: 2}
    assert simulate(sched, Costs(), action_costs=host, device_costs=dev).peak_live_activations == {0: 1}
    # with contention 1.5 F1 launches in 1.5 while B0 does 1 of its 4, then B0 goes on alone: 1 + 1.5 + 3
    res = simulate(sched, Costs(), action_costs=host, device_costs=dev, host_overlap_backward=True,
                   overlap_contention=1.5)
    assert {str(e.action): e.end for e in res.events}["0B0"] == pytest.approx(5.5)


def test_one_stream_forward_kernels_delay_the_backward() -> None:
    """Forced on a device-bound rank (one stream): the F launched beside the B runs among its kernels, so the B's
    device end (its input gradient, which the previous rank waits for) comes the F's device time later."""
    sched = generate("1F1B", num_ranks=1, num_microbatches=3)
    host = {(0, "F", None): 1.0, (0, "B", None): 2.0}
    dev = {(0, "F", None): 3.0, (0, "B", None): 2.0}
    inline = simulate(sched, Costs(), action_costs=host, device_costs=dev)
    forced = simulate(sched, Costs(), action_costs=host, device_costs=dev, host_overlap_backward=True)
    b0 = {str(e.action): e.end for e in inline.events}["0B0"]
    assert b0 == pytest.approx(5.0)
    assert {str(e.action): e.end for e in forced.events}["0B0"] == pytest.approx(b0 + 3.0)
    assert forced.makespan == pytest.approx(inline.makespan)  # the device's work is the same


def test_device_bound_one_stream_step_left_alone() -> None:
    """1F1B (one stage, one stream per rank), device-bound: the rule keeps every B inline, so the step is the
    inline one exactly; forcing the overlap gains nothing."""
    low = _lowered("1F1B")
    host, dev = _costs(low.num_stages, *DEVICE_BOUND)
    inline = _sim(low, host, dev)
    auto = _sim(low, host, dev, host_overlap_backward="auto")
    assert auto.makespan == inline.makespan
    assert set(auto.overlapped_backwards.values()) == {0}
    assert [e[:4] for e in auto.events] == [e[:4] for e in inline.events]
    assert _sim(low, host, dev, host_overlap_backward=True).makespan >= inline.makespan


def test_two_streams_overlap_regardless_one_stream_by_the_rule() -> None:
    """Interleaved1F1B with a stream per stage: a B beside an F of the other stage always (the runtime's rule),
    one beside an F of its own stage only where host-bound; the count follows the rule pair by pair."""
    low = _lowered("Interleaved1F1B", m=8, v=2)
    host, dev = _costs(low.num_stages, *DEVICE_BOUND)
    auto = _sim(low, host, dev, host_overlap_backward="auto")
    pairs = overlappable_backwards(low)
    for rank, acts in low.actions.items():
        comp = [a for a in acts if a.is_compute]
        cross = sum(1 for a, nxt in itertools.pairwise(comp) if a.type.value == "B" and nxt.type.value == "F"
                    and (a.stage, a.microbatch) in pairs[rank] and nxt.stage != a.stage)
        assert auto.overlapped_backwards[rank] == cross > 0
    # one device lane for the whole rank (device_streams False): one stream, so the rule keeps them all inline
    one = simulate(low, Costs(), action_costs=host, device_costs=dev, commit_horizon=10.0,
                   host_overlap_backward="auto")
    assert set(one.overlapped_backwards.values()) == {0}


def test_rule_decides_per_stage_pair_from_the_costs() -> None:
    """1F1B on 2 ranks, stage 0 host-bound and stage 1 device-bound: only rank 0 overlaps, as
    ``backward_overlap_pays`` says on each stage's host and device times."""
    low = _lowered("1F1B")
    host = {(0, "F", None): 2.0, (0, "B", None): 4.0, (1, "F", None): 1.0, (1, "B", None): 2.0}
    dev = {(0, "F", None): 0.5, (0, "B", None): 1.4, (1, "F", None): 2.0, (1, "B", None): 4.0}
    assert backward_overlap_pays(True, 4.0, 1.4, 0.5) and not backward_overlap_pays(True, 2.0, 4.0, 2.0)
    res = _sim(low, host, dev, host_overlap_backward="auto")
    assert res.overlapped_backwards[0] > 0 and res.overlapped_backwards[1] == 0
    # a recorded run's decisions replayed instead of the rule's
    replay = _sim(low, host, dev, overlap_pairs={1: {(1, 1)}})
    assert replay.overlapped_backwards[0] == 0 and replay.overlapped_backwards[1] > 0


def test_the_runtime_uses_the_same_rule() -> None:
    pytest.importorskip("torch")
    from pipeloom.runtime import device

    assert device.backward_overlap_pays is backward_overlap_pays


def test_default_unchanged_and_textbook_bubbles() -> None:
    low = _lowered("1F1B", m=8)
    host, dev = _costs(low.num_stages, *HOST_BOUND)
    base = _sim(low, host, dev)
    for off in (None, False):
        res = _sim(low, host, dev, host_overlap_backward=off)
        assert res.makespan == base.makespan and res.events == base.events and res.overlapped_backwards == {}
    # the option off: the textbook bubbles of GPipe, 1F1B, Interleaved1F1B
    p, m = 4, 8
    for name, v in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)):
        sched = generate(name, num_ranks=p, num_microbatches=m, stages_per_rank=v)
        res = simulate(sched, Costs(F=1.0, B=2.0), host_overlap_backward=False)
        assert res.overall_bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("streams", [True, False])
def test_every_named_schedule_finishes_forced_on(name: str, streams: bool) -> None:
    """Forced on every pair the runtime may overlap, every named schedule (lowered) still finishes, and no faster
    than the device's work allows."""
    low = _lowered(name, p=2, m=8)
    host, dev = _costs(low.num_stages, *HOST_BOUND)
    for t in ("I", "W"):
        for s in range(low.num_stages):
            host[(s, t, None)], dev[(s, t, None)] = 2.0, 0.7
    try:
        res = simulate(low, Costs(), action_costs=host, device_costs=dev, commit_horizon=10.0, device_streams=streams,
                       host_overlap_backward=True, overlap_contention=OVERLAP_CONTENTION)
    except ScheduleError as exc:  # pragma: no cover - the failure to report
        pytest.fail(f"{name}: {exc}")
    inline = simulate(low, Costs(), action_costs=host, device_costs=dev, commit_horizon=10.0, device_streams=streams)
    assert res.makespan <= inline.makespan * 1.05
    assert res.makespan >= max(res.busy.values())


def test_bad_options_are_refused() -> None:
    low = _lowered("1F1B")
    host, dev = _costs(low.num_stages, *HOST_BOUND)
    with pytest.raises(ValueError, match="host_overlap_backward must be"):
        _sim(low, host, dev, host_overlap_backward="yes")
    with pytest.raises(ValueError, match="overlap_contention"):
        _sim(low, host, dev, host_overlap_backward="auto", overlap_contention=0.5)
    with pytest.raises(ValueError, match="need device_costs"):
        simulate(low, Costs(), host_overlap_backward="auto")


@pytest.mark.parametrize("lists", [
    ("0F0 0B0 0F1 0B1", "1F0 1B0 1F1 1B1"),  # rank 1's F1 waits on rank 0's F1, after rank 0's B0 (rank 1's gradient)
    ("0F0 0F1 0B0 0F2 0B1 0B2", "1F0 1B0 1F1 1F2 1B1 1B2"),  # rank 1's second forward beside B0 waits on it
])
def test_custom_lists_whose_forwards_wait_on_the_backward_finish(lists: tuple[str, str]) -> None:
    """Forced on, a pair whose forwards (any of the run after the B) wait on the B's outputs stays inline, as the
    runtime keeps it (overlappable_backwards): the simulation finishes, and overlaps the pairs that are safe."""
    from pipeloom.schedules import Schedule, parse_action

    acts = {r: [parse_action(x) for x in text.split()] for r, text in enumerate(lists)}
    sched = Schedule(acts, (0, 1), max(len(t.split()) for t in lists) // 2)
    host, dev = _costs(2, *HOST_BOUND)
    res = simulate(sched, Costs(), action_costs=host, device_costs=dev, host_overlap_backward=True)
    pairs = overlappable_backwards(sched)
    assert (1, 0) not in pairs[1] and res.overlapped_backwards[1] == 0
    assert res.overlapped_backwards[0] == len(pairs[0]) > 0
    assert res.makespan <= simulate(sched, Costs(), action_costs=host, device_costs=dev).makespan  # (rank 1 bounds it)


def test_the_trial_of_host_heavy_pairs_is_simulated_as_the_runtime_runs_it() -> None:
    """The GPT with a 128k head on 2 x H200 (session S, learned means, ms): rank 1's B launches in 3.7 against
    2.6 + 1.7 of device time, so the rule keeps it inline, yet its host takes longer per microbatch (3.7 + 2.4)
    than its device (4.3): a host-heavy pair, tried beside (``overlap_trial``), and kept where the simulated step
    gets 3% shorter; with the trial off the rule alone decides (the runtime's ``host_overlap_trial=False``)."""
    low = _lowered("1F1B", m=16)
    host = {(0, "F", None): 2.4, (0, "B", None): 4.3, (1, "F", None): 2.4, (1, "B", None): 3.7}
    dev = {(0, "F", None): 0.44, (0, "B", None): 1.27, (1, "F", None): 1.72, (1, "B", None): 2.63}
    rule = _sim(low, host, dev, host_overlap_backward="auto", overlap_trial=False)
    assert rule.overlapped_backwards[0] > 0 and rule.overlapped_backwards[1] == 0 and not rule.overlap_tried
    trial = _sim(low, host, dev, host_overlap_backward="auto")
    assert trial.overlap_tried == {1: ((1, 1),)}
    assert trial.overlap_decided[1] == {(1, 1): True} and trial.overlapped_backwards[1] > 0
    assert trial.makespan < 0.97 * rule.makespan
    # a device-bound rank is never tried (session O's last rank of size l: host 3.65 + 2.10, device 5.03 + 2.50)
    host[(1, "F", None)], host[(1, "B", None)], dev[(1, "F", None)], dev[(1, "B", None)] = 2.10, 3.65, 2.50, 5.03
    bound = _sim(low, host, dev, host_overlap_backward="auto")
    assert not bound.overlap_tried and bound.overlapped_backwards[1] == 0
    # a host-heavy pair whose trial would not win 3% stays inline, as the runtime's trial drops it
    host[(1, "F", None)], host[(1, "B", None)], dev[(1, "F", None)], dev[(1, "B", None)] = 2.0, 4.0, 1.72, 2.63
    near = _sim(low, host, dev, host_overlap_backward="auto")
    beside = _sim(low, host, dev, overlap_pairs={0: {(0, 0)}, 1: {(1, 1)}})
    assert near.overlap_tried == {1: ((1, 1),)}
    assert (near.overlapped_backwards[1] > 0) == (beside.makespan < 0.97 * _sim(
        low, host, dev, host_overlap_backward="auto", overlap_trial=False).makespan)
