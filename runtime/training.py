"""What a training loop needs across ranks: the global gradient norm and the step's loss.

The problem.  In a pipeline, no rank sees the whole model: each holds some
stages, with FSDP a shard of each, and with data parallelism several ranks
hold the same (replicated) gradients.  ``torch.nn.utils.clip_grad_norm_`` on
one rank's parameters clips by that rank's norm, which differs on every
rank, so the stages end up scaled by different factors.  Likewise the losses
exist only on the last stage's ranks, one per replica.

The rule used here.  The global ``p``-norm is ``(sum_i |g_i|^p)^(1/p)`` over
every parameter of the model, each counted once:

* a parameter of a stage this rank holds alone (pipeline only): counted here;
* an FSDP-sharded parameter (a DTensor sharded over the replicas): each rank
  adds its shard's ``|.|^p``; the shards sum to the whole;
* a replicated parameter (DDP, or one FSDP does not manage): identical on
  every replica after REDUCE_GRAD, so only the replica with ``dp_rank == 0``
  counts it;
* a weight tied across pipeline ranks (``RuntimeOptions.tied_weights="sync"``):
  identical on every holding rank after the step, so only the lowest holding
  rank counts it (of its replicas, the one with ``dp_rank == 0``).

One all-reduce (SUM, or MAX for the inf-norm) of a single float64 over every
rank gives every rank the same total, hence the same clip coefficient, which
then scales every local gradient (shard or replica) in place, as torch's
``clip_grad_norm_`` does (``max_norm / (total + 1e-6)``, clamped to 1).

Alternative considered: gather every gradient's norm to one rank and
broadcast the coefficient (two collectives instead of one, and a rank
that holds nothing would still have to take part).

The step's loss: each last-stage rank adds its microbatch losses and counts
them; one all-reduce of ``[sum, count]`` (kept by one rank for ``reduce_to=``) gives the
mean over every microbatch of every replica.

Both are collectives over all ranks of the job: every rank calls them, in the
same order, between steps.  A rank that died makes them fail within
``stall_timeout + heartbeat_timeout`` seconds (a ``PeerLostError``), not hang.
"""

from __future__ import annotations

import math
import zlib
import time
from typing import Any

import torch
import torch.distributed as dist

from .errors import PeerLostError, PipelineConfigError, PipelineError

__all__ = ["clip_grad_norm_", "reduce_step_loss"]


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _sharded(g: Any) -> bool:
    from torch.distributed.tensor import Shard

    return any(isinstance(pl, Shard) for pl in g.placements)


#: seconds a collective waits on for its completion once a peer said 'bye' (the peer may have joined it, then closed)
_CLOSED_GRACE = 0.25

#: payload elements every training-loop collective carries (padded), so that two different ones are of one size
_TAGGED_WIDTH = 2


#: (default group, weakly, id of the Pipeline, what) of each training-loop collective left pending past its bound: every
#: Pipeline built on that group refuses later steps and collectives, not only the one that called it (an evaluation
#: Pipeline beside a training one shares the group: its next collective, or its step's layout agreement on gloo,
#: would pair with the pending one on the peers that never called it)
_PENDING: list[tuple[Any, int, str]] = []


def pending_collective(pipe: Any) -> str | None:
    """Why ``pipe`` may run no more steps or training-loop collectives (one left pending on its default group, by
    it or by another Pipeline on that group), worded to follow "an earlier training-loop collective"; or None."""
    own = getattr(pipe, "_collective_broken", None)
    if own is not None:
        return f"of this Pipeline did not complete ({own})"
    ref = getattr(pipe, "_world_group", None)
    group = ref() if ref is not None else None
    for g, who, why in _PENDING:
        if group is not None and g is not None and g() is group and who != id(pipe):
            return f"of another Pipeline on this process group did not complete ({why})"
    return None


