"""Where a step's host time goes in the runtime's own functions: cProfile of a 1-rank pipeline.

``dispatch_cost.py`` gives the runtime's extra time over the math, but on a
shared machine whose speed drifts 2x its per-step and per-action split is
noisy.  This profiles ``--steps`` steps of the same model (one process, a
world of one, every stage local) and prints, per step, the cumulative time of
the runtime's per-step functions (input signature, stall budget, split, the
layout agreement, checks, merge) and the dispatcher's (its loop's own time per
action, pick, readiness, stage calls), plus the Python function calls per
step -- a count that does not drift with the machine.  Alternate two
checkouts in one sitting to compare them.

Usage::

    python benchmarks/host_profile.py [--schedule GPipe] [--microbatches 8] [--steps 200]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats

import torch
from torch import nn

__all__ = ["main"]

_FUNCS = ["input_signature", "_stall_budget", "split_microbatches", "_agree_layout", "_check_step_inputs", "_merge",
          "step", "_run_step", "_run", "_compute", "pick", "_ready", "_emit"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", default="GPipe")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--port", type=int, default=29931)
    a = ap.parse_args(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", MASTER_PORT=str(a.port))
    import pipeloom
    from pipeloom.schedules import default_stages_per_rank

    n, dim = a.microbatches, a.dim
    torch.manual_seed(0)
    st = default_stages_per_rank(a.schedule)
    mods = [nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(max(st, 2))]
    stage_mods = [nn.Sequential(*mods)] if st == 1 else mods[:st]
    pipe = pipeloom.Pipeline(lambda s: stage_mods[s], schedule=a.schedule, num_microbatches=n,
                             loss_fn=lambda o, t: ((o - t) ** 2).mean())
    x, y = torch.randn(4 * n, dim), torch.randn(4 * n, dim)
    for _ in range(20):
        pipe.step(x, target=y)
    acts = pipe.statistics.actions_run
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(a.steps):
        pipe.step(x, target=y)
    pr.disable()
    pipe.close()
    s = pstats.Stats(pr)
    steps = a.steps
    print(f"{a.schedule} m={n}: {acts} actions/step, {steps} steps under cProfile; function calls per step "
          f"{s.total_calls / steps:.0f} (primitive {s.prim_calls / steps:.0f}); us per step "  # type: ignore[attr-defined]
          "(cumulative; _run_step also its own time per action)")
    want = list(_FUNCS)
    for (fn, _line, func), (_cc, nc, tt, ct, _callers) in sorted(s.stats.items(), key=lambda kv: -kv[1][3]):  # type: ignore[attr-defined]
        if func in want and "site-packages" not in fn and "/lib/python" not in fn:
            extra = f"   own time per action {tt / steps / acts * 1e6:7.1f}" if func == "_run_step" else ""
            print(f"  {func:<20} calls/step {nc / steps:6.1f}  cum {ct / steps * 1e6:8.1f}  own {tt / steps * 1e6:8.1f}{extra}")
            want.remove(func)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
