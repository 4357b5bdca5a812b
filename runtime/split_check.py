"""Does a split model still compute the model?  :func:`verify_split`.

:func:`~runtime.split.split_by_fqn` runs the model's own ``forward`` on every
stage, with the modules other stages own replaced by placeholders.  That is
right only if the forward tolerates the modules it does not own; when it does
not, the stages silently compute *another* model: a root forward doing
``h = self.embed(x) * self.scale`` scales again on every stage whose ``embed``
is a pass-through, a soft cap or a weightless norm in the root forward runs on
every stage's output, a position embedding is added on every stage, a
``detach()`` around a module cuts the gradient of every stage before it.
:func:`verify_split` runs the whole model and the chained stages on one batch
and refuses a split whose output, loss or gradients differ.
(``pipeloom.hf.verify_causal_lm_split`` is the same check for Hugging Face
causal LMs, run by ``stage_fn_for_causal_lm`` itself.)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .errors import PipelineConfigError
from .split import _FqnStageFn, reduce_output
from .stage import StageExecutor

__all__ = ["verify_split"]

#: the seed set before the whole model's run and before the chained stages' (dropout draws alike)
_SEED = 0

_CAUSE = (
    "The model's forward likely does something outside the modules a stage owns (a scale, a soft cap, a weightless "
    "norm or a position embedding applied in the forward itself, or a detach() of a module's output), which every "
    "stage then repeats or cuts: split_by_fqn's contract is that the forward tolerates the modules it does not own. "
    "Move that computation into a module one stage owns, write the forward with placeholder=None and "
    "'if self.embed is not None' checks, or split with pipeloom.split_by_tracing."
)


def verify_split(
    model: nn.Module,
    stage_fn: Callable[[int], nn.Module],
    *args: Any,
    target: Any = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    rtol: float = 1e-5,
    train: bool = False,
    num_stages: int | None = None,
    **kwargs: Any,
) -> None:
    """Refuse a ``stage_fn`` whose stages, chained, do not compute ``model``.

    Runs ``model(*args, **kwargs)`` and the stages ``stage_fn(0..n-1)`` the way
    the pipeline runs them (each through the runtime's ``StageExecutor``:
    stage 0 gets ``args``, each later stage the previous stage's output tuple
    positionally, every stage the same ``kwargs``, the last stage computes
    ``loss_fn(output, target)``), and compares:

    * the last stage's output with the model's (field by field for a mapping,
      dataclass or tuple; where the stages hand on one field, that field);
    * with ``loss_fn`` (and ``target``): the loss, then, after a backward on
      both, every parameter's gradient, by name (``split_by_fqn`` and torch's
      tracer keep the model's parameter names on the stages).  A gradient that
      differs, or is missing on the stage that holds the parameter where the
      model's is not zero, or is there where the model has none, is refused;
      so is a parameter no stage holds whose gradient in the model is not zero
      (a module left out with ``allow_unassigned=True`` that the model trains).

    Each element must agree to ``rtol`` of its own size: ``|got - want| <=
    rtol * (|want| + rms)``, ``rms`` = the root mean square of the
    reference tensor (1 where it is all zeros), so one large value does not
    loosen the others and small tensors (gradients of order 1e-5, common in
    large models) are held to their own size, not to 1.  A
    reference that is not finite (NaN, inf) cannot be compared and is
    refused; so is an output with no tensor in it.  Before running, every stage's parameters
    must equal the model's of the same name (a ``stage_fn`` built from another
    model, or from a factory that does not seed itself, is refused as such).

    Random state: the caller's (every CUDA device's too, once CUDA is up) is forked and left as it was; the same seed is
    set before the model's run and before the stages', so dropout draws alike
    when ``train=True`` (which runs both in training mode; the default runs
    both in eval mode).  Nothing of the caller's is modified: the model and
    any stage ``stage_fn`` hands back that it may hold on to are deep copies
    here (a ``split_by_fqn`` stage_fn builds fresh copies anyway), and the
    inputs are cloned for each run.  A ``split_by_fqn`` stage_fn built from a
    factory uses up the instance it built to check the names: later stages
    come from the factory.

    Cost: a copy of the model, one of its stages (together another model),
    gradients and one batch's activations, on the model's device and in its
    dtype; so run it on a small configuration of your model (a few layers,
    narrow, float32 on the CPU) with the split of the same shape.

    Example::

        model = Transformer(small_config)
        stage_fn = pipeloom.split_by_fqn(model, [["embed", "layers.0"], ["layers.1", "norm", "head"]])
        tokens = torch.randint(0, small_config.vocab, (2, 16))
        pipeloom.verify_split(model, stage_fn, tokens)                       # the output
        pipeloom.verify_split(model, stage_fn, tokens, target=labels,
                              loss_fn=loss_fn)                               # and every gradient

    Args:
        model: the whole model (on a real device; the meta device is refused).
        stage_fn: ``stage_fn(i) -> nn.Module``, as given to ``Pipeline``.
        *args, **kwargs: the model's inputs (the keywords reach every stage,
            as in the pipeline; names of this function's own arguments cannot
            be passed through).
        target, loss_fn: the last stage's loss, as in ``Pipeline``; given
            together, they add the loss and gradient comparisons.
        rtol: the tolerance, relative to each value's size (above).
        train: run in training mode (dropout, batch statistics) rather than
            eval mode.
        num_stages: how many stages to chain; default ``stage_fn.num_stages``
            (which ``split_by_fqn``, ``stage_fn_from_pipe`` and
            ``stage_fn_for_causal_lm`` set).

    Raises:
        PipelineConfigError: what differs (the output or one of its fields,
            the loss, or which parameters' gradients, with the largest
            difference and the scale) and the likely cause; a stage whose
            forward or backward raised (the stage named, the error chained);
            bad arguments.  An error of the whole model's own forward is
            raised as it is.
    """
    n = _num_stages(stage_fn, num_stages)
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol >= 0:
        raise PipelineConfigError(f"verify_split: rtol must be a non-negative number, got {rtol!r}")
    if (loss_fn is None) != (target is None):
        raise PipelineConfigError(
            "verify_split: give loss_fn and target together (the last stage computes loss_fn(output, target)); "
            f"got {'loss_fn' if loss_fn is not None else 'target'} alone"
        )
    if not isinstance(model, nn.Module):
        raise PipelineConfigError(f"verify_split needs the whole model as an nn.Module, got {type(model).__name__}")
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise PipelineConfigError(
            f"verify_split: {type(model).__name__} is on the meta device, so it cannot run; build a small "
            "configuration of it on a real device (the CPU will do) and split that the same way"
        )
    field = getattr(stage_fn, "output_field", None)
    devices = sorted({t.device.index or 0 for t in (*model.parameters(), *model.buffers(), *_tensors(args), *_tensors(kwargs))
                      if t.device.type == "cuda"})
    # (every CUDA device's generator is forked once CUDA is up: the seeding below touches only the devices in use,
    # but a stage may draw on another)
    forked = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else devices
    with torch.random.fork_rng(devices=forked):
        want_out, want_loss, want_grads = _run_whole(model, args, kwargs, target, loss_fn, train, field, devices)
        stages, got_out, got_loss = _run_stages(model, stage_fn, n, args, kwargs, target, loss_fn, train, devices)

    if field is not None:
        want_out = reduce_output(want_out, field)  # what the last stage returns (output_field applies to it too)
    elif isinstance(got_out, torch.Tensor) and not isinstance(want_out, (torch.Tensor, tuple, list)):
        want_out = reduce_output(want_out)  # the last stage hands on one field (a hook of the stage_fn's): that one
    _compare_outputs(got_out, want_out, rtol)
    if loss_fn is None:
        return
    assert got_loss is not None and want_loss is not None
    diff, scale, off = _diff(got_loss, want_loss, "loss")
    if not diff <= rtol * scale:
        raise PipelineConfigError(
            f"verify_split: the chained stages' loss {float(got_loss):.6g} differs from the whole model's "
            f"{float(want_loss):.6g} (by {off:.3g}, rtol {rtol:g}) although their outputs agree: "
            "loss_fn gives different results on equal outputs (does it read something else, or draw random numbers?)"
        )
    _compare_grads(stages, want_grads, rtol)


def _num_stages(stage_fn: Any, num_stages: int | None) -> int:
    if not callable(stage_fn):
        raise PipelineConfigError(f"verify_split needs stage_fn(i) -> nn.Module, got {type(stage_fn).__name__}")
    n = num_stages if num_stages is not None else getattr(stage_fn, "num_stages", None)
    if n is None:
        raise PipelineConfigError(
            f"verify_split: {stage_fn!r} has no num_stages attribute; pass num_stages= (the schedule's stage count)"
        )
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PipelineConfigError(f"verify_split: num_stages must be a positive int, got {n!r}")
    return n


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)


def _fresh(value: Any) -> Any:
    """The inputs, their tensors cloned (a forward that modifies its input in place must not change the next run's)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_fresh(v) for v in value)
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


def _seed(devices: list[int]) -> None:
    """The same random state before each run: the CPU generator and the CUDA devices in use (``torch.manual_seed``
    would also seed every other device, whose state the caller's fork does not restore before CUDA is up)."""
    torch.random.default_generator.manual_seed(_SEED)
    for d in devices:
        torch.cuda.default_generators[d].manual_seed(_SEED)


def _prepared(module: nn.Module, train: bool) -> nn.Module:
    module.train(train)
    for p in module.parameters():
        p.grad = None  # (a deep copy carries the original's gradients)
    return module


def _run_whole(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, loss_fn: Any, train: bool, field: str | None,
    devices: list[int],
) -> tuple[Any, torch.Tensor | None, dict[str, torch.Tensor | None]]:
    """(The whole model's output, its loss or None, each parameter name -> its gradient), on a copy."""
    whole = _prepared(copy.deepcopy(model), train)
    args, kwargs = _fresh(args), _fresh(kwargs)
    _seed(devices)
    if loss_fn is None:
        with torch.no_grad():
            return whole(*args, **kwargs), None, {}
    with torch.enable_grad():
        out = whole(*args, **kwargs)
        loss = loss_fn(reduce_output(out, field) if field is not None else out, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}")
        loss.backward()
    out = out.detach() if isinstance(out, torch.Tensor) else out
    return out, loss.detach(), {n: p.grad for n, p in whole.named_parameters(remove_duplicate=False)}


def _stage_error(i: int, n: int, when: str, exc: BaseException) -> PipelineConfigError:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return PipelineConfigError(
        f"verify_split: stage {i} (of {n}) raised {type(exc).__name__} in its {when}, where the whole model runs on "
        f"the same inputs: {first}. A stage runs the model's forward without the modules other stages own; the "
        "forward must tolerate them (split_by_fqn's contract), and take the previous stage's outputs as its inputs"
    )


def _run_stages(
    model: nn.Module, stage_fn: Callable[[int], nn.Module], n: int, args: tuple[Any, ...], kwargs: dict[str, Any],
    target: Any, loss_fn: Any, train: bool, devices: list[int],
) -> tuple[list[nn.Module], Any, torch.Tensor | None]:
    """(The stage modules, the last stage's output, the loss or None), chained as the runtime chains them."""
    fresh = isinstance(stage_fn, _FqnStageFn)  # builds a new copy on every call: nothing of the caller's to protect
    reference = dict(model.named_parameters(remove_duplicate=False))
    modules: list[nn.Module] = []
    executors: list[StageExecutor] = []
    built = [stage_fn(i) for i in range(n)]
    for i, m in enumerate(built):
        if not isinstance(m, nn.Module):
            raise PipelineConfigError(f"verify_split: stage_fn({i}) returned {type(m).__name__}, not an nn.Module")
    if not fresh:  # one copy of them all: a weight two stages share (tied across a V schedule's ends) stays shared
        built = _copy_keeping_hooks(built)
    for i, m in enumerate(built):
        m = _prepared(m, train)
        _check_weights(i, m, reference, type(model).__name__)
        modules.append(m)
        executors.append(StageExecutor(i, m, is_last=i == n - 1, loss_fn=loss_fn, grad_scale=1.0))
    grad = loss_fn is not None
    inputs: tuple[Any, ...] = tuple(_fresh(args))
    kwargs = _fresh(kwargs)
    out: Any = None
    loss = None
    _seed(devices)
    for i, ex in enumerate(executors):
        try:
            outputs, out, loss = ex.forward(0, inputs, kwargs, target if i == n - 1 else None, train=grad)
        except Exception as exc:  # noqa: BLE001 - named with its stage, chained
            raise _stage_error(i, n, "forward", exc) from exc
        # what the runtime hands the next stage: the outputs detached, needing a gradient where they did
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in outputs)
    if grad:
        grads: Any = None
        for i in reversed(range(n)):
            try:
                grads = executors[i].backward(0, grads)
            except Exception as exc:  # noqa: BLE001 - named with its stage, chained
                raise _stage_error(i, n, "backward", exc) from exc
        out = out.detach() if isinstance(out, torch.Tensor) else out
        loss = loss.detach() if loss is not None else None
    return modules, out, loss


