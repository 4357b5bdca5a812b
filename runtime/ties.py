"""Weights tied across ranks in a hand-written split: refused at construction.

The problem.  A model whose output head reuses the input embedding's weight
(``head.weight = emb.weight``, as GPT-2 and many Hugging Face models do) and a
``stage_fn`` that hands the embedding to stage 0 and the head to the last stage:
every rank builds the whole model and keeps its own stages, so on the last
stage's rank the head holds *that process's* copy of the tied weight.  Each rank
then trains its copy with its own part of the gradient (the embedding's on one
rank, the head's on the other), and the copies drift apart from the first step:
another model than the one written, silently.  The same happens to two layers
of one kind sharing a weight, and to one module object placed at two places of
the model (ALBERT or a Universal Transformer reusing a block at several
depths: ``blocks[2] = blocks[0]``; one ``nn.Embedding`` object used as input
embedding and output projection).  (``split_by_fqn`` refuses such a split by
name; a V schedule that puts both stages on one rank shares the weight for real
and reduces it once.)

Two rules, both run once per Pipeline over one pass of the garbage
collector's objects, after the local stages are built.  Only trainable
parameters count: a frozen one gets no gradient, so its copies cannot drift
(one unfrozen later is not seen); buffers are state, not trained, and not
counted either.

1. Local, by kind (each rank names its own end).  Every ``nn.Module`` alive in
   the process that is *not* part of a local stage is looked at: if one holds,
   as its own parameter, a parameter of a local stage, and it is a layer of
   another kind than the local holder (an ``Embedding`` holding the weight of a
   local ``Linear`` head), that parameter is tied to a module this rank does not
   run, and construction is refused.  Holders of the same kind (a shallow copy
   of a module) and structural containers (``torch.export``'s unflattened
   modules, FX graph modules, plain ``nn.Module`` shells that the tracing splits
   build around the same parameters) are not counted: they hold the parameter
   without being another use of it.

2. Across ranks, by name.  The same pass finds the *root models* alive in the
   process: non-structural modules outside the local stages that no other such
   module holds as a child (the model the user built whole, stage wrappers of
   other ranks' stages...).  In each root, a trainable parameter of a local
   stage that the root reaches under several qualified names
   (``named_parameters(remove_duplicate=False)``: a tied weight, or the
   parameters of a module object placed at several places) is a *tie group*,
   keyed by the root's class and the first of those names, a key every rank
   that built the same model computes alike.  Each rank posts which of its
   stages hold which groups (and under which names) with the construction
   agreement's "stages" checkpoint (``runtime/agreement.py``), and every rank
   decides from every rank's records: a group held by stages on more than one
   *pipeline* rank is refused on every rank, naming the tied names, the stages
   and their ranks.  Data-parallel replicas (and expert-parallel peers) of one
   stage are one use, not a tie; stages on one rank (a V schedule's first and
   last) share the weight for real.  A group whose every holder holds all of
   its ends on its own rank (each rank built a small model of its own, tied
   inside its stage) is not one tie spanning the ranks, and is let through.
   Ends of a tie that no stage uses (a tied ``lm_head`` that no stage keeps)
   are not a use: rule 2 refuses nothing for them (rule 1 does, where that
   end is a layer of another kind).  Cost (CPU, medians of 15):
   the pass over the collector's objects, as before, 27 ms with 175k objects
   alive (a process that imported torch and built the model); rule 2 adds
   0.3 ms to it for a 24-block GPT (388 parameters, one rank's half as its
   stage) and 3 ms for 96 blocks (1540 parameters); its record is a few KB
   (16 groups for a 96-block ALBERT).

Stages made by ``split_by_fqn`` (deep copies of the model) hold none of the
alive model's parameters, and are checked by name by their split.  Stages made
by tracing are structural containers (rule 1 passes them over) around tensors
torch's tracer lifted, copies for the most part; a weight tied across traced
stages is split into one copy per stage by the tracer itself, which neither
rule sees: ``split_by_tracing`` refuses such a split itself, from the model's
own tied names (``runtime/traced_split.py``); a pipe traced by the user and
given to ``stage_fn_from_pipe`` is not checked.

What it cannot see: modules no longer alive in this process (a ``stage_fn``
that builds each stage from a fresh model and drops the rest), a tie between
layers of one kind with no alive model holding both (two standalone
``nn.Linear`` sharing a weight, each its own stage), stages built from copies
of the model's parts (``copy.deepcopy(model.head)``: the copy is untied, and
trained as such), stages that each hold the whole model and run a part of
it (every rank holds every end of the tie), and models whose roots differ
between the ranks (the keys do not meet).  ``pipeloom.verify_split`` compares
the chained stages with the whole model and finds any of these.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from .errors import PipelineConfigError

__all__ = ["refuse_ties_across_ranks", "ties_across_ranks"]

#: tie groups one rank posts at most, and names listed per group (the record rides in the construction agreement)
_MAX_GROUPS, _MAX_NAMES = 256, 8


#: modules that only collect parameters (rule 1 does not take one for a layer using them)
_COLLECTIONS = (nn.ParameterList, nn.ParameterDict)


def _structural(cls: type) -> bool:
    """Modules that only hold another's parameters by construction (``torch.export``'s unflattened containers,
    FX graph modules, torch's pipelining split): not a layer that could be the other end of a tie."""
    return cls is nn.Module or cls.__module__.startswith(("torch.fx", "torch.export", "torch.distributed", "torch._"))


