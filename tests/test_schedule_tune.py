"""``pipeloom schedule tune``'s cost model: carrying a run's costs to other configurations, and the layer split.

One real 2-rank 1F1B job (gloo) records a profiling run whose steps alternate
the full and the half batch, once per module: the costs measured on it must
separate each action's fixed part from its per-row part, keep the step time of
the full-size steps, and the tuner's own configuration must come out at the
measured step time (calibration).  The layer-split search runs on costs built
by hand, whose best split is known.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ranks.harness import launch_script

from pipeloom.schedules import Costs, generate, lower, simulate
from pipeloom.tools.cli import main
from pipeloom.tools.run_costs import RunCosts, _affine, costs_from_trace, merge_types, with_host_costs
from pipeloom.tools.schedule_tune import (
    TIE,
    Candidate,
    Layers,
    TuneResult,
    _action_costs,
    calibration,
    fixed_per_action,
    format_tune,
    _nonneg_fit,
    near_ties,
    rank_candidates,
    search_split,
    stage_compute,
    tune,
)
from pipeloom.tools.trace_model import load_trace, summarize

SCRIPT = textwrap.dedent(
    """\
    import os, sys
    import torch, pipeloom
    import torch.distributed as dist
    from torch import nn
    out = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    stages = [nn.Sequential(*[nn.Linear(64, 64) for _ in range(2)]) for _ in range(2)]
    pipe = pipeloom.Pipeline(lambda s: stages[s], schedule="1F1B", num_microbatches=4,
                             loss_fn=nn.functional.mse_loss, trace=f"{out}/profile.jsonl")
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    for i in range(7):
        n = 32 if i % 2 == 0 else 16
        pipe.step(x[:n], target=y[:n])
    pipe.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
    """
)


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tune")
    proc = launch_script(d, SCRIPT, str(d))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d / "profile.jsonl"


def test_costs_of_a_profile_with_two_batch_sizes(profile: Path) -> None:
    model = load_trace(str(profile))
    rc = costs_from_trace(model)
    assert rc.sizes_fitted and rc.ref_bytes == 8 * 64 * 4  # 8 rows of 64 float32 per microbatch at the full batch
    assert set(rc.compute_fit) == {(0, "F"), (0, "B"), (1, "F"), (1, "B")}
    for fixed, per_byte in rc.compute_fit.values():
        assert fixed >= 0 and per_byte >= 0 and fixed + per_byte * rc.ref_bytes > 0
    # the step time is the full-size steps' (2, 4, 6; step 0 is the warm-up), not the half-size ones'
    assert rc.steps == [1, 2, 3, 4, 5, 6]
    st = summarize(model, skip_warmup=1, critical=False).step_times_ns
    assert rc.step_ns == pytest.approx(sum(st[s] for s in (2, 4, 6)) / 3)
    assert rc.step_ns_median == sorted(st[s] for s in (2, 4, 6))[1]
    # the link was timed: a fixed part, or (where the two sizes' fit has no intercept, as on a loaded machine) a
    # part per byte through the origin (run_costs._affine)
    assert (rc.link_latency_ns > 0 or rc.link_ns_per_byte > 0) and not rc.overlap_measured
    # the tuner's own configuration, calibrated, is the measured median; without calibration it is the model's
    r = tune(rc, schedules=["1F1B", "DualPipeV"], microbatches=[2, 4, 8], stages_per_rank=None)
    assert r.recorded is not None and r.recorded.step_ns == pytest.approx(rc.step_ns_median)
    assert r.calibration == pytest.approx(calibration(rc)) and r.sizes_fitted
    raw = tune(rc, schedules=["1F1B"], microbatches=[4], stages_per_rank=[1], calibrate=False)
    assert raw.calibration == 1.0 and raw.candidates[0].step_ns * r.calibration == pytest.approx(r.recorded.step_ns)
    assert {(c.schedule, c.stages_per_rank) for c in r.candidates} == {("1F1B", 1), ("DualPipeV", 2)}


def test_costs_of_a_graphed_run_leave_out_the_capture_steps(profile: Path) -> None:
    """A run with ``cuda_graphs`` (its header says so): the first step ran eagerly and the second uploaded the
    graphs at their first replay, so neither is measured by default; an explicit ``skip_warmup`` still rules."""
    model = load_trace(str(profile))
    assert model.header["options"]["cuda_graphs"] is False
    model.header["options"] = {**model.header["options"], "cuda_graphs": True}
    assert costs_from_trace(model).steps == [2, 3, 4, 5, 6]
    assert costs_from_trace(model, skip_warmup=1).steps == [1, 2, 3, 4, 5, 6]


def test_costs_from_the_typical_steps(profile: Path) -> None:
    """``typical``: actions and transfers measured on the steps at most the median of their size; the step times
    (what the tuner calibrates to) stay every reference step's."""
    model = load_trace(str(profile))
    every, typ = costs_from_trace(model), costs_from_trace(model, typical=True)
    st = summarize(model, skip_warmup=1, critical=False).step_times_ns
    full, half = sorted((2, 4, 6), key=lambda s: st[s]), sorted((1, 3, 5), key=lambda s: st[s])
    assert typ.steps == sorted(full[:2] + half[:2])  # the slowest step of each size is left out
    assert typ.step_ns_median == every.step_ns_median and typ.step_ns == every.step_ns
    for (stage, t), mean in typ.compute_ns.items():
        d = [a.duration for r in model.ranks for a in model.actions.get(r, [])
             if a.step in full[:2] and a.stage == stage and a.type == t]
        assert mean == pytest.approx(sum(d) / len(d))
    assert typ.sizes_fitted and set(typ.compute_fit) == set(every.compute_fit)


def test_device_times_from_the_traces_device_events(profile: Path) -> None:
    """GPU traces carry each action's device time (``device`` events, CUDA events in the engine):
    ``costs_from_trace(device=True)`` takes the actions' times from them (fixed part and all, fitted over the
    two batch sizes), and the tuner's device side keeps them whole (a synced span's fixed part is the sync's)."""
    from pipeloom.tools.schedule_tune import _device_side
    from pipeloom.tools.trace_model import TraceModel

    base = load_trace(str(profile))
    with pytest.raises(ValueError, match="no device times"):
        costs_from_trace(base, device=True)
    events = list(base.events)
    for r in base.ranks:
        for a in base.actions.get(r, []):
            # 1 us fixed + 2 us per full-size microbatch's worth of bytes: 5 us at 8 rows, 3 us at 4 rows
            ns = (1000 + (4000 if a.step % 2 == 0 else 2000) * (1 + a.stage)) if a.type in ("F", "B") else 100
            events.append({"ev": "device", "rank": r, "step": a.step, "name": a.name, "type": a.type,
                           "stage": a.stage, "mb": a.mb, "t": a.start, "ns": ns})
    model = TraceModel(base.header, events)
    dev, host = costs_from_trace(model, device=True), costs_from_trace(model)
    assert dev.device_measured and not host.device_measured
    for (stage, t), mean in dev.compute_ns.items():
        assert mean == pytest.approx(1000 + 4000 * (1 + stage))  # the full-size (reference) steps' device time
        fixed, per_byte = dev.compute_fit[(stage, t)]
        assert fixed == pytest.approx(1000) and per_byte * dev.ref_bytes == pytest.approx(4000 * (1 + stage))
    # everything but the actions' times is the same run's
    assert (dev.steps, dev.step_ns, dev.link_latency_ns) == (host.steps, host.step_ns, host.link_latency_ns)
    both = with_host_costs(dev, host)
    assert both.device_measured and both.host is not None and not both.host.device_measured
    assert _device_side(both, {"F": 500.0, "B": 500.0}).compute_fit == both.compute_fit  # nothing taken off
    spans = with_host_costs(costs_from_trace(model), host)
    assert all(a == 0.0 for a, _ in _device_side(spans, None).compute_fit.values())  # spans: per-byte part only


