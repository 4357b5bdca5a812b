"""Checkpoints that must survive a rank that hangs, and a latest checkpoint that is corrupt, on real gloo ranks.

* A rank that hangs (does not die) in a checkpoint call made its peers wait for the process group's timeout (30
  minutes on gloo): one that never calls ``save_checkpoint`` (stuck in its own code), one whose write blocks, one
  whose asynchronous save never completes.  Now every live rank raises ``CheckpointTimeoutError`` within about the
  call's ``timeout`` naming the rank that did not arrive and the call, the late rank raises at once when it comes,
  the next save works (a new checkpoint group), and both processes exit (a writer thread that still blocks does not
  hold the exit).
* A latest checkpoint complete by its marker but unreadable (a data file truncated or deleted, the metadata or
  the marker garbled) made every later ``load_checkpoint(root)`` fail: no fallback.  Now under a root every rank
  warns and loads the next older complete checkpoint, the same one on every rank, also where only one rank cannot
  read it; an explicit ``step-N`` raises ``CheckpointReadError`` on every rank; and a read that fails midway on one
  rank leaves no rank's model or optimizer half-loaded (it is read into new tensors first).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import CKPT_JOB, spawn_ranks  # noqa: E402

#: the calls' timeout in these jobs, and how long a stuck rank stays stuck
T = 2.0
STUCK = 5.0

HEAD = CKPT_JOB + """\
root, T, STUCK, how = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
def params():
    return [p.detach().flatten().tolist() for p in pipe.parameters()]
def save(step, **kw):
    return pipeloom.save_checkpoint(root, pipe, opt, step=step, stage_prefix=True, timeout=T, **kw)
def attempt(fn):
    t = time.monotonic()
    try:
        fn()
        rec = {"ok": True}
    except Exception as exc:
        rec = {"ok": False, "type": type(exc).__name__, "message": str(exc),
               "failed_ranks": getattr(exc, "failed_ranks", None)}
    rec["seconds"] = time.monotonic() - t
    return rec
out = {}
"""

# ---------------------------------------------------------------- a rank that hangs

# each stuck-rank job ends alike: the save after the stuck one works (on a new checkpoint group), and what is listed
AFTER = """\
train()
out["after"] = attempt(lambda: save(3))
out["listed"] = [s for s, _ in ck.list_checkpoints(root)]
print(json.dumps(out), flush=True)
pipe.close()
"""

NEVER_CALLS = HEAD + """\
train()
if how == "later":
    save(1)
if rank == 1:
    time.sleep(STUCK)  # stuck in its own code: the peer's save_checkpoint(step 2) waits for it
out["stuck"] = attempt(lambda: save(2))
""" + AFTER

STUCK_WRITE = HEAD + """\
train()
save(1)
if rank == 1:  # its file system blocks in the next write
    slow_next_write(STUCK)
out["stuck"] = attempt(lambda: save(2))
""" + AFTER

ASYNC_NEVER = HEAD + """\
train()
if rank == 1:  # the asynchronous save's write never returns (within the test: 60 s)
    slow_next_write(60)
save(1, async_save=True)
train()
if how == "wait":
    out["stuck"] = attempt(lambda: pipeloom.wait_checkpoints(timeout=T))
else:
    out["stuck"] = attempt(lambda: save(2))