def refuse_ties_across_ranks(modules: Mapping[int, nn.Module], rank: int) -> dict[str, Any]:
    """Raise :class:`PipelineConfigError` if a trainable parameter of a local stage is also a parameter of a layer
    of another kind outside this rank's stages; return this rank's record of the tie groups its stages use, for
    :func:`ties_across_ranks` (see the module docstring)."""
    local_mods: set[int] = set()
    local_params: dict[int, tuple[int, str, str]] = {}
    #: per trainable parameter of a local stage: how many times the local stages hold it, and by which stage(s)
    held: dict[int, dict[int, list[str]]] = {}
    for s, root in modules.items():
        for _, m in root.named_modules(remove_duplicate=False):
            local_mods.add(id(m))
        for mname, m in root.named_modules(remove_duplicate=False):
            if _structural(type(m)):  # (a traced stage's containers: the original model's layers hold the same tensors)
                continue
            for pname, p in m.named_parameters(recurse=False):
                if p.requires_grad:  # (a frozen weight gets no gradient: its copies cannot drift apart)
                    local_params.setdefault(id(p), (s, f"{mname}.{pname}" if mname else pname, type(m).__name__))
        for pname, p in root.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                held.setdefault(id(p), {}).setdefault(s, []).append(pname)
    if not held:
        return {}
    candidates: list[nn.Module] = []
    children: set[int] = set()
    for obj in gc.get_objects():
        cls = type(obj)  # (not isinstance: a dead weakref proxy among the objects raises on __class__)
        if not issubclass(cls, nn.Module) or id(obj) in local_mods or _structural(cls):
            continue
        # (a ParameterList/ParameterDict outside the stages is a collection of parameters, not a layer that uses them:
        # one holding the model's parameters, for an optimizer's groups, was taken for the other end of a tie; one
        # that is part of the model, used by its forward, is one more name the root reaches the weight by: rule 2)
        for pname, p in (() if issubclass(cls, _COLLECTIONS) else obj.named_parameters(recurse=False)):
            if id(p) in local_params and local_params[id(p)][2] != cls.__name__:
                s, name, kind = local_params[id(p)]
                raise PipelineConfigError(
                    f"rank {rank}: parameter {name!r} ({kind}) of stage {s} is also the parameter {pname!r} of a "
                    f"{cls.__name__} that no stage of this rank holds: a weight tied across stages on "
                    "different ranks (an input embedding reused by the output head) would be trained as separate "
                    "copies, each with its own rank's part of the gradient; untie it (clone the weight), or keep the "
                    "tied modules in one stage, or on one rank (a V schedule's first and last stage share it)"
                )
        kids = obj.__dict__.get("_modules")
        if kids:  # (a root without children holds a weight tied inside one layer: on one stage whatever the split)
            candidates.append(obj)
            children.update(id(c) for c in kids.values() if c is not None)
    return _tie_groups([m for m in candidates if id(m) not in children], held)


