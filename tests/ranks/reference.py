"""The unsplit model on one process, for comparing a pipelined run against.

With ``PIPELOOM_TEST_BACKEND=nccl`` it runs on the first GPU, as the ranks do:
"equal to a full backward" then means on the same kind of device (a GPU
evaluates some float64 ops, e.g. ``weight_norm``, differently from the CPU by
about 1e-8 relative, whatever the schedule).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from data import make_step_batches
from models import apply_freeze, build_stages, run_reference


def _device() -> torch.device:
    if os.environ.get("PIPELOOM_TEST_BACKEND") == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def reference_run(cfg: dict[str, Any], num_stages: int) -> list[dict[str, Any]]:
    """Per step: grads by ``s{stage}.{param}``, losses, output, eval output — with SGD between steps as the worker does."""
    from pipeloom.runtime.pipeline import split_microbatches

    n = cfg["microbatches"]
    dtype = getattr(torch, cfg.get("dtype", "float64"))
    stages = build_stages(num_stages, dim=cfg["dim"], multi=cfg.get("multi", False), seed=cfg.get("seed", 0), dtype=dtype,
                          model=cfg.get("model", "block"))
    dev = _device()
    stages = [s.to(dev) for s in stages]
    params = list({id(p): p for s in stages for p in s.parameters()}.values())  # a tied weight once
    opt = torch.optim.SGD(params, lr=cfg.get("lr", 0.1))
    steps = []
    for step in range(cfg.get("steps", 1)):
        b = make_step_batches(cfg, step)
        for s in stages:
            s.zero_grad(set_to_none=True)
        apply_freeze(stages, cfg, step)
        if "x_mbs" in b:
            args, kws, tg = [(x,) for x in b["x_mbs"]], [{}] * n, b["y_mbs"]
        else:
            kw = {"scale": b["scale"]} if "scale" in b else {}
            if cfg.get("x_grad"):
                b["x"].requires_grad_(True)
            si = split_microbatches((b["x"],), kw, b["target"], n)
            args, kws, tg = si.args, si.kwargs, si.targets
        args, kws, tg = _to(args, dev), _to(kws, dev), _to(tg, dev)
        losses, outs = _to(run_reference(stages, args, kws, tg, n), torch.device("cpu"))
        grads = {f"s{i}.{pn}": (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).cpu()
                 for i, m in enumerate(stages) for pn, p in m.named_parameters()}
        x_grad = b["x"].grad.clone() if cfg.get("x_grad") and b["x"].grad is not None else None
        opt.step()
        evals = None
        if cfg.get("eval"):
            with torch.no_grad():
                evals = []
                for a, k in zip(args, kws):
                    x: Any = a
                    for st in stages:
                        x = st(*x, **k)
                        x = x if isinstance(x, tuple) else (x,)
                    evals.append(x[0].cpu())
        steps.append({"grads": grads, "losses": losses, "outputs": outs, "eval": evals, "x_grad": x_grad})
    steps[-1]["buffers"] = {f"s{i}.{bn}": b.detach().clone().cpu() for i, m in enumerate(stages) for bn, b in m.named_buffers()}
    return steps
