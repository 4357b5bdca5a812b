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


class _Gain(torch.autograd.Function):
    """A custom autograd Function that uses a parameter (its backward is user code)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g * w, (g * x).reshape(-1, x.shape[-1]).sum(0)


class AwkwardBlock(nn.Module):
    """A stage that reuses parameters every way real models do, inside one stage.

    A Linear applied twice, two Linears with a tied weight, a cell applied
    recurrently, a weight-norm parametrization, a custom Function using a
    parameter, in-place ops (one on the stage's input); ``checkpointed`` runs the body under
    non-reentrant activation checkpointing.  The zero-bubble I/W split must give
    a full backward's gradients for all of it.
    """

    def __init__(self, dim: int, *, checkpointed: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.b.weight = self.a.weight
        self.cell = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.norm = nn.utils.parametrizations.weight_norm(nn.Linear(dim, dim))
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.checkpointed = checkpointed

    def _body(self, h: torch.Tensor) -> torch.Tensor:
        y = self.lin(torch.tanh(self.lin(h)))
        y = self.b(torch.relu(self.a(y)))
        for _ in range(2):
            y = self.cell(y) + y
        y = self.norm(y)
        y.mul_(0.5)
        return _Gain.apply(y, self.gain)

    def forward(self, h: torch.Tensor, skip: torch.Tensor | None = None, *, scale: torch.Tensor | None = None) -> Any:
        if h.requires_grad:  # an in-place op on a later stage's input (a leaf needing a gradient in a pipeline)
            h.mul_(1.0)
        if self.checkpointed:
            from torch.utils.checkpoint import checkpoint

            y = checkpoint(self._body, h, use_reentrant=False)
        else:
            y = self._body(h)
        return y * scale if scale is not None else y


def _draw(module: nn.Module, args: Any) -> None:
    torch.rand(1)


def build_stages(num_stages: int, *, dim: int, multi: bool, seed: int, dtype: torch.dtype, model: str = "block") -> list[nn.Module]:
    """``model``: "block" (Linear + tanh), "tied-ends" (blocks, the first and last sharing a weight),
    "awkward" (AwkwardBlock), "awkward-ckpt" (checkpointed), "draws" (blocks whose forwards draw a random number)
    or "adv-<kind>" (``adv_models.AdvStage``)."""
    torch.manual_seed(seed)
    if model.startswith("adv-"):  # tests/ranks/adv_models.py: unusual autograd graphs (tests/test_iw_adversarial.py)
        from adv_models import build

        return [m.to(dtype) for m in build(model[4:], num_stages, dim)]
    if model.startswith("awkward"):
        return [AwkwardBlock(dim, checkpointed=model.endswith("ckpt")).to(dtype) for _ in range(num_stages)]
    stages = [Block(dim, first=s == 0, last=s == num_stages - 1, multi=multi).to(dtype) for s in range(num_stages)]
    if model == "draws":  # every stage's forward draws a random number (that changes nothing it computes)
        for st in stages:
            st.register_forward_pre_hook(_draw)
    if model == "tied-ends":
        # the first and the last stage share a weight, as a tied embedding and LM head do;
        # V schedules place both on rank 0
        stages[-1].lin.weight = stages[0].lin.weight
    return stages


def apply_freeze(stages: Any, cfg: dict[str, Any], step: int) -> None:
    """``cfg["freeze"]``: per step, the parameter names (within a stage) that are frozen for that step."""
    plan = cfg.get("freeze")
    if not plan:
        return
    frozen = set(plan[step % len(plan)])
    items = stages.items() if isinstance(stages, dict) else enumerate(stages)
    for _, m in items:
        for n, p in m.named_parameters():
            p.requires_grad_(n not in frozen)


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
