"""One rank of the split_by_fqn integration test, and the model it splits.

Started by ``tests/test_split.py`` through ``harness.spawn_ranks`` with a JSON
job ``{"out": DIR, "cases": [{"id", "schedule", "microbatches", "fqns"}...]}``
(a case with ``"traced": true`` instead traces ``SkipNet`` with torch's tracer).
Every case builds the same seeded float64 ``TinyLM``, splits it with
``pipeloom.split_by_fqn``, runs one ``Pipeline.step`` and saves, per rank,
each local parameter's gradient under its *full-model* name (split stages keep
the model's names, so the test compares them to the unsplit model's directly)
and the losses, to ``DIR/{id}-rank{R}.pt``.  One process group serves every
case (starting torch costs more than a case).

The model lives here so the test process builds exactly the same one.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SkipNet", "TinyLM", "build_skipnet", "make_batch", "make_skip_batch", "lm_loss", "main", "traced_skipnet"]


class TinyBlock(nn.Module):
    """Pre-LN causal self-attention + MLP, small enough to run in float64 in a test."""

    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp(self.ln2(h))


class TinyLM(nn.Module):
    """embed -> layers -> norm -> head; the forward tolerates modules another stage owns."""

    def __init__(self, vocab: int = 13, dim: int = 8, layers: int = 4, block: Any = None) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList((block or (lambda: TinyBlock(dim)))() for _ in range(layers))
        self.norm: nn.Module | None = nn.LayerNorm(dim)
        self.head: nn.Module | None = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


class SkipNet(nn.Module):
    """A model whose traced 4-stage split has skip edges.

    Stage 0 computes ``h0`` (needs gradients) and a ``gate`` from the input
    (does not); every later block reads both, so stages 2 and 3 need values
    from stage 0 that stage 1 (and 2) must carry.
    """

    def __init__(self, dim: int = 8, blocks: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(5, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(blocks))
        self.out = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.tanh(self.inp(x))
        gate = torch.sigmoid(x.sum(-1, keepdim=True))
        h = h0
        for blk in self.blocks:
            h = torch.tanh(blk(h)) * gate + h0
        return self.out(h)


SKIP_SPLIT = {"blocks.0": "BEGINNING", "blocks.1": "BEGINNING", "blocks.2": "BEGINNING"}


def build_skipnet(seed: int = 0) -> SkipNet:
    torch.manual_seed(seed)
    return SkipNet().double()


def make_skip_batch(batch: int = 8, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=g)


def traced_skipnet(microbatch_rows: int) -> Any:
    """``split_by_tracing`` over ``SkipNet`` at ``SKIP_SPLIT``, traced with a microbatch of that many rows."""
    from torch.distributed.pipelining import SplitPoint

    import pipeloom

    x, _ = make_skip_batch(batch=microbatch_rows)
    spec = {k: getattr(SplitPoint, v) for k, v in SKIP_SPLIT.items()}
    return pipeloom.split_by_tracing(build_skipnet(), example_args=(x,), split_spec=spec)


def build_model(seed: int = 0, dtype: torch.dtype = torch.float64, **kw: Any) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kw).to(dtype)


def make_batch(batch: int = 8, seq: int = 6, vocab: int = 13, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    y = torch.randint(0, vocab, (batch, seq), generator=g)
    return x, y


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def main() -> None:
    import torch.distributed as dist

    import pipeloom

    job = json.load(open(sys.argv[1]))
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for case in job["cases"]:
        if case.get("traced"):  # SkipNet through torch's tracer, skip edges routed
            x, y = make_skip_batch()
            stage_fn = traced_skipnet(x.shape[0] // case["microbatches"])
            loss_fn: Any = F.cross_entropy
        else:
            x, y = make_batch()
            stage_fn = pipeloom.split_by_fqn(build_model(), case["fqns"])
            loss_fn = lm_loss
        pipe = pipeloom.Pipeline(stage_fn, schedule=case["schedule"], num_microbatches=case["microbatches"], loss_fn=loss_fn)
        losses: list[torch.Tensor] = []
        pipe.step(x, target=y, losses=losses)
        result = {
            "grads": {n: p.grad.clone() for m in pipe.stages.values() for n, p in m.named_parameters() if p.grad is not None},
            "params": sorted(n for m in pipe.stages.values() for n, _ in m.named_parameters()),
            "losses": [l.clone() for l in losses],
            "stages": sorted(pipe.stages),
        }
        pipe.close()
        torch.save(result, os.path.join(job["out"], f"{case['id']}-rank{rank}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
