"""Inputs and values checked before they do harm.

A pipeline hides mistakes that one process would show at once: a target
with 8 rows against an input of 6 is cut into microbatches that silently
pair the wrong rows; a ``(T, T)`` causal mask passed as a keyword is cut
along dim 0 like a batch; a NaN born in stage 1 surfaces as a NaN loss on
stage 3 of another rank; a float32 stage feeding a float64 stage fails
inside a matmul with no word of which stages disagree.  This module holds
the checks, kept out of the hot path unless asked for:

- :func:`check_batch` (every step, cheap: shapes only) — the batch rule: the
  batch size is dim 0 of the first positional tensor (else of the first
  keyword tensor, else of the target), and every other tensor argument,
  keyword argument and the target must have that many rows.  A tensor meant
  for every microbatch whole is wrapped in :class:`Replicate`; 0-d tensors
  and non-tensors always reach every microbatch whole.
- :func:`install_stage_checks` wraps a stage's forward and backward methods:
  a forward that fails while its inputs' floating dtype differs from its
  parameters' is re-raised naming both stages and dtypes (mixed precision
  and autocast keep working: nothing is checked unless the forward fails);
  with ``check_finite`` every F (outputs, loss), B and I (input gradients,
  parameter gradients for B) and W (parameter gradients) is checked for
  NaN/inf and the first one found raises ``FloatingPointError`` naming the
  stage, microbatch and action.  The finite check costs a reduction per
  tensor and, on GPUs, a device sync per action, so it is off by default.
  With data parallelism a forward that updates a buffer in place (BatchNorm's
  running statistics, an EMA) is refused, naming the stage, microbatch and
  buffer: each replica would update its own copy from its own rows.

Alternatives: checking dtypes up front forbids legitimate mixes (autocast, a
float32 head on a bfloat16 body); a global ``torch.autograd.detect_anomaly``
is 10x slower and names an autograd node, not a stage or microbatch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .errors import PipelineConfigError

__all__ = ["Replicate", "check_batch", "install_stage_checks"]


class Replicate:
    """A value given whole to every microbatch (not cut along dim 0), e.g. a ``(T, T)`` attention mask.

    ``pipe.step(x, target=y, mask=pipeloom.Replicate(causal_mask))``.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        v = self.value
        return f"Replicate({f'tensor of shape {tuple(v.shape)}' if isinstance(v, torch.Tensor) else type(v).__name__})"


def _rows(value: Any) -> int | None:
    return int(value.shape[0]) if isinstance(value, torch.Tensor) and value.dim() > 0 else None


def _in_container(value: Any, rows: int) -> str | None:
    """Where a plain tuple, list or dict holds a tensor with ``rows`` rows (None: it holds none)."""
    if type(value) is dict:
        items: Any = value.items()
    elif type(value) in (tuple, list):
        items = enumerate(value)
    else:
        return None
    for k, t in items:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == rows:
            return f"[{k!r}]"
    return None


