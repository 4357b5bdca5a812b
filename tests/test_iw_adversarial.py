"""Unusual autograd graphs inside stages, on real gloo ranks: the I/W-split schedules give a full backward's gradients.

Every stage of every case is a ``tests/ranks/adv_models.AdvStage`` of one kind (outputs that share a node or are
the same tensor, a pass-through input, outputs that need no gradient, views, custom Functions with
``once_differentiable`` and tensors on ``ctx``, reentrant and non-reentrant checkpoints, a parameter used only
under ``no_grad`` and a frozen one, per-microbatch data-dependent graphs with ``None`` input gradients, in-place
ops on views, buffers updated in forward, an input modified in place after a buffer update), chained into 4
stages on 2 ranks, 4 microbatches, 2 steps, float64, a keyword tensor on every stage; each row is checked against
the unsplit model in this process (every parameter's gradient, each microbatch's loss, the outputs, the buffers
after the last step).  The zero-bubble schedules (ZBVZeroBubble, InterleavedZeroBubble, DualPipeV) run every kind;
1F1B and Interleaved1F1B are the controls.  Plus a batch that requires grad: the first stage's backward reaches it
(I stops at the stage input; the split must go on into the caller's graph, as a full backward does).

One pool of rank processes runs all rows (about 15 s on 2 CPU cores).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from adv_models import KINDS  # noqa: E402
from harness import run_ranks  # noqa: E402
from reference import reference_run  # noqa: E402

from pipeloom.schedules import default_stages_per_rank  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-12)
SPLIT = ["ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"]
CONTROL = {"1F1B": ["chunk", "custom-fn", "inplace-input-buffer", "data-dep"], "Interleaved1F1B": ["same-twice", "inplace-view"]}


def _case(kind: str, schedule: str) -> dict[str, Any]:
    c = dict(id=f"{kind}-{schedule}", schedule=schedule, microbatches=4, dim=4, batch=8, steps=2, model=f"adv-{kind}",
             kwargs=True)
    if kind == "data-dep":  # (a None input gradient in some microbatches: a transfer whose layout changes)
        c["options"] = {"static_shapes": False}
    return c


CASES = [_case(k, s) for k in KINDS for s in SPLIT] + [_case(k, s) for s, ks in CONTROL.items() for k in ks] + [
    dict(id=f"x-grad-{s}", schedule=s, microbatches=4, dim=4, batch=8, steps=2, x_grad=True, kwargs=True)
    for s in ["1F1B", *SPLIT]
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return asyncio.run(run_ranks(2, CASES, tmp_path_factory.mktemp("adv"), timeout=240))


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_split_schedules_match_unsplit_model(results: dict[str, list[dict[str, Any]]], case_id: str) -> None:
    cfg = next(c for c in CASES if c["id"] == case_id)
    ranks = results[case_id]
    ns = 2 * default_stages_per_rank(cfg["schedule"])
    ref = reference_run(cfg, ns)
    last = next(r for r in ranks if ns - 1 in r["stages"])
    for step, want in enumerate(ref):
        got: dict[str, torch.Tensor] = {}
        for r in ranks:
            got.update(r["grads"][step])
        assert set(got) == set(want["grads"]), f"step {step}: parameters differ"
        for name, g in want["grads"].items():
            torch.testing.assert_close(got[name], g, **TOL, msg=lambda m, name=name, step=step: f"step {step} grad {name}: {m}")
        for m, (a, b) in enumerate(zip(last["losses"][step], want["losses"], strict=True)):
            torch.testing.assert_close(a, b, **TOL, msg=lambda msg, m=m, step=step: f"step {step} loss of microbatch {m}: {msg}")
        torch.testing.assert_close(last["outputs"][step], torch.cat(want["outputs"]), **TOL)
        if cfg.get("x_grad"):
            first = next(r for r in ranks if 0 in r["stages"])
            assert first["x_grad"][step] is not None, f"step {step}: the batch got no gradient"
            torch.testing.assert_close(first["x_grad"][step], want["x_grad"], **TOL)
    # buffers updated in forward: as many updates, in the same order (a checkpoint's recomputation count aside)
    buffers: dict[str, torch.Tensor] = {}
    for r in ranks:
        buffers.update(r["buffers"])
    for name, b in ref[-1]["buffers"].items():
        if not name.endswith(".calls"):
            torch.testing.assert_close(buffers[name], b, **TOL, msg=lambda m, name=name: f"buffer {name}: {m}")
