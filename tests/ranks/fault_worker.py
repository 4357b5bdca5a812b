"""A rank that trains a tiny pipeline and misbehaves on purpose (for the fault tests).

argv: MODE OUT_DIR.  Modes:
- ``raise``: rank 1's stage raises in the forward of microbatch 2 of step 1.
- ``kill``: rank 1 SIGKILLs itself in the middle of step 1.
- ``vanish``: rank 1 SIGKILLs itself between steps 1 and 2 (so rank 0 has no
  receive open from it; only the closed connection or missing heartbeats tell).
- ``stop``: rank 1 SIGSTOPs itself in the middle of step 1 (the test resumes and kills it).
- ``garbage``: every rank publishes its control endpoint; the test sprays it
  with malformed messages while the ranks train; they must finish correctly.
- ``badcsv``: the schedule file is malformed.
- ``raise-linger``: as ``raise``, but rank 1 stays alive for 4 s after its failure (so what
  rank 0 posted ahead from it stays pending while rank 0 exits).
``STATIC`` in the environment picks ``static_shapes``: ``1`` True, ``0`` False (gloo's header
protocol on every step), unset or empty: auto (the default; on gloo, like True, no headers
after the first step of a layout, the loop thread waiting in gloo itself, watched by
``runtime/direct_wait.py``).
Each rank writes ``{OUT}/rank{R}.json``: how it ended (ok / error type and
message) and when, so the test can check what every rank reported.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from torch import nn

MODE, OUT = sys.argv[1], sys.argv[2]
RANK = int(os.environ["RANK"])


class Stage(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.lin = nn.Linear(8, 8)
        self.calls = 0
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.step == 1 and RANK == 1 and self.calls == 3:
            if MODE in ("raise", "raise-linger"):
                raise ValueError("boom in user code")
            if MODE == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if MODE == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
        if MODE == "garbage":
            time.sleep(0.01)  # give the sprayer time to hit a running step
        return torch.tanh(self.lin(x))


def main() -> None:
    import pipeloom

    torch.manual_seed(0)
    stages = [Stage(i) for i in range(4)]
    schedule = "Interleaved1F1B"
    if MODE == "badcsv":
        schedule = os.path.join(OUT, "bad.csv")
    record: dict[str, object] = {"rank": RANK}
    try:
        pipe = pipeloom.Pipeline(lambda s: stages[s], schedule=schedule, num_microbatches=4,
                                 loss_fn=nn.functional.mse_loss, heartbeat_timeout=float(os.environ.get("HB_TIMEOUT", "10")),
                                 data_parallel=int(os.environ.get("DP", "1")), fsdp=os.environ.get("FSDP") == "1",
                                 options=pipeloom.RuntimeOptions(static_shapes={"1": True, "0": False}.get(os.environ.get("STATIC", ""))))
        if MODE == "garbage":
            # written whole, then renamed: the test polls for the file and reads it at once
            tmp = os.path.join(OUT, f"endpoint{RANK}.tmp")
            with open(tmp, "w") as f:
                f.write(pipe._control.endpoint)
            os.replace(tmp, os.path.join(OUT, f"endpoint{RANK}"))
            time.sleep(1.0)
        x, y = torch.randn(16, 8), torch.randn(16, 8)
        steps = 20 if MODE == "garbage" else 3
        losses: list[torch.Tensor] = []
        for step in range(steps):
            if MODE == "vanish" and RANK == 1 and step == 2:
                with open(os.path.join(OUT, "killed_at"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            for s in stages:
                s.step, s.calls = step, 0
            losses = []
            pipe.step(x, target=y, losses=losses)
        record.update(status="ok", losses=[float(l) for l in losses], rejected=pipe._control.rejected,
                      grads={f"s{s}": m.lin.weight.grad.sum().item() for s, m in pipe.stages.items()})
        pipe.close()
    except Exception as exc:
        record.update(status="error", type=type(exc).__name__, message=str(exc), t=time.time(),
                      **{k: getattr(exc, k) for k in ("stage", "microbatch", "action", "failed_rank", "peer") if hasattr(exc, k)})
        with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
            json.dump(record, f)
        if MODE == "raise-linger" and RANK == 1:
            time.sleep(4.0)
        raise
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
