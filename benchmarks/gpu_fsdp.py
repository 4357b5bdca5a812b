"""GPU benchmark: pipeline x FSDP (issue 8), pipeloom against torch.distributed.pipelining, same model, same run.

4 GPUs = 2 pipeline ranks x 2 FSDP ranks (a ``("pp", "dp")`` DeviceMesh,
global rank = pp_index * dp + dp_index).  The model is gpu_pipeline.py's
transformer (16 layers, hidden 2048, 16 heads, MLP 4x), sequence 1024, bf16;
each replica trains on its half of the global batch, 8 microbatches of 4
sequences per replica.  One process launch per schedule measures, in order
(``--engines`` picks a subset and the order):

- ``pipeloom-overlap``: ``pipeloom.Pipeline(..., data_parallel=2, fsdp=True,
  fsdp_wrap="blocks", prefetch=1)``; UNSHARD (all-gather) and REDUCE_GRAD
  (reduce-scatter) run as events that overlap other stages' compute;
- ``pipeloom-no-overlap``: the same with ``overlap_collectives=False``: every
  collective blocks the dispatcher until it has completed (the naive
  baseline);
- ``torch-fsdp``: torch.distributed.pipelining with FSDP2 on the same stage
  modules: ``fully_shard`` on every block and on the stage root over the
  mesh's ``"dp"`` ranks, ``reshard_after_forward=False`` (as torchtitan does
  under PP), ``PipelineStage(..., group=<the mesh's "pp" ranks>)`` with static
  ``input_args``/``output_args``, and ``get_schedule_class(NAME)``; each
  replica feeds its half of the global batch.  (Its groups are the mesh's
  ranks, built with a timeout, ``--torch-timeout``: see ``_Env.torch_groups``.
  The static examples carry ``requires_grad`` as the real tensors do: torch
  2.13 derives the gradient transfers from it, 2.11 ignores it.)  torch's
  stage handles FSDP itself (torch 2.11 and 2.13 alike): every backward runs
  with gradient sync off, and after the stage's last backward
  ``perform_reduce_grad`` runs FSDP's post-backward (the reduce-scatter,
  averaging over the replicas) and divides by the number of microbatches
  (``scale_grads``), so its gradients are the same average as pipeloom's and
  nothing else has to be called.

Per engine, one JSON line (rank 0 prints it and appends it to ``--json``):
step time (median of the timed steps after warm-up, each step between a
synchronize + barrier pair, max over ranks), peak memory
(``cuda.max_memory_allocated`` over the timed steps, max over ranks; None on
CPU), tokens per second (global batch), the first step's loss (mean over
microbatches and replicas), schedule, pp, dp, device, torch version, date.
An engine that raises is recorded with ``"status": "failed"`` and its error;
the run goes on with the next engine.  After all engines: a loss check (the
engines' first-step losses must agree; loose tolerance) is printed.

``--check`` runs one step per engine instead of timing and compares every
parameter's gradient (FSDP shards gathered with ``full_tensor()``) of each
pipeloom engine with torch's: ``rtol 1e-4`` in float32 (``5e-2`` in bf16).
Exit status 1 on a mismatch.

On the 4-GPU machine (pipeloom installed, e.g. ``pip install -e .``; NVLink
multicast off), one process launch per schedule, so a hang costs one schedule;
rows are written as they exist (``bash benchmarks/gpu_run.sh fsdp`` does the
same, with the project installed from the checkout):

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    timeout 300 torchrun --nproc-per-node 4 benchmarks/gpu_fsdp.py --schedule 1F1B --json out.jsonl
    timeout 300 torchrun --nproc-per-node 4 benchmarks/gpu_fsdp.py --schedule Interleaved1F1B --json out.jsonl
    timeout 300 torchrun --nproc-per-node 4 benchmarks/gpu_fsdp.py --schedule ZBVZeroBubble --json out.jsonl
    python benchmarks/gpu_fsdp.py --table out.jsonl

and, to check the gradients on the GPUs first (float32, a small model; about 20 s each):

    timeout 120 torchrun --nproc-per-node 4 benchmarks/gpu_fsdp.py --schedule ZBVZeroBubble --check \
        --dtype fp32 --layers 4 --hidden 256 --heads 4 --seq 128

CPU smoke test (gloo, tiny model, float32), the same code paths:

    timeout 300 python -m torch.distributed.run --nproc-per-node 4 benchmarks/gpu_fsdp.py --device cpu \\
        --layers 4 --hidden 32 --heads 4 --seq 16 --microbatches 4 --mbsize 2 --steps 3 --warmup 1 \\
        --schedule ZBVZeroBubble [--check] [--json smoke.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

__all__ = ["main", "table"]

ENGINES = ("pipeloom-overlap", "pipeloom-no-overlap", "torch-fsdp")


# ---------------------------------------------------------------- model: gpu_pipeline.py's

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import StepTimer  # noqa: E402
from gpu_pipeline import _loss, _model, _stages_of  # noqa: E402


# ---------------------------------------------------------------- measurement


class _Env(StepTimer):
    """What every engine shares: device, mesh, data, and the helpers that depend on the device."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cuda = args.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.dtype = {"auto": torch.bfloat16 if self.cuda else torch.float32, "bf16": torch.bfloat16,
                      "fp32": torch.float32, "fp64": torch.float64}[args.dtype]
        if self.world % args.dp:
            raise SystemExit(f"--dp {args.dp} does not divide the {self.world} ranks")
        self.dp, self.pp = args.dp, self.world // args.dp
        self.mesh = init_device_mesh(self.device.type, (self.pp, self.dp), mesh_dim_names=("pp", "dp"))
        self.pp_rank, self.dp_rank = self.rank // self.dp, self.rank % self.dp
        assert self.mesh.get_local_rank("pp") == self.pp_rank and self.mesh.get_local_rank("dp") == self.dp_rank

        from pipeloom.schedules import default_stages_per_rank

        self.name = args.schedule
        self.spr = default_stages_per_rank(self.name)
        self.num_stages = self.pp * self.spr
        if args.layers % self.num_stages:
            raise SystemExit(f"--layers {args.layers} is not a multiple of the {self.num_stages} stages")
        self.mine = _stages_of(self.name, self.pp_rank, self.pp, self.spr)
        n, mb = args.microbatches, args.mbsize
        g = torch.Generator().manual_seed(7)
        rows = self.dp * n * mb  # the global batch; replica d trains on part d of tensor_split(., dp)
        self.x = torch.randn(rows, args.seq, args.hidden, generator=g).to(self.device, self.dtype)
        self.y = torch.randn(rows, args.seq, args.hidden, generator=g).to(self.device, self.dtype)
        self.tokens = rows * args.seq

    def torch_groups(self) -> tuple[Any, Any]:
        """torch-fsdp's pipeline group and its FSDP mesh: the ranks of the ``("pp", "dp")`` mesh's two dimensions.

        Built from groups with a timeout of ``--torch-timeout`` (the mesh's own groups wait 10
        to 30 minutes): a torch engine that fails on some ranks would leave their pipeline or
        FSDP peers waiting; with the timeout those fail too (gloo: an exception, recorded; NCCL:
        the watchdog ends the process, after the rows already written) instead of hanging.
        """
        import datetime

        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if getattr(self, "_torch_groups", None) is None:
            timeout = datetime.timedelta(seconds=self.args.torch_timeout)
            grid = self.mesh.mesh.tolist()  # grid[i][j]: global rank of pipeline rank i in replica j
            pp_group = dp_group = None
            for j in range(self.dp):  # every rank creates every group, in the same order
                g = dist.new_group([row[j] for row in grid], timeout=timeout)
                if j == self.dp_rank:
                    pp_group = g
            for i in range(self.pp):
                g = dist.new_group(list(grid[i]), timeout=timeout)
                if i == self.pp_rank:
                    dp_group = g
            assert pp_group is not None and dp_group is not None
            dp_mesh = DeviceMesh.from_group(dp_group, self.device.type, mesh_dim_names=("dp",))
            assert dp_mesh.mesh.tolist() == self.mesh["dp"].mesh.tolist(), (dp_mesh, self.mesh)
            self._torch_groups = (pp_group, dp_mesh)
        return self._torch_groups

    def global_loss(self, losses: list[Any] | None) -> float:
        """Mean loss over microbatches and replicas (the dp ranks holding the last stage contribute); every rank calls this."""
        mine = float(sum(float(l.detach()) for l in losses) / len(losses)) if losses else 0.0
        return self.reduce(mine, "sum") / self.dp

    def free(self) -> None:
        """Release what the engine just run held, so the next one starts clean (see ``mem_before_gib``)."""
        import gc

        import torch

        gc.collect()
        if self.cuda:
            # Some of it goes only once threads and NCCL's watchdog let go: wait (at most 2 s) until
            # the allocated memory stops shrinking.
            torch.cuda.synchronize()
            last = torch.cuda.memory_allocated()
            for _ in range(10):
                time.sleep(0.2)
                gc.collect()
                now = torch.cuda.memory_allocated()
                if now >= last:
                    break
                last = now
            torch.cuda.empty_cache()


