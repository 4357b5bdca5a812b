"""split_by_fqn and stage_fn_from_pipe: stages that compose to the unsplit model.

In one process: stages built by name, run one after another, give the full
model's output and gradients (float64, so the tolerance is tight), keep its
parameter names, and are independent copies; meta-device models are
materialised; every wrong split is refused with an error naming the stage and
the name.  Torch's tracer: chained stage modules of a traced MLP equal the
MLP.  Then one real 2-rank run: ``Pipeline`` over a ``split_by_fqn`` stage_fn
gives the full model's gradients.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import warnings
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import spawn_ranks  # noqa: E402
from split_worker import SkipNet, TinyLM, build_model, build_skipnet, lm_loss, make_batch, make_skip_batch, traced_skipnet  # noqa: E402

from pipeloom import PipelineConfigError, split_by_fqn, split_by_tracing, stage_fn_from_pipe  # noqa: E402
from pipeloom.runtime.split import PassThrough  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-12)

SPLITS = {
    "two": [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "head"]],
    "three": [["embed"], ["layers.0", "layers.1", "layers.2"], ["layers.3", "norm", "head"]],
    "four-uneven": [["embed", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "head"]],
}


def _chain(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    h = x
    for st in stages:
        h = st(h)
    return h


def _grads(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for m in modules:
        for n, p in m.named_parameters():
            assert n not in out, f"{n} held by two stages"
            out[n] = p.grad
    return out


@pytest.mark.parametrize("split", ["two", "three", "four-uneven"])
def test_stages_compose_to_full_model(split: str) -> None:
    model = build_model()
    stage_fn = split_by_fqn(model, SPLITS[split])
    stages = [stage_fn(i) for i in range(len(SPLITS[split]))]
    x, y = make_batch()

    ref = model(x)
    lm_loss(ref, y).backward()
    out = _chain(stages, x)
    lm_loss(out, y).backward()

    torch.testing.assert_close(out, ref, **TOL)
    want = {n: p.grad for n, p in model.named_parameters()}
    got = _grads(stages)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")


def test_state_dict_keys_are_the_full_models() -> None:
    model = build_model()
    stage_fn = split_by_fqn(model, SPLITS["three"])
    keys = [set(stage_fn(i).state_dict()) for i in range(3)]
    assert set().union(*keys) == set(model.state_dict())
    assert sum(len(k) for k in keys) == len(model.state_dict())
    assert "layers.3.qkv.weight" in keys[2] and "layers.0.qkv.weight" in keys[1]
    # A full checkpoint loads into a stage by its own names.
    full = model.state_dict()
    st = stage_fn(1)
    st.load_state_dict({k: full[k] for k in st.state_dict()})


def test_split_below_a_block_keeps_names_and_gradients() -> None:
    """Names may go below a layer: parts of one block on two stages."""

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.blk = nn.ModuleDict({"p": nn.Linear(4, 4), "q": nn.Linear(4, 4)})
            self.b = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x) if self.a is not None else x
            for m in self.blk.values():
                h = torch.tanh(m(h))
            return self.b(h) if self.b is not None else h

    torch.manual_seed(0)
    model = Wide().double()
    stage_fn = split_by_fqn(model, [["a", "blk.p"], ["blk.q", "b"]])
    s0, s1 = stage_fn(0), stage_fn(1)
    assert list(s0.blk.keys()) == ["p"] and s0.b is None
    assert list(s1.blk.keys()) == ["q"] and s1.a is None
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(s1(s0(x)), model(x), **TOL)


def test_stages_are_independent_copies() -> None:
    model = build_model()
    stage_fn = split_by_fqn(model, SPLITS["two"])
    a, b = stage_fn(0), stage_fn(0)
    with torch.no_grad():
        a.embed.weight.add_(1.0)
    assert not torch.equal(a.embed.weight, model.embed.weight)
    assert torch.equal(b.embed.weight, model.embed.weight)
    # The model itself is untouched.
    assert model.head is not None and len(model.layers) == 4


def test_split_module_list_keeps_original_indices() -> None:
    stage = split_by_fqn(build_model(), SPLITS["two"])(1)
    assert stage.embed is None
    assert len(stage.layers) == 2
    assert [n for n, _ in stage.layers.named_children()] == ["2", "3"]
    assert stage.layers[3] is list(stage.layers)[1]
    with pytest.raises(KeyError, match="not on this pipeline stage"):
        stage.layers[0]


def test_factory_builds_each_stage_fresh() -> None:
    calls = []

    def factory() -> TinyLM:
        calls.append(1)
        return build_model()

    stage_fn = split_by_fqn(factory, SPLITS["two"])
    assert len(calls) == 1  # built once to check the names
    s0, s1 = stage_fn(0), stage_fn(1)
    assert len(calls) == 2  # the checking instance became stage 0
    x, _ = make_batch()
    torch.testing.assert_close(s1(s0(x)), build_model()(x), **TOL)


class _Inited(TinyLM):
    """A TinyLM with a root buffer and torchtitan-style init_weights (tolerating missing modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((1,), 2.0))
        self.init_calls = 0

    def init_weights(self) -> None:
        self.init_calls += 1
        self.scale.fill_(2.0)
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()


