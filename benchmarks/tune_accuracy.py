"""Does ``pipeloom schedule tune`` predict the step time of configurations it never saw run?

A tuner is only as good as its step times *across* configurations: the
simulator fed with a run's own costs follows that run (``sim_accuracy.py``),
but the tuner carries one run's costs to other schedules, microbatch counts
and stages per rank.  This benchmark checks exactly that, on two gloo ranks:

1. a **profiling run** (``--profile``, default 1F1B with 8 microbatches),
   traced, stays alive all round: first ``--profile-steps`` steps of each of
   the full and the half batch (the tuner separates each action's fixed cost
   from its per-row cost), then a full and a half step around every step of
   every configuration below;
2. a **grid** of configurations (every named schedule at its default stages
   per rank x ``--microbatches``), each built afresh in every one of
   ``--rounds`` rounds (order alternating), one warm-up step, then
   ``--steps`` steps, each *paired* with the profile's full step just before
   it (a barrier before every step, so that a step window holds that step's
   work only);
3. :func:`pipeloom.tools.schedule_tune.tune` ranks the grid from each
   round's profile alone; per configuration the table lists the measured
   step time (median of its steps) against the tuner's prediction (median
   over the rounds), and -- the comparison this machine allows -- the
   measured *ratio* to the profiled configuration (median over the adjacent
   pairs) against the predicted ratio: a shared machine whose speed drifts by
   a factor of 2 within minutes moves both steps of a pair alike.  Also the
   in-sample error (the configuration simulated with its own trace's costs,
   what the simulator can do at best) and the tuner's ranking against the
   measured one.

The model: ``--layers`` blocks (Linear, GELU, Linear) ``--dim`` wide, cut into
2 x stages-per-rank stages of equal layer counts; ``--batch`` rows per step.

Usage::

    python benchmarks/tune_accuracy.py [--rounds 3] [--steps 4] [--microbatches 4,8,16] [--out DIR] [--json]
    python benchmarks/tune_accuracy.py --analyze DIR     # re-read the traces of an earlier run

(it starts its own 2 ranks through ``pipeloom launch``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def _grid(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(schedule, microbatches, stages per rank) of every configuration the schedules accept on 2 ranks."""
    from pipeloom.schedules import ScheduleError, default_stages_per_rank, generate

    out = []
    for name in args.names.split(","):
        v = default_stages_per_rank(name)
        for m in (int(x) for x in args.microbatches.split(",")):
            try:
                generate(name, num_ranks=2, num_microbatches=m, stages_per_rank=v)
            except ScheduleError:
                continue
            out.append((name, m, v))
    return out


def _profile_config(args: argparse.Namespace) -> tuple[str, int, int]:
    from pipeloom.schedules import default_stages_per_rank

    name, _, rest = args.profile.partition(":")
    m = rest.partition(":")[0]
    return name, int(m or 8), default_stages_per_rank(name)


def _profile_split(args: argparse.Namespace) -> tuple[int, ...] | None:
    """Blocks per stage of the profile (``--profile NAME:M:B1,B2``); None: the even split."""
    parts = args.profile.split(":")
    if len(parts) < 3 or not parts[2]:
        return None
    split = tuple(int(b) for b in parts[2].split(","))
    name, _, v = _profile_config(args)
    if len(split) != 2 * v or sum(split) != args.layers or min(split) < 1:
        raise SystemExit(f"--profile {args.profile}: {name} has {2 * v} stages; give each at least one of the {args.layers} blocks")
    return split


