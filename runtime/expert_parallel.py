"""Expert parallelism inside pipeline stages: the ep mesh dimension, its groups, and what the stage function gets.

Problem.  An MoE stage holds more expert weights than one device should, so
its experts are sharded over ``ep`` ranks that each hold the same stage and
exchange tokens with all-to-alls (:mod:`pipeloom.moe`).  Those ranks also
each train on their own part of the batch (the ep dimension is a data
dimension for everything but the experts, as in GShard, DeepSpeed-MoE and
torchtitan), so the non-expert parameters are replicas to average, and the
expert parameters are shards that must not be.

Layout.  ``pp x dp x ep`` ranks; global rank ``= (pp_index * dp + dp_index)
* ep + ep_index`` (``Pipeline(expert_parallel=ep, data_parallel=dp)``), or a
DeviceMesh with dims ``("pp", "ep")`` or ``("pp", "dp", "ep")``.  Every
(dp, ep) *column* runs the schedule row of its pipeline rank as a pipeline
of its own, on part ``dp_index * ep + ep_index`` of the global batch: to the
data-parallel machinery (:mod:`.data_parallel`) the columns are
``dp * ep`` replicas.  Gradients:

- non-expert parameters: averaged over the row (every column), by
  REDUCE_GRAD's all-reduce, as DDP replicas are;
- expert parameters (:func:`pipeloom.moe.is_expert_parameter`): the
  all-to-all's backward already brought every ep column's contribution
  to the rank holding the expert, so each backward's contribution is scaled
  by ``1 / ep`` as autograd accumulates it (a hook on the parameter, see
  ``data_parallel._expert_scale``) and REDUCE_GRAD averages them over the
  ``dp`` replicas holding the same experts (no collective when ``dp == 1``),
  which gives the unsplit model's average over the global batch, also where
  ``.grad`` already held earlier steps' gradients (accumulation: dividing
  ``.grad`` at REDUCE_GRAD divided those again).  A parameter that several
  local stages share (a V schedule's first and last stage) is scaled once and
  reduced once.  They are not broadcast at construction either.

Every column's microbatch ``j`` must hold as many tokens as its ep peers'
(:mod:`pipeloom.moe` exchanges equal splits sized by the token count): a
batch whose rows the columns cannot share evenly is refused at the step, and
MoE layers whose settings differ between the ranks holding a stage
(``MoE.replica_settings``: top_k, capacity factor, ...) at construction.

Groups.  Created here with ``new_group``, by every rank in one global order
(stage by stage), eagerly on NCCL:

- the *row* group (every column of a pipeline rank): REDUCE_GRAD's all-reduce;
- the *expert replica* group (the row's ranks with the same ep index), when ``dp > 1``;
- one *ep group per stage* (and dp index): the ep ranks holding the stage.
  Two local stages of a V schedule have groups of the same ranks but their
  own communicators, because collectives on one NCCL communicator run one
  after another: with one communicator, the all-to-all of the forward half
  of an OVERLAP_F_B would queue behind the backward half's instead of
  running while it computes.

The stage function.  ``stage_fn(stage)`` or ``stage_fn(stage, ctx)``: a
function that takes two positional parameters gets a :class:`StageContext`
with the stage's ep group, its rank in it and its size.

Order, and why it cannot hang.  Collectives on a group pair by issue order,
and an all-to-all inside a compute is a collective that the dispatcher does
not see.  Two ep peers of a stage dispatching dynamically could run
different actions first (a forward on one, a backward on the other) and
pair a token exchange with a gradient exchange: a wrong result or a hang.
Alternatives: (a) order only the communicating actions, like the
data-parallel collectives; but in an MoE model every forward and backward
communicates, so that is the list order anyway; (b) agree on the order at
run time over the control plane, which adds a round trip per action to the
critical path; (c) run ranks with expert parallelism in their list order
(``dispatch`` rule ``list``, i.e. ``deterministic``).  pipeloom takes (c):
the ep peers of a stage share one schedule row, so they issue every
all-to-all, in every stage's group, in the same order.  Deadlock freedom:
the validator accepts a row list when some global order of all actions
respects every rank's list and every data dependency; give every column the
same global order and treat an action whose stage exchanges over ep as one
joint action of its ep peers.  If every rank waited, take the waiting head
``h`` earliest in that order: its inputs come from earlier actions, which
are done; each ep peer of ``h``'s rank has the same list, all of it before
``h`` done (else its head would come before ``h``), so its head is ``h``
too, and the joint all-to-all completes.  On GPUs the list order still
commits ahead (the host enqueues; CUDA stream waits order the data), which
is also how torch's runtime drives a GPU.  On gloo an all-to-all blocks
this rank's host until its peers arrive, which by the argument above they do.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import PipelineConfigError

__all__ = ["StageContext", "EpGroups", "make_ep_grid", "make_ep_groups", "call_stage_fn", "split_expert_params"]


@dataclass(frozen=True)
class StageContext:
    """What ``stage_fn(stage, ctx)`` learns about where its stage runs."""

    #: the stage index
    stage: int
    #: the device the stage runs on
    device: torch.device
    #: the stage's expert-parallel process group (its own communicator: pass it to ``pipeloom.moe.MoE``);
    #: None without expert parallelism
    ep_group: Any = None
    #: this rank's index in ``ep_group`` (0 without expert parallelism)
    ep_rank: int = 0
    #: ranks in ``ep_group`` (1 without expert parallelism)
    ep_size: int = 1
    #: global ranks of ``ep_group``, by ep index
    ep_ranks: tuple[int, ...] = field(default=())


def call_stage_fn(stage_fn: Callable[..., nn.Module], stage: int, ctx: StageContext) -> nn.Module:
    """``stage_fn(stage, ctx)`` if it takes two positional parameters (or ``*args``), else ``stage_fn(stage)``."""
    try:
        params = list(inspect.signature(stage_fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: the one-argument form
        return stage_fn(stage)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params) or len(positional) >= 2:
        return stage_fn(stage, ctx)
    return stage_fn(stage)


def make_ep_grid(*, world: int, data_parallel: int, expert_parallel: int, mesh: Any) -> tuple[list[list[int]], int]:
    """The pp x (dp * ep) grid of global ranks (columns ordered dp-major) and dp, from a mesh or the sizes."""
    if mesh is not None:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if names not in (("pp", "ep"), ("pp", "dp", "ep")):
            raise PipelineConfigError(
                f"with expert parallelism the mesh must have dims ('pp', 'ep') or ('pp', 'dp', 'ep'), got {names or mesh.ndim}"
            )
        t = mesh.mesh
        ep = t.shape[-1]
        dp = t.shape[1] if t.dim() == 3 else 1
        if expert_parallel not in (1, ep):
            raise PipelineConfigError(f"expert_parallel={expert_parallel} but the mesh's 'ep' dimension has {ep} ranks")
        if data_parallel not in (1, dp):
            raise PipelineConfigError(f"data_parallel={data_parallel} but the mesh's 'dp' dimension has {dp} ranks")
        grid = [[int(r) for r in row] for row in t.reshape(t.shape[0], -1).tolist()]
        if sorted(r for row in grid for r in row) != list(range(world)):
            raise PipelineConfigError(f"the mesh {grid} does not hold each of the job's {world} ranks once")
        return grid, dp
    ep, dp = expert_parallel, max(data_parallel, 1)
    if ep < 1 or world % (dp * ep):
        raise PipelineConfigError(f"data_parallel={dp} x expert_parallel={ep} does not divide the job's {world} ranks")
    pp = world // (dp * ep)
    return [[i * dp * ep + c for c in range(dp * ep)] for i in range(pp)], dp


@dataclass
class EpGroups:
    """This rank's expert-parallel groups (see the module docstring)."""

    ep: int
    dp: int
    #: every column of this rank's pipeline row (REDUCE_GRAD's all-reduce)
    row: Any
    row_ranks: list[int]
    #: the row's ranks with this rank's ep index (expert gradients' sum), None when dp == 1
    experts: Any
    experts_ranks: list[int]
    #: stage -> (group, global ranks) of its ep peers, for this rank's stages
    stage_groups: dict[int, tuple[Any, list[int]]]


