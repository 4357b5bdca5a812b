"""What one replica or one rank does alone, on 4 real gloo ranks (``tests/ranks/replica_adv_worker.py``).

- FSDP (pp 2 x FSDP 2) where a parameter gets a gradient on one replica only (a branch its microbatches take
  and the other replica's do not; a whole FSDP unit under ``fsdp_wrap="blocks"``) and one never used, through
  pipeloom's own reduce-scatter, FSDP2's (``fsdp_reduce="fsdp"``) and mixed precision (FSDP2's, float32):
  gradients after every step (accumulated without ``zero_grad`` too), the clip norm and AdamW's parameters
  equal the unsplit model's (float64; float32's tolerance with mixed precision); a parameter no replica used
  keeps ``grad`` None.
- ``save_checkpoint`` / ``load_checkpoint`` where one rank fails alone (its state cannot be gathered, rank 0's
  ``extra`` cannot be pickled, rank 0 cannot create the directory or write the marker, a rank's DCP write or
  read fails): every rank raises within seconds, naming the rank that failed, and the job goes on.
- expert parallelism: a backward the user runs outside the Pipeline (a regulariser over the stage modules,
  between steps or after ``close()``) adds the plain gradient to expert parameters, not one scaled by 1/ep.
- ``pipeloom launch`` (2 ranks), a script that catches a failed step's ``StageError`` and steps again.

Bugs these rows found (regression tests now):
- FSDP2's own reduce-scatter (``fsdp_reduce="fsdp"``, and every mixed-precision or offload policy) with a
  parameter that had a gradient on one replica only: FSDP2 reduce-scatters only the parameters that hold a
  gradient on its rank (and a unit where none does not at all), so the replicas' collectives differed in size
  and gloo ended the processes from C++ ("Received data size doesn't match"; NCCL would pair them with the
  next collective).  Now every trainable parameter gets a zero gradient where it has none before FSDP's
  reduce-scatter, and one small all-reduce beside it gives ``grad`` None back to those no replica had one for.
- expert parallelism: the hooks that scale each backward's expert gradient by 1/ep (registered at
  construction, removed at ``close``) scaled a backward the user ran over the stage modules between steps too:
  a regulariser's gradient on expert parameters came out divided by ep, silently.  They now scale only while
  a step of the Pipeline runs.
- ``save_checkpoint`` / ``load_checkpoint`` where one rank raised alone before a collective of the call (rank
  0 could not create the directory, pickle ``extra`` or write the marker; a rank could not gather its state
  or read the metadata): its peers waited in the call's next collective until the process group's timeout
  (30 minutes on gloo).  Each rank-local part of the call is now agreed: every rank raises a
  ``CheckpointError`` naming the rank that failed, at once, and the job can go on.  A DCP write or read that
  failed on one rank reached every rank as DCP's ``CheckpointException``, a ``BaseException`` that a training
  loop's ``except Exception`` missed: now a ``CheckpointError`` naming the rank too.
- a script that caught a failed step's error and stepped again (under ``pipeloom launch``): the failing
  rank's next step waited for its peer, which had re-raised its stored error at once, until that peer closed
  (``PeerLostError``) or forever; the launcher's summary then blamed whichever rank was still exiting when
  the grace ran out, or, had every rank exited within it, the job exited 0.  A failed step is now the
  Pipeline's last on every rank: the next ``step``/``eval`` raises a ``PipelineError`` naming it, at once; the
  launcher names the rank that reported the failure as the root cause (exit 1) also where it exited 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import launch_script, run_job  # noqa: E402

WORKER = Path(__file__).parent / "ranks" / "replica_adv_worker.py"



def script(n: int) -> list[list[Any]]:
    """``odd`` rows: replica 0's first microbatch has 3 rows (odd: `odd` and `oddblk` used), its others and
    replica 1's 2 (9 rows for 2 microbatches: 3, 2 | 2, 2); ``even`` rows: no replica uses them."""
    odd, even = 4 * n + 1, 4 * n
    return [["step", odd, 1], ["step", odd, 2], ["clip", 0.5], ["opt"], ["zero"],
            ["step", even, 3], ["clip", 0.5], ["opt"], ["zero"], ["step", odd, 4], ["opt"]]


def _fsdp(cid: str, schedule: str = "1F1B", n: int = 2, **kw: Any) -> dict[str, Any]:
    return dict(id=cid, kind="fsdp", schedule=schedule, microbatches=n, script=script(n), **kw)


def _ck(cid: str, fault: str, who: int, **kw: Any) -> dict[str, Any]:
    return dict(id=cid, kind="ckpt", fault=fault, who=who, **kw)


