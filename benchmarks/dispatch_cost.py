"""The runtime's own cost per action, with no transfers: one rank, every stage local.

``cpu_overhead.py`` measures pipeloom's step against torch's on two gloo
ranks; its per-action figure mixes three things: the dispatcher's own path
(choosing, bookkeeping, stage calls), the transport (posting and completing
gloo sends and receives, thread hops) and waiting for the peer.  This
benchmark takes the transport and the peer away: one process, a world of one,
the schedule's stages all local (hand-offs between them are in-process), so
what is left above the math is the dispatcher's path alone.

For each schedule, blocks of steps alternate between

* pipeloom: ``Pipeline`` on the stages, ``step(x, target=y)``;
* the floor: the same math by hand, the way the runtime calls it -- per
  microbatch, each stage's forward on a detached input that requires grad,
  the loss, then each stage's backward with the gradient of its output;

and the table shows the medians and the extra time per action (the median,
over blocks, of a block's pipeloom median less the floor's median next to it,
divided by the actions) in microseconds (actions: ``statistics.actions_run``, the last step's).  Each
schedule runs at ``--microbatches`` m and 2m: the runtime's extra time grows
by the per-action cost times the extra actions, so the two give it apart from
the per-step cost (splitting the batch, the loop's entry and exit, the step's
bookkeeping): ``per action = (extra(2m) - extra(m)) / (actions(2m) -
actions(m))``, ``per step = extra(m) - per action x actions(m)``.  torch's
runtime cannot be the reference here: its multi-stage schedules on one rank
fail in the backward (torch 2.13: "grad can be implicitly created only for
scalar outputs" at the first B).

Usage::

    python benchmarks/dispatch_cost.py [--steps 200] [--blocks 4] [--names Interleaved1F1B,LoopedBFS,GPipe]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from torch import nn

__all__ = ["main"]


def _floor_step(mods: list[nn.Module], x: torch.Tensor, y: torch.Tensor, n: int) -> None:
    for xm, ym in zip(x.chunk(n), y.chunk(n)):
        ins, outs = [], []
        h = xm
        for m in mods:
            a = h.detach().requires_grad_(True)
            h = m(a)
            ins.append(a)
            outs.append(h)
        loss = ((h - ym) ** 2).mean()
        loss.backward()
        for k in range(len(mods) - 2, -1, -1):
            torch.autograd.backward(outs[k], ins[k + 1].grad)


def run(name: str, steps: int, blocks: int, warmup: int, dim: int, n: int) -> dict[str, Any]:
    import pipeloom
    from pipeloom.schedules import default_stages_per_rank

    stages = default_stages_per_rank(name)
    torch.manual_seed(0)
    mods = [nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(max(stages, 2))]
    if stages == 1:  # one stage: the whole model
        stage_mods = [nn.Sequential(*mods)]
    else:
        stage_mods = mods[:stages]
    pipe = pipeloom.Pipeline(lambda s: stage_mods[s], schedule=name, num_microbatches=n,
                             loss_fn=lambda o, t: ((o - t) ** 2).mean())
    x, y = torch.randn(4 * n, dim), torch.randn(4 * n, dim)
    floor_mods = stage_mods
    for _ in range(warmup):
        pipe.step(x, target=y)
        _floor_step(floor_mods, x, y, n)
    actions = pipe.statistics.actions_run  # (the last step's)
    tp: list[float] = []
    tf: list[float] = []
    per = max(1, steps // blocks)
    for _ in range(blocks):
        for _ in range(per):
            t = time.perf_counter()
            pipe.step(x, target=y)
            tp.append(time.perf_counter() - t)
        for _ in range(per):
            t = time.perf_counter()
            _floor_step(floor_mods, x, y, n)
            tf.append(time.perf_counter() - t)
        for m in stage_mods:
            m.zero_grad(set_to_none=True)
    pipe.close()
    p, f = statistics.median(tp), statistics.median(tf)
    # the extra time from adjacent blocks (the machine's speed drifts over seconds; a block's neighbour saw the same)
    extra = statistics.median(statistics.median(tp[b * per:(b + 1) * per]) - statistics.median(tf[b * per:(b + 1) * per])
                              for b in range(blocks))
    return {"schedule": name, "stages": len(stage_mods), "actions": actions, "pipeloom_us": p * 1e6, "floor_us": f * 1e6,
            "extra_us": extra * 1e6, "per_action_us": extra / actions * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="timed steps per engine and schedule")
    ap.add_argument("--blocks", type=int, default=40, help="alternating pipeloom/floor blocks the timed steps are cut into "
                    "(the extra time is the median over blocks of each block's pipeloom median less its floor median)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--names", default="Interleaved1F1B,LoopedBFS,GPipe,1F1B")
    a = ap.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    print(f"{'schedule':<18}{'stages':>7}{'actions':>8}{'pipeloom us':>13}{'floor us':>10}{'extra us/action':>17}"
          f"{'  -> per action us':>19}{'per step us':>13}")
    port = 29900
    for name in a.names.split(","):
        rows = []
        for n in (a.microbatches, 2 * a.microbatches):
            os.environ["MASTER_PORT"] = str(port)
            port += 1
            rows.append(run(name, a.steps, a.blocks, a.warmup, a.dim, n))
        (r1, r2) = rows
        e1, e2 = r1["extra_us"], r2["extra_us"]
        per = (e2 - e1) / (r2["actions"] - r1["actions"])
        fixed = e1 - per * r1["actions"]
        for r in rows:
            print(f"{r['schedule']:<18}{r['stages']:>7}{r['actions']:>8}{r['pipeloom_us']:>13.0f}{r['floor_us']:>10.0f}"
                  f"{r['per_action_us']:>17.1f}" + (f"{per:>19.1f}{fixed:>13.0f}" if r is r2 else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
