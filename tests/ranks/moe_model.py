"""A small MoE model for the expert-parallel tests: the same stages on any layout, from one seed.

Stage ``s``: ``x + tanh(dense(x))`` then ``x + MoE(x)``.  Built with an ep group,
each rank keeps its share of the experts; built with ``group=None`` it holds
every expert (the unsplit reference).  Capacity factor 1.0 with top-2 routing
drops some assignments, so the tests cover the dropped path too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeloom.moe import MoE

DIM, EXPERTS, TOP_K, CAPACITY = 6, 4, 2, 1.0


class MoEStage(nn.Module):
    def __init__(self, stage: int, *, group: Any = None, ep_rank: int = 0, ep_size: int = 1,
                 dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1000 + stage)
        self.dense = nn.Linear(DIM, DIM, dtype=dtype)
        with torch.no_grad():
            self.dense.weight.normal_(0.0, DIM**-0.5, generator=g)
            self.dense.bias.normal_(0.0, 0.1, generator=g)
        self.moe = MoE(DIM, 2 * DIM, EXPERTS, top_k=TOP_K, capacity_factor=CAPACITY, group=group,
                       ep_rank=ep_rank, ep_size=ep_size, generator=g, dtype=dtype)

    #: raise in the next forward (the fault test's user error)
    boom = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.boom:
            raise RuntimeError("boom in user code")
        x = x + torch.tanh(self.dense(x))
        return x + self.moe(x)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def make_batch(step: int, *, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    x = torch.randn(rows, seq, DIM, generator=g, dtype=torch.float64)
    return x, torch.randn(rows, seq, DIM, generator=g, dtype=torch.float64)
