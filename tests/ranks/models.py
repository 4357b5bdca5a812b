"""Deterministic toy models shared by the rank worker and the in-process reference.

Every rank builds the whole model from one seed and keeps its own stages, so
the reference (the unsplit model on one process) starts from the same weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    """A stage: Linear + tanh; ``multi`` stages carry a second tensor (a skip path)."""

    def __init__(self, dim: int, *, first: bool, last: bool, multi: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        # a parameter used directly in this module's forward (not through a child module):
        # the I/W split must handle it as well as the Linear's weights
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.first, self.last, self.multi = first, last, multi
        if multi:
            self.mix = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, skip: torch.Tensor | None = None, *, scale: torch.Tensor | None = None) -> Any:
        y = torch.tanh(self.lin(h)) * self.gain
        if scale is not None:
            y = y * scale
        if not self.multi:
            return y
        skip = h if skip is None else skip
        skip = skip + self.mix(y)
        return y + skip if self.last else (y, skip)


def build_stages(num_stages: int, *, dim: int, multi: bool, seed: int, dtype: torch.dtype) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [
        Block(dim, first=s == 0, last=s == num_stages - 1, multi=multi).to(dtype) for s in range(num_stages)
    ]


def run_reference(stages: list[nn.Module], mb_args: list[tuple], mb_kwargs: list[dict], mb_targets: list, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The unsplit model on one process: losses per microbatch and outputs; grads accumulate in ``stages``."""
    losses, outs = [], []
    for args, kwargs, target in zip(mb_args, mb_kwargs, mb_targets):
        x: Any = args
        for st in stages:
            x = st(*x, **kwargs)
            x = x if isinstance(x, tuple) else (x,)
        out = x[0]
        loss = torch.nn.functional.mse_loss(out, target)
        (loss / n).backward()
        losses.append(loss.detach())
        outs.append(out.detach())
    return losses, outs


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)
