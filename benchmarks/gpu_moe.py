"""GPU benchmark: expert-parallel MoE stages, DualPipeV's OVERLAP_F_B hiding the all-to-alls (issue 16).

4 GPUs = 2 pipeline ranks x 2 expert-parallel ranks (``Pipeline(expert_parallel=2)``;
global rank = pp_index * 2 + ep_index).  The model: ``--layers`` layers, each
``x + MLP(LN(x))`` then ``x + MoE(LN(x))`` (:class:`pipeloom.moe.MoE`:
``--experts`` experts of hidden ``--expert-hidden`` sharded over the ep
ranks, top-``--top-k`` routing, capacity factor ``--capacity``), bf16;
every (pp, ep) column trains on its part of the global batch,
``--microbatches`` microbatches of ``--mbsize`` sequences of ``--seq`` tokens.
Engines, in one process launch, in the order given (``--engines``):

- ``pipeloom-overlap``: DualPipeV; each local stage on its own CUDA stream
  with its own ep communicator, so in an OVERLAP_F_B one stage's all-to-all
  runs while the other computes;
- ``pipeloom-overlap-fi``: the same with each pair's backward split
  (``schedules.overlap_input_only``): the forward overlapped with the backward's
  input half (which holds all its all-to-alls), the weight half right after, so
  the overlapped halves are about equal;
- ``pipeloom-overlap-ctas``: the same with ``RuntimeOptions(ep_max_ctas=N)``
  (``--ep-max-ctas``, default 8): the all-to-all kernels on fewer SMs, so the
  other half's compute keeps more of them;
- ``pipeloom-no-overlap``: the same with ``RuntimeOptions(overlap_streams=False)``
  (one stream: the halves and their all-to-alls run one after the other);
- ``torch-DualPipeV``: torch.distributed.pipelining's ``ScheduleDualPipeV`` with
  ``PipelineStage`` on the same stage modules (static shapes, a pp group per
  ep column, the same per-stage ep groups); its OVERLAP_F_B runs the halves
  one after the other; the non-expert gradients are all-reduced over the ep
  ranks after its step (inside the timed step), expert gradients divided by ep,
  as pipeloom's REDUCE_GRAD does;
- ``pipeloom-1F1B``, ``pipeloom-Interleaved1F1B``: reference schedules (same layers,
  spread over their stages).

Per engine, one JSON line (rank 0; appended to ``--json``): step time (median
of the timed steps, max over ranks), tokens/s (global batch), peak memory
(max over ranks), the first step's loss, and:

- ``a2a_alone_ms``: the all-to-all time of one step measured alone: one
  all-to-all of the layer's buffer, timed with CUDA events in a loop with
  nothing else running, times the all-to-alls a rank runs per step (4 per
  MoE layer per microbatch: dispatch and combine, forward and backward);
- from a ``torch.profiler`` CUDA timeline of one step (``--profile``, rank 0):
  ``a2a_kernel_ms`` (the all-to-all kernels' time, found through the
  ``pipeloom.moe.all_to_all`` ranges that launched them; it includes time a
  kernel waits for its peer), ``a2a_hidden`` (the fraction of it during
  which a compute kernel ran on another stream) and ``a2a_hidden_ms``; and the
  same for the all-to-alls launched inside OVERLAP_F_B actions
  (``pair_a2a_kernel_ms``, ``pair_a2a_hidden``; the actions' ``PP:`` ranges:
  pipeloom's ``RuntimeOptions(profile_ranges=True)``, torch's runtime always);
  with rank 1's trace of the same step (rank 0's ep peer), ``a2a_exchange_ms`` /
  ``a2a_exchange_hidden`` and ``pair_a2a_exchange_*``: each all-to-all from the later
  of the two ranks' kernel starts to its end (the exchange itself, not the time a
  kernel sat waiting for a peer that had not launched it yet).

GPU run (the ``moe4`` part of ``benchmarks/gpu_run.sh``)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    timeout 200 torchrun --nproc-per-node 4 benchmarks/gpu_moe.py --json out.jsonl --profile-dir prof

CPU smoke test (gloo, tiny, float32; the same code paths but no CUDA timeline)::

    timeout 300 python -m torch.distributed.run --nproc-per-node 4 benchmarks/gpu_moe.py --device cpu \\
        --layers 4 --hidden 16 --ffn 32 --experts 4 --expert-hidden 16 --seq 8 --microbatches 4 --mbsize 2 \\
        --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import StepTimer  # noqa: E402

__all__ = ["main"]

ENGINES = ("pipeloom-overlap", "pipeloom-overlap-fi", "pipeloom-overlap-ctas", "pipeloom-no-overlap", "torch-DualPipeV", "pipeloom-1F1B", "pipeloom-Interleaved1F1B")


# ---------------------------------------------------------------- model


def _layer_cls() -> Any:
    import torch
    from torch import nn

    from pipeloom.moe import MoE

    class Layer(nn.Module):
        def __init__(self, a: argparse.Namespace, seed: int, group: Any, ep_rank: int, ep_size: int) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            d = a.hidden
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.fc1, self.fc2 = nn.Linear(d, a.ffn), nn.Linear(a.ffn, d)
            with torch.no_grad():
                for lin in (self.fc1, self.fc2):
                    lin.weight.normal_(0.0, lin.in_features**-0.5, generator=g)
                    lin.bias.zero_()
            self.moe = MoE(d, a.expert_hidden, a.experts, top_k=a.top_k, capacity_factor=a.capacity, group=group,
                           ep_rank=ep_rank, ep_size=ep_size, generator=g)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm1(x))))
            return x + self.moe(self.norm2(x))

    return Layer


def _stage(a: argparse.Namespace, s: int, num_stages: int, group: Any, ep_rank: int, ep_size: int, device: Any, dtype: Any) -> Any:
    from torch import nn

    per = a.layers // num_stages
    Layer = _layer_cls()
    m = nn.Sequential(*[Layer(a, 1000 + s * per + i, group, ep_rank, ep_size) for i in range(per)])
    return m.to(device=device, dtype=dtype)


def _loss(out: Any, target: Any) -> Any:
    return ((out.float() - target.float()) ** 2).mean()


def _v_row(s: int, pp: int) -> int:
    return s if s < pp else 2 * pp - 1 - s


# ---------------------------------------------------------------- measurement


class _Env(StepTimer):
    def __init__(self, a: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        self.args = a
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cuda = a.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.dtype = {"auto": torch.bfloat16 if self.cuda else torch.float32, "bf16": torch.bfloat16,
                      "fp32": torch.float32}[a.dtype]
        self.ep = a.ep
        if self.world % self.ep:
            raise SystemExit(f"--ep {a.ep} does not divide the {self.world} ranks")
        self.pp = self.world // self.ep
        self.pp_rank, self.ep_rank = self.rank // self.ep, self.rank % self.ep
        g = torch.Generator().manual_seed(7)
        rows = self.ep * a.microbatches * a.mbsize
        self.x = torch.randn(rows, a.seq, a.hidden, generator=g).to(self.device, self.dtype)
        self.y = torch.randn(rows, a.seq, a.hidden, generator=g).to(self.device, self.dtype)
        self.tokens = rows * a.seq
        self._torch_groups: Any = None

    def torch_groups(self) -> Any:
        """For torch's engine: this column's pp group, one ep group per V stage, and the row group (every rank makes all)."""
        import torch.distributed as dist

        if self._torch_groups is None:
            timeout = datetime.timedelta(seconds=self.args.torch_timeout)
            grid = [[i * self.ep + e for e in range(self.ep)] for i in range(self.pp)]
            pp_group = row_group = None
            ep_groups: dict[int, Any] = {}
            for e in range(self.ep):
                g = dist.new_group([row[e] for row in grid], timeout=timeout)
                if e == self.ep_rank:
                    pp_group = g
            for i in range(self.pp):
                g = dist.new_group(grid[i], timeout=timeout)
                if i == self.pp_rank:
                    row_group = g
            for s in range(2 * self.pp):
                g = dist.new_group(grid[_v_row(s, self.pp)], timeout=timeout)
                if _v_row(s, self.pp) == self.pp_rank:
                    ep_groups[s] = g
            self._torch_groups = (pp_group, ep_groups, row_group)
        return self._torch_groups

    def free(self) -> None:
        import gc

        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


class _Run:
    step: Callable[[], None]
    losses: list[Any]
    moe_layers: int  # MoE layers on this rank
    extra: dict[str, Any]

    def close(self) -> None:
        pass


def _pipeloom(env: _Env, schedule: str, overlap: bool, ep_max_ctas: int | None = None, input_only: bool = False) -> _Run:
    import pipeloom
    from pipeloom.schedules import default_stages_per_rank, generate, overlap_input_only

    a = env.args
    num_stages = env.pp * default_stages_per_rank(schedule)
    if a.layers % num_stages:
        raise SystemExit(f"--layers {a.layers} is not a multiple of {schedule}'s {num_stages} stages")

    def stage_fn(s: int, ctx: pipeloom.StageContext) -> Any:
        return _stage(a, s, num_stages, ctx.ep_group, ctx.ep_rank, ctx.ep_size, env.device, env.dtype)

    opts = pipeloom.RuntimeOptions(overlap_streams=overlap, profile_ranges=True, ep_max_ctas=ep_max_ctas)
    plan: Any = schedule
    if input_only:  # each pair's backward split: (F;I) overlapped, W right after
        plan = overlap_input_only(generate(schedule, num_ranks=env.pp, num_microbatches=a.microbatches))
    pipe = pipeloom.Pipeline(stage_fn, schedule=plan, num_microbatches=a.microbatches, loss_fn=_loss,
                             expert_parallel=env.ep, device=env.device, options=opts)
    run = _Run()
    run.losses = []
    run.moe_layers = sum(len(m) for m in pipe.stages.values())
    run.extra = {"overlap_streams": overlap, "ep_max_ctas": ep_max_ctas, "input_only": input_only}
    mods = pipe.stages

    def step() -> None:
        for m in mods.values():
            m.zero_grad(set_to_none=True)
        run.losses = []
        pipe.step(env.x, target=env.y, losses=run.losses)

    run.step = step
    run.close = pipe.close  # type: ignore[method-assign]
    return run


def _torch_dualpipev(env: _Env) -> _Run:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    from pipeloom.moe import is_expert_parameter

    a = env.args
    pp_group, ep_groups, row_group = env.torch_groups()
    num_stages = 2 * env.pp
    mine = [env.pp_rank, num_stages - 1 - env.pp_rank]
    mods = {s: _stage(a, s, num_stages, ep_groups[s], env.ep_rank, env.ep, env.device, env.dtype) for s in mine}
    shape = (a.mbsize, a.seq, a.hidden)

    def ex(grad: bool) -> Any:
        return torch.empty(shape, device=env.device, dtype=env.dtype, requires_grad=grad)

    stages = [PipelineStage(mods[s], s, num_stages, env.device, input_args=(ex(s != 0),), output_args=(ex(True),),
                            group=pp_group) for s in mine]
    sched = get_schedule_class("DualPipeV")(stages, a.microbatches, loss_fn=_loss)
    x = torch.tensor_split(env.x, env.ep)[env.ep_rank]
    y = torch.tensor_split(env.y, env.ep)[env.ep_rank]
    params = [p for m in mods.values() for p in m.parameters()]
    dense = [p for p in params if not is_expert_parameter(p)]
    experts = [p for p in params if is_expert_parameter(p)]
    run = _Run()
    run.losses = []
    run.moe_layers = sum(len(m) for m in mods.values())
    run.extra = {"grad_reduce": "flat all-reduce after the step"}
    first, last = 0 in mods, num_stages - 1 in mods

    def step() -> None:
        for m in mods.values():
            m.zero_grad(set_to_none=True)
        run.losses = []
        sched.step(*((x,) if first else ()), target=y if last else None, losses=run.losses if last else None)
        # what pipeloom's REDUCE_GRAD does: non-expert gradients averaged over the ep columns, experts / ep
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in dense]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=row_group)
        flat.div_(env.ep)
        off = 0
        for p in dense:
            p.grad = flat[off : off + p.numel()].view_as(p)
            off += p.numel()
        for p in experts:
            if p.grad is not None:
                p.grad.div_(env.ep)

    run.step = step
    return run


def _make(env: _Env, engine: str) -> _Run:
    if engine == "pipeloom-overlap":
        return _pipeloom(env, "DualPipeV", True)
    if engine == "pipeloom-overlap-fi":
        return _pipeloom(env, "DualPipeV", True, input_only=True)
    if engine == "pipeloom-overlap-ctas":
        return _pipeloom(env, "DualPipeV", True, env.args.ep_max_ctas)
    if engine == "pipeloom-no-overlap":
        return _pipeloom(env, "DualPipeV", False)
    if engine == "torch-DualPipeV":
        return _torch_dualpipev(env)
    if engine.startswith("pipeloom-"):
        return _pipeloom(env, engine.split("-", 1)[1], True)
    raise SystemExit(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")


def _a2a_alone_ms(env: _Env) -> float | None:
    """One all-to-all of an MoE layer's buffer, on an ep group, alone (median ms over a loop)."""
    import torch
    import torch.distributed as dist

    from pipeloom.moe import capacity

    a = env.args
    _, ep_groups, _ = env.torch_groups()
    group = ep_groups[min(ep_groups)]
    c = capacity(a.mbsize * a.seq, num_experts=a.experts, top_k=a.top_k, capacity_factor=a.capacity)
    buf = torch.randn(a.experts * c, a.hidden, device=env.device, dtype=env.dtype)
    out = torch.empty_like(buf)
    for _ in range(3):
        dist.all_to_all_single(out, buf, group=group)
    env.sync()
    times = []
    for _ in range(20):
        if env.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dist.all_to_all_single(out, buf, group=group)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            dist.all_to_all_single(out, buf, group=group)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _trace_a2a(trace_path: str, name: str) -> dict[str, Any] | None:
    """The all-to-all kernels of one rank's chrome trace (see :func:`a2a_overlap`), with what classifies them."""
    with open(trace_path) as f:
        doc = json.load(f)
    events = [e for e in doc.get("traceEvents", []) if e.get("ph") == "X"]
    ranges: dict[Any, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("name") == name:
            ranges.setdefault((e.get("pid"), e.get("tid")), []).append((e["ts"], e["ts"] + e.get("dur", 0)))
    corr: dict[Any, float] = {}  # correlation id of an all-to-all launch -> its host time
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            rs = ranges.get((e.get("pid"), e.get("tid")))
            if rs and any(lo <= e["ts"] <= hi for lo, hi in rs):
                c = (e.get("args") or {}).get("correlation")
                if c is not None:
                    corr[c] = e["ts"]
    a2a_ops = {(e.get("args") or {}).get("External id"): e["ts"] for e in events
               if e.get("cat") == "cpu_op" and "alltoall" in e.get("name", "").replace("_", "").lower()}
    a2a_ops.pop(None, None)
    # the OVERLAP_F_B actions' host spans (PP:... ranges, pipeloom's profile_ranges and torch's runtime);
    # the backward half launches from autograd's thread, inside the action's span
    pairs = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("name", "").startswith("PP:") and "OVERLAP_F_B" in e["name"])
    kernels = [e for e in events if e.get("cat") == "kernel"]

    def arg(k: dict[str, Any], key: str) -> Any:
        return (k.get("args") or {}).get(key)

    found = {id(k): "range" for k in kernels if arg(k, "correlation") in corr}
    for k in kernels:
        if id(k) not in found and arg(k, "External id") in a2a_ops and "nccl" in k["name"].lower():
            found[id(k)] = "cpu op"
    streams = {arg(k, "stream") for k in kernels if id(k) in found}
    for k in kernels:
        if id(k) not in found and arg(k, "stream") in streams and "nccl" in k["name"].lower():
            found[id(k)] = "stream"
    a2a = [k for k in kernels if id(k) in found]
    if not a2a:
        return None

    def launched_in_pair(k: dict[str, Any]) -> bool:
        t = corr.get(arg(k, "correlation"))
        if t is None:
            t = a2a_ops.get(arg(k, "External id"))
        return t is not None and any(lo <= t <= hi for lo, hi in pairs)

    return {"a2a": a2a, "kernels": kernels, "pairs": pairs, "streams": streams, "found": found,
            "in_pair": [bool(pairs) and launched_in_pair(k) for k in a2a],
            "base_us": float(doc.get("baseTimeNanoseconds", 0)) / 1e3}


