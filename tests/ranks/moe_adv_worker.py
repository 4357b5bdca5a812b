"""One rank of tests/test_moe_adversarial.py: expert parallelism against the unsplit model, op by op.

``python moe_adv_worker.py JOB.json`` on every rank of a gloo job.  Each case builds a Pipeline of MoE stages
(``expert_parallel``: each stage's experts sharded over its ep ranks) and runs a script of training-loop
operations on it; every rank runs the same script on the unsplit model itself (every stage, every expert on
this process, float64, the global batch cut into the columns' parts and each part into microbatches, each
microbatch routed on its own, as the ep ranks route their own tokens) and compares after each operation:
every gradient of the stages it holds (expert tensors: the rows of the experts this rank holds; ``None``
included), the clip norm, the losses, the outputs, ``last_loss`` and, after optimizer steps, every parameter.
Where the runtime must refuse, the error text is recorded instead.  Result: ``{out}/{case}-rank{R}.json``.

The stage (``Stage``): ``x + tanh(dense(x))``, then, where the case gives the stage experts,
``x + MoE(x)`` (+ a shared expert beside the routed ones), and with ``aux`` a Switch-style load-balancing
loss of the stage's router carried to the loss as a second output (``(h, aux)``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import serve_job  # noqa: E402

D, F64 = 6, torch.float64
from compare import TensorDiffs  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-12)


def experts_of(cfg: dict[str, Any], s: int, ns: int) -> int:
    e = cfg.get("experts", 4)
    if isinstance(e, list):
        return e[s % len(e)] if cfg.get("cycle") else (e[s] if s < len(e) else 0)
    if isinstance(e, dict):  # {"first": E, "last": E}: only those stages have experts
        return e.get("first", 0) if s == 0 else e.get("last", 0) if s == ns - 1 else e.get("mid", 0)
    return e


class Stage(nn.Module):
    def __init__(self, cfg: dict[str, Any], s: int, ns: int, *, group: Any = None, ep_rank: int = 0, ep_size: int = 1) -> None:
        super().__init__()
        from pipeloom.moe import MoE

        g = torch.Generator().manual_seed(1000 + s)
        self.s, self.ns, self.aux = s, ns, bool(cfg.get("aux"))
        self.dense = nn.Linear(D, D, dtype=F64)
        with torch.no_grad():
            self.dense.weight.normal_(0.0, D**-0.5, generator=g)
            self.dense.bias.normal_(0.0, 0.1, generator=g)
        e = experts_of(cfg, s, ns)
        self.moe = None
        if e:
            over = cfg.get("rank_moe", {}).get(str(dist.get_rank()), {}) if group is not None else {}
            self.moe = MoE(D, 2 * D, e, top_k=over.get("top_k", min(cfg.get("top_k", 2), e)),
                           capacity_factor=over.get("cf", cfg.get("cf", 1.0)), group=group, ep_rank=ep_rank,
                           ep_size=ep_size, generator=g, dtype=F64)
            if cfg.get("zero_router"):  # every logit equal: top-k among ties
                with torch.no_grad():
                    self.moe.router.weight.zero_()
        self.shared = None
        if cfg.get("shared") and e:
            self.shared = nn.Sequential(nn.Linear(D, 2 * D, dtype=F64), nn.GELU(), nn.Linear(2 * D, D, dtype=F64))
            with torch.no_grad():
                for p in self.shared.parameters():
                    p.normal_(0.0, 0.3, generator=g)

    def forward(self, x: torch.Tensor, aux: torch.Tensor | None = None) -> Any:
        x = x + torch.tanh(self.dense(x))
        if self.aux and aux is None:
            aux = x.new_zeros(1)
        if self.moe is not None:
            y = self.moe(x)
            if self.shared is not None:
                y = y + self.shared(x)
            if self.aux:  # Switch: E * sum_e (fraction of tokens whose first choice is e) * (mean router prob of e)
                probs = torch.softmax(self.moe.router(x.reshape(-1, D)), -1)
                first = nn.functional.one_hot(probs.argmax(-1), probs.shape[-1]).to(F64)
                aux = aux + probs.shape[-1] * (first.mean(0) * probs.mean(0)).sum().reshape(1)
            x = x + y
        return (x, aux) if self.aux else x


class DeadRouter(nn.Module):
    """A router whose last expert's logit is always far below the others: that expert gets no token."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin
        self.weight = lin.weight

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        out = self.lin(t)
        return torch.cat([out[:, :-1], out[:, -1:] - 1e3], dim=1)


