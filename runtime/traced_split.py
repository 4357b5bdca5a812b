"""Stages from torch's tracer, with values that skip stages routed through the ones between.

``torch.distributed.pipelining.pipeline(model, mb_args, split_spec=...)``
traces a model with ``torch.export`` and cuts the graph at the split points;
stage *i* is the traced submodule ``pipe.get_stage_module(i)`` (parameter
names are the model's own: the tracer keeps every submodule's qualified
name).  Two things make that graph awkward for a pipeline runtime:

**Skip edges.**  A value computed on one stage is often used by stages
further on, not only by the next: a Hugging Face decoder computes the
causal mask and the rotary ``cos``/``sin`` once, before its first layer, and
every layer reads them.  Cut into four stages, stages 1..3 each take
``(hidden, cos, sin, mask)`` while stage 0 produced all four and stage 1
hands on only its hidden states.  A runtime that feeds each stage the
previous stage's outputs (torch's own ``PipelineStage``, and pipeloom's
transfers) then fails with ``forward() missing 3 required positional
arguments``.  The alternatives: send such values straight from the producing
stage to every consumer (a new kind of transfer, with its own gradient path
back, in the runtime and in every schedule's lowering), or recompute them
(not possible in general from a traced graph).  Routing keeps the runtime
as it is: :func:`stage_fn_from_pipe` reads the pipe's top-level graph, and
every stage between the producer and a consumer receives the value with its
own inputs and hands it on with its outputs, untouched (as a view, so a
value that needs a gradient gets the consumers' gradients summed on the way
back).  The cost is the extra bytes on the intermediate transfers.  A pipe
without skip edges gets the same transfers as without routing: each stage
hands on exactly the outputs the next one reads.

**Failed captures.**  When ``torch.export`` cannot capture the model, the
tracer raises a generic "cannot capture your model as a full graph" and the
real cause sits in ``__cause__`` (for a Hugging Face model: a
``DynamicCache`` in the output).  :func:`split_by_tracing` calls the tracer
and raises a ``PipelineConfigError`` that says the cause and, where known,
the fix (``use_cache=False``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import PipelineConfigError

__all__ = ["split_by_tracing", "stage_fn_from_pipe"]

# A value in the pipe's top-level graph: ("input", name) for a model input,
# ("stage", j, k) for output k of stage j (k None: the stage's only output).
_Value = tuple[Any, ...]


@dataclass(frozen=True)
class _Const:
    value: Any


@dataclass(frozen=True)
class _Route:
    """How one traced stage is fed and what it hands on.

    ``incoming`` is what the stage receives, in order (stage 0: the model's
    inputs); ``take`` picks the submodule's positional arguments from it
    (an index, or a constant baked into the graph); ``send`` lists what the
    stage hands on: ``("out", k)`` its own output k (None: the whole output),
    ``("in", j)`` incoming value j, carried on for a later stage.
    """

    index: int
    incoming: tuple[_Value, ...]
    take: tuple[int | _Const, ...]
    send: tuple[tuple[str, int | None], ...] | None  # None: the last stage hands on its raw output
    input_names: tuple[str, ...] = ()  # stage 0: the model's input names, for keyword inputs
    used: frozenset[_Value] = frozenset()  # values some stage reads


def _describe(v: _Value) -> str:
    if v[0] == "input":
        return f"model input {v[1]!r}"
    return f"output {v[2]} of stage {v[1]}" if v[2] is not None else f"the output of stage {v[1]}"


class _Router:
    """Forward pre-hook and hook of one routed stage (registered on the traced submodule itself)."""

    def __init__(self, route: _Route) -> None:
        self.route = route
        self._carry: list[list[Any]] = []  # incoming values between pre and post (a stack: calls nest only by error)

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        r = self.route
        incoming = list(args)
        if r.index == 0 and len(incoming) < len(r.incoming):
            for name in r.input_names[len(incoming) :]:
                if name in kwargs:
                    incoming.append(kwargs[name])
                elif ("input", name) in r.used:
                    raise TypeError(f"stage 0 of the traced pipe needs the model input {name!r}; it was not given")
                else:
                    incoming.append(None)  # an input the traced graph never reads (a constant like use_cache)
        if len(incoming) != len(r.incoming):
            want = ", ".join(_describe(v) for v in r.incoming)
            raise TypeError(
                f"traced stage {r.index} expects {len(r.incoming)} inputs ({want}), got {len(incoming)}"
            )
        self._carry.append(incoming)
        picked = tuple(t.value if isinstance(t, _Const) else incoming[t] for t in r.take)
        return picked, {}

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        incoming = self._carry.pop()
        send = self.route.send
        if send is None or send == (("out", None),):
            return output  # the last stage, or a stage handing on just its one output
        out: list[Any] = []
        for kind, k in send:
            if kind == "out":
                out.append(output if k is None else output[k])
            else:
                v = incoming[k]  # type: ignore[index]
                # A view: the carried value leaves the stage through its own autograd node.
                out.append(v.view_as(v) if isinstance(v, torch.Tensor) and v.requires_grad else v)
        return tuple(out)


def _analyse(pipe: Any, num_stages: int) -> tuple[list[_Route], list[str]] | None:
    """Routes for every stage, and a description of each skip edge; None for an object without a graph."""
    gm = getattr(pipe, "split_gm", None)
    graph = getattr(gm, "graph", None)
    if graph is None:
        return None
    nodes = list(graph.nodes)
    stage_nodes = [n for n in nodes if n.op == "call_module"]
    if len(stage_nodes) != num_stages:
        return None
    for i, n in enumerate(stage_nodes):
        if getattr(gm, n.target, None) is not pipe.get_stage_module(i):
            return None
    index = {n: i for i, n in enumerate(stage_nodes)}
    inputs = [n for n in nodes if n.op == "placeholder"]

    def value_of(arg: Any, where: str) -> _Value | _Const:
        if not isinstance(arg, torch.fx.Node):
            return _Const(arg)
        if arg.op == "placeholder":
            return ("input", arg.name)
        if arg in index:
            return ("stage", index[arg], None)
        if arg.op == "call_function" and arg.target is operator.getitem and arg.args[0] in index and isinstance(arg.args[1], int):
            return ("stage", index[arg.args[0]], arg.args[1])
        raise PipelineConfigError(f"{where} takes {arg.format_node()}, which is neither a model input nor a stage output")

    args_of: list[list[_Value | _Const]] = []
    for i, n in enumerate(stage_nodes):
        if n.kwargs:
            raise PipelineConfigError(f"traced stage {i} takes keyword arguments ({', '.join(n.kwargs)}); not supported")
        args_of.append([value_of(a, f"traced stage {i}") for a in n.args])
    output = next(n for n in nodes if n.op == "output")
    for a in _flatten_nodes(output.args):
        v = value_of(a, "the traced model's output")
        if isinstance(v, tuple) and (v[0] != "stage" or v[1] != num_stages - 1):
            raise PipelineConfigError(
                f"the traced model returns {_describe(v)}, not only what its last stage computes; "
                "pipeloom hands the loss only the last stage's output"
            )

    # The last stage that reads each value, and its name there (the stage's argument name).
    last_use: dict[_Value, int] = {}
    label: dict[_Value, str] = {}
    for i, vals in enumerate(args_of):
        sub = pipe.get_stage_module(i)
        arg_names = [n.name for n in sub.graph.nodes if n.op == "placeholder"] if hasattr(sub, "graph") else []
        for p, v in enumerate(vals):
            if isinstance(v, tuple):
                if p < len(arg_names):
                    label.setdefault(v, arg_names[p])
                if v[0] == "stage" and v[1] >= i:
                    raise PipelineConfigError(f"traced stage {i} reads {_describe(v)}, which is not computed before it")
                last_use[v] = max(last_use.get(v, -1), i)

    routes: list[_Route] = []
    skips: list[str] = []
    incoming: list[_Value] = [("input", n.name) for n in inputs]
    names = tuple(n.name for n in inputs)
    used = frozenset(last_use)
    for i in range(num_stages):
        pos = {v: j for j, v in enumerate(incoming)}
        take = tuple(v if isinstance(v, _Const) else pos[v] for v in args_of[i])
        if i == num_stages - 1:
            routes.append(_Route(i, tuple(incoming), take, None, names, used))
            break
        own = sorted({v for v, last in last_use.items() if v[0] == "stage" and v[1] == i and last > i}, key=lambda v: -1 if v[2] is None else v[2])
        carried = [v for v in incoming if last_use.get(v, -1) > i]
        send: list[tuple[str, int | None]] = [("out", v[2]) for v in own] + [("in", pos[v]) for v in carried]
        for v in carried:
            name = f"{label[v]!r} ({_describe(v)})" if v in label else _describe(v)
            skips.append(f"{name} carried through stage {i} (read up to stage {last_use[v]})")
        routes.append(_Route(i, tuple(incoming), take, tuple(send), names, used))
        incoming = own + carried
    return routes, skips


def _flatten_nodes(args: Any) -> list[torch.fx.Node]:
    out: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, lambda n: out.append(n) or n)
    return out


def stage_fn_from_pipe(pipe: Any) -> Callable[[int], nn.Module]:
    """A ``stage_fn`` over a model split by torch's tracer.

    ``pipe`` is what ``torch.distributed.pipelining.pipeline(module,
    mb_args=..., split_spec=...)`` returns; stage *i* is
    ``pipe.get_stage_module(i)``, the traced submodule itself (not a copy:
    torch's ``Pipe`` holds each stage's parameters once), with the model's
    own parameter names.

    Values a stage reads from a stage before the previous one (skip edges)
    are routed through the stages in between: each such stage gets hooks
    that take them in with its inputs and hand them on with its outputs
    (see the module docstring).  ``stage_fn.skip_edges`` describes each
    carried value (empty for a pipe without skip edges).  Stage 0 takes the
    model's inputs positionally or by name; a later stage takes what the
    previous one handed on, and ignores keyword inputs.
    """
    get = getattr(pipe, "get_stage_module", None)
    num_stages = getattr(pipe, "num_stages", None)
    if not callable(get) or not isinstance(num_stages, int):
        raise PipelineConfigError(
            f"stage_fn_from_pipe needs a torch.distributed.pipelining Pipe (with num_stages and "
            f"get_stage_module), got {type(pipe).__name__}"
        )
    _refuse_parameters_the_tracer_copied(pipe)
    analysed = _analyse(pipe, num_stages)
    routes, skips = analysed if analysed is not None else (None, [])

    def stage_fn(index: int) -> nn.Module:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"stage index must be an int, got {type(index).__name__}")
        if not 0 <= index < num_stages:
            raise PipelineConfigError(
                f"stage {index} was asked for, but the traced pipe has {num_stages} stages "
                f"(0..{num_stages - 1}); the schedule's stage count must equal pipe.num_stages"
            )
        module = get(index)
        if not isinstance(module, nn.Module):
            raise PipelineConfigError(f"pipe.get_stage_module({index}) returned {type(module).__name__}, not an nn.Module")
        if routes is not None:
            for handle in getattr(module, "_pipeloom_route_hooks", ()):
                handle.remove()  # built again (a second stage_fn over the same pipe): one set of hooks
            router = _Router(routes[index])
            module._pipeloom_route_hooks = (  # type: ignore[assignment]
                module.register_forward_pre_hook(router.pre, with_kwargs=True),
                module.register_forward_hook(router.post),
            )
        return module

    stage_fn.num_stages = num_stages  # type: ignore[attr-defined]
    stage_fn.skip_edges = tuple(skips)  # type: ignore[attr-defined]
    return stage_fn


_KNOWN_FIXES = (
    (
        ("Cache",),
        "the model returns its KV cache, which torch.export cannot carry: trace it with use_cache=False "
        "(example_kwargs={'use_cache': False}, or model.config.use_cache = False)",
    ),
    (
        ("data-dependent", "GuardOnDataDependent", "Could not guard on data-dependent"),
        "the forward branches on tensor values (an `if` on a tensor, .item(), .tolist()); "
        "make that branch depend on shapes or Python values, or split by module names with split_by_fqn",
    ),
)


def split_by_tracing(
    model: nn.Module,
    *,
    example_args: tuple[Any, ...],
    split_spec: Mapping[str, Any],
    example_kwargs: Mapping[str, Any] | None = None,
) -> Callable[[int], nn.Module]:
    """Trace ``model`` with torch's ``pipeline()`` and return :func:`stage_fn_from_pipe` over it.

    ``example_args``/``example_kwargs`` are one microbatch's inputs;
    ``split_spec`` maps module names to ``SplitPoint.BEGINNING``/``END``
    (torch's format).  A failed capture raises ``PipelineConfigError`` with
    torch's underlying reason (not the generic "cannot capture your model as
    a full graph") and, where it is known, the fix; the original exception
    is chained.
    """
    from torch.distributed.pipelining import pipeline

    # torch's pipeline() patches the forward of every split-point module in place and
    # never undoes it: a second trace of the same model then wraps the wrapper (and
    # recurses without end).  Put each module's own attributes back afterwards.
    saved: list[tuple[nn.Module, dict[str, Any]]] = []
    for name in split_spec:
        try:
            mod = model.get_submodule(name)
        except AttributeError as exc:
            raise PipelineConfigError(f"split_spec names {name!r}, which is not a module of {type(model).__name__}") from exc
        saved.append((mod, {k: mod.__dict__[k] for k in ("forward", "_orig_forward") if k in mod.__dict__}))
    try:
        pipe = pipeline(model, mb_args=tuple(example_args), mb_kwargs=dict(example_kwargs or {}), split_spec=dict(split_spec))
    except Exception as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        text = str(cause).strip()
        first = text.splitlines()[0] if text else ""
        if len(first) > 400:
            first = first[:400] + "..."
        fix = next((f for keys, f in _KNOWN_FIXES if any(k in text or k in type(cause).__name__ for k in keys)), None)
        raise PipelineConfigError(
            f"torch's tracer (pipeline()) failed on {type(model).__name__}: {type(cause).__name__}: {first}"
            + (f"\nFix: {fix}" if fix else "")
        ) from exc
    finally:
        for mod, attrs in saved:
            for k in ("forward", "_orig_forward"):
                mod.__dict__.pop(k, None)
            mod.__dict__.update(attrs)
    _refuse_ties_the_tracer_copied(model, pipe)
    return stage_fn_from_pipe(pipe)


def _stage_param_names(pipe: Any) -> list[set[str]]:
    return [{n for n, p in pipe.get_stage_module(i).named_parameters(remove_duplicate=False) if p.requires_grad}
            for i in range(pipe.num_stages)]


def _refuse_parameters_the_tracer_copied(pipe: Any) -> None:
    """A trainable parameter the traced graph uses in several stages (``x * self.scale`` before and after a
    split point) is copied by torch's tracer into each of them under its own name: the copies would be trained
    apart, each with its own stage's part of the gradient (another model, silently).  Refused, naming it."""
    where: dict[str, list[int]] = {}
    for i, names in enumerate(_stage_param_names(pipe)):
        for n in names:
            where.setdefault(n, []).append(i)
    copied = {n: st for n, st in where.items() if len(st) > 1}
    if copied:
        shown = "; ".join(f"{n} (stages {', '.join(map(str, st))})" for n, st in sorted(copied.items())[:6])
        more = f" and {len(copied) - 6} more" if len(copied) > 6 else ""
        raise PipelineConfigError(
            f"the traced split holds {len(copied)} trainable parameter(s) in more than one stage: {shown}{more}. "
            "torch's tracer gives each stage that uses a parameter its own copy, and the copies would be trained "
            "apart, each with its own stage's part of the gradient (another model, silently). Keep each "
            "parameter's uses within one stage (move the split point), or split with split_by_fqn"
        )


def _refuse_ties_the_tracer_copied(model: nn.Module, pipe: Any) -> None:
    """A trainable weight tied in ``model`` (one tensor under several names: an embedding reused by the head, one
    block at two depths) whose uses the tracer put in different stages: each of those stages holds *its own copy*
    (torch's ``pipeline()`` copies a parameter used by several stages; it keeps one tensor only within a stage),
    and nothing adds the copies' gradients, on one rank or several: each copy would be trained with its own
    stage's part of the gradient, another model than ``model``, silently.  Refused, naming the tie and the
    stages."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            names.setdefault(id(p), []).append(n)
    ties = [ns for ns in names.values() if len(ns) > 1]
    if not ties:
        return
    per_stage = _stage_param_names(pipe)
    for ns in ties:
        where = {i: sorted(set(ns) & have) for i, have in enumerate(per_stage) if set(ns) & have}
        if len(where) > 1:
            shown = "; ".join(f"stage {i}: {', '.join(v)}" for i, v in sorted(where.items()))
            raise PipelineConfigError(
                f"{type(model).__name__}'s weight tied as {', '.join(ns)} is used by {len(where)} stages of the traced "
                f"split ({shown}): torch's tracer gives each stage its own copy, and the copies would be trained "
                "apart, each with its own stage's part of the gradient (another model, silently). Keep the tie's "
                "uses in one stage (move the split point), untie it (clone the weight), or split with split_by_fqn "
                "and a V schedule (ZBVZeroBubble, DualPipeV) that puts the first and last stage on one rank, where "
                "the weight is shared for real"
            )
