"""RuntimeOptions.cuda_graphs: the slot count, the configuration checks, and (on a GPU) the graphed stage itself.

The pipeline cases run with the NCCL gradient pool (``tests/test_runtime_gradients.py``, ``graphs-*``
rows, ``PIPELOOM_TEST_BACKEND=nccl``); the single-process ones here compare one stage's graphed
forwards and backwards, interleaved as a pipeline interleaves them, with eager autograd.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "ranks"))

from pipeloom.runtime.cuda_graphs import StageGraphs, capturable_loss, slots_per_stage  # noqa: E402
from pipeloom.runtime.options import RuntimeOptions  # noqa: E402
from pipeloom.runtime.stage import StageExecutor  # noqa: E402
from pipeloom.schedules import generate  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")


# ---------------------------------------------------------------- CPU: planning and checks


@pytest.mark.parametrize(("name", "ranks", "m", "want"), [
    ("1F1B", 2, 8, [{0: 2}, {1: 1}]),
    ("1F1B", 4, 8, [{0: 4}, {1: 3}, {2: 2}, {3: 1}]),
    ("GPipe", 2, 6, [{0: 6}, {1: 6}]),
    ("1F1B", 2, 2, [{0: 2}, {1: 1}]),
])
def test_slots_are_the_schedules_live_microbatches(name: str, ranks: int, m: int, want: list[dict[int, int]]) -> None:
    sched = generate(name, num_ranks=ranks, num_microbatches=m)
    assert [slots_per_stage(sched.actions[r]) for r in range(ranks)] == want


def test_slots_of_multi_stage_and_combined_actions() -> None:
    # DualPipeV's OVERLAP_F_B actions count both halves; every stage of a rank gets at least one slot
    for name in ("DualPipeV", "Interleaved1F1B", "ZBVZeroBubble"):
        sched = generate(name, num_ranks=2, num_microbatches=8)
        for r in range(2):
            slots = slots_per_stage(sched.actions[r])
            stages = {leaf.stage for a in sched.actions[r] for leaf in a.leaves() if leaf.stage is not None}
            assert set(slots) == stages and all(1 <= n <= 8 for n in slots.values()), (name, r, slots)
    # the I of a split backward frees the slot (its W does not hold the activations of a graphed stage)
    sched = generate("ZBVZeroBubble", num_ranks=2, num_microbatches=8)
    live, peak = 0, 0
    for a in sched.actions[0]:
        for leaf in a.leaves():
            if leaf.stage == 0:
                live += {"F": 1, "I": -1, "B": -1}.get(leaf.type.value, 0)
                peak = max(peak, live)
    assert slots_per_stage(sched.actions[0])[0] == peak


def test_option_parsing() -> None:
    assert RuntimeOptions.from_env({"PIPELOOM_CUDA_GRAPHS": "1"}).cuda_graphs is True
    assert RuntimeOptions().cuda_graphs is False
    with pytest.raises(ValueError, match="cuda_graphs must be True or False"):
        RuntimeOptions(cuda_graphs="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"cuda_graphs_loss=True needs cuda_graphs=True"):
        RuntimeOptions(cuda_graphs_loss=True)
    with pytest.raises(ValueError, match=r"cuda_graphs_loss=True needs cuda_graphs=True"):
        RuntimeOptions.from_env({"PIPELOOM_CUDA_GRAPHS_LOSS": "1"})
    assert RuntimeOptions(cuda_graphs=True, cuda_graphs_loss=True).cuda_graphs_loss


def test_the_last_stages_layout_names_its_target() -> None:
    """A last stage's loss is captured with its module when the target is one tensor on the stage's device that
    needs no gradient; any other target keeps a module-only layout (its loss runs eagerly after the replay)."""
    dev = torch.device("cpu")  # (the layout is host logic: any device)
    m = nn.Linear(4, 4)
    mid = StageGraphs(1, m, 1, dev)
    last = StageGraphs(1, m, 1, dev, loss_fn=lambda y, t: ((y - t) ** 2).mean())
    x = torch.randn(2, 4, requires_grad=True)
    t = torch.randn(2, 4)
    assert mid._layout([x], {}, t) == ((((2, 4), torch.float32, True),), (), None)  # (not a last stage: no target)
    assert last._layout([x], {}, t) == ((((2, 4), torch.float32, True),), (), None, ((2, 4), torch.float32))
    ids = torch.zeros(2, dtype=torch.int64)
    assert last._layout([x], {}, ids)[3] == ((2,), torch.int64)
    for other in ({"y": t}, [t], t.requires_grad_(True), None):
        assert last._layout([x], {}, other)[3] is None, other


def test_keyword_arguments_in_the_layout() -> None:
    """Keyword tensors on the stage's device are graph inputs, keyword constants part of the layout (another value,
    1 for True, -0.0 for 0.0, or the names in another call order -- a ``**kwargs`` forward sees it -- is another
    layout); anything else: not graphable."""
    dev = torch.device("cpu")
    g = StageGraphs(1, nn.Linear(4, 4), 1, dev)
    x = torch.randn(2, 4)
    mask = torch.ones(2, 4, dtype=torch.bool)
    a = g._layout([x], {"scale": 0.5, "mask": mask, "cache": None})
    assert a == ((((2, 4), torch.float32, False),),
                 (("scale", False, (float, "0.5")), ("mask", True, ((2, 4), torch.bool, False)), ("cache", False, (type(None), None))), None)
    assert g._layout([x], {"scale": 0.5, "mask": torch.zeros(2, 4, dtype=torch.bool), "cache": None}) == a  # tensor values: same
    assert g._layout([x], {"mask": mask, "scale": 0.5, "cache": None}) != a  # another order
    assert g._layout([x], {"scale": 0.25, "mask": mask, "cache": None}) != a
    assert g._layout([x], {"flag": True}) != g._layout([x], {"flag": 1})
    assert g._layout([x], {"s": 0.0}) != g._layout([x], {"s": -0.0})
    assert g._layout([x], {"s": float("nan")}) == g._layout([x], {"s": float("nan")})  # (replays: nan is nan)
    assert g._layout([], {"x": x}) is not None  # keyword-only stages too
    for bad in ({"cache": [x]}, {"cache": object()}, {"mask": mask.to("meta")}):
        assert g._layout([x], bad) is None, bad


def test_which_losses_may_be_captured() -> None:
    """cuda_graphs_loss: a function or a module without parameters and buffers; a loss module with a learnable
    temperature or a class-weight buffer stays eager (a replay would neither train nor re-read it)."""
    assert capturable_loss(lambda y, t: (y - t).pow(2).mean())
    assert capturable_loss(nn.CrossEntropyLoss())
    assert not capturable_loss(None)
    assert not capturable_loss(nn.CrossEntropyLoss(weight=torch.ones(4)))  # (a buffer)

    class Tempered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = nn.Parameter(torch.ones(()))

        def forward(self, y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(y / self.t, t)

    assert not capturable_loss(Tempered())


def test_refused_on_cpu_ranks_with_the_reason(tmp_path: Path) -> None:
    import torch.distributed as dist

    import pipeloom
    from harness import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with pytest.raises(pipeloom.PipelineConfigError, match=r"cuda_graphs: not available the stages are not on a CUDA device \(device cpu\)"):
            pipeloom.Pipeline(lambda s: nn.Linear(4, 4), schedule="GPipe", num_microbatches=2, stages_per_rank=2,
                              loss_fn=lambda y, t: ((y - t) ** 2).mean(), options=RuntimeOptions(cuda_graphs=True))
        for kw, why in (({"fsdp": True}, "with fsdp"), ({"data_parallel": 2}, "with data parallelism"),
                        ({"expert_parallel": 2}, "with expert parallelism")):
            with pytest.raises(pipeloom.PipelineConfigError, match=f"rank 0: RuntimeOptions.cuda_graphs: not available {why}"):
                pipeloom.Pipeline(lambda s: nn.Linear(4, 4), schedule="GPipe", num_microbatches=2, stages_per_rank=2,
                                  loss_fn=lambda y, t: ((y - t) ** 2).mean(), options=RuntimeOptions(cuda_graphs=True), **kw)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- GPU: one stage, graphed against eager


class _Stage(nn.Module):
    def __init__(self, dim: int, tied: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = self.a if tied else nn.Linear(dim, dim)  # tied: one parameter used twice
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(self.norm(x)))) + x


def _pair(dim: int = 16, tied: bool = False, slots: int = 2) -> tuple[StageExecutor, StageExecutor]:
    torch.manual_seed(0)
    ref = _Stage(dim, tied).cuda().double()
    got = _Stage(dim, tied).cuda().double()
    got.load_state_dict(ref.state_dict())
    a = StageExecutor(1, ref, is_last=False, loss_fn=None, grad_scale=1.0)
    b = StageExecutor(1, got, is_last=False, loss_fn=None, grad_scale=1.0)
    b.graphs = StageGraphs(1, got, slots, torch.device("cuda", torch.cuda.current_device()))
    return a, b


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _zero_grads(*executors: StageExecutor) -> None:
    for ex in executors:
        ex.module.zero_grad(set_to_none=True)


def _same_grads(ref: nn.Module, got: nn.Module, **tol: float) -> None:
    """Every parameter's accumulated gradient, graphed (``got``) against eager (``ref``)."""
    for (n, p), q in zip(ref.named_parameters(), got.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=n, **tol)


