"""Stages with unusual autograd graphs, for the I/W-split adversarial tests (``tests/test_iw_adversarial.py``).

``build_stages(..., model="adv-<kind>")`` builds them.  Every stage takes ``(h, aux=None, *, scale=None)``
(the first stage gets only ``h``: ``aux`` is then a plain tensor made from it) and hands on two tensors,
``(main, aux)``; the last stage returns one tensor that depends on both.  Each kind puts one graph the
zero-bubble split must handle (or refuse loudly) into every stage, the first and the last included.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

KINDS = (
    "chunk",            # the two outputs are the outputs of one node (``chunk``): they share a grad_fn
    "same-twice",       # the same tensor returned twice
    "passthrough",      # the stage's input handed on unchanged as its second output
    "int-out",          # the second output is an int64 tensor (no gradient)
    "detached-out",     # the second output is a detached float tensor (no gradient)
    "view-out",         # both outputs are (non-contiguous) views of one intermediate
    "custom-fn",        # custom Functions: once_differentiable + tensors on ctx, save_for_backward + ctx attrs
    "ckpt-reentrant",   # torch.utils.checkpoint(use_reentrant=True)
    "ckpt-bare",        # non-reentrant checkpoint over a bare parameter of the stage and a counter buffer
    "nograd-frozen",    # a parameter used only under no_grad, a frozen Linear in the graph
    "data-dep",         # which parameters (and whether the inputs) the outputs depend on changes per microbatch
    "inplace-view",     # in-place ops with parameters on views of activations (CopySlices)
    "buffer",           # a buffer updated in every forward and read by it (an EMA)
    "inplace-input-buffer",  # that buffer updated, then the stage's input modified in place
)


class _OnceScale(torch.autograd.Function):
    """x * w; tensors kept as ctx attributes (not save_for_backward), backward once_differentiable."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.x, ctx.w = x.detach(), w.detach()
        return x * w

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return g * ctx.w, (g * ctx.x).reshape(-1, ctx.x.shape[-1]).sum(0)


class _CtxMatmul(torch.autograd.Function):
    """x @ w.T; x saved with save_for_backward, w kept on ctx; no materialized gradients; needs_input_grad read."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x)
        ctx.w = w.detach()
        return x @ w.t()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if g is None:
            return None, None
        (x,) = ctx.saved_tensors
        gx = g @ ctx.w if ctx.needs_input_grad[0] else None
        gw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return gx, gw


class AdvStage(nn.Module):
    def __init__(self, kind: str, dim: int, *, first: bool, last: bool) -> None:
        super().__init__()
        assert kind in KINDS, kind
        self.kind, self.first, self.last = kind, first, last
        self.lin = nn.Linear(dim, dim)
        self.g = nn.Parameter(1 + 0.1 * torch.randn(dim))
        if kind == "chunk":
            self.wide = nn.Linear(2 * dim, 2 * dim)
        if kind == "custom-fn":
            self.w2 = nn.Parameter(torch.randn(dim, dim) / dim)
        if kind in ("ckpt-reentrant", "ckpt-bare"):
            self.block = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
        if kind == "ckpt-bare":
            # (counts the region's runs, recomputations included: not compared, the first step's W may recompute)
            self.register_buffer("calls", torch.zeros(()))
        if kind == "nograd-frozen":
            self.unused = nn.Parameter(torch.randn(dim))
            self.frozen = nn.Linear(dim, dim).requires_grad_(False)
        if kind == "data-dep":
            self.a, self.b, self.c = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        if kind in ("buffer", "inplace-input-buffer"):
            self.register_buffer("ema", torch.zeros(dim))

    def _ckpt_body(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.block(h) * self.g  # (g: a bare parameter of this module inside the region)

    def forward(self, h: torch.Tensor, aux: torch.Tensor | None = None, *, scale: torch.Tensor | None = None) -> Any:
        k = self.kind
        if aux is None:
            aux = h * 0.5
        if k == "chunk":
            y, a = self.wide(torch.cat([h, aux.to(h.dtype)], -1)).chunk(2, -1)
        elif k == "same-twice":
            y = torch.tanh(self.lin(h + aux)) * self.g
            a = y
        elif k == "passthrough":
            y = torch.tanh(self.lin(h)) * self.g + aux
            a = h
        elif k == "int-out":
            y = torch.tanh(self.lin(h)) * (1 + 0.1 * aux.to(h.dtype)) * self.g
            a = (y.detach() > 0).to(torch.int64)
        elif k == "detached-out":
            y = torch.tanh(self.lin(h) + self.g * aux)
            a = y.detach() * 2
        elif k == "view-out":
            z = torch.cat([torch.tanh(self.lin(h)), aux * self.g], -1)
            y, a = z[:, ::2], z.view(z.shape[0], 2, -1)[:, 1]
        elif k == "custom-fn":
            y = _OnceScale.apply(self.lin(h), self.g)
            y = _CtxMatmul.apply(torch.tanh(y), self.w2)
            y = _OnceScale.apply(y, self.g)  # g used twice, both times in a custom Function
            a = _CtxMatmul.apply(aux, self.w2)
        elif k == "ckpt-reentrant":
            y = checkpoint(self.block, h + self.g, use_reentrant=True)
            a = aux * self.g
        elif k == "ckpt-bare":
            y = checkpoint(self._ckpt_body, h, use_reentrant=False)
            a = aux * 1.5
        elif k == "nograd-frozen":
            with torch.no_grad():
                s = torch.tanh(self.unused.sum())
            y = torch.tanh(self.lin(h) + self.frozen(aux)) * (1 + s) * self.g
            a = self.frozen(y)
        elif k == "data-dep":
            sel = float(scale.reshape(-1)[0]) if scale is not None else 1.0
            lin = self.a if sel > 1.0 else self.b
            if 0.8 < sel < 1.2:  # the outputs depend on no input (and not on a, b, lin): None input gradients
                y = torch.tanh(self.c.weight).sum(0).expand_as(h) * self.g
                a = self.c.bias.expand_as(y) * 1.0
            else:
                y = torch.tanh(lin(h)) * self.g
                a = self.lin(aux.detach()) if sel > 1.3 else aux * self.g  # (or depends on aux's values only)
        elif k == "inplace-view":
            y = self.lin(h)
            y[:, :2].mul_(self.g[:2])
            y.t()[1].add_(self.g[2] * h[:, 0])
            torch.relu_(y)
            a = aux * 1.0
            a[:, 1:3] += y[:, :2] * self.g[3]
        elif k in ("buffer", "inplace-input-buffer"):
            with torch.no_grad():
                self.ema.mul_(0.5).add_(0.5 * h.mean(0))
            if k == "inplace-input-buffer" and h.requires_grad:
                h.mul_(1.5)  # (a stage input: a leaf in the pipeline, an intermediate in the unsplit model)
            y = torch.tanh(self.lin(h - self.ema)) * self.g
            a = aux * 1.0
        else:
            raise AssertionError(k)
        if self.last:
            return y + 0.1 * a.to(y.dtype)
        return y, a


def build(kind: str, num_stages: int, dim: int) -> list[nn.Module]:
    return [AdvStage(kind, dim, first=s == 0, last=s == num_stages - 1) for s in range(num_stages)]
