"""Running one stage's module: forward, full backward, and the I/W split.

A stage keeps, per microbatch, what its backward needs: the input leaves
(received or handed-over activations, detached so the graph ends at the stage
boundary) and the outputs (or, on the last stage, the loss).

The zero-bubble split.  I computes the gradients for the stage's inputs so the
previous stage can go on; W computes the parameter gradients later, filling a
bubble.  W must not redo I's work: a second backward from the stage outputs
would run the whole activation-gradient chain again.  So during the forward of
a split stage, a hook captures the output of every module that owns
parameters directly (each Linear, LayerNorm, Embedding...).  I asks autograd
for the gradients of the stage inputs *and* of those captured outputs (one
pass, graph retained); W then runs, per module, a backward from its captured
output and gradient to its own parameters only, which is just the local
weight-gradient work (``x^T g`` for a Linear).  Parameters used outside any
module that owns them (a bare ``nn.Parameter`` used in a parent's forward)
fall back to a backward from the stage outputs restricted to them.  Gradients
are exactly those of a full backward, up to summation order.
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
    #: (module, its output) for every parameter-owning module, when the stage splits I/W
    captured: list[tuple[nn.Module, torch.Tensor]] = field(default_factory=list)
    #: what W still has to do: (root tensors, their gradients, parameters) per backward call
    weight_work: list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] | None = None


class StageExecutor:
    """Forward and backward of one stage module, per microbatch."""

    def __init__(
        self,
        index: int,
        module: nn.Module,
        *,
        is_last: bool,
        loss_fn: Callable[..., torch.Tensor] | None,
        grad_scale: float,
        split_backward: bool = False,
        dynamic_params: bool = False,
    ) -> None:
        self.index = index
        #: parameters are swapped while running (FSDP registers unsharded ones), so the
        #: I/W split looks them up at each I instead of keeping those seen at construction
        self.dynamic_params = dynamic_params
        self.module = module
        self.is_last = is_last
        self.loss_fn = loss_fn
        self.grad_scale = grad_scale
        self._saved: dict[int, _Saved] = {}
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._capture: list[tuple[nn.Module, torch.Tensor]] | None = None
        self._owned: dict[nn.Module, list[torch.Tensor]] = {}
        if split_backward:
            for m in module.modules():
                own: list[torch.Tensor] = [p for p in m.parameters(recurse=False) if p.requires_grad]
                if own:
                    self._owned[m] = own
                    m.register_forward_hook(self._capture_hook)

    def _capture_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._capture is not None:
            self._capture.append((module, output))

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
            self._capture = [] if self._owned else None
            try:
                out = self.module(*inputs, **kwargs)
            finally:
                captured, self._capture = self._capture or [], None
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
                self._saved[mb] = _Saved(tuple(inputs), loss=loss, captured=captured)
            return (), out, loss
        outputs = as_tensor_tuple(out, what=f"the output of stage {self.index}")
        if train:
            self._saved[mb] = _Saved(tuple(inputs), outputs=outputs, captured=captured)
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
        """I: input gradients now; the parameter-gradient work is prepared for W."""
        saved = self._saved[mb]
        roots, grads = self._roots(saved, grad_outputs)
        want_inputs = [t for t in saved.inputs if t.requires_grad]
        # Captured module outputs that carry a gradient path to their own parameters.
        captured = [(m, o) for m, o in saved.captured if isinstance(o, torch.Tensor) and o.requires_grad]
        owned = self._owned
        params = self._params
        if self.dynamic_params:
            owned = {m: [p for p in m.parameters(recurse=False) if p.requires_grad] for m in owned}
            params = [p for p in self.module.parameters() if p.requires_grad]
        covered = {id(p) for m, _ in captured for p in owned[m]}
        fallback: list[torch.Tensor] = [p for p in params if id(p) not in covered]
        targets = want_inputs + [o for _, o in captured]
        got: Sequence[torch.Tensor | None]
        if roots and targets:
            got = torch.autograd.grad(roots, targets, grads, retain_graph=True, allow_unused=True)
        else:
            got = (None,) * len(targets)
        it = iter(got[: len(want_inputs)])
        input_grads = [next(it) if t.requires_grad else None for t in saved.inputs]
        work: list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = []  # (roots, grads, params)
        for (m, o), g in zip(captured, got[len(want_inputs) :]):
            if g is not None:
                work.append(([o], [g], owned[m]))
        if fallback and roots:
            work.append((roots, grads if grads is not None else [torch.ones_like(r) for r in roots], fallback))
        saved.weight_work = work
        saved.captured = []
        return input_grads

    def backward_weight(self, mb: int) -> None:
        """W: the parameter gradients, from what I captured (local weight-gradient work only)."""
        saved = self._saved.pop(mb)
        if saved.weight_work is None:
            raise RuntimeError(f"stage {self.index}: W for microbatch {mb} before its I")
        last = len(saved.weight_work) - 1
        for i, (roots, grads, params) in enumerate(saved.weight_work):
            torch.autograd.backward(roots, grads, retain_graph=i < last, inputs=params)
