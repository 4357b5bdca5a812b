"""The runtime's per-step host shortcuts give what the slow paths they replace gave.

- ``ModelFingerprint`` (runtime/fingerprint.py): its key changes exactly when a
  full walk's would (requires_grad, train/eval, a parameter's shape, a new or
  replaced parameter or submodule), and a cold step is seen again through a real
  ``Pipeline`` (one rank process): the stall budget it sends.
- ``input_signature`` with ``StepInputs.layout_key`` (a digest cached by the uncut
  batch's layout): equal to the full walk's for the same microbatches, different
  when a shape, a dtype, requires_grad, the grad mode or a scalar changes; no key
  for inputs it cannot describe cheaply (pre-cut microbatches, containers).
- ``split_microbatches``: the same pieces as before (tuples per microbatch, a dict
  per microbatch).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import run_one_rank  # noqa: E402

import pipeloom  # noqa: E402
from pipeloom.runtime.actor import StepInputs, input_signature  # noqa: E402
from pipeloom.runtime.fingerprint import ModelFingerprint  # noqa: E402
from pipeloom.runtime.pipeline import Microbatches, split_microbatches  # noqa: E402


def _walk(mods: list[nn.Module]) -> tuple:
    """The fingerprint as the walk every step computed it (Pipeline._stall_budget before the cache)."""
    seen, params = set(), []
    for m in mods:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return (tuple((id(p), p.requires_grad, tuple(p.shape)) for p in params),
            tuple(m.training for st in mods for m in st.modules()))


def _changes(mods: list[nn.Module], fp: ModelFingerprint, change) -> tuple[bool, bool]:
    """(whether the walk's key changed, whether the cached key changed) across ``change()``."""
    w0, k0 = _walk(mods), fp.key()
    change()
    return _walk(mods) != w0, fp.key() != k0


def test_the_fingerprint_changes_when_the_walk_would() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(3, 3)
    mods = [nn.Sequential(shared, nn.Tanh(), nn.Linear(3, 2)), nn.Sequential(nn.Linear(2, 2), shared)]
    fp = ModelFingerprint(mods)
    assert fp.key() == fp.key()
    assert len(fp.key()[0]) == 6  # the shared Linear's weight and bias counted once
    cases = {
        "nothing": lambda: None,
        "requires_grad": lambda: mods[0][2].weight.requires_grad_(False),
        "requires_grad back": lambda: mods[0][2].weight.requires_grad_(True),
        "eval": lambda: mods[1].eval(),
        "one submodule to train": lambda: mods[1][0].train(),
        "a shape (p.data)": lambda: setattr(mods[0][2].weight, "data", torch.zeros(4, 3)),
        "a new parameter object": lambda: setattr(mods[1][0], "bias", nn.Parameter(torch.zeros(2))),
        "register_parameter": lambda: mods[0][1].register_parameter("scale", nn.Parameter(torch.ones(1))),
        "a new submodule": lambda: mods[0].add_module("extra", nn.Linear(2, 2)),
        "a replaced submodule": lambda: setattr(mods[1], "0", nn.Linear(2, 2)),
        "a module built elsewhere": lambda: nn.Linear(5, 5),  # (bumps the generation: a rebuild, same key)
    }
    for name, change in cases.items():
        walked, cached = _changes(mods, fp, change)
        assert walked == cached == (name not in ("nothing", "a module built elsewhere")), name
        assert fp.key()[0] == tuple(id(p) for p in dict.fromkeys(p for m in mods for p in m.parameters())), name


def test_the_fingerprint_misses_what_its_docstring_says() -> None:
    # a parameter written into the private dict: no registration hook fires, the cached lists stay
    # (runtime/fingerprint.py documents this; any later registration in the process refreshes them)
    m = nn.Linear(2, 2)
    fp = ModelFingerprint([m])
    k0 = fp.key()
    m._parameters["weight"] = nn.Parameter(torch.zeros(2, 2))
    assert fp.key() == k0
    nn.Linear(1, 1)  # any registration
    assert fp.key() != k0


STALL_BUDGET = r"""
import json, os, sys
import torch
from torch import nn
import pipeloom
torch.manual_seed(0)
mods = [nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0), nn.Linear(4, 4)) for _ in range(2)]
pipe = pipeloom.Pipeline(lambda s: mods[s], schedule="Interleaved1F1B", num_microbatches=2, loss_fn=nn.functional.mse_loss,
                         stall_timeout=7.0, first_step_stall_timeout=70.0)
x, y = torch.randn(4, 4), torch.randn(4, 4)
budgets = []
def step(note):
    pipe.step(x, target=y)
    budgets.append([note, pipe._control.stall_budget])
step("first")
step("same")
mods[1][2].weight.requires_grad_(False); step("requires_grad off")
step("same")
mods[1][2].weight.requires_grad_(True); step("requires_grad back (seen)")
mods[0].eval(); step("a stage in eval mode")
mods[0].train(); step("train again (seen)")
mods[1][2] = nn.Linear(4, 4); step("a replaced submodule")
with torch.no_grad():
    mods[0][0].weight.data = torch.zeros(4, 4)  # same shape, new storage: warm
step("same shapes")
pipe.eval(x); budgets.append(["eval", pipe._control.stall_budget])
pipe.eval(x); budgets.append(["eval again", pipe._control.stall_budget])
pipe.close()
print(json.dumps(budgets))
"""


async def test_the_stall_budget_is_cold_again_when_the_model_changes(tmp_path: Path) -> None:
    got = await run_one_rank(tmp_path, "budget.py", STALL_BUDGET, timeout=60)
    cold = [note for note, b in got if b == 70.0]
    assert all(b in (7.0, 70.0) for _, b in got), got
    assert cold == ["first", "requires_grad off", "a stage in eval mode", "a replaced submodule", "eval"], got


def _slow(inputs: StepInputs) -> int:
    return input_signature(StepInputs(inputs.args, inputs.kwargs, inputs.targets))  # (no key: the full walk)


def test_the_cached_signature_is_the_walks_and_changes_with_the_layout() -> None:
    x, y = torch.randn(12, 3), torch.randn(12, 2)
    mask = torch.ones(5, 5, dtype=torch.bool)
    batches = {
        "plain": ((x,), {}, y),
        "shape": ((torch.randn(12, 4),), {}, y),
        "rows": ((torch.randn(13, 3),), {}, torch.randn(13, 2)),
        "dtype": ((x.double(),), {}, y),
        "requires_grad": ((x.clone().requires_grad_(True),), {}, y),
        "a scalar kwarg": ((x,), {"scale": 2}, y),
        "another scalar": ((x,), {"scale": 3}, y),
        "True, not 1": ((x,), {"scale": True}, y),
        "a float": ((x,), {"scale": 0.0}, y),
        "its negative zero": ((x,), {"scale": -0.0}, y),
        "a Replicate": ((x,), {"mask": pipeloom.Replicate(mask)}, y),
        "a 0-d tensor": ((x, torch.tensor(2.0)), {}, y),
        "no target": ((x,), {}, None),
    }
    sigs = {}
    for name, (args, kwargs, target) in batches.items():
        inputs = split_microbatches(args, kwargs, target, 4)
        assert inputs.layout_key is not None, name
        for _ in range(2):  # the second from the cache
            sigs[name] = input_signature(inputs)
            assert sigs[name] == _slow(inputs), name
    assert len(set(sigs.values())) == len(sigs), sigs
    # grad mode is in the key (pieces cut under no_grad or inference_mode may differ): the same walk's digest
    xr = x.clone().requires_grad_(True)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            inputs = split_microbatches((xr,), {}, y, 4)
            assert input_signature(inputs) == _slow(inputs)
    assert input_signature(split_microbatches((xr,), {}, y, 4)) == sigs["requires_grad"]
    # inputs without a cheap key take the walk every time
    for args, kwargs in [((Microbatches([x[:3], x[3:]]),), {}), ((x,), {"pair": (1, 2)}), ((x,), {"d": {"a": x}})]:
        inputs = split_microbatches(args, kwargs, None, 2)
        assert inputs.layout_key is None
        assert input_signature(inputs) == _slow(inputs)


def test_split_microbatches_pieces() -> None:
    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5.0)
    inputs = split_microbatches((x, 7), {"k": x}, y, 2)
    assert [tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in inputs.args[1]] == [(2, 2), 7]
    assert all(type(a) is tuple for a in inputs.args)
    assert torch.equal(inputs.kwargs[0]["k"], x[:3]) and torch.equal(inputs.targets[1], y[3:])
    none = split_microbatches((), {}, None, 3)
    assert none.args == [(), (), ()] and none.kwargs == [{}, {}, {}] and none.targets is None
    assert none.kwargs[0] is not none.kwargs[1]


@pytest.mark.parametrize("n", [1, 3])
def test_split_microbatches_rows_like_torch(n: int) -> None:
    x = torch.randn(7, 2)
    inputs = split_microbatches((x,), {}, None, n)
    assert [a[0].shape[0] for a in inputs.args] == [c.shape[0] for c in torch.tensor_split(x, n)]
