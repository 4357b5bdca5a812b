"""Whether a step is *cold* (torch.compile may retrace), decided without walking the model each step.

The problem.  A rank tells its peers, in its heartbeats, how long one of its
actions may run before they call it stalled: generous while torch.compile may
be compiling (the first step, or the first after the parameters, their
``requires_grad``, shapes or the modules' train/eval modes changed), short
otherwise (``Pipeline._stall_budget``).  Deciding it walked every stage's
``parameters()`` and ``modules()`` each step -- recursive generators, a set to
drop shared parameters -- ~150 us per step on the CPU benchmark's tiny model,
and more on a real one: host time on the critical path of a host-bound GPU
step.

Alternatives.  (a) Walk every step (what it was): always right, slow.
(b) Cache the fingerprint and never look again: misses ``requires_grad_``,
``.train()``/``.eval()`` and ``p.data = bigger``, which the contract names.
(c) What this module does: cache the *lists* (the deduplicated parameters, the
modules) and rebuild them only when torch says a parameter or a submodule was
registered somewhere (``torch.nn.modules.module``'s global registration hooks,
public since torch 2.0, bump a process-wide generation); each step reads the
cached lists' flags flat -- ``requires_grad``, ``shape``, ``training`` -- and
compares.  A flag change, a new parameter object assigned as an attribute
(``m.weight = nn.Parameter(...)``), ``add_module``/``register_parameter``
or replacing a submodule are all seen.

What it can miss (documented, tested where it holds): a parameter or
submodule put into a module's private ``_parameters``/``_modules`` dict
directly, or removed with ``del m.weight`` (no hook fires for either), leaves
the cached lists stale until some other registration happens anywhere in the
process.  The cost of a miss is a cold step judged warm: a peer may report a
compile longer than ``stall_timeout`` as a stall.  (FSDP2 swaps parameters
through ``_parameters`` on unshard/reshard; the budget is read at a step's
start, after the previous step's reshard, when the same sharded parameters
are registered each time.)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.nn.parameter import is_lazy
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

__all__ = ["ModelFingerprint", "registration_generation"]

_generation = itertools.count(1)
_current = 0
_installed = False


def _bump(*_args: Any) -> None:
    global _current
    _current = next(_generation)
    # (returns None: the registered object is kept as it is)


def registration_generation() -> int:
    """A number that changes whenever any module of this process registers a parameter or a submodule."""
    global _installed
    if not _installed:
        _installed = True
        register_module_parameter_registration_hook(_bump)
        register_module_module_registration_hook(_bump)
        _bump()
    return _current


class ModelFingerprint:
    """The fingerprint of some modules' parameters (which, ``requires_grad``, shapes) and modes, cheaply per call.

    ``key()`` equals the one of a full walk whenever the cached lists are current
    (see the module docstring for when they are not).
    """

    __slots__ = ("_modules", "_gen", "_params", "_mods", "_ids")

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._modules = list(modules)
        self._gen = -1
        self._params: list[nn.Parameter] = []
        self._mods: list[nn.Module] = []
        self._ids: tuple[int, ...] = ()

    def _rebuild(self) -> None:
        seen: set[int] = set()
        params = []
        for m in self._modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        self._params = params
        self._mods = [sub for m in self._modules for sub in m.modules()]
        self._ids = tuple(id(p) for p in params)

    def key(self) -> tuple[Any, ...]:
        """(parameter ids, their requires_grad, their shapes, every module's ``training``)."""
        gen = registration_generation()
        if gen != self._gen:
            self._rebuild()
            self._gen = gen
        params = self._params
        try:
            shapes = tuple([p.shape for p in params])
        except RuntimeError:  # a lazy module's parameter not materialised yet (its first forward gives it a shape)
            shapes = tuple([None if is_lazy(p) else p.shape for p in params])
        return (self._ids, tuple([p.requires_grad for p in params]), shapes, tuple([m.training for m in self._mods]))
