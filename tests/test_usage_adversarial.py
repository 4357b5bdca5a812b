"""Caller-side usage patterns on real gloo ranks: what the caller passes gets a full backward's gradient.

First-stage inputs that are *leaves* requiring grad — a tensor given whole to every microbatch (a 0-d tensor,
``pipeloom.Replicate``) or the pieces of ``pipeloom.Microbatches`` — must get their ``.grad`` accumulated as a full
backward of the unsplit model does, under the I/W-split schedules too (I computed their gradient and dropped it:
``.grad`` stayed None, or on DualPipeV held only the microbatches that ran a full B), and once per tensor when the
caller passes one tensor in two positions.  The batch cut from one tensor (views, not leaves) is
``test_iw_adversarial.py``'s ``x-grad`` rows.

One 2-rank job runs every schedule and case; each rank computes the unsplit reference itself (same seed) and
writes the largest differences; about 10 s on 2 CPU cores.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import launch_script  # noqa: E402

SCHEDULES = ["1F1B", "ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"]
CASES = ["replicate-0d", "microbatches"]

SCRIPT = r'''
import json, os, sys
import torch
import torch.distributed as dist
from torch import nn
import pipeloom
from pipeloom.schedules import default_stages_per_rank

torch.set_num_threads(1)
out_dir, schedules, cases = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
D, B, N, F64 = 4, 8, 4, torch.float64


class Stage(nn.Module):
    def __init__(self, first):
        super().__init__()
        self.first = first
        self.lin = nn.Linear(D, D, dtype=F64)
        self.g = nn.Parameter(1 + 0.1 * torch.randn(D, dtype=F64))

    def forward(self, h, aux=None, s=None, s2=None):
        if self.first:
            y = torch.tanh(self.lin(h) + aux * self.g) * s
            return y if s2 is None else y * s2
        return torch.tanh(self.lin(h)) * self.g


def build(ns):
    torch.manual_seed(0)
    return [Stage(i == 0) for i in range(ns)]


def rnd(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def inputs(case, step):
    """(positional args, target, the caller's leaves that require grad)"""
    s = torch.tensor(0.8 + 0.3 * step, dtype=F64, requires_grad=True)  # 0-d: every microbatch gets it whole
    if case == "replicate-0d":
        x = rnd(B, D, seed=10 + step)  # (cut: no gradient wanted)
        aux = rnd(D, seed=20 + step).requires_grad_(True)
        # (s twice: one tensor in two positions gets the sum of both uses' gradients, once)
        return (x, pipeloom.Replicate(aux), s, s), rnd(B, D, seed=30 + step), {"aux": aux, "s": s}
    lens = [3, 5, 2, 4]
    xs = [rnd(2, t, D, seed=40 + 10 * step + m).requires_grad_(True) for m, t in enumerate(lens)]
    auxs = [rnd(2, 1, D, seed=50 + 10 * step + m).requires_grad_(True) for m in range(N)]
    ys = [rnd(2, t, D, seed=60 + 10 * step + m) for m, t in enumerate(lens)]
    leaves = {f"x{m}": x for m, x in enumerate(xs)} | {f"aux{m}": a for m, a in enumerate(auxs)} | {"s": s}
    return (pipeloom.Microbatches(xs), pipeloom.Microbatches(auxs), s), pipeloom.Microbatches(ys), leaves


def cut(v, n):
    if isinstance(v, pipeloom.Microbatches):
        return list(v)
    if isinstance(v, pipeloom.Replicate):
        return [v.value] * n
    return list(torch.tensor_split(v, n)) if v.dim() > 0 else [v] * n


def run(case, schedule, ns, pipelined):
    stages = build(ns)
    pipe = None
    if pipelined:
        pipe = pipeloom.Pipeline(lambda i: stages[i], schedule=schedule, num_microbatches=N,
                                 loss_fn=nn.functional.mse_loss)
        own = pipe.stages
    else:
        own = dict(enumerate(stages))
    got = {}
    for step in range(2):
        for m in own.values():
            m.zero_grad(set_to_none=True)
        args, target, leaves = inputs(case, step)
        if pipe is not None:
            pipe.step(*args, target=target)
            first = pipe.has_first_stage
        else:  # the unsplit model: one full backward over every microbatch
            a, t = [cut(v, N) for v in args], cut(target, N)
            loss = 0
            for m in range(N):
                h = tuple(c[m] for c in a)
                for st in stages:
                    h = st(*h)
                    h = h if isinstance(h, tuple) else (h,)
                loss = loss + nn.functional.mse_loss(h[0], t[m])
            (loss / N).backward()
            first = True
        for i, mod in own.items():
            for n, p in mod.named_parameters():
                got[f"{step}.s{i}.{n}"] = p.grad.clone()
        if first:
            for n, t in leaves.items():
                got[f"{step}.{n}"] = None if t.grad is None else t.grad.clone()
        with torch.no_grad():
            for mod in own.values():
                for p in mod.parameters():
                    p -= 0.1 * p.grad
    if pipe is not None:
        pipe.close()
    return got


# (the job's group, created once: Pipelines that each create and destroy it could meet the previous store)
dist.init_process_group("gloo")
report = {}
for schedule in schedules:
    ns = world * default_stages_per_rank(schedule)
    for case in cases:
        want = run(case, schedule, ns, False)
        got = run(case, schedule, ns, True)
        diffs = {}
        for k, v in got.items():
            w = want[k]
            diffs[k] = "None" if v is None else float((v - w).abs().max())
        report[f"{case}-{schedule}"] = diffs
json.dump(report, open(os.path.join(out_dir, f"rank{rank}.json"), "w"))
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, float | str]]]:
    d = tmp_path_factory.mktemp("usage")
    proc = launch_script(d, SCRIPT, str(d), ",".join(SCHEDULES), ",".join(CASES), timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((d / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", CASES)
def test_caller_leaves_get_a_full_backwards_gradient(reports: list[dict[str, dict[str, float | str]]], case: str,
                                                     schedule: str) -> None:
    seen = set()
    for rep in reports:
        diffs = rep[f"{case}-{schedule}"]
        seen.update(diffs)
        bad = {k: v for k, v in diffs.items() if v == "None" or v > 1e-10}
        assert not bad, f"{case} on {schedule}: differs from the unsplit model's full backward: {bad}"
    # the caller's leaves were checked (on the first stage's rank), step 0 and 1
    leaves = {"s", "aux"} if case == "replicate-0d" else {"s", *(f"x{m}" for m in range(4)), *(f"aux{m}" for m in range(4))}
    assert {f"{step}.{n}" for step in (0, 1) for n in leaves} <= seen
