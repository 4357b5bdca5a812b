"""One rank of tests/test_scaler_lifecycle_adversarial.py: ``PipelineGradScaler`` against ``torch.amp.GradScaler`` on the
unsplit model (this process), float32 with scales near 2^100.

``python scaler_adv_worker.py JOB.json`` on every rank of a gloo job (``harness.run_job``).  Each stage is
``tanh(Linear(4, 4))`` followed by ``Gain``, a custom Function whose backward multiplies column 0 of the stage's
output gradient by 2^40 in the steps, stages and replicas a case names: that stage's weight row 0 and bias 0 (and
every earlier stage's gradients) overflow float32 there and nowhere else.  With FSDP the weight's row 0 lives in one
replica's shard only: only that rank finds the inf.  The unsplit model skips those steps (its gain applies to the
whole batch) and halves its scale; every rank of the pipeline must do the same.

Case fields: ``schedule``, ``stages`` (how many in all), ``dp``, ``fsdp``, ``mb``, ``steps``, ``overflow`` ([[step,
stage, replica], ...]; a step is one optimizer step), ``acc`` (pipeline steps per optimizer step: the first ``acc - 1``
inside ``no_sync()``), ``optim`` (``sgd``, ``fused`` (AdamW, fused=True: unscales in its own kernel), ``two`` (one
optimizer for the weights, one for the biases), ``bias0`` (the same, but only stage 0's biases train: the
other ranks pass None for the biases' optimizer)), ``weights_only`` (the gain on the weight's gradient alone: with
``two`` the weights' optimizer skips and the biases' steps, as torch's per-optimizer flags do), ``clip`` (unscale_ + clip_grad_norm_ on odd steps), ``eval`` (an
eval between steps, compared unscaled), ``ckpt_at`` (save after that step with the scaler's state in ``extra``,
close, build a new Pipeline and scaler from other weights, load, go on), ``enabled``, ``frozen`` (a stage whose
parameters are frozen: its rank has no optimizer and calls ``scaler.update()`` alone), ``fail_at`` (stage 1 raises in
that step: the scaler must then refuse on every rank, promptly, and not step), ``ep`` (expert parallelism, pp x ep
with ``pipeloom.moe`` stages: ``run_ep``; the overflow's replica is then the ep column).

Result: ``{"scales": [...], "ref_scales": [...], "diff": max parameter difference, "loss_diff", "eval_diff",
"errors": [...], "fail": ...}``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import serve_job  # noqa: E402

import pipeloom  # noqa: E402


class Gain(torch.autograd.Function):
    on: set[tuple[int, int]] = set()  # (stage, replica) whose column-0 gradient is multiplied by 2^40 this step
    weights: bool = False  # (this case's gain is on the stage's weight gradient alone, not on its output's)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stage: int, replica: int) -> torch.Tensor:
        ctx.key = (stage, replica)
        return x.clone()

    @staticmethod
    def hit(key: tuple[int, int]) -> bool:
        # (the unsplit model, replica -1, runs every replica's rows: it overflows where any replica does)
        return key in Gain.on or (key[1] == -1 and any(s == key[0] for s, _ in Gain.on))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        if not Gain.weights and Gain.hit(ctx.key):
            g = g.clone()
            g[:, 0] *= 2.0 ** 40
        return g, None, None


class Stage(nn.Module):
    def __init__(self, s: int, replica: int, seed: int = 100, fail: list[bool] | None = None) -> None:
        super().__init__()
        torch.manual_seed(seed + s)
        self.lin, self.s, self.replica, self.fail = nn.Linear(4, 4), s, replica, fail
        # Gain.weights: the weight's gradient alone overflows (its bias and the input gradient stay finite)
        self.lin.weight.register_hook(lambda g: g * 2.0 ** 40 if Gain.weights and Gain.hit((self.s, self.replica)) else g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail is not None and self.fail[0]:
            raise RuntimeError("injected failure")
        return Gain.apply(torch.tanh(self.lin(x)), self.s, self.replica)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _optims(params: list[nn.Parameter], kind: str) -> list[torch.optim.Optimizer | None]:
    params = [p for p in params if p.requires_grad]
    if kind == "bias0":  # the weights' optimizer everywhere; the biases' (stage 0's alone train) where there are some
        w = [p for p in params if p.dim() == 2]
        b = [p for p in params if p.dim() == 1]
        return [torch.optim.SGD(w, lr=0.1, momentum=0.9) if w else None, torch.optim.Adam(b, lr=0.05) if b else None]
    if not params:
        return []
    if kind == "fused":
        return [torch.optim.AdamW(params, lr=0.05, fused=True)]
    if kind == "two":
        w = [p for p in params if p.dim() == 2]
        b = [p for p in params if p.dim() == 1]
        return [torch.optim.SGD(w, lr=0.1, momentum=0.9), torch.optim.Adam(b, lr=0.05)]
    return [torch.optim.SGD(params, lr=0.1, momentum=0.9)]


def run(cfg: dict[str, Any], job: dict[str, Any], rank: int) -> dict[str, Any]:
    dp, n_stages = cfg.get("dp", 1), cfg["stages"]
    replica = rank % dp
    acc, enabled, frozen = cfg.get("acc", 1), cfg.get("enabled", True), cfg.get("frozen")
    fail = [False]
    kw = dict(schedule=cfg["schedule"], num_microbatches=cfg["mb"], loss_fn=nn.functional.mse_loss,
              data_parallel=dp, fsdp=cfg.get("fsdp", False), options=pipeloom.RuntimeOptions(stall_timeout=10.0))
    ckpt = os.path.join(job["ckroot"], cfg["id"])
    res: dict[str, Any] = {"scales": [], "ref_scales": [], "diff": 0.0, "loss_diff": 0.0, "eval_diff": 0.0, "errors": []}

    def build(seed: int) -> tuple[Any, dict[int, nn.Module], list[torch.optim.Optimizer], Any]:
        stages: dict[int, nn.Module] = {}

        def stage_fn(s: int) -> nn.Module:
            m = stages[s] = Stage(s, replica, seed, fail if s == 1 else None)
            m.requires_grad_(s != frozen)
            if cfg.get("optim") == "bias0" and s != 0:
                m.lin.bias.requires_grad_(False)
            return m

        pipe = pipeloom.Pipeline(stage_fn, **kw)
        opts = _optims(pipe.parameters(), cfg.get("optim", "sgd"))
        scaler = pipeloom.PipelineGradScaler(pipe, init_scale=2.0 ** 100 if seed == 100 else 2.0 ** 16,
                                             growth_interval=2, enabled=enabled)
        return pipe, stages, opts, scaler

    pipe, stages, opts, scaler = build(100)
    ref = nn.Sequential(*[Stage(s, -1) for s in range(n_stages)])
    for s in range(n_stages):
        ref[s].requires_grad_(s != frozen)
        if cfg.get("optim") == "bias0" and s != 0:
            ref[s].lin.bias.requires_grad_(False)
    ref_opts = _optims(list(ref.parameters()), cfg.get("optim", "sgd"))
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100, growth_interval=2, enabled=enabled)
    overflow = cfg.get("overflow", [])
    Gain.weights = bool(cfg.get("weights_only"))
    gen = torch.Generator().manual_seed(7)
    for step in range(cfg["steps"]):
        for i in range(acc):
            x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)
            it = step * acc + i
            Gain.on = {(s, r) for st, s, r in overflow if st == it}
            fail[0] = cfg.get("fail_at") == it
            quiet = pipe.no_sync() if i < acc - 1 else contextlib.nullcontext()
            try:
                with quiet:
                    pipe.step(x, target=y, return_outputs=False)
            except pipeloom.PipelineError as exc:
                # the step failed: the scaler must refuse on every rank at once, and step nothing
                before = [_full(p).detach().clone() for p in pipe.parameters()]
                t0 = time.monotonic()
                try:
                    for o in opts or [None]:
                        scaler.step(o)
                    res["fail"] = {"stepped": "no error"}
                except Exception as exc2:  # noqa: BLE001 - what the test asserts on
                    res["fail"] = {"error": f"{type(exc2).__name__}: {exc2}"[:300]}
                res["fail"].update(step_error=type(exc).__name__, seconds=time.monotonic() - t0,
                                   moved=any(not torch.equal(a, _full(p)) for a, p in zip(before, pipe.parameters())))
                for o in opts:  # a second attempt must skip too (the flag was never agreed)
                    try:
                        scaler.step(o)
                    except Exception:  # noqa: BLE001
                        pass
                res["fail"]["moved_after_retry"] = any(not torch.equal(a, _full(p)) for a, p in zip(before, pipe.parameters()))
                pipe.close()
                return res
            ref_loss = nn.functional.mse_loss(ref(x), y)
            ref_scaler.scale(ref_loss).backward()
            Gain.on = set()
        if cfg.get("clip") and step % 2:
            for o in opts or [None]:  # (a rank with no optimizer joins the agreement with None)
                scaler.unscale_(o)
            pipe.clip_grad_norm_(10.0)
            for o in ref_opts:
                ref_scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 10.0)
        for o in opts or [None]:
            scaler.step(o)
        scaler.update()
        for o in opts:
            if o is not None:
                o.zero_grad()
        loss = pipe.last_loss()
        for o in ref_opts:
            ref_scaler.step(o)
        ref_scaler.update()
        for o in ref_opts:
            o.zero_grad()
        if acc == 1:  # (the reported loss is the unscaled one)
            res["loss_diff"] = max(res["loss_diff"], abs(loss - ref_loss.item()))
        res["scales"].append(scaler.get_scale())
        res["ref_scales"].append(ref_scaler.get_scale())
        if cfg.get("eval"):
            out = pipe.eval(x)
            if out is not None:
                with torch.no_grad():
                    res["eval_diff"] = max(res["eval_diff"], (out - ref(x)).abs().max().item())
        if cfg.get("ckpt_at") == step:
            pipeloom.save_checkpoint(ckpt, pipe, opts or None, step=step, extra={"scaler": scaler.state_dict()},
                                     stage_prefix=True)
            pipe.close()
            pipe, stages, opts, scaler = build(500)  # other weights and another scale: the load must bring all back
            info = pipeloom.load_checkpoint(ckpt, pipe, opts or None, stage_prefix=True)
            scaler.load_state_dict(info.extra["scaler"])
            res["loaded_scale"] = scaler.get_scale()
    for s, m in stages.items():
        for a, b in zip(m.parameters(), ref[s].parameters()):
            res["diff"] = max(res["diff"], (_full(a) - b).abs().max().item())
    pipe.close()
    return res


class Wrapped(nn.Module):
    """An MoE stage (``moe_model.MoEStage``, float32) followed by ``Gain`` keyed by this stage and ep column."""

    def __init__(self, s: int, column: int, **kw: Any) -> None:
        super().__init__()
        from moe_model import MoEStage

        self.inner, self.s, self.column = MoEStage(s, dtype=torch.float32, **kw), s, column

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Gain.apply(self.inner(x), self.s, self.column)


def run_ep(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    """pp x ep with ``pipeloom.moe`` stages; the unsplit reference holds every expert and routes each column's
    microbatches on their own (as tests/test_moe.py's), with torch's scaler."""
    from moe_model import loss_fn, make_batch

    ep, n, n_stages = cfg["ep"], cfg["mb"], cfg["stages"]
    ctxs: dict[int, Any] = {}
    stages: dict[int, nn.Module] = {}

    def stage_fn(s: int, ctx: Any) -> nn.Module:
        ctxs[s] = ctx
        m = stages[s] = Wrapped(s, ctx.ep_rank, group=ctx.ep_group, ep_rank=ctx.ep_rank, ep_size=ctx.ep_size)
        return m

    pipe = pipeloom.Pipeline(stage_fn, schedule=cfg["schedule"], num_microbatches=n, loss_fn=loss_fn, expert_parallel=ep,
                             options=pipeloom.RuntimeOptions(stall_timeout=10.0))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    scaler = pipeloom.PipelineGradScaler(pipe, init_scale=2.0 ** 100, growth_interval=2)
    ref = [Wrapped(s, 0) for s in range(n_stages)]
    ref_opt = torch.optim.SGD([q for m in ref for q in m.parameters()], lr=0.1, momentum=0.9)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100, growth_interval=2)
    res: dict[str, Any] = {"scales": [], "ref_scales": [], "diff": 0.0, "loss_diff": 0.0, "eval_diff": 0.0, "errors": []}
    for step in range(cfg["steps"]):
        x, y = (t.float() for t in make_batch(step, rows=8, seq=3))
        Gain.on = {(s, c) for st, s, c in cfg["overflow"] if st == step}
        pipe.step(x, target=y, return_outputs=False)
        for c, (xc, yc) in enumerate(zip(torch.tensor_split(x, ep), torch.tensor_split(y, ep))):
            for m in ref:
                m.column = c
            for xm, ym in zip(torch.tensor_split(xc, n), torch.tensor_split(yc, n)):
                h = xm
                for m in ref:
                    h = m(h)
                ref_scaler.scale(loss_fn(h, ym) / (n * ep)).backward()
        Gain.on = set()
        if step % 2:
            scaler.unscale_(opt)
            pipe.clip_grad_norm_(10.0)
            ref_scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_([q for m in ref for q in m.parameters()], 10.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        res["scales"].append(scaler.get_scale())
        res["ref_scales"].append(ref_scaler.get_scale())
    for s, m in stages.items():
        want = dict(ref[s].named_parameters())
        for name, a in m.named_parameters():
            b = want[name]
            if name.endswith(("moe.w1", "moe.w2")):
                k = m.inner.moe.local_experts
                b = b[ctxs[s].ep_rank * k:(ctxs[s].ep_rank + 1) * k]
            res["diff"] = max(res["diff"], (a - b).abs().max().item())
    pipe.close()
    return res


def _one(cfg: dict[str, Any], job: dict[str, Any], rank: int) -> dict[str, Any]:
    return run_ep(cfg, rank) if cfg.get("ep") else run(cfg, job, rank)


if __name__ == "__main__":
    serve_job(_one, empty={"scales": [], "ref_scales": [], "diff": None}, hard_exit=True)