def connect_training_collectives(device: torch.device) -> None:
    """NCCL: all-reduce one buffer of the shape :func:`_collective` uses, on the default group, with every rank.

    NCCL (2.22 on, ``NCCL_RUNTIME_CONNECT``) connects a communicator's channels for an algorithm at its first
    collective, inside the host call, which blocks until every peer has made it.  The default group runs no
    collective before the first training-loop one (construction agrees through the store, transfers run on pair
    groups), so a ``last_loss()`` that one peer never called (it closed its Pipeline, or ran its next step) blocked
    this rank inside ``dist.all_reduce`` itself, out of reach of the bound :func:`_collective` polls with, and the
    peer at its exit (both seen on 2 x H200, torch 2.11).  Called by the Pipeline's constructor, where every rank is.
    """
    buf = torch.zeros(_TAGGED_WIDTH + 2, dtype=torch.float64, device=device)
    dist.all_reduce(buf)
    buf.tolist()  # (completed: the host waits for it here, not in the first step)


def _collective(pipe: Any, t: torch.Tensor, op: Any, *, dst: int | None, what: str, key: str = "") -> None:
    """An all-reduce over every rank (the result for ``dst`` alone, or for every rank where ``dst`` is None),
    bounded in time instead of hanging on a dead peer.

    ``key``: more of what the call is (``clip_grad_norm_``'s norm type and max_norm), carried in its tag with
    ``what`` and ``op``: ranks that call it with different keys are told so, as for different collectives.

    Refused at once after a failed step of this Pipeline (its gradients and losses are partial, and a peer may
    not call it); while it waits, a failure a peer reported (its step failed after this rank's had ended) is
    raised as that peer's error instead of waiting out the bound.
    """
    failed = getattr(pipe, "_failed", None)
    if failed is not None:
        step, exc0 = failed
        # (the Pipeline's own rank: on NCCL a failed step aborted the default group, and dist.get_rank() raises)
        raise PipelineError(f"rank {getattr(pipe, 'rank', '?')}: {what}: this Pipeline's step {step} failed "
                            f"({type(exc0).__name__}: {exc0}); its gradients and losses are partial") from exc0
    broken = pending_collective(pipe)
    if broken is not None:
        raise PipelineError(
            f"rank {getattr(pipe, 'rank', '?')}: {what}: an earlier training-loop collective {broken}; it is still "
            "pending, and a later one would pair with it on the peers that never called it (the ranks' collectives out "
            "of step, the values of one call in another's result): close this Pipeline and restart the job from a "
            "checkpoint")
    actor = getattr(pipe, "_actor", None)
    between = getattr(actor, "error_between_steps", None)
    if between is not None and (err := between()) is not None:
        raise err
    control = getattr(actor, "control", None)
    # Which collective this is travels with it: the payload padded to one width and two tag elements, so that ranks
    # calling different ones (last_loss on one, clip_grad_norm_ on another) are told so instead of combining unlike
    # values.  NCCL checks nothing: a loss's 2 elements all-reduced against a norm's 1 completed or hung by chance,
    # and two of one width would complete with each rank's values mixed into the other's result, silently.
    flat = t.reshape(-1)
    width = max(_TAGGED_WIDTH, flat.numel())
    # (an all-reduce even for one rank's result: with a reduce, the ranks other than dst never read the tags, and a
    # reduce met by another collective's all-reduce neither completed nor failed, on gloo: both waited out the bound)
    tag = float(zlib.crc32(f"{what}/{op}/{key}".encode()) % 65521 + 1)
    is_max = op == dist.ReduceOp.MAX
    buf = torch.zeros(width + 2, dtype=torch.float64, device=t.device)
    buf[: flat.numel()] = flat
    buf[width] = tag
    buf[width + 1] = -tag if is_max else tag * tag
    work = dist.all_reduce(buf, op=op, async_op=True)
    limit = float(getattr(actor, "stall_timeout", 30.0)) + float(getattr(actor, "heartbeat_timeout", 10.0))
    deadline = time.monotonic() + limit
    delay = 1e-5
    check_at = time.monotonic() + 0.05
    try:
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"not completed after {limit:g} s")
            if between is not None and now > check_at:
                check_at = now + 0.05
                if (err := between()) is not None:
                    raise err
                if getattr(control, "peers_closed", None):  # (NCCL: a peer that left never fails the collective)
                    # (a peer that joined it and then closed, as at the end of a job: its 'bye' can be read before
                    # this rank's collective is seen complete; that one completes at once, a peer's that never came,
                    # never)
                    grace = time.monotonic() + _CLOSED_GRACE
                    while not work.is_completed() and time.monotonic() < grace:
                        time.sleep(1e-3)
                    if not work.is_completed():
                        raise ConnectionError("a peer closed its Pipeline")
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)
        work.wait()
    except PipelineError:
        raise
    except Exception as exc:  # gloo raises RuntimeError on a closed connection
        pending = not work.is_completed()
        if pending:  # (never to complete: it must not hold up the process's exit)
            from ..transport.tensor import guard_exit_works

            guard_exit_works([work])
            pipe._collective_timed_out = True
            pipe._collective_broken = f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            _PENDING.append((getattr(pipe, "_world_group", None), id(pipe), pipe._collective_broken))
        try:
            err = _why_not_completed(pipe, exc, what, limit, between, actor)
        finally:
            if pending:
                # NCCL: the pending collective would hold the process at exit (finalizing waits for it), and every
                # later collective of the group would queue behind it: abort the communicators, as after a failed
                # step (after the error is worked out: aborting the default group forgets it, and dist.get_rank())
                abort = getattr(pipe, "_abort_nccl", None)
                if abort is not None:
                    abort()
        raise err from exc
    world = dist.get_world_size()
    got = buf[width:].tolist()
    want = [tag, -tag] if is_max else [world * tag, world * tag * tag]
    if got != want:
        raise PipelineError(
            f"rank {dist.get_rank()}: {what} over all {world} ranks met another collective on some rank: every rank must "
            "call last_loss(), clip_grad_norm_() (with the same max_norm and norm_type) and a PipelineGradScaler's "
            "unscale_()/step() in the same order; the result is discarded"
        )
    if dst is None or dist.get_rank() == dst:
        t.copy_(buf[: flat.numel()].reshape(t.shape))


