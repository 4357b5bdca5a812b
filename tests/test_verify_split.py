"""pipeloom.verify_split: a model split by names is checked against the whole model.

Splits whose forward keeps split_by_fqn's contract pass (eval, with a loss
and every gradient, in training with dropout); forwards that do something
outside the modules a stage owns are refused with an error naming what
differs: an embedding scale or a logit soft cap (the output), an embedding
gradient shrink or a frozen embedding written as ``detach()`` in the forward
(only the gradients).  The caller's model, gradients, modes and random state
are left as they were; a stage that raises is named.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeloom import PipelineConfigError, split_by_fqn, verify_split
from pipeloom.runtime.stage import StageExecutor

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from split_worker import TinyLM  # noqa: E402

VOCAB, DIM, LAYERS = 11, 8, 4


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.fc2(torch.relu(self.fc1(h))))


class TitanLM(TinyLM):
    """torchtitan style: a module another stage owns is None, and the forward checks (the split tests' model,
    with blocks that may draw dropout)."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__(VOCAB, DIM, LAYERS, block=lambda: Block(dropout))


class ScaledEmbedLM(TitanLM):
    """Gemma style: the root forward scales the embedding; with pass-throughs, every stage scales again."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) * DIM**0.5
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class SoftCapLM(TitanLM):
    """A logit soft cap in the forward (torchtitan-style None checks elsewhere): every stage caps its output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        return torch.tanh(logits / 2.0) * 2.0


class ShrinkLM(TitanLM):
    """GLM-130B's embedding gradient shrink in the forward: the value is the embedding's, its gradient alpha times.

    With pass-throughs every stage shrinks again: the output is the same, the gradients of every stage before
    the last are shrunk once more per stage after it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h * 0.1 + h.detach() * 0.9
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class FrozenEmbedLM(TitanLM):
    """A frozen embedding written in the forward (``detach()``): on a later stage it cuts the incoming gradient.

    (Written as ``with torch.no_grad(): h = self.embed(x)`` it would be harmless: a pass-through returns the
    tensor it is given, which keeps its gradient.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).detach()
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


SPLITS = {
    2: [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "head"]],
    3: [["embed", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "norm", "head"]],
}


def build(cls: type[TitanLM] = TitanLM, **kw: Any) -> TitanLM:
    torch.manual_seed(0)
    return cls(**kw)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (3, 5), generator=g), torch.randint(0, VOCAB, (3, 5), generator=g)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def chain(stage_fn: Any, n: int, x: torch.Tensor) -> torch.Tensor:
    h = x
    with torch.no_grad():
        for i in range(n):
            h = stage_fn(i).eval()(h)
    return h


def grads_by_name(stage_fn: Any, n: int, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """The chained stages' gradients, run as the runtime runs them (detached boundaries)."""
    stages = [StageExecutor(i, stage_fn(i).eval(), is_last=i == n - 1, loss_fn=lm_loss, grad_scale=1.0) for i in range(n)]
    inputs: tuple = (x,)
    for i, ex in enumerate(stages):
        outs, _, _ = ex.forward(0, inputs, {}, y if i == n - 1 else None)
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in outs)
    g = None
    for ex in reversed(stages):
        g = ex.backward(0, g)
    return {name: p.grad for ex in stages for name, p in ex.module.named_parameters()}


@pytest.mark.parametrize("n", [2, 3])
def test_a_split_that_keeps_the_contract_passes(n: int) -> None:
    model = build()
    stage_fn = split_by_fqn(model, SPLITS[n])
    assert stage_fn.num_stages == n
    # the stages keep the model's parameter names, every one of them on exactly one stage
    names = [name for i in range(n) for name, _ in stage_fn(i).named_parameters()]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())
    x, y = batch()
    verify_split(model, stage_fn, x)
    verify_split(model, stage_fn, x, target=y, loss_fn=lm_loss)
    verify_split(model, stage_fn, x, target=y, loss_fn=lm_loss, num_stages=n)


def test_an_embedding_scale_in_the_forward_is_refused() -> None:
    model = build(ScaledEmbedLM)
    stage_fn = split_by_fqn(model, SPLITS[2], placeholder="identity")
    x, y = batch()
    # not vacuous: the chained stages really compute another model (the scale applied twice)
    with torch.no_grad():
        whole = model.eval()(x)
    off = float((chain(stage_fn, 2, x) - whole).abs().max())
    assert off > 1e-3  # (the final norm undoes much of it; the check allows 1e-5 of the scale)
    with pytest.raises(PipelineConfigError, match=r"stages' output differs .* by up to [0-9.e+-]+ \(its typical size") as info:
        verify_split(model, stage_fn, x)
    assert "outside the modules a stage owns" in str(info.value)
    assert f"{off:.3g}" in str(info.value)
    with pytest.raises(PipelineConfigError, match=r"output differs"):  # with a loss it is the output that names it
        verify_split(model, stage_fn, x, target=y, loss_fn=lm_loss)


