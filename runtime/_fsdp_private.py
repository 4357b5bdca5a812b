"""The two places where pipeloom reaches into FSDP2's internals (torch 2.11 - 2.13).

Everything else uses FSDP2's public API (``fully_shard``, ``FSDPModule.unshard``
/ ``reshard`` / ``set_*``).  These two cannot:

1. **Knowing when an unshard has landed without blocking.**  ``unshard(async_op=True)``
   returns a handle whose only method, ``wait()``, blocks (on gloo) and then
   copies the gathered data out.  The dispatcher must not block, so a waiter
   thread waits on the all-gather's ``Work`` itself, and ``handle.wait()`` runs
   on the loop only once that completed (then it is just the copy-out).
2. **Reducing gradients at REDUCE_GRAD, after every microbatch's backward.**
   (The fallback path: by default pipeloom reduce-scatters the accumulated
   unsharded gradients itself, asynchronously, when :func:`plain_reduction`
   says FSDP would do nothing more than average them; it then only needs
   :func:`finish_backward` to reset FSDP's per-step state.)
   FSDP2 reduce-scatters in its post-backward hook.  With the I/W split that
   hook fires during I, before W has produced the weight gradients, and with
   dynamic dispatch the "last backward" of a stage is only known when it has
   run.  So every backward runs with gradient sync off (gradients accumulate
   unsharded) and REDUCE_GRAD runs FSDP's post-backward on every parameter
   group by hand, then the root's final callback, exactly as torch's own
   pipelining runtime does (``_PipelineStageBase.perform_reduce_grad``).

Both are checked at import against the attributes they use, so a torch whose
internals moved fails with a clear message when FSDP is requested, not with an
AttributeError in the middle of a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["check_supported", "all_gather_works", "reduce_grads", "fsdp_modules", "plain_reduction", "finish_backward",
           "fill_missing_grads"]

_MIN_TORCH = (2, 11)


def _torch_version() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def check_supported() -> None:
    """Raise RuntimeError if this torch's FSDP2 lacks what pipeloom uses."""
    if _torch_version() < _MIN_TORCH:
        raise RuntimeError(f"pipeloom's FSDP support needs torch >= {'.'.join(map(str, _MIN_TORCH))}, found {torch.__version__}")
    from torch.distributed.fsdp import FSDPModule, fully_shard

    missing = [
        name
        for name in ("unshard", "reshard", "set_requires_gradient_sync", "set_is_last_backward", "set_reshard_after_backward", "set_reshard_after_forward")
        if not hasattr(FSDPModule, name)
    ]
    if not hasattr(fully_shard, "state"):
        missing.append("fully_shard.state")
    if missing:
        raise RuntimeError(f"torch {torch.__version__}: FSDP2 lacks {', '.join(missing)}, which pipeloom's FSDP support uses")


def param_groups(obj: Any) -> list[Any] | None:
    """The FSDP parameter groups of an ``FSDPState`` or of an ``unshard(async_op=True)`` handle.

    torch 2.13 holds a list, ``_fsdp_param_groups``; torch 2.11 holds one
    group or None, ``_fsdp_param_group`` (2.13 keeps that name on the state as
    a property that fails for more than one group, so the list is asked
    first).  A unit that manages no parameters of its own (a stage root whose
    parameters all belong to wrapped children) has None there: no groups.
    None: neither attribute is there (internals this module does not know).
    """
    if hasattr(obj, "_fsdp_param_groups"):
        groups = obj._fsdp_param_groups
        return [] if groups is None else list(groups)
    if hasattr(obj, "_fsdp_param_group"):
        group = obj._fsdp_param_group
        return [] if group is None else [group]
    return None


def _groups(state: Any) -> list[Any]:
    groups = param_groups(state)
    if groups is None:
        raise AttributeError(f"torch {torch.__version__}: {type(state).__name__} has neither _fsdp_param_groups nor _fsdp_param_group")
    return groups