def test_meta_model_is_materialised_with_init_weights() -> None:
    with torch.device("meta"):
        model = _Inited()
    stage_fn = split_by_fqn(model, SPLITS["two"], device="cpu")
    stages = [stage_fn(0), stage_fn(1)]
    for st in stages:
        assert st.init_calls == 1
        assert all(not t.is_meta for t in (*st.parameters(), *st.buffers()))
        assert st.scale.item() == 2.0  # the root buffer is on every stage, initialised
    x, _ = make_batch()
    out = stages[1](stages[0](x))
    assert out.shape == (8, 6, 13) and torch.isfinite(out).all()
    assert all(p.is_meta for p in model.parameters())  # the template stays on meta


def test_meta_model_is_materialised_with_reset_parameters() -> None:
    with torch.device("meta"):
        model = TinyLM()
    stage = split_by_fqn(model, SPLITS["three"])(2)
    assert all(p.device.type == "cpu" for p in stage.parameters())
    # LayerNorm.reset_parameters sets ones: proof that initialisation ran.
    assert torch.equal(stage.norm.weight, torch.ones(8))


def test_meta_model_without_initialiser_is_refused() -> None:
    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x * self.w)

    with torch.device("meta"):
        model = Raw()
    with pytest.raises(PipelineConfigError, match="nothing can initialise"):
        split_by_fqn(model, [["w", "lin"]])(0)


@pytest.mark.parametrize(
    ("fqns", "match"),
    [
        ([["embed", "layers.0"], ["layers.9", "norm", "head"]], r"stage 1: 'layers.9' is not a module.*has no '9'"),
        ([["embed", "layers.0.attn"], ["layers.1", "norm", "head"]], r"stage 0: 'layers.0.attn'"),
        ([["embedding"], ["layers", "norm", "head"]], r"stage 0: 'embedding'"),
        ([["embed", "layers.0"], ["layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"]],
         r"'layers.0' is kept by stage 0 and by stage 1"),
        ([["embed", "layers"], ["layers.2", "norm", "head"]], r"'layers.2' \(inside 'layers'\) is kept by stage 0 and by stage 1"),
        ([["embed", "layers"], ["norm"]], r"no stage holds 2 parameter\(s\).*head.weight"),
        ([["embed", "layers"], []], r"stage 1 keeps no module"),
        (["embed", "layers"], r"stage 0: expected a list of module names"),
        ([["embed", ""], ["layers", "norm", "head"]], r"stage 0: '' is not a fully-qualified"),
    ],
)
def test_bad_splits_are_refused_up_front(fqns: list, match: str) -> None:
    with pytest.raises(PipelineConfigError, match=match):
        split_by_fqn(build_model(), fqns)


def test_unassigned_parameters_may_be_dropped() -> None:
    stage_fn = split_by_fqn(build_model(), [["embed", "layers"], ["norm"]], allow_unassigned=True)
    assert stage_fn(1).head is None