def config_tag(name: str, m: int, v: int) -> str:
    return f"{name}-m{m}-v{v}"


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import pipeloom

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.dim, generator=g)
    y = torch.randn(args.batch, args.dim, generator=g)

    def build(name: str, m: int, v: int, path: str, split: tuple[int, ...] | None = None) -> Any:
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(args.dim, args.dim), nn.GELU(), nn.Linear(args.dim, args.dim))
                  for _ in range(args.layers)]
        n = 2 * v
        counts = split or (args.layers // n,) * n
        starts = [sum(counts[:s]) for s in range(n)]
        stages = [nn.Sequential(*blocks[starts[s]:starts[s] + counts[s]]) for s in range(n)]
        return pipeloom.Pipeline(lambda s: stages[s], schedule=name, num_microbatches=m, stages_per_rank=v,
                                 loss_fn=nn.functional.mse_loss, trace=path)

    pname, pm, pv = _profile_config(args)
    grid = _grid(args)
    pairs: dict[str, list[int]] = {}
    for r in range(args.rounds):
        # The profile, alive all round: first steps alternating the full and half batch (fixed and per-row
        # costs told apart), then a full and a half step around each step of every configuration (pairs).
        prof = build(pname, pm, pv, os.path.join(args.out, f"profile.r{r}.jsonl"), _profile_split(args))
        pstep = 0
        for i in range(1 + 2 * args.profile_steps):
            d = 1 if i % 2 == 0 else 2
            dist.barrier()  # every rank done with the last step: step windows hold one step's work only
            prof.step(x[: args.batch // d], target=y[: args.batch // d])
            pstep += 1
        order = grid if r % 2 == 0 else grid[::-1]
        for name, m, v in order:
            tag = config_tag(name, m, v)
            if rank == 0:
                print(f"round {r}: {tag}", flush=True)
            pipe = build(name, m, v, os.path.join(args.out, f"{tag}.r{r}.jsonl"))
            pipe.step(x, target=y)  # warm-up
            for _ in range(args.steps):
                dist.barrier()
                prof.step(x, target=y)
                pairs.setdefault(f"{tag}.r{r}", []).append(pstep)
                pstep += 1
                dist.barrier()
                pipe.step(x, target=y)
                # and a half-batch step of the profile beside every pair, so that its two sizes are measured
                # under the same load (the fit of fixed vs per-row costs is a difference of the two)
                dist.barrier()
                prof.step(x[: args.batch // 2], target=y[: args.batch // 2])
                pstep += 1
            pipe.close()
            dist.barrier()
        prof.close()
        dist.barrier()
    if rank == 0:
        with open(os.path.join(args.out, "pairs.json"), "w") as f:
            json.dump(pairs, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _rank_order(values: list[float]) -> list[int]:
    """1-based rank of each value (1 = smallest)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    for k, i in enumerate(order, 1):
        ranks[i] = k
    return ranks


def _exists(path: str) -> bool:
    return os.path.exists(path) or os.path.exists(path + ".rank0")


def analyze(out: str, args: argparse.Namespace) -> dict[str, object]:
    from pipeloom.schedules import generate, lower, simulate
    from pipeloom.tools.run_costs import costs_from_trace
    from pipeloom.tools.schedule_tune import SAMPLES, Layers, tune
    from pipeloom.tools.trace_model import load_trace, summarize

    grid = _grid(args)
    with open(os.path.join(out, "pairs.json")) as f:
        pairs: dict[str, list[int]] = json.load(f)
    rounds = [r for r in range(args.rounds) if _exists(os.path.join(out, f"profile.r{r}.jsonl"))]
    pred: dict[tuple[tuple[str, int, int], int], float] = {}
    pred_ratio: dict[tuple[tuple[str, int, int], int], float] = {}
    prof_steps: dict[int, dict[int, int]] = {}
    profiles = []
    hosts: list[dict[str, float]] = []
    for r in rounds:
        model = load_trace(os.path.join(out, f"profile.r{r}.jsonl"))
        prof_steps[r] = dict(model.windows and summarize(model, critical=False).step_times_ns)
        profile = costs_from_trace(model, typical=args.costs == "typical")
        profiles.append(profile)
        split = _profile_split(args)
        # with an uneven profile, the tuner knows the blocks (equal weights): it can tell each action's fixed
        # time from its blocks' (schedule_tune.host_split); the grid's stages hold equal block counts (even split)
        layers = Layers((1.0,) * args.layers, split) if split is not None else None
        result = tune(profile, schedules=sorted({g[0] for g in grid}), microbatches=sorted({g[1] for g in grid}),
                      stages_per_rank=sorted({g[2] for g in grid}), layers=layers,
                      samples=SAMPLES if args.samples is None else args.samples)
        hosts.append(result.host_fixed_ns or {})
        own = result.recorded.step_ns if result.recorded is not None else profile.step_ns
        for c in result.candidates:
            key = (c.schedule, c.microbatches, c.stages_per_rank)
            pred[(key, r)] = c.step_ns
            pred_ratio[(key, r)] = c.step_ns / own
    rows = []
    for cfg in grid:
        name, m, v = cfg
        steps: list[float] = []
        ratios: list[float] = []
        insample: list[float] = []
        preds: list[float] = []
        pratios: list[float] = []
        for r in rounds:
            path = os.path.join(out, f"{config_tag(*cfg)}.r{r}.jsonl")
            if not _exists(path) or (cfg, r) not in pred:
                continue
            model = load_trace(path)
            times = summarize(model, skip_warmup=1, critical=False).step_times_ns
            mine = [float(times[k]) for k in sorted(times)]
            steps += mine
            for t, ps in zip(mine, pairs.get(f"{config_tag(*cfg)}.r{r}", [])):
                if ps in prof_steps[r]:
                    ratios.append(t / prof_steps[r][ps])
            preds.append(pred[(cfg, r)])
            pratios.append(pred_ratio[(cfg, r)])
            rc = costs_from_trace(model)
            low = lower(generate(name, num_ranks=2, num_microbatches=m, stages_per_rank=v), comms=True,
                        recv_placement="early", costs=rc.costs)
            insample.append(simulate(low, rc.costs, action_costs=rc.action_costs).makespan / rc.step_ns)
        if not steps or not preds:
            continue
        meas, p = statistics.median(steps), statistics.median(preds)
        mratio, pratio = statistics.median(ratios) if ratios else float("nan"), statistics.median(pratios)
        rows.append({"schedule": name, "microbatches": m, "stages_per_rank": v, "measured_ms": meas / 1e6,
                     "predicted_ms": p / 1e6, "error": (p - meas) / meas,
                     "measured_ratio": mratio, "predicted_ratio": pratio, "paired_error": pratio / mratio - 1,
                     "insample_error": statistics.median(insample) - 1 if insample else None,
                     "steps": len(steps), "spread": (min(steps) / meas - 1, max(steps) / meas - 1)})
    mr = _rank_order([float(r["measured_ratio"]) for r in rows])  # type: ignore[arg-type]
    pr = _rank_order([float(r["predicted_ratio"]) for r in rows])  # type: ignore[arg-type]
    for r, a, b in zip(rows, mr, pr):
        r["measured_rank"], r["predicted_rank"] = a, b
    return {"profile": {"schedule": profiles[0].schedule, "microbatches": profiles[0].num_microbatches,
                        "step_ms": statistics.median(p.step_ns_median for p in profiles) / 1e6, "rounds": len(profiles),
                        "sizes_fitted": all(p.sizes_fitted for p in profiles),
                        "host_fixed_ms": {t: statistics.median(h[t] for h in hosts if t in h) / 1e6
                                          for t in sorted({t for h in hosts for t in h})}},
            "rows": rows}


def format_table(res: dict[str, object]) -> str:
    rows: list[dict[str, object]] = res["rows"]  # type: ignore[assignment]
    prof = res["profile"]
    lines = [f"profile: {prof['schedule']} m={prof['microbatches']}, {prof['rounds']} rounds, step "  # type: ignore[index]
             f"{prof['step_ms']:.2f} ms (median of the rounds' medians); fixed time per action: "  # type: ignore[index]
             + (", ".join(f"{t} {v:.3f} ms" for t, v in prof["host_fixed_ms"].items())  # type: ignore[index]
                if prof.get("host_fixed_ms") else "not separated (a CPU profile: see schedule_tune.fixed_per_action)"),  # type: ignore[attr-defined]
             "columns: measured = median step; predicted = the tuner's (median over the rounds' profiles); "
             "ratio = step / the profiled configuration's step (measured: median of the adjacent pairs)",
             f"{'schedule':<22} {'m':>3} {'v':>2} {'measured':>10} {'predicted':>10} {'error':>7} "
             f"{'ratio meas':>10} {'ratio pred':>10} {'paired err':>10} {'in-sample':>9} {'rank meas/pred':>14} {'spread':>14}"]
    for r in rows:
        ins = f"{r['insample_error']:+.1%}" if r["insample_error"] is not None else "-"
        lo, hi = r["spread"]  # type: ignore[misc]
        lines.append(f"{r['schedule']:<22} {r['microbatches']:>3} {r['stages_per_rank']:>2} {r['measured_ms']:>8.2f}ms "
                     f"{r['predicted_ms']:>8.2f}ms {r['error']:>+7.1%} {r['measured_ratio']:>10.3f} {r['predicted_ratio']:>10.3f} "
                     f"{r['paired_error']:>+10.1%} {ins:>9} {r['measured_rank']!s:>6}/{r['predicted_rank']!s:<7} "
                     f"{lo:+.0%}..{hi:+.0%}")
    for key, label in (("error", "absolute"), ("paired_error", "paired")):
        errs = [abs(float(r[key])) for r in rows]  # type: ignore[arg-type]
        lines.append(f"{label}: largest error {max(errs):.1%}, median {statistics.median(errs):.1%}; "
                     f"{sum(e <= 0.10 for e in errs)} of {len(errs)} within 10%")
    pick = min(rows, key=lambda r: float(r["predicted_ratio"]))  # type: ignore[arg-type]
    best = min(rows, key=lambda r: float(r["measured_ratio"]))  # type: ignore[arg-type]
    lines.append(f"tuner's pick {pick['schedule']} m={pick['microbatches']}: measured ratio {pick['measured_ratio']:.3f}; "
                 f"best measured {best['schedule']} m={best['microbatches']} {best['measured_ratio']:.3f} "
                 f"({float(pick['measured_ratio']) / float(best['measured_ratio']) - 1:+.1%})")  # type: ignore[arg-type]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="traced steps per configuration and round (after one warm-up)")
    p.add_argument("--profile", default="1F1B:8", help="NAME:MICROBATCHES[:BLOCKS] of the profiling run (BLOCKS: blocks "
                   "per stage, e.g. 3,5; uneven, the tuner separates each action's fixed time from its blocks')")
    p.add_argument("--profile-steps", type=int, default=2, help="per size and round, before the pairs")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch", type=int, default=128, help="rows per step (split into the microbatches)")
    p.add_argument("--microbatches", default="4,8,16")
    p.add_argument("--names", default=",".join(NAMES))
    p.add_argument("--out", default=None)
    p.add_argument("--analyze", metavar="DIR", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--samples", type=int, default=None, help="the tuner's simulations per candidate with drawn "
                   "action costs (default schedule_tune.SAMPLES; 0: the mean costs, as before)")
    p.add_argument("--costs", choices=("typical", "all"), default="typical",
                   help="the profile's costs from its typical steps (at most the median of their size; the tuner's "
                   "default, run_costs.TYPICAL) or from all of them (before)")
    args = p.parse_args()
    if "RANK" in os.environ:
        _rank_main(args)
        return
    out = args.analyze
    if out is None:
        out = args.out or tempfile.mkdtemp(prefix="pipeloom-tune-")
        os.makedirs(out, exist_ok=True)
        cmd = [sys.executable, "-m", "pipeloom.tools.cli", "launch", "--nproc-per-node", "2", str(Path(__file__).resolve()),
               *sys.argv[1:], "--out", out]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELOOM_")}
        subprocess.run(cmd, check=True, env=env)
    res = analyze(out, args)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"traces in {out}")
    print(format_table(res))


if __name__ == "__main__":
    main()