def make_stage(cfg: dict[str, Any], s: int, ns: int, shared: dict[str, Any], *, group: Any = None, ep_rank: int = 0,
               ep_size: int = 1) -> nn.Module:
    m = Stage(cfg, s, ns, group=group, ep_rank=ep_rank, ep_size=ep_size)
    if cfg.get("dead_expert") and m.moe is not None:
        m.moe.router = DeadRouter(m.moe.router)
    tie = cfg.get("tie")
    if tie and s in (0, ns - 1):
        key = f"tie-{tie}"
        if key not in shared:
            shared[key] = m
        elif tie == "router":  # the last stage's router is the first stage's (a non-expert parameter)
            m.moe.router.weight = shared[key].moe.router.weight
        elif tie == "moe":  # the last stage's whole MoE block is the first stage's (expert parameters too)
            m.moe = shared[key].moe
        elif tie == "dense_router":  # the last stage's dense weight is the first stage's router weight
            m.dense.weight = shared[key].moe.router.weight
    return m


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    if isinstance(out, tuple):
        return ((out[0] - target) ** 2).mean() + 0.05 * out[1].sum()
    return ((out - target) ** 2).mean()


def rnd(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def batch(rows: int, seq: int, seed: int, dup: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x = rnd(rows, seq, D, seed=seed)
    if dup:  # every token the same within a row: ties in the slot order too
        x = x[:, :1].expand(rows, seq, D).clone()
    return x, rnd(rows, seq, D, seed=seed + 1000)


def _cut(t: torch.Tensor, cols: int, n: int) -> list[torch.Tensor]:
    return [m for part in torch.tensor_split(t, cols) for m in torch.tensor_split(part, n)]


class Ref:
    """The unsplit model on this process: every stage and expert, each column's microbatches routed on their own."""

    def __init__(self, cfg: dict[str, Any], ns: int, cols: int) -> None:
        shared: dict[str, Any] = {}
        self.stages = [make_stage(cfg, s, ns, shared) for s in range(ns)]
        self.cols, self.n = cols, cfg["microbatches"]

    def params(self) -> list[nn.Parameter]:
        return list({id(p): p for st in self.stages for p in st.parameters()}.values())

    def run(self, x: torch.Tensor, y: torch.Tensor, *, train: bool) -> tuple[list[Any], list[torch.Tensor]]:
        outs, losses = [], []
        ctx = torch.enable_grad() if train else torch.no_grad()
        with ctx:
            for xm, ym in zip(_cut(x, self.cols, self.n), _cut(y, self.cols, self.n)):
                h: Any = xm
                for st in self.stages:
                    h = st(*h) if isinstance(h, tuple) else st(h)
                outs.append(h[0].detach() if isinstance(h, tuple) else h.detach())
                losses.append(loss_fn(h, ym))
            if train:
                (torch.stack(losses).sum() / len(losses)).backward()
        return outs, [v.detach() for v in losses]


class Compare(TensorDiffs):
    def model(self, what: str, pipe: Any, ref: Ref, ep_rank: int, *, grads: bool, params: bool) -> None:
        from pipeloom.moe import is_expert_parameter

        for s, mod in pipe.stages.items():
            rp = dict(ref.stages[s].named_parameters(remove_duplicate=False))
            for name, p in mod.named_parameters(remove_duplicate=False):
                r = rp[name]
                rows = slice(None)
                if is_expert_parameter(p) and p.shape != r.shape:  # this rank's experts: its rows of the whole
                    rows = slice(ep_rank * p.shape[0], (ep_rank + 1) * p.shape[0])
                if grads:
                    self.tensors(f"{what} grad s{s}.{name}", p.grad, None if r.grad is None else r.grad[rows])
                if params:
                    self.tensors(f"{what} param s{s}.{name}", p, r[rows])


def make_opt(params: list[torch.Tensor], cfg: dict[str, Any]) -> torch.optim.Optimizer:
    if cfg.get("opt", "adamw") == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, foreach=False)


def run_case(cfg: dict[str, Any], ckroot: str) -> dict[str, Any]:
    import pipeloom
    from pipeloom.schedules import default_stages_per_rank, generate, overlap_input_only

    rank, world = dist.get_rank(), dist.get_world_size()
    over = cfg.get("rank_cfg", {}).get(str(rank), {})  # a rank that disagrees
    ep, dp = over.get("ep", cfg.get("ep", 2)), over.get("dp", cfg.get("dp", 1))
    cols = dp * ep
    pp = world // cols
    spr = default_stages_per_rank(cfg["schedule"])
    ns = pp * spr
    n = cfg["microbatches"]
    start = cfg.get("start", 0)
    shared: dict[str, Any] = {}
    ep_rank_of: dict[int, int] = {}

    def stage_fn(s: int, ctx: Any) -> nn.Module:
        ep_rank_of[s] = ctx.ep_rank
        return make_stage(cfg, s, ns, shared, group=ctx.ep_group, ep_rank=ctx.ep_rank, ep_size=ctx.ep_size)

    schedule: Any = cfg["schedule"]
    if cfg.get("overlap_input_only"):
        schedule = overlap_input_only(generate(schedule, num_ranks=pp, num_microbatches=n))
    kw: dict[str, Any] = {"expert_parallel": ep}
    if dp > 1:
        kw["data_parallel"] = dp
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(stage_fn, schedule=schedule, num_microbatches=n, loss_fn=loss_fn,
                             options=pipeloom.RuntimeOptions(heartbeat_timeout=5.0, setup_timeout=30.0,
                                                             stall_timeout=20.0, first_step_stall_timeout=30.0), **kw)
    ref = Ref(cfg, ns, cols)
    opt = make_opt(pipe.parameters(), cfg)
    ref_opt = make_opt(ref.params(), cfg)
    cmp = Compare()
    col = pipe.dp_rank
    me = col % ep
    ckpt = os.path.join(ckroot, cfg.get("ckpt", "ckpt"))
    errors: list[str] = []
    try:
        if cfg.get("load"):
            info = pipeloom.load_checkpoint(os.path.join(ckroot, cfg["load"]), pipe, opt, stage_prefix=True)
            assert info is not None and info.step == cfg["load_step"], info
        for i, op in enumerate(cfg["script"]):
            kind, tag, live = op[0], f"op{i}:{op[0]}", i >= start
            if kind in ("step", "eval"):
                _, rows, seq, seed = op[:4]
                x, y = batch(rows, seq, seed, dup=bool(cfg.get("dup")))
                # (the ops of a resumed run's past: cut as the run that saved cut them)
                ref.cols = cols if live else cfg.get("replay_cols", cols)
                want_out, want_losses = ref.run(x, y, train=kind == "step")
                if not live:
                    continue
                losses: list[torch.Tensor] = []
                run = pipe.step if kind == "step" else pipe.eval
                out = run(x, target=y, losses=losses)
                if pipe.has_last_stage:
                    mine = slice(col * n, (col + 1) * n)
                    got = out[0] if isinstance(out, tuple) else out
                    cmp.tensors(f"{tag} output", got, torch.cat(want_out[mine]))
                    cmp.tensors(f"{tag} losses", torch.stack([v.detach() for v in losses]), torch.stack(want_losses[mine]))
                cmp.tensors(f"{tag} last_loss", torch.tensor(pipe.last_loss(), dtype=F64), torch.stack(want_losses).mean())
                if kind == "step" and not getattr(ref, "nosync", False):
                    cmp.model(tag, pipe, ref, me, grads=True, params=False)
            elif kind == "clip":
                _, max_norm, norm_type = op[:3]
                norm_type = math.inf if norm_type == "inf" else float(norm_type)
                want = torch.nn.utils.clip_grad_norm_(ref.params(), max_norm, norm_type)
                if live:
                    got = pipe.clip_grad_norm_(max_norm, norm_type)
                    cmp.tensors(f"{tag} norm", got, want)
                    cmp.model(tag, pipe, ref, me, grads=True, params=False)
            elif kind == "opt":
                ref_opt.step()
                if live:
                    opt.step()
                    cmp.model(tag, pipe, ref, me, grads=False, params=True)
            elif kind == "zero":
                ref_opt.zero_grad(set_to_none=True)
                if live:
                    opt.zero_grad(set_to_none=True)
            elif kind == "no_sync_on":  # (gradients stay local until the step after it: compared then)
                sync = pipe.no_sync()
                sync.__enter__()
                ref.nosync = True
            elif kind == "no_sync_off":
                sync.__exit__(None, None, None)
                ref.nosync = False
            elif kind == "save":
                if live:
                    pipeloom.save_checkpoint(ckpt, pipe, opt, step=op[1], stage_prefix=True)
            else:
                raise AssertionError(kind)
    finally:
        pipe.close()
    return {"diffs": cmp.diffs, "errors": errors, "stages": sorted(pipe.stages)}


def main() -> None:
    serve_job(lambda cfg, job, rank: run_case(cfg, job["ckroot"]))


if __name__ == "__main__":
    main()
