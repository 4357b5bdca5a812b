"""One rank of tests/test_replica_adversarial.py: what one replica or one rank does alone.

``python replica_adv_worker.py JOB.json`` on every rank of a gloo job (``harness.run_job``).  Case kinds:

- ``fsdp``: pp 2 x FSDP 2 where a parameter gets a gradient on one replica only (``odd``: used by a microbatch
  of an odd number of rows; one replica's share has one, the other's none), a whole FSDP unit (``oddblk``,
  ``fsdp_wrap="blocks"``) likewise, and one never used; a script of steps (accumulation without ``zero_grad``
  included), clipping and AdamW steps compared with the unsplit model on this process (float64; with a
  float32 ``mp_policy`` to float32's tolerance) after each operation;
- ``ckpt``: ``save_checkpoint`` / ``load_checkpoint`` where one rank fails alone (``fault``); every rank must
  raise, promptly, an error naming the failing rank;
- ``ep``: expert parallelism (pp 2 x ep 2): a backward the user runs outside the Pipeline over the stage
  modules (a regulariser) must add the plain gradient, not one scaled by 1/ep.

Result: ``{out}/{case}-rank{R}.json``: ``{"diffs": ..., "errors": [...], ...}``.
"""

from __future__ import annotations

import errno
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import TensorDiffs  # noqa: E402
from harness import serve_job  # noqa: E402

D, F64 = 4, torch.float64