def test_tied_weights_across_stages_are_refused() -> None:
    model = build_model()
    model.head.weight = model.embed.weight
    with pytest.raises(PipelineConfigError, match="shared by several stages.*'embed.weight' on stage 0.*'head.weight' on stage 1"):
        split_by_fqn(model, SPLITS["two"])
    # Tied within one stage is fine, and stays tied in the copy.
    st = split_by_fqn(model, [["embed", "layers", "norm", "head"]])(0)
    assert st.head.weight is st.embed.weight


def test_stage_index_beyond_the_split_is_an_error() -> None:
    stage_fn = split_by_fqn(build_model(), SPLITS["two"])
    assert stage_fn.num_stages == 2  # type: ignore[attr-defined]
    with pytest.raises(PipelineConfigError, match=r"stage 2 was asked for.*2 stages"):
        stage_fn(2)
    with pytest.raises(PipelineConfigError, match="stage -1"):
        stage_fn(-1)


class _Rotary(nn.Module):
    """Buffers only, like a rotary embedding: a table every stage's layers read."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0.5, 1.5, dim, dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.table.expand_as(h)


@dataclasses.dataclass
class _Out:
    loss: torch.Tensor | None
    hidden: torch.Tensor
    aux: torch.Tensor


class _Unaware(nn.Module):
    """A forward written for the whole model (no None checks), returning a dataclass."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, dim)
        self.rot = _Rotary(dim)
        self.act = nn.GELU()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))
        self.head = nn.Linear(dim, 11)

    def forward(self, x: torch.Tensor) -> _Out:
        h = self.embed(x)
        for layer in self.layers:
            h = self.act(layer(h * self.rot(h)))
        return _Out(loss=None, hidden=self.head(h), aux=h.sum())


def test_identity_placeholders_run_an_unmodified_forward() -> None:
    torch.manual_seed(0)
    model = _Unaware().double()
    x = torch.randint(0, 11, (3, 5))
    fqns = [["embed", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "head"]]
    stage_fn = split_by_fqn(model, fqns, placeholder="identity")
    stages = [stage_fn(i) for i in range(3)]
    s1 = stages[1]
    assert isinstance(s1.embed, PassThrough) and "stage 0" in repr(s1.embed)
    assert isinstance(s1.head, PassThrough) and "stage 2" in repr(s1.head)
    # Modules without parameters that nobody names are on every stage, copies.
    assert all(isinstance(s.rot, _Rotary) and isinstance(s.act, nn.GELU) for s in stages)
    assert stages[0].rot.table is not stages[1].rot.table
    # Stages 0 and 1 hand on the first tensor field of their dataclass (loss is None): hidden.
    # The last stage's output reaches the loss as the forward returned it.
    assert isinstance(stages[1](stages[0](x)), torch.Tensor)
    last = _chain(stages, x)
    assert isinstance(last, _Out)
    out, ref = last.hidden, model(x).hidden
    torch.testing.assert_close(out, ref, **TOL)
    ref.sum().backward()
    out.sum().backward()
    got = _grads(stages)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, **TOL)
    # output_field picks another field; a missing one is named.
    picked = split_by_fqn(model, fqns, placeholder="identity", output_field="aux")(2)
    assert picked(torch.randn(3, 5, 6, dtype=torch.float64)).dim() == 0
    with pytest.raises(TypeError, match=r"stage 2: the stage's _Out has no field 'nope' \(fields set: loss, hidden, aux\)"):
        split_by_fqn(model, fqns, placeholder="identity", output_field="nope")(2)(torch.randn(3, 5, 6, dtype=torch.float64))


def test_placeholder_default_is_none_for_plain_models_and_validated() -> None:
    stage_fn = split_by_fqn(_Unaware(), [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]])
    assert stage_fn.placeholder is None and stage_fn(1).embed is None  # type: ignore[attr-defined]
    with pytest.raises(PipelineConfigError, match="placeholder must be 'auto', 'identity' or None"):
        split_by_fqn(_Unaware(), [["embed", "layers", "head"]], placeholder="skip")  # type: ignore[arg-type]


