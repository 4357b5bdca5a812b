"""Cutting a model into pipeline stages by module names (torchtitan's way).

``Pipeline`` wants ``stage_fn(stage_index) -> nn.Module``.  :func:`split_by_fqn`
builds one from a whole model: each stage is a copy of the model with
everything it does not own removed.  It keeps the model's class, so its
``forward`` is the model's own, and its parameter names (state-dict keys) are
the full model's: ``layers.3.attn.wq.weight`` is called that on whichever
stage holds it, so checkpoints, optimizer states and gradient comparisons line
up with the unsplit model without any renaming.  (Models split by torch's
tracer are taken by :func:`stage_fn_from_pipe`, in ``traced_split.py``.)

Why name-based splitting and not tracing by default: tracing needs a model
that ``torch.export`` accepts (no KV-cache objects in the output, no
data-dependent control flow) and example inputs of the exact shapes.
Name-based splitting needs neither, at the price of a contract on the model:

**The model's forward must tolerate the modules it does not own.**  On a
stage, a module that another stage owns is replaced by a *placeholder*, and
an entry of an ``nn.ModuleList``, ``nn.ModuleDict`` or ``nn.Sequential`` that
another stage owns is absent (a container with no entry on the stage is
empty).  Two placeholders, chosen by ``placeholder=``:

* ``None`` (torchtitan's contract): the forward tests for it and takes the
  previous stage's output in place of what the module would have produced::

      def forward(self, x):
          h = self.embed(x) if self.embed is not None else x   # tokens or hidden states
          for layer in self.layers:                            # only this stage's layers
              h = layer(h)
          h = self.norm(h) if self.norm is not None else h
          return self.head(h) if self.head is not None else h

* ``"identity"``: a :class:`PassThrough` module that returns its first
  positional argument (or, called with keywords only, its first tensor
  keyword argument), so a forward written for the whole model runs unchanged:
  on a middle stage of a Hugging Face decoder the embedding returns the
  hidden states it is given, the final norm and the LM head hand them on.
  This is what transformers' own ``PipelineIdentityLayer`` and torchtitan's
  Hugging Face backend do.  It needs a forward in which every non-owned
  module maps "the hidden states" to "the hidden states" (true of decoders
  with ``base_model_pp_plan``; not of a model that adds a position embedding
  to the token embedding, like GPT-2).

The default, ``"auto"``, is ``"identity"`` for a ``transformers`` model and
``None`` otherwise (a torchtitan-style ``init_weights()`` reads
``self.embed.weight`` after an ``is not None`` check, which a pass-through
would break).

Iterating a split ``ModuleList``/``ModuleDict`` yields the kept entries in
their original order, and indexing one with an original index or key finds
the entry (a clear ``KeyError`` if another stage owns it).

**Check a split before training on it.**  A forward that breaks this contract
(a scale, a soft cap or a weightless norm in the root forward, repeated on every
stage by pass-throughs; a ``detach()``) trains another model silently:
:func:`pipeloom.verify_split` (``runtime/split_check.py``) runs the whole model
and the chained stages on one batch and refuses a split whose output, loss or
gradients differ (run it on a small configuration of the model).

**Modules without parameters are shared.**  A module holding only buffers
(rotary embeddings, position tables) or nothing at all (an activation) that
no stage names is kept, copied, by *every* stage: it is state or code that
any stage's forward may call, not a weight to train, and dropping it was the
classic failure (``rotary_emb`` set to None on every stage).  Such a module
may also be named by several stages; then only those keep it.  Buffers that
sit directly on a module split across stages (a RoPE table on the root) stay
on every stage too.  A module holding buffers that no stage keeps (dropped
with ``allow_unassigned=True``, or a buffer-only entry of a split container
that no stage names) is dropped with a ``UserWarning`` naming it.

**Outputs are reduced to tensors.**  What crosses a stage boundary must be a
tensor or a tuple of tensors.  A stage whose forward returns a mapping (a
Hugging Face ``ModelOutput`` included) or a dataclass hands on one tensor:
``output_field`` if given, else the first field holding a tensor, in the
mapping's order or the dataclass's field order.  ``ModelOutput`` leaves out
fields that are None, so a causal LM called without ``labels`` hands on its
``logits`` (on a middle stage: the hidden states the pass-through head
returned), a base model its ``last_hidden_state``; this is the rule behind
Hugging Face's own ``outputs[0]``.  Tensors, tuples and lists pass unchanged.
The last stage's output is not sent anywhere: it reaches ``loss_fn`` as the
forward returned it (so a loss can read every field, an auxiliary loss
included), unless ``output_field`` is given, which applies to every stage.

Other rules, each checked up front with an error naming the stage and the name:

* every name must be a module, parameter or buffer of the model; no name
  holding parameters may be kept by two stages (nor one inside another
  stage's module); a parameter shared by modules of two stages (tied
  weights) is refused, because each stage would train its own copy;
* every parameter must belong to some stage (``allow_unassigned=True`` drops
  the ones no stage names).

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
import dataclasses
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from .errors import PipelineConfigError
from .traced_split import stage_fn_from_pipe

__all__ = ["PassThrough", "reduce_output", "split_by_fqn", "stage_fn_from_pipe"]

Placeholder = Literal["auto", "identity"] | None

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class _SplitModuleList(nn.ModuleList):
    """A ModuleList holding some of the original entries under their original indices.

    Iteration yields the kept entries in order; ``[i]`` looks up original index
    ``i``; ``len`` counts the kept entries; ``append`` continues after the
    highest original index, so it never overwrites a kept entry.  (``pipeloom.hf``'s
    aligned split fills the other indices with pass-throughs: then ``len`` is the
    model's depth and iteration runs every index.)
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


class PassThrough(nn.Module):
    """Stands in for a module another stage owns: returns what it is given.

    Called with positional arguments it returns the first; called with
    keywords only, the first tensor among them.  It holds nothing, so a
    stage's state dict has no key for the module it replaces.
    """

    def __init__(self, replaces: str = "", owner: str = "another stage") -> None:
        super().__init__()
        self.replaces = replaces
        self.owner = owner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            return args[0]
        for value in kwargs.values():
            if isinstance(value, torch.Tensor):
                return value
        raise TypeError(
            f"{self.replaces or 'a module'} is not on this pipeline stage ({self.owner} owns it), and its "
            f"pass-through placeholder was called without a tensor to hand on (keywords: {', '.join(kwargs) or 'none'})"
        )

    def extra_repr(self) -> str:
        return f"replaces {self.replaces!r}, owned by {self.owner}" if self.replaces else ""


def reduce_output(value: Any, field: str | None = None) -> Any:
    """The tensor a stage hands on, from what its forward returned.

    Tensors, tuples and lists are returned unchanged.  From a mapping (a
    Hugging Face ``ModelOutput`` included) or a dataclass: ``field`` if
    given, else the first field holding a tensor (mapping order, or the
    dataclass's field order; ``ModelOutput`` omits fields that are None).
    Anything else is returned unchanged (the runtime then names its type).
    """
    if isinstance(value, (torch.Tensor, tuple, list)) and field is None:
        return value
    if isinstance(value, Mapping):
        items = list(value.items())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif field is not None:
        raise TypeError(f"output_field={field!r} was given, but the stage returned a {type(value).__name__}, which has no fields")
    else:
        return value
    if field is not None:
        for name, v in items:
            if name == field:
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"field {field!r} of the stage's {type(value).__name__} is {type(v).__name__}, not a tensor")
                return v
        raise TypeError(
            f"the stage's {type(value).__name__} has no field {field!r} (fields set: {', '.join(n for n, _ in items) or 'none'})"
        )
    for _, v in items:
        if isinstance(v, torch.Tensor):
            return v
    raise TypeError(
        f"the stage returned a {type(value).__name__} with no tensor field "
        f"(fields set: {', '.join(n for n, _ in items) or 'none'}); nothing to hand to the next stage"
    )


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


