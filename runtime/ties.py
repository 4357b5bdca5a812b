"""Weights tied across ranks in a hand-written split: refused at construction.

The problem.  A model whose output head reuses the input embedding's weight
(``head.weight = emb.weight``, as GPT-2 and many Hugging Face models do) and a
``stage_fn`` that hands the embedding to stage 0 and the head to the last stage:
every rank builds the whole model and keeps its own stages, so on the last
stage's rank the head holds *that process's* copy of the tied weight.  Each rank
then trains its copy with its own part of the gradient (the embedding's on one
rank, the head's on the other), and the copies drift apart from the first step:
another model than the one written, silently.  (``split_by_fqn`` refuses such a
split by name; a V schedule that puts both stages on one rank shares the weight
for real and reduces it once.)

The rule used here.  After the local stages are built, every ``nn.Module``
alive in the process that is *not* part of a local stage is looked at: if one
holds, as its own parameter, a parameter of a local stage, and it is a layer of
another kind than the local holder (an ``Embedding`` holding the weight of a
local ``Linear`` head), that parameter is tied to a module this rank does not
run (the other end of the tie, on the rank that holds its stage), and
construction is refused on every rank, naming both.  Holders of the same kind
(a shallow copy of a module) and structural containers (``torch.export``'s
unflattened modules, FX graph modules, plain ``nn.Module`` shells that the
tracing splits build around the same parameters) are not counted: they hold the
parameter without being another use of it.  One pass over the garbage
collector's objects, once per Pipeline.  Stages made by tracing (their layers
are such containers, beside the traced model's own) are checked by their split.

What it cannot see: a tie between two layers of one kind (two ``Linear``), a
tie through a shared *module* (the same ``nn.Embedding`` object placed in two
stages' trees) rather than a shared parameter, and modules no longer alive in
this process (a ``stage_fn`` that builds each stage from a fresh model and drops
the rest).  ``pipeloom.verify_split`` compares the chained stages with the whole
model and finds any of these.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping

from torch import nn

from .errors import PipelineConfigError

__all__ = ["refuse_ties_across_ranks"]


def _structural(cls: type) -> bool:
    """Modules that only hold another's parameters by construction (``torch.export``'s unflattened containers,
    FX graph modules, torch's pipelining split): not a layer that could be the other end of a tie."""
    return cls is nn.Module or cls.__module__.startswith(("torch.fx", "torch.export", "torch.distributed", "torch._"))


def refuse_ties_across_ranks(modules: Mapping[int, nn.Module], rank: int) -> None:
    """Raise :class:`PipelineConfigError` if a parameter of a local stage is also a parameter of a module outside
    this rank's stages (see the module docstring)."""
    local_mods: set[int] = set()
    local_params: dict[int, tuple[int, str, str]] = {}
    for s, root in modules.items():
        for _, m in root.named_modules(remove_duplicate=False):
            local_mods.add(id(m))
        for mname, m in root.named_modules(remove_duplicate=False):
            if _structural(type(m)):  # (a traced stage's containers: the original model's layers hold the same tensors)
                continue
            for pname, p in m.named_parameters(recurse=False):
                local_params.setdefault(id(p), (s, f"{mname}.{pname}" if mname else pname, type(m).__name__))
    if not local_params:
        return
    for obj in gc.get_objects():
        cls = type(obj)  # (not isinstance: a dead weakref proxy among the objects raises on __class__)
        if not issubclass(cls, nn.Module) or id(obj) in local_mods or _structural(cls):
            continue
        for pname, p in obj.named_parameters(recurse=False):
            if id(p) in local_params and local_params[id(p)][2] != cls.__name__:
                s, name, kind = local_params[id(p)]
                raise PipelineConfigError(
                    f"rank {rank}: parameter {name!r} ({kind}) of stage {s} is also the parameter {pname!r} of a "
                    f"{cls.__name__} that no stage of this rank holds: a weight tied across stages on "
                    "different ranks (an input embedding reused by the output head) would be trained as separate "
                    "copies, each with its own rank's part of the gradient; untie it (clone the weight), or keep the "
                    "tied modules in one stage, or on one rank (a V schedule's first and last stage share it)"
                )
