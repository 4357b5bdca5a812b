"""Where a transfer's time goes on the host: one hop of ``benchmarks/cpu_overhead.py``'s setting, piece by piece.

``cpu_overhead.py`` gives one number per action; this splits it.  Two gloo
ranks run pipeloom steps of one schedule on the same tiny stages; the
runtime's own functions are wrapped (in these processes only) to timestamp
each transfer with the monotonic clock, which both ranks share:

* ``send_transfer``: the sender's call, header and payload posted (wall);
* ``send -> header landed``: from the end of that call to the receiver thread
  returning from gloo's wait (transport, and the receiver thread waking);
* ``receiver thread``: from there to the hand-off (header checked, the next
  receive posted when the loop's thread is parked waiting);
* ``hand-off -> loop``: until the loop's thread runs ``RankActor._landed``
  (a wake through ``runtime/landing.py``, or the dispatcher finishing the
  action it was running);
* ``loop -> compute``: until the consuming action's compute starts.

and per step, each thread's CPU time (the loop's thread split into compute,
``send_transfer`` and the rest; the receiver thread), with the end of step's
wait for sends.  Medians and means over the timed steps: a mean far above its
median is the machine's other load (a thread ready to run but not running).

Usage::

    python benchmarks/host_hops.py [--names 1F1B] [--steps 100] [--warmup 5]

(one schedule: the first of ``--names``; 1F1B by default).
"""

from __future__ import annotations

import os
import statistics as st
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_overhead as co  # noqa: E402  (the same model, batch and rank spawning)


def _wrap(cls: Any, name: str, before: Any, after: Any) -> None:
    orig = getattr(cls, name)

    def f(*a: Any, **k: Any) -> Any:
        token = before(*a)
        try:
            return orig(*a, **k)
        finally:
            after(token, *a)

    setattr(cls, name, f)


def rank_main(args: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    import pipeloom
    from pipeloom.runtime.actor import RankActor
    from pipeloom.runtime.stage import StageExecutor
    from pipeloom.transport.tensor import TensorPlane

    sent: dict[Any, tuple[int, int]] = {}
    landed: dict[Any, tuple[int, int, int]] = {}
    started: dict[Any, int] = {}
    cpu = {"compute": 0, "send": 0}

    def send_before(self: Any, peer: int, step: int, kind: str, stage: int, mb: int, tensors: Any) -> tuple[int, int]:
        return time.monotonic_ns(), time.thread_time_ns()

    def send_after(tok: tuple[int, int], self: Any, peer: int, step: int, kind: str, stage: int, mb: int, tensors: Any) -> None:
        sent[(step, kind, stage, mb)] = (tok[0], time.monotonic_ns())
        cpu["send"] += time.thread_time_ns() - tok[1]

    _wrap(TensorPlane, "send_transfer", send_before, send_after)

    def landed_before(self: Any, got: Any, err: Any) -> None:
        if got is not None:
            landed[(got.step, got.kind, got.stage, got.microbatch)] = (got.header_ns, got.done_ns, time.monotonic_ns())

    _wrap(RankActor, "_landed", landed_before, lambda *a: None)

    def compute_before(self: Any, a: Any, step: int, *rest: Any) -> None:
        if a.type.name in ("F", "B", "I"):  # the consumers of transfers (W consumes none)
            started.setdefault((step, "F" if a.type.name == "F" else "B", a.stage, a.microbatch), time.monotonic_ns())

    _wrap(RankActor, "_compute", compute_before, lambda *a: None)
    for name in ("forward", "backward", "backward_input", "backward_weight"):
        _wrap(StageExecutor, name, lambda *a: time.thread_time_ns(), lambda tok, *a: cpu.__setitem__("compute", cpu["compute"] + time.thread_time_ns() - tok))

    name = args.names[0]
    num_stages, _ = co.stage_ranks(name, co.WORLD)
    x, y = co.batch()
    stages = co.build_stages(num_stages)
    pipe = pipeloom.Pipeline(lambda s: stages[s], schedule=name, num_microbatches=co.MICROBATCHES, loss_fn=co.loss_fn)
    rx = None
    walls, total, rx_cpu = [], 0, 0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            cpu.update(compute=0, send=0)
            rx = next(iter(pipe._tensors._receivers.values()), None)
        dist.barrier()
        for m in pipe.stages.values():
            m.zero_grad(set_to_none=True)
        clock = time.pthread_getcpuclockid(rx._thread.ident) if rx is not None else None
        c0, r0, t0 = time.thread_time_ns(), time.clock_gettime_ns(clock) if clock is not None else 0, time.perf_counter()
        pipe.step(x, target=y)
        if i >= args.warmup:
            walls.append(time.perf_counter() - t0)
            total += time.thread_time_ns() - c0
            rx_cpu += time.clock_gettime_ns(clock) - r0 if clock is not None else 0
    mine = {"sent": sent, "landed": landed, "started": started, "walls": walls,
            "cpu": {**cpu, "total": total, "receiver": rx_cpu}}
    everyone: list[Any] = [None] * co.WORLD
    dist.all_gather_object(everyone, mine)
    pipe.close()
    dist.destroy_process_group()
    if rank == 0:
        report(name, everyone, args)


def report(name: str, everyone: list[Any], args: Any) -> None:
    sent = {k: v for r in everyone for k, v in r["sent"].items()}
    rows = []
    for r in everyone:
        for k, (h, d, l) in r["landed"].items():
            if k[0] >= args.warmup and k in sent and k in r["started"]:
                s0, s1 = sent[k]
                rows.append((s1 - s0, h - s1, d - h, l - d, r["started"][k] - l))
    n = args.steps
    print(f"\n{name}: {co.WORLD} gloo ranks, {args.steps} steps after {args.warmup}; step median "
          + " / ".join(f"{st.median(r['walls']) * 1e3:.2f}" for r in everyone) + " ms (rank 0 / 1)")
    print(f"  per transfer ({len(rows)}), us:          median     mean")
    for label, col in zip(("send_transfer", "send -> header landed", "receiver thread", "hand-off -> loop", "loop -> compute"), zip(*rows)):
        print(f"    {label:<26} {st.median(col) / 1e3:9.1f} {st.mean(col) / 1e3:9.1f}")
    print("  CPU per step, us (rank 0 / 1):")
    for key, label in (("total", "loop thread"), ("compute", "  of which compute"), ("send", "  of which send_transfer"), ("receiver", "receiver thread")):
        print(f"    {label:<26} " + " / ".join(f"{r['cpu'][key] / n / 1e3:.0f}" for r in everyone))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--names" or a.startswith("--names=") for a in argv):
        argv += ["--names", "1F1B"]
    args = co.parse_args(argv)
    if "RANK" not in os.environ:
        co.__file__ = __file__  # spawn() starts this script as the ranks
        return co.spawn(argv)
    rank_main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