def _run(ex: StageExecutor, order: list[tuple[str, int]], xs: dict[int, torch.Tensor], gs: dict[int, torch.Tensor]) -> dict[int, tuple]:
    out = {}
    for kind, mb in order:
        if kind == "F":
            outs, _, _ = ex.forward(mb, (_leaf(xs[mb]),), {})
            out[mb] = [outs[0].detach().clone()]
        else:
            (gin,) = ex.backward(mb, [gs[mb]])
            out[mb].append(gin.clone())
    return out


@cuda
@pytest.mark.parametrize("tied", [False, True])
def test_graphed_stage_equals_eager_in_a_pipeline_order(tied: bool) -> None:
    ref, got = _pair(tied=tied)
    dev = torch.device("cuda", torch.cuda.current_device())
    xs = {m: torch.randn(3, 16, device=dev, dtype=torch.float64) for m in range(6)}
    gs = {m: torch.randn(3, 16, device=dev, dtype=torch.float64) for m in range(6)}
    warm = [("F", 0), ("B", 0)]
    _run(ref, warm, xs, gs)
    _run(got, warm, xs, gs)  # eager: the layout is noted
    assert got.graphs.wants_capture()
    got.graphs.capture()
    assert len(got.graphs.slots) == 2 and got.graphs.disabled is None
    _zero_grads(ref, got)
    # 1F1B's order on a first stage of two: two alive at most
    order = [("F", 1), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("F", 4), ("B", 3), ("B", 4)]
    want = _run(ref, order, xs, gs)
    have = _run(got, order, xs, gs)
    assert got.graphs.replays == 4
    for m in want:
        torch.testing.assert_close(have[m][0], want[m][0], rtol=1e-12, atol=1e-12)  # outputs
        torch.testing.assert_close(have[m][1], want[m][1], rtol=1e-12, atol=1e-12)  # input gradients
    _same_grads(ref.module, got.module, rtol=1e-12, atol=1e-12)  # accumulated over 4 microbatches


