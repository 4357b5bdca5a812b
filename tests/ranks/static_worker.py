"""Rank script for tests/test_static_shapes.py: a step whose shapes differ from the first one's.

``python static_worker.py OUT MODE``: 2 ranks, 1F1B, static shapes with the NCCL protocol emulated
on gloo (or on NCCL under PIPELOOM_TEST_BACKEND=nccl).  Step 0 learns the shapes; step 1 runs
without headers (checked); step 2 changes something.  ``static_shapes=True``: MODE ``batch`` (a
larger batch) or ``rg`` (the activation no longer requires grad) must fail on both ranks with an
error naming the transfer, not hang.  ``static_shapes=None`` (auto): ``batch-auto`` must relearn
(step 2 with headers, exact result), ``datadep`` (stage 0's output doubles its rows while the inputs
stay the same) must fail like ``batch``.  Each rank writes OUT/rank{r}.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from harness import init_backend, install_stack_dump  # noqa: E402

import pipeloom  # noqa: E402


class Stage(nn.Module):
    def __init__(self, detach: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.detach_out = detach
        self.double_rows = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        if self.double_rows:
            y = torch.cat([y, y])
        return y.detach() if self.detach_out else y


def main() -> None:
    install_stack_dump()
    out, mode = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    init_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    stages = [Stage(False).to(dev), Stage(False).to(dev)]
    pipe = pipeloom.Pipeline(
        lambda s: stages[s], schedule="1F1B", num_microbatches=4, loss_fn=lambda y, t: ((y - t) ** 2).mean(),
        options=pipeloom.RuntimeOptions(static_shapes=True if mode in ("batch", "rg") else None, emulate_nccl_transport=True,
                                        heartbeat_timeout=5),
    )
    rec: dict = {"rank": rank, "headerless": []}
    try:
        for step in range(3):
            rows = 8
            if step == 2 and mode in ("batch", "batch-auto"):
                rows = 12  # 4 microbatches of 3 rows instead of 2
            if step == 2 and mode == "rg":
                stages[0].detach_out = True
            if step == 2 and mode == "datadep":
                stages[0].double_rows = True
            x = torch.randn(rows, 4, dtype=torch.float64, device=dev)
            pipe.step(x, target=torch.zeros(rows, 4, dtype=torch.float64, device=dev))
            rec["headerless"].append(pipe.statistics.headerless_sends)
            rec.setdefault("losses", []).append(pipe.last_loss())
        rec["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the error is the result
        rec.update(status="error", type=type(exc).__name__, message=str(exc), t=time.time())
    (out / f"rank{rank}.json").write_text(json.dumps(rec))
    pipe.close()
    sys.exit(0 if rec["status"] == "ok" else 1)


if __name__ == "__main__":
    main()
