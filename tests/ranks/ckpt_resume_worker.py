"""A training job that checkpoints with pipeloom and is killed mid-save, under ``pipeloom launch --max-restarts 1``.

argv: MODE OUT STEPS.  2 ranks, ``Net`` split in 2 stages by module names
(1F1B, ``deterministic=True``, float64, dropout: the RNG state matters),
AdamW with a LambdaLR schedule (its state rides in ``extra``), global
clipping, and an asynchronous checkpoint every 2 steps into ``OUT/ckpt``.

MODE ``kill``: on the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) rank 1
SIGKILLs itself inside the save of step 4, right after writing its part of
the files: the checkpoint directory then holds real data from both ranks but
was never finished.  The restart must resume from step 2.  Each attempt
appends ``restart:first_step:what the step-4 save left`` to
``OUT/attempts{R}``; at the end each rank writes its parameters to
``OUT/final{R}.pt`` and the losses it saw to ``OUT/losses{R}.pt``.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from net import batch, build_net, fqns, loss_fn, make_optimizer  # noqa: E402

CFG = dict(dim=8, layers=4, batch=16, dropout=0.1, seed=0)
KILL_IN_SAVE = 4


def die_after_writing() -> None:
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    write = _FileSystemWriter.write_data

    def write_then_die(self, plan, planner):  # type: ignore[no-untyped-def]
        fut = write(self, plan, planner)
        fut.wait()  # this rank's files are on disk; DCP's finish (metadata) never comes
        os.kill(os.getpid(), signal.SIGKILL)
        return fut

    _FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]


def run(mode: str, out: str, steps: int, restart: int) -> None:
    """The job (``mode`` clean or kill); also run as a case of the 2-rank pool (ckpt_worker.py) for the clean reference."""
    import pipeloom

    rank = int(os.environ["RANK"])
    ckpt = os.path.join(out, "ckpt")
    partial = os.path.join(ckpt, f".step-{KILL_IN_SAVE:08d}.partial")
    left = "-"
    if os.path.isdir(partial):
        left = "partial:" + ",".join(sorted(n for n in os.listdir(partial) if n.endswith(".distcp")))
    split = pipeloom.split_by_fqn(build_net(CFG), fqns(4, 2))
    pipe = pipeloom.Pipeline(split, schedule="1F1B", num_microbatches=4, loss_fn=loss_fn, deterministic=True)
    opt = make_optimizer(pipe.parameters(), {"lr": 0.02})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    torch.manual_seed(100 + rank)  # the dropout masks: per rank, continued across a resume by the saved RNG state
    info = pipeloom.load_checkpoint(ckpt, pipe, opt)
    start = 0
    if info is not None:
        start = info.step
        sched.load_state_dict(info.extra["sched"])
    with open(os.path.join(out, f"attempts{rank}"), "a") as f:
        f.write(f"{restart}:{start}:{left}\n")
    losses = []
    for step in range(start, steps):
        x, y = batch(CFG, step)
        opt.zero_grad(set_to_none=True)
        pipe.step(x, target=y)
        losses.append(pipe.last_loss())
        pipe.clip_grad_norm_(0.1)
        opt.step()
        sched.step()
        if (step + 1) % 2 == 0:
            if mode == "kill" and restart == 0 and rank == 1 and step + 1 == KILL_IN_SAVE:
                # the patch is process-wide: step 2's save, still writing in the background on a
                # loaded machine, would die in it instead (the restart then resumed from step 0)
                pipeloom.wait_checkpoints()
                die_after_writing()
            pipeloom.save_checkpoint(ckpt, pipe, opt, step=step + 1, extra={"sched": sched.state_dict()}, async_save=True)
    pipeloom.wait_checkpoints()
    torch.save({n: p.detach() for m in pipe.stages.values() for n, p in m.named_parameters()}, os.path.join(out, f"final{rank}.pt"))
    torch.save(losses, os.path.join(out, f"losses{rank}.pt"))
    pipe.close()


def main() -> None:
    torch.set_num_threads(1)
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(os.environ["TORCHELASTIC_RESTART_COUNT"]))


if __name__ == "__main__":
    main()
