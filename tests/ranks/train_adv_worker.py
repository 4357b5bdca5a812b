"""One rank of tests/test_training_adversarial.py: a training loop's essentials against the unsplit model.

``python train_adv_worker.py JOB.json`` on every rank of a gloo job (the harness's rank pool).  Each case of
the job builds a Pipeline and runs a *script* of training-loop operations on it (steps of changing batch sizes,
``eval`` between steps, accumulation without ``zero_grad``, ``no_sync``, global clipping by the 2- and
inf-norm, a NaN gradient, optimizer steps, toggling a parameter's use); every rank runs the same script on the
unsplit model itself (same seeds, float64, the global batch cut as the replicas cut it) and compares after each
operation: every gradient of the stages it holds (``None`` included), the clip norm, the step's losses, the
eval outputs and, after optimizer steps, every parameter and buffer.  Where the runtime must refuse, the error
text is recorded instead.  The result goes to ``{out}/{case}-rank{R}.json``: ``{"diffs": {what: max abs diff
or a message}, "errors": [...]}``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import serve_job  # noqa: E402

D, F64 = 4, torch.float64
from compare import TensorDiffs  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-12)


class Blk(nn.Module):
    """A stage with what a training loop must get right: a weight tied inside the stage (``b``/``b2``), a
    parameter used twice (``g``), a frozen Linear, a parameter used only when ``use_sometimes`` (set per step),
    one never used, a constant buffer and, with ``ema``, a buffer updated in forward."""

    def __init__(self, s: int, ema: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(100 + s)

        def r(*sh: int) -> torch.Tensor:
            return torch.randn(*sh, generator=g, dtype=F64) * 0.5

        self.a = nn.Linear(D, D, dtype=F64)
        self.b = nn.Linear(D, D, bias=False, dtype=F64)
        self.b2 = nn.Linear(D, D, bias=False, dtype=F64)
        self.b2.weight = self.b.weight
        self.frozen = nn.Linear(D, D, dtype=F64).requires_grad_(False)
        with torch.no_grad():
            for p in [self.a.weight, self.a.bias, self.b.weight, self.frozen.weight, self.frozen.bias]:
                p.copy_(r(*p.shape))
        self.g = nn.Parameter(1 + r(D))
        self.sometimes = nn.Parameter(r(D))
        self.unused = nn.Parameter(r(D))
        self.register_buffer("scale", 1 + r(D))
        self.ema = ema
        if ema:
            self.register_buffer("running", torch.zeros(D, dtype=F64))
        self.drop = nn.Dropout(dropout) if dropout else None
        self.use_sometimes = True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.ema and self.training:
            with torch.no_grad():
                self.running.mul_(0.9).add_(0.1 * h.mean(0))
        y = torch.tanh(self.a(h)) * self.g
        if self.drop is not None:
            y = self.drop(y)
        y = self.b2(torch.tanh(self.b(y))) * self.g + self.frozen(h) * self.scale
        if self.use_sometimes:
            y = y + self.sometimes
        if self.ema:
            y = y - 0.1 * self.running
        if getattr(self, "tied", None) is not None:
            y = y * self.tied
        return y


def rnd(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _full(t: Any) -> Any:
    return t.full_tensor() if t is not None and hasattr(t, "full_tensor") else t


def _cut(t: torch.Tensor, dp: int, n: int) -> list[torch.Tensor]:
    return [m for part in torch.tensor_split(t, dp) for m in torch.tensor_split(part, n)]


class Ref:
    """The unsplit model on this process: every stage, one full backward over the global batch's microbatches."""

    def __init__(self, cfg: dict[str, Any], num_stages: int) -> None:
        self.cfg = cfg
        self.dp, self.n = cfg.get("dp", 1), cfg["microbatches"]
        shared: dict[str, nn.Parameter] = {}
        self.stages = [make_stage(cfg, s, num_stages, shared, reference=True) for s in range(num_stages)]
        self.own = dict(enumerate(self.stages))

    def step(self, x: torch.Tensor, y: torch.Tensor, *, train: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        outs, losses = [], []
        for xm, ym in zip(_cut(x, self.dp, self.n), _cut(y, self.dp, self.n)):
            h = xm
            for st in self.stages:
                h = st(h)
            outs.append(h.detach())
            losses.append(nn.functional.mse_loss(h, ym))
        if train:
            (torch.stack(losses).sum() / len(losses)).backward()
        return outs, [v.detach() for v in losses]


def make_stage(cfg: dict[str, Any], s: int, num_stages: int, shared: dict[str, nn.Parameter], *,
               reference: bool = False) -> nn.Module:
    m = Blk(s, ema=cfg.get("ema", False), dropout=cfg.get("dropout", 0.0))
    if cfg.get("tie_ends") and s in (0, num_stages - 1):
        # one Parameter in the first and the last stage (both on rank 0 under a V schedule)
        if "tied" not in shared:
            shared["tied"] = nn.Parameter(1 + rnd(D, seed=7))
        m.tied = shared["tied"]
    if cfg.get("compile") and not reference:  # (the unsplit model runs eagerly)
        m.compile(backend=cfg["compile"])
    return m


def make_opt(params: list[torch.Tensor], cfg: dict[str, Any]) -> torch.optim.Optimizer:
    if cfg.get("opt", "adamw") == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, foreach=False)


