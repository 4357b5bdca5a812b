"""A mixture-of-experts block whose experts are sharded over an expert-parallel group.

Problem.  An MoE layer sends each token to the ``top_k`` experts its router
picks; with the experts spread over the ``ep`` ranks of a stage (see
:mod:`pipeloom.runtime.expert_parallel`), the tokens travel to the rank of
their expert and back: two all-to-alls per layer in the forward, two in the
backward.  Inside a pipeline these exchanges are what DualPipeV's
OVERLAP_F_B hides: one stage's all-to-all runs while the other stage of the
pair computes.

Alternatives.  (a) Variable splits (send exactly the tokens routed to each
rank): the splits are data-dependent, so the host must read them
(``.tolist()``, a device synchronisation) before the all-to-all can be
issued, which stalls the commit-ahead GPU engine at every layer.  (b) A
fixed *capacity* per expert: each expert takes at most ``C`` tokens from
each source rank (``C = ceil(capacity_factor * tokens * top_k /
num_experts)``, known from the shapes), the rest are dropped (their MoE
output is zero; the residual carries them), and every all-to-all moves
equal, static splits.  No host synchronisation anywhere: this module takes
(b), as GShard and Switch did.  Dispatch and combine are index_add/gather
with a trash row for dropped assignments, so nothing data-dependent reaches
the host either.

Gradients.  The all-to-all is an autograd Function (:class:`AllToAll`)
whose backward is the reverse all-to-all of the incoming gradient, so a
backward through the layer exchanges gradients exactly as the forward
exchanged tokens, and the expert weights receive the gradient of every
token routed to them from every rank.  The same block with ``group=None``
holds all experts on one process and computes the same function (capacity
is per source rank, so a process that routes one rank's tokens drops the
same ones): the oracle the tests compare against.

Order.  Collectives on a group pair by issue order, so the ``ep`` ranks of
a stage must run the layer's all-to-alls in the same order.  pipeloom runs
ranks with expert parallelism in their schedule row's list order (every ep
peer of a stage has the same row); see
:mod:`pipeloom.runtime.expert_parallel` for why that cannot deadlock.

Overlap (GPUs).  The one line a model needs: build the block with the
stage's own group, ``MoE(..., group=ctx.ep_group)`` in
``stage_fn(stage, ctx)``.  pipeloom creates one ep communicator per local
stage and runs each stage on its own CUDA stream, so the two halves of an
OVERLAP_F_B issue their all-to-alls on different streams and communicators:
one half's all-to-all runs while the other half computes.  NCCL's
all-to-all never blocks the host, so both halves are enqueued at once.

Expert parameters carry ``_pipeloom_expert = True`` (:func:`is_expert_parameter`):
the runtime must not average them over the ep group (each rank holds other
experts) nor broadcast them from one rank at construction.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["AllToAll", "MoE", "is_expert_parameter", "mark_expert_parameter", "capacity"]

#: name of the profiler range around every all-to-all of this module (benchmarks find its kernels by it)
PROFILE_RANGE = "pipeloom.moe.all_to_all"


def mark_expert_parameter(p: nn.Parameter) -> nn.Parameter:
    """Mark ``p`` as sharded over the expert-parallel group (not averaged over it, not broadcast)."""
    p._pipeloom_expert = True  # type: ignore[attr-defined]
    return p


def is_expert_parameter(p: torch.Tensor) -> bool:
    """Whether ``p`` is an expert parameter (:func:`mark_expert_parameter`)."""
    return bool(getattr(p, "_pipeloom_expert", False))


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    out = torch.empty_like(x)
    with torch.profiler.record_function(PROFILE_RANGE):
        dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with equal splits along dim 0; backward sends the gradients back the same way.

    Chunk ``j`` of the input (``x.shape[0] / group size`` rows) goes to rank
    ``j`` of the group; chunk ``j`` of the output came from rank ``j``.  That
    exchange is its own inverse, so the backward is the same call on the
    gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _exchange(grad, ctx.group), None


def capacity(tokens: int, *, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert for the tokens of one source rank: ``ceil(capacity_factor * tokens * top_k / num_experts)``."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


class MoE(nn.Module):
    """Top-k routed experts (2-layer MLPs) with a fixed capacity per expert, sharded over ``group``.

    Args:
        dim: model width (input and output features).
        hidden: each expert's hidden width.
        num_experts: experts in the whole layer (over all ranks of ``group``).
        top_k: experts per token.
        capacity_factor: slots per expert relative to an even spread (tokens over it are dropped).
        group: the expert-parallel process group (``ctx.ep_group`` in ``stage_fn(stage, ctx)``);
            None: every expert on this process.
        ep_rank, ep_size: this rank's index in ``group`` and its size (default: read from ``group``);
            this rank holds experts ``[ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size)``.
        generator: for the initial weights; every rank that builds the layer with the same seed
            gets the same router, and expert ``e`` the same weights wherever it lives.

    Input ``[..., dim]``, output the same shape (the experts' weighted sum; add the residual yourself).
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        *,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        group: Any = None,
        ep_rank: int | None = None,
        ep_size: int | None = None,
        generator: torch.Generator | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if ep_size is None:
            ep_size = 1 if group is None else dist.get_world_size(group)
        if ep_rank is None:
            ep_rank = 0 if group is None else dist.get_rank(group)
        if num_experts % ep_size:
            raise ValueError(f"MoE: num_experts={num_experts} is not a multiple of the expert-parallel size {ep_size}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k} must be in [1, num_experts={num_experts}]")
        if group is None and ep_size != 1:
            raise ValueError(f"MoE: ep_size={ep_size} without a group")
        self.dim, self.hidden, self.num_experts, self.top_k = dim, hidden, num_experts, top_k
        self.capacity_factor = capacity_factor
        self.group, self.ep_rank, self.ep_size = group, ep_rank, ep_size
        self.local_experts = num_experts // ep_size
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.router = nn.Linear(dim, num_experts, bias=False, **kw)
        # every expert's weights drawn in order (so expert e is the same on any layout), then this rank's kept
        w1 = torch.empty(num_experts, dim, hidden, **kw)
        w2 = torch.empty(num_experts, hidden, dim, **kw)
        with torch.no_grad():
            self.router.weight.normal_(0.0, dim**-0.5, generator=generator)
            w1.normal_(0.0, dim**-0.5, generator=generator)
            w2.normal_(0.0, hidden**-0.5, generator=generator)
        lo, hi = ep_rank * self.local_experts, (ep_rank + 1) * self.local_experts
        self.w1 = mark_expert_parameter(nn.Parameter(w1[lo:hi].clone()))
        self.w2 = mark_expert_parameter(nn.Parameter(w2[lo:hi].clone()))

    def replica_settings(self) -> dict[str, Any]:
        """What every rank holding this layer (its ep peers, its data-parallel replicas) must build alike, beyond
        its tensors' shapes: the Pipeline compares it at construction (``runtime.agreement.stage_tensors``).
        Peers with another ``top_k`` or ``capacity_factor`` would exchange all-to-alls of other sizes."""
        return {"dim": self.dim, "hidden": self.hidden, "num_experts": self.num_experts, "top_k": self.top_k,
                "capacity_factor": self.capacity_factor, "ep_size": self.ep_size}

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, hidden={self.hidden}, experts={self.num_experts} ({self.local_experts} here, "
                f"ep {self.ep_rank}/{self.ep_size}), top_k={self.top_k}, capacity_factor={self.capacity_factor}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, self.dim)
        t = tokens.shape[0]
        e, k, ep, el = self.num_experts, self.top_k, self.ep_size, self.local_experts
        c = capacity(t, num_experts=e, top_k=k, capacity_factor=self.capacity_factor)
        probs = torch.softmax(self.router(tokens), dim=-1)
        gate, expert = probs.topk(k, dim=-1)  # [t, k]
        # slot of each assignment in its expert, first choices first (as GShard): [k * t]
        order = expert.t().reshape(-1)
        onehot = torch.zeros(k * t, e, dtype=torch.long, device=order.device).scatter_(1, order[:, None], 1)
        pos = (onehot.cumsum(0) - 1).gather(1, order[:, None]).squeeze(1)
        kept = pos < c
        trash = e * c
        slot = torch.where(kept, order * c + pos, torch.full_like(pos, trash))  # [k * t]
        src = tokens.repeat(k, 1)  # row j * t + i is token i (for choice j)
        buf = tokens.new_zeros(trash + 1, self.dim).index_add(0, slot, src)[:trash]  # [e * c, dim]
        # experts of rank r are [r * el, (r + 1) * el): chunk r of the buffer goes to rank r
        if self.group is not None and ep > 1:
            buf = AllToAll.apply(buf, self.group)  # [ep (source), el, c, dim]
        inp = buf.view(ep, el, c, self.dim).transpose(0, 1).reshape(el, ep * c, self.dim)
        h = torch.nn.functional.gelu(torch.bmm(inp, self.w1))
        out = torch.bmm(h, self.w2).view(el, ep, c, self.dim).transpose(0, 1).reshape(ep * el * c, self.dim)
        if self.group is not None and ep > 1:
            out = AllToAll.apply(out, self.group)  # back to the source: [e * c, dim] as dispatched
        out = torch.cat([out, out.new_zeros(1, self.dim)])  # the trash row: dropped assignments give 0
        weights = gate.t().reshape(-1, 1).to(out.dtype)
        y = (out.index_select(0, slot) * weights).view(k, t, self.dim).sum(0)
        return y.view(shape)
