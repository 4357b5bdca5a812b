"""The policy simulator (issue 19's "measure the room first"): static equals the list simulator,
the dynamic policies keep the runtime's guarantees, and the bound is a bound."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pipeloom.schedules import SCHEDULE_NAMES, Costs, generate, policy_ceiling, simulate, simulate_policy
from pipeloom.schedules.dispatch import static_peak
from pipeloom.schedules.policy_sim import _compute_lists, draw_costs
from pipeloom.tools.cli import main


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_static_policy_is_the_list_simulator_and_dynamic_keeps_the_cap(name: str) -> None:
    sched = generate(name, num_ranks=4, num_microbatches=8)
    costs = Costs(F=1, B=2, I=1, W=1, send_latency=0.1)
    lengths = [0.4 + 0.15 * m for m in range(8)]
    durs = draw_costs(sched, costs, lengths=lengths, jitter=0.2, slow={1: 1.3}, rng=random.Random(7))
    ref = simulate(sched, costs, action_costs={(s, t, m): v for (s, t, m), v in durs.items()})
    static = simulate_policy(sched, "static", durs, transfer=costs.transfer)
    assert static.makespan == pytest.approx(ref.makespan) and static.reordered == 0
    lists = _compute_lists(sched)
    for policy in ("dynamic", "critical"):
        res = simulate_policy(sched, policy, durs, transfer=costs.transfer)
        for r, acts in lists.items():
            assert res.peak_live[r] <= static_peak(acts), (policy, r)  # never more live activations than the list
            assert res.busy[r] == pytest.approx(static.busy[r])  # the same work, reordered
    means = policy_ceiling(sched, costs, trials=3, jitter=0.1)
    assert means["bound"] <= min(means[p] for p in ("static", "dynamic", "critical")) + 1e-9
    assert means["best"] == pytest.approx(min(means["best"], means["static"]))


def test_policy_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "simulate", "all", "-p", "2", "-m", "4", "--policy", "dynamic,critical", "--trials", "2",
                 "--jitter", "0.1", "--slow", "1:1.5"]) == 0
    out = capsys.readouterr().out
    assert "ZBVZeroBubble" in out and "bound" in out and "gain = static / policy - 1" in out
    assert main(["schedule", "simulate", "1F1B", "-p", "2", "-m", "4", "--policy", "dynamic", "--trials", "2",
                 "--lengths", "fixed", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    row = doc["schedules"][0]
    assert row["schedule"] == "1F1B" and set(row["mean_step"]) == {"static", "dynamic", "best", "bound"}
    # fixed lengths, no jitter: 1F1B's list is already what the dispatcher does
    assert row["mean_step"]["dynamic"] == pytest.approx(row["mean_step"]["static"])
    assert main(["schedule", "simulate", "1F1B", "-p", "2", "-m", "4", "--policy", "fastest"]) == 2
    assert "policies are static, dynamic, critical" in capsys.readouterr().err
    assert main(["schedule", "simulate", "1F1B", "-p", "2", "-m", "4", "--policy", "dynamic", "--lengths", "1:0"]) == 2


def test_notice_a_transfer_landing_while_busy_is_usable_only_after_the_action() -> None:
    """A CPU rank reads arrivals between actions: 0F1's output lands at 1.5, inside 1F0 (1..2), so
    it is usable at 2 + notice; the static order waits for it, `ready` runs 1B0 first."""
    sched = generate("GPipe", num_ranks=2, num_microbatches=2)
    durs = {(0, "F", 0): 1.0, (0, "F", 1): 0.5, (1, "F", 0): 1.0, (1, "F", 1): 1.0,
            (0, "B", 0): 2.0, (0, "B", 1): 2.0, (1, "B", 0): 2.0, (1, "B", 1): 2.0}
    for policy in ("static", "dynamic"):
        res = simulate_policy(sched, policy, durs)
        assert res.makespan == pytest.approx(9.0) and res.reordered == 0
    static = simulate_policy(sched, "static", durs, notice=0.3)
    assert static.makespan == pytest.approx(9.3) and static.reordered == 0
    ready = simulate_policy(sched, "dynamic", durs, notice=0.3)
    assert ready.makespan == pytest.approx(9.0) and ready.reordered == 1
    # a local hand-off (same rank) is never delayed: one rank, any notice, the list's makespan
    one = generate("1F1B", num_ranks=1, num_microbatches=2)
    d1 = {k: 1.0 for k in draw_costs(one, Costs())}
    assert simulate_policy(one, "static", d1, notice=5.0).makespan == pytest.approx(simulate_policy(one, "static", d1).makespan)


def test_sends_free_held_and_in_turn() -> None:
    """Rank 1 (the last stage) prefers 1B1 (a long backward follows it on rank 0) over 1B0.
    Free: its gradient leaves at once, rank 0 runs 0B1 from 4 to 9, then 0B0: 9.1.  Held (static
    shapes on NCCL: rank 0 posts its receives in list order): the gradient of 1B1 waits for 1B0's
    (produced at 5), so rank 0 starts 0B1 at 5: 10.1, worse than the list's 10.  In turn (static
    shapes on gloo; on NCCL too, where a rule reorders): 1B1 is not next in its send order, so
    rank 1 keeps the list, and rank 0's reordering has nothing to take: the list's 10."""
    sched = generate("GPipe", num_ranks=2, num_microbatches=2)
    durs = {(0, "F", 0): 1.0, (0, "F", 1): 1.0, (1, "F", 0): 1.0, (1, "F", 1): 1.0,
            (0, "B", 0): 0.1, (0, "B", 1): 5.0, (1, "B", 0): 1.0, (1, "B", 1): 1.0}
    prio = {(1, "B", 1): 10.0, (1, "B", 0): 1.0, (0, "B", 1): 5.0, (0, "B", 0): 0.1,
            **{(s, "F", m): 100.0 for s in (0, 1) for m in (0, 1)}}
    assert simulate_policy(sched, "static", durs).makespan == pytest.approx(10.0)
    got = {s: simulate_policy(sched, "critical", durs, priority=prio, sends=s) for s in ("free", "held", "in_turn")}
    assert got["free"].makespan == pytest.approx(9.1) and got["free"].reordered == 2
    assert got["held"].makespan == pytest.approx(10.1) and got["held"].reordered == 2
    assert got["in_turn"].makespan == pytest.approx(10.0) and got["in_turn"].reordered == 0
    # the list itself never holds anything: the same under every model
    for s in ("held", "in_turn"):
        assert simulate_policy(sched, "static", durs, sends=s).makespan == pytest.approx(10.0)
    with pytest.raises(ValueError, match="unknown sends"):
        simulate_policy(sched, "static", durs, sends="eager")


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_policy_finishes_with_held_and_in_turn_sends(name: str) -> None:
    sched = generate(name, num_ranks=4, num_microbatches=8)
    costs = Costs(F=1, B=2, I=1, W=1, send_latency=0.1)
    for seed in range(3):
        durs = draw_costs(sched, costs, lengths=[0.3 + 0.2 * m for m in range(8)], jitter=0.3, slow={1: 1.5},
                          rng=random.Random(seed))
        static = simulate_policy(sched, "static", durs, transfer=costs.transfer).makespan
        for policy in ("dynamic", "critical", "guarded"):
            held = simulate_policy(sched, policy, durs, transfer=costs.transfer, sends="held")
            turn = simulate_policy(sched, policy, durs, transfer=costs.transfer, sends="in_turn")  # finishes: no deadlock
            assert turn.makespan > 0 and held.makespan > 0
        assert simulate_policy(sched, "static", durs, transfer=costs.transfer, sends="in_turn").makespan == pytest.approx(static)


def test_uneven_benchmark_predicts_under_each_send_model(tmp_path: Path) -> None:
    # benchmarks/uneven.py --sends-table, on a row of a recorded 4-rank gloo run (LoopedBFS, bimodal
    # lengths, rule `ready`, measured -10% when sends were held): reordering gains in the free
    # model, nothing in turn, and loses when sends are held
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from uneven import sends_table

    row = {"schedule": "LoopedBFS", "workload": "bimodal", "ranks": 4, "microbatches": 8, "rule": "ready", "model": "sleep",
           "backend": "gloo", "gain": -0.102, "gain_ci": [-0.134, -0.081], "f_ms": 8.0, "steps": 12, "draws": 4}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "rule": "list"}) + "\n")
    lines = sends_table(str(path)).splitlines()
    assert len(lines) == 3  # header, rule, one row (the list row is left out)
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    free, in_turn, held = (float(c.rstrip("%")) for c in cells[-3:])
    assert cells[:5] == ["4", "LoopedBFS", "bimodal", "ready", "-10.2%"]
    assert free > 2.0 and in_turn == 0.0 and held < 0.0, cells
