"""Data parallelism around the pipeline: DDP-style replicas and FSDP2 shards.

Layout.  ``pp x dp`` ranks form a 2-D ``DeviceMesh`` with dims ``("pp", "dp")``;
global rank = ``pp_index * dp + dp_index``.  Every dp column (one replica or
shard group member of every stage) runs the same schedule row as a pipeline of
its own; the ranks of one pp row hold the same stages and reduce their
gradients over the ``"dp"`` group.

Data.  ``Pipeline.step`` takes the *global* batch on every rank; replica ``d``
keeps part ``d`` of ``tensor_split(batch, dp)`` and cuts that into
microbatches.  Gradients are averaged over replicas, after being averaged over
microbatches, so with equal-sized parts a step equals one step of the unsplit
model on the whole global batch cut into ``dp * num_microbatches`` pieces.

Events.  The schedule is lowered with ``REDUCE_GRAD`` after each stage's last
backward and, with FSDP, ``UNSHARD``/``RESHARD`` around each stage's work
(the all-gather issued ``prefetch`` stage switches ahead).  The actor runs
them as events, through :class:`StageCollectives`:

- ``UNSHARD(s)`` launches FSDP's asynchronous all-gather and returns; a waiter
  thread waits on its ``Work`` and wakes the dispatcher, and only then may a
  compute of stage ``s`` run.
- ``RESHARD(s)`` frees the gathered parameters once every earlier-listed
  compute of ``s`` (and its ``REDUCE_GRAD``) is done.
- ``REDUCE_GRAD(s)`` runs once all of ``s``'s backward work of the step (its
  B, or its W with the I/W split) is done, and only launches: an
  asynchronous reduce-scatter (an all-reduce on gloo, whose reduce-scatter
  cannot be polled) of the gradients FSDP accumulated unsharded over the
  microbatches (once per step, not per microbatch), and a bucketed
  asynchronous all-reduce of every replicated parameter's gradient (all of
  them under DDP; with FSDP, those no FSDP unit manages, e.g. when only a
  stage's inner blocks are wrapped).  Completions are applied on the loop
  (sharded DTensor gradients written, averaged buckets copied back) and the
  step returns when every collective has completed.

Without overlap.  ``Pipeline(overlap_collectives=False)`` (or
``PIPELOOM_OVERLAP_COLLECTIVES=0``) runs the same events synchronously: each
UNSHARD and REDUCE_GRAD launches its collectives and then holds this rank's
dispatcher, polling ``is_completed()``, until they have completed (on a GPU:
until the GPU has finished them, and whatever the stream queued before them),
and applies them before it returns.  Nothing then overlaps a collective; the
benchmarks use it as the naive baseline (``benchmarks/gpu_fsdp.py``).  While a
collective blocks, this rank's loop does not read control messages; one that
has not completed within ``stall_timeout + heartbeat_timeout`` seconds stops
the step with a ``PeerLostError``.

Accumulation.  Under ``Pipeline.no_sync()`` (DDP's ``no_sync``) REDUCE_GRAD
still runs in its place (so RESHARD keeps its order) but reduces nothing:
replicated gradients stay local, and FSDP's stay unsharded on its unsharded
parameters (which FSDP keeps, with their ``.grad``, across RESHARD and
UNSHARD).  Backward adds to them, so the first step outside ``no_sync``
reduces the sum over every accumulated step at once: the average over
replicas of the sum over steps, as if one step had seen all those batches.

Collective order.  Collectives on one group pair by issue order, and dynamic
dispatch may order a rank's actions differently from its replica's.  So the
collective actions (UNSHARD, REDUCE_GRAD) are issued in list order among
themselves, which is the same on every replica (they share a schedule row),
while compute stays free to reorder around them.  For the same reason FSDP
must never issue a collective on its own inside a compute: pipeloom sets
``reshard_after_forward=False`` (a stage runs many microbatch forwards and
backwards between its UNSHARD and RESHARD; resharding after each forward
would all-gather again before every backward, at a time that depends on
dispatch order), ``reshard_after_backward=False`` and
``requires_gradient_sync=False`` on every FSDP unit of a stage.

Why pipeloom reduce-scatters FSDP's gradients itself.  FSDP2 does it in its
post-backward, which on CPU (gloo) is synchronous, and which with the I/W
split would fire during I, before W produced the weight gradients.  So every
backward runs with gradient sync off and REDUCE_GRAD reduce-scatters the
accumulated unsharded gradients (laid out as FSDP shards them: dim 0,
``torch.chunk`` sizes) and writes the sharded gradients FSDP would have
written.  That is exact when FSDP's reduction is a plain average; with a
mixed-precision or offload policy (or ``PIPELOOM_FSDP_REDUCE=fsdp``) FSDP's
own post-backward runs instead, as torch's pipelining runtime does it: queued
on FSDP's stream on GPUs, synchronous on CPU (it then holds this rank's
dispatcher for the duration of the collective).  The private FSDP internals
this takes are confined to ``_fsdp_private``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..schedules import Action, ActionType
from ..transport.tensor import WorkWaiter
from .errors import PeerLostError, PipelineConfigError
from .trace import clock_ns


_SIDE: dict[Any, Any] = {}


def _host_counts(t: torch.Tensor) -> list[float]:
    """``t.tolist()`` of a finished collective's output, without waiting for the compute queued on the device.

    On CUDA a plain ``tolist()`` copies on the current stream, which waits for every kernel the host has
    queued ahead (a whole step's backwards, on a rank whose host runs ahead): a sync of the pipeline at each
    reduction.  The collective has completed (its Work said so), so the copy runs on a stream of its own
    and waits for nothing else.  ``t`` must not be written by work queued after the collective.
    """
    if not t.is_cuda:
        return t.tolist()
    s = _SIDE.get(t.device)
    if s is None:
        s = _SIDE[t.device] = torch.cuda.Stream(device=t.device)
    # (into pinned memory: a copy into pageable memory waited for the device's other streams too, measured on
    # an H200 behind 1.5 s of queued work; this one waits only for its own stream)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    with torch.cuda.stream(s):
        host.copy_(t, non_blocking=True)
    s.synchronize()
    return host.tolist()

__all__ = [
    "COLLECTIVE_TYPES",
    "StageCollectives",
    "make_mesh",
    "make_layout",
    "Layout",
    "lower_for_data_parallel",
    "replica_share",
    "wrap_fsdp",
    "sync_module_states",
    "DEFAULT_BUCKET_BYTES",
]

log = logging.getLogger("pipeloom.data_parallel")

_UNSHARD, _RESHARD, _REDUCE = ActionType.UNSHARD, ActionType.RESHARD, ActionType.REDUCE_GRAD
_B, _W = ActionType.B, ActionType.W
COLLECTIVE_TYPES = frozenset({_UNSHARD, _RESHARD, _REDUCE})
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


# ---------------------------------------------------------------- setup helpers


#: [the last NCCL default process group a Pipeline was built on in this process (weakly: holding a destroyed group
#: made the collector free it later, blocking there), how many different ones there were] (see :func:`make_mesh`)
_NCCL_WORLDS: list[Any] = [None, 0]


def _last_world() -> Any:
    ref = _NCCL_WORLDS[0]
    return ref() if ref is not None else None


def note_default_group() -> None:
    """At each Pipeline's construction: count the NCCL default groups this process has built Pipelines on."""
    world = dist.group.WORLD
    if world is None or world is _last_world() or dist.get_backend() != "nccl":
        return
    _NCCL_WORLDS[0] = weakref.ref(world)
    _NCCL_WORLDS[1] += 1


def make_mesh(pp: int, dp: int, device_type: str) -> Any:
    """The ``(pp, dp)`` DeviceMesh, dims named ``("pp", "dp")``: rank = pp_index * dp + dp_index.

    On a default NCCL group that is not the first this process made (a Pipeline built after an earlier one's
    ``close`` destroyed the group it had made), ``init_device_mesh`` would split its groups from the default
    group's communicator, and torch (2.11; pytorch/pytorch#192109) dereferences an empty rank list there: every rank
    ended with SIGSEGV (4 x H200).  There the mesh's groups are made as new communicators instead (the default
    group's bound device hidden for the call, so that torch does not take the split path; they connect at first
    use, as groups of a default group without a device do).
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.group.WORLD
    bound = getattr(world, "bound_device_id", None) if _NCCL_WORLDS[1] > 1 and world is _last_world() else None
    if bound is None:
        return init_device_mesh(device_type, (pp, dp), mesh_dim_names=("pp", "dp"))
    world.bound_device_id = None
    try:
        return init_device_mesh(device_type, (pp, dp), mesh_dim_names=("pp", "dp"))
    finally:
        world.bound_device_id = bound


@dataclass(frozen=True)
class Layout:
    """Where this rank sits in the ``pp x dp`` grid of global ranks."""

    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    mesh: Any
    #: grid[i][j]: the global rank of pipeline rank i in replica j
    grid: tuple[tuple[int, ...], ...]
    #: the group of a pipeline row's replicas when it is not the mesh's "dp" group (expert
    #: parallelism: every (dp, ep) column is a replica; see runtime/expert_parallel.py)
    row_group: Any = None
    #: expert parallelism: ep ranks per stage; the columns ``c`` with the same ``c // ep`` share a stage's experts
    ep: int = 1

    @property
    def column(self) -> list[int]:
        """Global ranks of this replica's pipeline ranks, by pipeline rank."""
        return [row[self.dp_rank] for row in self.grid]

    @property
    def row(self) -> list[int]:
        """Global ranks holding the same stages as this one (its data-parallel group)."""
        return list(self.grid[self.pp_rank])

    @property
    def dp_group(self) -> Any:
        return self.row_group if self.row_group is not None else self.mesh.get_group("dp")

    @property
    def dp_mesh(self) -> Any:
        return self.mesh["dp"]


def make_layout(*, rank: int, world: int, data_parallel: int, mesh: Any, device_type: str) -> Layout:
    """The grid from a given 2-D mesh (dims ``("pp", "dp")``), or a new one of ``world // data_parallel`` x ``data_parallel``."""
    if mesh is None:
        if data_parallel < 1 or world % data_parallel:
            raise PipelineConfigError(f"data_parallel={data_parallel} does not divide the job's {world} ranks")
        mesh = make_mesh(world // data_parallel, data_parallel, device_type)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh.ndim != 2 or names != ("pp", "dp"):
        raise PipelineConfigError(f"mesh must be a 2-D DeviceMesh with dims ('pp', 'dp'), got dims {names or mesh.ndim}")
    if data_parallel not in (1, mesh.size(1)):
        raise PipelineConfigError(f"data_parallel={data_parallel} but the mesh's 'dp' dimension has {mesh.size(1)} ranks")
    grid = tuple(tuple(int(r) for r in row) for row in mesh.mesh.tolist())
    if sum(len(r) for r in grid) != world:
        raise PipelineConfigError(f"the mesh holds {sum(len(r) for r in grid)} ranks but the job has {world}")
    where = [(i, j) for i, row in enumerate(grid) for j, r in enumerate(row) if r == rank]
    if not where:
        raise PipelineConfigError(f"rank {rank} is not in the mesh {grid}")
    i, j = where[0]
    return Layout(pp=len(grid), dp=len(grid[0]), pp_rank=i, dp_rank=j, mesh=mesh, grid=grid)


def lower_for_data_parallel(schedule: Any, *, fsdp: bool, prefetch: int) -> Any:
    """REDUCE_GRAD (and with FSDP, UNSHARD/RESHARD) added to a compute schedule; one that has them already is kept."""
    from ..schedules import lower

    if any(a.type in COLLECTIVE_TYPES for acts in schedule.actions.values() for a in acts):
        return schedule
    return lower(schedule, comms=False, fsdp=fsdp, prefetch=prefetch, reduce_grad=True)


def _share(value: Any, dp: int, index: int, n: int, what: str) -> Any:
    from .pipeline import Microbatches

    if isinstance(value, Microbatches):
        if len(value) != n * dp:
            raise PipelineConfigError(
                f"{what} holds {len(value)} microbatches; with data_parallel={dp} pass the global "
                f"batch's num_microbatches * data_parallel = {n * dp}"
            )
        return Microbatches(value[index * n : (index + 1) * n])
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if value.shape[0] < dp * n:
            raise PipelineConfigError(
                f"{what} has {value.shape[0]} rows along dim 0, fewer than data_parallel * num_microbatches = {dp * n}; "
                "every replica's every microbatch needs at least one row"
            )
        return torch.tensor_split(value, dp, dim=0)[index]
    return value  # scalars and non-tensors reach every replica unchanged


def replica_share(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], target: Any, *, dp: int, index: int, n: int
) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """Replica ``index``'s part of a global batch: part ``index`` of ``tensor_split(x, dp)`` along dim 0.

    ``Microbatches`` (pre-cut) must hold ``n * dp`` entries; replica ``index``
    takes entries ``[index * n, (index + 1) * n)``.
    """
    if dp == 1:
        return args, dict(kwargs), target
    a = tuple(_share(v, dp, index, n, f"positional input {i}") for i, v in enumerate(args))
    k = {key: _share(v, dp, index, n, f"keyword input {key!r}") for key, v in kwargs.items()}
    t = None if target is None else _share(target, dp, index, n, "target")
    return a, k, t


@torch.no_grad()
def refuse_lazy(module: nn.Module, where: str, why: str) -> None:
    """A stage of lazy modules (``nn.LazyLinear``) whose parameters have no shape yet cannot be broadcast or
    sharded when the Pipeline is built (torch's own error, "Can't access the shape of an uninitialized parameter",
    said nothing of why): refused, naming them."""
    from torch.nn.parameter import is_lazy

    lazy = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if is_lazy(t)]
    if lazy:
        more = f" and {len(lazy) - 3} more" if len(lazy) > 3 else ""
        rank = f"rank {dist.get_rank()}: " if dist.is_initialized() else ""
        raise PipelineConfigError(
            f"{rank}{where} holds lazy parameters not materialised yet ({', '.join(lazy[:3])}{more}); {why} needs their "
            "shapes when the Pipeline is built: run the stage's forward once on an example input (or give its layers "
            "their sizes) before building the Pipeline"
        )


