"""A model split by module names (``split_by_fqn``), shared by the checkpoint/clipping workers and the reference.

``Net`` keeps its parameters under the names a real model would have
(``layers.2.lin.weight``), so a checkpoint saved under one layout can load
under another.  It also holds a persistent buffer on the root, which every
split stage keeps (state on a split module), to check that such a buffer is
saved once and restored on every stage.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Layer(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.drop = nn.Dropout(dropout) if dropout else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(h)) * self.gain
        return self.drop(y) if self.drop is not None else y


class Net(nn.Module):
    def __init__(self, dim: int, layers: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim, dropout) for _ in range(layers))
        self.register_buffer("offset", 0.01 * torch.arange(dim, dtype=torch.float32))
        self.last = str(layers - 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h)
        # every stage keeps the buffer; only the one holding the last layer uses it
        return h + self.offset if self.last in self.layers._modules else h


def build_net(cfg: dict[str, Any]) -> Net:
    torch.manual_seed(cfg.get("seed", 0))
    return Net(cfg["dim"], cfg.get("layers", 4), cfg.get("dropout", 0.0)).to(getattr(torch, cfg.get("dtype", "float64")))


def fqns(layers: int, stages: int) -> list[list[str]]:
    per = layers // stages
    return [[f"layers.{i}" for i in range(s * per, (s + 1) * per)] for s in range(stages)]


def batch(cfg: dict[str, Any], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 + step)
    dtype = getattr(torch, cfg.get("dtype", "float64"))
    x = torch.randn(cfg["batch"], cfg["dim"], generator=g, dtype=dtype)
    return x, torch.randn(cfg["batch"], cfg["dim"], generator=g, dtype=dtype)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def make_optimizer(params: Any, cfg: dict[str, Any]) -> torch.optim.Optimizer:
    # foreach=False: a stage may mix DTensor shards and replicated tensors (fsdp_wrap="linears")
    return torch.optim.AdamW(params, lr=cfg.get("lr", 0.01), weight_decay=0.1, foreach=False)