def _zero(mods: dict[int, Any]) -> None:
    for m in mods.values():
        m.zero_grad(set_to_none=True)


def _full_grads(mods: dict[int, Any]) -> dict[str, Any]:
    """Every parameter's gradient, FSDP shards gathered (a collective over "dp": same order on every replica)."""
    import torch

    out = {}
    for s in sorted(mods):
        for name, p in mods[s].named_parameters():
            g = p.grad
            if g is not None and hasattr(g, "full_tensor"):
                g = g.full_tensor()
            out[f"s{s}.{name}"] = None if g is None else g.detach().to("cpu", torch.float64)
    return out


class _Run:
    """One engine, set up: ``step()`` runs one training step; ``mods`` are its stage modules."""

    mods: dict[int, Any]
    step: Callable[[], None]
    losses: list[Any]
    extra: dict[str, Any]

    def close(self) -> None:
        pass


def _pipeloom(env: _Env, overlap: bool) -> _Run:
    import pipeloom

    args = env.args
    built: dict[int, Any] = {}

    def stage_fn(s: int) -> Any:
        built[s] = _model(args, env.num_stages, s, env.device, env.dtype)
        return built[s]

    pipe = pipeloom.Pipeline(
        stage_fn, schedule=env.name, num_microbatches=args.microbatches, loss_fn=_loss,
        data_parallel=env.dp, mesh=env.mesh, fsdp=True, fsdp_wrap="blocks", prefetch=args.prefetch,
        overlap_collectives=overlap, device=env.device,
    )
    assert sorted(pipe.stages) == sorted(env.mine), (sorted(pipe.stages), env.mine)
    run = _Run()
    run.mods = pipe.stages
    run.losses = []
    run.extra = {"fsdp_wrap": "blocks", "prefetch": args.prefetch, "overlap_collectives": overlap}

    def step() -> None:
        _zero(run.mods)
        run.losses = []
        pipe.step(env.x, target=env.y, losses=run.losses)

    def close() -> None:
        st = pipe.statistics
        run.extra["out_of_order"] = st.out_of_order if st else None
        pipe.close()

    run.step = step
    run.close = close  # type: ignore[method-assign]
    return run