def _why_not_completed(pipe: Any, exc: BaseException, what: str, limit: float, between: Any, actor: Any) -> BaseException:
    """The error a training-loop collective that failed or ran out of time raises (see :func:`_collective`)."""
    from .checkpoint import _lost_peer

    rank, world = dist.get_rank(), dist.get_world_size()
    same_order = ("every rank must call last_loss(), clip_grad_norm_() and a PipelineGradScaler's unscale_()/step() "
                  "in the same order (a rank that called another of them, or none, leaves its peers waiting here)")
    # A peer that ended *cleanly* (it said 'bye': it closed its Pipeline, or its script ended, e.g. after its own
    # collective timed out the same way) was not lost: it never joined this collective.  On NCCL its process is
    # gone by the time this rank's bound runs out; on gloo its leaving breaks the collective at once.
    lost = _lost_peer(pipe, exc, what, wait=0.5)
    if between is not None and (err := between()) is not None:  # (reads the control plane: a 'bye' too)
        return err
    closed = sorted(getattr(getattr(actor, "control", None), "peers_closed", None) or ())
    if closed and (lost is None or lost.peer in closed):
        who = f"rank {closed[0]}" if len(closed) == 1 else f"ranks {closed}"
        return PipelineError(f"rank {rank}: {what} over all {world} ranks did not complete: {who} closed its "
                             f"Pipeline without joining it; {same_order}")
    if lost is not None:
        return lost
    if isinstance(exc, TimeoutError):
        # every peer alive: one of them is in another collective, or in none (the ranks called last_loss,
        # clip_grad_norm_ or a PipelineGradScaler's unscale_/step in different orders or numbers)
        return PipelineError(f"rank {rank}: {what} over all {world} ranks did not complete in {limit:g} s and no peer "
                             f"is known lost: {same_order}")
    return PeerLostError(f"{what} over all {world} ranks failed: {exc}", rank=rank, peer=-1)


