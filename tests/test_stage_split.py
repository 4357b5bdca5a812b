"""The I/W split against a full backward, in one process, for awkward autograd graphs.

Each case builds a stage module, runs forward + I + W through StageExecutor on
float64 inputs, and compares every parameter gradient and every input gradient
with a plain full backward of a deep copy of the same module on the same
inputs.  Several microbatches are interleaved (F F I I W W) as a zero-bubble
schedule would, so state leaking between microbatches shows up too.  The
rank-process tests in test_runtime_gradients.py cover the same cases end to end.
"""

from __future__ import annotations

import copy
from typing import Any
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeloom.runtime.stage import StageExecutor

D = 6


@pytest.fixture(autouse=True)
def _float64():
    """float64 for these tests only (a global default would leak into other test modules)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


class TwiceLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class Recurrent(nn.Module):
    def __init__(self, steps: int = 3) -> None:
        super().__init__()
        self.cell = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.LayerNorm(D))
        self.steps = steps

    def forward(self, x):
        h = x
        for _ in range(self.steps):
            h = self.cell(h) + x
        return h


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class SharedTranspose(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D)

    def forward(self, x):
        wt = self.w.t()
        return torch.sin(x @ wt) @ wt


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class CustomFn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return Scale.apply(self.lin(Scale.apply(x, self.w)), self.w)


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(D, D)
        self.l2 = nn.Linear(D, D)

    def forward(self, x):
        h = self.l1(x)
        h.mul_(2.0)
        h = torch.relu_(h)
        out = self.l2(h)
        out.add_(h)
        return out


class InPlaceInput(nn.Module):
    """Modifies its input in place, which the unsplit model allows (an intermediate there)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.pos = nn.Parameter(torch.randn(D))

    def forward(self, x):
        x += self.pos
        x.mul_(1.5)
        return self.lin(x)


class Parametrized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.utils.parametrizations.weight_norm(nn.Linear(D, D))
        self.lin2 = nn.Linear(D, D)

    def forward(self, x):
        return self.lin2(self.lin(torch.tanh(self.lin(x))))


class BareParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(D))
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return self.lin(x * self.scale) * self.scale


class ParamOutput(nn.Module):
    """Two outputs, one of which depends on the parameters only (a position table)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(4, D))
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        p = self.pos * 2.0
        return self.lin(x) + p.sum(0), p


class Checkpointed(nn.Module):
    calls = 0

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))
        self.reentrant = reentrant

    def _inner(self, x):
        type(self).calls += 1
        return self.block(x)

    def forward(self, x):
        return checkpoint(self._inner, x, use_reentrant=self.reentrant) + x


class CheckpointedBare(Checkpointed):
    """A parameter of the module itself read inside the checkpointed region (no module of its own runs again)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__(reentrant)
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(D))

    def _inner(self, x):
        type(self).calls += 1
        return self.block(x) * self.gain