class Compare(TensorDiffs):
    def model(self, what: str, own: dict[int, nn.Module], ref: Ref, *, grads: bool, params: bool) -> None:
        for s, mod in own.items():
            rmod = ref.stages[s]
            rp = dict(rmod.named_parameters())
            for name, p in mod.named_parameters():
                name = name.replace("_orig_mod.", "")
                if grads:
                    self.tensors(f"{what} grad s{s}.{name}", _full(p.grad), rp[name].grad)
                if params:
                    self.tensors(f"{what} param s{s}.{name}", _full(p), rp[name])
            if params:
                rb = dict(rmod.named_buffers())
                for name, b in mod.named_buffers():
                    self.tensors(f"{what} buffer s{s}.{name.replace('_orig_mod.', '')}", b, rb[name.replace("_orig_mod.", "")])


def run_case(cfg: dict[str, Any], out_dir: str, ckroot: str) -> dict[str, Any]:
    """The case's script on a Pipeline and on the unsplit model.  ``start``: the ops before it run on the
    unsplit model only (the run being resumed from a checkpoint, ``load``); ``ref=False``: no unsplit model
    (dropout: its masks are the ranks' own), the run's losses and parameters are recorded for another case."""
    import pipeloom
    from pipeloom.schedules import default_stages_per_rank

    rank, world = dist.get_rank(), dist.get_world_size()
    dp = cfg.get("dp", 1)
    pp = world // dp
    spr = cfg.get("spr") or default_stages_per_rank(cfg["schedule"])
    ns = pp * spr
    n = cfg["microbatches"]
    start = cfg.get("start", 0)
    use_ref = cfg.get("ref", True)
    torch.manual_seed(cfg.get("seed", 0))
    shared: dict[str, nn.Parameter] = {}
    pipe = pipeloom.Pipeline(lambda s: make_stage(cfg, s, ns, shared), schedule=cfg["schedule"], num_microbatches=n,
                             loss_fn=nn.functional.mse_loss, stages_per_rank=spr, data_parallel=dp,
                             fsdp=cfg.get("fsdp", False), deterministic=cfg.get("deterministic"))
    ref = Ref(cfg, ns)
    opt = make_opt(pipe.parameters(), cfg)
    ref_opt = make_opt(list({id(p): p for st in ref.stages for p in st.parameters()}.values()), cfg)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    cmp = Compare()
    errors: list[str] = []
    records: dict[str, Any] = {}
    part = pipe.dp_rank
    syncing_off = False
    ckpt = os.path.join(ckroot, cfg.get("ckpt", "ckpt"))
    if cfg.get("load"):
        torch.manual_seed(4321)  # (a resumed process's generators are not the saved ones)
        try:
            info = pipeloom.load_checkpoint(os.path.join(ckroot, cfg["load"]), pipe, opt, stage_prefix=True)
        except BaseException:
            pipe.close()
            raise
        assert info is not None and info.step == cfg["load_step"], info
        sched.load_state_dict(info.extra["sched"])
    for i, op in enumerate(cfg["script"]):
        if os.environ.get("TADV_TIMES"):
            print(f"rank {rank} {time.perf_counter():.2f} op {i} {op}", file=sys.stderr, flush=True)
        kind = op[0]
        tag = f"op{i}:{kind}"
        live = i >= start
        check = live and use_ref
        if kind in ("step", "eval"):
            _, rows, seed = op[:3]
            x, y = rnd(rows, D, seed=seed), rnd(rows, D, seed=seed + 1000)
            losses: list[torch.Tensor] = []
            if use_ref:
                # (the ops of a resumed run's past: cut as the run that saved cut them)
                ref.dp = dp if live else cfg.get("replay_dp", dp)
                want_out, want_losses = ref.step(x, y, train=kind == "step")
            if not live:
                continue
            if kind == "step":
                out = pipe.step(x, target=y, losses=losses)
            else:
                out = pipe.eval(x, target=y, losses=losses)
            records[f"{tag} last_loss"] = pipe.last_loss()
            if not check:
                continue
            if pipe.has_last_stage:
                mine = slice(part * n, (part + 1) * n)
                cmp.tensors(f"{tag} output", out, torch.cat(want_out[mine]))
                cmp.tensors(f"{tag} losses", torch.stack([v.detach() for v in losses]), torch.stack(want_losses[mine]))
            cmp.tensors(f"{tag} last_loss", torch.tensor(pipe.last_loss(), dtype=F64), torch.stack(want_losses).mean())
            # (inside no_sync the replicas' gradients are local, FSDP's not on .grad: compared after it)
            cmp.model(tag, pipe.stages, ref, grads=not syncing_off, params=False)
        elif kind == "clip":
            _, max_norm, norm_type = op[:3]
            norm_type = math.inf if norm_type == "inf" else float(norm_type)
            raise_nonfinite = len(op) > 3 and op[3]
            ref_params = [p for st in ref.stages for p in st.parameters()]
            ref_params = list({id(p): p for p in ref_params}.values())
            try:
                want = torch.nn.utils.clip_grad_norm_(ref_params, max_norm, norm_type, error_if_nonfinite=raise_nonfinite)
                want_err = None
            except RuntimeError as exc:
                want, want_err = None, str(exc)
            if not live:
                continue
            try:
                got = pipe.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite=raise_nonfinite)
                got_err = None
            except RuntimeError as exc:
                got, got_err = None, str(exc)
            if not check:
                continue
            if (got_err is None) != (want_err is None):
                cmp.diffs[f"{tag} error"] = f"pipeline: {got_err!r}; unsplit model: {want_err!r}"
            else:
                cmp.tensors(f"{tag} norm", got, want)
            cmp.model(tag, pipe.stages, ref, grads=True, params=False)
        elif kind == "nan":  # a NaN into element [0] of a gradient (every rank holding that element)
            _, stage, name = op[:3]
            stage = stage % ns  # (-1: the last stage)
            if stage in pipe.stages and live:
                p = dict(pipe.stages[stage].named_parameters())[name]
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                if local.numel() and (not hasattr(p.grad, "to_local") or pipe.dp_rank == 0):
                    local.view(-1)[0] = float("nan")
            rp = dict(ref.stages[stage].named_parameters())[name]
            rp.grad.view(-1)[0] = float("nan")
        elif kind == "opt":  # an optimizer step, then the LR scheduler's
            ref_opt.step()
            ref_sched.step()
            if live:
                opt.step()
                sched.step()
                for s_, mod in pipe.stages.items():
                    for name, p_ in mod.named_parameters():
                        records[f"{tag} param s{s_}.{name}"] = _full(p_).detach().clone()
                    for name, b_ in mod.named_buffers():
                        records[f"{tag} buffer s{s_}.{name}"] = b_.detach().clone()
            if check:
                cmp.model(tag, pipe.stages, ref, grads=False, params=True)
        elif kind == "zero":
            ref_opt.zero_grad(set_to_none=True)
            if live:
                opt.zero_grad(set_to_none=True)
        elif kind == "use":  # a parameter used in the coming steps, or not (on every stage)
            for m in [*pipe.stages.values(), *ref.stages]:
                getattr(m, "_orig_mod", m).use_sometimes = bool(op[1])
        elif kind == "save":  # ("save", step): a checkpoint of this step (stage_prefix: the stages share names)
            if live:
                pipeloom.save_checkpoint(ckpt, pipe, opt, step=op[1], extra={"sched": sched.state_dict()},
                                         stage_prefix=True)
        elif kind == "no_sync_on":
            ctx = pipe.no_sync()
            ctx.__enter__()
            syncing_off = True
        elif kind == "no_sync_off":
            ctx.__exit__(None, None, None)
            syncing_off = False
        else:
            raise AssertionError(kind)
    pipe.close()
    torch.save(records, os.path.join(out_dir, f"{cfg['id']}-rank{rank}-records.pt"))
    return {"diffs": cmp.diffs, "errors": errors, "stages": sorted(pipe.stages)}


def _make_partial(complete: str, partial: str) -> None:
    """What a save cut by a crash leaves: the ranks' data files in ``.step-N.partial``, no DCP metadata, no marker."""
    import shutil

    shutil.copytree(complete, partial, ignore=shutil.ignore_patterns("COMPLETE", ".metadata"))


def _one(cfg: dict[str, Any], job: dict[str, Any], rank: int) -> dict[str, Any]:
    if cfg.get("make_partial") and rank == 0:
        _make_partial(os.path.join(job["ckroot"], cfg["make_partial"][0]), os.path.join(job["ckroot"], cfg["make_partial"][1]))
    dist.barrier()
    return run_case(cfg, job["out"], job["ckroot"])


def main() -> None:
    serve_job(_one)


if __name__ == "__main__":
    main()
