"""What ``Pipeline(check_finite=True)`` costs per step, and what the always-on checks cost.

Two gloo ranks train the same pipeline with the finite check off and on, in
alternating blocks of steps (a noisy neighbour on the shared machine hits
both alike), on two models:

* ``tiny``: stages of ``Linear(16, 16)`` + tanh, 8 microbatches of 4 rows
  (the runtime, not the math, dominates: the worst case for a per-action check);
* ``mlp``: stages of 4 x ``Linear(512, 512)`` + tanh, 8 microbatches of 64 rows.

A step's time is the slower rank's (each step starts after a barrier); the
table gives the median over the timed steps and the ratio on/off.  Rank 0
also times, in-process, the checks that run on every step regardless
(``check_batch`` on the inputs and the cold-step fingerprint of the
parameters) for the ``mlp`` stage.

Usage: ``python benchmarks/check_finite.py [--steps 40] [--schedule 1F1B]``
(starts its own 2 ranks; or run it under ``pipeloom launch --nproc-per-node 2``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

MODELS = {"tiny": (16, 1, 4), "mlp": (512, 4, 64)}  # width, Linears per stage, rows per microbatch
MICROBATCHES = 8


def _stage(width: int, depth: int) -> object:
    from torch import nn

    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import pipeloom

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = []
    for name, (width, depth, mb_rows) in MODELS.items():
        torch.manual_seed(0)
        stages = [_stage(width, depth) for _ in range(4)]  # (V and interleaved schedules: 2 per rank)
        x, y = torch.randn(MICROBATCHES * mb_rows, width), torch.randn(MICROBATCHES * mb_rows, width)
        times: dict[bool, list[float]] = {False: [], True: []}
        t = torch.zeros(1)
        blocks = 4
        for b in range(blocks * 2):
            flag = bool(b % 2)
            # one Pipeline at a time on the group (a live one pre-posts receives for its next step)
            pipe = pipeloom.Pipeline(lambda s: stages[s], schedule=args.schedule, num_microbatches=MICROBATCHES,
                                     loss_fn=nn.functional.mse_loss, check_finite=flag)
            for _ in range(2):
                pipe.step(x, target=y)
            for _ in range(args.steps // blocks):
                dist.barrier()
                t0 = time.perf_counter()
                pipe.step(x, target=y)
                t[0] = time.perf_counter() - t0
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[flag].append(float(t[0]))
            pipe.close()
        off, on = statistics.median(times[False]), statistics.median(times[True])
        rows.append((name, off, on))
    if rank == 0:
        print(f"check_finite on 2 gloo ranks, {args.schedule}, {MICROBATCHES} microbatches, median of {args.steps} steps each")
        print(f"{'model':<6} {'off (ms)':>9} {'on (ms)':>9} {'on/off':>7}")
        for name, off, on in rows:
            print(f"{name:<6} {off * 1e3:9.2f} {on * 1e3:9.2f} {on / off:7.2f}")
        always_on(pipeloom)
    dist.destroy_process_group()


def always_on(pipeloom: object) -> None:
    """In-process cost of the per-step checks that run whatever the options."""
    import torch

    from pipeloom.runtime.checks import check_batch

    width, depth, mb_rows = MODELS["mlp"]
    stage = _stage(width, depth)
    x, y = torch.randn(MICROBATCHES * mb_rows, width), torch.randn(MICROBATCHES * mb_rows, width)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        check_batch((x,), {}, y, rank=0)
    batch_us = (time.perf_counter() - t0) / n * 1e6
    params = list(stage.parameters())
    t0 = time.perf_counter()
    for _ in range(n):
        (True, tuple((id(p), p.requires_grad, tuple(p.shape)) for p in params), tuple(m.training for m in stage.modules()))
    fp_us = (time.perf_counter() - t0) / n * 1e6
    print(f"always on, per step: check_batch {batch_us:.1f} us; cold-step fingerprint {fp_us:.1f} us "
          f"for a stage of {len(params)} parameter tensors and {len(list(stage.modules()))} modules")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--schedule", default="1F1B")
    args = p.parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen([sys.executable, __file__, *sys.argv[1:]],
                         env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
        for r in range(2)
    ]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