def make_ep_groups(grid: Sequence[Sequence[int]], *, rank: int, ep: int, dp: int, stage_to_row: Sequence[int],
                   timeout: float | None = None, device: torch.device | None = None,
                   max_ctas: int | None = None) -> EpGroups:
    """Every group of the layout, created by every rank in the same order; this rank's returned.

    ``timeout`` (seconds) bounds each collective on these groups: on gloo an all-to-all
    holds its rank's host until its peers arrive, and a peer that stopped (not died: a
    dead peer's connection closes at once) would otherwise hold it for the default
    group timeout (30 minutes).  The Pipeline passes its cold-step stall budget plus
    the heartbeat timeout, by which time the other ranks have named the stalled peer.

    ``device``: each stage group then runs one tiny all-to-all here, in stage order (the
    same on every member): NCCL connects an all-to-all's point-to-point channels at its
    first use, and that handshake holds the host until the peers arrive; done here, no
    step pays it while its event loop should be serving transfers.
    """
    import datetime

    kw: dict[str, Any] = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    row_i = next(i for i, row in enumerate(grid) if rank in row)
    col = list(grid[row_i]).index(rank)
    mine: dict[str, Any] = {}
    for i, row in enumerate(grid):
        g = dist.new_group(list(row), **kw)
        if i == row_i:
            mine["row"] = (g, list(row))
    mine["experts"] = (None, [rank])
    if dp > 1:
        for i, row in enumerate(grid):
            for e in range(ep):
                ranks = [row[d * ep + e] for d in range(dp)]
                g = dist.new_group(ranks, **kw)
                if i == row_i and e == col % ep:
                    mine["experts"] = (g, ranks)
    stage_groups: dict[int, tuple[Any, list[int]]] = {}
    capped = max_ctas is not None and device is not None and device.type == "cuda"
    if capped:
        from ..transport.tensor import _nccl_options
    for s, r in enumerate(stage_to_row):
        for d in range(dp):
            ranks = [grid[r][d * ep + e] for e in range(ep)]
            skw = dict(kw)
            # a fresh Options per group: torch writes each group's metadata into the one it is given
            opts = _nccl_options(max_ctas) if capped else None
            if opts is not None:
                skw["pg_options"] = opts
            g = dist.new_group(ranks, **skw)
            if rank in ranks:
                stage_groups[s] = (g, ranks)
    if device is not None:
        for s in sorted(stage_groups):
            g, ranks = stage_groups[s]
            probe = torch.zeros(len(ranks), device=device)
            dist.all_to_all_single(torch.empty_like(probe), probe, group=g)
    return EpGroups(ep=ep, dp=dp, row=mine["row"][0], row_ranks=mine["row"][1], experts=mine["experts"][0],
                    experts_ranks=mine["experts"][1], stage_groups=stage_groups)


def split_expert_params(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(non-expert, expert) trainable parameters of ``module``."""
    from pipeloom.moe import is_expert_parameter

    dense, experts = [], []
    for p in module.parameters():
        (experts if is_expert_parameter(p) else dense).append(p)
    return dense, experts


@torch.no_grad()
def sync_stage(module: nn.Module, groups: EpGroups) -> None:
    """As DDP at construction: non-expert parameters and buffers from the row's first rank; experts over their replicas."""
    dense, experts = split_expert_params(module)
    if len(groups.row_ranks) > 1:
        for t in [*dense, *module.buffers()]:
            dist.broadcast(t.data, src=groups.row_ranks[0], group=groups.row)
    if groups.experts is not None:
        for t in experts:
            dist.broadcast(t.data, src=groups.experts_ranks[0], group=groups.experts)