def _holds_params(model: nn.Module, fqn: str) -> bool:
    """``fqn`` (already resolved) is a parameter, or a module holding one."""
    *path, last = fqn.split(".")
    node = model
    for part in path:
        node = node._modules[part]  # type: ignore[assignment]
    child = node._modules.get(last)
    if child is not None:
        return any(True for _ in child.parameters())
    return node._parameters.get(last) is not None


def _check_ownership(model: nn.Module, stages: list[list[str]], allow_unassigned: bool) -> None:
    """No name in two stages; no parameter (tied or not) in two stages; none in no stage.

    Names holding no parameters (buffer-only or stateless modules, buffers)
    may be kept by several stages: each keeps a copy.
    """
    owner: dict[str, int] = {}
    for s, names in enumerate(stages):
        for n in names:
            if not _holds_params(model, n):
                continue
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


def _holds_no_parameters(module: nn.Module) -> bool:
    """No parameters anywhere inside (buffer-only, like rotary embeddings, or stateless)."""
    return not any(True for _ in module.parameters())


def _fate(child: nn.Module | None, path: str, in_container: bool, keep: frozenset[str], named: frozenset[str]) -> str:
    """What a stage does with ``child`` at ``path``: 'keep', 'split' (keep part of it) or 'drop'.

    ``keep`` is the stage's names, ``named`` every stage's.  A module without
    parameters that no stage names is kept by every stage (shared state), but
    not as a container entry: a container runs its entries in turn, so a
    stage would run it twice.
    """
    if _kept(path, keep):
        return "keep"
    if child is not None and _is_prefix(path, keep):
        return "split"
    if (
        child is not None
        and not in_container
        and not _kept(path, named)
        and not _is_prefix(path, named)
        and _holds_no_parameters(child)
    ):
        return "keep"
    return "drop"