def _tie_groups(roots: Sequence[nn.Module], held: Mapping[int, Mapping[int, list[str]]]) -> dict[str, Any]:
    """The tie groups of the alive root models that the local stages use: per group (keyed by the root's class and
    the first name the root reaches it by, the same on every rank that built the same model), the names the root
    reaches the one tensor by, which local stage holds it under which names, and whether the local stages hold it
    as many times as the root does (``complete``: every end of the tie is on this rank)."""
    out: dict[str, Any] = {}
    for root in roots:
        names: dict[int, list[str]] = {}
        for name, p in root.named_parameters(remove_duplicate=False):
            if id(p) in held:
                names.setdefault(id(p), []).append(name)
        for pid, ns in names.items():
            if len(ns) < 2 or len(out) >= _MAX_GROUPS:
                continue
            stages = held[pid]
            out[f"{type(root).__name__}:{ns[0]}"] = {
                "names": ns[:_MAX_NAMES], "count": len(ns),
                "stages": {str(s): local[:_MAX_NAMES] for s, local in sorted(stages.items())},
                "complete": sum(len(local) for local in stages.values()) >= len(ns),
            }
    return out


def ties_across_ranks(records: Sequence[Mapping[str, Any]], stage_to_rank: Sequence[int]) -> list[str]:
    """From every rank's record (index: global rank; field ``_ties``: what :func:`refuse_ties_across_ranks`
    returned), one sentence per tie group that stages on more than one pipeline rank use (``stage_to_rank``: the
    pipeline rank of each stage; data-parallel replicas of a stage are one use of it).  A group whose every user
    holds all of its ends (``complete``) is the same tie built once per rank, not one tie spanning them."""
    groups: dict[str, dict[str, Any]] = {}
    for r, rec in enumerate(records):
        for key, g in (rec.get("_ties") or {}).items():
            ent = groups.setdefault(key, {"names": g["names"], "count": g["count"], "users": {}, "complete": True})
            ent["complete"] = ent["complete"] and g["complete"]
            for s, local in g["stages"].items():
                ent["users"].setdefault(int(s), ([], local))[0].append(r)
    out = []
    for key, g in groups.items():
        pp = {stage_to_rank[s] for s in g["users"] if 0 <= s < len(stage_to_rank)}
        if len(pp) < 2 or g["complete"]:
            continue
        root = key.split(":", 1)[0]
        more = f" (and {g['count'] - len(g['names'])} more)" if g["count"] > len(g["names"]) else ""
        uses = ", ".join(f"stage {s} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} (as "
                         f"{', '.join(repr(n) for n in local)})"
                         for s, (rs, local) in sorted(g["users"].items()))
        out.append(f"one parameter of the {root} is tied under the names {', '.join(repr(n) for n in g['names'])}{more} "
                   f"and used by {uses}")
    if not out:
        return []
    shown = out[:3] + ([f"{len(out) - 3} more such ties"] if len(out) > 3 else [])
    return ["weights tied across stages on different ranks would be trained as separate copies, each rank's with "
            "its own part of the gradient (every rank built the whole model and kept its stages' parts): "
            + "; ".join(shown) + ". Untie them (clone the weight, or build the shared block once per use), or keep "
            "the tied modules in one stage, or on one rank (a V schedule's first and last stage share a weight for real)"]