def fsdp_modules(module: nn.Module) -> list[Any]:
    """Every FSDPModule in ``module`` (itself included), in ``modules()`` order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def all_gather_works(handles: Sequence[Any]) -> list[Any] | None:
    """The ``Work`` objects of the all-gathers behind ``unshard(async_op=True)`` handles.

    An empty list means nothing is in flight (already unsharded, or a
    one-rank group); None means this torch's handle does not expose them, and
    the caller must wait on the handles themselves.
    """
    works: list[Any] = []
    for h in handles:
        if h is None:
            continue
        groups = param_groups(h)
        if groups is None:
            return None
        for pg in groups:
            if not hasattr(pg, "_all_gather_result"):
                return None
            result = pg._all_gather_result
            if result is None:
                continue
            work = getattr(result, "all_gather_work", None)
            if work is not None and hasattr(work, "is_completed"):
                works.append(work)
    return works


def reduce_grads(modules: Sequence[Any]) -> None:
    """Reduce-scatter the gradients accumulated (unsharded) in these FSDP modules, once.

    On GPUs the reduce-scatter runs on FSDP's own stream and this returns
    once it is queued; on CPU (gloo) FSDP2 issues it synchronously.
    """
    from torch.distributed.fsdp import fully_shard

    states = [fully_shard.state(m) for m in modules]  # type: ignore[attr-defined]
    roots = [(m, st) for m, st in zip(modules, states) if getattr(st, "_is_root", None)]
    if not roots:  # never ran a forward: nothing accumulated
        roots = list(zip(modules, states))
    for m, _ in roots:
        m.set_is_last_backward(True)
        m.set_requires_gradient_sync(True)
    try:
        for _, st in roots:
            ctx_states = getattr(getattr(st, "_state_ctx", None), "all_states", None) or [st]
            for s in ctx_states:
                for pg in _groups(s):
                    pg.post_backward()
            st._root_post_backward_final_callback()
    finally:
        for m, _ in roots:
            m.set_requires_gradient_sync(False)
            m.set_is_last_backward(False)


def fill_missing_grads(modules: Sequence[Any]) -> list[tuple[Any, bool, bool]]:
    """Before :func:`reduce_grads`: a zero unsharded gradient for every trainable parameter that has none here.

    FSDP2's post-backward reduce-scatters only the parameters that hold a gradient on *this* rank (and issues
    nothing for a group where none does), so a parameter used on one replica only (a data-dependent branch,
    a block some microbatches skip) made the replicas' reduce-scatters differ in size, or one replica issue
    one the others did not: gloo ended the process from C++ ("Received data size doesn't match"), NCCL
    pairs the next collective with it.  With every trainable parameter holding one, each replica reduces
    the same tensors, and the zeros stand for "no gradient here" in the average (as DDP's zeros do).
    Returns, per trainable parameter in a fixed order (the same on every replica): (its ``FSDPParam``,
    whether it had a gradient on this rank, whether its sharded parameter had a gradient before), so the
    caller can give ``grad = None`` back to those no replica had one for.
    """
    from torch.distributed.fsdp import fully_shard

    out: list[tuple[Any, bool, bool]] = []
    for m in modules:
        for pg in _groups(fully_shard.state(m)):  # type: ignore[attr-defined]
            for fp in pg.fsdp_params:
                if not fp.sharded_param.requires_grad or not hasattr(fp, "_unsharded_param"):
                    continue
                unsharded = fp.unsharded_param
                had = fp.unsharded_accumulated_grad is not None or unsharded.grad is not None
                if not had:
                    unsharded.grad = torch.zeros_like(unsharded)
                out.append((fp, had, fp.sharded_param.grad is not None))
    return out


def plain_reduction(modules: Sequence[Any]) -> bool:
    """True if FSDP's reduction of these units is a plain average of same-dtype gradients.

    That is: no mixed-precision parameter or reduce dtype, no CPU offload,
    every parameter sharded on dim 0 over a 1-D mesh.  Then pipeloom may
    reduce-scatter the unsharded gradients itself (asynchronously) and write
    the sharded gradients, which is what FSDP would produce.  Anything else,
    or internals this function does not recognise, answers False (FSDP's own
    path is used).
    """
    from torch.distributed.fsdp import fully_shard

    try:
        for m in modules:
            st = fully_shard.state(m)  # type: ignore[attr-defined]
            for pg in _groups(st):
                for fp in pg.fsdp_params:
                    if getattr(fp, "param_dtype", None) is not None or getattr(fp, "reduce_dtype", None) is not None:
                        return False
                    if fp.offload_to_cpu:
                        return False
                    if getattr(fp.fsdp_placement, "dim", None) != 0:
                        return False
                    if fp.sharded_param.device_mesh.ndim != 1:
                        return False
    except AttributeError:
        return False
    return True


def finish_backward(modules: Sequence[Any]) -> None:
    """Reset FSDP's per-step backward state (what its final callback does on the last backward), with no collective.

    Gradient sync stays off, so the post-backward it may run for a parameter
    group issues no reduce-scatter.
    """
    from torch.distributed.fsdp import fully_shard

    states = [fully_shard.state(m) for m in modules]  # type: ignore[attr-defined]
    roots = [(m, st) for m, st in zip(modules, states) if getattr(st, "_is_root", None)]
    for m, st in roots:
        m.set_is_last_backward(True)
        try:
            st._root_post_backward_final_callback()
        finally:
            m.set_is_last_backward(False)
