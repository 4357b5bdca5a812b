"""How well does the simulator, fed with a run's own measured costs, predict that run's step time?

For every named schedule, two gloo ranks train the same MLP (4 blocks
``--dim`` wide, cut into 2 x stages-per-rank stages; ``--batch`` rows split
into ``--microbatches`` microbatches) for
``--steps`` steps with tracing on; then, for each trace,

    costs  = pipeloom.tools.run_costs.costs_from_trace(trace)      (the first --skip-warmup steps left out)
    sim    = simulate(lowered schedule, costs, action_costs=...)   (what `schedule simulate --costs-from` does)
    error  = (sim.makespan - measured mean step time) / measured   (the median beside it)
    typical = the same from the typical steps' costs (at most the median step
             of their size: costs_from_trace(typical=True), what the tuner
             uses), against the measured median step
    drawn  = the mean of --samples simulations whose every action's cost is drawn
             from its type's recorded dispersion (what the tuner does on CPU
             profiles: schedule_tune.SAMPLES), typical steps, against the median

and the table lists measured, simulated and the error per schedule.  This is
the validation behind ``pipeloom schedule tune``: a tuner is only as good as
its simulator's step times.

Usage::

    python benchmarks/sim_accuracy.py [--steps 12] [--dim 256] [--batch 128] [--microbatches 8] [--out DIR] [--names 1F1B,GPipe]

(it starts its own 2 ranks through ``pipeloom launch``; ``--analyze DIR``
only re-reads traces written before).  Numbers depend on the machine's load:
the CPU machine this was written on is shared, so run it a few times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LAYERS = 4
"""Blocks (Linear, GELU, Linear) of the model, cut into 2 x stages-per-rank stages."""
NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import pipeloom

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from pipeloom.schedules import default_stages_per_rank

    for name in args.names.split(","):
        torch.manual_seed(0)
        # one model of LAYERS blocks, cut into as many stages as the schedule runs
        blocks = [nn.Sequential(nn.Linear(args.dim, args.dim), nn.GELU(), nn.Linear(args.dim, args.dim)) for _ in range(LAYERS)]
        v = args.stages_per_rank or default_stages_per_rank(name)
        n = 2 * v
        per = LAYERS // n
        stages = [nn.Sequential(*blocks[s * per:(s + 1) * per]) for s in range(n)]
        pipe = pipeloom.Pipeline(lambda s: stages[s], schedule=name, num_microbatches=args.microbatches,
                                 stages_per_rank=v, loss_fn=nn.functional.mse_loss,
                                 trace=os.path.join(args.out, f"{name}{args.tag}.jsonl"))
        x = torch.randn(args.batch, args.dim)
        y = torch.randn(args.batch, args.dim)
        for _ in range(args.steps):
            pipe.step(x, target=y)
        pipe.close()
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def analyze(out: str, names: list[str], tag: str = "", samples: int = 15, skip_warmup: int = 2) -> list[dict[str, object]]:
    from pipeloom.schedules import generate, lower, simulate
    from pipeloom.tools.run_costs import costs_from_trace
    from pipeloom.tools.schedule_tune import sampled_runs
    from pipeloom.tools.trace_model import load_trace

    rows = []
    for name in names:
        model = load_trace(os.path.join(out, f"{name}{tag}.jsonl"))
        rc = costs_from_trace(model, skip_warmup=skip_warmup)
        sched = lower(generate(name, num_ranks=rc.world_size, num_microbatches=rc.num_microbatches or 1,
                               stages_per_rank=rc.stages_per_rank), comms=True, recv_placement="early", costs=rc.costs)
        sim = simulate(sched, rc.costs, action_costs=rc.action_costs)
        err = (sim.makespan - rc.step_ns) / rc.step_ns
        # what the tuner does: costs of the typical steps (at most the median step: a step that a neighbour's
        # burst slowed by 100 ms would otherwise add its share to every action of the type), the simulation
        # of their means and the mean of simulations with every action's cost drawn from its type's recorded
        # dispersion (schedule_tune.SAMPLES), against the median step
        ty = costs_from_trace(model, skip_warmup=skip_warmup, typical=True)
        tsim = simulate(sched, ty.costs, action_costs=ty.action_costs).makespan
        drawn = [r.makespan for r in sampled_runs(sched, ty.costs, dict(ty.action_costs), ty.dispersion,
                                                  ty.num_microbatches or 1, samples, seed=name)] if samples > 1 else []
        d = statistics.mean(drawn) if drawn else float("nan")
        med = rc.step_ns_median
        rows.append({"schedule": name, "measured_ms": rc.step_ns / 1e6, "simulated_ms": sim.makespan / 1e6, "error": err,
                     "measured_median_ms": med / 1e6, "typical_ms": tsim / 1e6, "typical_error": (tsim - med) / med,
                     "drawn_ms": d / 1e6, "drawn_error": (d - med) / med, "steps": len(rc.steps)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=128, help="rows per step (split into the microbatches)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--stages-per-rank", type=int, default=None, help="default: the schedule's")
    p.add_argument("--tag", default="", help="suffix of the trace file names")
    p.add_argument("--names", default=",".join(NAMES))
    p.add_argument("--out", default=None)
    p.add_argument("--analyze", metavar="DIR", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--skip-warmup", type=int, default=2,
                   help="steps left out of costs and step times (default 2: the first step of a layout carries transfer "
                        "headers, the next is the first without; a process's first pipeline may pay one-time costs there)")
    p.add_argument("--samples", type=int, default=15, help="simulations with drawn action costs (mean shown beside the "
                   "simulation of the means; 0: none)")
    args = p.parse_args()
    if "RANK" in os.environ:
        _rank_main(args)
        return
    names = args.names.split(",")
    out = args.analyze
    if out is None:
        out = args.out or tempfile.mkdtemp(prefix="pipeloom-sim-")
        os.makedirs(out, exist_ok=True)
        cmd = [sys.executable, "-m", "pipeloom.tools.cli", "launch", "--nproc-per-node", "2", str(Path(__file__).resolve()),
               "--steps", str(args.steps), "--dim", str(args.dim), "--batch", str(args.batch),
               "--microbatches", str(args.microbatches), "--names", args.names, "--out", out, f"--tag={args.tag}"]
        if args.stages_per_rank:
            cmd += ["--stages-per-rank", str(args.stages_per_rank)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELOOM_")}
        subprocess.run(cmd, check=True, env=env)
    rows = analyze(out, names, args.tag, args.samples, args.skip_warmup)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"traces in {out}")
    print(f"{'':<22} {'all steps: mean costs vs mean step':>38} | {'typical steps (the tuner): vs median step':>54}")
    print(f"{'schedule':<22} {'measured':>10} {'simulated':>10} {'error':>7}  | {'median':>10} {'simulated':>10} {'error':>7} "
          f"{'drawn':>10} {'error':>7}")
    for r in rows:
        print(f"{r['schedule']:<22} {r['measured_ms']:>8.3f}ms {r['simulated_ms']:>8.3f}ms {r['error']:>+7.1%}  | "
              f"{r['measured_median_ms']:>8.3f}ms {r['typical_ms']:>8.3f}ms {r['typical_error']:>+7.1%} "
              f"{r['drawn_ms']:>8.3f}ms {r['drawn_error']:>+7.1%}")
    for key, label in (("error", "all steps, mean costs"), ("typical_error", "typical steps, mean costs"),
                       ("drawn_error", "typical steps, drawn costs")):
        errs = [abs(float(r[key])) for r in rows]  # type: ignore[arg-type]
        print(f"{label}: largest error {max(errs):.1%}, median {statistics.median(errs):.1%}, "
              f"{sum(e <= 0.10 for e in errs)} of {len(errs)} within 10%")


if __name__ == "__main__":
    main()