def _peer_starts(mine: dict[str, Any], peer: dict[str, Any], tolerance_us: float = 50.0) -> tuple[list[float] | None, str]:
    """For each of this rank's all-to-all kernels, when its ep peer's matching kernel started (this rank's clock).

    The kernels are matched per communicator: each stage's all-to-alls run on that stage's
    stream, the stages (and so the streams, created in stage order) are the same on both
    ranks, and each communicator's all-to-alls run in the same order on both.  The two
    traces share the host clock (``baseTimeNanoseconds`` + ``ts``); the match is accepted
    only where the matched kernels end together (median within ``tolerance_us``): an
    all-to-all ends on both ranks when the exchange does.
    """
    def by_stream(t: dict[str, Any]) -> list[list[int]]:
        groups: dict[Any, list[int]] = {}
        for i, k in enumerate(t["a2a"]):
            groups.setdefault((k.get("args") or {}).get("stream"), []).append(i)
        return [sorted(ix, key=lambda i: t["a2a"][i]["ts"]) for _, ix in sorted(groups.items(), key=lambda kv: str(kv[0]))]

    a, b = by_stream(mine), by_stream(peer)
    if [len(x) for x in a] != [len(x) for x in b]:
        return None, f"unmatched: all-to-alls per stream {[len(x) for x in a]} here, {[len(x) for x in b]} on the peer"
    shift = peer["base_us"] - mine["base_us"]
    starts: list[float] = [0.0] * len(mine["a2a"])
    gaps = []
    for xs, ys in zip(a, b):
        for i, j in zip(xs, ys):
            k, q = mine["a2a"][i], peer["a2a"][j]
            starts[i] = q["ts"] + shift
            gaps.append(abs((k["ts"] + k["dur"]) - (q["ts"] + shift + q["dur"])))
    gaps.sort()
    med = gaps[len(gaps) // 2] if gaps else 0.0
    if med > tolerance_us:
        return None, f"unaligned: matched all-to-alls end {med:.0f} us apart (median)"
    return starts, f"matched {len(gaps)}, ends {med:.1f} us apart (median)"


def a2a_overlap(trace_path: str, name: str = "pipeloom.moe.all_to_all", peer_trace: str | None = None) -> dict[str, Any] | None:
    """From a profiler chrome trace: all-to-all kernel time and how much of it a compute kernel on another stream overlaps.

    The all-to-all kernels are found three ways, and the row says which found them
    (``a2a_found_by``): (1) their launch (a CUDA runtime or driver event, linked by
    correlation id) happened inside a ``name`` range on the same thread; (2) their
    ``External id`` is that of a CPU op named like ``c10d::alltoall...``; (3) NCCL kernels
    on a stream where (1) or (2) found one (each ep group has its own NCCL stream, which
    carries nothing else).  Compute kernels are those whose name does not mention nccl.

    A kernel's time includes the time it sits waiting for its peer to launch the same
    all-to-all.  With ``peer_trace`` (the ep peer's trace of the same step) each kernel's
    *exchange* is also measured: from the later of the two kernels' starts to its end
    (``a2a_exchange_ms``, ``a2a_exchange_hidden``, and the same ``pair_`` figures): the
    all-to-all's own time, without the wait for a peer that has not arrived yet.
    """
    got = _trace_a2a(trace_path, name)
    if got is None:
        return None
    a2a, kernels, pairs, streams = got["a2a"], got["kernels"], got["pairs"], got["streams"]

    def arg(k: dict[str, Any], key: str) -> Any:
        return (k.get("args") or {}).get(key)

    compute = [k for k in kernels if "nccl" not in k["name"].lower()]
    by_stream: dict[Any, list[tuple[float, float]]] = {}
    for k in compute:
        by_stream.setdefault(arg(k, "stream"), []).append((k["ts"], k["ts"] + k["dur"]))
    merged: dict[Any, list[tuple[float, float]]] = {}
    for st, ivs in by_stream.items():
        ivs.sort()
        out: list[list[float]] = []
        for lo, hi in ivs:
            if out and lo <= out[-1][1]:
                out[-1][1] = max(out[-1][1], hi)
            else:
                out.append([lo, hi])
        merged[st] = [(lo, hi) for lo, hi in out]

    def covered(st: Any, lo: float, hi: float) -> float:
        """The union of the other streams' compute intervals, clipped to [lo, hi]."""
        pieces = sorted((max(a, lo), min(b, hi)) for s2, ivs in merged.items() if s2 != st for a, b in ivs if b > lo and a < hi)
        cover, end = 0.0, lo
        for a, b in pieces:
            a = max(a, end)
            if b > a:
                cover += b - a
                end = b
        return cover

    peer_starts, match = (None, "no peer trace")
    if peer_trace is not None:
        peer = _trace_a2a(peer_trace, name)
        peer_starts, match = _peer_starts(got, peer) if peer is not None else (None, "no all-to-alls in the peer trace")
    total = hidden = pair_total = pair_hidden = 0.0
    ex_total = ex_hidden = ex_pair_total = ex_pair_hidden = 0.0
    n_pair = 0
    for i, k in enumerate(a2a):
        lo, hi = k["ts"], k["ts"] + k["dur"]
        st = arg(k, "stream")
        cover = covered(st, lo, hi)
        total += hi - lo
        hidden += cover
        in_pair = got["in_pair"][i]
        if in_pair:
            n_pair += 1
            pair_total += hi - lo
            pair_hidden += cover
        if peer_starts is not None:
            elo = min(max(lo, peer_starts[i]), hi)
            ecover = covered(st, elo, hi)
            ex_total += hi - elo
            ex_hidden += ecover
            if in_pair:
                ex_pair_total += hi - elo
                ex_pair_hidden += ecover
    how = sorted(set(got["found"].values()))
    row = {"a2a_kernel_ms": total / 1e3, "a2a_hidden_ms": hidden / 1e3, "a2a_hidden": hidden / total if total else 0.0,
           "a2a_kernels": len(a2a), "a2a_streams": len(streams), "a2a_found_by": ",".join(how),
           "pairs": len(pairs), "pair_a2a_kernels": n_pair, "pair_a2a_kernel_ms": pair_total / 1e3,
           "pair_a2a_hidden": pair_hidden / pair_total if pair_total else None, "peer_match": match}
    if peer_starts is not None:
        row.update(a2a_exchange_ms=ex_total / 1e3, a2a_exchange_hidden=ex_hidden / ex_total if ex_total else 0.0,
                   pair_a2a_exchange_ms=ex_pair_total / 1e3,
                   pair_a2a_exchange_hidden=ex_pair_hidden / ex_pair_total if ex_pair_total else None)
    return row


def _profile(env: _Env, run: _Run, engine: str) -> dict[str, Any]:
    """One profiled step; rank 0's CUDA timeline analysed (and kept under ``--profile-dir``), with its
    ep peer's (rank 1's) for the exchange times (:func:`a2a_overlap`)."""
    import torch

    a = env.args
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if env.cuda else [])
    peer = 1 if env.ep > 1 else None  # rank 0's ep peer (grid rows are ep-contiguous)
    d = a.profile_dir or "/tmp"
    if env.rank == 0 and peer is not None and env.cuda:  # a marker left by an earlier, interrupted run
        stale = os.path.join(d, f"moe-{engine}-rank{peer}.json.done")
        if os.path.exists(stale):
            os.remove(stale)
    with torch.profiler.profile(activities=acts) as prof:
        run.step()
        env.sync()
    if env.rank not in (0, peer) or not env.cuda:
        return {}
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"moe-{engine}-rank{env.rank}.json")
    done = path + ".done"
    if env.rank == peer:
        if os.path.exists(done):
            os.remove(done)
        prof.export_chrome_trace(path)
        open(done, "w").close()
        return {}
    prof.export_chrome_trace(path)
    peer_path = None
    if peer is not None:
        ppath = os.path.join(d, f"moe-{engine}-rank{peer}.json")
        deadline = time.monotonic() + 120
        while not os.path.exists(ppath + ".done") and time.monotonic() < deadline:
            time.sleep(0.1)
        if os.path.exists(ppath + ".done"):
            os.remove(ppath + ".done")
            peer_path = ppath
    got = a2a_overlap(path, peer_trace=peer_path)
    if peer_path is not None and not a.profile_dir:
        os.remove(peer_path)
    return dict(got or {"a2a_hidden": None}, profile=path if a.profile_dir else None)


