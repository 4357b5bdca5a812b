"""Checkpoint timeouts, the call ledger and damaged checkpoints: cases a review of the timeout/fallback change found,
each on 2 real gloo ranks.

* ``PendingCheckpoint.wait(0)`` (a poll) gave up on a healthy asynchronous save at once, abandoned it on every rank
  (it never completed: nothing listed) and failed the next save too; a later ``wait()`` raised at once saying "did
  not complete within 600 s".  Now 0, negative and NaN waits are refused (``done()`` polls), and a wait after one
  that gave up reports that one's timeout.
* ``timeout=float('inf')`` (or 1e15) raised a bare ``OverflowError`` from torch's timedelta/gloo conversion.
* One rank in ``save_checkpoint`` and another in ``load_checkpoint`` at the same point: each raised a bare
  ``ValueError: too many values to unpack``.
* A root whose only ``step-N`` directory lost its ``.metadata`` (or marker) returned None from
  ``load_checkpoint``, as for a fresh start: the job silently trained from scratch.
* The call ledger wrote world size + 2 keys into the job's store at every checkpoint call and never deleted them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import CKPT_JOB, run_json_script  # noqa: E402

HEAD = CKPT_JOB + """\
root = sys.argv[1]
def save(step, **kw):
    kw.setdefault("timeout", 5)
    return pipeloom.save_checkpoint(root, pipe, opt, step=step, stage_prefix=True, **kw)
def load(path=None, **kw):
    kw.setdefault("timeout", 5)
    return pipeloom.load_checkpoint(path or root, pipe, opt, stage_prefix=True, **kw)
def attempt(fn):
    try:
        ret = fn()
        return {"ok": True, "ret": None if ret is None else str(getattr(ret, "step", ret))}
    except BaseException as exc:
        return {"ok": False, "type": type(exc).__name__, "message": str(exc)}
out = {}
train()
"""


def _run(tmp_path: Path, body: str) -> list[dict]:
    return run_json_script(tmp_path, HEAD + body + "print(json.dumps(out), flush=True)\npipe.close()\n", 2,
                           str(tmp_path / "ckpt"), timeout=60)


WAIT_ZERO = """\
p = save(1, async_save=True)
out["wait0"] = attempt(lambda: p.wait(0))
out["wait_neg"] = attempt(lambda: p.wait(-1))
out["wait_nan"] = attempt(lambda: pipeloom.wait_checkpoints(timeout=float("nan")))
out["wait"] = attempt(lambda: p.wait())
out["inf"] = attempt(lambda: save(2, timeout=float("inf")))
out["huge"] = attempt(lambda: save(2, timeout=1e15))
out["next"] = attempt(lambda: save(2))
out["listed"] = [s for s, _ in ck.list_checkpoints(root)]
"""


def test_a_zero_wait_or_an_infinite_timeout_is_refused_and_the_save_completes(tmp_path: Path) -> None:
    """``wait(0)``, ``wait(-1)``, ``wait_checkpoints(timeout=nan)``: ``PipelineConfigError`` (0 used to abandon the
    healthy save on every rank: nothing listed, the next save failed); the save then completes.  ``timeout=inf`` and
    ``1e15``: ``PipelineConfigError`` on every rank, not ``OverflowError``; the next save works."""
    for r, rec in enumerate(_run(tmp_path, WAIT_ZERO)):
        for k in ("wait0", "wait_neg", "wait_nan", "inf", "huge"):
            assert not rec[k]["ok"] and rec[k]["type"] == "PipelineConfigError", (r, k, rec)
            assert "timeout must be a positive, finite number of seconds" in rec[k]["message"], (r, k, rec)
        assert "poll with done()" in rec["wait0"]["message"], rec
        assert rec["wait"]["ok"] and rec["next"]["ok"], (r, rec)
        assert rec["listed"] == [1, 2], (r, rec)


LATER_WAIT = """\
if rank == 1:  # the asynchronous save's write takes 2.5 s on rank 1
    slow_next_write(2.5)