CASES_ALL = [
    _fsdp("fsdp-own-blocks", wrap="blocks"),
    _fsdp("fsdp-fsdp-stage", reduce="fsdp"),
    _fsdp("fsdp-fsdp-blocks-ZBV", reduce="fsdp", wrap="blocks", schedule="ZBVZeroBubble", n=4),
    _fsdp("fsdp-mp-blocks", mp=True, wrap="blocks"),
    _ck("save-state", "state_dict", 1),
    _ck("save-extra", "unpicklable_extra", 0),
    _ck("save-mkdir", "mkdir", 0),
    _ck("save-marker", "finalize", 0),
    _ck("save-write", "write", 1),
    _ck("load-metadata", "read_metadata", 1, load=True),
    _ck("load-data", "read_data", 1, load=True),
    dict(id="ep-outside-backward", kind="ep"),
]
_ONLY = os.environ.get("RADV_ONLY", "").split(",")
CASES = [c for c in CASES_ALL if _ONLY == [""] or c["id"] in _ONLY]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("radv")
    return asyncio.run(run_job(4, WORKER, CASES, base / "out", base, timeout=float(os.environ.get("RADV_TIMEOUT", 240))))


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES if c["kind"] in ("fsdp", "ep")])
def test_gradients_match_the_unsplit_model(results: dict[str, list[dict[str, Any]]], case_id: str) -> None:
    for r, res in enumerate(results[case_id]):
        assert not res["errors"], f"rank {r}: {res['errors'][0]}"
        assert not res["diffs"], f"rank {r}: differs from the unsplit model: {json.dumps(dict(list(res['diffs'].items())[:12]), indent=1)}"


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES if c["kind"] == "ckpt"])
def test_a_checkpoint_one_rank_fails_stops_every_rank_naming_it(results: dict[str, list[dict[str, Any]]], case_id: str) -> None:
    cfg = next(c for c in CASES if c["id"] == case_id)
    for r, res in enumerate(results[case_id]):
        assert res["errors"], f"rank {r}: no error (rank {cfg['who']} failed)"
        first = res["errors"][0].splitlines()[0]
        # (a load whose data cannot be read: CheckpointReadError, a CheckpointError, since the corrupt-checkpoint work)
        assert first.startswith(("CheckpointError: ", "CheckpointReadError: ")), f"rank {r}: {first}"
        assert f"failed on rank {cfg['who']}" in first, f"rank {r}: the failing rank is not named: {first}"
        assert res["took"] < 20, f"rank {r}: took {res['took']:.1f} s to raise"


CAUGHT = textwrap.dedent("""\
    import os, sys, time, torch, pipeloom
    from torch import nn
    rank = int(os.environ["RANK"])
    class M(nn.Module):
        def __init__(self, s):
            super().__init__(); self.s = s; self.lin = nn.Linear(4, 4); self.boom = False
        def forward(self, x):
            if self.boom and self.s == 1 and x.shape[0] == 3:
                raise ValueError("shape error in user code")
            return self.lin(x)
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(lambda s: M(s), schedule="1F1B", num_microbatches=2, loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(5, 4), torch.randn(5, 4)
    pipe.step(x, target=y)
    for m in pipe.stages.values():
        m.boom = True
    for attempt in (1, 2):  # the user catches the failed step and runs the next one
        t0 = time.perf_counter()
        try:
            pipe.step(x, target=y)
            print(f"RESULT {rank} {attempt} ran", flush=True)
        except pipeloom.PipelineError as exc:
            print(f"RESULT {rank} {attempt} {time.perf_counter() - t0:.2f} {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
        for m in pipe.stages.values():
            m.boom = False
    pipe.close()
""")


def test_a_step_after_a_caught_failure_is_refused_at_once_and_the_launcher_names_the_cause(tmp_path: Path) -> None:
    """A failed step is the Pipeline's last: a script that catches its error and steps again gets, on every rank
    and at once, a PipelineError that names the failed step (the failing rank's next step waited for a peer
    that had re-raised its old error at once, until that peer closed: PeerLostError, or forever while it did
    other things); under ``pipeloom launch`` the job ends naming the failing rank as the root cause and exits 1
    also where the script caught the error and exited 0 (with every rank out within --grace it exited 0)."""
    proc = launch_script(tmp_path, CAUGHT, launch_args=("--grace", "20"), timeout=120)
    results = {tuple(line.split()[2:4]): line for line in proc.stdout.splitlines() if line.split()[1:2] == ["RESULT"]}
    for r in (0, 1):
        first, second = results.get((str(r), "1"), ""), results.get((str(r), "2"), "")
        assert ("StageError" if r == 1 else "RemoteRankError") in first, (first, proc.stderr[-3000:])
        assert "PipelineError: " in second and "runs no step after a failed one" in second, (second, proc.stderr[-3000:])
        assert "step 1 failed" in second and "shape error in user code" in second, second
        assert float(second.split()[4]) < 1.0, second
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "job failed: rank 1 failed (its script caught the error and exited 0" in proc.stderr, proc.stderr[-3000:]
    assert "root cause: rank 1, stage 1, microbatch 0, action 1F0" in proc.stderr, proc.stderr[-3000:]