def _last_pair(loss_fn: Any, grad_scale: float, n: int) -> tuple[StageExecutor, StageExecutor, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """A last stage run eagerly and the same stage with graphs (its loss offered to the capture), ``n`` microbatches
    of inputs and class-index targets."""
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    ref_m, got_m = _Stage(16).cuda().double(), _Stage(16).cuda().double()
    got_m.load_state_dict(ref_m.state_dict())
    ref = StageExecutor(1, ref_m, is_last=True, loss_fn=loss_fn, grad_scale=grad_scale)
    got = StageExecutor(1, got_m, is_last=True, loss_fn=loss_fn, grad_scale=grad_scale)
    got.graphs = StageGraphs(1, got_m, 1, dev, loss_fn=loss_fn)
    xs = {m: torch.randn(3, 16, device=dev, dtype=torch.float64) for m in range(n)}
    ts = {m: torch.randint(0, 16, (3,), device=dev) for m in range(n)}
    return ref, got, xs, ts


@cuda
@pytest.mark.parametrize("target", ["ids", "dict"])
def test_the_last_stages_loss_is_captured_with_it(target: str) -> None:
    """The last stage with a tensor target: one replay computes the output and the loss, and the backward starts
    from the loss; losses, input gradients and accumulated parameter gradients equal eager autograd's (a dict
    target keeps the loss eager after a module-only replay, exact alike)."""

    def loss_fn(y: torch.Tensor, t: Any) -> torch.Tensor:
        t = t["ids"] if isinstance(t, dict) else t
        return nn.functional.cross_entropy(y, t) + 0.1 * y.pow(2).mean()

    ref, got, xs, ts = _last_pair(loss_fn, 0.25, 5)
    tgt = (lambda m: ts[m]) if target == "ids" else (lambda m: {"ids": ts[m]})

    def run(ex: StageExecutor, mbs: range) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for mb in mbs:
            x = _leaf(xs[mb])
            _, _, loss = ex.forward(mb, (x,), {}, tgt(mb))
            loss = loss.detach().clone()
            (gin,) = ex.backward(mb, None)
            out[mb] = (loss, gin.clone())
        return out

    run(ref, range(1))
    run(got, range(1))
    assert got.graphs.wants_capture()
    got.graphs.capture()
    assert got.graphs.slots and got.graphs.disabled is None
    assert (got.graphs.slots[0].static_target is not None) == (target == "ids")
    _zero_grads(ref, got)
    want, have = run(ref, range(1, 5)), run(got, range(1, 5))
    assert got.graphs.replays == 4
    for m in want:
        torch.testing.assert_close(have[m][0], want[m][0], rtol=1e-12, atol=1e-12)  # the loss
        torch.testing.assert_close(have[m][1], want[m][1], rtol=1e-12, atol=1e-12)  # the input gradient
    _same_grads(ref.module, got.module, rtol=1e-12, atol=1e-12)


@cuda
def test_a_loss_that_cannot_be_captured_leaves_the_module_captured_alone() -> None:
    """A loss that reads a value on the host (here ``.item()``) cannot be captured: the module is captured alone
    with a warning, and the loss runs eagerly after each replay, exact."""

    def loss_fn(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        n = int(t.numel() - (t < 0).sum().item())  # (a host read)
        return nn.functional.cross_entropy(y, t.clamp(min=0), reduction="sum") / max(n, 1)

    ref, got, xs, ts = _last_pair(loss_fn, 1.0, 4)
    for ex in (ref, got):
        ex.forward(0, (_leaf(xs[0]),), {}, ts[0])
        ex.backward(0, None)
    with pytest.warns(RuntimeWarning, match="its loss is not captured with it"):
        got.graphs.capture()
    assert got.graphs.slots and got.graphs.disabled is None and got.graphs.slots[0].static_target is None
    _zero_grads(ref, got)
    for mb in range(1, 4):
        for ex in (ref, got):
            _, _, loss = ex.forward(mb, (_leaf(xs[mb]),), {}, ts[mb])
            ex.backward(mb, None)
    assert got.graphs.replays == 3
    _same_grads(ref.module, got.module, rtol=1e-12, atol=1e-12)


def _graphed_pair(make: Any, slots: int) -> tuple[StageExecutor, StageExecutor, torch.device]:
    """A middle stage run eagerly and the same stage (same weights, float64, on the GPU) with ``slots`` graph slots."""
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    ref_m, got_m = make().to(dev).double(), make().to(dev).double()
    got_m.load_state_dict(ref_m.state_dict())
    ref = StageExecutor(1, ref_m, is_last=False, loss_fn=None, grad_scale=1.0)
    got = StageExecutor(1, got_m, is_last=False, loss_fn=None, grad_scale=1.0)
    got.graphs = StageGraphs(1, got_m, slots, dev)
    return ref, got, dev


class _MaskedStage(nn.Module):
    """A Hugging Face-style layer: the hidden state positionally, an attention-like mask, a bias tensor that
    needs a gradient and a constant by keyword."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, bias: torch.Tensor, scale: float = 1.0,
                past: Any = None) -> torch.Tensor:
        assert past is None
        h = torch.tanh(self.a(x)) * scale
        return self.b(h.masked_fill(~mask, 0.0)) + bias


@cuda
def test_keyword_tensors_are_graph_inputs_and_constants_part_of_the_layout() -> None:
    """A stage called with keyword arguments (a mask, a tensor that needs a gradient, constants): replayed from
    its graph, equal to eager autograd in float64 (outputs, the gradients of the positional and the keyword
    input, the parameters' accumulated gradients); another constant value runs eagerly, exact too."""
    ref, got, dev = _graphed_pair(lambda: _MaskedStage(16), slots=2)
    xs = {m: torch.randn(3, 16, device=dev, dtype=torch.float64) for m in range(6)}
    gs = {m: torch.randn(3, 16, device=dev, dtype=torch.float64) for m in range(6)}
    masks = {m: torch.rand(3, 16, device=dev) > 0.3 for m in range(6)}
    bias = {ex: torch.zeros(16, device=dev, dtype=torch.float64, requires_grad=True) for ex in ("ref", "got")}

    def run(ex: StageExecutor, which: str, order: list[tuple[str, int]], scale: float = 0.5) -> dict[int, list[torch.Tensor]]:
        out: dict[int, list[torch.Tensor]] = {}
        for kind, mb in order:
            if kind == "F":
                outs, _, _ = ex.forward(mb, (_leaf(xs[mb]),), {"scale": scale, "mask": masks[mb], "bias": bias[which], "past": None})
                out[mb] = [outs[0].detach().clone()]
            else:
                (gin,) = ex.backward(mb, [gs[mb]])
                out[mb].append(gin.clone())
        return out

    run(ref, "ref", [("F", 0), ("B", 0)])
    run(got, "got", [("F", 0), ("B", 0)])
    assert got.graphs.wants_capture()
    got.graphs.capture()
    assert len(got.graphs.slots) == 2 and got.graphs.disabled is None
    _zero_grads(ref, got)
    for t in bias.values():
        t.grad = None
    order = [("F", 1), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    want, have = run(ref, "ref", order), run(got, "got", order)
    assert got.graphs.replays == 3
    for m in want:
        torch.testing.assert_close(have[m][0], want[m][0], rtol=1e-12, atol=1e-12)  # outputs (the mask was read)
        torch.testing.assert_close(have[m][1], want[m][1], rtol=1e-12, atol=1e-12)  # input gradients
    torch.testing.assert_close(bias["got"].grad, bias["ref"].grad, rtol=1e-12, atol=1e-12)  # the keyword tensor's
    _same_grads(ref.module, got.module, rtol=1e-12, atol=1e-12)
    # another constant: eager, and still exact
    want, have = run(ref, "ref", [("F", 4), ("B", 4)], scale=2.0), run(got, "got", [("F", 4), ("B", 4)], scale=2.0)
    assert got.graphs.replays == 3
    torch.testing.assert_close(have[4][1], want[4][1], rtol=1e-12, atol=1e-12)
    _same_grads(ref.module, got.module, rtol=1e-12, atol=1e-12)


class _CatStage(nn.Module):
    """A ``**kwargs`` forward: the keyword tensors' call order is part of what it computes."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(3 * dim, dim)

    def forward(self, x: torch.Tensor, **feats: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.cat([x, *feats.values()], -1))


@cuda
def test_a_kwargs_forward_replays_its_call_order() -> None:
    """Keyword tensors given in an order other than their names' (``b`` before ``a``) to a ``**kwargs`` forward
    that concatenates them: the replay computes what eager autograd does (outputs, gradients of the input, of
    both keyword tensors, of the parameters); the other order is another layout and runs eagerly."""
    ref, got, dev = _graphed_pair(lambda: _CatStage(8), slots=1)

    def run(ex: StageExecutor, mb: int, swap: bool = False) -> list[torch.Tensor]:
        g = torch.Generator(device="cpu").manual_seed(mb)
        x, fa, fb, gout = (torch.randn(2, 8, generator=g, dtype=torch.float64).to(dev) for _ in range(4))
        fa.requires_grad_(True)
        fb.requires_grad_(True)
        feats = {"a": fa, "b": fb} if swap else {"b": fb, "a": fa}
        outs, _, _ = ex.forward(mb, (_leaf(x),), feats)
        (gin,) = ex.backward(mb, [gout])
        return [outs[0].detach().clone(), gin.clone(), fa.grad.clone(), fb.grad.clone()]

    run(ref, 0)
    run(got, 0)
    got.graphs.capture()
    assert got.graphs.slots and got.graphs.disabled is None
    _zero_grads(ref, got)
    for mb in (1, 2):
        for w, h in zip(run(ref, mb), run(got, mb)):
            torch.testing.assert_close(h, w, rtol=1e-12, atol=1e-12)
    assert got.graphs.replays == 2
    for w, h in zip(run(ref, 3, swap=True), run(got, 3, swap=True)):  # the names' order: eager
        torch.testing.assert_close(h, w, rtol=1e-12, atol=1e-12)
    assert got.graphs.replays == 2
    _same_grads(ref.module, got.module, rtol=1e-12, atol=1e-12)


@cuda
def test_a_third_alive_microbatch_runs_eagerly_and_stays_exact() -> None:
    ref, got = _pair(slots=2)
    dev = torch.device("cuda", torch.cuda.current_device())
    xs = {m: torch.randn(3, 16, device=dev, dtype=torch.float64) for m in range(4)}
    gs = {m: torch.randn(3, 16, device=dev, dtype=torch.float64) for m in range(4)}
    _run(got, [("F", 0), ("B", 0)], xs, gs)
    got.graphs.capture()
    _run(ref, [("F", 0), ("B", 0)], xs, gs)
    _zero_grads(ref, got)
    order = [("F", 1), ("F", 2), ("F", 3), ("B", 3), ("B", 1), ("B", 2)]
    want, have = _run(ref, order, xs, gs), _run(got, order, xs, gs)
    assert got.graphs.replays == 2  # the third forward found both slots busy
    for m in want:
        torch.testing.assert_close(have[m][1], want[m][1], rtol=1e-12, atol=1e-12)
    _same_grads(ref.module, got.module, rtol=1e-12, atol=1e-12)


@cuda
def test_another_layout_runs_eagerly_and_moved_parameters_drop_the_graphs() -> None:
    ref, got = _pair()
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(3, 16, device=dev, dtype=torch.float64)
    got.forward(0, (_leaf(x),), {})
    got.backward(0, [torch.ones(3, 16, device=dev, dtype=torch.float64)])
    got.graphs.capture()
    y = torch.randn(5, 16, device=dev, dtype=torch.float64)  # another shape: eager
    got.forward(1, (_leaf(y),), {})
    assert got.graphs.replays == 0
    got.backward(1, [torch.ones(5, 16, device=dev, dtype=torch.float64)])
    got.graphs.start_step()
    assert got.graphs.slots
    got.module.a.weight = nn.Parameter(got.module.a.weight.detach().clone())  # replaced, not updated in place
    got.graphs.start_step()
    assert not got.graphs.slots and not got.graphs.wants_capture()
    got.module.a.weight.requires_grad_(False)  # and a changed trainable set is a new layout too
    got.forward(2, (_leaf(x),), {})
    assert got.graphs.wants_capture()


@cuda
def test_hooks_and_host_syncs_keep_the_stage_eager_with_a_warning() -> None:
    _, got = _pair()
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(3, 16, device=dev, dtype=torch.float64)
    got.module.a.register_forward_hook(lambda m, i, o: None)
    got.forward(0, (_leaf(x),), {})
    with pytest.warns(RuntimeWarning, match="stage 1: not captured as a CUDA graph .*has hooks"):
        got.graphs.capture()
    assert got.graphs.disabled and not got.graphs.slots

    class Syncs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(16, dtype=torch.float64, device=dev))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w if float(x.sum()) > -1e9 else x  # a host read of a value

    m = Syncs()
    ex = StageExecutor(1, m, is_last=False, loss_fn=None, grad_scale=1.0)
    ex.graphs = StageGraphs(1, m, 1, dev)
    ex.forward(0, (_leaf(x),), {})
    with pytest.warns(RuntimeWarning, match="stage 1: not captured as a CUDA graph .*it synchronizes with the host"):
        ex.graphs.capture()
    # and it still runs, eagerly
    outs, _, _ = ex.forward(1, (_leaf(x),), {})
    torch.testing.assert_close(outs[0], x)


def test_only_pipeloom_s_pure_hooks_are_captured_with_the_module() -> None:
    """split_by_fqn's output reducer (marked graph-safe) does not keep a stage eager; any other forward hook or
    pre-hook does, and so does a hook that merely looks like ours (the mark must be True)."""
    from pipeloom.runtime.cuda_graphs import GRAPH_SAFE_HOOK, _foreign_hooks
    from pipeloom.runtime.split import _OutputReducer

    m = nn.Sequential(nn.Linear(2, 2))
    m.register_forward_hook(_OutputReducer(None, 0))
    assert _foreign_hooks(m, set()) is None

    class Fake:
        def __call__(self, *a: Any) -> None:
            return None

    fake = Fake()
    setattr(fake, GRAPH_SAFE_HOOK, "yes")  # (not True)
    h = m[0].register_forward_pre_hook(fake)
    assert "module '0' has hooks" in (_foreign_hooks(m, set()) or "")
    h.remove()
    m.register_forward_hook(lambda mod, i, o: None)
    assert "has hooks" in (_foreign_hooks(m, set()) or "")


def test_process_wide_module_hooks_are_seen() -> None:
    """A hook registered for every module (``register_module_forward_hook`` and its kin: a profiler's, a FLOP
    counter's) runs at every eager call and would be skipped by a replay: it is reported, pipeloom's own are not."""
    from torch.nn.modules import module as mm

    from pipeloom.runtime.cuda_graphs import GRAPH_SAFE_HOOK, _any_global_hooks, _foreign_hooks, _global_hooks

    m = nn.Sequential(nn.Linear(2, 2))
    assert not _any_global_hooks() and _foreign_hooks(m, set()) is None

    def counter(mod: nn.Module, args: Any, out: Any) -> None:
        return None

    for register in (mm.register_module_forward_hook, mm.register_module_forward_pre_hook,
                     mm.register_module_full_backward_hook, mm.register_module_full_backward_pre_hook):
        h = register(counter)  # type: ignore[operator]
        try:
            assert _any_global_hooks()
            why = _foreign_hooks(m, set()) or ""
            assert "process-wide module hook" in why and "counter" in why, why
            assert _global_hooks({id(counter)}) is None  # ours (the executor's recompute note): allowed
        finally:
            h.remove()
    assert not _any_global_hooks()
    setattr(counter, GRAPH_SAFE_HOOK, True)
    h = mm.register_module_forward_hook(counter)
    try:
        assert _global_hooks(set()) is None
    finally:
        h.remove()


@cuda
def test_hooks_registered_after_the_capture_are_run() -> None:
    """A process-wide hook registered after the capture: the stage runs eagerly (the hook sees every call, the
    results stay exact) until it is removed, then replays again; a module hook registered after the capture drops
    the stage's graphs at the next step."""
    from torch.nn.modules import module as mm

    ref, got = _pair()
    dev = torch.device("cuda", torch.cuda.current_device())
    xs = {m: torch.randn(3, 16, device=dev, dtype=torch.float64) for m in range(8)}
    gs = {m: torch.randn(3, 16, device=dev, dtype=torch.float64) for m in range(8)}
    _run(ref, [("F", 0), ("B", 0)], xs, gs)
    _run(got, [("F", 0), ("B", 0)], xs, gs)
    got.graphs.capture()
    assert got.graphs.slots
    _zero_grads(ref, got)
    seen: list[str] = []
    h = mm.register_module_forward_hook(lambda mod, i, o: seen.append(type(mod).__name__))
    try:
        with pytest.warns(RuntimeWarning, match="stage 1: runs eagerly while a process-wide module hook"):
            have = _run(got, [("F", 1), ("B", 1)], xs, gs)
    finally:
        h.remove()
    assert got.graphs.replays == 0 and seen  # eager, and the hook saw the stage's modules
    want = _run(ref, [("F", 1), ("B", 1)], xs, gs)
    torch.testing.assert_close(have[1][0], want[1][0], rtol=1e-12, atol=1e-12)
    got.graphs.start_step()
    n = len(seen)
    _run(got, [("F", 2), ("B", 2)], xs, gs)
    _run(ref, [("F", 2), ("B", 2)], xs, gs)
    assert got.graphs.replays == 1 and len(seen) == n  # replayed again, the hook gone
    got.module.a.register_forward_hook(lambda mod, i, o: seen.append("module hook"))
    with pytest.warns(RuntimeWarning, match="stage 1: not captured as a CUDA graph .*has hooks"):
        got.graphs.start_step()
    assert not got.graphs.slots and got.graphs.disabled
    _run(got, [("F", 3), ("B", 3)], xs, gs)
    _run(ref, [("F", 3), ("B", 3)], xs, gs)
    assert seen[-1] == "module hook" and got.graphs.replays == 1
    _same_grads(ref.module, got.module, rtol=1e-12, atol=1e-12)


def test_a_forward_that_raises_does_not_become_the_captured_layout() -> None:
    """The layout is noted once the eager forward has returned: a step that failed (here a keyword argument the
    stage refuses) leaves nothing to capture, and the next good forward's layout is the one noted."""

    class Refuses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, labels: Any = None) -> torch.Tensor:
            if labels is not None:
                raise ValueError("labels go to the loss, not the stage")
            return self.lin(x)

    m = Refuses()
    ex = StageExecutor(1, m, is_last=False, loss_fn=None, grad_scale=1.0)
    ex.graphs = StageGraphs(1, m, 1, torch.device("cpu"))  # (noting needs no GPU; capturing would)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="labels go to the loss"):
        ex.forward(0, (x,), {"labels": torch.ones(2)})
    assert ex.graphs.layout is None and not ex.graphs.wants_capture()
    ex.forward(1, (x,), {})
    assert ex.graphs.wants_capture()
    assert [name for name, *_ in ex.graphs.layout[1]] == []  # (no keyword in the noted layout)


class _DictOut(nn.Module):
    """A torchtitan-style model (``placeholder=None`` forward) whose forward returns a mapping, so a split stage
    hands its tensor on through split_by_fqn's output reducer (a forward hook)."""

    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.norm is not None:
            x = self.norm(x)
        return {"hidden": x}


def _stage_pair(stage: nn.Module, twin: nn.Module, slots: int) -> tuple[StageExecutor, StageExecutor, torch.device]:
    dev = torch.device("cuda", torch.cuda.current_device())
    ref_m, got_m = stage.to(dev).double(), twin.to(dev).double()
    got_m.load_state_dict(ref_m.state_dict())
    ref = StageExecutor(1, ref_m, is_last=False, loss_fn=None, grad_scale=1.0)
    got = StageExecutor(1, got_m, is_last=False, loss_fn=None, grad_scale=1.0)
    got.graphs = StageGraphs(1, got_m, slots, dev)
    return ref, got, dev


def _same_run(want: dict[int, tuple], have: dict[int, tuple], ref: StageExecutor, got: StageExecutor) -> None:
    """Per microbatch the output and the input gradient, then every parameter's gradient: ``got`` against ``ref``."""
    for m in want:
        torch.testing.assert_close(have[m][0], want[m][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(have[m][1], want[m][1], rtol=1e-12, atol=1e-12)
    _same_grads(ref.module, got.module, rtol=1e-12, atol=1e-12)


def _graphed_equals_eager(ref: StageExecutor, got: StageExecutor, dev: torch.device, shape: tuple[int, ...]) -> None:
    """Warm-up step, capture, then 1F1B's order on two slots: replayed outputs, input and parameter gradients
    equal eager autograd in float64."""
    xs = {m: torch.randn(*shape, device=dev, dtype=torch.float64) for m in range(5)}
    gs = {m: torch.randn(*shape, device=dev, dtype=torch.float64) for m in range(5)}
    _run(ref, [("F", 0), ("B", 0)], xs, gs)
    _run(got, [("F", 0), ("B", 0)], xs, gs)
    assert got.graphs.wants_capture()
    got.graphs.capture()
    assert got.graphs.disabled is None and len(got.graphs.slots) == 2
    _zero_grads(ref, got)
    order = [("F", 1), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("F", 4), ("B", 3), ("B", 4)]
    want, have = _run(ref, order, xs, gs), _run(got, order, xs, gs)
    assert got.graphs.replays == 4
    _same_run(want, have, ref, got)


@cuda
def test_a_split_by_fqn_stage_is_captured_with_its_output_reducer() -> None:
    """Before, every split_by_fqn stage but the last (which carries the output reducer hook) stayed eager under
    cuda_graphs; the reducer is now part of the captured forward, and the replay equals eager."""
    from pipeloom.runtime.split import split_by_fqn

    torch.manual_seed(0)
    fn = split_by_fqn(_DictOut(), [["layers.0", "layers.1"], ["layers.2", "layers.3", "norm"]])
    ref, got, dev = _stage_pair(fn(0), fn(0), slots=2)
    assert got.module._forward_hooks  # (the reducer is there)
    _graphed_equals_eager(ref, got, dev, (3, 16))


@cuda
def test_a_hugging_face_middle_stage_gets_past_the_hooks_and_stays_exact() -> None:
    """A Hugging Face decoder's middle stage from ``stage_fn_for_causal_lm``: its input hook and output reducer no
    longer keep it eager, but transformers' own forward reads a value on the host (5.24: the causal-mask builder
    checks ``position_ids`` for packed sequences with a Python ``if`` on a device tensor), which the eager warm-up
    under ``set_sync_debug_mode("error")`` finds: it stays eager, with that reason, and exact."""
    transformers = pytest.importorskip("transformers")
    from pipeloom.hf import stage_fn_for_causal_lm

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    stage_fn, _ = stage_fn_for_causal_lm(model, num_stages=3, device="cpu")
    ref, got, dev = _stage_pair(stage_fn(1), stage_fn(1), slots=2)
    xs = {m: torch.randn(2, 8, 32, device=dev, dtype=torch.float64) for m in range(3)}
    gs = {m: torch.randn(2, 8, 32, device=dev, dtype=torch.float64) for m in range(3)}
    _run(ref, [("F", 0), ("B", 0)], xs, gs)
    _run(got, [("F", 0), ("B", 0)], xs, gs)
    with pytest.warns(RuntimeWarning, match="stage 1: not captured as a CUDA graph"):
        got.graphs.capture()
    assert got.graphs.disabled and "synchronizes with the host" in got.graphs.disabled, got.graphs.disabled
    assert "hooks" not in got.graphs.disabled
    _zero_grads(ref, got)
    order = [("F", 1), ("F", 2), ("B", 1), ("B", 2)]
    want, have = _run(ref, order, xs, gs), _run(got, order, xs, gs)
    assert got.graphs.replays == 0
    _same_run(want, have, ref, got)


@cuda
def test_a_capture_that_fails_half_way_leaves_the_process_usable() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())

    class LateSync(nn.Module):  # reads a value on the host only from its fourth call: inside the capture
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(16, dtype=torch.float64, device=dev))
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls >= 4:
                torch.cuda.current_stream().synchronize()
            return x * self.w

    m = LateSync()
    ex = StageExecutor(1, m, is_last=False, loss_fn=None, grad_scale=1.0)
    ex.graphs = StageGraphs(1, m, 1, dev)
    x = torch.randn(3, 16, device=dev, dtype=torch.float64)
    ex.forward(0, (_leaf(x),), {})
    with pytest.warns(RuntimeWarning, match="stage 1: not captured as a CUDA graph .*capture failed"):
        ex.graphs.capture()
    assert m.calls == 4 and not ex.graphs.slots
    # random numbers (the generator's capture bookkeeping) and eager work go on
    torch.randn(4, device=dev)
    outs, _, _ = ex.forward(1, (_leaf(x),), {})
    torch.testing.assert_close(outs[0], x)


@cuda
def test_a_stage_that_modifies_its_input_in_place_is_captured_on_copies() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8, dtype=torch.float64, device=dev)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            h.mul_(2.0)
            return self.lin(h)

    torch.manual_seed(0)
    ref_m, m = InPlace(), InPlace()
    m.load_state_dict(ref_m.state_dict())
    ref = StageExecutor(1, ref_m, is_last=False, loss_fn=None, grad_scale=1.0)
    ex = StageExecutor(1, m, is_last=False, loss_fn=None, grad_scale=1.0)
    ex.graphs = StageGraphs(1, m, 1, dev)
    xs = [torch.randn(2, 8, device=dev, dtype=torch.float64) for _ in range(3)]
    g = torch.randn(2, 8, device=dev, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="modifies its input in place"):
        ex.forward(0, (_leaf(xs[0]),), {})
    ex.backward(0, [g])
    ex.graphs.capture()
    assert ex.graphs.slots and ex.graphs.copy_inputs
    with pytest.warns(RuntimeWarning, match="modifies its input in place"):
        ref.forward(0, (_leaf(xs[0]),), {})
    ref.backward(0, [g])
    _zero_grads(ref, ex)
    for mb in (1, 2):
        a, b = ref.forward(mb, (_leaf(xs[mb]),), {})[0][0], ex.forward(mb, (_leaf(xs[mb]),), {})[0][0]
        torch.testing.assert_close(b, a)
        torch.testing.assert_close(ex.backward(mb, [g])[0], ref.backward(mb, [g])[0])
    assert ex.graphs.replays == 2
    _same_grads(ref.module, m)


@cuda
def test_buffers_are_restored_after_capture() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).to(dev)
    ex = StageExecutor(0, m, is_last=False, loss_fn=None, grad_scale=1.0)
    ex.graphs = StageGraphs(0, m, 1, dev)
    x = torch.randn(4, 8, device=dev)
    ex.forward(0, (x,), {})
    before = [b.clone() for b in m.buffers()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ex.graphs.capture()
    for a, b in zip(before, m.buffers()):
        torch.testing.assert_close(a, b)
    # a replay updates the running statistics as the eager forward does
    ref = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).to(dev)
    ref.load_state_dict(m.state_dict())
    ref(x)
    ex.forward(1, (x,), {})
    assert ex.graphs.replays == 1
    torch.testing.assert_close(m[1].running_mean, ref[1].running_mean)


@cuda
def test_a_backward_on_another_thread_keeps_its_slot_until_its_gradients_are_read() -> None:
    # host_overlap_backward: B(k) on the worker while the loop launches the next F of the same stage.  The slot
    # must stay busy until autograd has read the gradients the replay returned (its AccumulateGrad nodes): the
    # next forward replay writes the same memory pool.
    import threading

    torch.manual_seed(1)
    dev = torch.device("cuda", torch.cuda.current_device())
    dim = 512
    ref_m = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)).to(dev)
    m = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)).to(dev)
    m.load_state_dict(ref_m.state_dict())
    ref = StageExecutor(1, ref_m, is_last=False, loss_fn=None, grad_scale=1.0)
    ex = StageExecutor(1, m, is_last=False, loss_fn=None, grad_scale=1.0)
    ex.graphs = StageGraphs(1, m, 1, dev)
    xs = [torch.randn(64, dim, device=dev) for _ in range(12)]
    gs = [torch.randn(64, dim, device=dev) for _ in range(12)]
    ex.forward(0, (_leaf(xs[0]),), {})
    ex.backward(0, [gs[0]])
    ex.graphs.capture()
    slot = ex.graphs.slots[0]
    _zero_grads(ref, ex)
    ex.forward(1, (_leaf(xs[1]),), {})
    for mb in range(1, 11):
        t = threading.Thread(target=ex.backward, args=(mb, [gs[mb]]))
        t.start()
        while slot.busy and t.is_alive():
            pass
        ex.forward(mb + 1, (_leaf(xs[mb + 1]),), {})  # as soon as the slot is free
        t.join()
    ex.backward(11, [gs[11]])
    for mb in range(1, 12):
        ref.forward(mb, (_leaf(xs[mb]),), {})
        ref.backward(mb, [gs[mb]])
    assert ex.graphs.replays == 11
    _same_grads(ref_m, m, rtol=1e-4, atol=1e-4)


@cuda
def test_training_mode_and_a_second_backward() -> None:
    _, got = _pair()
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(3, 16, device=dev, dtype=torch.float64)
    g = torch.ones(3, 16, device=dev, dtype=torch.float64)
    got.forward(0, (_leaf(x),), {})
    got.backward(0, [g])
    got.graphs.capture()
    # a backward through the same replay twice would read the slot after it was released: refused
    out, loss = got.graphs.call((_leaf(x),), {})
    assert loss is None  # (not a last stage)
    torch.autograd.backward([out], [g], retain_graph=True)
    got.graphs.release()
    with pytest.raises(RuntimeError, match="slot was reused"):
        torch.autograd.backward([out], [g])
    # the module switched to eval mode (dropout, batch-norm statistics): the graphs captured in training mode go
    got.graphs.start_step()
    assert got.graphs.slots
    got.module.eval()
    got.graphs.start_step()
    assert not got.graphs.slots
