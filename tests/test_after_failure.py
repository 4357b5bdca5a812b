"""The training loop's collectives after a step that failed on one rank only (2 real gloo ranks).

In 1F1B the last stage's rank ends its step before the first stage's last backward; when that backward raises,
only rank 0's step fails.  Rank 1, done, calls ``last_loss()`` / ``clip_grad_norm_`` (collectives) and used to
wait out their whole bound (stall + heartbeat timeout), then name "lost rank -1"; rank 0's own call waited too,
on partial losses.  Now rank 0 refuses at once (its step failed) and rank 1 raises rank 0's reported error as
soon as its abort arrives.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import linear_job, run_json_script, spawn_ranks  # noqa: E402

SCRIPT = textwrap.dedent("""\
    import json, os, sys, time, torch, pipeloom
    from torch import nn
    rank = int(os.environ["RANK"])
    which = sys.argv[1]

    class Boom(torch.autograd.Function):
        calls = 0

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            Boom.calls += 1
            if Boom.calls == 4:  # the first stage's last backward of the first step
                raise RuntimeError("boom in stage 0's last backward")
            return g

    class Stage(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.lin, self.s = nn.Linear(4, 4), s

        def forward(self, x):
            y = self.lin(x)
            return Boom.apply(y) if self.s == 0 else y

    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(lambda s: Stage(s), schedule="1F1B", num_microbatches=4,
                             loss_fn=nn.functional.mse_loss, heartbeat_timeout=10.0, stall_timeout=30.0)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    out = {"rank": rank}
    try:
        pipe.step(x, target=y, return_outputs=False)
        out["step"] = "ok"
    except pipeloom.PipelineError as exc:
        out["step"] = type(exc).__name__
    t0 = time.monotonic()
    try:
        if which == "loss":
            pipe.last_loss()
        else:
            pipe.clip_grad_norm_(1.0)
        out["call"] = "ok"
    except pipeloom.PipelineError as exc:
        out["call"] = type(exc).__name__
        out["message"] = str(exc)
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
    if rank == 0:
        time.sleep(4.0)  # alive (not a dead peer): rank 1 must learn of the failure from its abort
    os._exit(0)
""")


@pytest.mark.parametrize("which", ["loss", "clip"])
def test_a_collective_after_a_step_that_failed_on_one_rank_names_it_at_once(tmp_path: Path, which: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    codes, outs, errs = asyncio.run(spawn_ranks(2, [str(script), which], timeout=60))
    assert codes == [0, 0], errs
    got = {d["rank"]: d for d in (json.loads(o.strip().splitlines()[-1]) for o in outs)}
    assert got[0]["step"] == "StageError", got
    assert got[1]["step"] == "ok", got  # its step had ended when rank 0's last backward raised
    # rank 0: refused at once, naming its failed step
    assert got[0]["call"] == "PipelineError" and "step 0 failed" in got[0]["message"], got[0]
    assert got[0]["seconds"] < 1.0, got[0]
    # rank 1: rank 0's own error, from its abort, long before the collective's 40 s bound
    assert got[1]["call"] == "RemoteRankError", got[1]
    assert "rank 0" in got[1]["message"] and "boom in stage 0's last backward" in got[1]["message"], got[1]
    assert got[1]["seconds"] < 5.0, got[1]


MISMATCH = linear_job("""\
    pipe.step(x, target=y)
    out = {"rank": rank}
    t0 = time.monotonic()
    try:
        if rank == 0:  # the ranks disagree on the collective
            pipe.last_loss()
        else:
            pipe.clip_grad_norm_(1.0, norm_type=float(sys.argv[1]))
        out["call"] = "ok"
    except pipeloom.PipelineError as exc:
        out["call"], out["message"] = type(exc).__name__, str(exc)
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
""", microbatches=2, rows=4, pipe_args="stall_timeout=2.0, heartbeat_timeout=2.0", imports=", json, sys, time")



@pytest.mark.parametrize("norm_type", ["2", "inf"])
def test_ranks_calling_different_collectives_are_told_so_and_the_job_exits(tmp_path: Path, norm_type: str) -> None:
    """Rank 0 calls ``last_loss()`` while rank 1 calls ``clip_grad_norm_`` (a sum, or for the inf norm a max): each
    waited out the bound and was told "lost rank -1" (no rank was lost), and then neither process could exit
    (destroying the group waited for the pending collective forever); on NCCL, which checks nothing, two such
    all-reduces of one size would complete with each rank's values in the other's result.  Every training-loop
    collective now carries which one it is: both ranks are told at once, and both processes end."""
    got = {d["rank"]: d for d in run_json_script(tmp_path, MISMATCH, 2, norm_type, timeout=60)}
    for rank, what in ((0, "the step loss's reduction"), (1, "the gradient norm's all-reduce")):
        rec = got[rank]
        assert rec["call"] == "PipelineError", rec
        assert rec["message"].startswith(f"rank {rank}: {what} over all 2 ranks met another collective on some rank: "
                                         "every rank must call last_loss(), clip_grad_norm_()"), rec
        assert rec["seconds"] < 2, rec


UNLIKE = linear_job("""\
    pipe.step(x, target=y)
    out = {"rank": rank}
    call = sys.argv[1].split("/")[rank]
    t0 = time.monotonic()
    try:
        if call.startswith("loss"):  # loss<n>: reduce_to=n
            out["value"] = pipe.last_loss(reduce_to=int(call[4:]))
        else:  # clip:<max_norm>:<norm_type>
            _, max_norm, norm_type = call.split(":")
            out["value"] = float(pipe.clip_grad_norm_(float(max_norm), norm_type=float(norm_type)))
        out["call"] = "ok"
    except pipeloom.PipelineError as exc:
        out["call"], out["message"] = type(exc).__name__, str(exc)
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
""", microbatches=2, rows=4, pipe_args="stall_timeout=2.0, heartbeat_timeout=2.0", imports=", json, sys, time")


@pytest.mark.parametrize("calls", ["loss0/clip:1:2", "clip:1:2/loss0", "clip:1:2/clip:1:1", "clip:1:2/clip:5:2",
                                   "loss1/loss1"])
def test_collectives_with_reduce_to_or_unlike_clipping_are_told_apart_at_once(tmp_path: Path, calls: str) -> None:
    """``last_loss(reduce_to=0)`` on one rank and ``clip_grad_norm_`` on the other: the reduce met an all-reduce,
    neither completed nor failed, and both waited out the bound (40 s by default), the second to give up told that
    the first had "closed its Pipeline without joining it"; the ranks other than ``reduce_to`` never read the
    tags, so they were never told.  ``clip_grad_norm_`` with another norm type or max_norm on each rank completed
    silently: each rank's stages scaled by another factor (the global clip's whole point).  Now every rank is told
    at once; ``reduce_to=1`` still gives the loss on rank 1 alone."""
    got = {d["rank"]: d for d in run_json_script(tmp_path, UNLIKE, 2, calls, timeout=60)}
    if calls == "loss1/loss1":
        assert got[0]["call"] == got[1]["call"] == "ok", got
        assert got[0]["value"] is None and got[1]["value"] > 0, got
        return
    for rank, call in enumerate(calls.split("/")):
        rec = got[rank]
        what = "the step loss's reduction" if call.startswith("loss") else "the gradient norm's all-reduce"
        assert rec["call"] == "PipelineError", rec
        assert rec["message"].startswith(f"rank {rank}: {what} over all 2 ranks met another collective on some rank: "
                                         "every rank must call last_loss(), clip_grad_norm_() (with the same max_norm "
                                         "and norm_type)"), rec
        assert rec["seconds"] < 2, rec


CLOSED = linear_job("""\
    pipe.step(x, target=y)
    out = {"rank": rank}
    if rank == 1:
        pipe.close()  # leaves without the collective its peer calls next
        if sys.argv[1] == "alive":
            time.sleep(3.0)
    else:
        t0 = time.monotonic()
        try:
            pipe.last_loss()
            out["call"] = "ok"
        except pipeloom.PipelineError as exc:
            out["call"], out["message"] = type(exc).__name__, str(exc)
        out["seconds"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
""", microbatches=2, rows=4, pipe_args="stall_timeout=20.0, heartbeat_timeout=10.0", imports=", json, sys, time")



@pytest.mark.parametrize("after", ["exits", "alive"])
def test_a_peer_that_closed_its_pipeline_is_named_as_having_left_not_lost(tmp_path: Path, after: str) -> None:
    """Rank 1 closes its Pipeline (and its script ends, or goes on alive) while rank 0 calls ``last_loss()``: rank 0
    was told "lost rank 1: its process ended during the call" (a crash, which it was not) or, with rank 1 alive, a
    raw connection error naming "rank -1".  On NCCL the same held for ranks calling different collectives (the
    first to give up exits before the other's bound runs out).  Now: the rank that left, and why the call cannot
    complete."""
    got = {d["rank"]: d for d in run_json_script(tmp_path, CLOSED, 2, after, timeout=60)}
    rec = got[0]
    assert rec["call"] == "PipelineError", rec
    assert rec["message"].startswith("rank 0: the step loss's reduction over all 2 ranks did not complete: rank 1 "
                                     "closed its Pipeline without joining it; every rank must call last_loss()"), rec
    assert rec["seconds"] < 10, rec


SKIPPED = linear_job("""\
    pipe.step(x, target=y)
    out = {"rank": rank, "calls": []}
    for call in (("last_loss", "step", "last_loss") if rank == 0 else ("step",)):
        try:
            pipe.last_loss() if call == "last_loss" else pipe.step(x, target=y)
            out["calls"].append([call, "ok", ""])
        except pipeloom.PipelineError as exc:
            out["calls"].append([call, type(exc).__name__, str(exc)])
    print(json.dumps(out), flush=True)
    pipe.close()
""", microbatches=2, rows=4, pipe_args="stall_timeout=2.0, heartbeat_timeout=2.0", imports=", json")



def test_a_collective_one_rank_never_called_leaves_the_pipeline_refusing_steps_and_collectives(tmp_path: Path) -> None:
    """Rank 0 calls ``last_loss()``; rank 1 does not and runs its next step.  Rank 0's all-reduce stays pending
    after its bound: a later collective would pair with it on rank 1 (one call's values in another's result,
    unseen: both of one kind carry one tag), and a step beside it ran on.  Now rank 0 refuses both at once,
    saying why, and both processes end."""
    got = {d["rank"]: d for d in run_json_script(tmp_path, SKIPPED, 2, timeout=90)}
    calls = got[0]["calls"]
    assert [c[:2] for c in calls] == [["last_loss", "PipelineError"], ["step", "PipelineError"],
                                      ["last_loss", "PipelineError"]], calls
    assert "did not complete in 4 s" in calls[0][2], calls
    for _, _, msg in calls[1:]:
        assert "an earlier training-loop collective of this Pipeline did not complete (the step loss's reduction" in msg, msg
        assert "restart the job from a checkpoint" in msg, msg
    assert got[1]["calls"][0][1] != "ok", got[1]  # its step's peer never ran it


TWO_PIPELINES = linear_job("""\
    other = pipeloom.Pipeline(lambda s: nn.Linear(4, 4), schedule="1F1B", num_microbatches=2,
                              loss_fn=nn.functional.mse_loss, stall_timeout=2.0, heartbeat_timeout=2.0)
    pipe.step(x, target=y)
    other.step(x, target=y)
    out = {"rank": rank, "calls": []}
    for call in (("last_loss", "other.step", "other.last_loss") if rank == 0 else ("other.step",)):
        t0 = time.monotonic()
        try:
            pipe.last_loss() if call == "last_loss" else other.step(x, target=y) if call == "other.step" else other.last_loss()
            out["calls"].append([call, "ok", "", time.monotonic() - t0])
        except pipeloom.PipelineError as exc:
            out["calls"].append([call, type(exc).__name__, str(exc), time.monotonic() - t0])
    print(json.dumps(out), flush=True)
    other.close()
    pipe.close()
""", microbatches=2, rows=4, pipe_args="stall_timeout=2.0, heartbeat_timeout=2.0", imports=", json, time")


def test_a_collective_left_pending_by_one_pipeline_stops_the_others_on_its_group(tmp_path: Path) -> None:
    """Two Pipelines on one default group (a training and an evaluation one): rank 0's ``last_loss()`` of the first
    is left pending (rank 1 never calls it).  The second Pipeline's step and collectives ran on beside it (on gloo
    its step's layout agreement paired with the pending all-reduce; a collective of one kind would pair with it
    silently).  Now the second refuses them at once too, naming the first's pending collective."""
    got = {d["rank"]: d for d in run_json_script(tmp_path, TWO_PIPELINES, 2, timeout=90)}
    calls = got[0]["calls"]
    assert [c[:2] for c in calls] == [["last_loss", "PipelineError"], ["other.step", "PipelineError"],
                                      ["other.last_loss", "PipelineError"]], calls
    for _, _, msg, seconds in calls[1:]:
        assert ("an earlier training-loop collective of another Pipeline on this process group did not complete "
                "(the step loss's reduction") in msg, msg
        assert seconds < 1.0, calls


def test_a_collective_seen_complete_after_its_peer_said_bye_is_not_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that joined the collective, then closed its Pipeline (the end of a job: ``last_loss()`` then
    ``close()``): its 'bye' can be read before this rank sees the collective complete (a busy host, the Work's
    completion polled a moment late).  That was an error, "rank 1 closed its Pipeline without joining it", for a
    collective that completed (a job ending in failure).  Now the collective gets a moment to complete first; one
    the peer never joined still fails.  (A stand-in Work and Pipeline, one process.)"""
    import time

    import torch
    import torch.distributed as dist

    from pipeloom.runtime import training

    class Work:
        def __init__(self, after: float) -> None:
            self.done_at = time.monotonic() + after

        def is_completed(self) -> bool:
            return time.monotonic() >= self.done_at

        def wait(self) -> bool:
            return True

    class Control:
        peers_closed = {1}

    class Actor:
        control, stall_timeout, heartbeat_timeout = Control(), 2.0, 2.0

        def error_between_steps(self) -> None:
            return None

    class Pipe:
        rank, _actor, _failed, _abort_nccl = 0, Actor(), None, None

    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 1)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: Work(0.1))
    t = torch.tensor([3.0, 2.0], dtype=torch.float64)
    training._collective(Pipe(), t, dist.ReduceOp.SUM, dst=None, what="the step loss's reduction")
    assert t.tolist() == [3.0, 2.0]
    # never completes: the peer never joined
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: Work(1e9))
    monkeypatch.setattr("pipeloom.transport.tensor.guard_exit_works", lambda works: None)
    monkeypatch.setattr("pipeloom.runtime.checkpoint._lost_peer", lambda *a, **k: None)
    pipe = Pipe()
    t0 = time.monotonic()
    with pytest.raises(training.PipelineError, match="rank 1 closed its Pipeline without joining it"):
        training._collective(pipe, t, dist.ReduceOp.SUM, dst=None, what="the step loss's reduction")
    assert time.monotonic() - t0 < 1.5
    assert pipe._collective_broken
