"""Weights tied across ranks in a hand-written split: found at construction, then kept in sync (or refused).

``RuntimeOptions.tied_weights="sync"`` (the default): a tie group rule 2 below finds spanning pipeline ranks is
not refused but trained as one weight, as Megatron and DeepSpeed (``TiedLayerSpec``) do: :func:`tie_sync_groups`
lists them (in key order, from every rank's records, alike on every rank) and :class:`TiedCopies` makes a process
group per set of holding pipeline ranks and replica column, broadcasts each copy from the lowest holding rank at
construction, and after every training step sums the step's gradient of each copy over its group (the gradient held
before the step taken aside and added back).  Rule 1's findings are then refused only where no other pipeline
rank's stage holds the group (the other end is on no stage: nothing to keep equal); one no group covers (no alive
model holds both ends) is refused as before.  With ``fsdp=True`` or expert parallelism a tie spanning ranks is
refused.  ``"refuse"``: everything below, as written (the behaviour before the sync existed).

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

from .errors import PipelineConfigError, PipelineError

__all__ = ["TiedCopies", "refuse_ties_across_ranks", "ties_across_ranks", "tie_sync_groups"]

#: tie groups one rank posts at most, and names listed per group (the record rides in the construction agreement);
#: a rank whose stages use more groups is refused (those past the limit were left out: neither synchronised nor
#: refused, their copies trained apart; 256 was reached by one shared block of 130 layers)
_MAX_GROUPS, _MAX_NAMES = 4096, 8


#: modules that only collect parameters (rule 1 does not take one for a layer using them)
_COLLECTIONS = (nn.ParameterList, nn.ParameterDict)


def _structural(cls: type) -> bool:
    """Modules that only hold another's parameters by construction (``torch.export``'s unflattened containers,
    FX graph modules, torch's pipelining split): not a layer that could be the other end of a tie."""
    return cls is nn.Module or cls.__module__.startswith(("torch.fx", "torch.export", "torch.distributed", "torch._"))


def refuse_ties_across_ranks(modules: Mapping[int, nn.Module], rank: int, *, sync: bool = False) -> dict[str, Any]:
    """Raise :class:`PipelineConfigError` if a trainable parameter of a local stage is also a parameter of a layer
    of another kind outside this rank's stages; return this rank's record of the tie groups its stages use, for
    :func:`ties_across_ranks` (see the module docstring).

    ``sync`` (``RuntimeOptions.tied_weights="sync"``): a layer of another kind found by rule 1 that is part of a
    root model whose tie group (rule 2) holds the parameter is not refused here: the finding rides in that group's
    record (``"other"``), and :func:`ties_across_ranks` refuses it only where no stage of another pipeline rank
    holds the group (no copy to keep equal to that end).  A finding that no group covers is refused here."""
    local_mods: set[int] = set()
    local_params: dict[int, tuple[int, str, str]] = {}
    #: per trainable parameter of a local stage: how many times the local stages hold it, and by which stage(s)
    held: dict[int, dict[int, list[str]]] = {}
    #: (sync) the frozen parameters of the local stages, in ``held`` too: a frozen tie's copies are made equal at
    #: construction, and one unfrozen later is refused at the step (TiedCopies.take), not trained apart
    frozen: set[int] = set()
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
            if p.requires_grad or sync:
                held.setdefault(id(p), {}).setdefault(s, []).append(pname)
                if not p.requires_grad:
                    frozen.add(id(p))
    if not held:
        return {}
    candidates: list[nn.Module] = []
    children: set[int] = set()
    #: (sync) rule 1's findings, per parameter: (the layer of another kind, what it is), decided after rule 2
    found: dict[int, list[tuple[nn.Module, dict[str, Any]]]] = {}
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
                if sync:
                    found.setdefault(id(p), []).append(
                        (obj, {"rank": rank, "stage": s, "name": name, "kind": kind, "other": pname, "other_kind": cls.__name__}))
                    continue
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
    out = _tie_groups([m for m in candidates if id(m) not in children], held, found, frozen, rank)
    if found:  # (sync) a layer of another kind holding a stage's weight outside every tie group rule 2 saw
        f = next(iter(found.values()))[0][1]
        raise PipelineConfigError(
            f"rank {rank}: parameter {f['name']!r} ({f['kind']}) of stage {f['stage']} is also the parameter "
            f"{f['other']!r} of a {f['other_kind']} that no stage of this rank holds, and no model alive in this "
            "process holds both (a tie the Pipeline cannot find on the other ranks, to keep the copies equal): it "
            "would be trained as separate copies, each with its own rank's part of the gradient; untie it (clone the "
            "weight), or keep the tied modules in one stage, or build the stages from one model kept alive while "
            "the Pipeline is built (runtime/ties.py)"
        )
    return out


