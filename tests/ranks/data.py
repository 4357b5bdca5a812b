"""Batches for a test configuration, identical on every rank and in the reference."""

from __future__ import annotations

from typing import Any

import torch


def make_step_batches(cfg: dict[str, Any], step: int) -> dict[str, Any]:
    """One step's batch: ``x``, ``target``, optional ``scale`` kwarg, or pre-cut microbatches.

    cfg keys: batch (rows, or a list per step), seq (length, list per step, or
    "per_mb" for a different length in every microbatch, or a list per step of
    per-microbatch lengths), dim, multi, kwargs.
    """
    g = torch.Generator().manual_seed(1000 + step)
    dtype = getattr(torch, cfg.get("dtype", "float64"))
    dim = cfg["dim"]
    batch = cfg["batch"][step] if isinstance(cfg["batch"], list) else cfg["batch"]
    n = cfg["microbatches"]
    seq = cfg.get("seq")
    out: dict[str, Any] = {}
    per_step = seq[step] if isinstance(seq, list) and isinstance(seq[step], list) else None
    if seq == "per_mb" or per_step is not None:
        lengths = per_step if per_step is not None else [3 + (step + m) % 5 for m in range(n)]
        xs = [torch.randn(batch // n, t, dim, generator=g, dtype=dtype) for t in lengths]
        ys = [torch.randn(batch // n, t, dim, generator=g, dtype=dtype) for t in lengths]
        out["x_mbs"], out["y_mbs"] = xs, ys
        return out
    t = seq[step] if isinstance(seq, list) else seq
    shape = (batch, dim) if t is None else (batch, t, dim)
    out["x"] = torch.randn(*shape, generator=g, dtype=dtype)
    out["target"] = torch.randn(*shape, generator=g, dtype=dtype)
    if cfg.get("kwargs"):
        out["scale"] = 0.5 + torch.rand(batch, *([1] * (len(shape) - 1)), generator=g, dtype=dtype)
    return out
