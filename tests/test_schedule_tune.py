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
from pathlib import Path

import pytest

from ranks.harness import launch_script

from pipeloom.schedules import Costs, generate, lower, simulate
from pipeloom.tools.cli import main
from pipeloom.tools.run_costs import RunCosts, _affine, costs_from_trace
from pipeloom.tools.schedule_tune import Layers, _action_costs, calibration, search_split, stage_compute, tune
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
    assert rc.link_latency_ns > 0 and not rc.overlap_measured
    # the tuner's own configuration, calibrated, is the measured median; without calibration it is the model's
    r = tune(rc, schedules=["1F1B", "DualPipeV"], microbatches=[2, 4, 8], stages_per_rank=None)
    assert r.recorded is not None and r.recorded.step_ns == pytest.approx(rc.step_ns_median)
    assert r.calibration == pytest.approx(calibration(rc)) and r.sizes_fitted
    raw = tune(rc, schedules=["1F1B"], microbatches=[4], stages_per_rank=[1], calibrate=False)
    assert raw.calibration == 1.0 and raw.candidates[0].step_ns * r.calibration == pytest.approx(r.recorded.step_ns)
    assert {(c.schedule, c.stages_per_rank) for c in r.candidates} == {("1F1B", 1), ("DualPipeV", 2)}


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