def check_batch(args: Sequence[Any], kwargs: Mapping[str, Any], target: Any, *, rank: int, microbatches: int = 2) -> None:
    """Every tensor that will be cut along dim 0 must have the batch's row count (see the module docstring); a
    plain container (tuple, list, dict) holding a tensor of the batch's rows is refused: containers reach every
    microbatch whole, not cut (with one row per microbatch its tensors would broadcast against each microbatch)."""
    rows = [r for v in (*args, *kwargs.values(), target) if (r := _rows(v)) is not None]
    if rows and microbatches > 1:
        named_all = [*((f"positional input {i}", a) for i, a in enumerate(args)),
                     *((f"keyword input {k!r}", v) for k, v in kwargs.items()), ("target", target)]
        for name, v in named_all:
            where = _in_container(v, rows[0])
            if where is not None:
                raise PipelineConfigError(
                    f"rank {rank}: {name} is a {type(v).__name__} whose element {where} has the batch's {rows[0]} rows; "
                    "tuples, lists and dicts reach every microbatch whole (they are not cut along dim 0): pass its "
                    "tensors as separate inputs, cut them yourself with pipeloom.Microbatches, or wrap a container "
                    "meant whole for every microbatch in pipeloom.Replicate"
                )
    if all(r == rows[0] for r in rows):  # (each step: the names are formatted only for the error)
        return
    named = [(f"positional input {i}", a) for i, a in enumerate(args)]
    named += [(f"keyword input {k!r}", v) for k, v in kwargs.items()]
    if target is not None:
        named.append(("target", target))
    cut = [(name, v, _rows(v)) for name, v in named if _rows(v) is not None]
    if len(cut) < 2:
        return
    ref_name, ref, batch = cut[0]
    for name, v, rows in cut[1:]:
        if rows == batch:
            continue
        what = (
            f"rank {rank}: {name} has {rows} rows along dim 0 but the batch has {batch} "
            f"(dim 0 of {ref_name}, shape {tuple(ref.shape)}); microbatches are cut along dim 0, "
            "so every input, keyword tensor and the target must have the batch's rows"
        )
        if name.startswith("keyword"):
            what += f"; to give every microbatch the whole tensor (a mask, a table), pass {name.split()[-1][1:-1]}=pipeloom.Replicate(tensor)"
        elif name.startswith("positional"):
            what += "; to give every microbatch the whole tensor, wrap it: pipeloom.Replicate(tensor)"
        elif name == "target":
            what += " (the target must hold one row per input row)"
        raise PipelineConfigError(what)


# ---------------------------------------------------------------- per-stage checks


def _float_dtype(ts: Sequence[Any]) -> torch.dtype | None:
    for t in ts:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.dtype
    return None


def _all_finite(ts: Sequence[Any]) -> bool:
    """One reduction per tensor and one sync for all: NaN/inf anywhere makes a sum non-finite.

    (A sum may also overflow to inf with finite values, e.g. in float16: the
    caller then looks tensor by tensor, so that only costs time.)
    """
    sums = [t.detach().sum().double() for t in ts
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel()]
    if not sums:
        return True
    total = torch.stack([x.abs() if x.is_complex() else x for x in sums]).sum()
    return bool(torch.isfinite(total))


def _nonfinite(t: Any) -> str | None:
    if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel():
        bad = ~torch.isfinite(t.detach())
        if bool(bad.any()):
            kinds = []
            if bool(torch.isnan(t.detach()).any()):
                kinds.append("nan")
            if bool(torch.isinf(t.detach()).any()):
                kinds.append("inf")
            return f"{int(bad.sum())} of {t.numel()} values are {'/'.join(kinds)}"
    return None


