"""Expert parallelism, adversarially: pp 2 x ep 2 on 4 real gloo ranks against the unsplit model (float64).

Each case (``tests/ranks/moe_adv_worker.py``) builds a Pipeline of MoE stages whose experts are sharded over
each stage's 2 ep ranks and runs a script of training-loop operations on it; every rank runs the same script
on the unsplit model with every expert on one process and compares after each operation (gradients of the
stages it holds, expert tensors by the rows it holds; clip norms; losses; outputs; ``last_loss``; parameters
after AdamW steps).  Covered: top-k among tied router logits and tied slot order, capacity overflow (dropped
assignments), an expert that never gets a token, uneven expert counts per stage (1 expert per rank, top-k of
3), a Switch load-balancing loss carried to the loss beside the output, a shared expert beside the routed
ones, MoE only in the first and the last stage, a router weight tied between the first and the last stage, a
whole MoE block shared by them, every named schedule (I/W split through the all-to-all; DualPipeV's
OVERLAP_F_B pairs, with and without ``overlap_input_only``), global clipping by the 2- and the inf-norm,
microbatches whose token counts change between steps, eval between steps, checkpoints resumed under the same
layout and under pp 4 without expert parallelism, data parallelism beside expert parallelism (pp 1 x dp 2 x
ep 2), and refusals: a batch whose rows the columns cannot share evenly, ranks that disagree on the ep size or
on an MoE's capacity.  One pool of 4 ranks runs every row (about 55 s on 2 cores).

Bugs these rows found (regression tests now):
- gradient accumulation over steps (no ``zero_grad`` between them; ``no_sync``'s last step too): REDUCE_GRAD
  divided an expert's whole ``.grad`` by the columns, so the earlier steps' part was divided again (halved
  at ep 2), silently; each backward's contribution is now scaled as it is accumulated (base-1F1B, dp2-ep2);
- an MoE block shared by two local stages (the first and the last of a V schedule): its expert parameters
  went through the shared-parameter path, an all-reduce over every column, which averaged this rank's
  experts with its ep peer's other experts (wrong from the first step) (tie-moe-*);
- a batch whose rows the dp x ep columns cannot share evenly (17 rows, 2 columns): the ep peers' all-to-alls
  had other sizes and gloo ended a process from C++ ("Received data size doesn't match"), the others saw
  it gone; now refused at the step on every rank (uneven-columns);
- ``save_checkpoint`` with an MoE block shared by two local stages: a KeyError on the ranks holding it
  (the expert shards' mesh lookup listed a shared parameter under one of its keys), while the other ranks
  went on into the save's next collective and waited there (ck-save-tie-moe-ZBV; resumed exactly now);
- ep peers whose MoE layers differ in a non-tensor setting (capacity factor, top_k): the same C++ end; now
  refused at construction (disagree-capacity).
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
from harness import run_job  # noqa: E402

WORKER = Path(__file__).parent / "ranks" / "moe_adv_worker.py"

# token counts change between steps (rows x seq: 16x3, 12x5, 20x2), eval between steps, clipping by the 2- and inf-norm
LOOP = [
    ["step", 16, 3, 1], ["clip", 0.05, 2], ["opt"], ["zero"],
    ["step", 12, 5, 2], ["eval", 8, 3, 3], ["step", 20, 2, 4], ["clip", 0.05, "inf"], ["opt"], ["zero"],
]
SHORT = LOOP[:4]
# pp 1 x dp 2 x ep 2: 4 columns of 4 microbatches; accumulation under no_sync too
DP_LOOP = [
    ["step", 16, 3, 1], ["clip", 0.05, 2], ["opt"], ["zero"],
    ["step", 24, 5, 2], ["eval", 16, 3, 3], ["step", 20, 2, 4], ["clip", 0.05, "inf"], ["opt"], ["zero"],
    ["no_sync_on"], ["step", 16, 3, 5], ["no_sync_off"], ["step", 16, 2, 6], ["clip", 0.05, 2], ["opt"], ["zero"],
]
# a checkpoint after step 2 (op 8); a resumed run starts at op 9
CK = [*LOOP, ["save", 2], ["step", 16, 3, 5], ["clip", 0.5, 2], ["opt"], ["zero"], ["step", 8, 4, 6], ["opt"], ["zero"]]
RESUME = dict(script=CK, start=11, load_step=2)

CASES_ALL: list[dict[str, Any]] = [
    dict(id="base-1F1B", schedule="1F1B", microbatches=4, script=LOOP),
    # every router logit equal (top-k among ties) on tokens that repeat (ties in the slot order), capacity
    # factor 0.5: many assignments dropped
    dict(id="ties-overflow-ZBV", schedule="ZBVZeroBubble", microbatches=4, zero_router=True, dup=True, cf=0.5, script=LOOP),
    # the last expert of every stage gets no token in any microbatch
    dict(id="dead-expert-IZB", schedule="InterleavedZeroBubble", microbatches=4, dead_expert=True, script=LOOP),
    # stage 0: 2 experts (one per ep rank) top-2; stage 1: 8, stage 2: 6 top-3; stage 3 none
    dict(id="uneven-experts-DualPipeV", schedule="DualPipeV", microbatches=4, experts=[2, 8, 6], top_k=3, script=LOOP),
    # a load-balancing loss carried to the loss beside the output, a shared expert; pairs as (F;I) then W
    dict(id="aux-shared-DualPipeV-fi", schedule="DualPipeV", microbatches=4, aux=True, shared=True,
         overlap_input_only=True, script=LOOP),
    dict(id="aux-Interleaved1F1B", schedule="Interleaved1F1B", microbatches=4, aux=True, script=LOOP),
    # MoE in the first and the last stage only
    dict(id="first-last-GPipe", schedule="GPipe", microbatches=4, experts={"first": 4, "last": 4}, script=LOOP),
    # ties between the first and the last stage (both on rank 0 and 1 under a V schedule)
    dict(id="tie-router-ZBV", schedule="ZBVZeroBubble", microbatches=4, tie="router", script=LOOP),
    # (6 experts: the router's [6, 6] weight is the last stage's dense weight)
    dict(id="tie-dense-router-DualPipeV", schedule="DualPipeV", microbatches=4, tie="dense_router", experts=6, script=LOOP),
    dict(id="tie-moe-ZBV", schedule="ZBVZeroBubble", microbatches=4, tie="moe", script=LOOP),
    dict(id="tie-moe-DualPipeV", schedule="DualPipeV", microbatches=4, tie="moe", aux=True, script=LOOP),
    # checkpoints: saved at pp 2 x ep 2, resumed under the same layout and under pp 4 without ep
    dict(id="ck-save-ZBV", schedule="ZBVZeroBubble", microbatches=4, script=CK, ckpt="a"),
    dict(id="ck-load-ZBV", schedule="ZBVZeroBubble", microbatches=4, **RESUME, load="a"),
    dict(id="ck-load-pp4-1F1B", schedule="1F1B", microbatches=4, ep=1, replay_cols=2, **RESUME, load="a"),
    # ... with an MoE block shared by the first and the last stage (its expert shards under two names)
    dict(id="ck-save-tie-moe-ZBV", schedule="ZBVZeroBubble", microbatches=4, tie="moe", script=CK, ckpt="t"),
    dict(id="ck-load-tie-moe-ZBV", schedule="ZBVZeroBubble", microbatches=4, tie="moe", **RESUME, load="t"),
    # data parallelism beside expert parallelism: pp 1 x dp 2 x ep 2
    dict(id="dp2-ep2-1F1B", schedule="1F1B", microbatches=4, dp=2, dead_expert=True, script=DP_LOOP),
    # ... and a whole MoE block shared by the two local stages of a V schedule (pp 1: both on every rank)
    dict(id="dp2-ep2-tie-moe-ZBV", schedule="ZBVZeroBubble", microbatches=4, dp=2, tie="moe", script=DP_LOOP),
    # refused: 18 rows do not split evenly over 4 columns... (2 columns: 9 and 9 do; 17: 9 and 8 do not)
    dict(id="uneven-columns", schedule="1F1B", microbatches=4, script=[["step", 17, 3, 1]],
         expect_error="cannot share evenly ([9, 8] rows)"),
    # refused: ranks that disagree on the ep size, or on an MoE's capacity (a non-tensor setting)
    dict(id="disagree-ep", schedule="1F1B", microbatches=4, rank_cfg={"3": {"ep": 1}}, script=SHORT,
         expect_error="mesh differs"),
    dict(id="disagree-capacity", schedule="1F1B", microbatches=4, rank_moe={"1": {"cf": 2.0}}, script=SHORT,
         expect_error="'capacity_factor': 1.0, 'ep_size': 2}, rank 1 has moe MoE{"),
]
# (MADV_ONLY=id,id: run only those rows, while debugging)
_ONLY = os.environ.get("MADV_ONLY", "").split(",")
CASES = [c for c in CASES_ALL if _ONLY == [""] or c["id"] in _ONLY]


async def _run(world: int, cases: list[dict[str, Any]], out: Path, ckroot: Path, timeout: float) -> dict[str, list[dict[str, Any]]]:
    return await run_job(world, WORKER, cases, out, ckroot, timeout)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("madv")
    return asyncio.run(_run(4, CASES, base / "out", base, timeout=240))


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_expert_parallel_matches_unsplit_model(results: dict[str, list[dict[str, Any]]], case_id: str) -> None:
    cfg = next(c for c in CASES if c["id"] == case_id)
    ranks = results[case_id]
    if cfg.get("expect_error"):
        for r, res in enumerate(ranks):
            assert res["errors"], f"rank {r}: not refused"
            first = res["errors"][0].splitlines()[0]
            assert cfg["expect_error"] in first, f"rank {r}: {res['errors'][0]}"
            assert f"rank {r}" in first, f"rank {r} not named: {first}"
        return
    for r, res in enumerate(ranks):
        assert not res["errors"], f"rank {r}: {res['errors'][0]}"
        assert not res["diffs"], f"rank {r}: differs from the unsplit model: {json.dumps(dict(list(res['diffs'].items())[:12]), indent=1)}"
