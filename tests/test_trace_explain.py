"""Explaining the step time: attribution, critical path, planned vs actual.

One real 2-rank job (gloo) runs every named schedule for 3 training steps
with an eval step after the first, each rank writing its own file
(``PATH.rank{R}``, as under torchrun), once per module.  On those traces the
attribution of every rank's time must add up to every step window exactly,
the critical path must tile the window, windows must not overlap, eval steps
must be marked and left out.  The rest runs on small hand-built traces whose
numbers are known.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from ranks.harness import launch_script

from pipeloom.schedules import SCHEDULE_NAMES
from pipeloom.tools.cli import main
from pipeloom.tools.trace_analysis import Attributor, attribute, critical_path, wait_causes
from pipeloom.tools.trace_export import chrome_trace
from pipeloom.tools.trace_model import TraceModel, load_trace, summarize, trace_api

SCRIPT = textwrap.dedent(
    """\
    import os, sys
    import torch, pipeloom
    import torch.distributed as dist
    from torch import nn
    out, names = sys.argv[1], sys.argv[2].split(",")
    # (argv[3] "overlap": every backward the list follows with a forward launched beside it, traced)
    opts = pipeloom.RuntimeOptions(host_overlap_backward=True) if sys.argv[3:] == ["overlap"] else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    for name in names:
        stages = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]
        pipe = pipeloom.Pipeline(lambda s: stages[s], schedule=name, num_microbatches=4,
                                 loss_fn=nn.functional.mse_loss, trace=f"{out}/{name}.jsonl", options=opts)
        x, y = torch.randn(16, 16), torch.randn(16, 16)
        pipe.step(x, target=y)
        pipe.eval(x, target=y)
        pipe.step(x, target=y)
        pipe.step(x, target=y)
        pipe.close()
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
    """
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("explain")
    proc = launch_script(d, SCRIPT, str(d), ",".join(SCHEDULE_NAMES))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_attribution_adds_up_on_real_runs(runs: Path, name: str) -> None:
    model = load_trace(runs / f"{name}.jsonl")  # the path the job was given stands for PATH.rank0, PATH.rank1
    assert model.ranks == [0, 1] and not model.missing_ranks
    assert model.steps == [0, 1, 2, 3] and model.eval_steps == {1} and model.train_steps == [0, 2, 3]
    wins = [model.windows[s] for s in model.steps]
    assert all(a[1] <= b[0] for a, b in zip(wins, wins[1:])), "step windows overlap"
    att = Attributor(model)
    for step in model.steps:
        lo, hi = model.window(step)
        for rank in model.ranks:
            a = att.attribute(rank, step)
            assert a.total_ns == a.window_ns == hi - lo, (name, step, rank, a)
            assert min([*a.actions_ns.values(), *a.waits_ns.values(), a.sends_ns, a.runtime_ns, a.prev_step_ns, a.outside_ns]) >= 0
            assert a.compute_ns > 0
        cp = critical_path(model, step, attributor=att)
        assert sum(s.duration for s in cp.segments) == hi - lo
        assert all(s.duration >= 0 for s in cp.segments) and cp.actions
        # segments in time order, tiling the window without gaps
        assert cp.segments[0].start == lo and cp.segments[-1].end == hi
        assert all(x.end == y.start for x, y in zip(cp.segments, cp.segments[1:]))
        assert cp.total("compute") > 0
    s = summarize(model)
    assert s.steps == (0, 2, 3) and "1 eval step" in s.left_out
    for r in s.attribution:
        assert r.total_ns == sum(model.windows[k][1] - model.windows[k][0] for k in (0, 2, 3))
    # the train step's waits on the other rank are attributed to that peer
    assert any(p in (0, 1) for r in s.attribution for p in r.by_peer())


def test_summary_cli_on_a_real_run(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(runs / "1F1B.jsonl")
    assert main(["trace", "summary", path, "--json", "--skip-warmup", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["steps"] == [2, 3] and "warm-up" in doc["left_out"] and "eval" in doc["left_out"]
    for a in doc["attribution_per_step"]:
        assert a["total_ns"] == a["window_ns"] == doc["step_times_ns"][str(a["step"])]
    assert {c["step"] for c in doc["critical_path"]} == {2, 3}
    assert {(x["rank"], x["type"]) for x in doc["action_stats"]} >= {(0, "F"), (0, "B"), (1, "F"), (1, "B")}
    assert set(doc["step_time_percentiles_ns"]) >= {"mean", "p50", "p90", "max"}
    assert main(["trace", "summary", path, "--include-eval"]) == 0
    out = capsys.readouterr().out
    assert "where the time went" in out and "critical path:" in out and "action durations:" in out
    assert "4 steps (0..3)" in out
    # only one rank's file: the other rank is reported, not shown as idle
    assert main(["trace", "summary", path + ".rank0"]) == 0
    cap = capsys.readouterr()
    assert "no events of rank 1" in cap.err and "rank 1: no events" in cap.out


def test_plan_against_run(runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = str(runs / "ZBVZeroBubble.jsonl")
    plan = str(tmp_path / "plan.jsonl")
    assert main(["schedule", "simulate", "--costs-from", run, "--trace", plan]) == 0
    out = capsys.readouterr().out
    assert "measured step time" in out and "ZBVZeroBubble: 2 ranks, 4 stages" in out
    assert load_trace(plan).header["time_unit_ns"] == 1
    assert main(["trace", "compare", run, plan]) == 0
    out = capsys.readouterr().out
    assert "run step 3:" in out and "slip" in out
    assert main(["trace", "compare", run, plan, "--json", "--top", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["actions"]) == 2 * 4 * 3 * 2  # 2 ranks x 2 stages x (F, I, W) x 4 microbatches
    # a plan mixed with a run anywhere else: exit 2 and say so
    assert main(["trace", "summary", plan, run]) == 2
    assert "compare them with `pipeloom trace compare RUN PLAN`" in capsys.readouterr().err
    assert main(["trace", "compare", plan, run]) == 2
    assert "give the run first" in capsys.readouterr().err
    assert main(["trace", "export", run, str(runs / "1F1B.jsonl"), "--chrome", str(tmp_path / "x.json")]) == 2
    assert "not files of one job" in capsys.readouterr().err


def test_export_carries_the_critical_path_and_attribution(runs: Path) -> None:
    model = load_trace(runs / "DualPipeV.jsonl")
    doc = chrome_trace(model)
    crit = [e for e in doc["traceEvents"] if e.get("cat") == "critical_path"]
    assert crit and {e["args"]["kind"] for e in crit} >= {"compute"}
    steps = [e for e in doc["traceEvents"] if e.get("cat") == "step"]
    for e in steps:
        a = e["args"]["attribution_ns"]
        assert a["total_ns"] == a["window_ns"]
    assert any(e["args"]["eval"] for e in steps)


@pytest.fixture(scope="module")
def overlap_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("explain-overlap")
    proc = launch_script(d, SCRIPT, str(d), "1F1B,Interleaved1F1B", "overlap")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B"])
def test_backwards_beside_forwards_are_traced(overlap_runs: Path, name: str) -> None:
    # host_overlap_backward in a traced run: the backwards launched on the worker thread are recorded with
    # "beside", their spans overlap the loop's forwards, and the attribution still tiles every window
    model = load_trace(overlap_runs / f"{name}.jsonl")
    beside = [a for lst in model.actions.values() for a in lst if a.event.get("beside")]
    assert {a.step for a in beside} == {2, 3}  # the first training step inline (its random-number check), eval none
    assert {a.rank for a in beside} == {0, 1} and all(a.type == "B" for a in beside)
    inline = {(a.rank, a.step, a.name): a for lst in model.actions.values() for a in lst if not a.event.get("beside")}
    # some backward's span covers the forward launched after it on its rank
    assert any(f.rank == b.rank and f.step == b.step and f.type == "F" and b.start < f.start < b.end
               for b in beside for f in inline.values())
    att = Attributor(model)
    for step in model.train_steps:
        lo, hi = model.window(step)
        for rank in model.ranks:
            a = att.attribute(rank, step)
            assert a.total_ns == a.window_ns == hi - lo and a.actions_ns.get("B", 0) > 0
        cp = critical_path(model, step, attributor=att)
        assert sum(x.duration for x in cp.segments) == hi - lo
    # the host costs of a backward come from the inline ones (the first step) where the steps measured have any,
    # else from the spans beside the forwards
    from pipeloom.tools.run_costs import costs_from_trace

    for skip, steps in ((0, (0, 2, 3)), (1, (2, 3))):
        own = [a.duration for a in inline.values() if a.type == "B" and a.stage == 0 and a.step in steps]
        assert own and costs_from_trace(model, skip_warmup=skip).compute_ns[(0, "B")] == pytest.approx(sum(own) / len(own))
    doc = chrome_trace(model)  # exported beside the forwards, on a row of their own where they overlap
    assert len([e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("name", "").endswith("B0") and e.get("cat") == "compute"]) >= 1


# ---------------------------------------------------------------- by hand


def _hand() -> TraceModel:
    """Rank 1 waits 100..200 for 1F0: announced at 130, landed at 170, action at 180 (after 10 of wake-up)."""
    h = trace_api().make_header(world_size=2, schedule="1F1B", num_microbatches=1, stage_to_rank=[0, 1])
    ev: list[dict[str, Any]] = [
        {"ev": "step", "rank": 0, "step": 0, "start": 100, "end": 400},
        {"ev": "step", "rank": 1, "step": 0, "start": 100, "end": 380},
        {"ev": "action", "rank": 0, "step": 0, "name": "0F0", "type": "F", "stage": 0, "mb": 0, "start": 100, "end": 120},
        {"ev": "send", "rank": 0, "step": 0, "peer": 1, "stage": 1, "mb": 0, "kind": "F", "seq": 0, "bytes": 8, "start": 125, "end": 140},
        {"ev": "wait", "rank": 1, "step": 0, "start": 100, "end": 180, "for": ["1F0: activation of stage 0 microbatch 0 from rank 0"]},
        {"ev": "recv", "rank": 1, "step": 0, "peer": 0, "stage": 1, "mb": 0, "kind": "F", "seq": 0, "bytes": 8, "start": 130, "end": 170},
        {"ev": "action", "rank": 1, "step": 0, "name": "1F0", "type": "F", "stage": 1, "mb": 0, "start": 185, "end": 220},
        {"ev": "action", "rank": 1, "step": 0, "name": "1B0", "type": "B", "stage": 1, "mb": 0, "start": 220, "end": 300},
        {"ev": "send", "rank": 1, "step": 0, "peer": 0, "stage": 0, "mb": 0, "kind": "B", "seq": 0, "bytes": 8, "start": 300, "end": 310},
        {"ev": "wait", "rank": 0, "step": 0, "start": 140, "end": 330, "for": ["0B0: gradient from stage 1 microbatch 0 on rank 1"]},
        {"ev": "recv", "rank": 0, "step": 0, "peer": 1, "stage": 0, "mb": 0, "kind": "B", "seq": 0, "bytes": 8, "start": 305, "end": 325},
        {"ev": "action", "rank": 0, "step": 0, "name": "0B0", "type": "B", "stage": 0, "mb": 0, "start": 330, "end": 390},
        # step 1 starts on rank 1 while rank 0 still finishes step 0 (its window is cut there)
        {"ev": "step", "rank": 1, "step": 1, "start": 390, "end": 500},
        {"ev": "step", "rank": 0, "step": 1, "start": 410, "end": 500, "eval": True},
        {"ev": "action", "rank": 1, "step": 1, "name": "1F0", "type": "F", "stage": 1, "mb": 0, "start": 420, "end": 450},
    ]
    return TraceModel(h, sorted(ev, key=lambda e: e.get("start", 0)))


def test_wait_causes_and_attribution_by_hand() -> None:
    m = _hand()
    assert m.windows == {0: (100, 390), 1: (390, 500)} and m.eval_steps == {1}
    w1 = m.waits[1][0]
    assert wait_causes(m, w1) == [(100, 130, "not_sent", 0), (130, 170, "in_flight", 0), (170, 180, "wakeup", None)]
    a1 = attribute(m, 1, 0)
    assert a1.actions_ns == {"F": 35, "B": 80} and a1.sends_ns == 10
    assert a1.waits_ns == {("not_sent", 0): 30, ("in_flight", 0): 40, ("wakeup", None): 10}
    assert a1.runtime_ns == 5 + 70 and a1.outside_ns == 10 - 0 and a1.total_ns == 290
    a0 = attribute(m, 0, 0)
    assert a0.actions_ns == {"F": 20, "B": 60} and a0.sends_ns == 15
    assert a0.waits_ns == {("not_sent", 1): 165, ("in_flight", 1): 20, ("wakeup", None): 5}
    assert a0.runtime_ns == 5 and a0.total_ns == 290
    # rank 0 in step 1's window: still in step 0 for 390..400, then outside until it enters step 1 at 410
    a0s1 = attribute(m, 0, 1)
    assert (a0s1.prev_step_ns, a0s1.outside_ns, a0s1.runtime_ns, a0s1.total_ns) == (10, 10, 90, 110)
    cp = critical_path(m, 0)
    assert [(s.kind, s.rank, s.start, s.end) for s in cp.segments] == [
        ("compute", 0, 100, 120), ("runtime", 0, 120, 125), ("transfer", 1, 125, 170), ("runtime", 1, 170, 185),
        ("compute", 1, 185, 220), ("compute", 1, 220, 300), ("transfer", 0, 300, 325), ("runtime", 0, 325, 330),
        ("compute", 0, 330, 390),
    ]
    assert cp.line() == "step 0 = 290 ns: compute 195 ns + transfers 70 ns + runtime 25 ns"
    s = summarize(m)
    assert s.steps == (0,) and s.left_out == "1 eval step"


def test_tune_ranks_configurations_from_a_run(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeloom.tools.run_costs import costs_from_trace
    from pipeloom.tools.schedule_tune import _action_costs, tune

    path = str(runs / "1F1B.jsonl")
    assert main(["schedule", "tune", "--costs-from", path, "--json", "-m", "2,4,8", "-v", "1,2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    cands = doc["candidates"]
    assert doc["recorded"]["schedule"] == "1F1B" and doc["recorded"]["microbatches"] == 4
    times = [c["step_ns"] for c in cands]
    # ranked by predicted step, except that the near-ties of the fastest (within TIE) lead in order of risk
    # (schedule_tune.rank_candidates): which ones tie depends on the recorded run's costs
    from pipeloom.tools.schedule_tune import TIE

    n = sum(1 for t in times if t <= min(times) * (1 + TIE))
    assert all(t <= min(times) * (1 + TIE) for t in times[:n]) and times[n:] == sorted(times[n:]), times
    assert all(c["fits"] for c in cands)
    assert {(c["schedule"], c["microbatches"], c["stages_per_rank"]) for c in cands} >= {("1F1B", 2, 1), ("ZBVZeroBubble", 4, 2)}
    assert any("GPipe m=2 v=2" in s for s in doc["skipped"])
    assert main(["schedule", "tune", "--costs-from", path, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "recorded configuration 1F1B m=4 v=1: measured" in out and "top 3 of" in out
    # a cap nothing fits under: exit 1, every candidate listed as over it
    assert main(["schedule", "tune", "--costs-from", path, "--memory-cap", "1B"]) == 1
    assert "over the cap" in capsys.readouterr().out
    assert main(["schedule", "tune", "--costs-from", path, "--memory-cap", "lots"]) == 2
    assert "not a size" in capsys.readouterr().err
    # scaling: one microbatch size recorded, so half the microbatches is twice the compute per action; the
    # runtime time per action and the blocking time per send (stage 0's F sends to rank 1) stay
    rc = costs_from_trace(load_trace(path))
    assert not rc.sizes_fitted
    a4, a2 = _action_costs(rc, 2, 1, 4), _action_costs(rc, 2, 1, 2)
    o = rc.runtime_per_action_ns[0] + rc.send_per_transfer_ns[0]
    assert a2[(0, "F", None)] - o == pytest.approx(2 * (a4[(0, "F", None)] - o))
    r = tune(rc, schedules=["1F1B"], microbatches=[4], stages_per_rank=[1], activation_memory=1000)
    assert r.recorded is not None and r.candidates[0].peak_activation_bytes == 1000 * r.candidates[0].peak_live


SLOW_FIRST_STAGE = textwrap.dedent(
    """\
    import os, sys, time
    import torch, pipeloom
    from torch import nn
    out = sys.argv[1]
    torch.set_num_threads(1)

    class SlowBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            time.sleep(0.04)
            return g

    class Slow(nn.Module):
        def forward(self, x):
            return SlowBackward.apply(x)

    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 8), Slow()), nn.Linear(8, 8)]
    pipe = pipeloom.Pipeline(lambda s: stages[s], schedule="1F1B", num_microbatches=2,
                             loss_fn=nn.functional.mse_loss, trace=f"{out}/slow.jsonl")
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(3):
        pipe.step(x, target=y)
    pipe.close()
    """
)


def test_the_wait_for_a_peers_end_of_step_is_a_wait_on_that_peer(tmp_path: Path) -> None:
    # 1F1B on 2 ranks: rank 1 (the last stage) runs its last backward, then waits for rank 0 to end its
    # step (static shapes: rank 0's end-of-step header), which comes after rank 0's last backward: 40 ms
    # of sleep here.  That wait is the peer's, not the runtime's own time.
    proc = launch_script(tmp_path, SLOW_FIRST_STAGE, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = load_trace(tmp_path / "slow.jsonl")
    ends = [w for w in model.waits[1] if any("end of step" in str(t) for t in w.event.get("for", []))]
    assert {w.step for w in ends} >= {1, 2}, "rank 1 waited at the end of its static-shape steps"
    for step in (1, 2):
        a = attribute(model, 1, step)
        peer_end = a.waits_ns.get(("peer_end", 0), 0)
        assert peer_end >= 30e6, a.waits_ns  # ~ rank 0's last backward (40 ms)
        assert a.runtime_ns < peer_end, (a.runtime_ns, peer_end)
        assert a.total_ns == a.window_ns


def test_layout_and_end_of_step_waits_by_hand() -> None:
    m = _hand()
    w = m.waits[1][0]
    for texts, want in ((["peers' end of step: from rank 0"], ("peer_end", 0)),
                        (["the ranks' input layouts"], ("layouts", None))):
        got = wait_causes(m, dataclasses.replace(w, event=dict(w.event, **{"for": texts})))
        assert [(c, p) for _, _, c, p in got] == [want]
        assert got[0][:2] == (w.start, w.end)


def test_a_backward_beside_forwards_counts_where_the_loop_ran_nothing_else() -> None:
    # rank 0 launched 0B0 on the worker at 100 (done at 200); meanwhile the loop ran 0F1 (120-150), sent its
    # output (150-160) and waited (160-190): F 30, send 10, B the other 60 of its span, runtime 200-220
    h = trace_api().make_header(world_size=1, schedule="1F1B", num_microbatches=2, stage_to_rank=[0])
    ev: list[dict[str, Any]] = [
        {"ev": "step", "rank": 0, "step": 0, "start": 100, "end": 220},
        {"ev": "action", "rank": 0, "step": 0, "name": "0B0", "type": "B", "stage": 0, "mb": 0, "start": 100, "end": 200,
         "beside": True},
        {"ev": "action", "rank": 0, "step": 0, "name": "0F1", "type": "F", "stage": 0, "mb": 1, "start": 120, "end": 150},
        {"ev": "send", "rank": 0, "step": 0, "peer": 1, "stage": 1, "mb": 1, "kind": "F", "seq": 0, "bytes": 8, "start": 150, "end": 160},
        {"ev": "wait", "rank": 0, "step": 0, "start": 160, "end": 190, "for": ["0B1: gradient"]},
    ]
    model = TraceModel(h, sorted(ev, key=lambda e: e.get("start", 0)))
    a = attribute(model, 0, 0)
    assert a.window_ns == a.total_ns == 120
    assert a.actions_ns == {"B": 60, "F": 30} and a.sends_ns == 10 and a.runtime_ns == 20 and not a.waits_ns
    from pipeloom.tools.run_costs import costs_from_trace

    # no inline backward to measure: the span beside the forwards stands for it
    assert costs_from_trace(model, skip_warmup=0).compute_ns[(0, "B")] == 100