class _StageChecks:
    def __init__(self, executor: Any, *, rank: int, stage_to_rank: Sequence[int], check_finite: bool,
                 replicas: int = 1) -> None:
        self.ex = executor
        self.rank = rank
        self.stage_to_rank = stage_to_rank
        self.check_finite = check_finite
        #: data-parallel replicas (columns) of this stage: a forward may not update a buffer then
        self.replicas = replicas

    def _where(self, action: str, mb: int) -> str:
        return f"stage {self.ex.index}, microbatch {mb}, action {self.ex.index}{action}{mb}"

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.ex.module.parameters() if p.requires_grad]

    def _check_grads(self, action: str, mb: int) -> None:
        if _all_finite([p.grad for p in self.ex.module.parameters() if p.grad is not None]):
            return
        for name, p in self.ex.module.named_parameters():
            if p.grad is not None and (why := _nonfinite(p.grad)):
                raise FloatingPointError(
                    f"non-finite gradient first seen after {self._where(action, mb)}: "
                    f"{name}.grad ({why})"
                )

    def _check(self, what: str, values: Sequence[Any], action: str, mb: int) -> None:
        if _all_finite(values):
            return
        for i, t in enumerate(values):
            if (why := _nonfinite(t)) is not None:
                label = what if len(values) == 1 else f"{what} {i}"
                raise FloatingPointError(f"non-finite {label} first seen in {self._where(action, mb)} ({why})")

    def forward(self, orig: Any, mb: int, inputs: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        ex = self.ex
        if self.check_finite:
            self._check("input" if ex.index == 0 else f"activation received from stage {ex.index - 1}", list(inputs), "F", mb)
        # With data parallelism a buffer updated in forward (BatchNorm's running statistics, an EMA, a
        # counter) is updated by each replica from its own rows only: no single process computes that
        # (the unsplit model updates it once per microbatch of the whole batch, in order), the replicas'
        # copies drift apart, and a checkpoint keeps one of them.  Refused where it first happens; the
        # check reads each buffer's version counter (no tensor is read).
        buffers = [(n, b, b._version) for n, b in ex.module.named_buffers()] if self.replicas > 1 else ()
        try:
            result = orig(mb, inputs, *args, **kwargs)
        except Exception as exc:
            hint = self._dtype_hint(inputs)
            if hint is None:
                raise
            raise TypeError(f"{hint}; the forward failed with {type(exc).__name__}: {exc}") from exc
        for name, b, version in buffers:
            if b._version != version:
                raise PipelineConfigError(
                    f"rank {self.rank}: {self._where('F', mb)} updated the buffer {name!r} in place, with "
                    f"{self.replicas} data-parallel replicas: each replica would update its own copy from its own "
                    "rows, which no single-process run does (the copies drift apart). Keep such state out of "
                    "data-parallel stages (BatchNorm: module.eval() to freeze its statistics), train without "
                    "data parallelism, or take replica 0's values after every step as torch DDP does "
                    "(RuntimeOptions(dp_buffers='replica0'))"
                )
        if self.check_finite:
            outputs, raw, loss = result
            self._check("output", list(outputs) if outputs else ([raw] if isinstance(raw, torch.Tensor) else []), "F", mb)
            if loss is not None:
                self._check("loss", [loss], "F", mb)
        return result

    def _dtype_hint(self, inputs: Sequence[Any]) -> str | None:
        ex = self.ex
        got = _float_dtype(inputs)
        want = _float_dtype(list(ex.module.parameters()))
        if got is None or want is None or got == want:
            return None
        if ex.index == 0:
            src = "the batch"
        else:
            src = f"stage {ex.index - 1} (rank {self.stage_to_rank[ex.index - 1]}) outputs {str(got).replace('torch.', '')}"
            return (
                f"{src} but stage {ex.index} (rank {self.rank}) holds {str(want).replace('torch.', '')} parameters: "
                f"cast one of the two stages (module.to(dtype)) or the output, or run both under autocast"
            )
        return (
            f"{src} is {str(got).replace('torch.', '')} but stage 0 (rank {self.rank}) holds "
            f"{str(want).replace('torch.', '')} parameters: cast the batch or the stage"
        )

    def backward(self, orig: Any, action: str, mb: int, *args: Any, **kwargs: Any) -> Any:
        grads = orig(mb, *args, **kwargs)
        if self.check_finite:
            if grads is not None:
                self._check("input gradient", list(grads), action, mb)
            if action == "B":
                self._check_grads(action, mb)
        return grads

    def backward_weight(self, orig: Any, mb: int, *args: Any, **kwargs: Any) -> Any:
        out = orig(mb, *args, **kwargs)
        if self.check_finite:
            self._check_grads("W", mb)
        return out


def install_stage_checks(executor: Any, *, rank: int, stage_to_rank: Sequence[int], check_finite: bool,
                         replicas: int = 1) -> None:
    """Wrap the executor's forward/backward methods with the checks (on the instance; the class is untouched)."""
    checks = _StageChecks(executor, rank=rank, stage_to_rank=stage_to_rank, check_finite=check_finite,
                          replicas=replicas)
    fwd = executor.forward
    executor.forward = functools.wraps(fwd)(functools.partial(checks.forward, fwd))
    if not check_finite:
        return
    for name, action in (("backward", "B"), ("backward_input", "I")):
        orig = getattr(executor, name, None)
        if orig is not None:
            setattr(executor, name, functools.wraps(orig)(functools.partial(checks.backward, orig, action)))
    w = getattr(executor, "backward_weight", None)
    if w is not None:
        executor.backward_weight = functools.wraps(w)(functools.partial(checks.backward_weight, w))