#: a module's forward (and backward) hooks: what a stage_fn may have put on its stages
_HOOK_ATTRS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


def _copy_keeping_hooks(modules: list[nn.Module]) -> list[nn.Module]:
    """A deep copy of the stages with their forward hooks.  ``copy.deepcopy`` of a ``torch.fx.GraphModule`` (a
    traced stage, :func:`stage_fn_from_pipe`) builds it anew from its graph and keeps only its state-dict hooks:
    the routing hooks that feed a traced stage its inputs (by name on stage 0, skip edges carried on later ones)
    were lost, and every correct traced split with a keyword input or a skip edge was refused ("forward() missing
    3 required positional arguments"), blamed on split_by_fqn's contract.  Hooks a copy lost are copied over."""
    memo: dict[int, Any] = {}
    copies = copy.deepcopy(modules, memo)
    for orig, new in zip(modules, copies):
        subs = dict(new.named_modules(remove_duplicate=False))
        for name, o in orig.named_modules(remove_duplicate=False):
            c = subs.get(name)
            if c is None:
                continue
            for attr in _HOOK_ATTRS:
                had = o.__dict__.get(attr)
                if had and not c.__dict__.get(attr):
                    setattr(c, attr, copy.deepcopy(had, memo))
    return copies


def _check_weights(i: int, stage: nn.Module, reference: dict[str, nn.Parameter], model_name: str) -> None:
    for name, p in stage.named_parameters():
        want = reference.get(name)
        if want is None:
            raise PipelineConfigError(
                f"verify_split: stage {i} holds a parameter {name!r} that {model_name} has not; gradients are compared "
                "by name, so a stage must keep the model's parameter names (split_by_fqn and torch's tracer do)"
            )
        if p.shape != want.shape or not _same_values(p.detach().to(want.device), want.detach()):
            how = f"shape {tuple(p.shape)} against {tuple(want.shape)}" if p.shape != want.shape else "other values"
            raise PipelineConfigError(
                f"verify_split: stage {i}'s {name!r} is not the model's ({how}): the stages do not hold this model's "
                "weights (a stage_fn built from another model, a factory that does not seed itself, or a model "
                "initialised per stage on the meta device), so they cannot be compared with it"
            )


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _diff(got: torch.Tensor, want: torch.Tensor, what: str = "") -> tuple[float, float, float]:
    """(how far ``got`` is from ``want``, the scale it is measured against), in float64: the largest
    ``|got - want| / (1 + |want| / rms)`` and ``rms`` = the root mean square of ``want`` (1 if that is 0), so that each
    element is held to its own size (one large value does not loosen the others) and small ones to the
    tensor's typical size.  ``got`` within ``rtol`` of ``want`` where ``diff <= rtol * scale``.  Third: the
    largest plain ``|got - want|`` (for messages).  A reference that is not finite cannot be compared: refused
    (``what`` names it)."""
    if want.numel() == 0:
        return 0.0, 1.0, 0.0
    g, w = got.detach().to(device=want.device, dtype=torch.float64), want.detach().to(torch.float64)
    if not bool(torch.isfinite(w).all()):
        raise PipelineConfigError(
            f"verify_split: the whole model's {what or 'result'} holds NaN or infinite values, so the split cannot be "
            "checked against it: run the check on inputs (and a small configuration) where the model is finite"
        )
    # (not floored at 1, as it was: a tensor of gradients of order 1e-4 was then held to 1e-5 absolute, and a
    # split whose gradients were 10 times too small passed; each tensor is held to its own size)
    rms = float(w.pow(2).mean().sqrt())
    rms = rms if rms > 0 else 1.0
    a = (g - w).abs()
    a = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)  # (a NaN where the model is finite: off)
    return float((a / (1.0 + w.abs() / rms)).max()), rms, float(a.max())


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, tensor) of every tensor in an output: tuples, lists, mappings, dataclasses walked."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _leaves(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, (tuple, list)):
        for j, v in enumerate(value):
            yield from _leaves(v, f"{path}[{j}]")


