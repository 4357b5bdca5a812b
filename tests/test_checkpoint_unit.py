"""Checkpoints in one process (a 1-rank gloo group): keys, atomicity, extra state, RNG, asynchronous save.

``save_checkpoint``/``load_checkpoint`` only need ``pipe.stages``, so these
tests hand them stages built by ``split_by_fqn`` directly; the multi-rank
layouts are in tests/test_checkpoint.py.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import free_port  # noqa: E402
from net import build_net, fqns, make_optimizer  # noqa: E402

import pipeloom  # noqa: E402
from pipeloom.runtime.checkpoint import MARKER, latest_checkpoint, list_checkpoints  # noqa: E402

CFG = dict(dim=4, layers=4, batch=8)


@pytest.fixture(scope="module", autouse=True)
def group() -> Any:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    pipeloom.wait_checkpoints()
    dist.destroy_process_group()


def _pipe(stages: int = 2, seed: int = 0) -> Any:
    split = pipeloom.split_by_fqn(build_net(dict(CFG, seed=seed)), fqns(4, stages))
    return SimpleNamespace(stages={s: split(s) for s in range(stages)})


def _train(pipe: Any, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        h = torch.randn(8, 4, generator=g, dtype=torch.float64)
        for s in sorted(pipe.stages):
            h = pipe.stages[s](h)
        h.pow(2).mean().backward()
        opt.step()


def _state(pipe: Any) -> dict[str, torch.Tensor]:
    return {f"{s}:{n}": t.detach().clone() for s, m in pipe.stages.items() for n, t in m.state_dict().items()}


def _params(pipe: Any) -> list[torch.Tensor]:
    return [p for m in pipe.stages.values() for p in m.parameters()]


def test_roundtrip_under_other_stage_count_with_optimizer_extra_and_rng(tmp_path: Path) -> None:
    a = _pipe(2)
    opt = make_optimizer(_params(a), {})
    _train(a, opt)
    with torch.no_grad():  # a buffer every split stage keeps: saved once, restored on every stage
        for m in a.stages.values():
            m.offset.add_(1.0)
    torch.manual_seed(123)
    random.seed(7)
    want_rand = (torch.rand(3), random.random())
    torch.manual_seed(123)
    random.seed(7)
    done = pipeloom.save_checkpoint(tmp_path, a, opt, step=2, extra={"epoch": 1, "pos": [3, 4]})
    assert done.done() and done.path == tmp_path / "step-00000002" and (done.path / MARKER).is_file()
    torch.manual_seed(999)
    random.seed(0)

    b = _pipe(4, seed=1)  # other weights, four stages instead of two
    opt_b = make_optimizer(_params(b), {})
    info = pipeloom.load_checkpoint(tmp_path, b, opt_b)
    assert info is not None and info.step == 2 and info.extra == {"epoch": 1, "pos": [3, 4]} and info.rng_restored
    assert (torch.rand(3), random.random())[1] == want_rand[1]
    full_a = {n: t for m in a.stages.values() for n, t in m.state_dict().items()}
    full_b = {n: t for m in b.stages.values() for n, t in m.state_dict().items()}
    assert full_a.keys() == full_b.keys()
    for n in full_a:
        assert torch.equal(full_a[n], full_b[n]), n
    for m in b.stages.values():
        assert torch.equal(m.offset, a.stages[0].offset) and m.offset[0] == 1.0
    # the optimizer state follows the parameters by name
    names_a = {id(p): n for m in a.stages.values() for n, p in m.named_parameters()}
    names_b = {id(p): n for m in b.stages.values() for n, p in m.named_parameters()}
    sa = {names_a[id(p)]: st for p, st in opt.state.items()}
    sb = {names_b[id(p)]: st for p, st in opt_b.state.items()}
    assert sa.keys() == sb.keys() and len(sa) == 12
    for n in sa:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[n][k], sb[n][k]), (n, k)
    # and training on from either gives the same parameters, bit for bit
    _train(a, opt, 1)
    _train(b, opt_b, 1)
    pa = {n: p for m in a.stages.values() for n, p in m.named_parameters()}
    pb = {n: p for m in b.stages.values() for n, p in m.named_parameters()}
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_a_checkpoint_cut_by_a_crash_is_never_loaded(tmp_path: Path) -> None:
    a = _pipe(2)
    opt = make_optimizer(_params(a), {})
    _train(a, opt, 1)
    pipeloom.save_checkpoint(tmp_path, a, opt, step=1)
    good = _state(a)
    _train(a, opt, 1)
    pipeloom.save_checkpoint(tmp_path, a, opt, step=2)
    # what a crash leaves: step 3 written but never finished (no rename), and a step-4 directory
    # copied by hand without the marker; neither may be taken for a checkpoint
    (tmp_path / "step-00000002").rename(tmp_path / ".step-00000003.partial")
    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "step-00000004" / ".metadata").write_bytes(b"x")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000001"
    b = _pipe(2, seed=3)
    # (the step-4 directory is passed over with a warning, as a damaged one: a root holding only such ones is
    # refused with CheckpointReadError, never taken for a fresh start)
    with pytest.warns(RuntimeWarning, match="step-00000004 cannot be read.*lacks its COMPLETE"):
        info = pipeloom.load_checkpoint(tmp_path, b, make_optimizer(_params(b), {}))
    assert info is not None and info.step == 1
    assert [c.name for c, _ in info.skipped] == ["step-00000004"]
    assert all(torch.equal(_state(b)[k], good[k]) for k in good)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        pipeloom.load_checkpoint(tmp_path / "step-00000004", b)
    assert pipeloom.load_checkpoint(tmp_path / "empty", b) is None  # a fresh start
    # saving step 3 again replaces the partial directory; keep_last prunes old ones
    pipeloom.save_checkpoint(tmp_path, a, opt, step=3, keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]
    assert not (tmp_path / ".step-00000003.partial").exists()


def test_async_save_writes_the_state_of_the_moment_it_was_called(tmp_path: Path) -> None:
    a = _pipe(2)
    opt = make_optimizer(_params(a), {})
    _train(a, opt, 1)
    at_save = _state(a)
    pending = pipeloom.save_checkpoint(tmp_path, a, opt, step=1, async_save=True)
    _train(a, opt, 2)  # the parameters change while the files are written
    assert pending.wait(timeout=60) == tmp_path / "step-00000001"
    assert pending.done() and (pending.path / MARKER).is_file()
    b = _pipe(2, seed=5)
    pipeloom.load_checkpoint(tmp_path, b)
    assert all(torch.equal(_state(b)[k], at_save[k]) for k in at_save)


def test_names_must_identify_parameters(tmp_path: Path) -> None:
    from torch import nn

    clash = SimpleNamespace(stages={0: nn.Linear(2, 2), 1: nn.Linear(2, 2)})  # both call it "weight"
    with pytest.raises(pipeloom.PipelineConfigError, match="stages 0 and 1 both hold a parameter named 'weight'"):
        pipeloom.save_checkpoint(tmp_path, clash, step=0)
    pipeloom.save_checkpoint(tmp_path, clash, step=0, stage_prefix=True)
    other = SimpleNamespace(stages={0: nn.Linear(2, 2), 1: nn.Linear(2, 2)})
    pipeloom.load_checkpoint(tmp_path, other, stage_prefix=True)
    assert torch.equal(other.stages[1].weight, clash.stages[1].weight)
    with pytest.raises(pipeloom.PipelineConfigError, match="holds no"):
        pipeloom.load_checkpoint(tmp_path, _pipe(2))
    with pytest.raises(pipeloom.PipelineConfigError, match="no optimizer state"):
        p = _pipe(2)
        pipeloom.load_checkpoint(tmp_path, p, make_optimizer(_params(p), {}), stage_prefix=True)
    with pytest.raises(pipeloom.PipelineConfigError, match="step must be"):
        pipeloom.save_checkpoint(tmp_path, clash, step=-1, stage_prefix=True)


# ---------------------------------------------------------------- clipping and the step loss, one rank


def _grad_pipe(seed: int = 0) -> Any:
    pipe = _pipe(2, seed)
    h = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    for s in sorted(pipe.stages):
        h = pipe.stages[s](h)
    (100 * h.pow(2).mean()).backward()
    pipe.parameters = lambda: _params(pipe)
    pipe.device = torch.device("cpu")
    return pipe


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.5, float("inf")])
def test_clip_on_one_rank_is_torchs(norm_type: float) -> None:
    from pipeloom.runtime.training import clip_grad_norm_

    mine, theirs = _grad_pipe(), _grad_pipe()
    total = clip_grad_norm_(mine, 0.5, norm_type)
    want = torch.nn.utils.clip_grad_norm_(_params(theirs), 0.5, norm_type)
    assert float(total) == pytest.approx(float(want), rel=1e-12) and float(want) > 0.5
    for a, b in zip(_params(mine), _params(theirs)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=0)


def test_clip_and_loss_refuse_bad_arguments() -> None:
    from pipeloom.runtime.training import clip_grad_norm_, reduce_step_loss

    pipe = _grad_pipe()
    with pytest.raises(pipeloom.PipelineConfigError, match="norm_type"):
        clip_grad_norm_(pipe, 1.0, -2)
    pipe.stages[0].layers[0].lin.weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(pipe, 1.0, error_if_nonfinite=True)
    with pytest.raises(pipeloom.PipelineConfigError, match="reduce_to"):
        reduce_step_loss(pipe, {}, reduce_to="rank0")
    with pytest.raises(pipeloom.PipelineConfigError, match="not a rank"):
        reduce_step_loss(pipe, {}, reduce_to=3)
    with pytest.raises(pipeloom.PipelineConfigError, match="no rank has a loss"):
        reduce_step_loss(pipe, {}, reduce_to="all")
    losses = {0: torch.tensor(1.0), 1: torch.tensor(2.0), 2: torch.tensor(4.5)}
    assert reduce_step_loss(pipe, losses) == pytest.approx(2.5) == reduce_step_loss(pipe, losses, reduce_to=0)


def test_closing_with_a_save_in_flight_warns(tmp_path: Path) -> None:
    from concurrent.futures import Future

    from pipeloom.runtime import checkpoint as ck

    writing: Future[Any] = Future()
    pending = ck.PendingCheckpoint(tmp_path / "step-00000005", 5, writing)
    ck._PENDING.append(pending)
    try:
        with pytest.warns(RuntimeWarning, match="checkpoint.*of step 5 still being written"):
            ck.warn_pending()
    finally:
        writing.set_result(pending.path)
        pipeloom.wait_checkpoints()
    assert not ck._PENDING
