"""Cutting a model into pipeline stages: by module names, or from torch's tracer.

``Pipeline`` wants ``stage_fn(stage_index) -> nn.Module``.  Two ways to get one
from a whole model:

* :func:`split_by_fqn` (torchtitan's way).  Each stage is a copy of the whole
  model with everything it does not own removed; it keeps the model's class,
  so its ``forward`` is the model's own, and its parameter names (state-dict
  keys) are the full model's: ``layers.3.attn.wq.weight`` is called that on
  whichever stage holds it, so checkpoints, optimizer states and gradient
  comparisons line up with the unsplit model without any renaming.
* :func:`stage_fn_from_pipe`, for a model already split by torch's tracer
  (``torch.distributed.pipelining.pipeline``): stage *i* is the traced
  submodule ``pipe.get_stage_module(i)``.

Why name-based splitting and not tracing by default: tracing needs a model
that ``torch.export`` accepts and example inputs of the exact shapes, and its
stage modules are graph modules whose parameter names differ from the model's.
Name-based splitting needs neither, at the price of a contract on the model:

**The model's forward must tolerate missing modules.**  On a stage, a module
that another stage owns is ``None`` (an attribute of an ordinary module) or
absent (an entry of an ``nn.ModuleList``, ``nn.ModuleDict`` or
``nn.Sequential``; a container with no entry on the stage is empty, not
``None``), and the forward must then take the previous stage's output in
place of what that module would have produced, e.g.::

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x   # tokens or hidden states
        for layer in self.layers:                            # only this stage's layers
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h

Iterating a split ``ModuleList``/``ModuleDict`` yields the kept entries in
their original order, and indexing one with an original index or key finds
the entry (a clear ``KeyError`` if another stage owns it).  torchtitan's
models follow this contract.

Other rules, each checked up front with an error naming the stage and the name:

* every name must be a module, parameter or buffer of the model; no name may
  be kept by two stages (nor one inside another stage's module); a parameter
  shared by modules of two stages (tied weights) is refused, because each
  stage would train its own copy;
* every parameter must belong to some stage (``allow_unassigned=True`` drops
  the ones no stage names);
* buffers that sit directly on a module split across stages (a RoPE table on
  the root, say) stay on every stage: they are state, not trained weights.

Models on the meta device.  Build the model under ``torch.device("meta")`` to
split a model that does not fit one process: each stage is materialised with
``to_empty`` on ``device`` and initialised by the model's ``init_weights()``
when it has one (which must also tolerate missing modules), otherwise by
``reset_parameters()`` of every submodule; a stage holding tensors that
neither initialises is refused rather than left holding garbage.  Such a
stage's weights come from its own initialisation, so they are not the ones a
real-device model built from the same seed would have.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .errors import PipelineConfigError

__all__ = ["split_by_fqn", "stage_fn_from_pipe"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class _SplitModuleList(nn.ModuleList):
    """A ModuleList holding some of the original entries under their original indices.

    Iteration yields the kept entries in order; ``[i]`` looks up original index
    ``i``; ``len`` counts the kept entries; ``append`` continues after the
    highest original index, so it never overwrites a kept entry.
    """

    def __getitem__(self, idx: Any) -> Any:  # type: ignore[override]
        if isinstance(idx, slice):
            return super().__getitem__(idx)
        key = str(int(idx))
        if key not in self._modules:
            raise KeyError(
                f"entry {idx} of this ModuleList is not on this pipeline stage "
                f"(this stage holds {', '.join(self._modules) or 'none'})"
            )
        return self._modules[key]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(m for m in self._modules.values() if m is not None)

    def append(self, module: nn.Module) -> _SplitModuleList:
        nxt = max((int(k) for k in self._modules), default=-1) + 1
        self.add_module(str(nxt), module)
        return self


def _check_fqns(stage_fqns: object) -> list[list[str]]:
    if isinstance(stage_fqns, (str, bytes)) or not isinstance(stage_fqns, Sequence):
        raise PipelineConfigError(
            f"stage_fqns must be a list with one list of module names per stage, got {type(stage_fqns).__name__}"
        )
    if not stage_fqns:
        raise PipelineConfigError("stage_fqns is empty: give one list of module names per stage")
    out: list[list[str]] = []
    for s, names in enumerate(stage_fqns):
        if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
            raise PipelineConfigError(
                f"stage {s}: expected a list of module names, got {names!r} "
                "(stage_fqns is a list of lists: [['embed', 'layers.0'], ['layers.1', 'head']])"
            )
        names = list(names)
        if not names:
            raise PipelineConfigError(f"stage {s} keeps no module: every stage needs at least one name")
        for n in names:
            if not isinstance(n, str) or not n or n.startswith(".") or n.endswith(".") or ".." in n:
                raise PipelineConfigError(f"stage {s}: {n!r} is not a fully-qualified module name like 'layers.0'")
        out.append(list(dict.fromkeys(names)))
    return out


def _describe(module: nn.Module) -> str:
    names = list(module._modules)
    if isinstance(module, (nn.ModuleList, nn.Sequential)) and names:
        return f"{type(module).__name__} with entries {names[0]}..{names[-1]}"
    own = [*names, *module._parameters, *module._buffers]
    return f"{type(module).__name__} holding {', '.join(own) if own else 'nothing'}"


def _resolve(model: nn.Module, fqn: str, stage: int) -> None:
    """Raise a clear error unless ``fqn`` names a module, parameter or buffer of ``model``."""
    node: nn.Module = model
    parts = fqn.split(".")
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        child = node._modules.get(part)
        if child is not None:
            node = child
            continue
        if last and (node._parameters.get(part) is not None or node._buffers.get(part) is not None):
            return
        where = ".".join(parts[:depth]) or "the model"
        raise PipelineConfigError(
            f"stage {stage}: {fqn!r} is not a module, parameter or buffer of {type(model).__name__}: "
            f"{where} ({_describe(node)}) has no {part!r}"
        )


def _kept(path: str, keep: frozenset[str]) -> bool:
    """``path`` is listed, or lies inside a listed module."""
    while True:
        if path in keep:
            return True
        cut = path.rfind(".")
        if cut < 0:
            return False
        path = path[:cut]


def _is_prefix(path: str, keep: frozenset[str]) -> bool:
    """Something strictly inside ``path`` is listed (so ``path`` is split, not dropped)."""
    pre = path + "."
    return any(k.startswith(pre) for k in keep)


def _check_ownership(model: nn.Module, stages: list[list[str]], allow_unassigned: bool) -> None:
    """No name in two stages; no parameter (tied or not) in two stages; none in no stage."""
    owner: dict[str, int] = {}
    for s, names in enumerate(stages):
        for n in names:
            for other, t in owner.items():
                if t != s and (n == other or n.startswith(other + ".") or other.startswith(n + ".")):
                    inner, outer = (n, other) if len(n) >= len(other) else (other, n)
                    what = f"{n!r}" if n == other else f"{inner!r} (inside {outer!r})"
                    raise PipelineConfigError(
                        f"{what} is kept by stage {t} and by stage {s}: each module belongs to exactly one stage"
                    )
            owner[n] = s
    keeps = [frozenset(n) for n in stages]
    holders: dict[int, tuple[nn.Parameter, dict[int, str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        entry = holders.setdefault(id(p), (p, {}))
        for s, keep in enumerate(keeps):
            if _kept(name, keep):
                entry[1].setdefault(s, name)
        entry[1].setdefault(-1, name)
    unassigned = []
    for _, (_, by_stage) in holders.items():
        first_name = by_stage.pop(-1)
        if len(by_stage) > 1:
            desc = ", ".join(f"{n!r} on stage {s}" for s, n in sorted(by_stage.items()))
            raise PipelineConfigError(
                f"a parameter is shared by several stages ({desc}): tied weights cannot span stages "
                "(each stage would train its own copy); untie them or keep the tied modules on one stage"
            )
        if not by_stage:
            unassigned.append(first_name)
    if unassigned and not allow_unassigned:
        shown = ", ".join(unassigned[:6]) + ("..." if len(unassigned) > 6 else "")
        raise PipelineConfigError(
            f"no stage holds {len(unassigned)} parameter(s) of {type(model).__name__}: {shown}; "
            "add their modules to a stage, or pass allow_unassigned=True to drop them"
        )


def _prune(module: nn.Module, prefix: str, keep: frozenset[str]) -> None:
    """Remove in place everything under ``module`` that this stage does not keep."""
    container = isinstance(module, _CONTAINERS)
    for name in list(module._modules):
        child = module._modules[name]
        path = prefix + name
        if _kept(path, keep):
            continue
        if child is not None and _is_prefix(path, keep):
            _prune(child, path + ".", keep)
            if type(child) is nn.ModuleList:
                split = _SplitModuleList()
                split._modules.update(child._modules)
                module._modules[name] = split
            continue
        if container:
            del module._modules[name]
        elif isinstance(child, _CONTAINERS):
            # An empty container, not None: ``for layer in self.layers`` just runs no layer.
            module._modules[name] = _SplitModuleList() if isinstance(child, nn.ModuleList) else type(child)()
        else:
            module._modules[name] = None
    for name in list(module._parameters):
        if not _kept(prefix + name, keep):
            module._parameters[name] = None
    # Buffers on a split module stay: they are state every stage may need.


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _materialise(stage: nn.Module, index: int, device: torch.device) -> None:
    """``to_empty`` then initialise: ``init_weights()`` if the model has it, else ``reset_parameters()``."""
    init_weights = getattr(stage, "init_weights", None)
    if not callable(init_weights):
        blind = [
            name or type(stage).__name__
            for name, m in stage.named_modules()
            if not callable(getattr(m, "reset_parameters", None))
            and any(t is not None for t in (*m._parameters.values(), *m._buffers.values()))
        ]
        if blind:
            raise PipelineConfigError(
                f"stage {index} was built on the meta device, but nothing can initialise "
                f"{', '.join(blind[:6])}: these modules hold parameters or buffers and have no "
                f"reset_parameters(), and {type(stage).__name__} has no init_weights()"
            )
    stage.to_empty(device=device)
    with torch.no_grad():
        if callable(init_weights):
            init_weights()
        else:
            for m in stage.modules():
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _FqnStageFn:
    """The ``stage_fn`` that :func:`split_by_fqn` returns; ``num_stages`` tells how many it builds."""

    def __init__(
        self,
        model: nn.Module,
        factory: Callable[[], nn.Module] | None,
        stages: list[list[str]],
        device: torch.device | None,
    ) -> None:
        self._template: nn.Module | None = model
        self._factory = factory
        self._model_type = type(model).__name__
        self.stage_fqns: tuple[tuple[str, ...], ...] = tuple(tuple(n) for n in stages)
        self.num_stages = len(stages)
        self._device = device

    def __call__(self, index: int) -> nn.Module:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"stage index must be an int, got {type(index).__name__}")
        if not 0 <= index < self.num_stages:
            raise PipelineConfigError(
                f"stage {index} was asked for, but split_by_fqn was given module names for "
                f"{self.num_stages} stages (0..{self.num_stages - 1}); the schedule's stage count "
                "must equal len(stage_fqns)"
            )
        if self._factory is None:
            assert self._template is not None
            stage = copy.deepcopy(self._template)
        elif self._template is not None:  # the instance built to check the names: use it once
            stage, self._template = self._template, None
        else:
            stage = self._factory()
            if not isinstance(stage, nn.Module):
                raise PipelineConfigError(f"the model factory returned {type(stage).__name__}, not an nn.Module")
        _prune(stage, "", frozenset(self.stage_fqns[index]))
        if _has_meta(stage):
            _materialise(stage, index, self._device or _default_device())
        return stage

    def __repr__(self) -> str:
        return f"split_by_fqn({self._model_type}, {self.num_stages} stages)"


def split_by_fqn(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    stage_fqns: Sequence[Sequence[str]],
    *,
    device: torch.device | str | None = None,
    allow_unassigned: bool = False,
) -> Callable[[int], nn.Module]:
    """A ``stage_fn`` whose stage *i* keeps only the modules named in ``stage_fqns[i]``.

    Args:
        model_or_factory: the whole model (on any device, the meta device
            included), or a zero-argument function that builds it.  A model is
            deep-copied for every stage, so stages never share parameters and
            the model itself is left untouched.  A factory is called once now
            (to check the names; that instance becomes the first stage built)
            and once for every further stage, so it is never deep-copied; it
            should build the same architecture each time, and seed itself if
            stages built in different processes must start from one model.
        stage_fqns: per stage, the fully-qualified names of what it keeps
            (modules, or parameters/buffers directly on a split module), e.g.
            ``[["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "head"]]``.
        device: where a model on the meta device is materialised (default:
            the current CUDA device if any, else CPU).  Models on a real
            device stay where they are (``Pipeline`` moves stages itself).
        allow_unassigned: drop parameters that no stage names instead of
            raising.

    Returns:
        ``stage_fn(i) -> nn.Module``, with attributes ``num_stages`` and
        ``stage_fqns``.  Asking for a stage beyond ``len(stage_fqns)`` raises.

    Raises:
        PipelineConfigError: an unknown name (naming it and its stage), a name
            kept by two stages, tied parameters across stages, or parameters
            that no stage holds.  Checked here, before any stage is built.

    See the module docstring for the contract the model's forward must keep.
    """
    if isinstance(model_or_factory, nn.Module):
        model, factory = model_or_factory, None
    elif callable(model_or_factory):
        factory = model_or_factory
        model = factory()
        if not isinstance(model, nn.Module):
            raise PipelineConfigError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    else:
        raise PipelineConfigError(
            f"split_by_fqn needs an nn.Module or a function that builds one, got {type(model_or_factory).__name__}"
        )
    stages = _check_fqns(stage_fqns)
    for s, names in enumerate(stages):
        for n in names:
            _resolve(model, n, s)
    _check_ownership(model, stages, allow_unassigned)
    return _FqnStageFn(model, factory, stages, None if device is None else torch.device(device))


def stage_fn_from_pipe(pipe: Any) -> Callable[[int], nn.Module]:
    """A ``stage_fn`` over a model split by torch's tracer.

    ``pipe`` is what ``torch.distributed.pipelining.pipeline(module,
    mb_args=..., split_spec=...)`` returns; stage *i* is
    ``pipe.get_stage_module(i)``, the traced submodule itself (not a copy:
    torch's ``Pipe`` holds each stage's parameters once).  Parameter names are
    those of the traced graph module, not the original model's.
    """
    get = getattr(pipe, "get_stage_module", None)
    num_stages = getattr(pipe, "num_stages", None)
    if not callable(get) or not isinstance(num_stages, int):
        raise PipelineConfigError(
            f"stage_fn_from_pipe needs a torch.distributed.pipelining Pipe (with num_stages and "
            f"get_stage_module), got {type(pipe).__name__}"
        )

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
        return module

    stage_fn.num_stages = num_stages  # type: ignore[attr-defined]
    return stage_fn