def _compare_outputs(got: Any, want: Any, rtol: float) -> None:
    got_leaves, want_leaves = dict(_leaves(got, "output")), dict(_leaves(want, "output"))
    if not want_leaves:
        raise PipelineConfigError(
            f"verify_split: the whole model returns a {type(want).__name__} with no tensor that verify_split can find "
            "(it walks tensors, tuples, lists, mappings and dataclasses), so nothing could be compared: pass a "
            "loss_fn and target to compare the loss and gradients, or give the model an output of those kinds"
        )
    if got_leaves.keys() != want_leaves.keys():
        raise PipelineConfigError(
            f"verify_split: the last stage returns {_shape_of(got_leaves)} where the whole model returns "
            f"{_shape_of(want_leaves)}. " + _CAUSE
        )
    for path, w in want_leaves.items():
        g = got_leaves[path]
        if g.shape != w.shape:
            raise PipelineConfigError(
                f"verify_split: the chained stages' {path} has shape {tuple(g.shape)} where the whole model's has "
                f"{tuple(w.shape)}. " + _CAUSE
            )
        diff, scale, off = _diff(g, w, path)
        if not diff <= rtol * scale:
            raise PipelineConfigError(
                f"verify_split: the chained stages' {path} differs from the whole model's by up to {off:.3g} "
                f"(its typical size {scale:.3g}; allowed rtol {rtol:g} of each value's size). " + _CAUSE
            )


