"""A training loop's essentials on real gloo ranks, against the unsplit model on one process (float64).

Each case (``tests/ranks/train_adv_worker.py``) runs a script of training-loop operations on a Pipeline and,
on every rank, on the unsplit model, comparing after each operation.  The stages hold a weight tied inside the
stage, a parameter used twice, a frozen Linear, a parameter used in some steps only, one never used and a
buffer.  Covered: pipeline x data parallel / FSDP (pp 2 x dp 2) under the I/W-split schedules and 1F1B,
AdamW (whose weight decay steps any parameter that has a gradient, a zero one too), global clipping by the
2- and inf-norm (a NaN gradient on one rank), accumulation over steps without ``zero_grad`` and under
``no_sync``, ``eval`` between training steps, batch sizes that change from step to step.

Bugs these rows found (regression tests now):
- under data parallelism a parameter that got no gradient on any replica (unused, or not used this step)
  came back from REDUCE_GRAD with a zero gradient, not None: AdamW's weight decay and momentum then moved it
  (the unsplit model leaves it alone);
- ``clip_grad_norm_(norm_type=inf)`` with a NaN gradient on a rank other than 0: gloo's MAX all-reduce drops
  the NaN, so the norm came back finite and ``error_if_nonfinite`` did not fire.
- a Parameter shared by two stages of one rank (tied between the first and last stage of a V schedule) under
  DDP was reduced by both stages' REDUCE_GRAD: the first one's completion overwrote what the other stage's
  backward had added meanwhile (now reduced once, by the later one); under FSDP it was sharded twice (now
  refused at construction, on every rank);
- a buffer updated in forward (an EMA, BatchNorm's statistics) under data parallelism: each replica updated
  its own copy from its own rows, silently unlike any single-process run (now refused at the first such
  forward, naming rank, stage, microbatch, action and buffer).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import RanksFailed, spawn_ranks  # noqa: E402

WORKER = Path(__file__).parent / "ranks" / "train_adv_worker.py"
SPLIT = ["ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"]

# a training loop: batch sizes change (16, 12, 20, 9: uneven parts), eval between steps, accumulation
# without zero_grad, a parameter unused in some steps, clipping, AdamW
LOOP = [
    ["step", 16, 1], ["clip", 0.05, 2], ["opt"], ["zero"],
    ["step", 12, 2], ["eval", 8, 3], ["step", 20, 4], ["clip", 0.05, "inf"], ["opt"], ["zero"],
    ["use", False], ["step", 9, 5], ["opt"], ["zero"], ["use", True],
    ["no_sync_on"], ["step", 16, 6], ["eval", 10, 7], ["no_sync_off"], ["step", 16, 8], ["clip", 0.1, 2], ["opt"], ["zero"],
    ["step", 16, 9], ["nan", -1, "a.weight"], ["clip", 1.0, "inf"], ["zero"],
    ["step", 16, 10], ["nan", 1, "g"], ["clip", 1.0, "inf", True], ["zero"],
]


def _dp(s: str, fsdp: bool) -> dict[str, Any]:
    return dict(id=f"dp-{'fsdp' if fsdp else 'ddp'}-{s}", schedule=s, microbatches=4, dp=2, fsdp=fsdp, script=LOOP)


CASES4_ALL = [_dp(s, fsdp) for s in ["1F1B", *SPLIT] for fsdp in (False, True)] + [
    # one Parameter in the first and the last stage, both on rank 0 under a V schedule
    dict(id="tie-pp4-ZBV", schedule="ZBVZeroBubble", microbatches=4, dp=1, tie_ends=True, script=LOOP),
    dict(id="tie-ddp-ZBV", schedule="ZBVZeroBubble", microbatches=4, dp=2, tie_ends=True, script=LOOP),
    dict(id="tie-ddp-DualPipeV", schedule="DualPipeV", microbatches=4, dp=2, tie_ends=True, script=LOOP),
    # torch.compile'd stages (aot_eager: the autograd graph of a compiled region without inductor's compile time)
    dict(id="compile-pp4-ZBV", schedule="ZBVZeroBubble", microbatches=4, dp=1, compile="aot_eager", script=LOOP[:10]),
    dict(id="compile-pp4-1F1B", schedule="1F1B", microbatches=4, dp=1, compile="aot_eager", script=LOOP[:10]),
    # a buffer updated in forward (an EMA): exact without data parallelism...
    dict(id="ema-pp4-ZBV", schedule="ZBVZeroBubble", microbatches=4, dp=1, ema=True, script=LOOP[:10]),
    # refused: FSDP cannot shard a parameter two stages share
    dict(id="tie-fsdp-ZBV", schedule="ZBVZeroBubble", microbatches=4, dp=2, fsdp=True, tie_ends=True, script=LOOP,
         expect_error="share one parameter"),
    # ...refused with it (each replica would update its copy from its own rows); last: the step fails
    dict(id="ema-ddp-ZBV", schedule="ZBVZeroBubble", microbatches=4, dp=2, ema=True, script=LOOP[:4],
         expect_error="updated the buffer 'running' in place"),
]
# (TADV_ONLY=id,id: run only those rows, while debugging)
CASES4 = [c for c in CASES4_ALL if not os.environ.get("TADV_ONLY") or c["id"] in os.environ["TADV_ONLY"].split(",")]


async def _run(world: int, cases: list[dict[str, Any]], out: Path, timeout: float) -> dict[str, list[dict[str, Any]]]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps({"cases": cases, "out": str(out)}))
    codes, _, errs = await spawn_ranks(world, [str(WORKER), str(out / "job.json")], timeout=timeout)
    if any(c != 0 for c in codes):
        tails = "\n".join(f"--- rank {r} (exit {c}) ---\n{e[-3000:]}" for r, (c, e) in enumerate(zip(codes, errs)))
        raise RanksFailed(f"ranks failed: exit codes {codes}\n{tails}", codes, errs)
    return {c["id"]: [json.loads((out / f"{c['id']}-rank{r}.json").read_text()) for r in range(world)] for c in cases}


@pytest.fixture(scope="module")
def results4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return asyncio.run(_run(4, CASES4, tmp_path_factory.mktemp("tadv4"), timeout=300))


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES4])
def test_training_loop_matches_unsplit_model(results4: dict[str, list[dict[str, Any]]], case_id: str) -> None:
    cfg = next(c for c in CASES4 if c["id"] == case_id)
    if cfg.get("expect_error"):
        for r, res in enumerate(results4[case_id]):
            assert res["errors"], f"rank {r}: not refused"
            assert cfg["expect_error"] in res["errors"][0], f"rank {r}: {res['errors'][0]}"
        return
    for r, res in enumerate(results4[case_id]):
        assert not res["errors"], f"rank {r}: {res['errors'][0]}"
        assert not res["diffs"], f"rank {r}: differs from the unsplit model: {json.dumps(dict(list(res['diffs'].items())[:12]), indent=1)}"