def _torch_fsdp(env: _Env) -> _Run:
    """torch.distributed.pipelining + FSDP2 on the same stage modules (see the module docstring)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    args = env.args
    cls = get_schedule_class(env.name)
    single = issubclass(cls, PipelineScheduleSingle)
    if single != (env.spr == 1):
        raise RuntimeError(f"{env.name}: torch's class {cls.__name__} and pipeloom disagree on stages per rank ({env.spr})")
    pp_group, dp_mesh = env.torch_groups()  # the mesh's "pp" ranks and its "dp" dimension (see torch_groups)
    mods: dict[int, Any] = {}
    for s in env.mine:
        m = _model(args, env.num_stages, s, env.device, env.dtype)
        for block in m.children():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(m, mesh=dp_mesh, reshard_after_forward=False)
        mods[s] = m
    shape = (args.mbsize, args.seq, args.hidden)

    def ex(requires_grad: bool) -> Any:
        # Static shapes.  requires_grad matters on torch >= 2.13, which derives the gradient
        # transfers from it (an output example without it: no gradient is sent back); 2.11 ignores it.
        return torch.empty(shape, device=env.device, dtype=env.dtype, requires_grad=requires_grad)

    stages = [PipelineStage(mods[s], s, env.num_stages, env.device, input_args=(ex(s != 0),), output_args=(ex(True),),
                            group=pp_group)
              for s in env.mine]
    sched = cls(stages[0] if single else stages, args.microbatches, loss_fn=_loss)
    # this replica's part of the global batch, as pipeloom's replica_share cuts it
    x = torch.tensor_split(env.x, env.dp)[env.dp_rank]
    y = torch.tensor_split(env.y, env.dp)[env.dp_rank]
    first, last = 0 in mods, env.num_stages - 1 in mods
    run = _Run()
    run.mods = mods
    run.losses = []
    run.extra = {"fsdp_wrap": "blocks+root", "reshard_after_forward": False}

    def step() -> None:
        _zero(mods)
        run.losses = []
        sched.step(*((x,) if first else ()), target=y if last else None, losses=run.losses if last else None)

    run.step = step
    return run


def _make(env: _Env, engine: str) -> _Run:
    if engine == "pipeloom-overlap":
        return _pipeloom(env, overlap=True)
    if engine == "pipeloom-no-overlap":
        return _pipeloom(env, overlap=False)
    if engine == "torch-fsdp":
        return _torch_fsdp(env)
    raise SystemExit(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")


def _agree(env: _Env, err: str | None) -> str | None:
    """Every rank's error (or None), gathered: the first one, naming its rank, or None if all succeeded."""
    import torch.distributed as dist

    errs: list[Any] = [None] * env.world
    dist.all_gather_object(errs, err)
    bad = [(r, e) for r, e in enumerate(errs) if e]
    return None if not bad else f"rank {bad[0][0]}: {bad[0][1]}"


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()[:2000]