def _prune(module: nn.Module, prefix: str, keep: frozenset[str], named: frozenset[str], placeholder: Placeholder, owners: dict[str, int]) -> None:
    """Remove in place everything under ``module`` that this stage does not keep."""
    container = isinstance(module, _CONTAINERS)
    for name in list(module._modules):
        child = module._modules[name]
        path = prefix + name
        fate = _fate(child, path, container, keep, named)
        if fate == "keep":
            continue
        if fate == "split":
            assert child is not None
            _prune(child, path + ".", keep, named, placeholder, owners)
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
        elif placeholder == "identity" and child is not None:
            owner = owners.get(path)
            module._modules[name] = PassThrough(path, "no stage" if owner is None else f"stage {owner}")
        else:
            module._modules[name] = None
    for name in list(module._parameters):
        if not _kept(prefix + name, keep):
            module._parameters[name] = None
    # Buffers on a split module stay: they are state every stage may need.


def _owners(stages: list[list[str]]) -> dict[str, int]:
    """Each name (and every module above it) -> the stage that owns it, for placeholders' messages."""
    out: dict[str, int] = {}
    for s, names in enumerate(stages):
        for n in names:
            out.setdefault(n, s)
    return out


def _dropped_buffers(model: nn.Module, stages: list[list[str]], named: frozenset[str]) -> list[str]:
    """Modules holding buffers that no stage keeps (each described with its buffers)."""
    kept_somewhere: set[str] = set()
    dropped: dict[str, nn.Module] = {}

    def walk(module: nn.Module, prefix: str, keep: frozenset[str]) -> None:
        container = isinstance(module, _CONTAINERS)
        for name, child in module._modules.items():
            if child is None:
                continue
            path = prefix + name
            fate = _fate(child, path, container, keep, named)
            if fate == "split":
                walk(child, path + ".", keep)
            elif fate == "keep":
                kept_somewhere.add(path)
            elif any(True for _ in child.buffers()):
                dropped[path] = child

    for names in stages:
        walk(model, "", frozenset(names))
    out = []
    for path, module in dropped.items():
        if path in kept_somewhere or any(_kept(path, frozenset([k])) for k in kept_somewhere):
            continue
        bufs = [n for n, _ in module.named_buffers()]
        out.append(f"{path!r} ({type(module).__name__} with buffers {', '.join(bufs[:4])}{'...' if len(bufs) > 4 else ''})")
    return out


def _is_transformers_model(model: nn.Module) -> bool:
    return any(c.__module__.split(".")[0] == "transformers" for c in type(model).__mro__)


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


class _OutputReducer:
    """Forward hook: a stage's mapping/dataclass output becomes the tensor it hands on (a pure function of the
    output: ``RuntimeOptions.cuda_graphs`` captures it with the module)."""

    _pipeloom_graph_safe = True

    def __init__(self, field: str | None, index: int) -> None:
        self.field, self.index = field, index

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        try:
            out = reduce_output(output, self.field)
        except TypeError as exc:
            raise TypeError(f"stage {self.index}: {exc}") from None
        if self.field is None and isinstance(out, torch.Tensor) and out.dim() == 0 and not isinstance(output, torch.Tensor):
            # The first tensor field is a scalar: a loss the forward computed (``labels`` passed to every stage) or
            # a MoE model's ``aux_loss`` (``output_router_logits=True``), listed before ``logits``.  Handed on, the
            # next stage got a 0-d tensor as its hidden states and failed somewhere inside with an IndexError.
            fields = output.items() if isinstance(output, Mapping) else (
                [(f.name, getattr(output, f.name)) for f in dataclasses.fields(output)]
                if dataclasses.is_dataclass(output) else [])
            first = next((n for n, v in fields if v is out), "?")
            other = next((n for n, v in fields if isinstance(v, torch.Tensor) and v.dim() > 0), None)
            if other is not None:
                raise TypeError(
                    f"stage {self.index} returned a {type(output).__name__} whose first tensor field, {first!r}, is a "
                    f"scalar (a loss?), which would be handed to the next stage in place of {other!r}: pass "
                    f"output_field={other!r} to split_by_fqn, or do not make the stages compute it")
        return out