def test_a_soft_cap_after_the_head_is_refused() -> None:
    model = build(SoftCapLM)
    stage_fn = split_by_fqn(model, SPLITS[3])
    x, _ = batch()
    with torch.no_grad():
        assert float((chain(stage_fn, 3, x) - model.eval()(x)).abs().max()) > 1e-3
    with pytest.raises(PipelineConfigError, match=r"output differs from the whole model's"):
        verify_split(model, stage_fn, x)


def test_a_difference_in_the_gradients_alone_names_the_parameters() -> None:
    model = build(ShrinkLM)
    stage_fn = split_by_fqn(model, SPLITS[2], placeholder="identity")
    x, y = batch()
    verify_split(model, stage_fn, x)  # the output is the whole model's
    # ... and the gradients really are not: stage 0's are shrunk once more by stage 1
    got = grads_by_name(stage_fn, 2, x, y)
    model.zero_grad()
    lm_loss(model.eval()(x), y).backward()
    want = dict(model.named_parameters())
    torch.testing.assert_close(got["layers.0.fc1.weight"], 0.1 * want["layers.0.fc1.weight"].grad)
    torch.testing.assert_close(got["head.weight"], want["head.weight"].grad)
    model.zero_grad(set_to_none=True)
    with pytest.raises(PipelineConfigError, match=r"outputs and the loss agree, but the gradient of (\d+) parameter") as info:
        verify_split(model, stage_fn, x, target=y, loss_fn=lm_loss)
    msg = str(info.value)
    assert "'layers.0.fc1.weight' (stage 0) differs by up to" in msg  # (the five worst are named)
    assert "and 4 more" in msg
    assert "(stage 1)" not in msg  # the last stage's gradients are right
    # stage 0 holds embed + 2 blocks of 4 tensors each
    assert "gradient of 9 parameter(s)" in msg


def test_a_gradient_cut_on_a_later_stage_names_what_got_none() -> None:
    model = build(FrozenEmbedLM)
    stage_fn = split_by_fqn(model, SPLITS[2], placeholder="identity")
    x, y = batch()
    verify_split(model, stage_fn, x)
    with pytest.raises(PipelineConfigError, match=r"'layers\.[01]\.fc[12]\.(weight|bias)' \(stage 0\) got no gradient, where the whole model's is up to"):
        verify_split(model, stage_fn, x, target=y, loss_fn=lm_loss)


def test_training_mode_with_dropout_draws_alike_and_modes_are_restored() -> None:
    model = build(dropout=0.5).train()
    model.layers[1].eval()  # a mixed state, to be left as it was
    modes = [m.training for m in model.modules()]
    stage_fn = split_by_fqn(model, SPLITS[3])
    x, y = batch()
    verify_split(model, stage_fn, x, train=True)
    verify_split(model, stage_fn, x, target=y, loss_fn=lm_loss, train=True)
    verify_split(model, stage_fn, x, target=y, loss_fn=lm_loss)  # eval mode
    assert [m.training for m in model.modules()] == modes
    # not vacuous: in training the dropout does draw (two draws differ), so passing needs the same seed
    with torch.no_grad():
        assert not torch.equal(model(x), model(x))


def test_the_model_its_gradients_and_the_random_state_are_untouched() -> None:
    model = build(dropout=0.5)
    x, y = batch()
    lm_loss(model(x), y).backward()  # the caller's own gradients, to be kept
    model.head.bias.grad = None  # and a missing one
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    stage_fn = split_by_fqn(model, SPLITS[2])
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    x_before = x.clone()
    verify_split(model, stage_fn, x, target=y, loss_fn=lm_loss, train=True)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(x, x_before)
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), n
    for n, p in model.named_parameters():
        if grads[n] is None:
            assert p.grad is None, n
        else:
            assert torch.equal(p.grad, grads[n]), n


class Unaware(TitanLM):
    """A forward that calls its modules without checking: the stage without ``norm`` fails."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h)) if self.head is not None else self.norm(h)


def test_a_stage_that_raises_is_named() -> None:
    model = build(Unaware)
    stage_fn = split_by_fqn(model, SPLITS[3])
    x, _ = batch()
    with pytest.raises(PipelineConfigError, match=r"stage 0 \(of 3\) raised TypeError in its forward") as info:
        verify_split(model, stage_fn, x)
    assert isinstance(info.value.__cause__, TypeError)


def test_a_stage_fn_holding_its_stages_and_other_weights() -> None:
    """A hand-written stage_fn that hands out the same modules: they are not modified; other weights are refused."""
    model = build()
    split = split_by_fqn(model, SPLITS[2])
    held = [split(0), split(1)]
    stage_fn = held.__getitem__
    x, y = batch()
    with pytest.raises(PipelineConfigError, match=r"no num_stages attribute; pass num_stages="):
        verify_split(model, stage_fn, x)
    verify_split(model, stage_fn, x, target=y, loss_fn=lm_loss, num_stages=2)
    assert all(p.grad is None for m in held for p in m.parameters())
    assert all(m.training for m in held)
    with pytest.raises(PipelineConfigError, match=r"stage 0's 'embed.weight' is not the model's \(other values\)"):
        verify_split(build(), split_by_fqn(TitanLM(), SPLITS[2]), x)


def test_bad_arguments_are_refused() -> None:
    model = build()
    stage_fn = split_by_fqn(model, SPLITS[2])
    x, y = batch()
    with pytest.raises(PipelineConfigError, match="loss_fn and target together"):
        verify_split(model, stage_fn, x, loss_fn=lm_loss)
    with pytest.raises(PipelineConfigError, match="meta device"):
        with torch.device("meta"):
            meta = TitanLM()
        verify_split(meta, stage_fn, x)


# ---------------------------------------------------------------- the review's cases (session Q)


class _Adapter(nn.Module):
    """Zero-initialised (LoRA-style): adds nothing at first, so outputs and loss agree without it."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Linear(DIM, DIM, bias=False)
        self.up = nn.Linear(DIM, DIM, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(h))


