"""Step timing shared by the GPU benchmark scripts (gpu_fsdp.py, gpu_moe.py): the same protocol everywhere.

A mixin for a benchmark's environment object, which provides ``cuda`` (bool)
and ``device``: every timed step starts after a device sync and a barrier, so
ranks start together and no earlier work is counted, and a step's time ends
after a device sync.
"""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["StepTimer", "append_row"]


def append_row(path: str | None, row: dict[str, Any]) -> None:
    """Append ``row`` to the JSON Lines file ``path`` (nothing when ``path`` is None)."""
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


class StepTimer:
    cuda: bool
    device: Any

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def reduce(self, x: float, op: str = "max") -> float:
        """``x`` reduced over every rank (``"max"`` or ``"sum"``)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([x], device=self.device, dtype=torch.float64)
        dist.all_reduce(t, op={"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op])
        return float(t.item())

    def timed(self, fn: Callable[[], None], steps: int, warmup: int) -> tuple[list[float], int | None]:
        """Seconds of each of ``steps`` calls of ``fn`` after ``warmup`` untimed ones, and the peak GPU memory."""
        import torch
        import torch.distributed as dist

        for _ in range(warmup):
            fn()
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            self.sync()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return times, (torch.cuda.max_memory_allocated() if self.cuda else None)
