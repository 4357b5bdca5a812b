"""How long does a checkpoint hold up training: synchronous vs asynchronous save, and load?

``pipeloom.save_checkpoint(..., async_save=True)`` copies the state to CPU
memory and returns; a background thread writes the files.  This measures, on
the ranks of one job (gloo, CPU), for a GPT of ``--layers`` x ``--dim`` split
in one stage per rank with AdamW state:

* ``sync``: the time ``save_checkpoint`` blocks with ``async_save=False``;
* ``async-return``: the time it blocks with ``async_save=True`` (staging);
* ``async-total``: from the call until the checkpoint is complete (renamed);
* ``load``: ``load_checkpoint`` of the latest one into the same layout.

Median of ``--repeats`` saves each, the slowest rank's time; the checkpoint
size is the sum of the files.  Usage::

    pipeloom launch --nproc-per-node 2 benchmarks/checkpoint_save.py --layers 8 --dim 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import GPT, GPTConfig, lm_loss, stage_fqns  # noqa: E402

import pipeloom  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    cfg = GPTConfig(vocab=256, dim=args.dim, heads=8, layers=args.layers, seq=32)
    with torch.device("meta"):
        model = GPT(cfg)
    split = pipeloom.split_by_fqn(model, stage_fqns(args.layers, world), device="cpu")
    pipe = pipeloom.Pipeline(split, schedule="1F1B", num_microbatches=max(4, 2 * world), loss_fn=lm_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab, (8, cfg.seq))
    pipe.step(x, target=x)
    opt.step()  # optimizer state exists
    where = [args.dir or (tempfile.mkdtemp(prefix="pipeloom-ckpt-") if pipe.rank == 0 else None)]
    dist.broadcast_object_list(where, src=0)  # one directory for every rank
    root = Path(where[0])
    times: dict[str, list[float]] = {"sync": [], "async-return": [], "async-total": [], "load": []}
    step = 0

    def slowest(t: float) -> float:
        v = torch.tensor([t])
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return float(v)

    for _ in range(args.repeats):
        step += 1
        t0 = time.perf_counter()
        pipeloom.save_checkpoint(root, pipe, opt, step=step, keep_last=2)
        times["sync"].append(slowest(time.perf_counter() - t0))
        step += 1
        t0 = time.perf_counter()
        pending = pipeloom.save_checkpoint(root, pipe, opt, step=step, async_save=True, keep_last=2)
        times["async-return"].append(slowest(time.perf_counter() - t0))
        pending.wait()
        times["async-total"].append(slowest(time.perf_counter() - t0))
        dist.barrier()
        t0 = time.perf_counter()
        pipeloom.load_checkpoint(root, pipe, opt)
        times["load"].append(slowest(time.perf_counter() - t0))
    if pipe.rank == 0:
        latest = pipeloom.latest_checkpoint(root)
        size = sum(f.stat().st_size for f in latest.iterdir()) if latest else 0
        params = sum(p.numel() for p in model.parameters())
        print(f"GPT {params / 1e6:.1f}M params, {world} ranks, checkpoint {size / 1e6:.1f} MB (model + AdamW), "
              f"median of {args.repeats}, slowest rank:")
        for k, v in times.items():
            print(f"  {k:13s} {statistics.median(v) * 1e3:8.1f} ms")
    pipe.close()


if __name__ == "__main__":
    main()