def test_tune_cli_takes_both_sides_from_a_trace_with_device_times(profile: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from pipeloom.runtime.trace import write_trace

    base = load_trace(str(profile))
    events = list(base.events) + [
        {"ev": "device", "rank": r, "step": a.step, "name": a.name, "type": a.type, "stage": a.stage, "mb": a.mb,
         "t": a.start, "ns": 2000} for r in base.ranks for a in base.actions.get(r, [])]
    path = tmp_path / "gpu-like.jsonl"
    write_trace(path, base.header, events)
    assert main(["schedule", "tune", "--costs-from", str(path), "-m", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["host_separate"] and doc["device_events"] and doc["candidates"]
    assert main(["schedule", "tune", "--costs-from", str(path), "-m", "4"]) == 0
    assert "host and device recorded apart (device times from CUDA events)" in capsys.readouterr().out
    # a trace without them (a CPU run) keeps one side
    assert main(["schedule", "tune", "--costs-from", str(profile), "-m", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert not doc["host_separate"] and not doc["device_events"]


def test_simulate_costs_from_a_gpu_run_uses_the_two_lane_model(profile: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU run's spans are host launch times: `schedule simulate --costs-from` simulates its configuration as the
    tuner does (host lane ahead of a device lane), so its device time shows in the step; a CPU run keeps one lane."""
    from pipeloom.runtime.trace import write_trace

    base = load_trace(str(profile))
    dev_ns = 5_000_000  # each F and B 5 ms on the device: far longer than its host span on this CPU profile
    events = list(base.events) + [
        {"ev": "device", "rank": r, "step": a.step, "name": a.name, "type": a.type, "stage": a.stage, "mb": a.mb,
         "t": a.start, "ns": dev_ns if a.type in ("F", "B") else 1000} for r in base.ranks for a in base.actions.get(r, [])]
    path = tmp_path / "gpu-like.jsonl"
    write_trace(path, base.header, events)
    assert main(["schedule", "simulate", "--costs-from", str(path), "--json"]) == 0
    lanes = json.loads(capsys.readouterr().out)
    assert lanes["device_model"] == "lanes" and lanes["num_microbatches"] == 4
    # each rank runs 4 F and 4 B of device time, one after the other on its device lane
    assert lanes["makespan"] >= 8 * dev_ns * 0.5
    assert main(["schedule", "simulate", "--costs-from", str(path), "--json", "--device-model", "one-lane"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["device_model"] == "one-lane" and one["makespan"] < lanes["makespan"] / 2  # host spans alone
    plan = tmp_path / "plan.jsonl"
    assert main(["schedule", "simulate", "--costs-from", str(path), "--trace", str(plan)]) == 0
    assert "two lanes, as `schedule tune`" in capsys.readouterr().out
    assert main(["trace", "compare", str(path), str(plan)]) == 0  # the plan sets against the run it came from
    capsys.readouterr()
    assert main(["schedule", "simulate", "--costs-from", str(profile), "--json"]) == 0  # a CPU run: one lane
    assert json.loads(capsys.readouterr().out)["device_model"] == "one-lane"
    # planned as it ran: the run's options come from its header (a run recorded with a 1 ms horizon and no
    # launch rule commits less far ahead: never faster than with the default horizon)
    assert base.header["options"]["device"] == "cpu" and base.header["options"]["gpu_commit_ms"] == 10.0
    narrow = tmp_path / "narrow.jsonl"
    write_trace(narrow, dict(base.header, options=dict(base.header["options"], gpu_commit_ms=0.001,
                                                           gpu_commit_launches=0.0)), events)
    import pipeloom.tools.schedule_tune as st

    seen: list[dict[str, Any]] = []
    real = st._simulate

    def spy(*a: Any, **kw: Any) -> Any:
        seen.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(st, "_simulate", spy)
    assert main(["schedule", "simulate", "--costs-from", str(narrow), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] >= lanes["makespan"] * 0.999
    (kw,) = seen
    assert kw["commit_ns"] == pytest.approx(1000.0) and kw["commit_launches"] == 0.0
    # overlap_streams auto (the header's None): 1F1B has no OVERLAP_F_B, one stream; a run recorded with it on: as it ran
    assert kw["overlap_backward"] == "auto" and base.header["options"]["overlap_streams"] is None and kw["stage_streams"] is False
    on = tmp_path / "streams.jsonl"
    write_trace(on, dict(base.header, options=dict(base.header["options"], overlap_streams=True)), events)
    assert main(["schedule", "simulate", "--costs-from", str(on), "--json"]) == 0
    assert seen[-1]["stage_streams"] is True


def test_compute_carried_as_fixed_plus_per_byte(profile: Path) -> None:
    rc = costs_from_trace(load_trace(str(profile)))
    for m, rows in ((4, 8), (8, 4), (2, 16)):
        nbytes = rows * 64 * 4
        (c0, c1) = stage_compute(rc, 2, nbytes)
        for s, c in ((0, c0), (1, c1)):
            for t in ("F", "B"):
                fixed, per_byte = rc.compute_fit[(s, t)]
                assert c[t] == pytest.approx(fixed + per_byte * nbytes)
        a = _action_costs(rc, 2, 1, m)
        o0 = rc.runtime_per_action_ns[0]
        # F of stage 0 sends to rank 1: one send's blocking time, whatever the payload
        assert a[(0, "F", None)] == pytest.approx(c0["F"] + o0 + rc.send_per_transfer_ns[0])
        assert a[(0, "B", None)] == pytest.approx(c0["B"] + o0)  # the first stage's gradient goes nowhere
    # a split backward: I + W = B, I small on the first stage
    (c0, c1) = stage_compute(rc, 2, rc.ref_bytes)
    assert c0["I"] + c0["W"] == pytest.approx(c0["B"]) and c0["I"] < 0.1 * c0["B"] < c1["I"]


def test_affine_fit() -> None:
    assert _affine([(1, 5)]) is None
    assert _affine([(1, 3), (1, 5), (2, 6), (2, 6)]) == pytest.approx((2.0, 2.0))  # medians 4 and 6
    assert _affine([(1, 6), (2, 4)]) == (5, 0.0)  # a negative slope: the size does not matter
    assert _affine([(1, 1), (3, 9)]) == pytest.approx((0.0, 2.5))  # a negative intercept: proportional


def _hand_costs(stage_f: list[float], layers: int = 0) -> RunCosts:
    """1F1B on 2 ranks, m=4, per-stage F (B = 2F), no runtime, free transfers."""
    compute = {}
    for s, f in enumerate(stage_f):
        compute[(s, "F")] = f
        compute[(s, "B")] = 2 * f
    return RunCosts(costs=Costs(), action_costs={(s, t, None): c for (s, t), c in compute.items()}, compute_ns=compute,
                    overhead_per_action_ns={0: 0.0, 1: 0.0}, schedule="1F1B", num_microbatches=4, world_size=2,
                    stage_to_rank=[0, 1], steps=[1], step_ns=0.0, runtime_per_action_ns={0: 0.0, 1: 0.0},
                    send_per_transfer_ns={0: 0.0, 1: 0.0}, compute_fit={k: (c, 0.0) for k, c in compute.items()},
                    ref_bytes=1)


def test_layer_costs_follow_the_recorded_split() -> None:
    # 10 layers, recorded 5 + 5; the last stage was twice as slow: its layers cost twice as much
    rc = _hand_costs([10.0, 20.0])
    layers = Layers(tuple([1.0] * 10), (5, 5))
    (a, b) = stage_compute(rc, 2, 1, layers=layers, split=(6, 4))
    assert a["F"] == pytest.approx(10 + 4) and b["F"] == pytest.approx(16)
    # weights move the cost inside a stage: a head as the last layer holding most of stage 1
    heavy = Layers((1.0,) * 9 + (6.0,), (5, 5))
    (a, b) = stage_compute(rc, 2, 1, layers=heavy, split=(6, 4))
    assert a["F"] == pytest.approx(10 + 2) and b["F"] == pytest.approx(18)
    assert heavy.even_split(4) == (3, 3, 2, 2) and Layers((1.0,) * 10, (5, 5), ends=(1, 1)).even_split(4) == (3, 2, 2, 3)
    with pytest.raises(ValueError, match="add up"):
        Layers((1.0,) * 10, (5, 4))
    with pytest.raises(ValueError, match="split"):
        stage_compute(rc, 2, 1, layers=layers, split=(10, 0))


def test_split_search_balances_a_heavy_end_stage() -> None:
    rc = _hand_costs([10.0, 20.0])
    layers = Layers(tuple([1.0] * 10), (5, 5))
    split, best = search_split(rc, "1F1B", 2, 1, 4, layers)
    # per layer: 2 on the first five, 4 on the last five; balanced: the second stage holds fewer layers
    assert split[1] < 5 and sum(split) == 10
    even = tune(rc, schedules=["1F1B"], microbatches=[4], stages_per_rank=[1], layers=layers,
                                 calibrate=False)
    assert even.candidates[0].split == (5, 5) and best < even.candidates[0].step_ns
    # brute force over every split: the search found the best
    times = {}
    for k in range(1, 10):
        low = lower(generate("1F1B", num_ranks=2, num_microbatches=4), comms=True)
        ac = _action_costs(rc, 2, 1, 4, [0, 1], layers=layers, split=(k, 10 - k))
        times[k] = simulate(low, Costs(), action_costs=ac).makespan
    assert best == pytest.approx(min(times.values())) and times[split[0]] == pytest.approx(best)
    r = tune(rc, schedules=["1F1B", "GPipe"], microbatches=[4], stages_per_rank=[1], layers=layers, search=1,
             calibrate=False)
    assert r.candidates[0].searched and r.candidates[0].split == split
    assert any(not c.searched and c.split == (5, 5) for c in r.candidates)


def test_tune_cli_with_layers(profile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(profile)
    assert main(["schedule", "tune", "--costs-from", path, "-m", "4,8", "--layer-weights", "1,1,1,4",
                 "--search-split", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sizes_fitted"] and doc["calibration"] > 0
    assert all(c["split"] is not None and sum(c["split"]) == 4 for c in doc["candidates"])
    assert main(["schedule", "tune", "--costs-from", path, "-m", "4", "--layers", "4", "--search-split", "2"]) == 0
    out = capsys.readouterr().out
    assert "layers per stage" in out and "calibrated by" in out
    assert main(["schedule", "tune", "--costs-from", path, "--layer-weights", "1,1,1", "--recorded-split", "2,2"]) == 2
    assert "add up" in capsys.readouterr().err


def _layered_costs(stage_costs: dict[str, list[float]], place: list[int], schedule: str = "Interleaved1F1B") -> RunCosts:
    """A profile of len(place) stages with the given per-stage times by type (no runtime, free transfers)."""
    compute = {(s, t): c for t, cs in stage_costs.items() for s, c in enumerate(cs)}
    p = max(place) + 1
    return RunCosts(costs=Costs(), action_costs={(s, t, None): c for (s, t), c in compute.items()}, compute_ns=compute,
                    overhead_per_action_ns={r: 0.0 for r in range(p)}, schedule=schedule, num_microbatches=4,
                    world_size=p, stage_to_rank=place, steps=[1], step_ns=0.0,
                    runtime_per_action_ns={r: 0.0 for r in range(p)}, send_per_transfer_ns={r: 0.0 for r in range(p)},
                    compute_fit={k: (c, 0.0) for k, c in compute.items()}, ref_bytes=1)


# an embedding, 8 blocks, a head (three classes of layer); recorded on 4 stages: emb+2, 1, 3, 2+head blocks
WEIGHTS = (0.01,) + (1.0,) * 8 + (2.2,)
UNEVEN = Layers(WEIGHTS, (3, 1, 3, 3), ends=(1, 1))
HOST = {"F": (300.0, 20.0, 200.0, 150.0), "B": (500.0, 30.0, 400.0, 250.0)}  # fixed, embedding, block, head


def _host_times(t: str, emb: int, blocks: int, head: int) -> float:
    f, e, b, h = HOST[t]
    return f + emb * e + blocks * b + head * h


def test_fixed_part_per_action_paid_once_per_action() -> None:
    stages = [(1, 2, 0), (0, 1, 0), (0, 3, 0), (0, 2, 1)]
    rc = _layered_costs({t: [_host_times(t, *c) for c in stages] for t in HOST}, [0, 1, 0, 1])
    assert fixed_per_action(rc, UNEVEN, 1) == pytest.approx({"F": 300.0, "B": 500.0, "I": 500.0, "W": 500.0})
    # a CPU profile (no host side recorded apart) keeps the old rule: see fixed_per_action's docstring
    cpu = _action_costs(rc, 2, 1, 4, [0, 1], layers=UNEVEN, split=(5, 5))
    assert cpu[(0, "F", None)] == pytest.approx(stage_compute(rc, 2, 1, layers=UNEVEN, split=(5, 5))[0]["F"])
    # a GPU profile, here host-bound (device time = host time): every action pays the fixed part once, the
    # rest by layer (1F1B, two stages of emb+4 and 4+head blocks)
    rc = with_host_costs(rc, rc)
    a = _action_costs(rc, 2, 1, 4, [0, 1], layers=UNEVEN, split=(5, 5))
    assert a[(0, "F", None)] == pytest.approx(_host_times("F", 1, 4, 0))
    assert a[(1, "B", None)] == pytest.approx(_host_times("B", 0, 4, 1))
    # a split backward (never recorded): I and W are an action each, each paying the backward's fixed part
    assert a[(1, "I", None)] + a[(1, "W", None)] == pytest.approx(a[(1, "B", None)] + 500.0)
    # sharing whole stage times by weight (the old rule) moves the fixed part with the layers: this 1F1B stage,
    # made of all of two recorded stages and a third of another, would pay it more than twice
    old = stage_compute(rc, 2, 1, layers=UNEVEN, split=(5, 5))
    assert old[0]["F"] > a[(0, "F", None)] + 300.0
    r = tune(rc, schedules=["1F1B"], microbatches=[4], stages_per_rank=[1], layers=UNEVEN, calibrate=False)
    assert r.host_fixed_ns == pytest.approx({"F": 300.0, "B": 500.0, "I": 500.0, "W": 500.0}) and r.host_separate
    assert "host time per action: F 0.000 ms + per layer 0.000 ms" in format_tune(r)
    assert r.host_units_ns is not None and r.host_units_ns["F"] == pytest.approx({"fixed": 300.0, "start": 20.0, "layer": 200.0, "end": 150.0})


def test_fixed_part_needs_stages_that_hold_different_layers() -> None:
    even = Layers(WEIGHTS, (5, 5), ends=(1, 1))
    rc = _layered_costs({t: [_host_times(t, 1, 4, 0), _host_times(t, 0, 4, 1)] for t in HOST}, [0, 1], "1F1B")
    assert fixed_per_action(rc, even, 1) is None  # 2 stages, 4 unknowns: the old rule, unchanged
    a = _action_costs(rc, 2, 2, 4, [0, 1, 1, 0], layers=even, split=(3, 2, 2, 3))
    old = stage_compute(rc, 4, 1, layers=even, split=(3, 2, 2, 3))
    assert a[(1, "F", None)] == pytest.approx(old[1]["F"])
    r = tune(rc, schedules=["1F1B"], microbatches=[4], stages_per_rank=[1], layers=even, calibrate=False)
    assert r.host_fixed_ns is None and not r.host_separate and "not separated" in format_tune(r)
    # one class of layer (equal weights) and two stages of 3 and 5 layers: fixed and per-layer told apart
    rc = _layered_costs({"F": [100 + 3 * 40, 100 + 5 * 40], "B": [200 + 3 * 80, 200 + 5 * 80]}, [0, 1], "1F1B")
    assert fixed_per_action(rc, Layers((1.0,) * 8, (3, 5)), 1) == pytest.approx({"F": 100.0, "B": 200.0, "I": 200.0, "W": 200.0})
    # a negative fixed part (noise; the larger stage more than proportionally slower) is none: the old rule
    rc = _layered_costs({"F": [100.0, 300.0], "B": [200 + 3 * 80, 200 + 5 * 80]}, [0, 1], "1F1B")
    assert fixed_per_action(rc, Layers((1.0,) * 8, (3, 5)), 1) == pytest.approx({"F": 0.0, "B": 200.0, "I": 200.0, "W": 200.0})


def test_split_backward_measured_in_a_second_profile() -> None:
    stages = [(1, 2, 0), (0, 1, 0), (0, 3, 0), (0, 2, 1)]
    host = dict(HOST, I=(400.0, 0.0, 300.0, 200.0), W=(450.0, 0.0, 250.0, 100.0))
    times = {t: [host[t][0] + e * host[t][1] + b * host[t][2] + h * host[t][3] for e, b, h in stages] for t in host}
    fb = _layered_costs({t: times[t] for t in ("F", "B")}, [0, 1, 0, 1])
    fiw = _layered_costs({t: times[t] for t in ("F", "I", "W")}, [0, 1, 1, 0], "ZBVZeroBubble")
    fiw = replace(fiw, compute_fit={**fiw.compute_fit, (0, "I"): (50.0, 0.0)}, compute_ns={**fiw.compute_ns, (0, "I"): 50.0})
    run = merge_types(with_host_costs(fb, fb), with_host_costs(fiw, fiw))
    assert {t for _, t in run.compute_ns} == {"F", "B", "I", "W"} and run.schedule == "Interleaved1F1B"
    assert run.host is not None and set(run.host.compute_ns) == set(run.compute_ns)
    assert run.compute_ns[(0, "F")] == fb.compute_ns[(0, "F")]
    # the first stage's I (no input gradient: 50 ns here) is left out of the fit
    assert fixed_per_action(run, UNEVEN, 1) == pytest.approx({"F": 300.0, "B": 500.0, "I": 400.0, "W": 450.0})
    a = _action_costs(run, 2, 2, 4, [0, 1, 1, 0], layers=UNEVEN, split=(3, 2, 2, 3))
    assert a[(2, "I", None)] == pytest.approx(400.0 + 2 * 300.0) and a[(2, "W", None)] == pytest.approx(450.0 + 2 * 250.0)
    assert a[(2, "B", None)] == pytest.approx(500.0 + 2 * 400.0)  # measured, not I + W
    # the first stage's I, left out of the fit, is carried from the recorded first stage (here the same layers)
    assert a[(0, "I", None)] == pytest.approx(50.0) and a[(0, "W", None)] == pytest.approx(450.0 + 2 * 250.0)
    b = _action_costs(run, 2, 1, 4, [0, 1], layers=UNEVEN, split=(5, 5))
    assert b[(0, "I", None)] == pytest.approx(50.0 + 2 * 300.0)  # two blocks more than the recorded first stage
    with pytest.raises(ValueError, match="same stages"):
        merge_types(fb, _layered_costs({"F": [1.0, 1.0], "I": [1.0, 1.0], "W": [1.0, 1.0]}, [0, 1], "1F1B"))


def test_host_and_device_recorded_apart() -> None:
    stages = [(1, 2, 0), (0, 1, 0), (0, 3, 0), (0, 2, 1)]
    host = _layered_costs({t: [_host_times(t, *c) for c in stages] for t in HOST}, [0, 1, 0, 1])
    host = replace(host, runtime_per_action_ns={0: 7.0, 1: 7.0}, step_ns=123.0, step_ns_median=120.0)
    # the synced run: host-bound stages look like their host time (+ the sync), the head's B is device-bound
    dev_b = [_host_times("B", *c) + 10 for c in stages]
    dev_b[3] = 5000.0
    device = _layered_costs({"F": [_host_times("F", *c) + 10 for c in stages], "B": dev_b}, [0, 1, 0, 1])
    run = with_host_costs(device, host)
    assert run.host is not None and run.step_ns == 123.0 and run.runtime_per_action_ns == {0: 7.0, 1: 7.0}
    a = _action_costs(run, 2, 1, 4, [0, 1], layers=UNEVEN, split=(5, 5))
    # host-bound: the host path (launch + the runtime's 7 ns); device-bound: the device time of the layers
    assert a[(0, "F", None)] == pytest.approx(_host_times("F", 1, 4, 0) + 7.0)
    dev = stage_compute(replace(device, compute_fit={k: (c - HOST[k[1]][0], 0.0) for k, c in device.compute_ns.items()}),
                        2, 1, layers=UNEVEN, split=(5, 5))
    assert dev[1]["B"] > _host_times("B", 0, 4, 1) + 7.0 and a[(1, "B", None)] == pytest.approx(dev[1]["B"])
    r = tune(run, schedules=["1F1B"], microbatches=[4], stages_per_rank=[1], layers=UNEVEN, calibrate=False)
    assert r.host_separate and r.host_fixed_ns == pytest.approx({"F": 300.0, "B": 500.0, "I": 500.0, "W": 500.0})
    assert r.device_model == "lanes" and "committing ahead of its device" in format_tune(r)
    assert "longer of its host path" in format_tune(tune(run, schedules=["1F1B"], microbatches=[4], stages_per_rank=[1],
                                                         layers=UNEVEN, calibrate=False, device_model="max"))
    # two lanes: the host path and the device time apart, each what the one-lane model takes the longer of
    host_c, dev_c, launch = _action_costs(run, 2, 1, 4, [0, 1], layers=UNEVEN, split=(5, 5), lanes=True)
    assert host_c[(0, "F", None)] == pytest.approx(_host_times("F", 1, 4, 0) + 7.0)
    assert launch == pytest.approx(max(v - 7.0 for v in host_c.values()))  # no sends here: the slowest launch
    assert dev_c[(1, "B", None)] == pytest.approx(dev[1]["B"])
    for k in host_c:
        assert max(host_c[k], dev_c[k]) == pytest.approx(a[k])
    # with two microbatch sizes, the device time is the part of a synced span that grows with the rows: the
    # sync, the checks and the host's launch (here a 5000 ns intercept everywhere) are not device time
    fit = {k: (5000.0, 0.0) for k in device.compute_fit}
    fit[(3, "B")] = (5000.0, 6000.0)
    sized = with_host_costs(replace(device, compute_fit=fit, sizes_fitted=True), host)
    b = _action_costs(sized, 2, 1, 4, [0, 1], layers=UNEVEN, split=(5, 5))
    assert b[(0, "F", None)] == pytest.approx(_host_times("F", 1, 4, 0) + 7.0)
    assert b[(1, "B", None)] == pytest.approx(6000.0)  # all of recorded stage 3's B, per byte x 1 byte
    # an OVERLAP_F_B pair (DualPipeV) pays the runtime's 7 ns per action once, not once per half
    from pipeloom.tools.schedule_tune import _pair_overlap

    ac = _action_costs(run, 2, 2, 4, [0, 1, 1, 0], layers=UNEVEN, split=(3, 2, 2, 3))
    short = sum(min(ac[(s, "F", None)], ac[(s, "B", None)]) for s in range(4)) / 4
    assert _pair_overlap(run, ac) == pytest.approx(1 - 7.0 / short)
    with pytest.raises(ValueError, match="not the configuration"):
        with_host_costs(device, replace(host, num_microbatches=8))


def _host_bound(head: float) -> RunCosts:
    """A host-bound GPU profile (Interleaved1F1B, blocks 2,1,3,2): host times fixed + per layer (HOST, the head
    ``head`` x its HOST unit), device times (CUDA events) a hundredth of them."""
    stages = [(1, 2, 0), (0, 1, 0), (0, 3, 0), (0, 2, 1)]
    host = {t: [f + e * emb + b * blk + head * h * hd for emb, blk, hd in stages] for t, (f, e, b, h) in HOST.items()}
    h = _layered_costs(host, [0, 1, 0, 1])
    d = _layered_costs({t: [x / 100 for x in v] for t, v in host.items()}, [0, 1, 0, 1])
    return with_host_costs(replace(d, device_measured=True), h)  # device times from CUDA events


def test_host_time_grows_with_the_blocks_a_stage_holds() -> None:
    """On a host-bound GPU job an action's host time is the runtime's fixed part plus what each of its layers
    launches: moving a block to the first stage (blocks 5,3 instead of 4,4) loads the first rank's host, and the
    tuner must see that (the last GPU grid picked 5,3, measured 13% slower than 4,4)."""
    from pipeloom.tools.schedule_tune import _simulate, host_fit

    run = _host_bound(head=0.5)  # the head + loss launch half a block's kernels
    fit = host_fit(run, UNEVEN, 1)
    assert fit is not None
    assert fit.describe(UNEVEN)["F"] == pytest.approx({"fixed": 300.0, "start": 20.0, "layer": 200.0, "end": 75.0})
    assert fit.describe(UNEVEN)["B"] == pytest.approx({"fixed": 500.0, "start": 30.0, "layer": 400.0, "end": 125.0})
    for name in ("1F1B", "GPipe"):
        even, moved = (_simulate(run, name, 2, 1, 8, layers=UNEVEN, split=sp)[1].makespan for sp in ((5, 5), (6, 4)))
        assert moved > even * 1.05  # 5,3: the first rank launches a block more per action
        host, _, _ = _action_costs(run, 2, 1, 8, [0, 1], layers=UNEVEN, split=(6, 4), lanes=True)
        assert host[(0, "F", None)] == pytest.approx(_host_times("F", 1, 5, 0))
        assert host[(1, "B", None)] == pytest.approx(500 + 3 * 400 + 0.5 * 250)
    assert search_split(run, "1F1B", 2, 1, 8, UNEVEN)[0] == (5, 5)
    r = tune(run, schedules=["1F1B"], microbatches=[8], stages_per_rank=[1], layers=UNEVEN, search=1, calibrate=False)
    assert r.candidates[0].split == (5, 5)
    assert r.host_units_ns is not None and r.host_units_ns["F"]["layer"] == pytest.approx(200.0)
    text = format_tune(r)
    assert "host time per action: F 0.000 ms + per layer 0.000 ms, start 0.000 ms, end 0.000 ms" in text
    # a head that launches more than the block it replaces (3 blocks' worth): then 5,3 is the faster split
    heavy = _host_bound(head=3 * 200 / 150)
    assert search_split(heavy, "1F1B", 2, 1, 8, UNEVEN)[0] == (6, 4)


def test_host_time_of_a_stage_is_that_of_its_own_layers() -> None:
    """A candidate stage's host time is the fitted fixed part plus its own layers' units, whatever recorded stage
    they came from: a head that is expensive to run (FLOPs weight 2.2) but cheap to launch does not lend its
    launch time to the blocks recorded beside it (sharing a recorded stage's host time by FLOPs did)."""
    from pipeloom.tools.schedule_tune import _less_fixed

    run = _host_bound(head=0.2)  # the head launches a fifth of HOST's head unit: 30 ns of F
    host, dev, _ = _action_costs(run, 2, 2, 8, [0, 1, 1, 0], layers=UNEVEN, split=(3, 1, 4, 2), lanes=True)
    # stage 2: recorded stage 2's three blocks and one of recorded stage 3 (beside the head); stage 3: a block + head
    assert host[(2, "F", None)] == pytest.approx(_host_times("F", 0, 4, 0))
    assert host[(3, "F", None)] == pytest.approx(300 + 200 + 30)
    assert host[(3, "B", None)] == pytest.approx(500 + 400 + 50)
    # the rule before: the fixed part off, the rest of each recorded stage shared among its layers by FLOPs
    assert run.host is not None
    by_flops = stage_compute(_less_fixed(run.host, {"F": 300.0}), 4, 1, layers=UNEVEN, split=(3, 1, 4, 2))
    assert by_flops[3]["F"] + 300 == pytest.approx(300 + (2 * 200 + 30) * 3.2 / 4.2)  # 628 ns, not 530
    old_host, _, _ = _action_costs(run, 2, 2, 8, [0, 1, 1, 0], layers=UNEVEN, split=(3, 1, 4, 2), lanes=True,
                                   host_units=False)  # that rule, kept for tune_grid's comparison
    assert old_host[(3, "F", None)] == pytest.approx(by_flops[3]["F"] + 300)
    # the device side is still shared by FLOPs (a head is expensive to run)
    dev_flops = stage_compute(run, 4, 1, layers=UNEVEN, split=(3, 1, 4, 2))
    assert dev[(3, "F", None)] == pytest.approx(dev_flops[3]["F"])


def test_host_speed_per_rank_from_two_profiles() -> None:
    """The same stages recorded under two schedules that place them on different ranks (Interleaved1F1B: blocks
    2,1,3,2 on ranks 0,1,0,1; ZBVZeroBubble: 0,1,1,0) tell a rank whose host is slower for the same work from the
    layers' cost (``host_fit(rank_speed=True)``); without, the slower rank biases the units."""
    from pipeloom.tools.schedule_tune import host_fit

    stages = [(1, 2, 0), (0, 1, 0), (0, 3, 0), (0, 2, 1)]
    host = dict(HOST, I=(400.0, 0.0, 300.0, 200.0), W=(450.0, 0.0, 250.0, 100.0))

    def times(t: str, place: list[int]) -> list[float]:
        f, e, b, h = host[t]
        return [(f + emb * e + blk * b + hd * h) * (1.3 if place[k] == 1 else 1.0) for k, (emb, blk, hd) in enumerate(stages)]

    il, zb = [0, 1, 0, 1], [0, 1, 1, 0]
    fb = _layered_costs({t: times(t, il) for t in ("F", "B")}, il)
    fiw = _layered_costs({t: times(t, zb) for t in ("F", "I", "W")}, zb, "ZBVZeroBubble")
    run = merge_types(with_host_costs(replace(fb, device_measured=True), fb),
                      with_host_costs(replace(fiw, device_measured=True), fiw))
    assert run.host is not None and run.host.borrowed == ("I", "W") and len(run.host.others) == 1
    plain = host_fit(run, UNEVEN, 1)
    assert plain is not None and plain.speed == {}
    assert abs(plain.describe(UNEVEN)["F"]["layer"] - 200.0) > 20  # rank 1's slowness taken for the layers'
    fit = host_fit(run, UNEVEN, 1, rank_speed=True)
    assert fit is not None and fit.speed == pytest.approx({0: 1.0, 1: 1.3})
    for t in ("F", "B", "I", "W"):
        f, e, b, h = host[t]
        want = {"fixed": f, "layer": b, "end": h} | ({"start": e} if t in ("F", "B") else {})
        got = {k: v for k, v in fit.describe(UNEVEN)[t].items() if k in want}
        assert got == pytest.approx(want), t
    # a candidate's action on rank 1 pays rank 1's speed; one on rank 0 the units as they are
    hc, _, _ = _action_costs(run, 2, 1, 8, [0, 1], layers=UNEVEN, split=(5, 5), lanes=True, host_rank_speed=True)
    assert hc[(0, "F", None)] == pytest.approx(300 + 20 + 4 * 200)
    assert hc[(1, "F", None)] == pytest.approx(1.3 * (300 + 4 * 200 + 150))
    # one profile alone (every stage on one rank only): no speed to fit
    alone = with_host_costs(replace(fb, device_measured=True), fb)
    single = host_fit(alone, UNEVEN, 1, rank_speed=True)
    assert single is not None and single.speed == {}


def test_tune_cli_host_costs(profile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(profile)
    assert main(["schedule", "tune", "--costs-from", path, "--host-costs-from", path, "-m", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["host_separate"] and doc["candidates"]
    assert main(["schedule", "tune", "--costs-from", path, "--host-costs-from", str(profile.parent / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_commit_horizon_is_the_runtimes() -> None:
    """The tuner's copy of the runtime's commit horizon (it must not import torch) gives the runtime's values."""
    from pipeloom.runtime.device import commit_horizon as runtime_horizon
    from pipeloom.tools.schedule_tune import commit_horizon

    for args in ((10.0, 3.0, 1.0, 250.0), (10.0, 3.0, 10.0, 250.0), (10.0, 3.0, 120.0, 250.0), (10.0, 0.0, 50.0, 250.0),
                 (300.0, 3.0, 50.0, 250.0), (10.0, 3.0, 0.0, 250.0)):
        assert commit_horizon(*args) == runtime_horizon(*args)
    assert commit_horizon(10.0, 3.0, 10.0) == 30.0 and commit_horizon(10.0, 3.0, 120.0) == 250.0


def test_drawn_costs(profile: Path) -> None:
    """CPU profiles: every action's cost drawn from its type's recorded dispersion (``RunCosts.dispersion``)."""
    from pipeloom.tools.schedule_tune import sampled_runs

    rc = costs_from_trace(load_trace(str(profile)))
    assert set(rc.dispersion) == {"F", "B"}
    for q in rc.dispersion.values():
        assert len(q) == 32 and list(q) == sorted(q) and sum(q) / len(q) == pytest.approx(1.0)
    low = lower(generate("1F1B", num_ranks=2, num_microbatches=4), comms=True, recv_placement="early")
    c = Costs(F=1, B=2, send_latency=0.1)
    ac = {(s, t, None): x for s in range(2) for t, x in (("F", 1.0), ("B", 2.0))}
    means = simulate(low, c, action_costs=ac).makespan
    # no dispersion: every draw is the means' simulation
    flat = sampled_runs(low, c, ac, {"F": (1.0,), "B": (1.0,)}, 4, 5, seed="x")
    assert [r.makespan for r in flat] == [means] * 5
    # a rank waits for the later of two things: the drawn steps are longer on average than the means' step
    runs = sampled_runs(low, c, ac, {"F": (0.5, 1.5), "B": (0.5, 1.5)}, 4, 15, seed="x")
    assert [r.makespan for r in runs] == sorted(r.makespan for r in runs)
    assert sum(r.makespan for r in runs) / 15 > means
    assert runs == sampled_runs(low, c, ac, {"F": (0.5, 1.5), "B": (0.5, 1.5)}, 4, 15, seed="x")  # seeded
    # the tuner keeps the median of SAMPLES draws on a CPU profile; samples=0: the means
    drawn, plain = (tune(rc, schedules=["1F1B"], microbatches=[4], stages_per_rank=[1], calibrate=False, samples=k)
                    for k in (15, 0))
    assert drawn.candidates[0].step_ns != plain.candidates[0].step_ns


def test_posted_receives_time_the_link_only_where_the_receiver_was_already_waiting(profile: Path) -> None:
    """Static shapes on gloo trace a receive posted ahead as landed when the loop's wait for it returned, i.e.
    when its consumer came to it.  Only a receive whose wait began before it was sent times the link; one
    consumed late (with or without a short wait on a payload that had landed) is no sample of the link."""
    from pipeloom.tools.trace_model import TraceModel

    base = load_trace(str(profile))
    sends = {(s.rank, s.event["peer"], s.step, s.event["seq"]): s for s, _ in base.transfer_pairs()}
    events: list[dict[str, Any]] = []
    waited = 0
    for e in base.events:
        if e.get("ev") == "wait":
            continue
        if e.get("ev") == "recv" and e["step"] >= 1:
            s = sends.get((e["peer"], e["rank"], e["step"], e["seq"]))
            if s is None:
                continue
            e = {**e, "posted": True}
            if e["mb"] == 0 and e["kind"] == "F":  # the consumer was waiting when it was sent: 40 us of link
                e["end"] = s.end + 40_000
                events.append({"ev": "wait", "rank": e["rank"], "step": e["step"], "start": s.end - 50_000,
                               "end": e["end"], "for": ["x"]})
                waited += 1
            elif e["mb"] == 1:  # consumed 3 ms late after a short wait on a payload that had landed
                e["end"] = s.end + 3_000_000
                events.append({"ev": "wait", "rank": e["rank"], "step": e["step"], "start": e["end"] - 30_000,
                               "end": e["end"], "for": ["x"]})
            else:  # consumed 3 ms late, no wait
                e["end"] = s.end + 3_000_000
        events.append(e)
    assert waited >= 3
    rc = costs_from_trace(TraceModel(base.header, events))
    assert rc.link_latency_ns == pytest.approx(40_000)
    assert rc.costs.send_latency == pytest.approx(40_000)


def test_near_ties_are_said_to_be_ties() -> None:
    def cand(name: str, ms: float) -> Candidate:
        return Candidate(name, 8, 1, ms * 1e6, 0.1, 2, 1 << 20, True)

    tied = [cand("1F1B", 70.54), cand("GPipe", 71.0), cand("1F1B", 71.0), cand("ZBVZeroBubble", 80.0)]
    assert near_ties(tied) == [0, 1, 2]
    assert near_ties([cand("1F1B", 70.0), cand("GPipe", 70.0 * (1 + TIE) + 0.01)]) == [0]
    assert near_ties([]) == []
    text = format_tune(TuneResult(candidates=tuple(tied), skipped=(), recorded=None, measured_step_ns=0.0, memory_cap=None,
                                  activation_memory=0, activation_memory_is_proxy=False))
    assert "#1-#3 are predicted within 0.7% of each other" in text and "measure them" in text
    alone = format_tune(TuneResult(candidates=(cand("GPipe", 60.0), cand("1F1B", 70.0)), skipped=(), recorded=None,
                                   measured_step_ns=0.0, memory_cap=None, activation_memory=0,
                                   activation_memory_is_proxy=False))
    assert "of each other" not in alone


def test_a_tie_is_ranked_by_the_even_split_then_memory_and_a_clear_lead_by_speed() -> None:
    def cand(name: str, ms: float, live: int, *, searched: bool = False, fits: bool = True) -> Candidate:
        return Candidate(name, 8, 1, ms * 1e6, 0.1, live, live << 20, fits, (5, 3) if searched else (4, 4), searched)

    # the two GPU grids' case: the searched split predicted 1.9% ahead of the even ones (measured 12% behind)
    searched, gpipe, ofob = cand("1F1B", 72.69, 2, searched=True), cand("GPipe", 74.09, 8), cand("1F1B", 74.09, 2)
    far = cand("ZBVZeroBubble", 80.0, 1)
    ranked = rank_candidates([gpipe, far, searched, ofob])
    assert ranked == [ofob, gpipe, searched, far]  # even split first, then less memory; the 10% slower one stays last
    assert near_ties(ranked) == [0, 1, 2]
    # a searched split clearly ahead (beyond the tie) keeps first place
    ahead = cand("1F1B", 74.09 / (1 + TIE) - 0.5, 2, searched=True)
    assert rank_candidates([ofob, gpipe, ahead])[0] is ahead
    # a faster candidate over the memory cap never comes before one that fits
    over = cand("GPipe", 60.0, 8, fits=False)
    assert rank_candidates([over, gpipe, ofob]) == [ofob, gpipe, over]
    text = format_tune(TuneResult(candidates=tuple(ranked), skipped=(), recorded=None, measured_step_ns=0.0,
                                  memory_cap=None, activation_memory=0, activation_memory_is_proxy=False))
    assert "#1-#3 are predicted within 1.9% of each other" in text and "even layer split first" in text


def test_the_host_fit_is_the_best_non_negative_fit() -> None:
    # unconstrained, the fit of these rows puts a negative unit on the second class; dropping every negative part at
    # once (the old rule) then also lost the first class's and fitted a constant (residual 49.48); the best fit with
    # every part >= 0 keeps the first class's unit (residual 46.08)
    rows = [[1.0, 0.0], [0.0, 1.0], [3.0, 0.0], [2.0, 0.0]]
    ys = [8.22, 0.751, 3.155, 9.258]

    def residual(fixed: float, units: list[float]) -> float:
        return sum((fixed + sum(a * b for a, b in zip(r, units)) - y) ** 2 for r, y in zip(rows, ys))

    got = _nonneg_fit(rows, ys)
    assert got is not None
    fixed, units = got
    assert fixed >= 0 and min(units) >= 0
    assert residual(fixed, units) < residual(5.346, [0.0, 0.0]) - 3
    # no non-negative point of a grid around it does better
    grid = [i * 0.05 for i in range(0, 201)]
    assert all(residual(f, [u, 0.0]) >= residual(fixed, units) - 1e-6 for f in grid[::4] for u in grid[:60])
    assert all(residual(f, [u1, u2]) >= residual(fixed, units) - 1e-6 for f in grid[::8] for u1 in grid[:40:4] for u2 in grid[:40:4])
    # rows that cannot tell the fixed part from a unit: no fit
    assert _nonneg_fit([[1.0], [1.0], [1.0]], [2.0, 2.1, 1.9]) is None


def test_tune_grid_replay_predicts_a_saved_grid_again() -> None:
    # benchmarks/tune_grid.py --replay: a recorded GPU grid (profile traces + tune_grid.json) predicted again with the
    # tuner as it is now; the measurements stay, every prediction, error and the order are the current tuner's
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import tune_grid

    grid = Path(__file__).parents[1] / "benchmarks" / "results" / "tunegrid-sessionI" / "grid-a"
    recorded = json.loads((grid / "tune_grid.json").read_text())
    doc, summary = tune_grid.replay(str(grid))
    rows = doc["rows"]
    assert sorted(r["measured_ns"] for r in rows) == sorted(r["measured_ns"] for r in recorded["rows"])
    for r in rows:
        assert r["error"] == pytest.approx(r["step_ns"] / r["measured_ns"] - 1)
        assert len(r["host_busy_ns"]) == len(r["device_busy_ns"]) == 2
    cands = [Candidate(r["schedule"], r["microbatches"], r["stages_per_rank"], r["step_ns"], 0.0,
                       r["peak_live_microbatch_stages"], r["peak_activation_bytes"], True, tuple(r["split"]),
                       r["searched"]) for r in rows]
    assert [(c.schedule, c.microbatches, c.split) for c in rank_candidates(cands)] == \
        [(c.schedule, c.microbatches, c.split) for c in cands]  # the rows in the tuner's order: its pick first
    # the recorded tuner's pick (the grid's first row) and how far it measured from the best
    assert summary[0].startswith("recorded tuner: first pick 1F1B m=8 (5,3) +12.2% from the best measured")
    assert summary[1].startswith("current tuner: first pick ")
    assert "head to head" in summary[-1]
    table = tune_grid.format_grid(doc)
    assert "tuner's first pick" in table and len(table.splitlines()) > len(rows)
    # the recorded grid round by round: the searched split was the fastest row of round 1, 12.3% behind in round 2
    assert "recorded tuner's pick, round 1: fastest 1F1B m=8 (5,3) 57.01 ms; the pick 1F1B m=8 (5,3) 57.01 ms (+0.0%)" \
        in summary
    assert any(x.startswith("recorded tuner's pick, round 2: fastest 1F1B m=8 (4,4)") and x.endswith("(+12.3%)")
               for x in summary)
    assert any("head to head by block of 4 steps (ms): the pick 79.4 60.4 58.7 73.0 76.5 79.5;" in x for x in summary)


def test_tune_grid_by_round() -> None:
    # format_grid's rounds: each round's fastest row and the pick (the first row) against it; none where the steps
    # per round are unknown
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import tune_grid

    def row(schedule: str, split: list[int], times: list[float]) -> dict[str, Any]:
        return {"schedule": schedule, "microbatches": 8, "stages_per_rank": 1, "split": split,
                "times_ns": [t * 1e6 for t in times]}

    doc = {"rounds": 2, "rows": [row("1F1B", [6, 4], [50, 52, 80, 82]), row("GPipe", [5, 5], [60, 61, 60, 62])]}
    assert tune_grid._by_round(doc) == [
        "round 1: fastest 1F1B m=8 (5,3) 51.00 ms; the pick 1F1B m=8 (5,3) 51.00 ms (+0.0%)",
        "round 2: fastest GPipe m=8 (4,4) 61.00 ms; the pick 1F1B m=8 (5,3) 81.00 ms (+32.8%)"]
    doc["rounds"] = 3  # 4 steps cannot be 3 rounds
    assert tune_grid._by_round(doc) == []


def test_tune_grid_also_split_adds_a_split_to_every_matching_configuration() -> None:
    # tune_grid.py --also-split: a given split measured beside the tuner's candidates, predicted by the same model
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import argparse

    import tune_grid

    grid = Path(__file__).parents[1] / "benchmarks" / "results" / "tunegrid-sessionI" / "grid-a"
    run = tune_grid.profile_costs({"host": str(grid / "profile_host.jsonl"), "host_iw": str(grid / "profile_iw_host.jsonl")},
                                  events=True)
    args = argparse.Namespace()
    args.layers, args.hidden, args.heads, args.batch, args.seq, args.vocab = tune_grid.SIZES["s"]
    layers = Layers(tuple(tune_grid.layer_weights(args)), tune_grid._units([2, 1, 3, 2]), ends=(1, 1))
    res = tune(run, schedules=["1F1B", "Interleaved1F1B"], microbatches=[8], stages_per_rank=None,
               measured_step_ns=155e6, layers=layers, device_model="lanes")
    out = tune_grid._with_splits(res, run, layers, 2, [[3, 5]])
    added = [c for c in out if c.split == (4, 6)]
    assert [(c.schedule, c.searched) for c in added] == [("1F1B", True)]  # (Interleaved1F1B has 4 stages)
    assert len(out) == len(res.candidates) + 1 and added[0].step_ns > 0
    assert out == rank_candidates(out)
    assert tune_grid._with_splits(res, run, layers, 2, None) == list(res.candidates)


def test_tuner_predicts_the_runtimes_overlapped_backwards() -> None:
    """GPU profiles: the candidates are simulated with the runtime's default host_overlap_backward (auto): on a
    host-bound profile every B followed by an F is launched beside it, the step is shorter than inline, and the
    ranking says so per candidate; off, the inline launch as before."""
    from pipeloom.tools.schedule_tune import _simulate

    run = _host_bound(head=0.5)
    auto = _simulate(run, "1F1B", 2, 1, 8, layers=UNEVEN, split=(5, 5))[1]
    off = _simulate(run, "1F1B", 2, 1, 8, layers=UNEVEN, split=(5, 5), overlap_backward=False)[1]
    assert auto.makespan < off.makespan * 0.9 and sum(auto.overlapped_backwards.values()) == 13  # 16 B, 3 not before an F
    kw = {"schedules": ["1F1B", "Interleaved1F1B"], "microbatches": [8], "stages_per_rank": None, "layers": UNEVEN,
          "calibrate": False}
    r = tune(run, **kw)
    assert r.overlap_backward == "auto"
    c = next(c for c in r.candidates if c.schedule == "1F1B")
    assert (c.overlapped_backwards, c.backwards) == (13, 16) and c.step_ns == pytest.approx(auto.makespan)
    text = format_tune(r)
    assert "B beside F" in text and "13/16" in text and "auto rule launches them" in text
    r_off = tune(run, overlap_backward=False, **kw)
    assert all(c.overlapped_backwards == 0 for c in r_off.candidates) and "launched inline" in format_tune(r_off)
    assert r.to_json()["candidates"][0]["backwards"] > 0
    # CPU profiles (no host side): one lane, nothing launched beside
    cpu = tune(replace(run, host=None), schedules=["1F1B"], microbatches=[8], stages_per_rank=[1], calibrate=False)
    assert cpu.overlap_backward is None and "B beside F" not in format_tune(cpu)
    with pytest.raises(ValueError, match="overlap_backward must be"):
        tune(run, overlap_backward="yes", **kw)


def _gpu_trace(options: dict[str, Any] | None, actions: list[tuple[int, str, int, int, int, int, bool]],
               sizes: dict[int, int]) -> Any:
    """A one-rank GPU trace by hand: ``actions`` (step, type, microbatch, start, end, device ns, beside) of stage 0,
    each step's microbatch size (a forward send of that many bytes)."""
    from pipeloom.tools.trace_model import TraceModel

    header = {"format": "pipeloom-trace", "version": 1, "world_size": 1, "schedule": "1F1B", "num_microbatches": 2,
              "stage_to_rank": [0], "source": "run", **({"options": options} if options is not None else {})}
    events: list[dict[str, Any]] = []
    for st, t, mb, start, end, ns, beside in actions:
        name = f"0{t}{mb}"
        events.append({"ev": "action", "rank": 0, "step": st, "name": name, "type": t, "stage": 0, "mb": mb,
                       "start": start, "end": end, **({"beside": True} if beside else {})})
        events.append({"ev": "device", "rank": 0, "step": st, "name": name, "type": t, "stage": 0, "mb": mb,
                       "t": start, "ns": ns})
    for st, b in sizes.items():
        events.append({"ev": "send", "rank": 0, "step": st, "peer": 0, "stage": 1, "mb": 0, "kind": "F", "seq": st,
                       "bytes": b, "start": st * 100_000 + 1, "end": st * 100_000 + 2})
    return TraceModel(header, events)


def _gpu_run(compute: dict[tuple[int, str], float], ref: int, *, device: bool, steps: list[int]) -> RunCosts:
    return RunCosts(costs=Costs(), action_costs={(s, t, None): c + 7.0 for (s, t), c in compute.items()},
                    compute_ns=dict(compute), overhead_per_action_ns={0: 7.0}, schedule="1F1B", num_microbatches=2,
                    world_size=1, stage_to_rank=[0], steps=steps, step_ns=0.0, runtime_per_action_ns={0: 7.0},
                    compute_fit={k: (c / 2, c / 2 / ref) for k, c in compute.items()}, ref_bytes=ref,
                    sizes_fitted=True, device_measured=device)


def test_device_times_as_the_runtime_learns_them() -> None:
    """A GPU trace's device side as the runtime learns it (``learned_device_costs``): each stage and type's least
    CUDA-event time per microbatch size (compute alone: a slept learning step's), not the mean (a host-bound rank's
    pace); a backward launched beside a forward left out (its stream ran the forward's kernels too); fitted through
    two sizes where the smaller one's least is compute (below the reference's, at least proportional), elsewhere
    the median fixed share of those fits; a trace whose runtime did not sleep its learning steps unchanged."""
    from pipeloom.tools.schedule_tune import learned_device_costs, learned_sleeps

    # steps 0-1 full size (1000 bytes; the learning steps: the first launch slept), 2 full, 3 half (500 bytes)
    acts = [(0, "F", 0, 0, 90, 300, False), (0, "F", 1, 100, 190, 900, False),
            (0, "B", 0, 200, 390, 600, False), (0, "B", 1, 400, 590, 1900, False),
            (1, "F", 0, 100_000, 100_090, 310, False), (1, "B", 0, 100_200, 100_390, 620, False),
            (2, "F", 0, 200_000, 200_090, 880, False), (2, "B", 0, 200_100, 200_290, 400, True),  # beside: left out
            (2, "B", 1, 200_300, 200_490, 1800, False),
            (3, "F", 0, 300_000, 300_090, 200, False), (3, "B", 0, 300_200, 300_390, 1500, False)]
    sizes = {0: 1000, 1: 1000, 2: 1000, 3: 500}
    run = _gpu_run({(0, "F"): 700.0, (0, "B"): 1300.0}, 1000, device=True, steps=[1, 2, 3])
    model = _gpu_trace({"gpu_commit_ms": 10.0, "device": "cuda"}, acts, sizes)
    assert learned_sleeps(model)
    got = learned_device_costs(model, run)
    assert got.compute_ns == {(0, "F"): 300.0, (0, "B"): 600.0}  # the least at the reference size; the beside B's 400 not
    # F: through (500 bytes, 200) and (1000, 300): 100 fixed + 0.2 per byte (a fixed share of 1/3)
    assert got.compute_fit[(0, "F")] == pytest.approx((100.0, 0.2))
    # B: its half-size least (1500) is the host's pace, above its reference least: F's fixed share of its 600
    assert got.compute_fit[(0, "B")] == pytest.approx((200.0, 0.4))
    assert got.action_costs[(0, "F", None)] == pytest.approx(307.0)  # (the runtime's time per action kept)
    # a trace without the run's options (recorded before the learning sleeps), or with them off: as it was
    for opts in (None, {"device": "cuda", "gpu_learn_sleep": False}):
        old = _gpu_trace(opts, acts, sizes)
        assert not learned_sleeps(old) and learned_device_costs(old, run) is run
    assert learned_device_costs(model, replace(run, device_measured=False)).compute_ns == run.compute_ns  # spans: as is


def test_host_forwards_as_launched_alone() -> None:
    """``alone_host_costs``: a forward's host span that a backward launched beside it (``host_overlap_backward``)
    overlaps holds both lanes' contention, which the two-lane model adds itself: a stage's forwards cost what the
    ones launched alone took, per size; nothing launched beside: unchanged."""
    from pipeloom.tools.schedule_tune import alone_host_costs

    # full size (1000 bytes) steps 1-2, half size step 3; the forwards 1F during a beside B take 140 instead of 100
    acts = [(1, "F", 0, 100_000, 100_100, 0, False), (1, "B", 0, 100_200, 100_500, 0, True),
            (1, "F", 1, 100_250, 100_390, 0, False),
            (2, "F", 0, 200_000, 200_100, 0, False), (2, "B", 0, 200_200, 200_500, 0, True),
            (2, "F", 1, 200_250, 200_390, 0, False),
            (3, "F", 0, 300_000, 300_060, 0, False), (3, "B", 0, 300_200, 300_500, 0, True),
            (3, "F", 1, 300_250, 300_334, 0, False)]
    sizes = {1: 1000, 2: 1000, 3: 500}
    run = _gpu_run({(0, "F"): 120.0, (0, "B"): 300.0}, 1000, device=False, steps=[1, 2, 3])
    got = alone_host_costs(_gpu_trace({"device": "cuda"}, acts, sizes), run)
    assert got.compute_ns[(0, "F")] == pytest.approx(100.0) and got.compute_ns[(0, "B")] == 300.0
    assert got.compute_fit[(0, "F")] == pytest.approx((20.0, 0.08))  # 60 at 500 bytes, 100 at 1000
    assert got.action_costs[(0, "F", None)] == pytest.approx(107.0)
    inline = [(st, t, mb, a, b, ns, False) for st, t, mb, a, b, ns, _ in acts]
    assert alone_host_costs(_gpu_trace({"device": "cuda"}, inline, sizes), run) is run


def test_session_l_profile_as_the_runtime_ran_it() -> None:
    """The recorded GPU profile of session L (2 x H200, GPT size s, Interleaved1F1B m=16, the runtime launching
    backwards beside forwards): read as the runtime learns it, the tuner launches most of the profile's own
    backwards beside a forward, as the run did (27 and 29 of 32 per rank and step), where the means' host-paced
    device times kept (nearly) every one inline; the trace of a runtime without learning sleeps (session I) is read as
    before.  And the reconstructed grid replays (its profile section lacks fields a run writes)."""
    import sys

    from pipeloom.tools.run_costs import costs_from_trace
    from pipeloom.tools.schedule_tune import _simulate, gpu_profile_costs, learned_device_costs

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import tune_grid

    results = Path(__file__).parents[1] / "benchmarks" / "results"
    model = load_trace(str(results / "tunegrid-sessionL" / "profile_host.jsonl"))
    mean = with_host_costs(costs_from_trace(model, typical=True, device=True), costs_from_trace(model, typical=True))
    learned = gpu_profile_costs(model)
    assert learned.compute_ns[(2, "F")] < 0.6e6 < 1.5e6 < mean.compute_ns[(2, "F")]  # 3 blocks: 0.53 ms slept
    assert learned.compute_ns[(2, "B")] < 1.5e6 < 3e6 < mean.compute_ns[(2, "B")]
    assert learned.host is not None and mean.host is not None
    assert learned.host.compute_ns[(2, "F")] < 0.85 * mean.host.compute_ns[(2, "F")]  # alone, not beside a B
    layers = Layers(tuple(tune_grid.layer_weights(_size_s())), (3, 1, 3, 3), ends=(1, 1))
    kw: dict[str, Any] = {"layers": layers, "split": (3, 1, 3, 3)}
    before = _simulate(mean, "Interleaved1F1B", 2, 2, 16, **kw)[1].overlapped_backwards
    now = _simulate(learned, "Interleaved1F1B", 2, 2, 16, **kw)[1].overlapped_backwards
    assert sum(before.values()) < 10 and all(n >= 20 for n in now.values())  # of 32 per rank
    old = load_trace(str(results / "tunegrid-sessionI" / "grid-a" / "profile_host.jsonl"))
    dev = costs_from_trace(old, typical=True, device=True)
    assert learned_device_costs(old, dev) is dev
    doc, summary = tune_grid.replay(str(results / "tunegrid-sessionL"))
    assert "tuner's first pick" in tune_grid.format_grid(doc)
    assert summary[0].startswith("recorded tuner: first pick DualPipeV m=8 (1,3,2,2) +22.8%")
    assert max(abs(r["error"]) for r in doc["rows"]) < 0.2 and doc["rows"][0]["schedule"] == "1F1B"


def _size_s() -> Any:
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import tune_grid

    a = argparse.Namespace()
    a.layers, a.hidden, a.heads, a.batch, a.seq, a.vocab = tune_grid.SIZES["s"]
    return a


def test_tune_grid_replay_with_the_recorded_overlap_decisions(tmp_path: Path) -> None:
    """A grid that recorded each row's host_overlap_backward decisions per rank (``overlap_decided_by_rank``,
    since session M) is also replayed with them (``_simulate(overlap_pairs=...)``): the share of a row's error
    that is the runtime's decision rather than the costs.  On session M's bound grid (rows edited to carry
    decisions): every backward inline and every one beside predict differently on a host-bound row, and the
    recorded decisions are what the prediction follows."""
    import shutil
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import tune_grid

    src = Path(__file__).parents[1] / "benchmarks" / "results" / "tunegrid-sessionM" / "grid-pin"
    steps = {}
    for beside in (False, True):
        grid = tmp_path / f"beside{int(beside)}"
        shutil.copytree(src, grid)
        doc = json.loads((grid / "tune_grid.json").read_text())
        for r in doc["rows"]:
            if r["schedule"] == "1F1B":  # one stage per rank: the pair (s, s) on rank s
                r["overlap_decided_by_rank"] = [{f"{s}>{s}": beside} for s in range(2)]
        (grid / "tune_grid.json").write_text(json.dumps(doc))
        new, summary = tune_grid.replay(str(grid))
        rows = [r for r in new["rows"] if r["schedule"] == "1F1B"]
        assert rows and all("step_ns_as_decided" in r for r in rows)
        assert all("step_ns_as_decided" not in r for r in new["rows"] if r["schedule"] != "1F1B")
        for r in rows:
            assert r["error_as_decided"] == pytest.approx(r["step_ns_as_decided"] / r["measured_ns"] - 1)
        assert any(x.startswith(f"current tuner with each row's recorded overlap decisions ({len(rows)} rows)")
                   for x in summary)
        steps[beside] = {(r["microbatches"], tuple(r["split"])): r["step_ns_as_decided"] for r in rows}
    # host-bound (GPT size s): the backwards beside the forwards shorten every 1F1B row
    assert all(steps[True][k] < steps[False][k] for k in steps[True]), steps