def test_passthrough_hands_on_keywords_or_says_why_not() -> None:
    p = PassThrough("model.norm", "stage 3")
    t = torch.ones(2)
    assert p(t, 5) is t and p(hidden_states=t, flag=True) is t
    with pytest.raises(TypeError, match=r"model.norm is not on this pipeline stage \(stage 3 owns it\)"):
        p(flag=True)


def test_buffer_only_modules_may_be_named_by_several_stages() -> None:
    model = _Unaware()
    stage_fn = split_by_fqn(model, [["embed", "rot", "layers.0", "layers.1"], ["rot", "layers.2", "layers.3", "head"]])
    assert stage_fn(0).rot is not None and stage_fn(1).rot is not None
    # Named by stage 0 only: stage 1 drops it (the user's choice), no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert split_by_fqn(model, [["embed", "rot", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]])(1).rot is None
    # A module with parameters still belongs to one stage.
    with pytest.raises(PipelineConfigError, match="'layers.0' is kept by stage 0 and by stage 1"):
        split_by_fqn(model, [["embed", "layers.0", "layers.1"], ["layers.0", "layers.2", "layers.3", "head"]])


def test_dropping_a_module_with_buffers_warns() -> None:
    class WithNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.bn = nn.BatchNorm1d(3)  # parameters and running-stat buffers
            self.seq = nn.Sequential(nn.Linear(3, 3), _Rotary(3), nn.Linear(3, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not run
            return x

    with pytest.warns(UserWarning, match=r"no stage keeps 'bn' \(BatchNorm1d with buffers running_mean"):
        split_by_fqn(WithNorm(), [["lin"], ["seq"]], allow_unassigned=True)
    # A buffer-only entry of a split container that no stage names: dropped everywhere, named.
    with pytest.warns(UserWarning, match=r"no stage keeps 'seq.1' \(_Rotary with buffers table\)"):
        split_by_fqn(WithNorm(), [["lin", "bn", "seq.0"], ["seq.2"]])


# ---------------------------------------------------------------- torch's tracer


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in (self.l0, self.l1, self.l2):
            x = torch.relu(lin(x))
        return self.l3(x)


def test_stage_fn_from_pipe_chains_to_the_traced_model() -> None:
    from torch.distributed.pipelining import SplitPoint, pipeline

    torch.manual_seed(0)
    model = _MLP().double()
    x = torch.randn(2, 4, dtype=torch.float64)
    pipe = pipeline(model, mb_args=(x,), split_spec={"l1": SplitPoint.BEGINNING, "l3": SplitPoint.BEGINNING})
    stage_fn = stage_fn_from_pipe(pipe)
    assert stage_fn.num_stages == 3  # type: ignore[attr-defined]
    stages = [stage_fn(i) for i in range(3)]
    xs = torch.randn(5, 4, dtype=torch.float64)  # the stages take other batch sizes too
    torch.testing.assert_close(_chain(stages, xs), model(xs), **TOL)
    assert [n for n, _ in stages[1].named_parameters()] == ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    with pytest.raises(PipelineConfigError, match=r"stage 3 was asked for.*3 stages"):
        stage_fn(3)


def test_traced_skip_edges_are_routed_with_their_gradients() -> None:
    """SkipNet cut in 4: h0 and gate from stage 0 are read by stages 1..3, carried through 1 and 2."""
    stage_fn = traced_skipnet(2)
    edges = stage_fn.skip_edges  # type: ignore[attr-defined]
    assert len(edges) == 4, edges
    for through in (1, 2):
        for name in ("'tanh'", "'sigmoid'"):  # h0 and the gate, by their names in the traced graph
            assert any(e.startswith(name) and f"of stage 0) carried through stage {through} (read up to stage 3)" in e for e in edges), edges
    stages = [stage_fn(i) for i in range(4)]
    assert [n for n, _ in stages[0].named_parameters()] == ["inp.weight", "inp.bias"]  # the model's own names
    model = build_skipnet()
    x, y = make_skip_batch(batch=2)
    ref = model(x)
    nn.functional.cross_entropy(ref, y).backward()
    # As the runtime runs them: each stage's inputs are leaves; gradients flow back stage by stage.
    ins, outs = [], []
    h: tuple = (x,)
    for st in stages:
        leaves = tuple(t.detach().requires_grad_(t.requires_grad) for t in h)
        out = st(*leaves)
        ins.append(leaves)
        outs.append(out if isinstance(out, tuple) else (out,))
        h = outs[-1]
    torch.testing.assert_close(outs[-1][0], ref, **TOL)
    grads: tuple = (None,)
    for i in reversed(range(4)):
        if i == 3:
            nn.functional.cross_entropy(outs[3][0], y).backward()
        else:
            pairs = [(o, g) for o, g in zip(outs[i], grads) if g is not None and o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(t.grad if t.requires_grad else None for t in ins[i])
    got = {n: p.grad for st in stages for n, p in st.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, **TOL, msg=lambda m, n=n: f"{n}: {m}")
    # Called again, stage_fn does not stack a second set of routing hooks.
    assert len(stage_fn(1)._forward_hooks) == 1


def test_failed_trace_names_the_cause() -> None:
    from torch.distributed.pipelining import SplitPoint

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if h.sum() > 0:  # data-dependent control flow: export cannot capture it
                h = -h
            return self.b(h)

    model = Branchy()
    with pytest.raises(PipelineConfigError, match=r"pipeline\(\)\) failed on Branchy: .*\nFix: the forward branches on tensor values") as info:
        split_by_tracing(model, example_args=(torch.randn(2, 3),), split_spec={"b": SplitPoint.BEGINNING})
    assert info.value.__cause__ is not None
    assert "forward" not in model.b.__dict__  # torch's patch of the split point is undone
    with pytest.raises(PipelineConfigError, match="split_spec names 'c'"):
        split_by_tracing(model, example_args=(torch.randn(2, 3),), split_spec={"c": SplitPoint.BEGINNING})


def test_stage_fn_from_pipe_rejects_other_objects() -> None:
    with pytest.raises(PipelineConfigError, match="needs a torch.distributed.pipelining Pipe"):
        stage_fn_from_pipe(_MLP())


# ---------------------------------------------------------------- real ranks

RANK_CASES = [
    dict(id="1F1B", schedule="1F1B", microbatches=4, fqns=SPLITS["two"]),
    dict(id="ZBV", schedule="ZBVZeroBubble", microbatches=4, fqns=SPLITS["four-uneven"]),
]
TRACED_CASES = [  # SkipNet through torch's tracer: 4 stages with skip edges on 2 ranks
    dict(id="traced-ZBV", schedule="ZBVZeroBubble", microbatches=4, traced=True),
    dict(id="traced-Interleaved1F1B", schedule="Interleaved1F1B", microbatches=4, traced=True),
]


async def test_pipeline_over_split_stages_matches_full_model(tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"out": str(tmp_path), "cases": RANK_CASES + TRACED_CASES}))
    worker = Path(__file__).parent / "ranks" / "split_worker.py"
    codes, _, errs = await spawn_ranks(2, [str(worker), str(job)], timeout=60)
    assert codes == [0, 0], "\n".join(f"--- rank {r} ---\n{e[-3000:]}" for r, e in enumerate(errs))

    model = build_model()
    x, y = make_batch()
    for case in RANK_CASES:
        model.zero_grad(set_to_none=True)
        n = case["microbatches"]
        ref_losses = []
        for xm, ym in zip(x.tensor_split(n), y.tensor_split(n)):
            loss = lm_loss(model(xm), ym)
            (loss / n).backward()
            ref_losses.append(loss.detach())
        ranks = [torch.load(tmp_path / f"{case['id']}-rank{r}.pt") for r in range(2)]
        got = {**ranks[0]["grads"], **ranks[1]["grads"]}
        assert set(ranks[0]["params"]).isdisjoint(ranks[1]["params"])
        assert got.keys() == {n for n, _ in model.named_parameters()}, case["id"]
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[name], p.grad, **TOL, msg=lambda m, k=name: f"{case['id']} {k}: {m}")
        last = ranks[1] if case["schedule"] == "1F1B" else ranks[0]  # ZBV: rank 0 holds the last stage
        torch.testing.assert_close(torch.stack(last["losses"]), torch.stack(ref_losses), **TOL)

    skip = build_skipnet()
    x, y = make_skip_batch()
    for case in TRACED_CASES:
        skip.zero_grad(set_to_none=True)
        n = case["microbatches"]
        for xm, ym in zip(x.tensor_split(n), y.tensor_split(n)):
            (nn.functional.cross_entropy(skip(xm), ym) / n).backward()
        ranks = [torch.load(tmp_path / f"{case['id']}-rank{r}.pt") for r in range(2)]
        got = {**ranks[0]["grads"], **ranks[1]["grads"]}
        assert got.keys() == {n for n, _ in skip.named_parameters()}, case["id"]
        for name, p in skip.named_parameters():
            torch.testing.assert_close(got[name], p.grad, **TOL, msg=lambda m, k=name: f"{case['id']} {k}: {m}")


