"""Loss scaling for float16 training through a pipeline: ``PipelineGradScaler``.

The problem.  ``torch.amp.GradScaler`` is used as ``scaler.scale(loss).backward()``,
``scaler.step(opt)``, ``scaler.update()``.  In a pipeline neither half fits: the loss
exists only on the last stage's rank, inside the step, where the runtime seeds each
microbatch's backward; and each rank's scaler would look for inf/NaN in its own
stages' gradients only.  An overflow in one stage's gradients would then skip the
optimizer step on that rank alone while the others applied theirs, and the ranks'
scales would drift apart: a model that silently stops being the model.

The rule used here.  ``PipelineGradScaler(pipe)`` is a ``torch.amp.GradScaler``
bound to the Pipeline: the last stage multiplies each microbatch's loss by the
current scale where it seeds the backward (full backward, or I of a split one;
the losses the step reports stay unscaled), and ``unscale_`` (which ``step`` calls
when the caller did not) combines this rank's found-inf flag over every rank of
the job with one all-reduce, bounded in time like ``clip_grad_norm_``'s, so every
rank skips the same steps and keeps the same scale.  The rest is torch's own
(``step``, ``update``, ``state_dict``, ``get_scale``).  FSDP's sharded gradients
are unscaled shard by shard.

Use::

    scaler = pipeloom.PipelineGradScaler(pipe)      # on every rank
    for x, y in data:
        pipe.step(x, target=y, return_outputs=False)
        scaler.unscale_(opt)                        # optional: before clipping
        pipe.clip_grad_norm_(1.0)
        scaler.step(opt)                            # skipped on every rank alike on an overflow
        scaler.update()
        opt.zero_grad()

A rank with no optimizer (its stages are all frozen) runs the same loop with ``opt = None``: ``unscale_(None)`` and
``step(None)`` join the agreement where its peers' calls do, so its scale follows theirs (it seeds the backward if it
holds the last stage).  An optimizer that unscales in its own kernel (``fused=True``; torch's ``step`` then checks it
with ``_check_inf_per_device`` instead of ``unscale_``) is agreed on the same way.

Alternative considered: FSDP1's ``ShardedGradScaler(process_group=...)`` agrees on
the flag too, but issues one all-reduce per device a rank's gradients live on (none
on a rank without gradients: its peers then hang) and unbounded; here every rank
issues exactly one.
"""

from __future__ import annotations

from typing import Any

import torch

from torch.amp.grad_scaler import OptState

from .errors import PipelineConfigError

__all__ = ["PipelineGradScaler"]

#: the key of the state of the first ``step(None)`` / ``unscale_(None)`` of an iteration (a rank without an optimizer
#: its peers step) among torch's per-optimizer states; the k-th's is ``_NO_OPTIMIZER - k``
_NO_OPTIMIZER = -1


class PipelineGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for a :class:`~pipeloom.Pipeline` (see the module docstring).

    ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval`` and ``enabled``
    are torch's.  Build it on every rank, once per Pipeline; it scales the Pipeline's training
    steps from then on (evaluation is never scaled).  With ``enabled=False`` it does nothing, as
    torch's does.  Not with ``RuntimeOptions(check_finite=True)``, which would fail the step on the
    very overflows the scaler exists to skip.
    """

    def __init__(self, pipe: Any, *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        device = torch.device(pipe.device)
        super().__init__(device.type, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self._pipe = pipe
        #: this iteration's unscale_(None) and step(None) calls (each None stands for one optimizer the peers step)
        self._none_calls = [0, 0]
        if not self.is_enabled():
            return
        if getattr(pipe.options, "check_finite", False):
            raise PipelineConfigError(
                f"rank {pipe.rank}: PipelineGradScaler with RuntimeOptions(check_finite=True): the check fails the step on the "
                "overflowed gradients that loss scaling expects and skips; turn one of them off"
            )
        owner = getattr(pipe, "_grad_scaler", None)
        if owner is not None:
            raise PipelineConfigError(f"rank {pipe.rank}: this Pipeline already has a PipelineGradScaler; build one per Pipeline")
        # the scale on this rank's device on every rank (torch makes it at the first scale(), which only the last
        # stage's rank calls): unscale_ and update need it everywhere
        self.scale(torch.zeros((), device=device))
        pipe._grad_scaler = self
        for ex in pipe._executors.values():
            if ex.is_last:
                ex.loss_scaler = self.scale

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """torch's unscale, over local shards of sharded gradients, with one found-inf flag per rank (on the scale's
        device) whatever devices and dtypes the gradients have, so that every rank all-reduces exactly one."""
        by: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    if not allow_fp16 and g.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if hasattr(g, "to_local"):  # a DTensor (FSDP2): its local shard, in place
                        g = g.to_local()
                    if g.is_sparse:
                        if g.dtype is torch.float16:
                            g = g.coalesce()
                        g = g._values()
                    by.setdefault((g.device, g.dtype), []).append(g)
            # (public ops, per tensor: torch's own scaler uses a private fused kernel for the same two things)
            for (dev, _), grads in by.items():
                inv = inv_scale.to(dev)
                bad = torch.zeros((), dtype=torch.bool, device=dev)
                for g in grads:
                    g.mul_(inv)  # (the scale is a power of two: exact in any floating dtype)
                    bad |= ~torch.isfinite(g).all()
                found_inf.add_(bad.to(found_inf.device, found_inf.dtype))
        return {found_inf.device: found_inf}

    def unscale_(self, optimizer: torch.optim.Optimizer | None) -> None:
        """torch's ``unscale_``, then this rank's found-inf flag combined with every other rank's (one
        all-reduce over the job; a dead peer raises ``PeerLostError`` instead of hanging).

        ``None``: a rank with no optimizer (its stages are all frozen) joins the agreement where its peers
        unscale theirs, with a clean flag."""
        if not self.is_enabled():
            return
        self._check_open()
        if optimizer is None:
            k = self._none_calls[0]  # (the k-th None of this iteration stands for the peers' k-th optimizer it lacks)
            if k < self._none_calls[1]:
                raise RuntimeError("unscale_(None) is being called after step(None) in the same iteration.")
            state = self._per_optimizer_states[_NO_OPTIMIZER - k]
            state["found_inf_per_device"] = {self._scale.device: torch.zeros((), dtype=torch.float32, device=self._scale.device)}
            self._none_calls[0] += 1
            self._agree(state)
            state["stage"] = OptState.UNSCALED
            return
        super().unscale_(optimizer)
        self._agree(self._per_optimizer_states[id(optimizer)])

    def step(self, optimizer: torch.optim.Optimizer | None, *args: Any, **kwargs: Any) -> float | None:
        """torch's ``step``.  ``None``: a rank with no optimizer (its stages are all frozen), or without one that its
        peers step (an optimizer of stage 0's embedding alone), steps nothing in its place but joins the found-inf
        agreement the peers' ``step`` runs (unless an ``unscale_(None)`` did), so that the ranks' agreements pair
        and every rank updates the scale alike.  Pass it where the peers pass the optimizer it lacks, once per
        such optimizer."""
        if optimizer is not None or not self.is_enabled():
            return super().step(optimizer, *args, **kwargs) if optimizer is not None else None
        k = self._none_calls[1]
        if k >= self._none_calls[0]:  # (not unscaled by an unscale_(None) of its own)
            self.unscale_(None)
        self._none_calls[1] += 1
        self._per_optimizer_states[_NO_OPTIMIZER - k]["stage"] = OptState.STEPPED
        return None

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """torch's ``update``; a rank that stepped no optimizer (not even ``step(None)``) is told what to call."""
        if self.is_enabled() and new_scale is None and not self._per_optimizer_states:
            raise PipelineConfigError(
                f"rank {self._pipe.rank}: PipelineGradScaler.update() without a step() since the last update(): a rank "
                "with no optimizer (its stages are all frozen) calls scaler.step(None) where its peers step theirs "
                "(and unscale_(None) where they unscale), so that it joins their inf check and updates the scale alike"
            )
        super().update(new_scale)
        self._none_calls = [0, 0]

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        """The found-inf check of an optimizer that unscales in its own kernel (``fused=True``: torch's ``step``
        calls this instead of ``unscale_``), agreed over every rank as ``unscale_``'s is.  Without the agreement
        the rank whose stage overflowed skipped the step and the others took it, silently."""
        self._check_open()
        super()._check_inf_per_device(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        self._agree(state)
        return state["found_inf_per_device"]

    def _check_open(self) -> None:
        """Refuse to work for a closed Pipeline: a Pipeline built after it does not scale its losses by this
        scaler, so this scaler's unscale_ divided its gradients by the scale (2^16 by default), silently."""
        if getattr(self._pipe, "_closed", False):
            raise PipelineConfigError(
                f"rank {self._pipe.rank}: this PipelineGradScaler's Pipeline is closed: build one for the new Pipeline "
                "(new.load_state_dict(old.state_dict()) carries the scale over)"
            )

    def _agree(self, state: dict[str, Any]) -> None:
        """This rank's found-inf flag in an optimizer's ``state``, combined with every other rank's (one all-reduce)."""
        from .training import _collective

        (dev, flag), = state["found_inf_per_device"].items()
        total = flag.to(torch.float64)
        try:
            _collective(self._pipe, total, torch.distributed.ReduceOp.SUM, dst=None, what="the loss scaler's inf check")
        except BaseException:
            # not agreed: a later step(optimizer) must not apply these gradients on the strength of this rank's
            # flag alone (the peers may have found an inf, and after a failed step the gradients are partial):
            # counted as found, so it skips
            state["found_inf_per_device"] = {dev: torch.ones_like(flag)}
            raise
        state["found_inf_per_device"] = {dev: (total > 0).to(flag.dtype)}