def _say(env: _Env, line: str) -> None:
    if env.rank == 0:
        print(line, flush=True)


def _base_row(env: _Env, engine: str) -> dict[str, Any]:
    import torch

    a = env.args
    return {
        "engine": engine, "schedule": env.name, "pp": env.pp, "dp": env.dp, "stages": env.num_stages,
        "layers": a.layers, "hidden": a.hidden, "heads": a.heads, "seq": a.seq, "microbatches": a.microbatches,
        "mbsize": a.mbsize, "dtype": str(env.dtype).replace("torch.", ""), "order": a.engines,
        "device": torch.cuda.get_device_name() if env.cuda else "cpu (gloo)", "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def _emit(env: _Env, row: dict[str, Any]) -> None:
    if env.rank == 0:  # each row as soon as it exists: a later hang must not lose it
        print(json.dumps(row), flush=True)
        if env.args.json:
            with open(env.args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


def bench(env: _Env, engines: list[str]) -> int:
    args = env.args
    first_loss: dict[str, float] = {}
    for engine in engines:
        row = _base_row(env, engine)
        err: str | None = None
        run: _Run | None = None
        times: list[float] = []
        peak: int | None = None
        loss = float("nan")
        if env.cuda:  # what is still allocated when the engine starts (data; anything an earlier engine left)
            import torch

            row["mem_before_gib"] = env.reduce(float(torch.cuda.memory_allocated())) / 2**30
        try:
            run = _make(env, engine)
            run.step()  # the first warm-up step; its loss is the one the engines must agree on
            losses = run.losses
        except Exception as exc:  # recorded, and the run goes on with the next engine
            err = _error(exc)
            traceback.print_exc()
            losses = None
        err = _agree(env, err)
        if err is None:
            loss = env.global_loss(losses)
            try:
                times, peak = env.timed(run.step, args.steps, max(0, args.warmup - 1))  # type: ignore[union-attr]
            except Exception as exc:
                err = _error(exc)
                traceback.print_exc()
            err = _agree(env, err)
        if run is not None:
            try:
                run.close()
            except Exception:
                traceback.print_exc()
            row.update(run.extra)
        if err is None:
            step = env.reduce(statistics.median(times))
            peak_max = env.reduce(float(peak)) if peak is not None else None
            first_loss[engine] = loss
            row.update(status="ok", step_ms=step * 1e3, peak_gib=None if peak_max is None else peak_max / 2**30,
                       tokens_per_s=env.tokens / step, loss=loss, steps=args.steps, warmup=args.warmup)
        else:
            row.update(status="failed", error=err)
        _emit(env, row)
        del run
        env.free()
    if len(first_loss) > 1:
        ref_name, ref = next(iter(first_loss.items()))
        rtol = 1e-4 if env.dtype != _bf16() else 2e-2
        worst = max(abs(v - ref) / max(abs(ref), 1e-12) for v in first_loss.values())
        verdict = "OK" if worst <= rtol else "MISMATCH"
        _say(env, f"loss check {env.name}: first-step loss " + ", ".join(f"{k} {v:.6g}" for k, v in first_loss.items())
             + f": {verdict} (max relative difference {worst:.2e}, tolerance {rtol:g})")
    return 0


def _bf16() -> Any:
    import torch

    return torch.bfloat16


def check(env: _Env, engines: list[str]) -> int:
    """One step per engine; every pipeloom engine's gradients (and losses) against torch's."""
    import torch

    grads: dict[str, dict[str, Any]] = {}
    losses: dict[str, float] = {}
    failed: dict[str, str] = {}
    for engine in engines:
        err: str | None = None
        run: _Run | None = None
        try:
            run = _make(env, engine)
            run.step()
        except Exception as exc:
            err = _error(exc)
            traceback.print_exc()
        err = _agree(env, err)
        if err is None:
            grads[engine] = _full_grads(run.mods)  # type: ignore[union-attr]
            losses[engine] = env.global_loss(run.losses)  # type: ignore[union-attr]
        else:
            failed[engine] = err
            _say(env, f"check {env.name}: {engine} FAILED: {err}")
            _emit(env, {**_base_row(env, engine), "status": "failed", "error": err, "mode": "check"})
        if run is not None:
            try:
                run.close()
            except Exception:
                traceback.print_exc()
        del run
        env.free()
    ref_name = "torch-fsdp" if "torch-fsdp" in grads else next(iter(grads), None)
    rtol = 5e-2 if env.dtype == torch.bfloat16 else 1e-4
    bad = 0
    for engine, got in grads.items():
        if engine == ref_name:
            continue
        want = grads[ref_name]  # type: ignore[index]
        worst = 0.0
        norm2 = 0.0
        problems = []
        if set(got) != set(want):
            problems.append(f"parameters differ: {sorted(set(got) ^ set(want))[:4]}")
        for k in sorted(set(got) & set(want)):
            a, b = got[k], want[k]
            if a is None or b is None:
                if not (a is None and b is None):
                    problems.append(f"{k}: gradient missing on {'this engine' if a is None else ref_name}")
                continue
            norm2 += float((a * a).sum())
            scale = float(b.abs().max())
            diff = float((a - b).abs().max())
            worst = max(worst, diff / scale if scale > 0 else diff)
            if not torch.allclose(a, b, rtol=rtol, atol=rtol * 1e-2 * max(scale, 1e-30)):
                problems.append(f"{k}: max |diff| {diff:.3e}, max |grad| {scale:.3e}")
        # every rank checked its own stages: agree on the verdict
        nprob = int(env.reduce(float(len(problems)), "sum"))
        worst_all = env.reduce(worst)
        norm = math.sqrt(env.reduce(norm2, "sum") / env.dp)  # every replica holds the same full gradients
        lw = abs(losses[engine] - losses[ref_name]) / max(abs(losses[ref_name]), 1e-12)  # type: ignore[index]
        ok = nprob == 0 and lw <= rtol
        bad += not ok
        if problems:
            print(f"[rank {env.rank}] {engine} vs {ref_name}: " + "; ".join(problems[:5]), flush=True)
        _say(env, f"check {env.name}: {engine} vs {ref_name}: {'OK' if ok else 'MISMATCH'} "
                  f"({len(got)} gradients on rank 0, norm {norm:.4g}, max relative difference {worst_all:.2e} over all ranks, "
                  f"rtol {rtol:g}; loss {losses[engine]:.6g} vs {losses[ref_name]:.6g})")  # type: ignore[index]
    if ref_name is None or len(grads) < 2:
        _say(env, f"check {env.name}: fewer than two engines ran; nothing compared")
        return 1
    return 1 if bad or failed else 0


# ---------------------------------------------------------------- table


def table(path: str) -> str:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    by: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        if r.get("mode") == "check":
            continue
        key = (r["schedule"], r.get("pp"), r.get("dp"), r.get("device"), r.get("dtype"))
        by.setdefault(key, {})[r["engine"]] = r  # the last row of an engine wins

    def ms(r: dict[str, Any] | None) -> str:
        if r is None:
            return "—"
        if r.get("status") == "failed":
            return "failed"
        return f"{r['step_ms']:.1f}"

    def gib(r: dict[str, Any] | None) -> str:
        return f"{r['peak_gib']:.2f}" if r and r.get("peak_gib") is not None else "—"

    def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
        ok = a and b and a.get("status") == "ok" and b.get("status") == "ok"
        return f"{a['step_ms'] / b['step_ms']:.3f}" if ok else "—"  # type: ignore[index]

    out = ["| schedule | pp x dp | device | torch-fsdp ms | pipeloom-overlap ms | pipeloom-no-overlap ms | overlap/torch | "
           "no-overlap/overlap | torch GiB | overlap GiB | no-overlap GiB | first-step loss (torch / overlap / no-overlap) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    failures = []
    for (sched, pp, dp, device, _dtype), e in by.items():
        t, o, n = e.get("torch-fsdp"), e.get("pipeloom-overlap"), e.get("pipeloom-no-overlap")
        loss = " / ".join(f"{r['loss']:.5g}" if r and r.get("status") == "ok" else "—" for r in (t, o, n))
        out.append(f"| {sched} | {pp} x {dp} | {device} | {ms(t)} | {ms(o)} | {ms(n)} | {ratio(o, t)} | {ratio(n, o)} | "
                   f"{gib(t)} | {gib(o)} | {gib(n)} | {loss} |")
        failures += [f"- {sched} {r['engine']}: {r.get('error')}" for r in (t, o, n) if r and r.get("status") == "failed"]
    if failures:
        out += ["", "Failed:", *failures]
    return "\n".join(out)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--schedule", default="1F1B")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, in the order to run: {', '.join(ENGINES)}")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda: NCCL, one GPU per rank; cpu: gloo")
    ap.add_argument("--dtype", choices=("auto", "bf16", "fp32", "fp64"), default="auto", help="auto: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--dp", type=int, default=2, help="FSDP ranks per stage; pipeline ranks = world / dp")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=8, help="per replica")
    ap.add_argument("--mbsize", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps before timing (at least 1 runs)")
    ap.add_argument("--prefetch", type=int, default=1, help="pipeloom: stage switches ahead that an all-gather is issued")
    ap.add_argument("--check", action="store_true", help="one step per engine; compare gradients with torch's instead of timing")
    ap.add_argument("--json", default=None, help="append result rows (JSON Lines) here")
    ap.add_argument("--table", default=None, help="print the table of a results file and exit")
    ap.add_argument("--pg-timeout", type=float, default=600, help="process group timeout, seconds")
    ap.add_argument("--torch-timeout", type=float, default=120, help="timeout of torch-fsdp's pipeline p2p group, seconds")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        ap.error(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    import datetime

    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=args.pg_timeout)
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=timeout)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        dist.init_process_group("gloo", timeout=timeout)
    try:
        env = _Env(args)
        _say(env, f"{env.name}: pp {env.pp} x dp {env.dp}, {env.num_stages} stages, {args.layers} layers, hidden {args.hidden}, "
                  f"seq {args.seq}, {args.microbatches} x {args.mbsize} per replica, {env.dtype}, {env.device.type}, "
                  f"torch {torch.__version__}; engines {', '.join(engines)}")
        rc = check(env, engines) if args.check else bench(env, engines)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