def rnd(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


class OddBlock(nn.Module):
    """A child block (its own FSDP unit under ``fsdp_wrap="blocks"``) the stage runs on odd microbatches only."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D, generator=g, dtype=F64) * 0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.w)


class Branchy(nn.Module):
    """``a``: always used; ``odd`` and ``oddblk``: only by a microbatch of an odd number of rows; ``never``: never."""

    def __init__(self, s: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(300 + s)
        self.a = nn.Linear(D, D, dtype=F64)
        with torch.no_grad():
            self.a.weight.copy_(torch.randn(D, D, generator=g, dtype=F64) * 0.5)
            self.a.bias.copy_(torch.randn(D, generator=g, dtype=F64) * 0.5)
        self.odd = nn.Parameter(torch.randn(D, generator=g, dtype=F64))
        self.never = nn.Parameter(torch.randn(D, generator=g, dtype=F64))
        self.oddblk = OddBlock(g)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.a(h))
        if h.shape[0] % 2 == 1:
            y = y * self.odd + self.oddblk(y)
        return y


def _cut(t: torch.Tensor, dp: int, n: int) -> list[torch.Tensor]:
    return [m for part in torch.tensor_split(t, dp) for m in torch.tensor_split(part, n)]


def _full(t: Any) -> Any:
    return t.full_tensor() if t is not None and hasattr(t, "full_tensor") else t


class Diffs(TensorDiffs):
    """TensorDiffs at another tolerance (mixed precision), or the default's."""

    def __init__(self, tol: dict[str, float] | None = None) -> None:
        super().__init__()
        self.tol = tol

    def tensors(self, what: str, got: Any, want: Any) -> None:
        if self.tol is None or got is None or want is None:
            return super().tensors(what, got, want)
        got, want = got.detach().to(F64), want.detach().to(F64)
        if got.shape != want.shape:
            self.diffs[what] = f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
        elif not torch.allclose(got, want, **self.tol):
            self.diffs[what] = float((got - want).abs().max())


def opts(**kw: Any) -> Any:
    import pipeloom

    return pipeloom.RuntimeOptions(heartbeat_timeout=5.0, setup_timeout=30.0, stall_timeout=20.0,
                                   first_step_stall_timeout=30.0, **kw)


# ---------------------------------------------------------------- fsdp: a gradient on one replica only


def run_fsdp(cfg: dict[str, Any]) -> dict[str, Any]:
    import pipeloom
    from pipeloom.schedules import default_stages_per_rank

    dp, n = 2, cfg["microbatches"]
    ns = dist.get_world_size() // dp * default_stages_per_rank(cfg["schedule"])
    kw: dict[str, Any] = {}
    tol = None
    if cfg.get("mp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kw["fsdp_kwargs"] = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)}
        tol = dict(rtol=1e-4, atol=1e-5)
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(lambda s: Branchy(s), schedule=cfg["schedule"], num_microbatches=n,
                             loss_fn=nn.functional.mse_loss, data_parallel=dp, fsdp=True, fsdp_wrap=cfg.get("wrap", "stage"),
                             options=opts(fsdp_reduce=cfg.get("reduce", "auto")), **kw)
    ref = [Branchy(s) for s in range(ns)]
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05, weight_decay=0.1, foreach=False)
    ref_opt = torch.optim.AdamW([p for m in ref for p in m.parameters()], lr=0.05, weight_decay=0.1, foreach=False)
    cmp = Diffs(tol)

    def compare(tag: str, *, grads: bool = True, params: bool = False) -> None:
        for s, mod in pipe.stages.items():
            rp = dict(ref[s].named_parameters())
            for name, p in mod.named_parameters():
                if grads:
                    cmp.tensors(f"{tag} grad s{s}.{name}", _full(p.grad), rp[name].grad)
                if params:
                    cmp.tensors(f"{tag} param s{s}.{name}", _full(p), rp[name])

    try:
        for i, op in enumerate(cfg["script"]):
            tag = f"op{i}:{op[0]}"
            if op[0] == "step":
                rows, seed = op[1], op[2]
                x, y = rnd(rows, D, seed=seed), rnd(rows, D, seed=seed + 1000)
                losses = []
                for xm, ym in zip(_cut(x, dp, n), _cut(y, dp, n)):
                    h = xm
                    for m in ref:
                        h = m(h)
                    losses.append(nn.functional.mse_loss(h, ym))
                (torch.stack(losses).sum() / len(losses)).backward()
                pipe.step(x, target=y)
                cmp.tensors(f"{tag} last_loss", torch.tensor(pipe.last_loss(), dtype=F64), torch.stack(losses).mean().detach())
                compare(tag)
            elif op[0] == "clip":
                want = torch.nn.utils.clip_grad_norm_([p for m in ref for p in m.parameters()], op[1])
                got = pipe.clip_grad_norm_(op[1])
                cmp.tensors(f"{tag} norm", got, want)
                compare(tag)
            elif op[0] == "opt":
                ref_opt.step()
                opt.step()
                compare(tag, grads=False, params=True)
            elif op[0] == "zero":
                ref_opt.zero_grad(set_to_none=True)
                opt.zero_grad(set_to_none=True)
    finally:
        pipe.close()
    return {"diffs": cmp.diffs, "errors": []}


# ---------------------------------------------------------------- ckpt: one rank fails alone


class _Raise(Exception):
    pass


def run_ckpt(cfg: dict[str, Any], ckroot: str) -> dict[str, Any]:
    import pipeloom
    import pipeloom.runtime.checkpoint as ck
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    fault, who = cfg["fault"], cfg.get("who", 1)
    root = os.path.join(ckroot, cfg["id"])
    pipe = pipeloom.Pipeline(lambda s: nn.Linear(D, D, dtype=F64), schedule="1F1B", num_microbatches=4,
                             loss_fn=nn.functional.mse_loss, options=opts())
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = rnd(4, D, seed=1), rnd(4, D, seed=2)
    pipe.step(x, target=y)
    opt.step()
    if cfg.get("load"):  # a good checkpoint to load, written by every rank
        pipeloom.save_checkpoint(root, pipe, opt, step=1, stage_prefix=True)
    undo: list[Any] = []
    extra: dict[str, Any] = {}
    if rank == who:
        if fault == "unpicklable_extra":  # rank 0's extra is what gets saved
            extra = {"f": lambda: 0}
        elif fault == "mkdir":  # rank 0 makes the directory: a root it cannot create
            blocker = os.path.join(ckroot, cfg["id"] + "-file")
            open(blocker, "w").close()
        elif fault in ("state_dict", "finalize", "write", "read_metadata", "read_data"):
            if fault == "state_dict":  # gathering this rank's state (a hook, a copy to CPU memory) fails
                owner, name = ck, "_state_dicts"
            elif fault == "finalize":  # rank 0's marker: the disk is full
                owner, name = ck, "_finalize"
            elif fault == "write":  # (the class that writes: FileSystemWriter and the runtime's own writer derive from it)
                from torch.distributed.checkpoint.filesystem import _FileSystemWriter

                owner, name = _FileSystemWriter, "write_data"
            elif fault == "read_metadata":
                owner, name = dcp.FileSystemReader, "read_metadata"
            else:
                owner, name = dcp.FileSystemReader, "read_data"
            orig = getattr(owner, name)

            def broken(*a: Any, **k: Any) -> Any:
                raise OSError(errno.ENOSPC if fault in ("finalize", "write") else errno.EIO, f"injected {fault} failure")

            setattr(owner, name, broken)
            undo.append(lambda: setattr(owner, name, orig))
    if fault == "mkdir":
        root = os.path.join(ckroot, cfg["id"] + "-file", "ckpt")
    t0 = time.perf_counter()
    errors: list[str] = []
    try:
        if cfg.get("load"):
            pipeloom.load_checkpoint(root, pipe, opt, stage_prefix=True)
        else:
            pipeloom.save_checkpoint(root, pipe, opt, step=2, extra=extra, stage_prefix=True)
    except Exception as exc:  # noqa: BLE001 - the case records it
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        for u in undo:
            u()
    took = time.perf_counter() - t0
    # still usable: the next collective pairs (a save/load that leaves a rank behind would hang here)
    pipe.step(x, target=y)
    pipe.close()
    return {"diffs": {}, "errors": errors, "took": took}


# ---------------------------------------------------------------- ep: a backward outside the Pipeline


def run_ep(cfg: dict[str, Any]) -> dict[str, Any]:
    import pipeloom
    from pipeloom.moe import MoE, is_expert_parameter

    D6 = 6

    class Stage(nn.Module):
        def __init__(self, s: int, group: Any, ep_rank: int, ep_size: int) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(500 + s)
            self.dense = nn.Linear(D6, D6, dtype=F64)
            self.moe = MoE(D6, 2 * D6, 4, top_k=2, capacity_factor=1.0, group=group, ep_rank=ep_rank, ep_size=ep_size,
                           generator=g, dtype=F64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + torch.tanh(self.dense(x))
            return x + self.moe(x)

    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(lambda s, ctx: Stage(s, ctx.ep_group, ctx.ep_rank, ctx.ep_size), schedule="1F1B",
                             num_microbatches=2, loss_fn=nn.functional.mse_loss, expert_parallel=2, options=opts())
    cmp = Diffs()
    x, y = rnd(4, 3, D6, seed=1), rnd(4, 3, D6, seed=2)

    def regulariser(tag: str) -> None:
        # an L2 penalty over the stage's parameters, backward outside the Pipeline: each parameter's gradient
        # grows by exactly 2 * 0.01 * p, expert parameters too
        params = [p for m in pipe.stages.values() for p in m.parameters()]
        before = [None if p.grad is None else p.grad.detach().clone() for p in params]
        (0.01 * sum((p * p).sum() for p in params)).backward()
        for (name, p), b in zip([(n_, p) for m in pipe.stages.values() for n_, p in m.named_parameters()], before):
            want = 0.02 * p.detach() + (0 if b is None else b)
            cmp.tensors(f"{tag} grad {name}{' (expert)' if is_expert_parameter(p) else ''}", p.grad, want)

    pipe.step(x, target=y)
    regulariser("after step")
    for p in pipe.parameters():
        p.grad = None
    regulariser("no step")
    pipe.close()
    for p in pipe.parameters():
        p.grad = None
    regulariser("after close")
    return {"diffs": cmp.diffs, "errors": []}


def _one(cfg: dict[str, Any], job: dict[str, Any], rank: int) -> dict[str, Any]:
    kind = cfg["kind"]
    if kind == "fsdp":
        return run_fsdp(cfg)
    if kind == "ckpt":
        return run_ckpt(cfg, job["ckroot"])
    if kind == "ep":
        return run_ep(cfg)
    raise AssertionError(kind)


if __name__ == "__main__":
    serve_job(_one)
