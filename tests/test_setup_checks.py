"""Mistakes caught early, on real gloo ranks: disagreeing ranks, bad inputs, non-finite values, slow steps.

- Ranks built with different settings (microbatches, schedule) fail at
  construction on every rank, naming the field and each rank's value, within
  seconds (before: the first step hung forever).
- A rank whose construction fails (missing schedule file, a failing
  ``stage_fn``, no ``loss_fn`` on the last stage) stops every rank: under
  ``pipeloom launch`` one root-cause line with the error, a short traceback,
  the peers as consequences, no gloo "Connection closed by peer" noise.
- Step inputs are checked before any compute (rows of the target and of
  keyword tensors; ``Replicate``; a missing target or loss_fn), a float32
  stage feeding a float64 stage is named, and ``check_finite`` names the
  stage, microbatch and action where a NaN/inf first appears.
- The stall budget is generous in a cold step (first, or after the model
  changed: torch.compile compiles then) and strict in a warm one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import spawn_ranks  # noqa: E402

CHECKS_WORKER = str(Path(__file__).parent / "ranks" / "checks_worker.py")
_EXE = shutil.which("pipeloom")
LAUNCH = [_EXE, "launch"] if _EXE else [sys.executable, "-m", "pipeloom.tools.cli", "launch"]

# A script every rank runs: MODE picks what rank 1 does differently.
SCRIPT = textwrap.dedent("""
    import json, os, sys, time, torch, pipeloom
    from torch import nn
    rank = int(os.environ["RANK"])
    mode, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    kw = dict(schedule="Interleaved1F1B", num_microbatches=4, loss_fn=nn.functional.mse_loss,
              heartbeat_timeout=2.0, stall_timeout=2.0, setup_timeout=float(os.environ.get("SETUP_TIMEOUT", "60")))

    def stage_fn(s):
        if mode == "stage_fn" and rank == 1:
            return [nn.Linear(4, 4)][s]          # stage 3 does not exist in the user's list
        return nn.Linear(4, 4)

    if rank == 1:
        if mode == "microbatches":
            kw["num_microbatches"] = 8
        elif mode == "schedule":
            kw["schedule"] = "ZBVZeroBubble"
        elif mode == "csv":
            kw["schedule"] = os.path.join(out, "missing.csv")
        elif mode == "no_loss":
            kw["loss_fn"] = None
        elif mode == "late":                        # joins the job, but builds no Pipeline in time
            # (joins as a Pipeline would: through the store and key prefix its construction uses)
            from pipeloom.runtime.pipeline import _init_process_group
            _init_process_group("gloo")
            time.sleep(6)
            sys.exit(0)
    t0 = time.time()
    try:
        pipe = pipeloom.Pipeline(stage_fn, **kw)
        pipe.step(torch.randn(8, 4), target=torch.randn(8, 4))
        pipe.close()
        rec = {"status": "ok"}
    except Exception as exc:
        rec = {"status": "error", "type": type(exc).__name__, "message": str(exc),
               "failed_rank": getattr(exc, "failed_rank", None)}
        raise
    finally:
        rec["elapsed"] = time.time() - t0
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(rec, f)
""")


def _records(out: Path, world: int = 2) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    p = tmp_path / "build.py"
    p.write_text(SCRIPT)
    return p


# ---------------------------------------------------------------- ranks that disagree


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("microbatches", "num_microbatches differs: rank 0 has 4, rank 1 has 8"),
        ("schedule", "schedule differs: rank 0 has Interleaved1F1B, rank 1 has ZBVZeroBubble"),
    ],
)
async def test_disagreeing_ranks_fail_at_construction(tmp_path: Path, script: Path, mode: str, says: str) -> None:
    codes, _, errs = await spawn_ranks(2, [str(script), mode, str(tmp_path)], timeout=60)
    assert codes == [1, 1], errs
    for r, rec in enumerate(_records(tmp_path)):
        assert rec["type"] == "PipelineConfigError", rec
        assert says in rec["message"], rec["message"]
        assert rec["message"].startswith(f"rank {r}: the ranks built different Pipelines"), rec["message"]
        assert rec["elapsed"] < 20, rec  # seconds, not a hang (a loaded machine: generous)
    for e in errs:
        assert "Connection closed" not in e and "The above exception" not in e, e[-3000:]


async def test_a_rank_that_never_builds_is_named_after_setup_timeout(tmp_path: Path, script: Path) -> None:
    codes, _, errs = await spawn_ranks(2, [str(script), "late", str(tmp_path)], timeout=60, env={"SETUP_TIMEOUT": "2"})
    assert codes == [1, 0], errs
    rec = json.loads((tmp_path / "rank0.json").read_text())
    assert rec["type"] == "PipelineConfigError", rec
    assert "rank 1 did not reach the same point of building the Pipeline" in rec["message"], rec["message"]
    assert "setup_timeout=2 s" in rec["message"], rec["message"]
    assert 2 <= rec["elapsed"] < 10, rec


# ---------------------------------------------------------------- construction errors under pipeloom launch


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("csv", "PipelineConfigError: schedule file '{out}/missing.csv' does not exist"),
        ("stage_fn", "IndexError: list index out of range"),
        ("no_loss", "PipelineConfigError: rank 1 holds the last stage (3) but loss_fn is None"),
    ],
)
def test_construction_error_under_launch_gives_one_root_cause(tmp_path: Path, script: Path, mode: str, error: str) -> None:
    # (--grace 15: the failed rank's own exit, torch's teardown included, is what the summary names; under
    # the default 2 s a loaded 2-core machine sometimes had the launcher stop it first: "still exiting after --grace")
    proc = subprocess.run([*LAUNCH, "--nproc-per-node", "2", "--grace", "15", str(script), mode, str(tmp_path)],
                          capture_output=True, text=True, timeout=90)
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    error = error.format(out=tmp_path)
    at = err.find("pipeloom launch: job failed")
    assert at >= 0, err[-3000:]
    summary = err[at:].splitlines()
    assert summary[0] == "pipeloom launch: job failed: rank 1 exited with code 1", summary
    # the root cause, on one line, with the error text
    assert summary[1].startswith("  root cause: rank 1: ") and error in summary[1], summary
    assert err.count("root cause:") == 1
    # a short traceback: the user's line (and stage_fn's), not the setup's internals
    assert "build.py" in "\n".join(summary[2:]), summary
    assert len(summary) <= 12, "\n".join(summary)
    assert "runtime/pipeline.py" not in "\n".join(summary), summary
    assert summary[-1] == "pipeloom launch: also stopped: rank 0 (consequence of rank 1)", summary
    # the peer stopped quietly: its own error says it is a consequence; no gloo noise, no chains
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["type"] == "RemoteRankError" and r0["failed_rank"] == 1, r0
    assert error.split(": ", 1)[1] in r0["message"], r0["message"]
    assert "Connection closed" not in err and "The above exception was the direct cause" not in err, err[-4000:]
    rank0_lines = [ln for ln in err[:at].splitlines() if ln.startswith("[rank0]")]
    assert len(rank0_lines) <= 10, "\n".join(rank0_lines)


# ---------------------------------------------------------------- step inputs and values


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import asyncio

    out = tmp_path_factory.mktemp("checks")
    codes, _, errs = asyncio.run(spawn_ranks(2, [CHECKS_WORKER, str(out)], timeout=240))
    assert codes == [0, 0], "\n".join(e[-3000:] for e in errs)
    return _records(out)


def test_target_rows_must_match_the_batch(checks: list[dict[str, Any]]) -> None:
    for r, rec in enumerate(checks):
        c = rec["target_rows"]
        assert c["type"] == "PipelineConfigError", c
        assert f"rank {r}: target has 6 rows along dim 0 but the batch has 8" in c["message"], c["message"]


def test_keyword_tensor_is_not_cut_silently_and_replicate_passes_it_whole(checks: list[dict[str, Any]]) -> None:
    for rec in checks:
        c = rec["mask_cut"]
        assert c["type"] == "PipelineConfigError", c
        assert "keyword input 'mask' has 5 rows along dim 0 but the batch has 8" in c["message"], c["message"]
        assert "mask=pipeloom.Replicate(tensor)" in c["message"], c["message"]
    ok = checks[1]["mask_replicated"]
    assert ok["status"] == "ok", ok
    assert ok["losses"] == pytest.approx(ok["reference"], rel=1e-12, abs=0)


def test_a_container_holding_batch_rows_is_refused(checks: list[dict[str, Any]]) -> None:
    # tuples, lists and dicts reach every microbatch whole: a target (y, y) would pair every microbatch with the
    # whole batch (silently, where a microbatch has one row and the loss broadcasts)
    for r, rec in enumerate(checks):
        c = rec["tuple_target"]
        assert c["type"] == "PipelineConfigError", c
        assert f"rank {r}: target is a tuple whose element [0] has the batch's 8 rows" in c["message"], c["message"]
        assert "pipeloom.Microbatches" in c["message"] and "pipeloom.Replicate" in c["message"], c["message"]


def test_a_keyword_tensor_that_requires_grad_is_refused(checks: list[dict[str, Any]]) -> None:
    # every stage gets it, on every rank: each rank's copy would hold only its own stages' gradient share
    for r, rec in enumerate(checks):
        c = rec["mask_grad"]
        assert c["type"] == "PipelineConfigError", c
        assert f"rank {r}: keyword input 'mask' requires grad" in c["message"], c["message"]
        assert "only the gradient of its own stages" in c["message"], c["message"]


def test_return_outputs_false_drops_each_output_after_its_loss(checks: list[dict[str, Any]]) -> None:
    # GPipe, 4 microbatches, the last stage's loss graph does not hold its output: kept, every earlier
    # output is alive at each forward (held for the merged return); not kept, none is
    last = checks[1]["return_outputs"]
    assert last.get("status") == "ok", last
    kept, dropped = last["True"], last["False"]
    assert kept["alive"][:4] == [0, 1, 2, 3] and kept["out_rows"] == 8 and kept["eval_rows"] == 8, kept
    assert dropped["alive"][:4] == [0, 0, 0, 0] and dropped["out_rows"] is None and dropped["eval_rows"] is None, dropped
    # the same step either way: losses and gradients equal, on both ranks
    for rec in checks:
        r = rec["return_outputs"]
        assert r["True"]["grads"] == r["False"]["grads"] and r["True"]["losses"] == r["False"]["losses"], r
    assert checks[0]["return_outputs"]["True"]["out_rows"] is None  # not the last stage's rank
    assert len(last["True"]["losses"]) == 4


def test_profile_ranges_name_every_action_wait_and_send(checks: list[dict[str, Any]]) -> None:
    # 1F1B, 4 microbatches, rank 1's forward sleeps 50 ms: rank 0 waits for its first gradient
    r0, r1 = (c["profile_ranges"] for c in checks)
    assert r0.get("status") == "ok" and r1.get("status") == "ok", (r0, r1)
    n0, n1 = set(r0["names"]), set(r1["names"])
    assert {f"PP:0F{m}" for m in range(4)} | {f"PP:0B{m}" for m in range(4)} <= n0, n0
    assert {f"PP:1F{m}" for m in range(4)} | {f"PP:1B{m}" for m in range(4)} <= n1, n1
    assert "PP:send" in n0 and "PP:send" in n1  # activations out of rank 0, gradients out of rank 1
    assert "PP:wait 0B0" in n0, n0  # rank 0, its two forwards done, waits for microbatch 0's gradient
    waits = {n for n in n0 | n1 if n.startswith(("PP:wait ", "PP:hold "))}
    assert all(n.split(" ", 1)[1] in {f"{s}{t}{m}" for s in (0, 1) for t in "FB" for m in range(4)} for n in waits), waits


def test_missing_target_or_loss_fn_is_named(checks: list[dict[str, Any]]) -> None:
    c = checks[1]["no_target"]
    assert c["type"] == "PipelineConfigError" and "step() got no target" in c["message"], c
    assert checks[0]["no_target"]["type"] == "RemoteRankError"  # rank 0 does not need the target: it hears why
    # ... also when its send to rank 1 breaks because rank 1 already closed: the abort came first
    busy = checks[0]["no_target_while_busy"]
    assert busy["type"] == "RemoteRankError" and busy["failed_rank"] == 1 and "got no target" in busy["message"], busy
    c = checks[1]["no_loss_fn_at_construction"]
    assert c["type"] == "PipelineConfigError", c
    assert "rank 1 holds the last stage (1) but loss_fn is None" in c["message"], c["message"]
    c0 = checks[0]["no_loss_fn_at_construction"]
    assert c0["type"] == "RemoteRankError" and c0["failed_rank"] == 1 and "loss_fn is None" in c0["message"], c0
    c = checks[1]["forward_only_then_step"]
    assert c["type"] == "PipelineConfigError" and "has no loss_fn" in c["message"], c
    assert checks[1]["forward_only_eval"] == {"status": "ok", "out_rows": 8}


def test_host_overlap_fails_loudly_when_forwards_start_drawing_beside_a_recomputation(checks: list[dict[str, Any]]) -> None:
    # the first training step (inline) drew nothing, so the second overlapped its backwards; its forwards drew:
    # an activation checkpoint's recomputation beside them could have taken other masks, so the step fails
    recs = [c["overlap_draws_later_ckpt"] for c in checks]
    for c in recs:
        assert c["status"] == "error" and "host_overlap_backward" in c["message"], c
        assert "drew random numbers" in c["message"] and "step 1" in c["message"], c
    assert any(c["type"] == "PipelineError" and "activation checkpointing" in c["message"] for c in recs), recs


def test_host_overlap_turns_off_when_forwards_start_drawing_without_recomputation(checks: list[dict[str, Any]]) -> None:
    # no checkpoint: the backwards draw nothing, so the forwards' draws beside them took the inline run's masks;
    # the step stands and the overlap is off from the next one (every rank whose forwards drew)
    for c in (c["overlap_draws_later"] for c in checks):
        assert c["status"] == "ok", c
        (s0, n0), (s1, n1), (s2, n2) = c["steps"]
        assert n0 == 0 and n1 > 0 and n2 == 0, c


def test_dtype_mismatch_between_stages_names_both(checks: list[dict[str, Any]]) -> None:
    c = checks[1]["dtype_mismatch"]
    assert c["type"] == "StageError" and c["stage"] == 1, c
    assert "stage 0 (rank 0) outputs float32 but stage 1 (rank 1) holds float64 parameters" in c["message"], c["message"]
    assert checks[0]["dtype_mismatch"]["type"] == "RemoteRankError"
    # mixing dtypes is allowed where the stage handles it
    assert checks[1]["dtype_cast_in_stage"]["status"] == "ok", checks[1]["dtype_cast_in_stage"]


@pytest.mark.parametrize(
    ("case", "rank", "says"),
    [
        ("nan_forward", 1, "non-finite output first seen in stage 1, microbatch 2, action 1F2"),
        ("nan_loss", 1, "non-finite loss first seen in stage 1, microbatch 3, action 1F3"),
        ("nan_backward_B", 1, "non-finite input gradient first seen in stage 1, microbatch 0, action 1B0"),
        ("nan_param_grad", 0, "non-finite gradient first seen after stage 0, microbatch 0, action 0B0: weight.grad"),
    ],
)
def test_check_finite_names_where_a_nan_first_appears(checks: list[dict[str, Any]], case: str, rank: int, says: str) -> None:
    c = checks[rank][case]
    assert c["type"] == "StageError", c
    assert "FloatingPointError" in c["message"] and says in c["message"], c["message"]
    assert checks[1 - rank][case]["type"] == "RemoteRankError"


def test_check_finite_in_the_split_backward_and_off_by_default(checks: list[dict[str, Any]]) -> None:
    c = checks[1]["nan_backward_I"]
    assert c["type"] == "StageError" and c["stage"] == 1, c
    assert "non-finite input gradient first seen in stage 1, microbatch 0, action 1I0" in c["message"], c["message"]
    assert checks[1]["nan_loss_unchecked"]["status"] == "ok"  # without check_finite nothing is checked
    assert checks[1]["finite_ok"]["status"] == "ok" and len(checks[1]["finite_ok"]["losses"]) == 4


# ---------------------------------------------------------------- stall budget: compile-aware


STALL = textwrap.dedent("""
    import json, os, sys, time, torch, pipeloom
    from torch import nn
    rank = int(os.environ["RANK"])
    out = sys.argv[1]
    SLOW = {0: 3.0, 1: 3.0, 2: 3.0}           # seconds rank 1's forward sleeps in each step

    class Slow(nn.Linear):
        step = 0
        def forward(self, x):
            if rank == 1 and self.calls == 0 and self.step in SLOW:
                time.sleep(SLOW[self.step])
            self.calls += 1
            return super().forward(x)

    torch.manual_seed(0)
    mods = [nn.Sequential(Slow(4, 4), nn.Linear(4, 4)) for _ in range(2)]
    pipe = pipeloom.Pipeline(lambda s: mods[s], schedule="1F1B", num_microbatches=2, loss_fn=nn.functional.mse_loss,
                             heartbeat_interval=0.2, heartbeat_timeout=10, stall_timeout=1.0, first_step_stall_timeout=20)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    done = []
    try:
        for step in range(3):
            for m in mods:
                m[0].step, m[0].calls = step, 0
            if step == 1:
                mods[rank][1].weight.requires_grad_(False)   # the model changed: a cold step again
            pipe.step(x, target=y)
            done.append(step)
        rec = {"status": "ok"}
    except Exception as exc:
        rec = {"status": "error", "type": type(exc).__name__, "message": str(exc)}
    rec["done"] = done
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
""")


async def test_slow_cold_steps_pass_and_a_slow_warm_step_is_a_stall(tmp_path: Path) -> None:
    script = tmp_path / "stall.py"
    script.write_text(STALL)
    t0 = time.monotonic()
    codes, _, errs = await spawn_ranks(2, [str(script), str(tmp_path)], timeout=90)
    r0, r1 = _records(tmp_path)
    # steps 0 (first) and 1 (requires_grad changed) are cold: 3 s is within their 20 s budget
    assert r0["done"] == [0, 1], (r0, errs[0][-2000:])
    # step 2 is warm: 3 s in one action is over the 1 s stall timeout
    assert r0["type"] == "PeerLostError", r0
    assert "lost rank 1: it has been running 1F0 for" in r0["message"], r0["message"]
    assert "(stall timeout 1 s)" in r0["message"], r0["message"]
    assert "--stall-timeout" in r0["message"] and "first_step_stall_timeout" in r0["message"], r0["message"]
    assert r1["done"] == [0, 1] and r1["type"] == "RemoteRankError", r1
    assert time.monotonic() - t0 < 60