def _tie_groups(roots: Sequence[nn.Module], held: Mapping[int, Mapping[int, list[str]]],
                found: dict[int, list[tuple[nn.Module, dict[str, Any]]]] | None = None,
                frozen: set[int] = frozenset(), rank: int | None = None) -> dict[str, Any]:
    """The tie groups of the alive root models that the local stages use: per group (keyed by the root's class and
    the first name the root reaches it by, the same on every rank that built the same model), the names the root
    reaches the one tensor by, which local stage holds it under which names, and whether the local stages hold it
    as many times as the root does (``complete``: every end of the tie is on this rank)."""
    out: dict[str, Any] = {}
    where = "" if rank is None else f"rank {rank}: "
    #: the parameter each key names here: two roots of one class tying other parameters under one first name (two
    #: models built apart) give one key to two ties, which the ranks (finding the roots in their own order) cannot
    #: pair: the key is marked ``ambiguous`` (and refused where it spans ranks), its ``complete`` both ties'
    owner: dict[str, int] = {}
    for root in roots:
        names: dict[int, list[str]] = {}
        for name, p in root.named_parameters(remove_duplicate=False):
            if id(p) in held:
                names.setdefault(id(p), []).append(name)
        inside: set[int] | None = None
        for pid, ns in names.items():
            if len(ns) < 2:
                continue
            if len(out) >= _MAX_GROUPS:
                raise PipelineConfigError(
                    f"{where}the stages use more than {_MAX_GROUPS} tied parameters (tie groups: the first "
                    f"{type(root).__name__}:{ns[0]!r} past the limit), more than the Pipeline records to find the "
                    "ties across ranks: the ones left out would be trained as separate copies; tie whole tensors "
                    "instead of many small ones (fewer, larger parameters), or untie them")
            stages = held[pid]
            key = f"{type(root).__name__}:{ns[0]}"
            complete = sum(len(local) for local in stages.values()) >= len(ns)
            if owner.setdefault(key, pid) != pid:
                group = out[key]
                group["ambiguous"], group["complete"] = True, group["complete"] and complete
            else:
                group = out[key] = {
                    "names": ns[:_MAX_NAMES], "count": len(ns),
                    "stages": {str(s): local[:_MAX_NAMES] for s, local in sorted(stages.items())},
                    "complete": complete,
                }
                if pid in frozen:  # (sync: a frozen tie, made equal at construction, not summed per step)
                    group["frozen"] = True
            if found and pid in found:  # rule 1's findings of layers of this root: decided with every rank's records
                if inside is None:
                    inside = {id(m) for m in root.modules()}
                mine = [f for m, f in found[pid] if id(m) in inside]
                if mine:
                    group.setdefault("other", mine[0])
                    rest = [(m, f) for m, f in found[pid] if id(m) not in inside]
                    if rest:
                        found[pid] = rest
                    else:
                        del found[pid]
    return out


