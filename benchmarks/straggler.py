"""Straggler benchmark: event-driven dispatch against the deterministic list order.

One rank is slowed artificially: its stage sleeps ``--delay-ms`` in the
forward of every ``--every``-th microbatch (a stand-in for a slow host, a
data-loader hiccup, a thermal throttle).  The same pipeline runs twice in the
same processes: ``deterministic=True`` (each rank walks its list in order, as
torch's runtime does) and the default event-driven dispatch (the
highest-priority *ready* action runs; W and other microbatches fill the wait).
Sleeping does not use the CPU, so the comparison holds on a small machine.

    python benchmarks/straggler.py [--ranks 4] [--schedule ZBVZeroBubble] [--delay-ms 30]

Prints median step times and the ratio event-driven / deterministic per schedule.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

__all__ = ["main"]


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import pipeloom
    from pipeloom.schedules import default_stages_per_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    slow_rank = args.slow_rank if args.slow_rank >= 0 else world // 2

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(args.dim, args.dim)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if rank == slow_rank and self.calls % args.every == 0:
                time.sleep(args.delay_ms / 1e3)
            time.sleep(args.work_ms / 1e3)  # the stage's "compute"
            y = torch.tanh(self.lin(x))
            if y.requires_grad and args.bwd_ms > 0:  # and its backward, twice the forward by default
                y.register_hook(lambda g: (time.sleep(args.bwd_ms / 1e3), g)[1])
            return y

    rows = []
    for name in args.schedules.split(","):
        spr = default_stages_per_rank(name)
        n = args.microbatches or max(2 * world, 8)
        times: dict[str, float] = {}
        for mode in ("deterministic", "event-driven"):
            torch.manual_seed(0)
            stages = [Stage() for _ in range(world * spr)]
            pipe = pipeloom.Pipeline(lambda s: stages[s], schedule=name, num_microbatches=n,
                                     loss_fn=nn.functional.mse_loss, deterministic=mode == "deterministic")
            x, y = torch.randn(n * 2, args.dim), torch.randn(n * 2, args.dim)
            samples = []
            for i in range(args.warmup + args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                pipe.step(x, target=y)
                dt = time.perf_counter() - t0
                if i >= args.warmup:
                    samples.append(dt)
            t = torch.tensor([statistics.median(samples)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[mode] = float(t.item())
            dist.barrier()
            pipe.close()
        rows.append((name, n, times["deterministic"], times["event-driven"]))
    if rank == 0:
        print(f"\n{world} gloo ranks; rank {slow_rank} sleeps {args.delay_ms} ms in every {args.every}th forward; "
              f"every forward {args.work_ms} ms, backward {args.bwd_ms} ms; median of {args.steps} steps\n")
        print(f"{'schedule':24} {'mb':>3} {'deterministic ms':>17} {'event-driven ms':>16} {'ratio':>6}")
        for name, n, det, dyn in rows:
            print(f"{name:24} {n:>3} {det * 1e3:>17.1f} {dyn * 1e3:>16.1f} {dyn / det:>6.2f}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--schedules", default="1F1B,Interleaved1F1B,ZBVZeroBubble,DualPipeV")
    ap.add_argument("--microbatches", type=int, default=0)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--work-ms", type=float, default=2.0)
    ap.add_argument("--bwd-ms", type=float, default=4.0)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    if "RANK" in os.environ:
        _rank_main(args)
        return 0
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(args.ranks):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])], env=env))
    codes = [p.wait() for p in procs]
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