class SharedNodeOutputs(nn.Module):
    """Outputs that share one autograd node (``chunk``; ``unbind`` of parameters only) and one returned twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, 2 * D)
        self.pos = nn.Parameter(torch.randn(2, D))

    def forward(self, x):
        a, b = self.lin(x).chunk(2, -1)
        p, q = (self.pos * 2.0).unbind(0)
        return a, b, p, q, a


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        h = self.norm(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


CASES = {
    "twice": TwiceLinear,
    "recurrent": Recurrent,
    "tied": Tied,
    "shared_transpose": SharedTranspose,
    "custom_function": CustomFn,
    "in_place": InPlace,
    "in_place_input": InPlaceInput,
    "parametrized": Parametrized,
    "bare_param": BareParam,
    "param_output": ParamOutput,
    "checkpoint": lambda: Checkpointed(False),
    "checkpoint_reentrant": lambda: Checkpointed(True),
    "checkpoint_bare_param": lambda: CheckpointedBare(False),
    "shared_node_outputs": SharedNodeOutputs,
    "attention": Attention,
}


def _inputs(case: str, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shape = (3, 5, D) if case == "attention" else (5, D)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _run_split(module: nn.Module, xs, gys, *, position: str):
    last = position == "last"
    ex = StageExecutor(0, module, is_last=last,
                       loss_fn=(lambda out, t: ((out[0] if isinstance(out, tuple) else out) * t).sum()) if last else None, grad_scale=1.0, split_backward=True)
    in_grads = []
    leaves = [x.detach().requires_grad_(position != "first") for x in xs]
    for mb, x in enumerate(leaves):
        ex.forward(mb, (x,), {}, gys[mb][0] if last else None)
    for mb in range(len(xs)):
        in_grads.append(ex.backward_input(mb, None if last else gys[mb]))
    for mb in range(len(xs)):
        ex.backward_weight(mb)
    return in_grads


def _run_full(module: nn.Module, xs, gys, *, position: str):
    in_grads = []
    for mb, x in enumerate(xs):
        x = x.detach().requires_grad_(position != "first")
        out = module(x * 1)  # an intermediate, as a stage input is in the unsplit model
        outs = out if isinstance(out, tuple) else (out,)
        if position == "last":
            (outs[0] * gys[mb][0]).sum().backward()
        else:
            torch.autograd.backward(outs, gys[mb])
        in_grads.append([x.grad])
    return in_grads


@pytest.mark.parametrize(
    ("case", "position"),
    # A reentrant checkpoint whose input needs no gradient has no gradient at all (torch's rule).
    # (The last stage's loss reads only the first output: the others' parameters get no gradient there.)
    [(c, p) for c in sorted(CASES) for p in ("middle", "first", "last")
     if (c, p) not in (("checkpoint_reentrant", "first"), ("shared_node_outputs", "last"))],
)
def test_split_equals_full_backward(case: str, position: str) -> None:
    torch.manual_seed(0)
    ref = CASES[case]()
    mod = copy.deepcopy(ref)
    xs = _inputs(case, 3)
    with torch.no_grad():
        outs = [ref(x) for x in xs]
    g = torch.Generator().manual_seed(11)
    gys = [tuple(torch.randn(o.shape, generator=g) for o in (out if isinstance(out, tuple) else (out,))) for out in outs]
    if position == "last":
        gys = [(gy[0],) for gy in gys]
    want = _run_full(ref, xs, gys, position=position)
    got = _run_split(mod, xs, gys, position=position)
    for (name, p), q in zip(ref.named_parameters(), mod.parameters()):
        assert p.grad is not None, name
        assert q.grad is not None, f"{case}: {name} got no gradient from the I/W split"
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12, msg=lambda m: f"{case} {position} {name}: {m}")
    if position != "first":
        for w, gi in zip(want, got):
            torch.testing.assert_close(gi[0], w[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reentrant,bare", [(False, False), (True, False), (False, True)])
def test_checkpoint_recomputes_no_more_than_a_full_backward(reentrant: bool, bare: bool) -> None:
    """I + W recompute a checkpointed region at most once per microbatch, as one full backward does (``bare``: a
    parameter the region reads directly, found when W recomputes the region for it)."""
    cls = CheckpointedBare if bare else Checkpointed
    mod = cls(reentrant)
    xs = _inputs("checkpoint", 2)
    cls.calls = 0
    _run_full(copy.deepcopy(mod), xs, [(torch.ones(5, D),)] * 2, position="middle")
    full_calls = cls.calls
    # The executor learns at its first I which modules are recomputed: from then on,
    # every step recomputes each checkpointed region once per microbatch.
    ex = StageExecutor(0, mod, is_last=False, loss_fn=None, grad_scale=1.0, split_backward=True)
    for step in range(3):
        cls.calls = 0
        leaves = [x.detach().requires_grad_() for x in xs]
        for mb, x in enumerate(leaves):
            ex.forward(mb, (x,), {})
        for mb in range(len(xs)):
            ex.backward_input(mb, (torch.ones(5, D),))
        for mb in range(len(xs)):
            ex.backward_weight(mb)
        if step > 0:
            assert cls.calls <= full_calls, (step, cls.calls, full_calls)


def test_trainable_set_may_change_between_steps() -> None:
    """Unfreezing and freezing parameters between steps, as fine-tuning recipes do."""
    torch.manual_seed(0)
    ref = Recurrent()
    mod = copy.deepcopy(ref)
    ex = StageExecutor(0, mod, is_last=False, loss_fn=None, grad_scale=1.0, split_backward=True)
    for step, frozen in enumerate([("cell.0.weight",), (), ("cell.2.weight", "cell.2.bias")]):
        for m in (ref, mod):
            m.zero_grad(set_to_none=True)
            for n, p in m.named_parameters():
                p.requires_grad_(n not in frozen)
        x = _inputs("recurrent", 1)[0] + step
        gy = torch.randn(5, D, generator=torch.Generator().manual_seed(step))
        ref(x.detach().requires_grad_()).backward(gy)
        ex.forward(0, (x.detach().requires_grad_(),), {})
        ex.backward_input(0, (gy,))
        ex.backward_weight(0)
        for (n, p), q in zip(ref.named_parameters(), mod.parameters()):
            if n in frozen:
                assert q.grad is None, n
            else:
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12)


def test_compiled_stage_falls_back_to_full_backward_with_a_warning() -> None:
    torch.manual_seed(0)
    ref = TwiceLinear()
    mod = copy.deepcopy(ref)
    compiled = torch.compile(mod, backend="aot_eager")
    xs = _inputs("twice", 2)
    gys = [(torch.randn(5, D),) for _ in xs]
    _run_full(ref, xs, gys, position="middle")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_split(compiled, xs, gys, position="middle")
    assert sum("cannot be split" in str(w.message) for w in caught) == 1
    for p, q in zip(ref.parameters(), mod.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12)


class _Keep(torch.autograd.Function):
    """Identity whose node keeps an object on its context (as a custom Function may keep a tensor)."""

    @staticmethod
    def forward(ctx, x, marker):  # type: ignore[no-untyped-def]
        ctx.marker = marker
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g, None


@pytest.mark.parametrize("index", [0, 1])
def test_a_full_backward_leaves_its_graph_to_be_freed_later(index: int) -> None:
    """RuntimeOptions.defer_graph_teardown: the backward leaves its graph's nodes in ``graves`` (freed by the
    runtime after the next action has launched); gradients are the same, and the nodes go when the list is
    cleared.  Past the first stage the input leaves do not keep their gradients meanwhile."""
    import weakref

    class Marker:
        pass

    torch.manual_seed(0)
    ref, got = nn.Linear(4, 4), nn.Linear(4, 4)
    got.load_state_dict(ref.state_dict())
    a = StageExecutor(index, ref, is_last=False, loss_fn=None, grad_scale=1.0)
    b = StageExecutor(index, got, is_last=False, loss_fn=None, grad_scale=1.0)
    b.graves = []
    x = torch.randn(3, 4)
    g = torch.randn(3, 4)
    markers: list[Any] = []

    def keep(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        m = Marker()
        markers.append(weakref.ref(m))
        return _Keep.apply(out, m)

    for ex in (a, b):
        leaf = x.clone().requires_grad_(True)
        ex.module.register_forward_hook(keep)
        ex.forward(0, (leaf,), {})
        (gin,) = ex.backward(0, [g])
        torch.testing.assert_close(gin, g @ ex.module.weight)
        assert (leaf.grad is None) == (ex is b and index > 0)
        del leaf
    assert markers[0]() is None  # freed when the backward returned
    assert markers[1]() is not None and len(b.graves) == 1  # still held by the graph's nodes
    for p, q in zip(ref.parameters(), got.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    b.graves.clear()
    assert markers[1]() is None


@pytest.mark.parametrize("split", [False, True])
def test_no_saved_activation_outlives_the_backward_with_deferred_teardown(split: bool) -> None:
    """defer_graph_teardown keeps a finished backward's *nodes* for later, never what autograd saved: after a full
    backward, or I then W (whose graph I retained: W frees it when it ends), no saved activation is alive but the
    stage's input, which the graph's input accumulator holds until the runtime frees the nodes."""
    import gc
    import weakref

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(nn.functional.gelu(self.a(x)).sin())

    saved: list[Any] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter) and t.numel() >= 16 * 8:
            saved.append(weakref.ref(t))
        return t

    torch.manual_seed(0)
    ex = StageExecutor(1, Net(), is_last=False, loss_fn=None, grad_scale=1.0, split_backward=split)
    ex.graves = []
    x = torch.randn(32, 16).requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ex.forward(0, (x,), {})
    g = [torch.randn(32, 16)]
    if split:
        ex.backward_input(0, g)
        ex.backward_weight(0)
    else:
        ex.backward(0, g)
    del g
    gc.collect()
    alive = [r() for r in saved if r() is not None]
    assert all(t is x for t in alive), f"{len(alive)} saved activations alive after the backward"


@pytest.mark.parametrize("case", ["twice", "checkpoint"])
def test_a_first_stage_input_that_requires_grad_gets_a_full_backwards_gradient(case: str) -> None:
    """The caller's batch requires grad: the first stage's inputs are views of it, not leaves.  I stops at them (a
    full backward goes on into the caller's graph): the split goes on too, so the batch gets a full backward's
    gradient (``checkpoint``: from the second microbatch the recomputed modules' gradients are taken in I)."""
    torch.manual_seed(0)
    ref = CASES[case]()
    mod = copy.deepcopy(ref)
    x = _inputs(case, 1)[0].repeat(2, 1)
    g = torch.Generator().manual_seed(3)
    gys = [torch.randn(5, D, generator=g) for _ in range(2)]
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    for xm, gy in zip(torch.tensor_split(xa, 2), gys):
        ref(xm).backward(gy)
    ex = StageExecutor(0, mod, is_last=False, loss_fn=None, grad_scale=1.0, split_backward=True)
    for mb, xm in enumerate(torch.tensor_split(xb, 2)):
        ex.forward(mb, (xm,), {})
    for mb in range(2):
        ex.backward_input(mb, (gys[mb],))
    for mb in range(2):
        ex.backward_weight(mb)
    assert xb.grad is not None, "the batch got no gradient"
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-10, atol=1e-12)
    for p, q in zip(ref.parameters(), mod.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12)


def test_a_full_backward_into_the_callers_batch_warns_nothing() -> None:
    """A full backward (1F1B's B) of a first stage whose inputs are views of a batch that requires grad: the batch
    gets its gradient, and reading the inputs' gradients raises no warning about a non-leaf ``.grad``."""
    import warnings

    torch.manual_seed(0)
    mod = CASES["twice"]()
    xb = _inputs("twice", 1)[0].repeat(2, 1).requires_grad_()
    ex = StageExecutor(0, mod, is_last=False, loss_fn=None, grad_scale=1.0)
    g = torch.Generator().manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for mb, xm in enumerate(torch.tensor_split(xb, 2)):
            ex.forward(mb, (xm,), {})
            ex.backward(mb, (torch.randn(5, D, generator=g),))
    assert xb.grad is not None


class CountsThenModifiesInput(nn.Module):
    """Updates a buffer, then modifies its input in place (allowed on the unsplit model's intermediate)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("seen", torch.zeros(D))

    def forward(self, x):
        with torch.no_grad():
            self.seen.mul_(0.5).add_(x.mean(0))
        x.mul_(1.5)
        return self.lin(x - self.seen)


def test_a_stage_that_modifies_its_input_in_place_runs_each_forward_once() -> None:
    """The stage's first forward runs on copies of its leaf inputs and finds the in-place op on them: no forward is
    run twice, so what a forward does before the in-place op (a buffer update) happens once, as unsplit."""
    torch.manual_seed(0)
    ref = CountsThenModifiesInput()
    mod = copy.deepcopy(ref)
    xs = _inputs("in_place_input", 3)
    g = torch.Generator().manual_seed(5)
    gys = [(torch.randn(5, D, generator=g),) for _ in xs]
    want = _run_full(ref, xs, gys, position="middle")
    with pytest.warns(RuntimeWarning, match="modifies its input in place"):
        got = _run_split(mod, xs, gys, position="middle")
    torch.testing.assert_close(mod.seen, ref.seen, rtol=1e-10, atol=1e-12)
    for p, q in zip(ref.parameters(), mod.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12)
    for w, gi in zip(want, got):
        torch.testing.assert_close(gi[0], w[0], rtol=1e-10, atol=1e-12)


class _FusedWgrad(torch.autograd.Function):
    """x @ w.T + b whose backward adds the weight gradient into ``w.main_grad`` and returns None for ``w``
    (Megatron's gradient-accumulation fusion): a backward with a side effect, which must run once."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        w.main_grad.add_(g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))
        return g @ w, None, g.reshape(-1, g.shape[-1]).sum(0)


class FusedWgrad(nn.Module):
    """The fused Function twice on one weight, a plain Linear beside it, and a pure custom Function (Scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D)
        self.b = nn.Parameter(torch.randn(D))
        self.lin = nn.Linear(D, D)
        self.s = nn.Parameter(torch.randn(D))
        self.w.main_grad = torch.zeros(D, D)

    def forward(self, x):
        h = torch.tanh(_FusedWgrad.apply(x, self.w, self.b))
        h = _FusedWgrad.apply(h, self.w, self.b) + self.lin(h)
        return Scale.apply(h, self.s)


@pytest.mark.parametrize("position", ["middle", "first", "last"])
def test_a_custom_backward_with_side_effects_runs_once(position: str) -> None:
    """W does not run a custom autograd Function's backward again: its weight-side gradients from I's one run seed
    the nodes below it, so a side effect (``main_grad += ...``) happens once per microbatch, as in a full backward."""
    torch.manual_seed(0)
    ref = FusedWgrad()
    mod = copy.deepcopy(ref)
    mod.w.main_grad = torch.zeros(D, D)
    xs = _inputs("fused", 3)
    g = torch.Generator().manual_seed(3)
    gys = [(torch.randn(5, D, generator=g),) for _ in xs]
    want = _run_full(ref, xs, gys, position=position)
    got = _run_split(mod, xs, gys, position=position)
    assert float(ref.w.main_grad.abs().sum()) > 0
    torch.testing.assert_close(mod.w.main_grad, ref.w.main_grad, rtol=1e-10, atol=1e-12)
    assert ref.w.grad is None and mod.w.grad is None
    for name in ("b", "lin.weight", "lin.bias", "s"):
        p, q = ref.get_parameter(name), mod.get_parameter(name)
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{position} {name}: {m}")
    if position != "first":
        for w, gi in zip(want, got):
            torch.testing.assert_close(gi[0], w[0], rtol=1e-10, atol=1e-12)