def sync_module_states(module: nn.Module, group: Any, src: int) -> None:
    """Broadcast parameters and buffers from global rank ``src`` over ``group`` (as DDP does at construction)."""
    refuse_lazy(module, "a stage", "data parallelism (its parameters are broadcast over the replicas)")
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.data, src=src, group=group)


def wrap_fsdp(module: nn.Module, mesh: Any, policy: Any, fsdp_kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    """Apply ``fully_shard`` to a stage as ``policy`` says; a stage that already holds FSDP units is left as is.

    ``policy``: ``"stage"`` (one unit, the whole stage), ``"blocks"`` (each
    direct child that has parameters is a unit, or each entry of a child
    ``ModuleList``/``ModuleDict``, and the stage itself one more
    for its remaining parameters, as torchtitan wraps a model: every
    parameter is then a DTensor, which optimizers' fused/foreach paths
    require on GPUs), or a callable ``module -> bool`` asked for every
    submodule, children before parents; parameters that no unit it picks
    manages stay replicated and are all-reduced (an optimizer then sees plain
    tensors beside DTensors, which torch's foreach implementations reject
    on GPUs: pass ``foreach=False`` to it).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from ._fsdp_private import check_supported

    check_supported()
    refuse_lazy(module, "a stage", "FSDP (its parameters are sharded over the replicas)")
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        return module
    kw = {"reshard_after_forward": False, **(fsdp_kwargs or {})}
    kw["mesh"] = mesh
    if policy == "stage":
        return fully_shard(module, **kw)  # type: ignore[return-value]  # an FSDPModule is the same nn.Module
    if policy == "blocks":
        for child in module.children():
            # a ModuleList/ModuleDict has no forward of its own (fully_shard refuses it): its
            # entries are the blocks (``layers.3`` of a split_by_fqn stage), as torchtitan wraps them
            blocks = list(child.children()) if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child]
            for block in blocks:
                if any(p.requires_grad for p in block.parameters()):
                    fully_shard(block, **kw)
        return fully_shard(module, **kw)  # type: ignore[return-value]
    if callable(policy):
        for m in _post_order(module):
            if policy(m):
                fully_shard(m, **kw)
        return module
    raise PipelineConfigError(f"fsdp_wrap must be 'stage', 'blocks' or a callable, not {policy!r}")


def _post_order(module: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []
    for child in module.children():
        out.extend(_post_order(child))
    out.append(module)
    return out


def _configure_fsdp(units: Sequence[Any]) -> None:
    """No collective may start inside a compute (see the module docstring)."""
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
        m.set_requires_gradient_sync(False, recurse=False)
        m.set_is_last_backward(False)


# ---------------------------------------------------------------- completion


class _Bucket:
    """Gradients of several parameters reduced as one flat tensor."""

    __slots__ = ("params", "numel", "dtype", "device")

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.dtype = params[0].dtype
        self.device = params[0].device


def _make_buckets(params: Sequence[torch.Tensor], cap_bytes: int) -> list[_Bucket]:
    """Consecutive parameters (in reverse order, as DDP) of one dtype and device, up to ``cap_bytes`` each."""
    buckets: list[_Bucket] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append(_Bucket(current))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(_Bucket(current))
    return buckets


def _expert_scale(ep: int, active: Callable[[], bool]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Expert parallelism: the hook that scales each gradient contribution of an expert parameter by ``1 / ep``
    before autograd accumulates it into ``.grad``, while ``active()`` (a step of the Pipeline runs).

    An expert's gradient from one backward is the sum over the ep columns' tokens (the all-to-all's backward
    brought every column's here), while the unsplit model's is their mean (each column's loss is averaged over
    its microbatches, the columns' over the columns).  Dividing ``.grad`` by the columns at REDUCE_GRAD, as
    before, also divided what ``.grad`` held from earlier steps (accumulation without ``zero_grad``): they
    came out halved, silently.  Scaled here, each contribution is scaled once; REDUCE_GRAD then only averages
    over the dp replicas that hold the same experts, as DDP does (their earlier steps' part is the same on
    every replica, so the average keeps it).

    Only the Pipeline's own backwards are scaled: a backward the user runs over the stage modules between
    steps (a regulariser, a probe) is one process's own gradient, which the all-to-all gathered from nobody;
    scaled, it came out divided by ep, silently (the hooks stay registered from construction to ``close``).
    """
    def scale(g: torch.Tensor) -> torch.Tensor:
        return g / ep if active() else g

    return scale


# ---------------------------------------------------------------- the events


class _Plan:
    """What one action list requires, derived once per list (train or eval)."""

    def __init__(self, actions: Sequence[Action]) -> None:
        self.collectives: list[tuple[ActionType, int]] = []
        self.bw_total: dict[int, int] = {}
        #: per stage, for its k-th RESHARD: (stage computes listed before it, REDUCE_GRAD listed before it)
        self.reshard_need: dict[int, list[tuple[int, bool]]] = {}
        #: per stage, for its k-th UNSHARD: RESHARDs of the stage listed before it
        self.unshard_need: dict[int, list[int]] = {}
        #: stages whose computes wait for an UNSHARD (listed before their first compute)
        self.unshard_first: set[int] = set()
        #: FSDP stages that compute without a prior UNSHARD (filled in by StageCollectives)
        self.ungated: list[int] = []
        #: per stage, the buckets of parameters it shares with another local stage that its REDUCE_GRAD reduces
        #: (filled in by StageCollectives)
        self.shared_buckets: dict[int, list[_Bucket]] = {}
        #: the same for expert parameters several local stages share (reduced over the expert replicas)
        self.shared_expert_buckets: dict[int, list[_Bucket]] = {}
        computes: dict[int, int] = {}
        reduced: set[int] = set()
        reshards: dict[int, int] = {}
        for a in actions:
            t = a.type
            if t is _UNSHARD:
                self.collectives.append((t, a.stage))
                self.unshard_need.setdefault(a.stage, []).append(reshards.get(a.stage, 0))
                if computes.get(a.stage, 0) == 0:
                    self.unshard_first.add(a.stage)
            elif t is _REDUCE:
                self.collectives.append((t, a.stage))
                reduced.add(a.stage)
            elif t is _RESHARD:
                self.reshard_need.setdefault(a.stage, []).append((computes.get(a.stage, 0), a.stage in reduced))
                reshards[a.stage] = reshards.get(a.stage, 0) + 1
            else:
                for leaf in a.leaves():
                    computes[leaf.stage] = computes.get(leaf.stage, 0) + 1
                    if leaf.type is _B or leaf.type is _W:
                        self.bw_total[leaf.stage] = self.bw_total.get(leaf.stage, 0) + 1


class StageCollectives:
    """UNSHARD / RESHARD / REDUCE_GRAD of one rank's stages, as non-blocking events for the actor.

    The actor calls :meth:`begin_step` with the step's list, :meth:`ready` for
    readiness (collective actions, and computes of FSDP stages), :meth:`run`
    to launch one, :meth:`done` after every action, and waits for
    :attr:`outstanding` to reach 0 before the step ends.  Completions arrive
    on a waiter thread and are applied on the loop, which is woken.

    ``overlap=False``: :meth:`run` waits for the collectives it launched and
    applies them before returning (the dispatcher is blocked meanwhile), so
    :attr:`outstanding` is 0 whenever :meth:`run` has returned.
    """

    def __init__(
        self,
        stages: Mapping[int, nn.Module],
        *,
        rank: int,
        group: Any,
        group_ranks: Sequence[int],
        device: torch.device,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
        fsdp_reduce: str = "auto",
        expert_group: Any = None,
        expert_divisor: int | None = None,
    ) -> None:
        from ._fsdp_private import fsdp_modules

        self.rank = rank
        self.group = group
        self.group_ranks = list(group_ranks)
        self.size = len(self.group_ranks)
        self.peers = [r for r in self.group_ranks if r != rank]
        self.device = device
        #: False: every collective blocks the dispatcher until it has completed (see the module docstring)
        self.overlap = overlap
        #: "auto": reduce-scatter FSDP gradients here where that is a plain average; "fsdp": leave it to FSDP2
        self.fsdp_reduce = fsdp_reduce
        self._units: dict[int, list[Any]] = {}
        self._buckets: dict[int, list[_Bucket]] = {}
        self._modules = dict(stages)
        #: per FSDP stage: (name, sharded parameter) of every parameter FSDP manages
        self._sharded: dict[int, list[tuple[str, Any]]] = {}
        #: per FSDP stage: reduce-scatter here, asynchronously (True) or through FSDP's post-backward (False)
        self._own_reduce: dict[int, bool] = {}
        self._group_index = dist.get_rank(group) if group is not None else 0
        #: expert parallelism (runtime/expert_parallel.py): expert parameters are not averaged over ``group``
        #: (every column); each backward's contribution is scaled as it is accumulated (see ``_expert_hooks``)
        #: and REDUCE_GRAD averages them over ``expert_group`` (their dp replicas; None: not reduced)
        self.expert_group = expert_group
        self.expert_divisor = expert_divisor
        self._expert_buckets: dict[int, list[_Bucket]] = {}
        self._expert_replicas = 1 if expert_group is None else dist.get_world_size(expert_group)
        self._expert_hooks: list[Any] = []
        #: between begin_step and end_step: the Pipeline's step runs (its backwards scale expert gradients)
        self.in_step = False
        #: launch REDUCE_GRAD on the stage's own CUDA stream (set by the Pipeline with expert
        #: parallelism, where the stages keep their streams; see RankActor)
        self.on_stage_streams = False
        self._bucket_bytes = bucket_bytes
        # A parameter held by several of this rank's stages (a weight tied between the first and the last
        # stage of a V schedule, both on this rank) gets gradients from each; reduced in each stage's
        # bucket, the first REDUCE_GRAD averaged a part and its completion then overwrote what the other
        # stage's backward had added meanwhile.  It is reduced once, by whichever of its stages' REDUCE_GRAD
        # comes last in the list (collectives run in list order, so the others' backward is done by then).
        holders: dict[int, list[int]] = {}
        for s, module in stages.items():
            for p in module.parameters():
                holders.setdefault(id(p), []).append(s)
        shared = {i for i, ss in holders.items() if len(ss) > 1}
        #: (parameter, the local stages holding it) for every parameter several local stages share
        self._shared: list[tuple[torch.Tensor, list[int]]] = []
        #: the same for expert parameters (reduced over the expert replicas, not the row)
        self._shared_experts: list[tuple[torch.Tensor, list[int]]] = []
        if expert_divisor is not None:
            from pipeloom.moe import is_expert_parameter
        for s, module in stages.items():
            units = fsdp_modules(module)
            if units:
                _configure_fsdp(units)
                self._units[s] = units
                self._sharded[s] = [(n, p) for n, p in module.named_parameters() if p.requires_grad and _is_dtensor(p)]
            # Replicated parameters: every one under DDP, with FSDP those that no unit manages
            # (FSDP's are DTensors while resharded, which they are at construction).
            replicated = [p for p in module.parameters() if p.requires_grad and not _is_dtensor(p)]
            experts = []
            if expert_divisor is not None:
                experts = [p for p in replicated if is_expert_parameter(p)]
                replicated = [p for p in replicated if not is_expert_parameter(p)]
                for p in experts:
                    if holders[id(p)][0] == s:  # (once per parameter, also where several local stages hold it)
                        self._expert_hooks.append(p.register_hook(
                            _expert_scale(expert_divisor // self._expert_replicas, lambda: self.in_step)))
                        if id(p) in shared:
                            self._shared_experts.append((p, holders[id(p)]))
                experts = [p for p in experts if id(p) not in shared]
                if experts and expert_group is not None:
                    self._expert_buckets[s] = _make_buckets(experts, bucket_bytes)
            for p in replicated:
                if id(p) in shared and holders[id(p)][0] == s:
                    self._shared.append((p, holders[id(p)]))
            replicated = [p for p in replicated if id(p) not in shared]
            if replicated and self.size > 1:
                self._buckets[s] = _make_buckets(replicated, bucket_bytes)
        self._actor: Any = None
        self._waiter: WorkWaiter | None = None
        self._plans: list[tuple[Sequence[Action], _Plan]] = []
        self.outstanding = 0
        self._step = 0
        #: False while accumulating (``Pipeline.no_sync``): REDUCE_GRAD reduces nothing
        self.sync = True
        #: stages whose parameters are gathered and usable by computes
        self._unsharded: set[int] = set()
        self._gathering: dict[int, list[Any]] = {}
        self._new_step(_Plan(()))

    @property
    def fsdp_stages(self) -> list[int]:
        return sorted(self._units)

    def attach(self, actor: Any) -> None:
        """Called by the actor: completions wake it, failures stop its step."""
        self._actor = actor

    def close(self) -> None:
        for h in self._expert_hooks:  # (the modules may outlive this Pipeline: their gradients unscaled again)
            h.remove()
        self._expert_hooks = []
        if self._waiter is not None:
            self._waiter.stop()
            self._waiter = None

    # ---------------------------------------------------------- per step
    def _new_step(self, plan: _Plan) -> None:
        self._plan = plan
        self._queue: deque[tuple[ActionType, int]] = deque(plan.collectives)
        self._computes: dict[int, int] = {}
        self._bw_done: dict[int, int] = {}
        self._reshards: dict[int, int] = {}
        self._unshards: dict[int, int] = {}
        self._reduced: set[int] = set()
        #: FSDP stages whose computes must wait for their UNSHARD in this list
        self._gated = plan.unshard_first & set(self._units)

    def begin_step(self, actions: Sequence[Action]) -> None:
        """Start a step running ``actions`` (the actor's static train or eval list, not a copy)."""
        plan = self._plan_for(actions)
        if plan.ungated:
            raise PipelineConfigError(
                f"rank {self.rank}: FSDP stage(s) {plan.ungated} compute without an UNSHARD before their first compute "
                "in the schedule; lower it with fsdp=True (pipeloom.schedules.lower)"
            )
        self._new_step(plan)
        self.in_step = True

    def end_step(self) -> None:
        """The step has ended (done or failed): backwards from here on are the user's (see ``_expert_scale``)."""
        self.in_step = False

    def _plan_for(self, actions: Sequence[Action]) -> _Plan:
        for lst, plan in self._plans:
            if lst is actions:
                return plan
        plan = _Plan(actions)
        computed = {leaf.stage for a in actions if a.type not in COLLECTIVE_TYPES for leaf in a.leaves()}
        plan.ungated = sorted(s for s in self._units if s in computed and s not in plan.unshard_first)
        order = [s for t, s in plan.collectives if t is _REDUCE]

        def by_last_reduce(shared: list[tuple[torch.Tensor, list[int]]]) -> dict[int, list[_Bucket]]:
            by_stage: dict[int, list[torch.Tensor]] = {}
            for p, holding in shared:
                listed = [s for s in order if s in holding]
                if listed:
                    by_stage.setdefault(listed[-1], []).append(p)
            return {s: _make_buckets(ps, self._bucket_bytes) for s, ps in by_stage.items()}

        if self._shared and self.size > 1:
            plan.shared_buckets = by_last_reduce(self._shared)
        if self._shared_experts and self.expert_group is not None:
            plan.shared_expert_buckets = by_last_reduce(self._shared_experts)
        self._plans.append((actions, plan))
        return plan

    # ---------------------------------------------------------- readiness
    def ready(self, a: Action) -> bool:
        t = a.type
        if t is _UNSHARD:
            q = self._queue
            if not q or q[0][0] is not t or q[0][1] != a.stage:
                return False
            k = self._unshards.get(a.stage, 0)
            need = self._plan.unshard_need[a.stage]
            return k >= len(need) or self._reshards.get(a.stage, 0) >= need[k]
        if t is _REDUCE:
            q = self._queue
            if not q or q[0][0] is not t or q[0][1] != a.stage:
                return False
            return self._bw_done.get(a.stage, 0) >= self._plan.bw_total.get(a.stage, 0)
        if t is _RESHARD:
            s = a.stage
            if s in self._gathering:
                return False
            needs = self._plan.reshard_need.get(s, ())
            k = self._reshards.get(s, 0)
            if k >= len(needs):
                return True
            count, after_reduce = needs[k]
            return self._computes.get(s, 0) >= count and (not after_reduce or s in self._reduced)
        gated = self._gated
        if not gated:
            return True
        for leaf in a.leaves():
            if leaf.stage in gated and leaf.stage not in self._unsharded:
                return False
        return True

    def describe(self, a: Action) -> str | None:
        """Why ``a`` is not ready, if it is for a data-parallel reason."""
        t = a.type
        if t in (_UNSHARD, _REDUCE):
            q = self._queue
            if q and (q[0][0] is not t or q[0][1] != a.stage):
                return f"{a}: collectives over the data-parallel group go in list order; {q[0][1]}{q[0][0].value} first"
            if t is _REDUCE:
                return (
                    f"{a}: backward of stage {a.stage} ({self._bw_done.get(a.stage, 0)} of "
                    f"{self._plan.bw_total.get(a.stage, 0)} B/W done)"
                )
            return f"{a}: an earlier RESHARD of stage {a.stage}"
        if t is _RESHARD:
            if a.stage in self._gathering:
                return f"{a}: all-gather of stage {a.stage} over ranks {self.group_ranks}"
            return f"{a}: earlier computes of stage {a.stage}"
        for leaf in a.leaves():
            if leaf.stage in self._gated and leaf.stage not in self._unsharded:
                if leaf.stage in self._gathering:
                    return f"{leaf}: all-gather (UNSHARD) of stage {leaf.stage} over ranks {self.group_ranks}"
                return f"{leaf}: UNSHARD of stage {leaf.stage}"
        return None

    # ---------------------------------------------------------- running
    def done(self, a: Action) -> None:
        """Bookkeeping after any action ran."""
        if a.type in COLLECTIVE_TYPES:
            return
        for leaf in a.leaves():
            s = leaf.stage
            self._computes[s] = self._computes.get(s, 0) + 1
            if leaf.type is _B or leaf.type is _W:
                self._bw_done[s] = self._bw_done.get(s, 0) + 1

    def run(self, a: Action, step: int) -> None:
        t = a.type
        s = a.stage
        self._step = step
        if t is _UNSHARD:
            self._queue.popleft()
            self._unshards[s] = self._unshards.get(s, 0) + 1
            self._unshard(s)
        elif t is _RESHARD:
            self._reshards[s] = self._reshards.get(s, 0) + 1
            for m in self._units.get(s, ()):
                m.reshard()
            self._unsharded.discard(s)
        elif t is _REDUCE:
            self._queue.popleft()
            self._reduced.add(s)
            units = self._units.get(s)
            if not self.sync:
                # Accumulation step (Pipeline.no_sync): gradients stay local, unreduced (FSDP's
                # unsharded ones on its unsharded parameters), and add up until a step that syncs.
                if units:
                    from ._fsdp_private import finish_backward

                    finish_backward(units)
                return
            if units:
                self._reduce_sharded(s, units)
            for bucket in [*self._buckets.get(s, ()), *self._plan.shared_buckets.get(s, ())]:
                self._all_reduce(bucket, s, step)
            # expert parameters: each backward's contribution was scaled as it was accumulated (_expert_scale);
            # what is left is the average over their dp replicas (none without data parallelism)
            for bucket in [*self._expert_buckets.get(s, ()), *self._plan.shared_expert_buckets.get(s, ())]:
                self._all_reduce(bucket, s, step, group=self.expert_group, divisor=self._expert_replicas)
        else:
            raise AssertionError(f"not a data-parallel action: {a}")

    def _unshard(self, s: int) -> None:
        from ._fsdp_private import all_gather_works

        units = self._units.get(s)
        if not units:
            self._unsharded.add(s)
            return
        handles = [m.unshard(async_op=True) for m in units]
        works = all_gather_works(handles)
        if not works:  # nothing in flight, or this torch hides the Work: wait here
            for h in handles:
                if h is not None:
                    h.wait()
            self._unsharded.add(s)
            return
        self._gathering[s] = handles

        def landed() -> None:
            for h in self._gathering.pop(s, ()):
                if h is not None:
                    h.wait()  # the copy-out; the data is there
            self._unsharded.add(s)

        nbytes = sum(p.numel() * p.element_size() for _, p in self._sharded.get(s, ()))
        self._submit(works, landed, f"all-gather (UNSHARD) of stage {s}", (f"{s}UNSHARD", "all-gather", s, nbytes))

    def _reduce_sharded(self, s: int, units: list[Any]) -> None:
        """REDUCE_GRAD of an FSDP stage: one asynchronous reduce-scatter of its accumulated unsharded gradients.

        FSDP2 itself reduce-scatters synchronously on CPU, so when its
        reduction would be a plain average (see ``_fsdp_private.plain_reduction``)
        it is done here instead: the unsharded gradients are copied into one
        padded flat buffer laid out as FSDP shards (dim 0, ``torch.chunk``
        sizes), the collective is launched, FSDP's per-step state is reset, and
        on completion each sharded parameter gets its DTensor gradient.
        """
        from . import _fsdp_private as fp

        own = self._own_reduce.get(s)
        if own is None:
            own = self._own_reduce[s] = (
                self.fsdp_reduce != "fsdp"
                and self.size > 1
                and all(sp.dim() > 0 for _, sp in self._sharded[s])
                and len({sp.dtype for _, sp in self._sharded[s]}) <= 1
                and fp.plain_reduction(units)
            )
        if not own:
            self._reduce_by_fsdp(s, units)
            return
        sharded = self._sharded[s]
        if not sharded:
            fp.finish_backward(units)
            return
        current = dict(self._modules[s].named_parameters())  # the unsharded parameters, registered now
        if any(_is_dtensor(current[name]) for name, _ in sharded):  # resharded before its REDUCE_GRAD
            self._reduce_by_fsdp(s, units)
            return
        ws, idx = self.size, self._group_index
        layout = []
        total = 0
        for name, sp in sharded:
            full = current[name]
            rows = full.shape[0]
            rest = tuple(full.shape[1:])
            chunk_rows = -(-rows // ws)
            per_row = full.numel() // rows if rows else 0
            layout.append((name, sp, full, rows, rest, chunk_rows, chunk_rows * per_row, total))
            total += chunk_rows * per_row
        dtype = sharded[0][1].dtype
        # After the gradients, one column per parameter in every rank's row: how many replicas hold a
        # gradient for it (see _all_reduce: a parameter that got none anywhere keeps grad None)
        inp = torch.zeros(ws, total + len(layout), dtype=dtype, device=self.device)
        local_none = False
        for i, (name, sp, full, rows, rest, chunk_rows, cn, off) in enumerate(layout):
            g = full.grad
            local_none = local_none or g is None
            if g is not None:
                inp[:, total + i] = 1
                # rank k's shard is rows [k * chunk_rows, (k + 1) * chunk_rows), zero-padded
                padded = g.new_zeros(ws * chunk_rows, *rest)
                padded[:rows].copy_(g)
                inp[:, off : off + cn].copy_(padded.view(ws, cn))
                full.grad = None  # consumed; FSDP keeps the unsharded parameter across steps
        fp.finish_backward(units)
        if self.device.type == "cuda":
            kind = "reduce-scatter"
            out = torch.empty(total + len(layout), dtype=dtype, device=self.device)
            work = dist.reduce_scatter_tensor(out, inp.view(-1), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        else:
            # gloo's reduce-scatter Work never reports completion to is_completed() (only a
            # blocking wait() ends it), and the waiter must poll; an all-reduce of the same
            # buffer does report it, at twice the traffic, and this rank keeps its own row.
            kind = "all-reduce"
            out = inp[idx]
            work = dist.all_reduce(inp, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        from torch.distributed.tensor import DTensor

        def landed() -> None:
            del inp_keep[:]
            # (read on the host only where this rank lacked a gradient; before the division, which is queued
            # on the compute stream: see _host_counts)
            anywhere = _host_counts(out[total:]) if local_none else [1.0] * len(layout)
            out.div_(ws)
            for (name, sp, full, rows, rest, chunk_rows, cn, off), used in zip(layout, anywhere):
                local_rows = max(0, min(chunk_rows, rows - idx * chunk_rows))
                local = out[off : off + cn].view(chunk_rows, *rest)[:local_rows]
                old = sp.grad
                if old is not None:
                    local = old.to_local() + local
                elif not used:
                    continue  # no replica had a gradient for it: None, as in a full backward
                sp.grad = DTensor.from_local(local, sp.device_mesh, sp.placements, run_check=False, shape=sp.shape, stride=sp.stride())

        inp_keep = [inp]  # alive until the collective is done
        self._submit([work], landed, f"{kind} of stage {s}'s sharded gradients ({total * ws} elements)",
                     (f"{s}REDUCE_GRAD", kind, s, inp.numel() * inp.element_size()))

    def _reduce_by_fsdp(self, s: int, units: list[Any]) -> None:
        """REDUCE_GRAD of an FSDP stage through FSDP2's own post-backward (mixed precision, offload,
        ``fsdp_reduce="fsdp"``), with the replicas' reduce-scatters matched.

        FSDP2 reduce-scatters only what has a gradient on this rank, so a parameter with a gradient on one
        replica only (a data-dependent branch) made the replicas' collectives differ (see
        ``_fsdp_private.fill_missing_grads``, which gives every trainable parameter one, zeros where it had
        none).  Beside it, one small all-reduce counts the replicas that had a gradient for each parameter,
        issued first on every replica; when it lands, a parameter none of them had one for gets ``grad``
        None back (what the zeros made it), as in the unsplit model's backward and as ``_all_reduce`` does.
        """
        from . import _fsdp_private as fp

        if self.size <= 1:
            fp.reduce_grads(units)
            return
        filled = fp.fill_missing_grads(units)
        if not filled:
            fp.reduce_grads(units)
            return
        held = torch.tensor([1.0 if had else 0.0 for _, had, _ in filled], dtype=torch.float32, device=self.device)
        work = dist.all_reduce(held, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        fp.reduce_grads(units)

        def landed() -> None:
            if not all(had for _, had, _ in filled):  # (else every count is at least 1; read on the host only here)
                for (param, _, before), count in zip(filled, _host_counts(held)):
                    if count == 0 and not before:
                        param.sharded_param.grad = None  # no replica had a gradient: None, as in a full backward

        self._submit([work], landed, f"all-reduce of which of stage {s}'s sharded parameters have gradients",
                     (f"{s}REDUCE_GRAD", "all-reduce", s, held.numel() * held.element_size()))

    def _all_reduce(self, bucket: _Bucket, s: int, step: int, *, group: Any = None, divisor: int | None = None) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        # One more element per parameter, summed with the gradients: how many replicas hold a
        # gradient for it.  A parameter that got none on any replica (unused in this step, or
        # by the model) keeps ``grad = None``, as in the unsplit model's backward; a zero
        # gradient there instead would be stepped by AdamW's weight decay or a momentum.
        # (made without a host-to-device copy, which would wait for a GPU's queued work; read back on the
        # host only where this rank lacks a gradient, which is rare)
        held = grads[0].new_ones(len(grads))
        for i, p in enumerate(bucket.params):
            if p.grad is None:
                held[i] = 0
        flat = torch.cat([*(g.detach().reshape(-1) for g in grads), held])
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group if group is None else group, async_op=True)
        size = self.size if divisor is None else divisor

        def landed() -> None:
            local_none = any(p.grad is None for p in bucket.params)
            # (the replicas' counts, read before the division is queued: see _host_counts)
            anywhere = _host_counts(flat[bucket.numel :]) if local_none else [1.0] * len(bucket.params)
            flat.div_(size)
            offset = 0
            for p, used in zip(bucket.params, anywhere):
                n = p.numel()
                view = flat[offset : offset + n].view_as(p)
                offset += n
                if p.grad is None:
                    if used:
                        p.grad = view
                else:
                    p.grad.copy_(view)

        self._submit([work], landed, f"all-reduce of stage {s}'s gradients ({bucket.numel} elements)",
                     (f"{s}REDUCE_GRAD", "all-reduce", s, flat.numel() * flat.element_size()))

    def _submit(self, works: list[Any], landed: Callable[[], None], what: str, span: tuple[str, str, int, int]) -> None:
        """Wait for ``works`` on the waiter thread; then, on the loop, run ``landed`` and wake the actor.

        Without overlap, wait for them here (blocking the dispatcher) and run ``landed`` before returning.
        """
        actor = self._actor
        trace = getattr(actor, "trace", None)
        t0 = clock_ns() if trace is not None else 0
        step = self._step
        if not self.overlap:
            self.outstanding += 1
            err = self._wait_now(works)
            self.outstanding -= 1
            if err is not None:
                raise self._lost(what, err)
            landed()  # an exception here fails the action that launched the collective
            if trace is not None:
                trace.collective(step, span[0], span[1], span[2], span[3], t0, clock_ns())
            return
        loop = asyncio.get_running_loop()
        if self._waiter is None:
            # Poll, never park inside gloo's wait() (see WorkWaiter): a rank that stops
            # on a failure exits with this thread still waiting.
            cuda = self.device.type == "cuda"
            self._waiter = WorkWaiter(
                f"pipeloom-dp-r{self.rank}", poll=True, max_delay=2e-4 if cuda else 1e-3, wait_after_poll=not cuda
            )
        self.outstanding += 1

        def on_loop(err: BaseException | None) -> None:
            self.outstanding -= 1
            if err is None:
                try:
                    landed()
                except Exception as exc:  # a bug here must stop the step, not vanish in a callback
                    err = exc
            if err is not None and actor is not None:
                actor._fail_remote(self._lost(what, err))
            elif trace is not None:
                trace.collective(step, span[0], span[1], span[2], span[3], t0, clock_ns())
            if actor is not None:
                actor._wake.set()

        def complete(err: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(on_loop, err)
            except RuntimeError:  # the loop is closed: the job is being torn down
                pass

        self._waiter.submit(works, complete)

    def _wait_now(self, works: list[Any]) -> BaseException | None:
        """Block until every Work in ``works`` has completed (``overlap=False``); the error, if one failed."""
        cuda = self.device.type == "cuda"
        actor = self._actor
        limit = float(getattr(actor, "stall_timeout", 30.0) or 30.0) + float(getattr(actor, "heartbeat_timeout", 10.0) or 10.0)
        deadline = time.monotonic() + limit
        try:
            for w in works:
                delay = 5e-6
                # poll, as the waiter thread does (see WorkWaiter): on CUDA, is_completed() is
                # true once the GPU has run the collective; wait() would only order a stream
                while not w.is_completed():
                    if time.monotonic() > deadline:
                        return TimeoutError(
                            f"not completed after {limit:g} s (overlap_collectives=False: the collective blocks this rank)"
                        )
                    time.sleep(delay)
                    delay = min(delay * 2, 5e-5 if cuda else 1e-3)
                if not cuda:
                    w.wait()  # returns at once, raising the collective's error if it failed (gloo)
        except Exception as exc:  # gloo raises RuntimeError on a closed connection
            return exc
        return None

    def _lost(self, what: str, err: BaseException) -> PeerLostError:
        """Name the peer most likely gone: the data-parallel peer heard from least recently."""
        actor = self._actor
        liveness = getattr(actor, "liveness", None)
        peer = min(self.peers, key=liveness.last_heard) if self.peers and liveness is not None else (self.peers or [self.rank])[0]
        return PeerLostError(f"{what} over the data-parallel group (ranks {self.group_ranks}) failed: {err}", rank=self.rank, peer=peer)

    async def drain(self, check: Callable[[], None], interval: float) -> None:
        """Wait (without blocking the loop) until every launched collective completed; ``check()`` may raise."""
        actor = self._actor
        while self.outstanding:
            check()
            wake = actor._wake
            wake.clear()
            if not self.outstanding:
                break
            await wake.wait_for(interval)
        check()


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)
