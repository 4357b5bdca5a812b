"""GPU benchmark: pipeloom against torch.distributed.pipelining on the same model, same run.

A transformer of 16 layers (hidden 2048, 16 heads, MLP 4x), sequence 1024,
bf16, 8 microbatches of 4 sequences, on 2 or more GPUs, for each named schedule:

- step time (median over timed steps, max over ranks), for pipeloom and torch;
- efficiency: the compute floor divided by step time.  The floor is, per rank,
  the forward and backward of the rank's own stages for every microbatch with
  no communication and no waiting (measured on the same GPU, same modules);
  the pipeline's floor is the largest rank's;
- peak memory (``max_memory_allocated``, max over ranks).

And a variable-length case (sequence length per microbatch drawn from
256..1024): pipeloom takes each microbatch at its own length
(``pipeloom.Microbatches``), torch must pad every microbatch to 1024 (static
receive buffers); tokens per second counts real tokens only.

torch gets a fair configuration: ``PipelineStage(input_args=..., output_args=...)``
(static shapes), which avoids its runtime shape inference — the suspect in
GPipe/1F1B hanging with dynamic inference on 2 GPUs.

Run (one schedule per process, so a hang costs one row, not the table):

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/gpu_pipeline.py --schedule ZBVZeroBubble --json out.jsonl

Each invocation appends one JSON line per engine to ``--json``;
``--table FILE`` prints the table of a JSON Lines file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

__all__ = ["main"]


def _model(args: argparse.Namespace, num_stages: int, stage: int, device: Any = "cuda", dtype: Any = None) -> Any:
    """Stage ``stage``: ``layers // num_stages`` transformer blocks in an ``nn.Sequential``, seeded per stage
    (bf16 unless ``dtype`` says otherwise; benchmarks/gpu_fsdp.py builds the same model)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self, h: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(h)
            self.qkv = nn.Linear(h, 3 * h)
            self.proj = nn.Linear(h, h)
            self.ln2 = nn.LayerNorm(h)
            self.fc1 = nn.Linear(h, 4 * h)
            self.fc2 = nn.Linear(4 * h, h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
            x = x + self.proj(a)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    per = args.layers // num_stages
    torch.manual_seed(1000 + stage)
    return nn.Sequential(*[Block(args.hidden, args.heads) for _ in range(per)]).to(device=device, dtype=dtype or torch.bfloat16)


def _loss(out: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.mse_loss(out.float(), target.float())


def _stages_of(name: str, rank: int, world: int, spr: int) -> list[int]:
    if name in ("ZBVZeroBubble", "DualPipeV"):
        return [rank, 2 * world - 1 - rank]
    return [rank + k * world for k in range(spr)]


def _timed(fn: Any, steps: int, warmup: int) -> tuple[list[float], int]:
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, torch.cuda.max_memory_allocated()


def _reduce_max(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _floor(mods: dict[int, Any], args: argparse.Namespace, seqs: list[int], last: int) -> float:
    """Forward+backward of this rank's stages for every microbatch, no communication."""
    import torch

    def once() -> None:
        for t in seqs:
            for s, m in sorted(mods.items()):
                x = torch.randn(args.mbsize, t, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=s != 0)
                out = m(x)
                if s == last:
                    _loss(out, torch.zeros_like(out)).backward()
                else:
                    out.backward(torch.ones_like(out))

    for _ in range(2):
        once()
    torch.cuda.synchronize()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        once()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    for m in mods.values():
        m.zero_grad(set_to_none=True)
    return statistics.median(ts)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    import pipeloom
    from pipeloom.schedules import default_stages_per_rank

    rank, world = dist.get_rank(), dist.get_world_size()
    name = args.schedule
    spr = default_stages_per_rank(name)
    num_stages = world * spr
    mine = _stages_of(name, rank, world, spr)
    mods = {s: _model(args, num_stages, s) for s in mine}
    n, mb = args.microbatches, args.mbsize
    g = torch.Generator().manual_seed(7)
    if args.varlen:
        seqs = [int(v) for v in torch.randint(256, args.seq + 1, (n,), generator=g)]
    else:
        seqs = [args.seq] * n
    xs = [torch.randn(mb, t, args.hidden, generator=g).to("cuda", torch.bfloat16) for t in seqs]
    ys = [torch.randn(mb, t, args.hidden, generator=g).to("cuda", torch.bfloat16) for t in seqs]
    tokens = mb * sum(seqs)
    results = []
    floor = _reduce_max(_floor(mods, args, seqs, num_stages - 1))

    def record(engine: str, times: list[float], peak: int, extra: dict[str, Any] | None = None) -> None:
        step = _reduce_max(statistics.median(times))
        peak_max = _reduce_max(float(peak))
        row = {
            "engine": engine, "schedule": name, "varlen": args.varlen, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
            "efficiency": floor / step, "peak_gib": peak_max / 2**30, "tokens_per_s": tokens / step,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "gpus": world, "label": args.label,
            "env": {k: v for k, v in os.environ.items() if k.startswith("PIPELOOM_")},
            **(extra or {}),
        }
        results.append(row)
        if rank == 0:  # write each row as soon as it exists: a later hang must not lose it
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")

    def run_pipeloom() -> None:
        pipe = pipeloom.Pipeline(lambda s: mods[s], schedule=name, num_microbatches=n, loss_fn=_loss)
        if args.varlen:
            x_in, y_in = pipeloom.Microbatches(xs), pipeloom.Microbatches(ys)
        else:
            x_in, y_in = torch.cat(xs), torch.cat(ys)
        times, peak = _timed(lambda: pipe.step(x_in, target=y_in), args.steps, args.warmup)
        st = pipe.statistics
        record("pipeloom", times, peak, {"out_of_order": st.out_of_order if st else None, "order": args.engines})
        pipe.close()
        for m in mods.values():
            m.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()

    def run_torch() -> None:
        """torch.distributed.pipelining, static shapes."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        t_pad = max(seqs) if not args.varlen else args.seq
        def ex(grad: bool) -> Any:
            # requires_grad as the real tensors have it: torch >= 2.13 sends no gradient back otherwise
            return torch.empty(mb, t_pad, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=grad)

        stages = [PipelineStage(mods[s], s, num_stages, torch.device("cuda"), input_args=(ex(s != 0),), output_args=(ex(True),))
                  for s in mine]
        cls = get_schedule_class(name)
        sched = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, n, loss_fn=_loss)
        if args.varlen:  # torch needs one shape: pad every microbatch to the longest possible
            pad = lambda ts: torch.cat([torch.nn.functional.pad(t, (0, 0, 0, t_pad - t.shape[1])) for t in ts])  # noqa: E731
            x_t, y_t = pad(xs), pad(ys)
        else:
            x_t, y_t = torch.cat(xs), torch.cat(ys)
        first, last = 0 in mine, num_stages - 1 in mine

        def tstep() -> None:
            sched.step(*((x_t,) if first else ()), target=y_t if last else None)

        times, peak = _timed(tstep, args.steps, args.warmup)
        record("torch", times, peak, {"order": args.engines})
        for m in mods.values():
            m.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()

    # in the order given, so order effects (clocks, allocator state) can be checked
    for engine in args.engines.split(","):
        {"pipeloom": run_pipeloom, "torch": run_torch}[engine.strip()]()
    return results


def table(path: str) -> str:
    rows = [json.loads(l) for l in open(path) if l.strip()]
    by: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        case = ("varlen" if r["varlen"] else "fixed") + (f" {r['label']}" if r.get("label") else "")
        by.setdefault((r.get("gpus", 2), r["schedule"], case), {})[r["engine"]] = r
    out = ["| GPUs | schedule | case | torch ms | pipeloom ms | ratio | torch eff | pipeloom eff | torch GiB | pipeloom GiB | torch tok/s | pipeloom tok/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (gpus, sched, case), e in by.items():
        t, p = e.get("torch"), e.get("pipeloom")
        f = lambda r, k, fmt: (fmt % r[k]) if r else "—"  # noqa: E731
        ratio = f"{p['step_ms'] / t['step_ms']:.3f}" if t and p else "—"
        out.append(f"| {gpus} | {sched} | {case} | {f(t,'step_ms','%.1f')} | {f(p,'step_ms','%.1f')} | {ratio} | "
                   f"{f(t,'efficiency','%.3f')} | {f(p,'efficiency','%.3f')} | {f(t,'peak_gib','%.2f')} | {f(p,'peak_gib','%.2f')} | "
                   f"{f(t,'tokens_per_s','%.0f')} | {f(p,'tokens_per_s','%.0f')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", default="1F1B")
    ap.add_argument("--engines", default="pipeloom,torch")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mbsize", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--varlen", action="store_true")
    ap.add_argument("--label", default="", help="a tag for this row's variant (e.g. the PIPELOOM_* settings tried)")
    ap.add_argument("--json", default=None, help="append result rows (JSON Lines) here")
    ap.add_argument("--table", default=None, help="print the table of a results file and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        run(args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