def bench(env: _Env, engines: list[str]) -> int:
    import torch
    import torch.distributed as dist

    a = env.args
    alone = _a2a_alone_ms(env)
    alone = env.reduce(alone) if alone is not None else None
    if env.rank == 0:
        print(f"one all-to-all alone: {alone:.3f} ms", flush=True)
    losses0: dict[str, float] = {}
    for engine in engines:
        row: dict[str, Any] = {
            "engine": engine, "pp": env.pp, "ep": env.ep, "layers": a.layers, "hidden": a.hidden, "ffn": a.ffn,
            "experts": a.experts, "top_k": a.top_k, "expert_hidden": a.expert_hidden, "capacity": a.capacity,
            "seq": a.seq, "microbatches": a.microbatches, "mbsize": a.mbsize, "dtype": str(env.dtype).replace("torch.", ""),
            "device": torch.cuda.get_device_name() if env.cuda else "cpu (gloo)", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "order": a.engines,
        }
        err = None
        run = None
        try:
            run = _make(env, engine)
            run.step()
            mine = float(sum(float(l) for l in run.losses) / len(run.losses)) if run.losses else 0.0
            loss = env.reduce(mine, "sum") / env.ep
            times, peak = env.timed(run.step, a.steps, max(0, a.warmup - 1))
            prof = _profile(env, run, engine) if a.profile else {}
            step = env.reduce(statistics.median(times))
            per_step = 4 * run.moe_layers * a.microbatches
            row.update(status="ok", step_ms=step * 1e3, tokens_per_s=env.tokens / step, loss=loss,
                       peak_gib=None if peak is None else env.reduce(float(peak)) / 2**30,
                       a2a_per_step=per_step, a2a_alone_ms=None if alone is None else alone * per_step, **prof, **run.extra)
            losses0[engine] = loss
        except Exception as exc:  # recorded; a failure on one rank leaves the others waiting (NCCL timeouts end it)
            traceback.print_exc()
            err = f"{type(exc).__name__}: {exc}"[:2000]
            row.update(status="failed", error=err)
        if run is not None:
            try:
                run.close()
            except Exception:
                traceback.print_exc()
        if env.rank == 0:
            print(json.dumps(row), flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
        del run
        env.free()
        dist.barrier()
    if env.rank == 0 and len(losses0) > 1:
        ref = next(iter(losses0.values()))
        worst = max(abs(v - ref) / max(abs(ref), 1e-12) for v in losses0.values())
        print(f"first-step losses: {', '.join(f'{k} {v:.6g}' for k, v in losses0.items())} (max relative difference {worst:.1e})")
    return 0


def table(path: str) -> str:
    rows = [json.loads(l) for l in open(path) if l.strip()]
    lines = ["| engine | step ms | tokens/s | peak GiB | a2a alone ms/step | a2a kernels ms | hidden | in pairs ms | hidden in pairs "
             "| exchange in pairs ms | exchange hidden in pairs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['engine']} | failed: {r.get('error', '')[:80]} | | | | | | | | | |")
            continue
        lines.append(f"| {r['engine']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {f(r.get('peak_gib'), '.2f')} | "
                     f"{f(r.get('a2a_alone_ms'), '.1f')} | {f(r.get('a2a_kernel_ms'), '.1f')} | {f(r.get('a2a_hidden'), '.0%')} | "
                     f"{f(r.get('pair_a2a_kernel_ms'), '.1f')} | {f(r.get('pair_a2a_hidden'), '.0%')} | "
                     f"{f(r.get('pair_a2a_exchange_ms'), '.1f')} | {f(r.get('pair_a2a_exchange_hidden'), '.0%')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, in order: {', '.join(ENGINES)}")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    ap.add_argument("--ep", type=int, default=2, help="expert-parallel ranks per stage; pipeline ranks = world / ep")
    ap.add_argument("--layers", type=int, default=8, help="layers in the whole model (a multiple of every engine's stages)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=2048, help="the dense MLP's hidden width")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-hidden", type=int, default=1024)
    ap.add_argument("--capacity", type=float, default=1.25, help="capacity factor")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=8, help="per ep column")
    ap.add_argument("--mbsize", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled step")
    ap.add_argument("--profile-dir", default=None, help="keep rank 0's chrome traces here")
    ap.add_argument("--json", default=None)
    ap.add_argument("--table", default=None, help="print the table of a results file and exit")
    ap.add_argument("--ep-max-ctas", type=int, default=8,
                    help="engine pipeloom-overlap-ctas: RuntimeOptions.ep_max_ctas (the all-to-all's CTA cap)")
    ap.add_argument("--torch-timeout", type=float, default=120)
    a = ap.parse_args(argv)
    if a.table:
        print(table(a.table))
        return 0
    import torch
    import torch.distributed as dist

    if a.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=datetime.timedelta(seconds=300))
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    env = _Env(a)
    try:
        return bench(env, [e for e in a.engines.split(",") if e])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
