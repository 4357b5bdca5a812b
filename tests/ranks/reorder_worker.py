"""Rank script for tests/test_static_shapes.py: the dynamic order on gloo's static path.

argv: OUT RULE [SCHEDULE] (default ZBVZeroBubble).  2 ranks, 4 stages (float64 Linear+tanh),
rank 1's stages slow (every forward sleeps SLOW_MS).  Two Pipelines built from the same initial weights run 3 identical steps
each: ``dispatch=RULE`` and ``deterministic=True``.  Steps 1 and 2 run without headers (static
shapes, auto: the default on gloo).  Writes ``{OUT}/rank{R}.json``: per run, the actions run
out of list order in the last step, whether it ran headerless, and the gradients' sums; and
the largest difference between the two runs' gradients.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

import torch
from torch import nn

import pipeloom

OUT, RULE = sys.argv[1], sys.argv[2]
SCHEDULE = sys.argv[3] if len(sys.argv) > 3 else "ZBVZeroBubble"
SLOW_MS = float(os.environ.get("SLOW_MS", "15"))
RANK = int(os.environ["RANK"])


class Slow(nn.Module):
    def __init__(self, slow: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.slow = slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow:
            time.sleep(SLOW_MS / 1000)
        return torch.tanh(self.lin(x))


def main() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    base = [Slow(slow=RANK == 1) for s in range(4)]  # (each rank runs its own stages: rank 1's are slow)
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
    rec: dict[str, object] = {}
    grads = {}
    for name, kw in (("dynamic", {"options": pipeloom.RuntimeOptions(dispatch=RULE)}),
                     ("deterministic", {"deterministic": True})):
        stages = copy.deepcopy(base)
        pipe = pipeloom.Pipeline(lambda s: stages[s], schedule=SCHEDULE, num_microbatches=8,
                                 loss_fn=nn.functional.mse_loss, **kw)
        for _ in range(3):
            for m in stages:
                m.zero_grad(set_to_none=True)
            pipe.step(x, target=y)
        st = pipe.statistics
        rec[name] = {"out_of_order": st.out_of_order, "headerless": st.headerless_sends > 0, "held": st.held_sends}
        grads[name] = {f"s{s}.{n}": p.grad.clone() for s, m in pipe.stages.items() for n, p in m.named_parameters()}
        pipe.close()
    rec["max_diff"] = max(float((grads["dynamic"][k] - grads["deterministic"][k]).abs().max()) for k in grads["dynamic"])
    rec["params"] = sorted(grads["dynamic"])
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    main()
