"""Running one stage's module: forward, full backward, and the I/W split.

A stage keeps, per microbatch, what its backward needs: the input leaves
(received or handed-over activations, detached so the graph ends at the stage
boundary) and the outputs (or, on the last stage, the loss).

The zero-bubble split.  I computes the gradients for the stage's inputs so the
previous stage can go on; W must then produce the parameter gradients.  Doing
W as a second backward from the outputs would run most of the graph twice.
Instead I runs one backward for inputs *and* parameters with
``torch.autograd.grad`` (nothing is accumulated yet), stashes the parameter
gradients, and W accumulates them into ``.grad``.  Gradients are exact; the
cost is that I carries all the backward compute, so the split moves *when*
gradients land in ``.grad``, not how the compute is divided.  (A true
weight/input split of the autograd graph is the GPU issue's work.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["StageExecutor", "as_tensor_tuple"]


def as_tensor_tuple(value: Any, *, what: str) -> tuple[torch.Tensor, ...]:
    """A stage's output as a tuple of tensors; anything else is a clear error."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise TypeError(
        f"{what} must be a tensor or a tuple/list of tensors to cross a stage boundary, got {type(value).__name__}"
    )


@dataclass
class _Saved:
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...] = ()
    loss: torch.Tensor | None = None
    param_grads: tuple[torch.Tensor | None, ...] | None = None
    backward_inputs_done: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class StageExecutor:
    """Forward and backward of one stage module, per microbatch."""

    def __init__(
        self,
        index: int,
        module: nn.Module,
        *,
        is_first: bool,
        is_last: bool,
        loss_fn: Callable[..., torch.Tensor] | None,
        grad_scale: float,
    ) -> None:
        self.index = index
        self.module = module
        self.is_first = is_first
        self.is_last = is_last
        self.loss_fn = loss_fn
        self.grad_scale = grad_scale
        self._saved: dict[int, _Saved] = {}
        self._params = [p for p in module.parameters() if p.requires_grad]

    @property
    def live_microbatches(self) -> int:
        """Microbatches whose forward state is still held (activations in memory)."""
        return len(self._saved)

    def reset(self) -> None:
        self._saved.clear()

    def forward(
        self,
        mb: int,
        inputs: Sequence[torch.Tensor],
        kwargs: dict[str, Any],
        target: Any = None,
        *,
        train: bool = True,
    ) -> tuple[tuple[torch.Tensor, ...], Any, torch.Tensor | None]:
        """Run the module; return (outputs for the next stage, raw output, loss or None)."""
        if train:
            out = self.module(*inputs, **kwargs)
        else:
            with torch.no_grad():
                out = self.module(*inputs, **kwargs)
        loss = None
        if self.is_last:
            if self.loss_fn is not None and target is not None:
                loss = self.loss_fn(out, target)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}")
            if train:
                if loss is None:
                    raise ValueError("training needs loss_fn and a target on the last stage")
                self._saved[mb] = _Saved(tuple(inputs), loss=loss)
            return (), out, loss
        outputs = as_tensor_tuple(out, what=f"the output of stage {self.index}")
        if train:
            self._saved[mb] = _Saved(tuple(inputs), outputs=outputs)
        return outputs, out, None

    def _roots(self, saved: _Saved, grad_outputs: Sequence[torch.Tensor | None] | None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if self.is_last:
            assert saved.loss is not None
            return [saved.loss * self.grad_scale], None
        if grad_outputs is None or len(grad_outputs) != len(saved.outputs):
            raise ValueError(
                f"stage {self.index} has {len(saved.outputs)} outputs but received "
                f"{0 if grad_outputs is None else len(grad_outputs)} gradients"
            )
        roots, grads = [], []
        for o, g in zip(saved.outputs, grad_outputs):
            if g is None or not o.requires_grad:
                continue
            if g.shape != o.shape:
                raise ValueError(f"stage {self.index}: gradient of shape {tuple(g.shape)} for an output of shape {tuple(o.shape)}")
            roots.append(o)
            grads.append(g)
        return roots, grads

    def _input_grads(self, saved: _Saved) -> list[torch.Tensor | None]:
        return [t.grad if t.requires_grad else None for t in saved.inputs]

    def backward(self, mb: int, grad_outputs: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        """Full backward (B): accumulate parameter gradients, return the input gradients."""
        saved = self._saved.pop(mb)
        roots, grads = self._roots(saved, grad_outputs)
        if roots:
            torch.autograd.backward(roots, grads)
        return self._input_grads(saved)

    def backward_input(self, mb: int, grad_outputs: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        """I: input gradients now, parameter gradients stashed for W."""
        saved = self._saved[mb]
        roots, grads = self._roots(saved, grad_outputs)
        want_inputs = [t for t in saved.inputs if t.requires_grad]
        targets = want_inputs + self._params
        if roots and targets:
            got = torch.autograd.grad(roots, targets, grads, allow_unused=True)
        else:
            got = (None,) * len(targets)
        it = iter(got[: len(want_inputs)])
        input_grads = [next(it) if t.requires_grad else None for t in saved.inputs]
        saved.param_grads = tuple(got[len(want_inputs) :])
        saved.backward_inputs_done = True
        # Activations for the graph are released by autograd.grad; only the
        # stashed parameter gradients stay until W.
        saved.outputs, saved.loss = (), None
        return input_grads

    def backward_weight(self, mb: int) -> None:
        """W: accumulate the parameter gradients that I computed."""
        saved = self._saved.pop(mb)
        if saved.param_grads is None:
            raise RuntimeError(f"stage {self.index}: W for microbatch {mb} before its I")
        for p, g in zip(self._params, saved.param_grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
