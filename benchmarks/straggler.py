"""Straggler benchmark: event-driven dispatch against the deterministic list order.

One rank (``--slow-rank``, default world // 2) is slowed artificially in the
forward of every ``--every``-th microbatch of each of its stages (counted per
step, so every step delays the same microbatches).  The same pipeline runs in
the same processes with ``deterministic=True`` (each rank walks its list in
order, as torch's runtime does) and with the default event-driven dispatch
(the highest-priority *ready* action runs; W and other microbatches fill the
wait), each first without the straggler (delay 0, the baseline row) and then
with it, so both the cost of the straggler and what dispatch does about it
are visible.

Two backends:

- ``--backend gloo`` (default): CPU ranks whose "compute" is host sleeps
  (``--work-ms`` per forward, ``--bwd-ms`` per backward), so the comparison
  holds on a small machine; the straggler sleeps ``--delay-ms`` on the host.
- ``--backend nccl``: one GPU per rank (cuda:LOCAL_RANK).  Each stage is real
  GPU work: ``--layers-per-rank`` bf16 ``Linear(dim, dim)`` + tanh layers per
  rank (split over the rank's stages) on a ``(--rows, --dim)`` activation per
  microbatch, with a real backward.  ``--delay-kind gpu`` (the default here)
  makes the straggler GPU time: a loop of ``dim x dim`` matmuls on the stage's
  stream, the number of iterations calibrated with CUDA events at start-up to
  last ``--delay-ms``; ``--delay-kind host`` sleeps on the host instead (a slow
  data loader, a Python hiccup).  Steps are timed between
  ``cuda.synchronize`` + barrier.

The script starts its own ``--ranks`` processes (or runs as one rank under
``torchrun``/``pipeloom launch`` when RANK is set).  Rank 0 prints the median
step time (max over ranks) per schedule, dispatch and delay, and the ratio
event-driven / deterministic; ``--json FILE`` appends one JSON line per
measurement.

    python benchmarks/straggler.py [--ranks 4] [--schedules 1F1B,ZBVZeroBubble] [--delay-ms 20]

On a 4-GPU host (about 30-60 s in all for the 3 default nccl schedules):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python benchmarks/straggler.py --backend nccl --ranks 4 --json straggler-4gpu.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from _procs import stop_ranks  # benchmarks/ is on sys.path: scripts run from there

__all__ = ["main"]

_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _gpu_problem(torch: Any, ranks: int, local: int | None = None) -> str | None:
    """Why this process cannot run the nccl mode (one line), or None."""
    import torch.distributed as dist

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return f"--backend nccl: no CUDA GPU is visible (torch {torch.__version__}); use --backend gloo on CPU"
    if not dist.is_available() or not dist.is_nccl_available():
        return f"--backend nccl: this torch ({torch.__version__}) has no NCCL support"
    if local is None and count < ranks:
        return f"--backend nccl: --ranks {ranks} needs {ranks} GPUs, {count} visible"
    if local is not None and local >= count:
        return f"--backend nccl: LOCAL_RANK {local} but only {count} GPUs visible"
    return None


def _rank_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F

    import pipeloom
    from pipeloom.schedules import default_stages_per_rank

    torch.set_num_threads(1)
    gpu = args.backend == "nccl"
    if gpu:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        problem = _gpu_problem(torch, 0, local)
        if problem:
            print(f"straggler.py: rank {os.environ.get('RANK')}: {problem}", file=sys.stderr)
            return 2
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
        dtype = torch.bfloat16
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
        dtype = torch.float32
    rank, world = dist.get_rank(), dist.get_world_size()
    slow_rank = args.slow_rank if args.slow_rank >= 0 else world // 2
    if not 0 <= slow_rank < world:
        raise SystemExit(f"--slow-rank {slow_rank} is not a rank of {world}")

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize(dev)

    # What the straggler does; ``state["delay"]`` toggles it between the baseline and the delayed run.
    state = {"delay": False}
    delay_iters, iter_ms = 0, 0.0
    if gpu:
        da = torch.randn(args.dim, args.dim, device=dev, dtype=dtype)
        db = torch.randn(args.dim, args.dim, device=dev, dtype=dtype)
        dc = torch.empty(args.dim, args.dim, device=dev, dtype=dtype)

        def gpu_delay(iters: int) -> None:
            with torch.no_grad():
                for _ in range(iters):
                    torch.mm(da, db, out=dc)

        cal = torch.zeros(2, device=dev)
        if rank == slow_rank and args.delay_kind == "gpu" and args.delay_ms > 0:
            gpu_delay(25)  # cuBLAS set-up, clocks up
            sync()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            n_cal = 50
            start.record()
            gpu_delay(n_cal)
            end.record()
            end.synchronize()
            per = start.elapsed_time(end) / n_cal
            cal[0], cal[1] = per, max(1, round(args.delay_ms / per))
        dist.broadcast(cal, src=slow_rank)
        iter_ms, delay_iters = float(cal[0].item()), int(cal[1].item())

    def straggle() -> None:
        if args.delay_kind == "gpu":
            gpu_delay(delay_iters)  # queued on this stage's stream: the forward's kernels run after it
        else:
            time.sleep(args.delay_ms / 1e3)

    def _backward_sleep(g: torch.Tensor) -> torch.Tensor:
        time.sleep(args.bwd_ms / 1e3)
        return g

    class CpuStage(nn.Module):
        """One Linear; the compute is host sleeps (forward ``work_ms``, backward ``bwd_ms``)."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(args.dim, args.dim)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if state["delay"] and rank == slow_rank and self.calls % args.every == 0:
                straggle()
            time.sleep(args.work_ms / 1e3)  # the stage's "compute"
            y = torch.tanh(self.lin(x))
            if y.requires_grad and args.bwd_ms > 0:  # and its backward, twice the forward by default
                y.register_hook(_backward_sleep)
            return y

    class GpuStage(nn.Module):
        """``layers`` bf16 Linear + tanh on the GPU: real forward and backward work."""

        def __init__(self, layers: int) -> None:
            super().__init__()
            lins = [nn.Linear(args.dim, args.dim, device=dev, dtype=dtype) for _ in range(layers)]
            with torch.no_grad():
                for lin in lins:  # keep activations O(1) through the layers
                    lin.weight.normal_(0.0, args.dim**-0.5)
                    lin.bias.zero_()
            self.layers = nn.ModuleList(lins)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if state["delay"] and rank == slow_rank and self.calls % args.every == 0:
                straggle()
            for lin in self.layers:
                x = torch.tanh(lin(x))
            return x

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out.float(), target.float())

    cases = [0.0, args.delay_ms] if args.delay_ms > 0 else [0.0]
    results: list[dict[str, Any]] = []
    for name in args.schedules.split(","):
        spr = default_stages_per_rank(name)
        n = args.microbatches or max(2 * world, 8)
        if gpu and args.layers_per_rank % spr:
            raise SystemExit(f"--layers-per-rank {args.layers_per_rank} does not split over {spr} stages per rank ({name})")
        built: list[Any] = []

        def stage_fn(s: int) -> nn.Module:
            torch.manual_seed(s)
            m = GpuStage(args.layers_per_rank // spr) if gpu else CpuStage()
            built.append(m)
            return m

        for mode in ("deterministic", "event-driven"):
            built.clear()
            pipe = pipeloom.Pipeline(stage_fn, schedule=name, num_microbatches=n, loss_fn=loss_fn,
                                     deterministic=mode == "deterministic", device=dev)
            gen = torch.Generator(device=dev).manual_seed(1)
            x = torch.randn(n * args.rows, args.dim, device=dev, dtype=dtype, generator=gen)
            y = torch.randn(n * args.rows, args.dim, device=dev, dtype=dtype, generator=gen)
            for delay in cases:
                state["delay"] = delay > 0
                samples = []
                for i in range(args.warmup + args.steps):
                    for m in built:
                        m.calls = 0
                    for p in pipe.parameters():
                        p.grad = None
                    sync()
                    dist.barrier()
                    sync()
                    t0 = time.perf_counter()
                    pipe.step(x, target=y)
                    sync()
                    dt = time.perf_counter() - t0
                    if i >= args.warmup:
                        samples.append(dt)
                t = torch.tensor([statistics.median(samples)], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                results.append({"schedule": name, "dispatch": mode, "delay_ms": delay, "microbatches": n,
                                "step_ms": round(float(t.item()) * 1e3, 3)})
            state["delay"] = False
            sync()
            dist.barrier()
            pipe.close()
            del pipe, x, y
            built.clear()

    if rank == 0:
        device = torch.cuda.get_device_name(dev) if gpu else "cpu"
        if gpu:
            what = (f"{args.layers_per_rank} x Linear({args.dim},{args.dim}) bf16 per rank on ({args.rows}, {args.dim}) "
                    f"per microbatch, real backward")
            how = (f"GPU matmul loop, {delay_iters} x {iter_ms:.3f} ms (calibrated)" if args.delay_kind == "gpu"
                   else "host sleep")
        else:
            what = f"every forward {args.work_ms} ms, backward {args.bwd_ms} ms (host sleeps)"
            how = "host sleep"
        print(f"\n{world} {args.backend} ranks on {device}, torch {torch.__version__}; rank {slow_rank} is delayed "
              f"{args.delay_ms} ms ({how}) in forwards {args.every}, {2 * args.every}, ... of each of its stages per step;\n"
              f"{what}; median of {args.steps} steps after {args.warmup} warm-up, max over ranks\n")
        print(f"{'schedule':18} {'mb':>3} {'delay':>12} {'deterministic ms':>17} {'event-driven ms':>16} {'ratio':>6}"
              f" {'straggler cost det/event ms':>28}")
        by = {(r["schedule"], r["dispatch"], r["delay_ms"]): r["step_ms"] for r in results}
        for name in args.schedules.split(","):
            n = next(r["microbatches"] for r in results if r["schedule"] == name)
            for delay in cases:
                det, dyn = by[(name, "deterministic", delay)], by[(name, "event-driven", delay)]
                label = "none" if delay == 0 else f"{args.delay_kind} {delay:g} ms"
                cost = ""
                if delay:
                    cost = f"{det - by[(name, 'deterministic', 0.0)]:+.1f} / {dyn - by[(name, 'event-driven', 0.0)]:+.1f}"
                print(f"{name:18} {n:>3} {label:>12} {det:>17.1f} {dyn:>16.1f} {dyn / det:>6.2f} {cost:>28}")
        if args.json:
            date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            with open(args.json, "a") as f:
                for r in results:
                    row = {**r, "delay_kind": args.delay_kind, "every": args.every, "slow_rank": slow_rank,
                           "backend": args.backend, "device": device, "torch": torch.__version__, "ranks": world,
                           "steps": args.steps, "warmup": args.warmup, "rows": args.rows, "dim": args.dim,
                           "date": date}
                    if gpu:
                        row.update(layers_per_rank=args.layers_per_rank, delay_iters=delay_iters if args.delay_kind == "gpu" else 0,
                                   delay_iter_ms=round(iter_ms, 4))
                    else:
                        row.update(work_ms=args.work_ms, bwd_ms=args.bwd_ms)
                    f.write(json.dumps(row) + "\n")
            print(f"\nappended {len(results)} rows to {args.json}")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                    help="gloo: CPU ranks, compute simulated by sleeps; nccl: one GPU per rank, real compute")
    ap.add_argument("--ranks", type=int, default=4, help="processes to start (ignored when RANK is set, e.g. under torchrun)")
    ap.add_argument("--schedules", default=None,
                    help="comma-separated (default gloo: 1F1B,Interleaved1F1B,ZBVZeroBubble,DualPipeV; "
                         "nccl: 1F1B,Interleaved1F1B,ZBVZeroBubble)")
    ap.add_argument("--microbatches", type=int, default=0, help="default max(2 * ranks, 8)")
    ap.add_argument("--dim", type=int, default=None, help="hidden size (default gloo 16, nccl 4096)")
    ap.add_argument("--rows", type=int, default=None,
                    help="rows of one microbatch's activation, i.e. microbatch size x sequence (default gloo 2, nccl 8192)")
    ap.add_argument("--layers-per-rank", type=int, default=8,
                    help="nccl: Linear layers per rank, split over its stages (8: ~3 ms forward per microbatch on an H100)")
    ap.add_argument("--delay-ms", type=float, default=None, help="the straggler's delay (default gloo 20, nccl 10)")
    ap.add_argument("--delay-kind", choices=("host", "gpu"), default=None,
                    help="host: time.sleep in the forward; gpu: calibrated matmul loop on the GPU (default: gpu on nccl, host on gloo)")
    ap.add_argument("--work-ms", type=float, default=2.0, help="gloo: host sleep per forward")
    ap.add_argument("--bwd-ms", type=float, default=4.0, help="gloo: host sleep per backward")
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--slow-rank", type=int, default=-1, help="default world // 2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=None, help="default gloo 2, nccl 3")
    ap.add_argument("--json", default=None, help="append one JSON line per measurement to this file")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds before the started ranks are killed (default gloo 900, nccl 180)")
    args = ap.parse_args(argv)
    gpu = args.backend == "nccl"
    if args.schedules is None:
        args.schedules = "1F1B,Interleaved1F1B,ZBVZeroBubble" if gpu else "1F1B,Interleaved1F1B,ZBVZeroBubble,DualPipeV"
    if args.dim is None:
        args.dim = 4096 if gpu else 16
    if args.rows is None:
        args.rows = 8192 if gpu else 2
    if args.delay_ms is None:
        args.delay_ms = 10.0 if gpu else 20.0
    if args.delay_kind is None:
        args.delay_kind = "gpu" if gpu else "host"
    if args.warmup is None:
        args.warmup = 3 if gpu else 2
    if args.timeout is None:
        args.timeout = 180.0 if gpu else 900.0
    if args.delay_kind == "gpu" and not gpu:
        ap.error("--delay-kind gpu needs --backend nccl")
    if args.every < 1 or args.steps < 1 or args.warmup < 0 or args.delay_ms < 0 or args.ranks < 1:
        ap.error("--every and --steps must be >= 1, --warmup and --delay-ms >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if "RANK" in os.environ:
        return _rank_main(args)
    if args.backend == "nccl":
        import torch

        problem = _gpu_problem(torch, args.ranks)
        if problem:
            print(f"straggler.py: {problem}", file=sys.stderr)
            return 2
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(args.ranks):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.ranks), LOCAL_WORLD_SIZE=str(args.ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        if args.backend == "nccl":
            for k, v in _NO_MULTICAST.items():
                env.setdefault(k, v)
        procs.append(subprocess.Popen([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])], env=env))
    # Bounded: a rank that fails leaves the others blocked in a collective, and a hang must not eat the run.
    deadline = time.monotonic() + args.timeout
    failed_at: float | None = None
    code = 0
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > 15):
            why = f"timed out after {args.timeout:g} s" if now > deadline else "a rank failed; the others did not exit"
            print(f"straggler.py: {why}; stopping the ranks", file=sys.stderr)
            stop_ranks(procs)
            code = 124 if now > deadline else 1
            break
        time.sleep(0.1)
    codes = [p.wait() for p in procs]
    return code or (0 if all(c == 0 for c in codes) else 1)


if __name__ == "__main__":
    sys.exit(main())
