"""Ranks that disagree, on real gloo ranks: every rank fails within seconds with the same clear error.

Found by the disagreement sweep (each case hung, crashed a rank inside gloo, named a live rank lost, or
trained another model silently before its fix):

- ``PIPELOOM_JOB_SECRET`` set on some ranks only: the ranks without it waited in the secret's broadcast,
  the others in the next collective (a hang in the constructor); set to different values: every control
  message was dropped as forged, and a waiting rank named its live peer lost after the heartbeat timeout.
- ``pair_groups`` on one rank only (``static_shapes=False``): one rank created process groups alone, its
  peer named it lost ("no heartbeat") while it was building.
- a ``heartbeat_interval`` above half a peer's ``heartbeat_timeout``: a live, idle peer named lost.
- batches of different sizes on the ranks: microbatches cut differently on each rank; the last stage's
  loss broadcast one rank's outputs against other rows of the target, silently.
- a keyword input passed on one rank only: that rank's stages ran another model, silently.
- one rank ``eval`` while the others ``step`` under ``static_shapes=False``: the receiving rank was
  ended by gloo's C++ ``terminate`` (a packed header+payload in a smaller receive), its peer said only
  "the process exited or was killed".
- data-parallel replicas whose stage tensors differ (shape: gloo's ``terminate`` in the construction
  broadcast; dtype: replica 0's bytes copied into another dtype, silently).
- a rank that closes its Pipeline early: named at once, and the error says what this rank waited for
  (it said "data-parallel collectives" in a job without any).

One pool of 2 ranks runs the cases in order (one process group, a Pipeline per case) and one of 4 ranks
the data-parallel ones; each rank writes what every case raised and how long it took.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import spawn_ranks  # noqa: E402

SCRIPT = r'''
import json, os, sys, time
import torch
import torch.distributed as dist
from torch import nn
import pipeloom

torch.set_num_threads(1)
out, cases = sys.argv[1], sys.argv[2].split(",")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
D = 4


def build(**kw):
    opts = kw.pop("options", {})
    base = dict(schedule="1F1B", num_microbatches=4,
                loss_fn=nn.functional.mse_loss, heartbeat_timeout=3.0, setup_timeout=20.0)
    base.update(kw)
    dims = base.pop("dims", (D, D))
    dtype = base.pop("dtype", torch.float32)
    return pipeloom.Pipeline(lambda s: nn.Linear(*dims, dtype=dtype), options=pipeloom.RuntimeOptions(**opts), **base)


def batch(rows=8):
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)


def case(name):
    one = rank == 1
    pipe = None
    try:
        if name == "secret-one":
            if one:
                os.environ["PIPELOOM_JOB_SECRET"] = "s3cret"
            pipe = build()
        elif name == "secret-differs":
            os.environ["PIPELOOM_JOB_SECRET"] = "s3cret" if one else "other"
            pipe = build()
        elif name == "pair-groups":
            pipe = build(options=dict(static_shapes=False, pair_groups=one))
        elif name == "heartbeat":
            pipe = build(heartbeat_interval=2.5 if one else 0.5)
        elif name.startswith("rows"):
            pipe = build(options=dict(static_shapes=False) if name == "rows-headers" else {})
            x, y = batch(6 if one else 8)
            pipe.step(x, target=y)
        elif name == "kwarg":
            pipe = build()
            x, y = batch()
            pipe.step(x, target=y, **({"scale": torch.ones(8, D)} if one else {}))
        elif name == "eval-headers":
            pipe = build(options=dict(static_shapes=False))
            x, y = batch()
            pipe.step(x, target=y)
            (pipe.eval if one else pipe.step)(x, target=y)
        elif name == "eval-static":  # (no per-step agreement: every rank waits on the other, heartbeats flowing)
            pipe = build(options=dict(static_shapes=True), stall_timeout=2.0, first_step_stall_timeout=2.0)
            x, y = batch()
            pipe.step(x, target=y)
            (pipe.eval if one else pipe.step)(x, target=y)
        elif name in ("replica-shape", "replica-dtype"):
            odd = rank % 2 == 1  # the second replica of each stage
            kw = {"dims": (D, D + 2 if odd else D)} if name == "replica-shape" else {"dtype": torch.float64 if odd else torch.float32}
            pipe = build(data_parallel=2, **kw)
        elif name == "agree":  # the same calls everywhere still train (keyword inputs, a rank passing no batch)
            pipe = build()
            x, y = batch()
            pipe.step(x if rank == 0 else None, target=y if pipe.has_last_stage else None)
            pipe.eval(x, target=y)
        elif name == "close-early":
            pipe = build()
            x, y = batch()
            pipe.step(x, target=y)
            if one:
                pipe.close()
                time.sleep(3)
                return {"status": "ok"}
            pipe.step(x, target=y)
        return {"status": "ok"}
    except Exception as exc:
        return {"status": "error", "type": type(exc).__name__, "message": str(exc)}
    finally:
        os.environ.pop("PIPELOOM_JOB_SECRET", None)
        if pipe is not None:
            pipe.close()


dist.init_process_group("gloo")
report = {}
for name in cases:
    t0 = time.monotonic()
    rec = case(name)
    rec["elapsed"] = time.monotonic() - t0
    report[name] = rec
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if name == "close-early":
        os._exit(0)  # (last: rank 0's failed step leaves its gather with rank 1 pending in gloo)
dist.destroy_process_group()
'''

CASES_2 = ["secret-one", "secret-differs", "pair-groups", "heartbeat", "rows", "rows-headers", "kwarg", "eval-headers",
           "agree", "close-early"]
CASES_4 = ["replica-shape", "replica-dtype"]
CASES_STUCK = ["eval-static"]  # (its own pool: the waits it breaks leave that process group unusable)


async def _run(tmp: Path, world: int, cases: list[str]) -> list[dict[str, Any]]:
    script = tmp / "disagree.py"
    script.write_text(SCRIPT)
    codes, _, errs = await spawn_ranks(world, [str(script), str(tmp), ",".join(cases)], timeout=90)
    assert all(c == 0 for c in codes), (codes, [e[-3000:] for e in errs])
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return asyncio.run(_run(tmp_path_factory.mktemp("disagree2"), 2, CASES_2))


@pytest.fixture(scope="module")
def stuck(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return asyncio.run(_run(tmp_path_factory.mktemp("disagree-stuck"), 2, CASES_STUCK))


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return asyncio.run(_run(tmp_path_factory.mktemp("disagree4"), 4, CASES_4))


def _all_fail(recs: list[dict[str, Any]], name: str, kind: str, *says: str, within: float = 15.0) -> None:
    for r, rec in enumerate(recs):
        c = rec[name]
        assert c["status"] == "error" and c["type"] == kind, (r, c)
        assert c["message"].startswith(f"rank {r}"), (r, c["message"])
        for s in says:
            assert s in c["message"], (r, c["message"])
        assert c["elapsed"] < within, (r, c)  # seconds, not a timeout (a loaded 2-core machine: generous)


@pytest.mark.timeout(150)
def test_job_secret_on_some_ranks_or_different_fails_at_construction(two: list[dict[str, Any]]) -> None:
    _all_fail(two, "secret-one", "PipelineConfigError", "PIPELOOM_JOB_SECRET differs: rank 0 has unset",
              "rank 1 has set (digest ")
    _all_fail(two, "secret-differs", "PipelineConfigError", "PIPELOOM_JOB_SECRET differs: rank 0 has set (digest ")
    for rec in two:  # the secret itself is never shown
        assert "s3cret" not in rec["secret-one"]["message"] and "other" not in rec["secret-differs"]["message"]


@pytest.mark.timeout(150)
def test_pair_groups_and_heartbeats_are_agreed(two: list[dict[str, Any]]) -> None:
    _all_fail(two, "pair-groups", "PipelineConfigError", "pair_groups differs: rank 0 has false, rank 1 has true")
    _all_fail(two, "heartbeat", "PipelineConfigError",
              "rank 1's heartbeat_interval (2.5 s) exceeds half of rank 0's heartbeat_timeout (3 s)")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", ["rows", "rows-headers"])
def test_batches_of_different_sizes_are_refused_at_the_step(two: list[dict[str, Any]], name: str) -> None:
    _all_fail(two, name, "PipelineConfigError", "step 0: the ranks pass batches of different sizes",
              "rank 0 passes 8 rows, rank 1 passes 6 rows")


@pytest.mark.timeout(150)
def test_a_keyword_input_on_one_rank_is_refused(two: list[dict[str, Any]]) -> None:
    _all_fail(two, "kwarg", "PipelineConfigError", "step 0: the ranks pass different keyword inputs (ranks 0 | 1 differ")
    assert "this rank passes ['scale']" in two[1]["kwarg"]["message"]
    assert "this rank passes none" in two[0]["kwarg"]["message"]


@pytest.mark.timeout(150)
def test_eval_against_step_with_the_header_protocol_is_named_not_a_crash(two: list[dict[str, Any]]) -> None:
    _all_fail(two, "eval-headers", "PipelineError", "step 1: the ranks disagree on the kind of step",
              "rank(s) 0 run a training step", "rank(s) 1 an evaluation step")


@pytest.mark.timeout(150)
def test_ranks_that_agree_still_train(two: list[dict[str, Any]]) -> None:
    # a rank may pass None for what it does not use (its batch size is then not compared)
    for rec in two:
        assert rec["agree"]["status"] == "ok", rec["agree"]


@pytest.mark.timeout(150)
def test_a_rank_that_closes_early_is_named_with_what_was_awaited(two: list[dict[str, Any]]) -> None:
    c = two[0]["close-early"]
    assert c["status"] == "error" and c["type"] == "PeerLostError", c
    assert "lost rank 1: it closed its Pipeline after 1 step(s) while this rank is in step 1" in c["message"], c
    assert "data-parallel collectives" not in c["message"] and "waiting for the ranks' input layouts" in c["message"], c
    assert two[1]["close-early"]["status"] == "ok"


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("name", "says"), [
    ("replica-shape", "rank 0 has weight float32[4, 4], rank 1 has weight float32[6, 4]"),
    ("replica-dtype", "rank 0 has weight float32[4, 4], rank 1 has weight float64[4, 4]"),
])
def test_replicas_with_different_stage_tensors_fail_at_construction(four: list[dict[str, Any]], name: str, says: str) -> None:
    _all_fail(four, name, "PipelineConfigError", "stage 0 differs between the ranks that hold it", says)


@pytest.mark.timeout(150)
def test_eval_against_step_with_static_shapes_is_named_from_the_heartbeats(stuck: list[dict[str, Any]]) -> None:
    """``static_shapes=True`` has no per-step agreement: rank 1 in ``eval`` and rank 0 in ``step`` each waited
    for a transfer the other never sends, heartbeats flowing, forever.  Now the heartbeats carry the kind of the
    step (protocol 6), and a waiting rank that hears a peer run its step as the other kind ends the step on every
    rank, with the per-step agreement's wording.  (Were the kinds alike and the waits endless anyway, every rank
    waiting longer than the stall budget ends it too: ``tests/test_liveness.py``.)"""
    for r, rec in enumerate(stuck):
        c = rec["eval-static"]
        assert c["status"] == "error" and c["type"] in ("PipelineError", "RemoteRankError"), (r, c)
        assert "the ranks disagree on the kind of step" in c["message"], (r, c)
        assert "rank(s) 0 run a training step" in c["message"] and "rank(s) 1 an evaluation step" in c["message"], (r, c)
        assert c["elapsed"] < 8.0, (r, c)  # a heartbeat interval and a liveness check, not a hang
