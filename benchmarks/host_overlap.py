"""A backward launched beside the next forward (``RuntimeOptions.host_overlap_backward``), on CPU cores.

On a host-bound GPU job the loop's thread waits in ``torch.autograd.backward`` while the autograd
engine's thread launches the backward's kernels; with ``host_overlap_backward`` the backward of B(i)
runs on a worker thread and the loop launches F(i+1) meanwhile.  The same mechanism on CPU ranks
runs the two computations on two cores, where the machine has a spare one: a compute-bound
stand-in that shows the mechanism at work and what it costs where nothing can overlap (the GPU
figure needs the lent GPUs: ``gpu_pipeline.py --engines pipeloom,pipeloom-x,torch --x-options
host_overlap_backward=true``).

One process, a world of one, 1F1B with one stage (F0 B0 F1 B1 ...: each B followed by an
independent F), one intra-op thread per computation (``torch.set_num_threads(1)``); three engines
alive, timed in alternating blocks: pipeloom inline, pipeloom with the overlap, and torch's
``Schedule1F1B`` on the same module.  Prints each engine's median step and the ratios.

Usage::

    python benchmarks/host_overlap.py [--dim 512] [--layers 4] [--microbatches 8] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["main"]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=64, help="rows per microbatch")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per engine")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--port", type=int, default=29951)
    a = ap.parse_args(argv)
    import pipeloom
    from pipeloom.runtime.options import RuntimeOptions

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    n = a.microbatches
    mod = nn.Sequential(*[m for _ in range(a.layers) for m in (nn.Linear(a.dim, a.dim), nn.Tanh())])
    x, y = torch.randn(a.rows * n, a.dim), torch.randn(a.rows * n, a.dim)
    engines: dict[str, Any] = {}
    for label, on in (("pipeloom", False), ("pipeloom-overlap", True)):
        pipe = pipeloom.Pipeline(lambda s: mod, schedule="1F1B", num_microbatches=n, loss_fn=_loss,
                                 options=RuntimeOptions(host_overlap_backward=on))
        engines[label] = (lambda pipe=pipe: pipe.step(x, target=y, return_outputs=False)), pipe
    try:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        stage = PipelineStage(mod, 0, 1, torch.device("cpu"))
        sched = Schedule1F1B(stage, n, loss_fn=_loss)
        engines["torch"] = (lambda: sched.step(x, target=y)), None
    except Exception as exc:  # noqa: BLE001 - the comparison is optional where torch's runtime cannot run it
        print(f"torch's Schedule1F1B on one rank: not run ({type(exc).__name__}: {str(exc)[:120]})")
    for fn, _ in engines.values():
        for _ in range(a.warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in engines}
    per = max(1, a.steps // a.blocks)
    for b in range(a.blocks):
        order = list(engines) if b % 2 == 0 else list(engines)[::-1]
        for k in order:
            fn = engines[k][0]
            for _ in range(per):
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
            mod.zero_grad(set_to_none=True)
    overlapped = engines["pipeloom-overlap"][1].statistics.overlapped_backwards
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"1F1B, one rank, {n} microbatches of {a.rows} x {a.dim}, {a.layers} layers; {os.cpu_count()} CPUs, "
          f"one intra-op thread; {len(times['pipeloom'])} steps per engine in {a.blocks} alternating blocks")
    for k, v in med.items():
        print(f"  {k:<18} {v:9.2f} ms" + (f"   x{v / med['torch']:.3f} of torch" if "torch" in med else ""))
    print(f"  overlap / inline: x{med['pipeloom-overlap'] / med['pipeloom']:.3f} "
          f"({overlapped} of the last step's {n} backwards launched beside a forward)")
    for _, pipe in engines.values():
        if pipe is not None:
            pipe.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
