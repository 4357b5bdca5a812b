"""A rank that trains with its own checkpoints and resumes from them under ``pipeloom launch --max-restarts``.

argv: MODE OUT_DIR STEPS.  2 ranks, 2 stages (1F1B), float64, SGD with
momentum.  After every step each rank saves its stage and optimizer state to
``OUT/ckpt{R}.step{N}`` (write then rename, so a file that exists is
complete); at start-up it resumes from the newest step that *every* rank has
saved (a rank may be one step ahead of a peer that died).  With MODE ``kill``
rank 1 SIGKILLs itself at the start of step 3 on the first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0).  At the end each rank writes its final
parameters to ``OUT/final{R}.pt`` and appends ``restart:first_step`` to
``OUT/attempts{R}``.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import sys

import torch
from torch import nn

MODE, OUT, STEPS = sys.argv[1], sys.argv[2], int(sys.argv[3])
RANK = int(os.environ["RANK"])
RESTART = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def saved_steps(rank: int) -> set[int]:
    return {int(m.group(1)) for p in glob.glob(os.path.join(OUT, f"ckpt{rank}.step*"))
            if (m := re.search(r"\.step(\d+)$", p))}


def main() -> None:
    import pipeloom

    torch.manual_seed(0)
    layers = [nn.Linear(8, 8, dtype=torch.float64) for _ in range(2)]
    pipe = pipeloom.Pipeline(lambda s: nn.Sequential(layers[s], nn.Tanh()), schedule="1F1B", num_microbatches=4,
                             loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    common = saved_steps(0) & saved_steps(1)
    start = max(common) if common else 0
    if start:
        state = torch.load(os.path.join(OUT, f"ckpt{RANK}.step{start}"))
        for index, stage in pipe.stages.items():
            stage.load_state_dict(state["stages"][index])
        opt.load_state_dict(state["opt"])
    with open(os.path.join(OUT, f"attempts{RANK}"), "a") as f:
        f.write(f"{RESTART}:{start}\n")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, dtype=torch.float64, generator=g), torch.randn(16, 8, dtype=torch.float64, generator=g))
               for _ in range(STEPS)]
    for step in range(start, STEPS):
        if MODE == "kill" and RANK == 1 and step == 3 and RESTART == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batches[step]
        pipe.step(x, target=y)
        opt.step()
        opt.zero_grad()
        path = os.path.join(OUT, f"ckpt{RANK}.step{step + 1}")
        torch.save({"stages": {i: s.state_dict() for i, s in pipe.stages.items()}, "opt": opt.state_dict()}, path + ".tmp")
        os.replace(path + ".tmp", path)
    torch.save({i: s.state_dict() for i, s in pipe.stages.items()}, os.path.join(OUT, f"final{RANK}.pt"))
    pipe.close()


if __name__ == "__main__":
    main()