def _merged(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rank's tie groups merged by key: names, count, users (stage -> (ranks, local names)), complete, and
    rule 1's findings (``others``, by rank)."""
    groups: dict[str, dict[str, Any]] = {}
    for r, rec in enumerate(records):
        for key, g in (rec.get("_ties") or {}).items():
            ent = groups.setdefault(key, {"names": g["names"], "count": g["count"], "users": {}, "complete": True,
                                          "others": []})
            ent["complete"] = ent["complete"] and g["complete"]
            ent["ambiguous"] = ent.get("ambiguous", False) or g.get("ambiguous", False)
            ent["trainable"] = ent.get("trainable", False) or not g.get("frozen", False)
            if g.get("other"):
                ent["others"].append(g["other"])
            for s, local in g["stages"].items():
                ent["users"].setdefault(int(s), ([], local))[0].append(r)
    return groups


def _pipeline_ranks(g: Mapping[str, Any], stage_to_rank: Sequence[int]) -> set[int]:
    return {stage_to_rank[s] for s in g["users"] if 0 <= s < len(stage_to_rank)}


def _spans(g: Mapping[str, Any], stage_to_rank: Sequence[int]) -> bool:
    """One tie whose copies are on more than one pipeline rank (not the same tie built whole on every rank)."""
    return len(_pipeline_ranks(g, stage_to_rank)) >= 2 and not g["complete"]


def _describe(key: str, g: Mapping[str, Any]) -> str:
    root = key.split(":", 1)[0]
    more = f" (and {g['count'] - len(g['names'])} more)" if g["count"] > len(g["names"]) else ""
    uses = ", ".join(f"stage {s} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} (as "
                     f"{', '.join(repr(n) for n in local)})"
                     for s, (rs, local) in sorted(g["users"].items()))
    return (f"one parameter of the {root} is tied under the names {', '.join(repr(n) for n in g['names'])}{more} "
            f"and used by {uses}")


def _shown(out: list[str]) -> str:
    return "; ".join(out[:3] + ([f"{len(out) - 3} more such ties"] if len(out) > 3 else []))


def ties_across_ranks(records: Sequence[Mapping[str, Any]], stage_to_rank: Sequence[int], *, sync: bool = False,
                      fsdp: bool = False, expert_parallel: bool = False) -> list[str]:
    """From every rank's record (index: global rank; field ``_ties``: what :func:`refuse_ties_across_ranks`
    returned), one sentence per tie group that stages on more than one pipeline rank use (``stage_to_rank``: the
    pipeline rank of each stage; data-parallel replicas of a stage are one use of it).  A group whose every user
    holds all of its ends (``complete``) is the same tie built once per rank, not one tie spanning them.

    ``sync`` (``RuntimeOptions.tied_weights="sync"``): such groups are synchronised (:func:`tie_sync_groups`), not
    refused, unless ``fsdp`` or ``expert_parallel`` (not supported with a tie spanning ranks); refused instead are
    the groups rule 1 found a layer of another kind for (on some rank) that no other pipeline rank's stage holds:
    the other end is on no stage, and nothing can keep the copies equal."""
    groups = _merged(records)
    ambiguous = [k for k, g in sorted(groups.items()) if g["ambiguous"] and _spans(g, stage_to_rank)]
    if ambiguous:
        root, _, name = ambiguous[0].partition(":")
        return [f"two models of class {root} alive in this process (no module holding both) tie other parameters "
                f"under the same name {name!r}, and the stages of more than one pipeline rank use them: the Pipeline "
                "cannot tell their ties apart across ranks, to keep each one's copies equal (one would be trained as "
                "separate copies); build the models under one parent module (an nn.ModuleDict) kept alive while the "
                "Pipeline is built, or untie them" + (f" ({len(ambiguous) - 1} more such names)" if len(ambiguous) > 1 else "")]
    if sync:
        spanning = [_describe(k, g) for k, g in sorted(groups.items()) if _spans(g, stage_to_rank) and g["trainable"]]
        if spanning and (fsdp or expert_parallel):
            what = "fsdp=True" if fsdp else "expert parallelism"
            return [f"weights tied across stages on different ranks are kept equal by summing their gradients over "
                    f"the holding ranks, which is not implemented with {what}: " + _shown(spanning) + ". Untie them "
                    "(clone the weight), or keep the tied modules in one stage or on one rank (a V schedule's first "
                    f"and last stage share a weight for real), or train without {what}"]
        out = []
        for key, g in sorted(groups.items()):
            if _spans(g, stage_to_rank) or not g["others"]:
                continue
            f = g["others"][0]
            out.append(f"on rank {f['rank']}, parameter {f['name']!r} ({f['kind']}) of stage {f['stage']} is also the "
                       f"parameter {f['other']!r} of a {f['other_kind']} that no stage of any rank holds ({_describe(key, g)})")
        if not out:
            return []
        return ["a weight tied to a module that no stage runs cannot be trained as one weight (the copies of that "
                "module and of the stage would be trained apart): " + _shown(out) + ". Untie it (clone the weight), "
                "or give the tied module to a stage"]
    out = [_describe(k, g) for k, g in groups.items() if _spans(g, stage_to_rank)]
    if not out:
        return []
    return ["weights tied across stages on different ranks would be trained as separate copies, each rank's with "
            "its own part of the gradient (every rank built the whole model and kept its stages' parts): "
            + _shown(out) + ". Untie them (clone the weight, or build the shared block once per use), or keep "
            "the tied modules in one stage, or on one rank (a V schedule's first and last stage share a weight for real)"]


def tie_sync_groups(records: Sequence[Mapping[str, Any]], stage_to_rank: Sequence[int], *,
                    frozen: bool = True) -> list[tuple[str, tuple[int, ...], bool]]:
    """The tie groups that span pipeline ranks (``RuntimeOptions.tied_weights="sync"``), sorted by key (every rank
    makes their process groups in this order): ``(key, the pipeline ranks holding a copy, ascending, trainable)``.
    ``trainable``: some rank's copy required a gradient at construction (the same answer on every rank); a frozen
    group's copies are made equal at construction and not summed per step (``frozen=False``: left out)."""
    return [(k, tuple(sorted(_pipeline_ranks(g, stage_to_rank))), g["trainable"])
            for k, g in sorted(_merged(records).items()) if _spans(g, stage_to_rank) and (frozen or g["trainable"])]


class TiedCopies:
    """This rank's copies of the weights tied across pipeline ranks (``RuntimeOptions.tied_weights="sync"``), with
    the process groups that keep them equal.

    Made by every rank, in the same order (``dist.new_group`` is collective over the job): per distinct set of
    holding pipeline ranks (the groups of :func:`tie_sync_groups`, in key order, grouped by that set), one process
    group per replica column ``j`` (the copies of column ``j`` are on ``grid[i][j]`` for the holding pipeline ranks
    ``i``).  At construction each copy is made the lowest holding rank's (:meth:`broadcast`).  Around a training step
    (:meth:`take` before, :meth:`sync` after its backward work and data-parallel reductions have completed): the
    gradient each copy held before the step is taken aside, the step's own contribution (zeros where this copy got
    none) is summed over the group, and the earlier gradient added back, so that after every step each copy holds
    the unsplit model's accumulated gradient, under gradient accumulation too.  A copy that no rank's step gave a
    gradient keeps what it held (None stays None, as in the unsplit model's backward)."""

    def __init__(self, modules: Mapping[int, nn.Module], uses: Mapping[str, Any], plan: Sequence[tuple[str, tuple[int, ...]]],
                 *, rank: int, pp_rank: int, grid: Sequence[Sequence[int]], dp_group: Any = None) -> None:
        import torch.distributed as dist

        self.rank = rank
        #: (group, its global ranks, this rank's copies in key order: the Parameter, or None where another key of
        #: the set already names that one Parameter) for every set this rank holds copies in
        self.sets: list[tuple[Any, list[int], list[nn.Parameter | None]]] = []
        #: ids of the copies this rank does not count in a global gradient norm (a lower rank of its group does)
        self.not_counted: set[int] = set()
        #: the copies of groups frozen (on every rank) at construction: made equal then, not summed per step; one
        #: found trainable at a training step is refused there (:meth:`take`); id -> (Parameter, key)
        self.frozen: dict[int, tuple[nn.Parameter, str]] = {}
        self._dp_group = dp_group
        self._dp = len(grid[0]) if grid else 1
        #: a training step ran inside ``no_sync``: the gradients held before the next synchronised one are not yet
        #: averaged over the replicas (the data-parallel reduction of that step sees only its own contribution)
        self.unreduced = False
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        trainable: dict[str, bool] = {}
        for key, pp, *rest in plan:
            by_ranks.setdefault(pp, []).append(key)
            trainable[key] = bool(rest[0]) if rest else True
        for pp, keys in by_ranks.items():
            for j in range(self._dp):
                ranks = [int(grid[i][j]) for i in pp]
                group = dist.new_group(sorted(ranks))
                if rank not in ranks:
                    continue
                params: list[nn.Parameter | None] = []
                seen: set[int] = set()
                for key in keys:
                    use = uses.get(key)
                    if not use:
                        raise PipelineConfigError(
                            f"rank {rank}: the tie group {key!r} is held by pipeline rank {pp_rank}'s stages on other "
                            "replicas but not here: the replicas of a stage must be built from the same model")
                    s, local = next(iter(use["stages"].items()))
                    p = modules[int(s)].get_parameter(local[0])
                    if not trainable[key]:
                        self.frozen[id(p)] = (p, key)
                    params.append(None if id(p) in seen else p)
                    seen.add(id(p))
                    if rank != min(ranks):  # (and of the lowest, only column 0's: training.py counts replicated ones so)
                        self.not_counted.add(id(p))
                self.sets.append((group, ranks, params))

    def __bool__(self) -> bool:
        return bool(self.sets)

    def _copies(self) -> list[nn.Parameter]:
        """The copies summed per step (not those frozen at construction)."""
        seen: set[int] = set()
        out = []
        for _, _, params in self.sets:
            for p in params:
                if p is not None and id(p) not in seen and id(p) not in self.frozen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def broadcast(self) -> None:
        """Every copy from the lowest holding rank of its group (ranks may have built the model from other seeds)."""
        import torch
        import torch.distributed as dist

        with torch.no_grad():
            for group, ranks, params in self.sets:
                for p in params:
                    if p is not None:
                        dist.broadcast(p.data, src=min(ranks), group=group)

    def take(self) -> list[Any]:
        """Before a training step: each copy's gradient, taken aside (the step accumulates into None)."""
        for p, key in self.frozen.values():
            if p.requires_grad:
                raise PipelineConfigError(
                    f"rank {self.rank}: the weight tied across pipeline ranks {key!r} was frozen (requires_grad=False) "
                    "when this Pipeline was built and is trainable now: its copies on the holding ranks would be "
                    "trained apart, each with its own rank's part of the gradient; unfreeze it before building the "
                    "Pipeline (build a new Pipeline after unfreezing)")
        copies = self._copies()
        prev = [p.grad for p in copies]
        for p in copies:
            p.grad = None
        return prev

    def restore(self, prev: list[Any]) -> None:
        """After a failed step: the gradients taken aside, with what the step added locally (nothing collective)."""
        import torch

        with torch.no_grad():
            for p, g in zip(self._copies(), prev):
                if g is None:
                    continue
                if p.grad is not None:
                    g.add_(p.grad)
                p.grad = g

    def sync(self, prev: list[Any], *, synced: bool, check: Any = None, limit: float = 40.0) -> None:  # noqa: C901
        """After a training step (every B and W action done, data-parallel reductions completed): sum each copy's
        contribution of the step over its group and add back the gradient it held before (``prev``, from
        :meth:`take`).  ``synced``: the step reduced gradients over the replicas (not inside ``no_sync``).  ``check()``:
        a failure a peer reported (raised instead of waiting on); ``limit``: seconds each all-reduce may take."""
        import torch
        import torch.distributed as dist

        copies = self._copies()
        index = {id(p): i for i, p in enumerate(copies)}
        with torch.no_grad():
            summed: dict[int, torch.Tensor | None] = {}
            for group, ranks, params in self.sets:
                # (a Parameter two keys name: one slot, the first key's; a frozen group's: none)
                live = [p for p in params if p is not None and id(p) not in self.frozen]
                by_dtype: dict[Any, list[nn.Parameter]] = {}
                for p in live:
                    by_dtype.setdefault(p.dtype, []).append(p)
                for dtype, ps in by_dtype.items():
                    dev = ps[0].device
                    held = [0.0 if p.grad is None else 1.0 for p in ps]
                    flat = torch.cat([*(p.grad.detach().reshape(-1) if p.grad is not None
                                        else torch.zeros(p.numel(), dtype=dtype, device=dev) for p in ps),
                                      torch.tensor(held, dtype=dtype, device=dev)])
                    self._wait(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True), check, limit,
                               f"the all-reduce of the step's gradients of weights tied across ranks {sorted(ranks)}")
                    # (how many copies got a gradient: read on the host only where this one got none)
                    counts = flat[-len(ps):].tolist() if 0.0 in held else held
                    offset = 0
                    for p, count in zip(ps, counts):
                        n = p.numel()
                        summed[id(p)] = flat[offset:offset + n].view_as(p) if count else None
                        offset += n
            if self._dp > 1 and synced and self.unreduced:
                prev = self._average_over_replicas(copies, prev, check, limit)
            self.unreduced = self._dp > 1 and not synced
            for p in copies:
                g, before = summed.get(id(p)), prev[index[id(p)]]
                if g is None:
                    p.grad = before
                elif before is None:
                    p.grad = g
                else:
                    before.add_(g)
                    p.grad = before

    def _average_over_replicas(self, copies: list[nn.Parameter], prev: list[Any], check: Any, limit: float) -> list[Any]:
        """The gradients held before a synchronised step that followed ``no_sync`` steps, averaged over the
        replicas (as the data-parallel reduction of that step averages the other parameters' whole gradients)."""
        import torch
        import torch.distributed as dist

        out = list(prev)
        by_dtype: dict[Any, list[int]] = {}
        for i, p in enumerate(copies):
            by_dtype.setdefault(p.dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            dev = copies[idx[0]].device
            parts = [prev[i].reshape(-1) if prev[i] is not None else torch.zeros(copies[i].numel(), dtype=dtype, device=dev)
                     for i in idx]
            held = [0.0 if prev[i] is None else 1.0 for i in idx]
            flat = torch.cat([*parts, torch.tensor(held, dtype=dtype, device=dev)])
            self._wait(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._dp_group, async_op=True), check, limit,
                       "the average over the replicas of tied weights' gradients accumulated inside no_sync")
            counts = flat[-len(idx):].tolist()
            flat.div_(self._dp)
            offset = 0
            for i, count in zip(idx, counts):
                n = copies[i].numel()
                if count:
                    view = flat[offset:offset + n].view_as(copies[i])
                    if out[i] is None:
                        out[i] = view.clone()
                    else:
                        out[i].copy_(view)
                offset += n
        return out

    def _wait(self, work: Any, check: Any, limit: float, what: str) -> None:
        """Wait for ``work`` polling, so that a peer's reported failure or a lost peer ends the wait (not gloo's
        or NCCL's own timeout, minutes away)."""
        import time

        deadline = time.monotonic() + limit
        delay, check_at = 1e-5, time.monotonic() + 0.05
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline:
                from ..transport.tensor import guard_exit_works

                guard_exit_works([work])  # (never to complete: it must not hold up the process's exit)
                raise PipelineError(f"rank {self.rank}: {what} did not complete in {limit:g} s")
            if check is not None and now > check_at:
                check_at = now + 0.05
                err = check()
                if err is not None:
                    raise err
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)
        work.wait()
