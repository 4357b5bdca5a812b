"""Uneven work on CPU: pipeloom's dispatch rule against its deterministic order and torch, with the simulator's prediction.

Issue 19's benchmark.  gloo ranks whose "compute" is host sleeps
proportional to each microbatch's length (so the comparison holds on a small,
loaded machine): a forward sleeps ``--f-ms x length``, the input-gradient
half of a backward (I) as long, the weight-gradient half (W) as long (a
custom autograd Function on the weight, so the zero-bubble split puts it in
W), a full B both.  Microbatches have different row counts (``pipeloom.
Microbatches``), the length being ``rows / max_rows``.

Workloads (``--workloads``):

* ``fixed`` -- every microbatch at the longest length;
* ``uniform`` -- lengths uniform in 0.25..1 of the longest;
* ``bimodal`` -- 70% at a quarter, 30% at full length (packed short
  documents and a few long ones);
* ``slow-rank`` -- fixed lengths, rank 1 1.5x slower (a slow stage);
* ``jitter`` -- fixed lengths, rank 1's every action x (1 + 0.3 N(0,1)).

Each step uses one of ``--draws`` length vectors (seeded, the same for every
engine).  Engines, all alive in the same processes, timed in alternating
blocks so drift hits them alike: pipeloom ``deterministic=True``, pipeloom's
default dispatch (``auto``: the rule it picks is shown), and
``torch.distributed.pipelining``'s class of the same name; torch needs one
shape for every microbatch, so on uneven work it gets them padded to the
longest (its sleeps follow the padded rows: what padding costs).

The measured gain is the median over pairs of steps with the same lengths,
timed one right after the other, of deterministic / dynamic - 1 (ranks
averaged), with its quartiles: the spread is this machine's noise.  Next to
it the simulator's
prediction for the same rule on the same lengths and costs
(``pipeloom.schedules.simulate_policy``), with the measured per-action
host overhead as the transfer cost.

    python benchmarks/uneven.py [--ranks 2] [--schedules ...] [--workloads ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from _procs import stop_ranks  # benchmarks/ is on sys.path: scripts run from there

__all__ = ["main"]

ALL_SCHEDULES = "GPipe,1F1B,Interleaved1F1B,LoopedBFS,InterleavedZeroBubble,ZBVZeroBubble,DualPipeV"
ALL_WORKLOADS = "fixed,uniform,bimodal,slow-rank,jitter"


def _lengths(workload: str, m: int, draws: int, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(draws):
        if workload == "uniform":
            out.append([rng.uniform(0.25, 1.0) for _ in range(m)])
        elif workload == "bimodal":
            out.append([1.0 if rng.random() < 0.3 else 0.25 for _ in range(m)])
        else:
            out.append([1.0] * m)
    return out


def _rows(lengths: list[float], max_rows: int) -> list[int]:
    return [max(1, round(x * max_rows)) for x in lengths]


def _predict(name: str, world: int, m: int, workload: str, vectors: list[list[float]], args: argparse.Namespace,
             rule: str, overhead_ms: float) -> float:
    """Simulated gain of ``rule`` over the static order, mean step time over the same length vectors."""
    from pipeloom.schedules import Costs, generate, simulate_policy
    from pipeloom.schedules.policy_sim import draw_costs

    sched = generate(name, num_ranks=world, num_microbatches=m)
    f = args.f_ms
    costs = Costs(F=f, B=2 * f, I=f, W=f, send_latency=overhead_ms)
    slow = {1: args.slow} if workload == "slow-rank" else None
    jitter = args.jitter if workload == "jitter" else 0.0
    rng = random.Random(7)
    tot = {"static": 0.0, rule: 0.0}
    trials = 0
    for vec in vectors:
        for _ in range(4 if jitter else 1):
            lengths = [_rows([x], args.max_rows)[0] / args.max_rows for x in vec]
            durs = draw_costs(sched, costs, lengths=lengths, slow=slow, rng=rng)
            if jitter:  # only rank 1's actions jitter
                for k in durs:
                    if sched.stage_to_rank[k[0]] == 1:
                        durs[k] *= max(0.1, 1.0 + jitter * rng.gauss(0.0, 1.0))
            pol = {"static": "static", "ready": "dynamic", "critical": "critical", "guarded": "guarded"}
            for p in tot:
                tot[p] += simulate_policy(sched, pol[p], durs, transfer=overhead_ms).makespan
            trials += 1
    return tot["static"] / tot[rule] - 1.0


def _rank_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F

    import pipeloom
    from pipeloom.schedules import default_stages_per_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state: dict[str, Any] = {"workload": "fixed", "step": 0}

    def factor(stage: int, mb_len: float, kind: str, mb: int) -> float:
        x = mb_len
        if rank == 1 and state["workload"] == "slow-rank":
            x *= args.slow
        if rank == 1 and state["workload"] == "jitter":
            r = random.Random(hash((state["step"], stage, mb, kind)))
            x *= max(0.1, 1.0 + args.jitter * r.gauss(0.0, 1.0))
        return x

    class SleepGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor, ms: float) -> torch.Tensor:
            ctx.ms = ms
            return t.view_as(t)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
            time.sleep(ctx.ms / 1e3)
            return g, None

    class Stage(nn.Module):
        def __init__(self, s: int) -> None:
            super().__init__()
            self.s = s
            self.lin = nn.Linear(args.dim, args.dim)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mb = self.calls
            self.calls += 1
            length = x.shape[0] / args.max_rows
            f = args.f_ms * factor(self.s, length, "F", mb)
            time.sleep(f / 1e3)
            w = SleepGrad.apply(self.lin.weight, args.f_ms * factor(self.s, length, "W", mb))
            y = torch.tanh(F.linear(x, w, self.lin.bias))
            if y.requires_grad:
                ms = args.f_ms * factor(self.s, length, "I", mb)
                y.register_hook(lambda g, ms=ms: (time.sleep(ms / 1e3), g)[1])
            return y

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target)

    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    results: list[dict[str, Any]] = []
    overhead_ms = args.overhead_ms
    for name in args.schedules.split(","):
        spr = default_stages_per_rank(name)
        S = world * spr
        m = args.microbatches
        built: dict[str, list[Stage]] = {}

        def make(tag: str) -> Any:
            def fn(s: int) -> nn.Module:
                torch.manual_seed(s)
                st = Stage(s)
                built.setdefault(tag, []).append(st)
                return st
            return fn

        det = pipeloom.Pipeline(make("det"), schedule=name, num_microbatches=m, loss_fn=loss_fn, deterministic=True)
        dyn = pipeloom.Pipeline(make("dyn"), schedule=name, num_microbatches=m, loss_fn=loss_fn)
        rule = dyn._actor.dispatch_rule if hasattr(dyn, "_actor") else "?"
        # torch: its own stages, placed as pipeloom places them
        place = det.schedule.stage_to_rank
        mine = [s for s in range(S) if place[s] == rank]
        t_stages = {s: make("torch")(s) for s in mine}
        t_sched = None
        try:
            if args.no_torch:
                raise RuntimeError("--no-torch")
            cls = get_schedule_class(name)
            pst = [PipelineStage(t_stages[s], s, S, torch.device("cpu")) for s in mine]
            single = issubclass(cls, PipelineScheduleSingle)
            t_sched = cls(pst[0] if single else pst, m, loss_fn=loss_fn)
        except Exception as exc:  # a schedule torch does not build this way: reported, not fatal
            if rank == 0:
                print(f"uneven.py: torch {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        for workload in args.workloads.split(","):
            state["workload"] = workload
            vectors = _lengths(workload, m, args.draws, args.seed)
            gen = torch.Generator().manual_seed(1)
            batches = []
            for vec in vectors:
                rows = _rows(vec, args.max_rows)
                xs = [torch.randn(r, args.dim, generator=gen) for r in rows]
                ys = [torch.randn(r, args.dim, generator=gen) for r in rows]
                pad = args.max_rows
                xp = torch.cat([torch.cat([x, x.new_zeros(pad - x.shape[0], args.dim)]) for x in xs])
                yp = torch.cat([torch.cat([y, y.new_zeros(pad - y.shape[0], args.dim)]) for y in ys])
                batches.append((xs, ys, xp, yp))

            def run(engine: str, i: int) -> None:
                xs, ys, xp, yp = batches[i % len(batches)]
                state["step"] = i
                for st in built.get(engine, []):
                    st.calls = 0
                if engine == "torch":
                    for s in mine:
                        t_stages[s].zero_grad(set_to_none=True)
                    t_sched.step(*((xp,) if 0 in mine else ()), target=yp if S - 1 in mine else None)  # type: ignore[union-attr]
                    return
                pipe = det if engine == "det" else dyn
                for mod in pipe.stages.values():
                    mod.zero_grad(set_to_none=True)
                pipe.step(pipeloom.Microbatches(xs), target=pipeloom.Microbatches(ys))
                if engine == "dyn" and pipe.statistics is not None:
                    reordered.append(pipe.statistics.out_of_order)

            reordered: list[int] = []  # this rank's actions run ahead of an earlier-listed one, per dynamic step
            engines = ["det", "dyn"] + (["torch"] if t_sched is not None else [])
            times: dict[str, list[float]] = {e: [] for e in engines}
            per_block = max(1, args.steps // args.blocks)

            def timed(e: str, i: int) -> None:
                dist.barrier()
                t0 = time.perf_counter()
                run(e, i)
                times[e].append(time.perf_counter() - t0)

            # pipeloom's two orders alternate in blocks (drift hits both alike); torch after them,
            # on its own (its transfers share the default group with pipeloom's on gloo)
            for e in ("det", "dyn"):
                for i in range(args.warmup):
                    dist.barrier()
                    run(e, i)
            for b in range(args.blocks):
                for e in (("det", "dyn") if b % 2 == 0 else ("dyn", "det")):
                    for i in range(per_block):
                        timed(e, b * per_block + i)
            if "torch" in engines:
                dist.barrier()
                for i in range(args.warmup):
                    dist.barrier()
                    run("torch", i)
                for i in range(max(2, per_block * args.blocks // 2)):
                    timed("torch", i)
            meds = {}
            for e in engines:
                t = torch.tensor([statistics.median(times[e])])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                meds[e] = float(t.item()) * 1e3
            # the gain from pairs of steps with the same lengths, timed next to each other
            # (median of det/dyn - 1); its spread (quartiles) is the noise of this machine
            pair = torch.tensor([a / b for a, b in zip(times["det"], times["dyn"])])
            dist.all_reduce(pair, op=dist.ReduceOp.SUM)
            pair = sorted((pair / world).tolist())
            q = statistics.quantiles(pair, n=4) if len(pair) >= 2 else [pair[0]] * 3
            ooo = torch.tensor([float(sum(reordered)) / max(1, len(reordered))])
            dist.all_reduce(ooo, op=dist.ReduceOp.SUM)
            row = {"schedule": name, "workload": workload, "ranks": world, "microbatches": m, "rule": rule,
                   "reordered_per_step": round(float(ooo.item()), 2),
                   "det_ms": round(meds["det"], 2), "dyn_ms": round(meds["dyn"], 2),
                   "torch_ms": round(meds["torch"], 2) if "torch" in meds else None,
                   "gain": round(q[1] - 1.0, 4), "gain_q1": round(q[0] - 1.0, 4), "gain_q3": round(q[2] - 1.0, 4)}
            if rank == 0:
                row["predicted"] = round(_predict(name, world, m, workload, vectors, args, rule, overhead_ms), 4)
                print(f"{name:22} {workload:10} {rule:8} det {row['det_ms']:8.1f} dyn {row['dyn_ms']:8.1f} "
                      f"torch {row['torch_ms'] if row['torch_ms'] is not None else '-':>8} gain {row['gain']:+.1%} "
                      f"[{row['gain_q1']:+.1%}, {row['gain_q3']:+.1%}] predicted {row['predicted']:+.1%} "
                      f"reordered/step {row['reordered_per_step']}", flush=True)
            results.append(row)
        dist.barrier()
        det.close()
        dyn.close()
        del det, dyn, t_sched

    if rank == 0 and args.json:
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with open(args.json, "a") as f:
            for r in results:
                f.write(json.dumps({**r, "f_ms": args.f_ms, "max_rows": args.max_rows, "steps": args.steps,
                                    "draws": args.draws, "torch": torch.__version__, "date": date}) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--schedules", default=ALL_SCHEDULES)
    ap.add_argument("--workloads", default=ALL_WORKLOADS)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--f-ms", type=float, default=8.0, help="forward sleep of a full-length microbatch (I and W as long)")
    ap.add_argument("--max-rows", type=int, default=32)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--slow", type=float, default=1.5)
    ap.add_argument("--jitter", type=float, default=0.3)
    ap.add_argument("--draws", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=12, help="alternations of the two pipeloom orders (steps / blocks each)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overhead-ms", type=float, default=0.4, help="host cost per transfer/action used as the simulator's transfer time")
    ap.add_argument("--no-torch", action="store_true", help="leave torch.distributed.pipelining out")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=1800.0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if "RANK" in os.environ:
        return _rank_main(args)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(args.ranks):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.ranks), LOCAL_WORLD_SIZE=str(args.ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])], env=env))
    deadline = time.monotonic() + args.timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
            stop_ranks(procs)
            return 1
        time.sleep(0.2)
    return 0 if all(p.returncode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