def _shape_of(leaves: dict[str, Any]) -> str:
    if not leaves:
        return "no tensor"
    shown = ", ".join(f"{p} {tuple(t.shape)}" for p, t in list(leaves.items())[:4])
    return shown + (f" (and {len(leaves) - 4} more)" if len(leaves) > 4 else "")


def _compare_grads(stages: list[nn.Module], want: dict[str, torch.Tensor | None], rtol: float) -> None:
    holders: dict[str, list[int]] = {}
    for i, m in enumerate(stages):
        for name, _ in m.named_parameters():
            holders.setdefault(name, []).append(i)
    bad: list[tuple[float, str]] = []  # (how far off, relative to the allowed difference; what)
    for i, m in enumerate(stages):
        for name, p in m.named_parameters():
            w, g = want.get(name), p.grad
            where = f"{name!r} (stage {i})"
            if len(holders[name]) > 1:
                where += f" (held by stages {', '.join(map(str, holders[name]))}: each copy gets its stage's part)"
            if w is None and g is None:
                continue
            if g is None or w is None:
                present = w if g is None else g
                assert present is not None
                size = float(present.detach().abs().max()) if present.numel() else 0.0
                if size == 0.0:
                    continue  # (no gradient and a zero gradient are the same)
                what = ("got no gradient, where the whole model's is up to " if g is None
                        else "got a gradient of up to ") + f"{size:.3g}" + (" where the whole model's has none" if w is None else "")
                bad.append((float("inf"), f"{where} {what}"))
                continue
            diff, scale, off = _diff(g, w, f"gradient of {name!r}")
            if not diff <= rtol * scale:
                bad.append((diff / (rtol * scale) if rtol * scale > 0 else float("inf"),
                            f"{where} differs by up to {off:.3g} (typical size {scale:.3g})"))
    for name, w in want.items():
        # a parameter no stage holds (dropped with allow_unassigned=True) that the model trains: the stages lose it
        if name not in holders and w is not None and w.numel() and float(w.detach().abs().max()) != 0.0:
            bad.append((float("inf"), f"{name!r} is held by no stage, where the whole model's gradient is up to "
                                      f"{float(w.detach().abs().max()):.3g}"))
    if not bad:
        return
    bad.sort(key=lambda b: -b[0])
    shown = "; ".join(what for _, what in bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
    raise PipelineConfigError(
        f"verify_split: the outputs and the loss agree, but the gradient of {len(bad)} parameter(s) differs between "
        f"the chained stages and the whole model (rtol {rtol:g}): {shown}. " + _CAUSE
    )