class _TiedEnds(nn.Module):
    """An embedding-like input layer whose weight the head reuses, and a middle layer."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.emb, self.mid = nn.Linear(4, 4), nn.Linear(4, 4, bias=False), nn.Linear(4, 4)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(self.pre(x))))


def test_split_by_tracing_refuses_a_tie_whose_uses_land_in_two_stages() -> None:
    """torch's tracer copies a parameter used by several stages (stage 0 got ``emb.weight``, stage 1 its own
    ``head.weight``, other tensors): the stages trained two copies of one weight apart, silently (a 2-rank job's
    gradients were off by 0.16 and 0.11).  Refused at the split, naming the tie and the stages; a tie whose uses
    stay in one stage (the tracer keeps one tensor there) and a frozen tie are split as before."""
    from torch.distributed.pipelining import SplitPoint

    model = _TiedEnds()
    x = torch.randn(2, 4)
    with pytest.raises(PipelineConfigError, match=r"_TiedEnds's weight tied as emb.weight, head.weight is used by 2 stages "
                                                   r"of the traced split \(stage 0: emb.weight.*; stage 1: head.weight\)"):
        split_by_tracing(model, example_args=(x,), split_spec={"mid": SplitPoint.BEGINNING})
    # the tie's uses in one stage: one tensor there, and its gradient is the whole model's
    stage_fn = split_by_tracing(model, example_args=(x,), split_spec={"emb": SplitPoint.BEGINNING})
    s0, s1 = stage_fn(0), stage_fn(1)
    params = dict(s1.named_parameters(remove_duplicate=False))
    assert params["emb.weight"] is params["head.weight"]
    s1(s0(x)).sum().backward()
    want = _TiedEnds()
    want.load_state_dict(model.state_dict())
    want(x).sum().backward()
    torch.testing.assert_close(params["emb.weight"].grad, want.emb.weight.grad)
    # frozen: the copies get no gradient and cannot drift apart
    frozen = _TiedEnds()
    frozen.emb.weight.requires_grad_(False)
    split_by_tracing(frozen, example_args=(x,), split_spec={"mid": SplitPoint.BEGINNING})


class _ScaledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.scale) * self.scale


def test_a_parameter_the_traced_split_uses_in_two_stages_is_refused() -> None:
    """``self.scale`` used before and after the split point: torch's tracer copies it into both stages under its
    own name, and the copies were trained apart, silently.  Refused by ``split_by_tracing`` and by
    ``stage_fn_from_pipe`` over a pipe the user traced."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    x = torch.randn(2, 4)
    want = r"the traced split holds 1 trainable parameter\(s\) in more than one stage: scale \(stages 0, 1\)"
    with pytest.raises(PipelineConfigError, match=want):
        split_by_tracing(_ScaledTwice(), example_args=(x,), split_spec={"b": SplitPoint.BEGINNING})
    with pytest.raises(PipelineConfigError, match=want):
        stage_fn_from_pipe(pipeline(_ScaledTwice(), mb_args=(x,), split_spec={"b": SplitPoint.BEGINNING}))
    frozen = _ScaledTwice()
    frozen.scale.requires_grad_(False)  # (no gradient: the copies stay equal)
    split_by_tracing(frozen, example_args=(x,), split_spec={"b": SplitPoint.BEGINNING})
