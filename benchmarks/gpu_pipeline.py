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

A second model family, ``--model gpt`` (``--size s`` or ``l``): a GPT whose
first stage holds a token embedding and whose last stage holds the final
RMSNorm and a 32k-vocabulary head (so the end stages are heavier than the
middle ones), RMSNorm + SwiGLU blocks, cross-entropy on token ids, and many
small microbatches (``s``: 8 layers, hidden 1024, 32 microbatches of 1
sequence; ``l``: 16 layers, hidden 2048, 16 microbatches of 2 sequences;
sequence 1024 both).  Each row also reports the schedule's bubble ceiling
(1F1B/GPipe: m/(m+p-1) of the compute floor) and ``vs_ceiling``, and the
schedule's *simulated* ceiling: its action lists run by
``pipeloom.schedules.simulate`` with each stage's measured device time of F, B
and I (W = B - I; CUDA events, the stream asleep while the host launches, same
modules and inputs as the floor), free transfers and no host (``sim_ms``; ``vs_sim`` = sim_ms / step: the share of
the schedule's own ideal a run reached, for the unbalanced stages and the
multi-stage lists the formula does not fit).

``--profile N`` runs N more steps of each engine under ``torch.profiler``
(CUDA activity) and attributes every gap in the rank's compute (all non-NCCL
kernels, any stream): *host* (the next kernel's launch call began after the
GPU ran dry: the host was late), *launch* (the rest of such a gap: launch to
kernel start), *dependency* (the kernel was already queued: it waited on a
stream wait; *transfer* when an NCCL kernel ended inside the gap).

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


_GPT_SIZES = {
    # name: (layers, hidden, heads, microbatches, sequences per microbatch)
    "s": (8, 1024, 8, 32, 1),
    "l": (16, 2048, 16, 16, 2),
}


_GPT: tuple[Any, Any] | None = None