@torch.no_grad()
def clip_grad_norm_(
    pipe: Any, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Clip the gradients of the whole pipelined model by their global norm; return that norm.

    The same contract as ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``
    on the unsplit model: every rank gets the total norm (a float64 tensor on
    the pipeline's device) and its gradients are scaled by
    ``min(1, max_norm / (total + 1e-6))``.  Call it on every rank after the
    step (after the gradients were reduced: not inside ``no_sync``).  With
    expert parallelism the unsplit model holds every expert once: each ep
    rank's expert shard is counted, the replicated parameters once.
    """
    p = float(norm_type)
    if not (p > 0 or p == math.inf):
        raise PipelineConfigError(f"norm_type must be positive or inf, got {norm_type}")
    # each parameter's gradient counted once over the job: replicated ones on the first (dp, ep)
    # column; expert shards (expert parallelism: column = dp index x ep + ep index) on every ep
    # rank of the first dp index, since each ep rank holds other experts
    column = getattr(pipe, "dp_rank", 0)
    ep = max(1, int(getattr(pipe, "expert_parallel", 1) or 1))
    count_replicated = column == 0
    count_experts = column < ep
    counted: list[torch.Tensor] = []
    scaled: list[torch.Tensor] = []
    if ep > 1:
        from pipeloom.moe import is_expert_parameter
    # a weight tied across pipeline ranks (RuntimeOptions.tied_weights="sync") holds the same gradient on each holding
    # rank: counted by the lowest of them alone (runtime/ties.py TiedCopies), scaled on every one
    ties = getattr(pipe, "_ties", None)
    tied_elsewhere = ties.not_counted if ties else set()
    for param in pipe.parameters():
        g = param.grad
        if g is None:
            continue
        if id(param) in tied_elsewhere:
            scaled.append(g)
            continue
        if ep > 1 and is_expert_parameter(param):
            scaled.append(g)
            if count_experts:
                counted.append(g)
            continue
        if _is_dtensor(g):
            local = g.to_local()
            scaled.append(local)
            if _sharded(g) or count_replicated:
                counted.append(local)
        else:
            scaled.append(g)
            if count_replicated:
                counted.append(g)
    device = pipe.device
    local_total = torch.zeros((), dtype=torch.float64, device=device)
    if counted:
        if p == math.inf:
            local_total = torch.stack([g.detach().abs().max().to(torch.float64) for g in counted if g.numel()] or [local_total]).max()
        else:
            norms = torch.stack([torch.linalg.vector_norm(g.detach(), p).to(torch.float64) for g in counted])
            local_total = norms.pow(p).sum()
    # (ranks clipping by different norms or to different maxima would scale their stages by different factors, the
    # very thing a global clip exists to prevent: the tag carries both, so that such ranks are told)
    key = f"norm_type={p!r} max_norm={float(max_norm)!r}"
    if p == math.inf:
        # A NaN must reach every rank, as torch's max gives NaN on the unsplit model.  gloo's MAX
        # keeps a NaN only where it is the left operand (rank 0's): from any other rank it is
        # dropped and the norm came back finite.  So the NaN travels as a flag beside the maximum
        # of the rest, in the same all-reduce.
        nan = torch.isnan(local_total)
        both = torch.stack([torch.where(nan, torch.zeros_like(local_total), local_total), nan.to(torch.float64)])
        _collective(pipe, both, dist.ReduceOp.MAX, dst=None, what="the gradient norm's all-reduce", key=key)
        total = torch.where(both[1] > 0, torch.full_like(both[0], math.nan), both[0])
    else:
        _collective(pipe, local_total, dist.ReduceOp.SUM, dst=None, what="the gradient norm's all-reduce", key=key)
        total = local_total.pow(1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from all pipeline stages is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in scaled:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def reduce_step_loss(pipe: Any, losses: dict[int, torch.Tensor] | None, *, reduce_to: str | int = "all") -> float | None:
    """The mean of the last step's microbatch losses over every replica; on every rank or only on rank 0."""
    if reduce_to != "all" and (isinstance(reduce_to, bool) or not isinstance(reduce_to, int)):
        raise PipelineConfigError(f"reduce_to must be 'all' or a rank number, got {reduce_to!r}")
    world = getattr(pipe, "world_size", None) or dist.get_world_size()
    if reduce_to != "all" and not 0 <= int(reduce_to) < world:
        raise PipelineConfigError(f"reduce_to={reduce_to} is not a rank of this {world}-rank job")
    vals = list((losses or {}).values())
    t = torch.zeros(2, dtype=torch.float64, device=pipe.device)
    if vals:
        t[0] = torch.stack([v.detach().to(t.device, torch.float64).reshape(()) for v in vals]).sum()
        t[1] = len(vals)
    dst = None if reduce_to == "all" else int(reduce_to)
    _collective(pipe, t, dist.ReduceOp.SUM, dst=dst, what="the step loss's reduction")
    if dst is not None and dist.get_rank() != dst:
        return None
    if t[1] == 0:
        raise PipelineConfigError("no rank has a loss for the last step (was it run with a target and a loss_fn?)")
    return float(t[0] / t[1])