class _FqnStageFn:
    """The ``stage_fn`` that :func:`split_by_fqn` returns; ``num_stages`` tells how many it builds."""

    def __init__(
        self,
        model: nn.Module,
        factory: Callable[[], nn.Module] | None,
        stages: list[list[str]],
        device: torch.device | None,
        placeholder: Placeholder,
        output_field: str | None,
    ) -> None:
        self._template: nn.Module | None = model
        self._factory = factory
        self._model_type = type(model).__name__
        self.stage_fqns: tuple[tuple[str, ...], ...] = tuple(tuple(n) for n in stages)
        self.num_stages = len(stages)
        self._device = device
        #: what stands in for a module another stage owns: None or "identity" (resolved from "auto")
        self.placeholder: Placeholder = placeholder
        self.output_field = output_field
        self._named = frozenset(n for names in stages for n in names)
        self._owners = _owners(stages)

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
        _prune(stage, "", frozenset(self.stage_fqns[index]), self._named, self.placeholder, self._owners)
        if _has_meta(stage):
            _materialise(stage, index, self._device or _default_device())
        if self.output_field is not None or index < self.num_stages - 1:
            stage.register_forward_hook(_OutputReducer(self.output_field, index))
        return stage

    def __repr__(self) -> str:
        return f"split_by_fqn({self._model_type}, {self.num_stages} stages)"


def split_by_fqn(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    stage_fqns: Sequence[Sequence[str]],
    *,
    device: torch.device | str | None = None,
    allow_unassigned: bool = False,
    placeholder: Placeholder = "auto",
    output_field: str | None = None,
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
            Modules without parameters that no stage names are kept by every
            stage (see the module docstring).
        device: where a model on the meta device is materialised (default:
            the current CUDA device if any, else CPU).  Models on a real
            device stay where they are (``Pipeline`` moves stages itself).
        allow_unassigned: drop parameters that no stage names instead of
            raising.
        placeholder: what replaces a module another stage owns: ``None``
            (the forward checks ``is not None``, torchtitan's contract),
            ``"identity"`` (a :class:`PassThrough` returning its first
            argument, so an unmodified forward runs), or ``"auto"``:
            ``"identity"`` for a ``transformers`` model, else ``None``.
            Entries of ModuleList/ModuleDict/Sequential are always removed.
        output_field: the field every stage, the last included, hands on
            when its forward returns a mapping or dataclass (a
            ``ModelOutput``); default: the first field holding a tensor on
            every stage but the last, whose output reaches ``loss_fn`` as is.

    Returns:
        ``stage_fn(i) -> nn.Module``, with attributes ``num_stages``,
        ``stage_fqns`` and ``placeholder`` (as resolved).  Asking for a stage
        beyond ``len(stage_fqns)`` raises.

    Raises:
        PipelineConfigError: an unknown name (naming it and its stage), a name
            kept by two stages, tied parameters across stages, or parameters
            that no stage holds.  Checked here, before any stage is built.

    Warns:
        UserWarning: a module holding buffers that no stage keeps.

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
    if placeholder not in ("auto", "identity", None):
        raise PipelineConfigError(f"placeholder must be 'auto', 'identity' or None, got {placeholder!r}")
    if placeholder == "auto":
        placeholder = "identity" if _is_transformers_model(model) else None
    stages = _check_fqns(stage_fqns)
    for s, names in enumerate(stages):
        for n in names:
            _resolve(model, n, s)
    _check_ownership(model, stages, allow_unassigned)
    lost = _dropped_buffers(model, stages, frozenset(n for names in stages for n in names))
    if lost:
        warnings.warn(
            f"split_by_fqn: no stage keeps {', '.join(lost)}; a stage whose forward uses "
            "them will fail. Name each on the stages that run it (modules without parameters "
            "may be named by several stages).",
            UserWarning,
            stacklevel=2,
        )
    return _FqnStageFn(model, factory, stages, None if device is None else torch.device(device), placeholder, output_field)