p = save(1, async_save=True, timeout=3)
out["first"] = attempt(lambda: p.wait(0.5))
t = time.monotonic()
out["again"] = attempt(lambda: p.wait())
out["again_s"] = time.monotonic() - t
out["next"] = attempt(lambda: save(2, timeout=3))
out["after"] = attempt(lambda: save(3, timeout=3))
out["listed"] = [s for s, _ in ck.list_checkpoints(root)]
"""


def test_a_wait_after_one_that_gave_up_reports_that_ones_timeout(tmp_path: Path) -> None:
    """``p.wait(0.5)`` gives up on a save whose write takes longer (``CheckpointTimeoutError``); a later ``p.wait()``
    raises at once (the save is abandoned) saying it was the earlier 0.5 s wait that gave up, not "within 600 s"."""
    for r, rec in enumerate(_run(tmp_path, LATER_WAIT)):
        assert rec["first"]["type"] == "CheckpointTimeoutError" and "within 0.5 s" in rec["first"]["message"], (r, rec)
        again = rec["again"]
        assert again["type"] == "CheckpointTimeoutError" and rec["again_s"] < 1.0, (r, rec)
        assert "within 0.5 s (this rank's earlier wait" in again["message"], (r, rec)
        assert "600" not in again["message"], (r, rec)
        assert rec["next"]["type"] == "CheckpointTimeoutError", (r, rec)
        assert rec["after"]["ok"] and rec["listed"] == [3], (r, rec)


MIXED = """\
save(1)
out["mixed"] = attempt(lambda: save(2) if rank == 0 else load())
out["after"] = attempt(lambda: save(3))
out["listed"] = [s for s, _ in ck.list_checkpoints(root)]
"""


def test_ranks_in_different_checkpoint_calls_are_told_so(tmp_path: Path) -> None:
    """Rank 0 calls ``save_checkpoint`` where rank 1 calls ``load_checkpoint``: ``PipelineConfigError`` on both naming
    both calls (a bare ``ValueError: too many values to unpack`` before); the next save works."""
    for r, rec in enumerate(_run(tmp_path, MIXED)):
        m = rec["mixed"]
        assert not m["ok"] and m["type"] == "PipelineConfigError", (r, rec)
        assert "rank 0: save_checkpoint, rank 1: load_checkpoint" in m["message"], (r, rec)
        assert rec["after"]["ok"] and rec["listed"] == [1, 3], (r, rec)


DAMAGED = """\
save(1)
train()
save(2)
dist.barrier()
if rank == 0:  # step 2 lost its metadata (a file deleted on the shared file system)
    os.unlink(os.path.join(root, "step-00000002", ".metadata"))
dist.barrier()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out["fallback"] = attempt(load)
out["warned"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
dist.barrier()
if rank == 0:  # and now step 1 lost its marker: nothing is left to load
    os.unlink(os.path.join(root, "step-00000001", "COMPLETE"))
dist.barrier()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    out["none_left"] = attempt(load)
out["fresh"] = attempt(lambda: load(root + "/nothing-here"))
"""


def test_a_root_whose_only_checkpoints_are_damaged_is_not_a_fresh_start(tmp_path: Path) -> None:
    """Step 2 lacks its ``.metadata``: ``load_checkpoint(root)`` warns naming it and loads step 1 (as for any unreadable
    checkpoint).  Step 1 then lacks its marker too: ``CheckpointReadError`` on every rank (it returned None, a fresh
    start, and the job trained from scratch); an empty root still returns None."""
    for r, rec in enumerate(_run(tmp_path, DAMAGED)):
        assert rec["fallback"] == {"ok": True, "ret": "1"}, (r, rec)
        assert any("step-00000002 cannot be read" in w and "lacks its .metadata" in w for w in rec["warned"]), (r, rec)
        nl = rec["none_left"]
        assert not nl["ok"] and nl["type"] == "CheckpointReadError", (r, rec)
        assert "none of the 2 checkpoint(s)" in nl["message"] and "lacks its COMPLETE" in nl["message"], (r, rec)
        assert rec["fresh"] == {"ok": True, "ret": None}, (r, rec)


GROWTH = """\
store = dist.distributed_c10d._get_default_store()
counts = []
for i in range(40):
    if i % 10 == 9:
        p = save(i, async_save=True)
        load()
    else:
        save(i, keep_last=2)
    counts.append(store.num_keys())
out["counts"] = counts
"""


def test_the_call_ledger_does_not_grow_the_store(tmp_path: Path) -> None:
    """40 checkpoint calls (saves, asynchronous saves, loads): the job's store holds as many keys after the last as
    after the tenth (it grew by world size + 2 = 4 keys a call, forever)."""
    for r, rec in enumerate(_run(tmp_path, GROWTH)):
        counts = rec["counts"]
        assert counts[-1] <= counts[9], (r, counts)


INTERRUPTED = """\
from torch.distributed.checkpoint.filesystem import _FileSystemWriter
if rank == 0:  # Ctrl-C reaches rank 0 while it writes its files
    real = _FileSystemWriter.write_data
    def interrupted(self, plan, planner):
        _FileSystemWriter.write_data = real
        raise KeyboardInterrupt()
    _FileSystemWriter.write_data = interrupted
out["save"] = attempt(lambda: save(1))
out["after"] = attempt(lambda: save(2))
out["listed"] = [s for s, _ in ck.list_checkpoints(root)]
"""


def test_a_ctrl_c_during_a_save_stays_a_keyboard_interrupt(tmp_path: Path) -> None:
    """A ``KeyboardInterrupt`` on rank 0 inside DCP's write (which DCP catches as a failure of the call) is raised as
    ``KeyboardInterrupt`` on rank 0 (it became a ``CheckpointError``, an ``Exception``: a loop that goes on after a
    failed save ignored the Ctrl-C); rank 1 raises ``CheckpointError`` naming it; the next save works."""
    r0, r1 = _run(tmp_path, INTERRUPTED)
    assert r0["save"]["type"] == "KeyboardInterrupt", r0
    assert r1["save"]["type"] == "CheckpointError" and "failed on rank 0: KeyboardInterrupt" in r1["save"]["message"], r1
    for rec in (r0, r1):
        assert rec["after"]["ok"] and rec["listed"] == [2], rec
