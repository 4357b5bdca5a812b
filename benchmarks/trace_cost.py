"""What recording a trace costs a step, and which part of the recording costs it.

``tune_grid.py`` on 2 H200s (GPT size s, host-bound) showed the traced profile's full-batch steps at
~178 ms against 120.5 ms for the same configuration untraced: the recording, not the model, made up
a third of the traced step, and the tuner reads its costs from traced runs.  This benchmark times one
configuration in alternating blocks of steps under variants of the recording, each its own Pipeline
built once (same model, same communicators per variant):

* ``off``: no trace;
* ``on``: ``trace=PATH`` (the file sink: a writer thread encodes each step's events);
* ``on-nodevice``: traced, but no CUDA-event device times (GPUs: ``dev.on_timed`` cleared);
* ``on-nosink``: traced, the step's events dropped instead of written (no writer thread work);
* ``on-bare``: both of the above.

Each row: median step time per variant over the blocks, and its ratio to ``off``.

Usage (2 GPUs)::

    torchrun --nproc-per-node 2 benchmarks/trace_cost.py [--schedule Interleaved1F1B --microbatches 16]

``--smoke``: tiny GPT on gloo CPU ranks (the path in seconds; its figures mean little).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import append_row  # noqa: E402

VARIANTS = ("off", "on", "on-nodevice", "on-nosink", "on-bare")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", default="Interleaved1F1B")
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--blocks-per-stage", default="2,2,2,2", help="GPT blocks per stage")
    ap.add_argument("--size", default="s")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="/tmp/trace_cost")
    ap.add_argument("--json", default=None, help="append the result row (JSON Lines) here")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    import pipeloom
    from tune_grid import SIZES, _loss, gpt_stage_fn

    if args.smoke:
        args.size = "smoke"
    args.layers, args.hidden, args.heads, args.batch, args.seq, args.vocab = SIZES[args.size]
    gpu = torch.cuda.is_available() and not args.smoke
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # (with the device bound, as the runtime's own setup does: NCCL then gives every point-to-point way one
    # communicator per pair)
    dist.init_process_group("nccl" if gpu else "gloo",
                            **({"device_id": torch.device("cuda", torch.cuda.current_device())} if gpu else {}))
    if not gpu:
        torch.set_num_threads(1)
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    split = [int(b) for b in args.blocks_per_stage.split(",")]
    os.makedirs(args.out, exist_ok=True)
    variants = [v for v in args.variants.split(",") if v]
    pipes: dict[str, Any] = {}
    for v in variants:
        kw = {"trace": os.path.join(args.out, f"{v}.jsonl")} if v != "off" else {}
        pipe = pipeloom.Pipeline(gpt_stage_fn(args, split, device, dtype), schedule=args.schedule,
                                 num_microbatches=args.microbatches, stages_per_rank=len(split) // dist.get_world_size(),
                                 loss_fn=_loss, device=device, **kw)
        if v in ("on-nodevice", "on-bare"):
            pipe._actor.dev.on_timed = None  # (private: the CUDA-event device times off)
        if v in ("on-nosink", "on-bare") and pipe._trace_sink is not None:
            pipe._trace_sink.emit = lambda events: None  # (private: the events dropped)
        pipes[v] = pipe

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    def timed(pipe: Any, steps: int) -> list[float]:
        out = []
        for _ in range(steps):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(x, target=y, return_outputs=False)
            sync()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.append(float(t.item()))
        return out

    for v in variants:
        timed(pipes[v], args.warmup)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            times[v] += timed(pipes[v], args.steps)
    for p in pipes.values():
        p.close()
    if rank == 0:
        base = statistics.median(times["off" if "off" in times else variants[0]])
        row = {"schedule": args.schedule, "microbatches": args.microbatches, "blocks": split, "size": args.size,
               "device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
               "median_ms": {v: statistics.median(t) * 1e3 for v, t in times.items()},
               "ratio": {v: statistics.median(t) / base for v, t in times.items()}}
        print(f"{args.schedule} m={args.microbatches} blocks {args.blocks_per_stage} ({row['device']}):")
        for v in variants:
            print(f"  {v:<12} {row['median_ms'][v]:8.2f} ms  x{row['ratio'][v]:.3f}  "
                  f"(range {min(times[v]) * 1e3:.1f}-{max(times[v]) * 1e3:.1f})")
        append_row(args.json, row)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
