"""A rank for the launcher failure tests: trains a tiny pipeline under ``pipeloom launch`` and misbehaves.

argv: MODE OUT_DIR.  2 ranks, 4 stages (Interleaved1F1B), 4 microbatches.
Unlike ``fault_worker.py`` it passes no timeouts to ``Pipeline``, so the
launcher's ``--heartbeat-timeout`` and ``$PIPELOOM_STALL_TIMEOUT`` are what
count.  Modes (the misbehaving rank is rank 1, in a forward of step 1):

- ``raise``: raises ``ValueError("boom in user code")``;
- ``kill``: SIGKILLs itself;
- ``stop``: SIGSTOPs itself;
- ``spin``: spins in ``while True: pass`` inside the forward (its heartbeat
  thread keeps running and reports the action as busy);
- ``train``: nobody misbehaves; trains until killed (signals to the launcher);
- ``forged``: publishes its control endpoint (``endpoint{R}``), trains a
  step, waits for the file ``forged`` (the test sends wrongly signed frames
  first), then trains 3 more steps.

Files in OUT_DIR: ``pid{R}`` at start-up (before torch is imported),
``fault`` (``time.time()`` just before the misbehaviour), ``step{N}`` after
each finished step (rank 0), and ``rank{R}.json``: how the rank ended
(ok, or the error's type, message and the fields that place it) and when.
The exception is re-raised, as in a user's script.
"""

from __future__ import annotations

import os
import sys

MODE, OUT = sys.argv[1], sys.argv[2]
RANK = int(os.environ["RANK"])


def note(name: str, value: object) -> None:
    tmp = os.path.join(OUT, f"{name}.tmp{RANK}")
    with open(tmp, "w") as f:
        f.write(str(value))
    os.replace(tmp, os.path.join(OUT, name))


note(f"pid{RANK}", os.getpid())

import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.step == 1 and RANK == 1 and self.calls == 3 and MODE in ("raise", "kill", "stop", "spin"):
            note("fault", repr(time.time()))
            if MODE == "raise":
                raise ValueError("boom in user code")
            if MODE == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if MODE == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            while True:  # MODE == "spin": an endless loop in user code
                pass
        if MODE == "train":
            time.sleep(0.005)
        return torch.tanh(self.lin(x))


def main() -> None:
    import pipeloom

    torch.manual_seed(0)
    stages = [Stage() for _ in range(4)]
    record: dict[str, object] = {"rank": RANK}
    try:
        pipe = pipeloom.Pipeline(lambda s: stages[s], schedule="Interleaved1F1B", num_microbatches=4,
                                 loss_fn=nn.functional.mse_loss)
        if MODE == "forged":
            note(f"endpoint{RANK}", pipe._control.endpoint)
        x, y = torch.randn(16, 8), torch.randn(16, 8)
        steps = 4 if MODE == "forged" else (10**6 if MODE == "train" else 3)
        losses: list[torch.Tensor] = []
        for step in range(steps):
            if MODE == "forged" and step == 1:
                end = time.monotonic() + 20
                while not os.path.exists(os.path.join(OUT, "forged")) and time.monotonic() < end:
                    time.sleep(0.01)
            for s in stages:
                s.step, s.calls = step, 0
            losses = []
            pipe.step(x, target=y, losses=losses)
            if RANK == 0:
                note(f"step{step}", repr(time.time()))
        record.update(status="ok", losses=[float(v) for v in losses], rejected=pipe._control.rejected)
        pipe.close()
    except Exception as exc:
        record.update(status="error", type=type(exc).__name__, message=str(exc), t=time.time(),
                      **{k: getattr(exc, k) for k in ("stage", "microbatch", "action", "failed_rank", "peer") if hasattr(exc, k)})
        with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
            json.dump(record, f)
        raise
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