def gpt_classes() -> tuple[Any, Any]:
    """(Block, Stage) of the GPT family, defined once torch is imported (also used by tune_grid.py).

    ``Block(h, heads)``: RMSNorm, causal attention, RMSNorm, SwiGLU.
    ``Stage(vocab, hidden, first, last, make_blocks, tail_seed=None)``: the token embedding if
    ``first``, the blocks ``make_blocks()`` returns (built after the embedding), and, if ``last``,
    the final RMSNorm and the vocabulary head (after ``torch.manual_seed(tail_seed)`` when given).
    """
    global _GPT
    if _GPT is not None:
        return _GPT
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self, h: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            ffn = 256 * ((8 * h // 3 + 255) // 256)
            self.n1 = nn.RMSNorm(h)
            self.qkv = nn.Linear(h, 3 * h, bias=False)
            self.proj = nn.Linear(h, h, bias=False)
            self.n2 = nn.RMSNorm(h)
            self.w13 = nn.Linear(h, 2 * ffn, bias=False)
            self.w2 = nn.Linear(ffn, h, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, h = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
            x = x + self.proj(a)
            g, u = self.w13(self.n2(x)).chunk(2, dim=-1)
            return x + self.w2(F.silu(g) * u)

    class Stage(nn.Module):
        def __init__(self, vocab: int, hidden: int, first: bool, last: bool, make_blocks: Any, tail_seed: int | None = None) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden) if first else None
            self.blocks = nn.ModuleList(make_blocks())
            if tail_seed is not None:
                torch.manual_seed(tail_seed)
            self.norm = nn.RMSNorm(hidden) if last else None
            self.head = nn.Linear(hidden, vocab, bias=False) if last else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.embed is not None:
                x = self.embed(x)
            for blk in self.blocks:
                x = blk(x)
            if self.head is not None:
                x = self.head(self.norm(x))
            return x

    _GPT = (Block, Stage)
    return _GPT


def _gpt_model(args: argparse.Namespace, num_stages: int, stage: int, device: Any = "cuda", dtype: Any = None) -> Any:
    """Stage ``stage`` of the GPT: embedding on the first stage, RMSNorm + vocabulary head on the last."""
    import torch

    Block, Stage = gpt_classes()
    torch.manual_seed(2000 + stage)
    st = Stage(args.vocab, args.hidden, stage == 0, stage == num_stages - 1,
               lambda: [Block(args.hidden, args.heads) for _ in range(args.layers // num_stages)])
    return st.to(device=device, dtype=dtype or torch.bfloat16)


def _graphed(pipe: Any) -> dict[str, Any]:
    """RuntimeOptions.cuda_graphs: per rank, the forwards of the last step replayed from graphs, and why a stage
    was not captured (gathered from every rank; {} without the option)."""
    import torch.distributed as dist

    if not pipe.options.cuda_graphs:
        return {}
    mine = {"graphed_forwards": getattr(pipe.statistics, "graphed_forwards", None),
            "not_captured": {s: ex.graphs.disabled for s, ex in pipe._executors.items() if ex.graphs is not None and ex.graphs.disabled}}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"graphed_by_rank": every}


def _gpt_loss(out: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(out.float().flatten(0, -2), target.flatten())


def _ceiling(name: str, m: int, world: int) -> float:
    """The schedule's bubble ceiling as a fraction of the compute floor (1F1B/GPipe: m/(m+p-1));
    for the multi-stage schedules the same formula over ranks (an upper bound they may beat)."""
    return m / (m + world - 1)


def _loss(out: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.mse_loss(out.float(), target.float())


def _stages_of(name: str, rank: int, world: int, spr: int) -> list[int]:
    if name in ("ZBVZeroBubble", "DualPipeV"):
        return [rank, 2 * world - 1 - rank]
    return [rank + k * world for k in range(spr)]


def _stage_costs(mods: dict[int, Any], args: argparse.Namespace, seqs: list[int], last: int) -> tuple[dict[int, dict[str, float]], bool]:
    """Per stage of this rank, the device time (ms, median over microbatches) of F, B and I, timed with CUDA
    events on the same modules and inputs as :func:`_floor`; W is taken as B - I (the weight half of a
    full backward).  The last stage's F includes the loss (as in both runtimes).  Stage 0 has no input
    gradient: its I is 0 and its W the whole backward, as in pipeloom's split.

    Device time, not the host's: before each timed launch the stream sleeps (``torch.cuda._sleep``) for
    ``PAD_MS``, so the launch lands in the sleep's shadow and the event pair spans the kernels alone (a
    host-bound action would otherwise be timed at the host's pace).  Without ``_sleep`` the times are
    the eager loop's (``padded`` False in the row)."""
    import torch

    gpt = args.model == "gpt"
    sleep = getattr(torch.cuda, "_sleep", None)
    cycles = 0
    if sleep is not None:
        sleep(1_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        sleep(2_000_000)
        b.record()
        b.synchronize()
        ms = a.elapsed_time(b)
        cycles = int(2_000_000 / ms * _PAD_MS) if ms > 0 else 0

    def pad() -> None:
        if cycles:
            sleep(cycles)

    def fwd(s: int, m: Any, x: Any, tgt: Any) -> Any:
        """The forward as the runtimes run it (the last stage's with its loss): the root of the backward."""
        out = m(x)
        if s == last:
            return _gpt_loss(out, tgt) if gpt else _loss(out, torch.zeros_like(out))
        return out

    def seed(s: int, root: Any) -> Any:
        return None if s == last else torch.ones_like(root)

    out: dict[int, dict[str, Any]] = {}
    for s, m in sorted(mods.items()):
        spans: dict[str, list[float]] = {"F": [], "B": [], "I": []}
        for rep in range(2):  # the first pass warms up
            pend = []
            for t in seqs:
                # inputs, targets and gradient seeds made outside the timed spans (no runtime does that work there)
                e = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
                x = _stage_input(args, s, t)
                tgt = torch.zeros((args.mbsize, t), dtype=torch.long, device="cuda") if s == last else None
                pad()
                e[0].record()
                root = fwd(s, m, x, tgt)
                e[1].record()
                g = seed(s, root)
                pad()
                e[2].record()
                torch.autograd.backward(root, g)
                e[3].record()
                x = _stage_input(args, s, t)
                root = fwd(s, m, x, tgt)
                g = seed(s, root)
                pad()
                e[4].record()
                if x.requires_grad:
                    torch.autograd.grad(root, [x], g)
                e[5].record()
                pend.append(e)
                del x, root, g
            torch.cuda.synchronize()
            if rep:
                for e in pend:
                    spans["F"].append(e[0].elapsed_time(e[1]))
                    spans["B"].append(e[2].elapsed_time(e[3]))
                    spans["I"].append(e[4].elapsed_time(e[5]))
        m.zero_grad(set_to_none=True)
        spans["W"] = [max(b - i, 0.0) for b, i in zip(spans["B"], spans["I"])]
        c: dict[str, Any] = {k: statistics.median(v) for k, v in spans.items()}
        c["W"] = max(c["B"] - c["I"], 0.0)
        if len(set(seqs)) > 1:  # (varying lengths: each microbatch its own cost, in the order of seqs)
            c["per_mb"] = spans
        out[s] = c
    return out, bool(cycles)


#: _stage_costs: how long the stream sleeps before each timed launch (longer than any action's host launch
#: here: the GPT's slowest, the last stage's backward, takes the host about 6 ms)
_PAD_MS = 12.0


def _sim_ceiling(name: str, n: int, world: int, costs: dict[int, dict[str, float]]) -> dict[str, Any]:
    """The schedule's own bubble ceiling: its action lists (as torch orders them) simulated with the measured
    per-stage device times, free transfers and no host, an OVERLAP_F_B taking the sum of its halves (a dense
    stage is compute-bound on both).  ``sim_ms`` is that step; ``sim_busy_ms`` the busiest rank's compute."""
    from pipeloom.schedules import Costs, default_stages_per_rank, generate, simulate

    sched = generate(name, num_ranks=world, num_microbatches=n, stages_per_rank=default_stages_per_rank(name))
    ac: dict[tuple[int, str, int | None], float] = {}
    for s, c in costs.items():
        for k in ("F", "B", "I", "W"):
            ac[(s, k, None)] = c[k]
            for j, v in enumerate(c.get("per_mb", {}).get(k, ())):  # (varying lengths: looked up first)
                ac[(s, k, j)] = v
    res = simulate(sched, Costs(send_latency=0.0, overlap=1.0), action_costs=ac)
    return {"sim_ms": res.makespan, "sim_busy_ms": max(res.busy.values()),
            "stage_costs_ms": {str(s): {k: round(c[k], 3) for k in ("F", "B", "I", "W")} for s, c in sorted(costs.items())}}


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


def _host_times(fn: Any, steps: int, idle: Any = None, usage: bool = False) -> list[dict[str, Any]]:
    """``--host-times``: per rank, the median host time of a step (``fn`` returned, GPU not waited
    for), the step with the GPU drained, and (pipeloom) the dispatcher's idle time; gathered."""
    import torch
    import torch.distributed as dist

    import gc

    gcs = [0, 0, 0]
    gc_s = [0.0, 0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:  # the garbage collector's passes and their time
        if phase == "start":
            gc_s[1] = time.perf_counter()
        else:
            gcs[info["generation"]] += 1
            gc_s[0] += time.perf_counter() - gc_s[1]

    host, full, idl = [], [], []
    before = _thread_cpu() if usage else {}
    w0 = time.perf_counter()
    if usage:
        gc.callbacks.append(on_gc)
    for _ in range(steps):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        full.append(t2 - t0)
        if idle is not None:
            idl.append(idle())
    if usage:
        gc.callbacks.remove(on_gc)
    wall = time.perf_counter() - w0
    mine: dict[str, Any] = {"host_ms": statistics.median(host) * 1e3, "step_ms": statistics.median(full) * 1e3,
                            "idle_ms": statistics.median(idl) * 1e3 if idl else None}
    if usage:  # which threads burn CPU beside the launching one, and the collector's passes
        after = _thread_cpu()
        busy = sorted(((after[k] - before.get(k, 0.0)) / wall, k) for k in after)
        mine["threads"] = [(k, round(v, 3)) for v, k in reversed(busy) if v >= 0.02][:8]
        mine["gc_by_gen"], mine["gc_ms"], mine["gc_objects"] = gcs, gc_s[0] * 1e3, len(gc.get_objects())
    allr: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(allr, mine)
    return allr


def _thread_cpu() -> dict[str, float]:
    """CPU seconds used so far by each thread of this process, by name (Linux /proc)."""
    import threading

    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    py = {str(t.native_id): t.name for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        key = f"{py.get(tid, name)}:{tid}"
        out[key] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def _reduce_max(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _stage_input(args: argparse.Namespace, stage: int, t: int) -> Any:
    """A microbatch of ``t`` positions as stage ``stage`` takes it: token ids on the GPT's first stage, else bf16
    hidden states (needing a gradient past the first stage)."""
    import torch

    if args.model == "gpt" and stage == 0:
        return torch.randint(0, args.vocab, (args.mbsize, t), device="cuda")
    return torch.randn(args.mbsize, t, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=stage != 0)


def _floor(mods: dict[int, Any], args: argparse.Namespace, seqs: list[int], last: int) -> float:
    """Forward+backward of this rank's stages for every microbatch, no communication."""
    import torch

    gpt = args.model == "gpt"

    def once() -> None:
        for t in seqs:
            for s, m in sorted(mods.items()):
                out = m(_stage_input(args, s, t))
                if s == last:
                    if gpt:
                        _gpt_loss(out, torch.zeros(out.shape[:-1], dtype=torch.long, device="cuda")).backward()
                    else:
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
    return min(ts)  # the floor: the least of the runs (the GPU's speed drifts on shared hosts)


def _gaps(trace_path: str) -> dict[str, Any]:
    """Attribute the gaps between this rank's compute kernels in a profiler trace (see the docstring)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    launches: dict[int, float] = {}
    kernels = []
    ranges = []  # --profile-cpu: the runtime's PP:... ranges (pipeloom's profile_ranges, torch's runtime)
    copies: list[tuple[str, float]] = []
    for e in events:
        cat = e.get("cat")
        if cat == "user_annotation" and str(e.get("name", "")).startswith("PP:"):
            ranges.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"], e.get("tid")))
        if cat == "cuda_runtime" or cat == "cuda_driver":
            c = e.get("args", {}).get("correlation")
            if c is not None and "aunch" in e.get("name", ""):
                launches[c] = float(e["ts"])
        elif cat == "kernel":
            kernels.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", ""), e.get("args", {})))
        elif cat in ("gpu_memcpy", "gpu_memset"):
            copies.append((str(e.get("name", cat)), float(e.get("dur", 0))))
    nccl = sorted((k[0], k[1]) for k in kernels if "nccl" in k[2].lower())
    comp = sorted((k[0], k[1], k[3].get("correlation"), k[3].get("stream")) for k in kernels if "nccl" not in k[2].lower())
    out = {"host_us": 0.0, "launch_us": 0.0, "transfer_us": 0.0, "dependency_us": 0.0, "busy_us": 0.0,
           "span_us": 0.0, "gaps": 0, "streams": sorted({str(k[3]) for k in comp})}
    if not comp:
        return out
    out["span_us"] = comp[-1][1] - comp[0][0]
    end = comp[0][0]
    import bisect

    nccl_ends = sorted(e for _, e in nccl)
    ranges.sort()
    starts = [r[0] for r in ranges]
    by_range: dict[str, float] = {}
    late: dict[str, float] = {}

    def doing(t: float) -> str:
        """What the host was inside at time t: the innermost PP range containing it (kind only)."""
        i = bisect.bisect_right(starts, t)
        best = None
        for j in range(i - 1, max(-1, i - 64), -1):  # ranges nest: the latest-starting one that contains t
            if ranges[j][1] >= t:
                best = ranges[j]
                break
        if best is None:
            return "outside any range"
        nm = best[2][3:]
        if nm.startswith(("hold ", "wait ")):
            return nm[:4] + " " + "".join(c for c in nm[5:] if not c.isdigit())
        if nm == "send":
            return "send"
        return "in " + "".join(c for c in nm if not c.isdigit())

    for st, en, corr, _ in comp:
        if st > end + 1.0:  # a gap over 1 us
            gap = st - end
            out["gaps"] += 1
            launch = launches.get(corr)
            if launch is not None and launch > end:
                host = min(launch - end, gap)
                out["host_us"] += host
                out["launch_us"] += gap - host
                if ranges:  # where the host was when the device ran dry, and which action launched late
                    k = doing(end)
                    by_range[k] = by_range.get(k, 0.0) + host
                    k = doing(launch)
                    late[k] = late.get(k, 0.0) + host
            else:
                i = bisect.bisect_left(nccl_ends, end)
                if i < len(nccl_ends) and nccl_ends[i] <= st + 1.0:
                    out["transfer_us"] += gap
                else:
                    out["dependency_us"] += gap
        out["busy_us"] += max(0.0, en - max(st, end))
        end = max(end, en)
    # two stage streams at once (two stages on a rank, OVERLAP_F_B): how long their compute kernels ran side by
    # side; the CUDA-event device time of an action spans the other stream's kernels then, so the actions' summed
    # device times exceed the union busy time by about this much (per stream: the kernels' own summed time)
    per_stream: dict[str, float] = {}
    edges = []
    for st, en, _, stream in comp:
        per_stream[str(stream)] = per_stream.get(str(stream), 0.0) + (en - st)
        edges += [(st, 1, stream), (en, -1, stream)]
    edges.sort(key=lambda e: (e[0], e[1]))
    active: dict[Any, int] = {}
    concurrent = 0.0
    last_t = None
    for t, d, stream in edges:
        if last_t is not None and sum(1 for v in active.values() if v > 0) >= 2:
            concurrent += t - last_t
        active[stream] = active.get(stream, 0) + d
        last_t = t
    out["kernel_us_by_stream"] = {k: round(v, 1) for k, v in sorted(per_stream.items())}
    # what the device ran, by kernel name (count, summed us; the 40 largest) and the copies/memsets: two engines'
    # tables side by side say whether one of them does more device work than the other for the same step
    by_name: dict[str, list[float]] = {}
    for st, en, nm, _ in kernels:
        key = nm[:90]
        v = by_name.setdefault(key, [0, 0.0])
        v[0] += 1
        v[1] += en - st
    for nm, d in copies:
        v = by_name.setdefault("[copy] " + nm[:80], [0, 0.0])
        v[0] += 1
        v[1] += d
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]
    out["kernels_by_name"] = {k: [int(v[0]), round(v[1], 1)] for k, v in top}
    out["kernel_count"] = len(kernels)
    out["copy_us"] = round(sum(d for _, d in copies), 1)
    out["concurrent_streams_us"] = round(concurrent, 1)
    if ranges:
        out["host_gap_at_idle_us"] = {k: round(v, 1) for k, v in sorted(by_range.items(), key=lambda kv: -kv[1])}
        out["host_gap_late_launch_us"] = {k: round(v, 1) for k, v in sorted(late.items(), key=lambda kv: -kv[1])}
    return out


def run(args: argparse.Namespace, name: str) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    import pipeloom
    from pipeloom.schedules import default_stages_per_rank

    rank, world = dist.get_rank(), dist.get_world_size()
    gpt = args.model == "gpt"
    spr = default_stages_per_rank(name)
    num_stages = world * spr
    mine = _stages_of(name, rank, world, spr)
    build = _gpt_model if gpt else _model
    loss_fn = _gpt_loss if gpt else _loss
    mods = {s: build(args, num_stages, s) for s in mine}
    n, mb = args.microbatches, args.mbsize
    g = torch.Generator().manual_seed(7)
    if args.varlen:
        seqs = [int(v) for v in torch.randint(256, args.seq + 1, (n,), generator=g)]
    else:
        seqs = [args.seq] * n
    if gpt:
        xs = [torch.randint(0, args.vocab, (mb, t), generator=g).to("cuda") for t in seqs]
        ys = [torch.randint(0, args.vocab, (mb, t), generator=g).to("cuda") for t in seqs]
    else:
        xs = [torch.randn(mb, t, args.hidden, generator=g).to("cuda", torch.bfloat16) for t in seqs]
        ys = [torch.randn(mb, t, args.hidden, generator=g).to("cuda", torch.bfloat16) for t in seqs]
    tokens = mb * sum(seqs)
    results = []
    floor = _reduce_max(_floor(mods, args, seqs, num_stages - 1))
    ceiling = _ceiling(name, n, world)
    every_cost: list[Any] = [None] * world
    dist.all_gather_object(every_cost, _stage_costs(mods, args, seqs, num_stages - 1))
    sim = _sim_ceiling(name, n, world, {s: c for part, _ in every_cost for s, c in part.items()})
    sim["padded"] = all(p for _, p in every_cost)
    # (the plain stack is named by its shape, so that rows of several shapes in one file stay apart; the default
    # shape keeps the old name)
    shape = (args.layers, args.hidden, args.heads, args.seq, args.microbatches, args.mbsize)
    model_name = (f"gpt-{args.size}" + (f"-v{args.vocab}" if args.vocab != 32000 else "") if gpt else
                  "transformer" if shape == (16, 2048, 16, 1024, 8, 4) else
                  "transformer-{}x{}-h{}-s{}-m{}x{}".format(*shape))

    def host_profile(engine: str, fn: Any) -> None:
        """``--cprofile N``: N more steps under cProfile on rank 0; where the host's time goes, printed."""
        if not args.cprofile or name not in args.profile_schedules.split(","):
            return
        import cProfile
        import io
        import pstats

        torch.cuda.synchronize()
        dist.barrier()
        prof = cProfile.Profile() if rank == args.cprofile_rank else None
        if prof is not None:
            prof.enable()
        for _ in range(args.cprofile):
            fn()
        torch.cuda.synchronize()
        if prof is not None:
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
            if args.profile_dir:  # the whole profile, for callers/callees offline
                os.makedirs(args.profile_dir, exist_ok=True)
                prof.dump_stats(os.path.join(args.profile_dir, f"cprofile-{engine}-{name}-{model_name}-r{rank}.pstats"))
            text = "\n".join(line[:160] for line in buf.getvalue().splitlines() if line.strip())
            print(f"--- cProfile, rank {rank}, {engine} {name} {model_name}, {args.cprofile} steps ---\n{text}", flush=True)
        dist.barrier()

    def profile(engine: str, fn: Any) -> dict[str, Any] | None:
        host_profile(engine, fn)
        if not args.profile or name not in args.profile_schedules.split(","):
            return None
        from torch.profiler import ProfilerActivity, profile as tprofile, schedule as pschedule

        torch.cuda.synchronize()
        dist.barrier()
        # CUDA activity only (kernels and the runtime's launch calls): CPU-op recording would
        # slow the host, which is what is being measured; one warm-up step for CUPTI's start
        path = f"/tmp/prof-{engine}-{name}-{model_name}-r{rank}.json"
        acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.profile_cpu else [])
        with tprofile(activities=acts, schedule=pschedule(wait=0, warmup=1, active=args.profile), with_stack=args.profile_stack,
                      on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
            for i in range(args.profile + 1):
                fn()
                if i in (0, args.profile):  # (no synchronisation between the profiled steps)
                    torch.cuda.synchronize()
                prof.step()
        gaps = _gaps(path)
        if args.profile_dir and rank in (0, world - 1):
            import gzip
            import shutil

            os.makedirs(args.profile_dir, exist_ok=True)
            with open(path, "rb") as src, gzip.open(os.path.join(args.profile_dir, os.path.basename(path) + ".gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.remove(path)
        # every rank's attribution, gathered to rank 0
        allg: list[Any] = [None] * world
        dist.all_gather_object(allg, gaps)
        return {"profile_steps": args.profile, "gaps_by_rank": allg}

    def record(engine: str, times: list[float], peak: int, extra: dict[str, Any] | None = None) -> None:
        step = _reduce_max(statistics.median(times))
        peak_max = _reduce_max(float(peak))
        row = {
            "engine": engine, "schedule": name, "model": model_name, "microbatches": n, "varlen": args.varlen, "return_outputs": args.return_outputs,
            "step_ms": step * 1e3, "floor_ms": floor * 1e3, "efficiency": floor / step, "ceiling": ceiling,
            "vs_ceiling": floor / step / ceiling, **sim, "vs_sim": sim["sim_ms"] / (step * 1e3), "peak_gib": peak_max / 2**30, "tokens_per_s": tokens / step,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cpu_bind": os.environ.get("PIPELOOM_CPU_BIND") or args.cpu_bind, "date": time.strftime("%Y-%m-%d"),
            "gpus": world, "label": args.label, "code": args.code,
            "env": {k: v for k, v in os.environ.items() if k.startswith("PIPELOOM_")},
            **(extra or {}),
        }
        results.append(row)
        if rank == 0:  # write each row as soon as it exists: a later hang must not lose it
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")

    def _overlapped(pipe: Any) -> list[Any]:
        """Every rank's backwards launched beside a forward in its last step (host_overlap_backward), gathered."""
        st = pipe.statistics
        actor = pipe._actor  # (private, for the record: host_overlap_backward auto's decisions and what they read)
        from pipeloom.schedules import ActionType

        mine = {"n": st.overlapped_backwards if st else None,
                "decided": {f"{b}>{f}": v for (b, f), v in getattr(actor, "_bg_decided", {}).items()},
                # (host_overlap_trial: the host-heavy pairs the rule kept inline, tried beside; whether they stayed)
                "trial": None if getattr(actor, "_trial", None) is None else {
                    **actor._trial.state(), "pairs": [f"{b}>{f}" for (b, f) in sorted(getattr(actor, "_bg_try", ()))]},
                "learned": {f"{t.value}{s}": actor.dev.learned((t, s)) for s in actor.stages for t in (ActionType.F, ActionType.B)}}
        got: list[Any] = [None] * world
        dist.all_gather_object(got, mine)
        return got

    def build_pipeloom() -> tuple[Any, Any, Any]:
        # --trace-dir: the engine's own rank trace (per-action host spans, device times from CUDA events, waits
        # by cause) for `pipeloom trace summary`; its cost on GPUs is within 1% (benchmarks/trace_cost.py)
        if args.trace_dir:
            os.makedirs(args.trace_dir, exist_ok=True)
        traced = ({"trace": os.path.join(args.trace_dir, f"{name}-{args.model}-{args.size}.jsonl")}
                  if args.trace_dir else {})
        pipe = pipeloom.Pipeline(lambda s: mods[s], schedule=name, num_microbatches=n, loss_fn=loss_fn, **traced)
        if args.varlen:
            x_in, y_in = pipeloom.Microbatches(xs), pipeloom.Microbatches(ys)
        else:
            x_in, y_in = torch.cat(xs), torch.cat(ys)
        fn = lambda: pipe.step(x_in, target=y_in, return_outputs=args.return_outputs)  # noqa: E731

        def extra() -> dict[str, Any]:
            st = pipe.statistics
            # (private, for the record: the commit horizon the GPU policy settled on)
            return {"out_of_order": st.out_of_order if st else None, "overlapped_by_rank": _overlapped(pipe),
                    "horizon_ms": getattr(getattr(pipe._actor, "dev", None), "horizon_ms", None)}

        fn.idle = lambda: pipe.statistics.idle_seconds  # type: ignore[attr-defined]
        return fn, pipe.close, extra

    def build_torch() -> tuple[Any, Any, Any]:
        """torch.distributed.pipelining, static shapes."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        t_pad = max(seqs) if not args.varlen else args.seq

        def ex(s: int, out: bool) -> Any:
            # requires_grad as the real tensors have it: torch >= 2.13 sends no gradient back otherwise
            if gpt and s == 0 and not out:
                return torch.zeros(mb, t_pad, dtype=torch.long, device="cuda")
            width = args.vocab if (gpt and out and s == num_stages - 1) else args.hidden
            return torch.empty(mb, t_pad, width, device="cuda", dtype=torch.bfloat16, requires_grad=out or s != 0)

        stages = [PipelineStage(mods[s], s, num_stages, torch.device("cuda"), input_args=(ex(s, False),), output_args=(ex(s, True),))
                  for s in mine]
        cls = get_schedule_class(name)
        sched = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, n, loss_fn=loss_fn)
        if args.varlen:  # torch needs one shape: pad every microbatch to the longest possible
            pad = lambda ts: torch.cat([torch.nn.functional.pad(t, (0, 0, 0, t_pad - t.shape[1])) for t in ts])  # noqa: E731
            x_t, y_t = pad(xs), pad(ys)
        else:
            x_t, y_t = torch.cat(xs), torch.cat(ys)
        first, last = 0 in mine, num_stages - 1 in mine
        import inspect

        # the same outputs policy as pipeloom's, where this torch's step takes it
        kw = {"return_outputs": args.return_outputs} if "return_outputs" in inspect.signature(sched.step).parameters else {}

        def tstep() -> None:
            sched.step(*((x_t,) if first else ()), target=y_t if last else None, **kw)

        return tstep, None, lambda: {}

    def build_pipeloom_one_stream() -> tuple[Any, Any, Any] | None:
        """pipeloom with every stage on one stream (OVERLAP_F_B's halves in sequence); DualPipeV only."""
        if name != "DualPipeV":
            return None
        from pipeloom.runtime.options import RuntimeOptions

        pipe = pipeloom.Pipeline(lambda s: mods[s], schedule=name, num_microbatches=n, loss_fn=loss_fn,
                                 options=RuntimeOptions.from_env(overlap_streams=False))
        x_in, y_in = torch.cat(xs), torch.cat(ys)
        return (lambda: pipe.step(x_in, target=y_in, return_outputs=args.return_outputs)), pipe.close, lambda: {"variant": "one stream"}

    def build_pipeloom_x(which: int = 0) -> tuple[Any, Any, Any]:
        """pipeloom with the RuntimeOptions fields of --x-options (e.g. gpu_commit_ms=50); engine
        ``pipeloom-xN`` takes the N-th of several sets separated by ``;`` (``pipeloom-x`` the first)."""
        from pipeloom.runtime.options import RuntimeOptions

        variant = args.x_options.split(";")[which]
        fields: dict[str, Any] = {}
        for kv in filter(None, variant.split(",")):
            k, v = kv.split("=", 1)
            fields[k] = {"true": True, "false": False}.get(v.lower(), v)
            if isinstance(fields[k], str):
                try:
                    fields[k] = float(v) if "." in v or k.endswith("_ms") else int(v)
                except ValueError:
                    pass
        pipe = pipeloom.Pipeline(lambda s: mods[s], schedule=name, num_microbatches=n, loss_fn=loss_fn,
                                 options=RuntimeOptions.from_env(**fields))
        x_in, y_in = torch.cat(xs), torch.cat(ys)
        fn = lambda: pipe.step(x_in, target=y_in, return_outputs=args.return_outputs)  # noqa: E731
        fn.idle = lambda: pipe.statistics.idle_seconds  # type: ignore[attr-defined]
        return fn, pipe.close, lambda: {"variant": variant, "overlapped_by_rank": _overlapped(pipe),
                                        "horizon_ms": getattr(getattr(pipe._actor, "dev", None), "horizon_ms", None),
                                        **_graphed(pipe)}

    builders = {"pipeloom": build_pipeloom, "torch": build_torch, "pipeloom-1s": build_pipeloom_one_stream,
                "pipeloom-x": build_pipeloom_x}
    for i in range(1, len(args.x_options.split(";"))):
        builders[f"pipeloom-x{i + 1}"] = lambda i=i: build_pipeloom_x(i)
    engines = [e.strip() for e in args.engines.split(",")]
    if args.alternate:
        # Both engines alive, blocks of steps alternating between them, so a drift in the
        # GPU's or host's speed hits both alike; peak memory per engine is taken over its
        # own blocks (the other engine's few persistent buffers included).
        built = {e: b for e in engines if (b := builders[e]()) is not None}
        engines = list(built)
        for e in engines:
            for _ in range(args.warmup):
                built[e][0]()
        if args.gc_freeze:  # every object alive now out of the collector's way (both engines alike)
            import gc

            gc.collect()
            gc.freeze()
        times: dict[str, list[float]] = {e: [] for e in engines}
        peaks: dict[str, int] = {e: 0 for e in engines}
        per = max(1, args.steps // args.alternate)
        rounds: dict[str, list[float]] = {e: [] for e in engines}
        for r in range(args.alternate):
            # each round starts with the next engine (rotated), so that no engine always runs first: a block
            # right after another engine's pays for what that one left behind (allocator pools, caches), and
            # with a fixed order that cost fell on the first engine every round
            for e in engines[r % len(engines):] + engines[:r % len(engines)]:
                t, pk = _timed(built[e][0], per, 0)
                times[e] += t
                rounds[e].append(statistics.median(t))
                peaks[e] = max(peaks[e], pk)
        floor_start = floor
        floor = min(floor, _reduce_max(_floor(mods, args, seqs, num_stages - 1)))  # (record() reads it)
        for e in engines:
            fn, close, extra = built[e]
            prof = profile(e, fn)
            ht = ({"host_times": _host_times(fn, args.host_times, getattr(fn, "idle", None), usage=args.thread_cpu)}
                  if args.host_times else {})
            if ht and rank == 0:
                print(f"host times {e} {name}: " + "; ".join(
                    f"r{i} host {h['host_ms']:.1f} step {h['step_ms']:.1f}" + (f" idle {h['idle_ms']:.1f}" if h['idle_ms'] is not None else "")
                    for i, h in enumerate(ht["host_times"])), flush=True)
            if ht and rank == 0 and args.thread_cpu:
                for i, u in enumerate(ht["host_times"]):
                    print(f"thread cpu {e} {name} r{i} (gc {u['gc_by_gen']} {u['gc_ms']:.1f} ms, {u['gc_objects']} objects): "
                          + ", ".join(f"{k} {v:.2f}" for k, v in u["threads"]), flush=True)
            # each round's median step (slowest rank): the spread of the per-round ratios tells noise from a difference
            round_ms = [_reduce_max(r) * 1e3 for r in rounds[e]]
            record(e, times[e], peaks[e], {"order": args.engines, "rotated": True, "alternate": args.alternate, "floor_ms_start": floor_start * 1e3,
                                           "round_ms": round_ms,
                                           **extra(), **(prof or {}), **ht})
            if close is not None:
                close()
        for m in mods.values():
            m.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    else:
        # in the order given, so order effects (clocks, allocator state) can be checked
        for e in engines:
            b = builders[e]()
            if b is None:
                continue
            fn, close, extra = b
            t, pk = _timed(fn, args.steps, args.warmup)
            prof = profile(e, fn)
            record(e, t, pk, {"order": args.engines, **extra(), **(prof or {})})
            if close is not None:
                close()
            for m in mods.values():
                m.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    del mods
    torch.cuda.empty_cache()
    return results


def table(path: str) -> str:
    rows = [json.loads(l) for l in open(path) if l.strip()]
    by: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        case = (r.get("model", "transformer") + " " + ("varlen" if r["varlen"] else "fixed")
                + (f" cpu-bind={r['cpu_bind']}" if r.get("cpu_bind", "none") != "none" else "")
                + (f" {r['label']}" if r.get("label") else "") + (f" [{r['code']}]" if r.get("code") else ""))
        if r["engine"] == "pipeloom-1s" or r["engine"].startswith("pipeloom-x"):  # a variant: its own row, beside the same process's torch
            v = " one-stream" if r["engine"] == "pipeloom-1s" else f" {r.get('variant', 'x')}"
            by.setdefault((r.get("gpus", 2), r["schedule"], case + v), {})["pipeloom"] = r
            r["_base_case"] = case
            continue
        by.setdefault((r.get("gpus", 2), r["schedule"], case), {})[r["engine"]] = r
    out = ["| GPUs | schedule | case | torch ms | pipeloom ms | ratio | rounds' ratios | torch eff | pipeloom eff | ceiling | pipeloom/ceiling | simulated ms | torch/sim | pipeloom/sim | torch GiB | pipeloom GiB | B beside F per rank |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def beside(r: dict[str, Any] | None) -> str:
        # each rank's backwards launched on the worker in the last step: pipelines alike but for one rank's
        # auto decision differed by 30% in session K, which this column shows at a glance
        ranks = (r or {}).get("overlapped_by_rank") or []
        return ",".join("?" if o is None or o.get("n") is None else str(o["n"]) for o in ranks) or "—"

    def sim(r: dict[str, Any] | None, frac: Any) -> str:
        # the simulated ceiling (_sim_ceiling): its step, or the share of it a run reached (sim / measured step)
        if not r or "sim_ms" not in r:
            return "—"
        return f"{r['sim_ms']:.1f}" if frac is None else f"{r['sim_ms'] / r['step_ms']:.3f}"

    for (gpus, sched, case), e in by.items():
        t, p = e.get("torch"), e.get("pipeloom")
        if t is None and p is not None and p.get("_base_case"):  # a variant: the same process's torch
            t = by.get((gpus, sched, p["_base_case"]), {}).get("torch")
        f = lambda r, k, fmt: (fmt % r[k]) if r else "—"  # noqa: E731
        ratio = f"{p['step_ms'] / t['step_ms']:.3f}" if t and p else "—"
        spread = "—"
        if t and p and t.get("round_ms") and len(t["round_ms"]) == len(p.get("round_ms") or []):
            rr = sorted(a / b for a, b in zip(p["round_ms"], t["round_ms"]))
            spread = f"{rr[0]:.3f}-{rr[-1]:.3f}"
        out.append(f"| {gpus} | {sched} | {case} | {f(t,'step_ms','%.1f')} | {f(p,'step_ms','%.1f')} | {ratio} | {spread} | "
                   f"{f(t,'efficiency','%.3f')} | {f(p,'efficiency','%.3f')} | {f(p or t,'ceiling','%.3f') if (p or t) and 'ceiling' in (p or t) else '—'} | "
                   f"{f(p,'vs_ceiling','%.3f') if p and 'vs_ceiling' in p else '—'} | {sim(p or t, None)} | {sim(t, 1)} | {sim(p, 1)} | "
                   f"{f(t,'peak_gib','%.2f')} | {f(p,'peak_gib','%.2f')} | "
                   f"{beside(p)} |")
    prof = [r for r in rows if r.get("gaps_by_rank")]
    if prof:
        out += ["", "| GPUs | schedule | model | engine | rank | span ms | busy ms | host ms | launch ms | transfer ms | dependency ms | gaps |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in prof:
            for i, gp in enumerate(r["gaps_by_rank"]):
                out.append(f"| {r['gpus']} | {r['schedule']} | {r.get('model', '')}{' [' + r['code'] + ']' if r.get('code') else ''} | "
                           f"{r['engine']} | {i} | {gp['span_us'] / 1e3:.1f} | {gp['busy_us'] / 1e3:.1f} | {gp['host_us'] / 1e3:.2f} | "
                           f"{gp['launch_us'] / 1e3:.2f} | {gp['transfer_us'] / 1e3:.2f} | {gp['dependency_us'] / 1e3:.2f} | {gp['gaps']} |")
        att = [(r, i, gp) for r in prof for i, gp in enumerate(r["gaps_by_rank"]) if gp.get("host_gap_at_idle_us")]
        if att:  # --profile-cpu: what the host was in when the device ran dry, and which range launched late
            out += ["", "| schedule | engine | rank | host ms: the host was in ... when the device ran dry | ... the late kernel's range |",
                    "|---|---|---|---|---|"]
            for r, i, gp in att:
                fmt = lambda d: ", ".join(f"{k} {v / 1e3:.2f}" for k, v in list(d.items())[:6])  # noqa: E731
                out.append(f"| {r['schedule']} | {r['engine']} | {i} | {fmt(gp['host_gap_at_idle_us'])} | "
                           f"{fmt(gp.get('host_gap_late_launch_us', {}))} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", default="1F1B", help="a schedule, or several separated by commas (run one after the other)")
    ap.add_argument("--model", default="transformer", choices=("transformer", "gpt"))
    ap.add_argument("--size", default="l", choices=sorted(_GPT_SIZES), help="GPT size (sets layers, hidden, heads, microbatches)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--profile", type=int, default=0, help="profile this many more steps per engine and attribute compute gaps")
    ap.add_argument("--cprofile-rank", type=int, default=0, help="the rank --cprofile profiles")
    ap.add_argument("--host-times", type=int, default=0, help="after timing, this many more steps per engine: each rank's host time, step time and (pipeloom) idle time")
    ap.add_argument("--thread-cpu", action="store_true", help="with --host-times: each busy thread's CPU share and the garbage collector's passes (Linux)")
    ap.add_argument("--gc-freeze", action="store_true", help="--alternate: gc.freeze() after the warm-up steps (both engines)")
    ap.add_argument("--cprofile", type=int, default=0, help="run this many more steps per engine under cProfile on rank 0 and print the top functions")
    ap.add_argument("--profile-cpu", action="store_true",
                    help="--profile with CPU activity too: host gaps attributed to the runtime's PP:... ranges (set "
                         "PIPELOOM_PROFILE_RANGES=1 for pipeloom): what the host was in when the device ran dry")
    ap.add_argument("--profile-stack", action="store_true",
                    help="--profile-cpu with the Python tracer (with_stack): every Python call on the timeline (slows the host; "
                         "for where a host transition's time goes, not for timing)")
    ap.add_argument("--trace-dir", default=None, help="record engine pipeloom's rank trace here, one file per schedule "
                    "(pipeloom trace summary reads it)")
    ap.add_argument("--profile-dir", default=None, help="keep the gzipped traces of the first and last rank here")
    ap.add_argument("--profile-schedules", default="1F1B", help="which schedules --profile applies to (comma-separated)")
    ap.add_argument("--code", default="", help="a tag for the code under test (e.g. main@abc1234)")
    ap.add_argument("--engines", default="pipeloom,torch")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mbsize", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    # (12: the engine learns its action times over the first 2-3 steps, and RuntimeOptions.host_overlap_trial then
    # tries host-heavy pairs over 8 more; timed steps after that are the steady state)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--varlen", action="store_true")
    ap.add_argument("--return-outputs", action="store_true",
                    help="keep and return the last stage's outputs (both engines' default); without it both engines run "
                         "step(..., return_outputs=False), as a training loop that only needs the loss would")
    ap.add_argument("--x-options", default="gpu_commit_ms=50", help="RuntimeOptions fields of engine pipeloom-x (k=v,...); several sets separated by ';' "
                    "are engines pipeloom-x, pipeloom-x2, ...")
    ap.add_argument("--alternate", type=int, default=0,
                    help="rounds: keep both engines alive and alternate blocks of steps/ROUNDS steps between them")
    ap.add_argument("--label", default="", help="a tag for this row's variant (e.g. the PIPELOOM_* settings tried)")
    ap.add_argument("--cpu-bind", default="none", choices=("none", "slice", "node", "socket"),
                    help="bind each rank's process to CPUs before torch starts its threads (pipeloom.affinity; as "
                         "`pipeloom launch --cpu-bind`); both engines run under it; recorded in each row")
    ap.add_argument("--json", default=None, help="append result rows (JSON Lines) here")
    ap.add_argument("--table", default=None, help="print the table of a results file and exit")
    args = ap.parse_args(argv)
    if args.model == "gpt":
        args.layers, args.hidden, args.heads, args.microbatches, args.mbsize = _GPT_SIZES[args.size]
    if args.table:
        print(table(args.table))
        return 0
    if args.cpu_bind != "none":
        from pipeloom.affinity import bind_this_process

        bind_this_process(args.cpu_bind)
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        for name in args.schedule.split(","):
            run(args, name.strip())
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
