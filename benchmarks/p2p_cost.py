"""The host's cost of posting a point-to-point transfer, by the way it is posted.

A cProfile of rank 1 of GPT size s (1F1B, 2 x H200; ``gpu_pipeline.py --cprofile``) put pipeloom's
standalone NCCL posts at ~170 us (``ProcessGroup.send``) and ~124 us (``ProcessGroup.recv``) of host
time each, and the completion polls beside them (``Work.is_completed``) at ~40-58 us a call, where
torch's runtime, which posts every action's transfers through ``batch_isend_irecv`` (one coalesced
NCCL group), spent ~42 us per coalesced call.  On a host-bound step (the GPU busy ~30% of it) that is
several percent of the step.  This measures the alternatives alone, two ranks, rank 0 sending and
rank 1 receiving ``--size`` elements ``--ops`` times per way, in alternating blocks:

* ``pg``: ``ProcessGroup.send/recv`` (the runtime's ``transport/tensor.py`` ``_isend``/``_irecv``);
* ``batch``: ``dist.batch_isend_irecv([P2POp])`` with one op (torch's runtime's way);
* ``pg+poll``: ``pg`` and one ``Work.is_completed()`` on the oldest posted work per post (the runtime's
  reaping);

and prints the host microseconds per post (median over blocks), each way's works waited at the block's
end.  NCCL's flight recorder records every op; run once more with ``TORCH_NCCL_TRACE_BUFFER_SIZE=0`` in
the environment to see its share.

Usage (2 GPUs; or gloo CPU ranks without GPUs)::

    torchrun --nproc-per-node 2 benchmarks/p2p_cost.py [--ops 200 --blocks 10]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import append_row  # noqa: E402

WAYS = ("pg", "batch", "pg+poll")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1 << 20, help="elements per transfer (bf16 on GPUs, float32 on CPUs)")
    ap.add_argument("--ops", type=int, default=200, help="posts per way and block")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--json", default=None, help="append the result row here")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # (with the device bound, as the runtime's own setup does: NCCL then gives every point-to-point way one
    # communicator per pair)
    dist.init_process_group("nccl" if gpu else "gloo",
                            **({"device_id": torch.device("cuda", torch.cuda.current_device())} if gpu else {}))
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("run on 2 ranks")
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    # one group per direction, as the runtime's pair groups
    group = dist.new_group([0, 1])
    peer_pg = group  # (ProcessGroup: send/recv take the group rank; 0 and 1 here)
    buf = torch.ones(args.size, dtype=dtype, device=device)
    peer = 1 - rank

    def post_pg() -> Any:
        return peer_pg.send([buf], peer, 0) if rank == 0 else peer_pg.recv([buf], peer, 0)

    def post_batch() -> Any:
        op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, buf, peer, group)
        return dist.batch_isend_irecv([op])[0]

    def block(way: str) -> float:
        works: collections.deque[Any] = collections.deque()
        post = post_batch if way == "batch" else post_pg
        poll = way == "pg+poll"
        if gpu:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.ops):
            works.append(post())
            if poll and works[0].is_completed():
                works.popleft()
        t1 = time.perf_counter()
        for w in works:
            w.wait()
        if gpu:
            torch.cuda.synchronize()
        return (t1 - t0) / args.ops * 1e6

    ways = [w for w in args.ways.split(",") if w]
    for w in ways:  # warm-up (communicators, streams)
        block(w)
    got: dict[str, list[float]] = {w: [] for w in ways}
    for b in range(args.blocks):
        for w in (ways if b % 2 == 0 else ways[::-1]):
            got[w].append(block(w))
    mine = {w: statistics.median(v) for w, v in got.items()}
    both: list[Any] = [None, None]
    dist.all_gather_object(both, mine)
    if rank == 0:
        row = {"device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
               "trace_buffer": os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"), "size": args.size,
               "us_per_post": {"sender": both[0], "receiver": both[1]}}
        print(f"host us per post ({row['device']}, TORCH_NCCL_TRACE_BUFFER_SIZE={row['trace_buffer']}):")
        for w in ways:
            print(f"  {w:<8} send {both[0][w]:7.1f}   recv {both[1][w]:7.1f}")
        append_row(args.json, row)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
