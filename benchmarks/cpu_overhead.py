"""How much does pipeloom's dispatch cost per action, against torch.distributed.pipelining?

The model is chosen so that the runtime, not the math, is what is timed:
every stage is one ``Linear(16, 16)`` + tanh, and a step is 8 microbatches of
4 rows, so an action's compute is a few tens of microseconds and a step's
time is almost all scheduling, messaging and transfers.  Two gloo ranks on
this machine run, for each of the 7 named schedules, the *same* stages (same
seed), schedule class, microbatches and batch through

* torch: ``PipelineStage`` + torch's schedule class of the same name, and
* pipeloom: ``Pipeline`` with the same schedule name,

in the same processes, alternating blocks of steps between the two (so a
noisy neighbour on the shared machine hits both alike).  Every timed step is
preceded by a barrier so both ranks start together; a step's time is the
slower rank's, and the table shows the median over the timed steps after
warm-up steps (torch's first step also infers shapes).

Per-action dispatch overhead of pipeloom, in microseconds, estimated as::

    (step time - idle time - compute time) / actions        (per rank, then averaged)

* step time: the rank's own wall time of ``pipe.step``;
* idle time: ``pipe.statistics.idle_seconds``, the time the dispatcher slept
  with nothing ready (waiting for the other rank is not overhead of this one);
* compute time: the sum, over the rank's compute actions in the schedule, of
  each action's time measured in one process with ``time.perf_counter`` around
  the same stage-module calls the runtime makes (forward + loss; backward;
  ``autograd.grad`` for I; gradient accumulation for W), median of many runs;
* actions: compute actions the rank ran (``statistics.actions_run``; an
  OVERLAP_F_B pair counts once).

So the overhead includes everything pipeloom does around the math: choosing
the next action, announcing and posting transfers, waking on arrivals,
draining sends at the end of the step.  It is an estimate: the in-process
compute times are measured on a warm, uncontended process, so they are a
lower bound and the overhead an upper bound.

Usage::

    python benchmarks/cpu_overhead.py [--steps 30] [--warmup 5] [--names 1F1B,DualPipeV] [--profile 1F1B]

It starts its own 2 ranks (or runs as the ranks under ``pipeloom launch`` /
``torchrun``); rank 0 prints the table.  ``--profile NAME`` also runs extra
pipeloom steps of that schedule under cProfile on rank 0 and prints where the
time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Stage", "main", "measure_compute"]

DIM = 16
MICROBATCHES = 8
ROWS_PER_MICROBATCH = 4
WORLD = 2
REPO = Path(__file__).resolve().parents[1]


class Stage(nn.Module):
    """One tiny stage: Linear + tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def build_stages(num_stages: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [Stage() for _ in range(num_stages)]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    rows = MICROBATCHES * ROWS_PER_MICROBATCH
    return torch.randn(rows, DIM, generator=g), torch.randn(rows, DIM, generator=g)


def stage_ranks(name: str, world: int) -> tuple[int, dict[int, list[int]]]:
    """(num_stages, rank -> its stages) as both engines place them."""
    from pipeloom.schedules import default_stages_per_rank, placement_style

    spr = default_stages_per_rank(name)
    num_stages = world * spr
    if placement_style(name) == "v":
        return num_stages, {r: [r, 2 * world - 1 - r] for r in range(world)}
    return num_stages, {r: [r + k * world for k in range(spr)] for r in range(world)}


# ---------------------------------------------------------------- ranks


def _timed_steps(step: Callable[[], Any], n: int, cpu: list[float], after: Callable[[], None] | None = None) -> list[float]:
    """Wall time of each of ``n`` steps; the process's CPU time of each (every thread) appended to ``cpu``."""
    times = []
    for _ in range(n):
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if after is not None:
            after()
    return times


def run_schedule(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Time torch and pipeloom on this rank for one schedule."""
    import pipeloom
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    rank, world = dist.get_rank(), dist.get_world_size()
    num_stages, placement = stage_ranks(name, world)
    mine = placement[rank]
    x, y = batch()

    # torch: its own copy of the same stages.
    t_stages = build_stages(num_stages)
    cls = get_schedule_class(name)
    pstages = [PipelineStage(t_stages[s], s, num_stages, torch.device("cpu")) for s in mine]
    single = issubclass(cls, PipelineScheduleSingle)
    t_sched = cls(pstages[0] if single else pstages, MICROBATCHES, loss_fn=loss_fn)
    t_args = (x,) if 0 in mine else ()
    t_target = y if num_stages - 1 in mine else None

    def torch_step() -> None:
        for s in mine:
            t_stages[s].zero_grad(set_to_none=True)
        t_sched.step(*t_args, target=t_target)

    # pipeloom: another copy of the same stages.
    p_stages = build_stages(num_stages)
    options = None
    if args.options:
        from pipeloom.runtime.options import RuntimeOptions, parse_fields

        options = RuntimeOptions.from_env(**parse_fields(args.options))
    pipe = pipeloom.Pipeline(lambda s: p_stages[s], schedule=name, num_microbatches=MICROBATCHES, loss_fn=loss_fn, options=options)
    p_stats: list[tuple[float, int]] = []

    def pipeloom_step() -> None:
        for m in pipe.stages.values():
            m.zero_grad(set_to_none=True)
        pipe.step(x, target=y)

    def record() -> None:
        st = pipe.statistics
        p_stats.append((float(getattr(st, "idle_seconds", 0.0)), int(getattr(st, "actions_run", 0))))

    for _ in range(args.warmup):
        dist.barrier()
        torch_step()
        dist.barrier()
        pipeloom_step()
    times: dict[str, list[float]] = {"torch": [], "pipeloom": []}
    cpu: dict[str, list[float]] = {"torch": [], "pipeloom": []}
    block = max(1, args.steps // args.blocks)
    for b in range(args.blocks):
        order = ("torch", "pipeloom") if b % 2 == 0 else ("pipeloom", "torch")
        for engine in order:
            if engine == "torch":
                times["torch"] += _timed_steps(torch_step, block, cpu["torch"])
            else:
                times["pipeloom"] += _timed_steps(pipeloom_step, block, cpu["pipeloom"], record)

    profile = None
    if args.profile == name:
        prof = cProfile.Profile() if rank == 0 else None
        dist.barrier()
        if prof is not None:
            prof.enable()
        for _ in range(args.steps):
            pipeloom_step()
        if prof is not None:
            prof.disable()
            out = io.StringIO()
            ps = pstats.Stats(prof, stream=out)
            ps.sort_stats("tottime").print_stats(25)
            ps.sort_stats("cumulative").print_stats(30)
            profile = out.getvalue()
    dist.barrier()
    pipe.close()
    return {"times": times, "cpu": cpu, "pipeloom_stats": p_stats, "profile": profile}


def rank_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != WORLD:
        raise SystemExit(f"cpu_overhead.py runs on exactly {WORLD} ranks, got {dist.get_world_size()}")
    mine: dict[str, Any] = {}
    for name in args.names:
        mine[name] = run_schedule(name, args)
        if rank == 0:
            print(f"  timed {name}", file=sys.stderr, flush=True)
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    if rank == 0:
        print_report(everyone, args)


# ---------------------------------------------------------------- compute, in one process


def _median_time(fn: Callable[..., Any], setup: Callable[[], tuple[Any, ...]], repeat: int) -> float:
    """Median seconds of ``fn(*setup())``, timing only ``fn``."""
    samples = []
    for _ in range(repeat):
        args = setup()
        t0 = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure_compute(num_stages: int, repeat: int = 300) -> dict[tuple[str, int], float]:
    """Seconds per action type (F, B, I, W) and stage, with the calls the runtime makes."""
    torch.set_num_threads(1)
    stages = build_stages(num_stages)
    x, y = batch()
    xm, ym = x[:ROWS_PER_MICROBATCH], y[:ROWS_PER_MICROBATCH]
    scale = 1.0 / MICROBATCHES
    out: dict[tuple[str, int], float] = {}
    for s, mod in enumerate(stages):
        last = s == num_stages - 1
        params = list(mod.parameters())

        def inp() -> torch.Tensor:
            return xm.clone() if s == 0 else xm.clone().requires_grad_(True)

        def fwd(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            o = mod(h)
            return h, (loss_fn(o, ym) if last else o)

        def roots(o: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
            return ([o * scale], None) if last else ([o], [torch.ones_like(o)])

        def run_b(state: tuple[torch.Tensor, torch.Tensor]) -> None:
            r, g = roots(state[1])
            torch.autograd.backward(r, g)

        def run_i(state: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
            h, o = state
            r, g = roots(o)
            targets = ([h] if h.requires_grad else []) + params
            return torch.autograd.grad(r, targets, g, allow_unused=True)

        grads = [torch.ones_like(p) for p in params]

        def run_w() -> None:
            for p, g in zip(params, grads):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.add_(g)

        for _ in range(20):  # warm up allocator and autograd
            run_b(fwd(inp()))
        out[("F", s)] = _median_time(fwd, lambda: (inp(),), repeat)
        out[("B", s)] = _median_time(run_b, lambda: (fwd(inp()),), repeat)
        out[("I", s)] = _median_time(run_i, lambda: (fwd(inp()),), repeat)
        out[("W", s)] = _median_time(run_w, lambda: (), repeat)
    return out


def rank_compute(name: str, rank: int, costs: dict[tuple[str, int], float]) -> tuple[float, int]:
    """(compute seconds, compute actions) of a rank's list in the named schedule."""
    from pipeloom.schedules import generate

    sched = generate(name, num_ranks=WORLD, num_microbatches=MICROBATCHES)
    total, count = 0.0, 0
    for a in sched.actions[rank]:
        if not a.is_compute:
            continue
        count += 1
        for leaf in a.leaves():
            total += costs[(leaf.type.name, leaf.stage)]
    return total, count


# ---------------------------------------------------------------- report


def print_report(everyone: list[dict[str, Any]], args: argparse.Namespace) -> None:
    rows = []
    profiles: list[str] = []
    cost_cache: dict[int, dict[tuple[str, int], float]] = {}
    for name in args.names:
        per_rank = [r[name] for r in everyone]
        step_t = {
            eng: statistics.median(max(ts) for ts in zip(*(r["times"][eng] for r in per_rank)))
            for eng in ("torch", "pipeloom")
        }
        num_stages, _ = stage_ranks(name, WORLD)
        if num_stages not in cost_cache:
            cost_cache[num_stages] = measure_compute(num_stages)
        costs = cost_cache[num_stages]
        # CPU time per step, summed over the ranks (every thread of each process): what the
        # engine costs the machine, which wall time on a shared 2-core machine hides or inflates
        cpu_t = {eng: sum(statistics.median(r["cpu"][eng]) for r in per_rank) for eng in ("torch", "pipeloom")}
        overheads, actions, computes, idles, cpu_over = [], [], [], [], []
        for rank, r in enumerate(per_rank):
            compute, listed = rank_compute(name, rank, costs)
            busy = [t - idle for t, (idle, _) in zip(r["times"]["pipeloom"], r["pipeloom_stats"])]
            ran = statistics.median(n for _, n in r["pipeloom_stats"]) or listed
            overheads.append((statistics.median(busy) - compute) / ran)
            cpu_over.append((statistics.median(r["cpu"]["pipeloom"]) - compute) / ran)
            actions.append(int(ran))
            computes.append(compute)
            idles.append(statistics.median(idle for idle, _ in r["pipeloom_stats"]))
        rows.append((name, step_t["torch"], step_t["pipeloom"], overheads, actions, computes, idles, cpu_t, cpu_over))
        if any(r["profile"] for r in per_rank):
            profiles.extend(r["profile"] for r in per_rank if r["profile"])

    print(
        f"\npipeloom vs torch.distributed.pipelining, {WORLD} gloo ranks on {os.cpu_count()} cores, torch {torch.__version__}; "
        f"stages Linear({DIM},{DIM})+tanh, {MICROBATCHES} microbatches x {ROWS_PER_MICROBATCH} rows; "
        f"median of {args.steps} steps after {args.warmup} warm-up\n"
    )
    head = (f"{'schedule':<22} {'torch ms/step':>13} {'pipeloom ms/step':>16} {'ratio pl/torch':>14} {'pl us/action':>12} "
            f"{'torch CPU ms':>12} {'pl CPU ms':>9} {'CPU ratio':>9} {'pl CPU us/act':>13} {'actions/rank':>12} {'compute ms/rank':>15} {'idle ms/rank':>12}")
    print(head)
    print("-" * len(head))
    for name, tt, pt, ov, act, comp, idle, ct, cov in rows:
        print(
            f"{name:<22} {tt * 1e3:>13.2f} {pt * 1e3:>16.2f} {pt / tt:>14.2f} {statistics.mean(ov) * 1e6:>12.0f} "
            f"{ct['torch'] * 1e3:>12.2f} {ct['pipeloom'] * 1e3:>9.2f} {ct['pipeloom'] / ct['torch']:>9.2f} {statistics.mean(cov) * 1e6:>13.0f} "
            f"{'/'.join(map(str, act)):>12} {'/'.join(f'{c * 1e3:.2f}' for c in comp):>15} "
            f"{'/'.join(f'{i * 1e3:.2f}' for i in idle):>12}"
        )
    print(
        "\npl us/action = (pipeloom step time - idle - in-process compute) / compute actions, per rank, averaged; "
        "per-rank columns are rank0/rank1.\n"
        "CPU ms = the processes' CPU time per step (all threads: loop, gloo and ZeroMQ I/O, receiver threads), "
        "median per rank, summed over ranks; pl CPU us/act = (a rank's CPU time per step - its compute) / its "
        "actions, averaged: the host cost of an action, robust to other load on the machine."
    )
    for p in profiles:
        print(f"\n--- cProfile of pipeloom steps on rank 0 ({args.profile}) ---\n{p}")


# ---------------------------------------------------------------- entry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(argv: Sequence[str]) -> int:
    """Start the 2 ranks of this script; rank 0's output is the report."""
    port = _free_port()
    procs = []
    for r in range(WORLD):
        env = dict(os.environ)
        env.update(
            RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        )
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, *argv], env=env, start_new_session=True,
                stdout=None if r == 0 else subprocess.DEVNULL,
            )
        )
    try:
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    if any(codes):
        print(f"cpu_overhead.py: ranks exited with {codes}", file=sys.stderr)
        return 1
    return 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from pipeloom.schedules import SCHEDULE_NAMES, canonical_name

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per engine and schedule")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per engine first")
    p.add_argument("--blocks", type=int, default=3, help="alternating torch/pipeloom blocks the timed steps are cut into")
    p.add_argument("--names", default=",".join(SCHEDULE_NAMES), help="comma-separated schedules")
    p.add_argument("--options", default="", metavar="K=V,...", help="RuntimeOptions fields for pipeloom (e.g. gloo_prepost_depth=4)")
    p.add_argument("--profile", default=None, metavar="NAME", help="also cProfile pipeloom steps of this schedule on rank 0")
    args = p.parse_args(argv)
    args.names = [canonical_name(n) for n in args.names.split(",") if n.strip()]
    if args.profile:
        args.profile = canonical_name(args.profile)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if "RANK" not in os.environ:
        return spawn(argv)
    rank_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