""" + AFTER


def _run(tmp_path: Path, script: str, how: str, *, limit: float = 40,
         codes_wanted: tuple[int, int] = (0, 0)) -> tuple[list[dict[str, Any]], float]:
    """The job on 2 ranks: each rank's record, and the seconds until both processes had exited (with
    ``codes_wanted``)."""
    job = tmp_path / "job.py"
    job.write_text(script)
    t0 = time.monotonic()
    codes, outs, errs = asyncio.run(spawn_ranks(2, [str(job), str(tmp_path / "ckpt"), str(T), str(STUCK), how],
                                                timeout=limit))
    took = time.monotonic() - t0
    assert codes == list(codes_wanted), (codes, [e[-3000:] for e in errs])
    return [json.loads(o.strip().splitlines()[-1]) for o in outs], took


def _names_the_stuck_rank(rec: dict[str, Any], call: str) -> None:
    assert not rec["ok"] and rec["type"] == "CheckpointTimeoutError", rec
    assert rec["message"].startswith("rank 0: ") and call in rec["message"], rec
    assert rec["failed_ranks"] == [1], rec


@pytest.mark.parametrize("how", ["first", "later"])
def test_a_rank_that_never_calls_save_is_named_within_the_timeout(tmp_path: Path, how: str) -> None:
    """Rank 1 is stuck in its own code instead of calling ``save_checkpoint(step 2)`` (its first checkpoint call,
    or a later one): rank 0 raises within about ``timeout`` naming rank 1 as not having called it; rank 1,
    when it calls, raises at once (rank 0 stopped waiting); the next save works, and both processes exit."""
    (r0, r1), took = _run(tmp_path, NEVER_CALLS, how)
    _names_the_stuck_rank(r0["stuck"], "save_checkpoint(step 2)")
    assert "rank 1 has not called it" in r0["stuck"]["message"], r0
    assert T - 0.5 < r0["stuck"]["seconds"] < T + 2.5, r0
    assert not r1["stuck"]["ok"] and r1["stuck"]["type"] == "CheckpointTimeoutError", r1
    assert "rank 0 stopped waiting for ranks [1]" in r1["stuck"]["message"], r1
    assert r1["stuck"]["seconds"] < 1.0, r1
    for r in (r0, r1):
        assert r["after"]["ok"], r
        assert r["listed"] == ([3] if how == "first" else [1, 3]), r
    assert took < STUCK + 15, took


def test_a_rank_stuck_in_its_write_is_named_within_the_timeout(tmp_path: Path) -> None:
    """Rank 1's write of step 2 blocks for longer than ``timeout``: rank 0 raises within about ``timeout`` (in DCP's
    collective, bounded by the checkpoint group's gloo timeout) naming rank 1 as still writing its files; rank 1
    raises once its write returns; nothing of step 2 is listed, the next save works, both processes exit."""
    (r0, r1), took = _run(tmp_path, STUCK_WRITE, "")
    _names_the_stuck_rank(r0["stuck"], "save_checkpoint(step 2)")
    assert "rank 1 is still at 'writing its files'" in r0["stuck"]["message"], r0
    assert r0["stuck"]["seconds"] < T + 2.5, r0
    assert not r1["stuck"]["ok"] and r1["stuck"]["type"] == "CheckpointTimeoutError", r1
    assert "rank 0 stopped waiting" in r1["stuck"]["message"], r1
    assert r1["stuck"]["seconds"] < STUCK + 2.0, r1
    for r in (r0, r1):
        assert r["after"]["ok"], r
        assert r["listed"] == [1, 3], r
    assert took < STUCK + 15, took


@pytest.mark.parametrize("how", ["save", "wait"])
def test_an_async_save_that_never_completes_on_one_rank(tmp_path: Path, how: str) -> None:
    """Rank 1's asynchronous save of step 1 never finishes writing.  The next save (or ``wait_checkpoints``) raises
    ``CheckpointTimeoutError`` on both ranks within about ``timeout`` naming rank 1 (rank 0's background
    collective timed out waiting for rank 1's part; rank 1's wait for its own writer timed out); the save after
    that works on a new checkpoint group; and rank 1 exits although its writer thread still blocks, with exit code 1
    (that checkpoint is not complete; it exited 0 before, and a script's own ``sys.exit(n)`` ended as 0 too)."""
    (r0, r1), took = _run(tmp_path, ASYNC_NEVER, how, codes_wanted=(0, 1))
    for r, rec in enumerate((r0, r1)):
        stuck = rec["stuck"]
        assert not stuck["ok"] and stuck["type"] == "CheckpointTimeoutError", (r, rec)
        assert stuck["message"].startswith(f"rank {r}: ") and stuck["failed_ranks"] == [1], (r, rec)
        assert stuck["seconds"] < T + 3.0, (r, rec)
        assert rec["after"]["ok"], (r, rec)
        assert rec["listed"] == [3], (r, rec)
    # (rank 0's report: its own files are written, its writer waits for rank 1's)
    assert "rank 1 is still at 'writing its files (in the background)'" in r0["stuck"]["message"], r0
    if how == "save":  # agreed: every rank raises the same report
        assert r1["stuck"]["message"].split(": ", 1)[1] == r0["stuck"]["message"].split(": ", 1)[1], (r0, r1)
    assert took < 25, took  # (the blocked writer sleeps 60 s: the exit did not wait for it)


# ---------------------------------------------------------------- a corrupt latest checkpoint

CORRUPT = HEAD + """\
spoil, who, explicit = how.split(",")
train()
save(2)
p2 = params()
train()
save(4)
d = os.path.join(root, "step-00000004")
if rank == 0 and who == "all":  # spoiled on disk (every rank sees it)
    if spoil == "truncate":
        path = os.path.join(d, "__1_0.distcp")
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    elif spoil == "delete":
        os.unlink(os.path.join(d, "__0_0.distcp"))
    elif spoil == "metadata":
        open(os.path.join(d, ".metadata"), "wb").write(b"not a pickle")
    elif spoil == "marker":
        open(os.path.join(d, "COMPLETE"), "w").write("{garbage")
if rank == 1 and who == "rank1":  # only rank 1 cannot read step 4 (its copy, its node's file system)
    from torch.distributed.checkpoint import FileSystemReader
    real = FileSystemReader.read_data
    def eio(self, plan, planner):
        if "step-00000004" in str(self.path):
            raise OSError(5, "Input/output error (simulated)")
        return real(self, plan, planner)
    FileSystemReader.read_data = eio
dist.barrier()
with torch.no_grad():
    for p in pipe.parameters():
        p.fill_(7.0)
before = params()
state_before = {k: v.tolist() if torch.is_tensor(v) else v for st in opt.state.values() for k, v in st.items()}
target = d if explicit == "explicit" else root
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    t = time.monotonic()
    try:
        info = pipeloom.load_checkpoint(target, pipe, opt, stage_prefix=True, timeout=T)
        out.update(step=info.step, skipped=[[str(p), why] for p, why in info.skipped])
    except Exception as exc:
        out.update(type=type(exc).__name__, message=str(exc), failed_ranks=getattr(exc, "failed_ranks", None))
    out["seconds"] = time.monotonic() - t
out["warned"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
out["equal_step2"] = params() == p2
out["untouched"] = params() == before and state_before == {
    k: v.tolist() if torch.is_tensor(v) else v for st in opt.state.values() for k, v in st.items()}
print(json.dumps(out), flush=True)
pipe.close()
"""


@pytest.mark.parametrize("spoil,want", [
    ("truncate", "__1_0.distcp is "),
    ("delete", "__0_0.distcp is missing"),
    ("metadata", "its metadata or COMPLETE marker cannot be read: UnpicklingError"),
    ("marker", "its metadata or COMPLETE marker cannot be read: JSONDecodeError"),
])
def test_a_corrupt_latest_checkpoint_falls_back_to_the_older_one(tmp_path: Path, spoil: str, want: str) -> None:
    """Step 4 (the latest, complete by its marker) spoiled on disk: ``load_checkpoint(root)`` warns on every rank,
    naming step 4 and what failed, and loads step 2 on every rank (``info.skipped`` lists step 4)."""
    ranks, _ = _run(tmp_path, CORRUPT, f"{spoil},all,root")
    for r, rec in enumerate(ranks):
        assert rec.get("step") == 2 and rec["equal_step2"], (r, rec)
        [(path, why)] = rec["skipped"]
        assert path.endswith("step-00000004") and want in why and why.startswith(f"rank {r}: "), (r, rec)
        [warned] = rec["warned"]
        assert "step-00000004 cannot be read" in warned and want in warned, (r, warned)
        assert "loading the next older complete checkpoint" in warned and warned.endswith("step-00000002"), (r, warned)
        assert rec["seconds"] < 10, rec


def test_a_checkpoint_one_rank_cannot_read_falls_back_on_every_rank(tmp_path: Path) -> None:
    """Only rank 1 fails to read step 4 (an I/O error in its read, after rank 0 read its part): every rank loads
    step 2, none step 4, and the warning names rank 1 and its error."""
    ranks, _ = _run(tmp_path, CORRUPT, "none,rank1,root")
    for r, rec in enumerate(ranks):
        assert rec.get("step") == 2 and rec["equal_step2"], (r, rec)
        [(path, why)] = rec["skipped"]
        assert path.endswith("step-00000004") and "failed on rank 1" in why and "Input/output error" in why, (r, rec)
        assert rec["warned"] and "failed on rank 1" in rec["warned"][0], (r, rec)


@pytest.mark.parametrize("who", ["all", "rank1"])
def test_an_explicit_corrupt_checkpoint_is_refused_with_nothing_loaded(tmp_path: Path, who: str) -> None:
    """``load_checkpoint(root/step-00000004)`` of an unreadable checkpoint: ``CheckpointReadError`` on every rank
    naming the path, the failing rank and its error, no fallback; and no rank's parameters or optimizer state
    changed (where only rank 1's read failed, rank 0 had read its part: into new tensors, never into the model)."""
    ranks, _ = _run(tmp_path, CORRUPT, f"{'truncate' if who == 'all' else 'none'},{who},explicit")
    for r, rec in enumerate(ranks):
        assert rec.get("type") == "CheckpointReadError", (r, rec)
        assert rec["message"].startswith(f"rank {r}: load_checkpoint(") and "step-00000004" in rec["message"], (r, rec)
        assert "an explicit checkpoint is never replaced by another" in rec["message"], (r, rec)
        assert ("__1_0.distcp is " if who == "all" else "failed on rank 1") in rec["message"], (r, rec)
        assert rec["untouched"] and not rec["warned"], (r, rec)