class _AdapterLM(TitanLM):
    def __init__(self) -> None:
        super().__init__()
        self.adapter = _Adapter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h)
        if self.adapter is not None:
            h = h + self.adapter(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


def test_a_trained_parameter_that_no_stage_holds_is_refused() -> None:
    """A module left to no stage (allow_unassigned=True) whose gradient in the whole model is not zero: outputs and
    loss agree (it adds zero at initialisation), but the pipeline would never train it."""
    model = build(_AdapterLM)
    stage_fn = split_by_fqn(model, SPLITS[2], allow_unassigned=True)
    x, y = batch()
    verify_split(model, stage_fn, x)  # (the outputs agree: not what differs)
    with pytest.raises(PipelineConfigError, match=r"'adapter.up.weight' is held by no stage"):
        verify_split(model, stage_fn, x, target=y, loss_fn=lm_loss)


class _Result:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class _OpaqueLM(TitanLM):
    def forward(self, x: torch.Tensor) -> Any:
        out = super().forward(x)
        return _Result(out) if self.head is not None else out


def test_an_output_with_no_tensor_to_compare_is_refused_not_passed() -> None:
    model = build(_OpaqueLM)
    stage_fn = split_by_fqn(model, SPLITS[2])
    x, _ = batch()
    with pytest.raises(PipelineConfigError, match=r"no tensor that verify_split can find"):
        verify_split(model, stage_fn, x)


class _OffsetNet(nn.Module):
    """A root-forward offset (repeated on every stage) beside one huge output column."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, DIM)
        with torch.no_grad():
            self.head.bias[0] = 1e5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + 0.5
        h = self.a(h) if self.a is not None else h
        return self.head(h) if self.head is not None else h


def test_one_large_value_does_not_loosen_the_others() -> None:
    torch.manual_seed(0)
    model = _OffsetNet()
    x = torch.randn(4, DIM)
    stage_fn = split_by_fqn(model, [["a"], ["head"]])
    with torch.no_grad():
        off = float((model(x) - model.head(model.a(x + 0.5) + 0.5))[:, 1:].abs().max())
    assert off > 1e-2  # (the split's real error on the ordinary columns)
    with pytest.raises(PipelineConfigError, match=r"output differs"):
        verify_split(model, stage_fn, x)


def test_a_model_that_is_not_finite_on_the_input_cannot_be_checked() -> None:
    model = build()
    stage_fn = split_by_fqn(model, SPLITS[2])
    x, _ = batch()
    with torch.no_grad():
        model.head.bias[0] = float("nan")
    with pytest.raises(PipelineConfigError, match=r"NaN or infinite"):
        verify_split(model, stage_fn, x)


class _TiedEnds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(self.embed(x))) @ self.embed.weight.t()


class _First(nn.Module):
    def __init__(self, embed: nn.Embedding, mid: nn.Linear) -> None:
        super().__init__()
        self.embed, self.mid = embed, mid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(self.embed(x)))


class _Last(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.embed.weight.t()


def test_a_weight_two_hand_written_stages_share_stays_shared() -> None:
    """A hand-written stage_fn whose first and last stage share the embedding (tied weights on a V schedule's ends):
    the stages are copied together, so the tie survives and the split, which is right, passes; an untied copy
    (each stage with its own) is refused for the gradient the pipeline would then split between two copies."""
    torch.manual_seed(0)
    model = _TiedEnds()
    x, y = batch()
    first, last = _First(model.embed, model.mid), _Last(model.embed)

    def stage_fn(i: int) -> nn.Module:
        return (first, last)[i]

    verify_split(model, stage_fn, x, target=y, loss_fn=lm_loss, num_stages=2)
    untied = (_First(model.embed, model.mid), _Last(copy.deepcopy(model.embed)))
    with pytest.raises(PipelineConfigError, match=r"embed.weight"):
        verify_split(model, lambda i: untied[i], x, target=y, loss_fn=lm_loss, num_stages=2)
