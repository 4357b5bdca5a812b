"""``static_shapes``: a transfer whose shapes differ from the first step's fails both ranks loudly.

The gradients of the static-shapes protocol are checked with every schedule in
tests/test_runtime_gradients.py (cases ``static-*``, 2 and 4 ranks); here, what must
never be silent: after the first step the receiver posts its receives with the first
step's shapes before the sender has produced anything, so a changed shape must stop
the job on both ranks with an error naming the transfer and both shapes (the sender
fills the posted receive first, so nothing hangs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import spawn_ranks  # noqa: E402

WORKER = str(Path(__file__).parent / "ranks" / "static_worker.py")


async def _run(tmp_path: Path, mode: str) -> list[dict]:
    codes, _, errs = await spawn_ranks(2, [WORKER, str(tmp_path), mode], timeout=90)
    recs = []
    for r in range(2):
        p = tmp_path / f"rank{r}.json"
        assert p.exists(), f"rank {r} wrote no record (exit {codes[r]}):\n{errs[r][-3000:]}"
        recs.append(json.loads(p.read_text()))
    assert codes == [1, 1], (codes, [e[-2000:] for e in errs])
    return recs


@pytest.mark.parametrize("mode,sender,what,expect", [
    # static_shapes=True: the activation rank 0 sends: 3 rows per microbatch instead of 2
    ("batch", 0, "activation", "float64[3, 4] requires_grad"),
    # static_shapes=True: the activation no longer requires grad (rank 1 would compute no input gradient)
    ("rg", 0, "activation", "(float64[2, 4])"),
    # auto: same inputs, but stage 0's output doubles its rows (data-dependent shapes)
    ("datadep", 0, "activation", "float64[4, 4] requires_grad"),
])
async def test_changed_transfer_fails_both_ranks(tmp_path: Path, mode: str, sender: int, what: str, expect: str) -> None:
    recs = await _run(tmp_path, mode)
    for r in recs:
        assert r["status"] == "error", r
        assert r["headerless"] == [0, 4], r  # step 1 ran without headers (4 microbatches, one transfer each way)
    s = recs[sender]
    assert s["type"] == "StageError", s
    msg = s["message"]
    assert msg.startswith(f"rank {sender}, step 2, stage 0, microbatch 0, action 0F0"), msg
    assert "static shapes (static_shapes=" in msg and f"the {what} that stage 0 sends to stage 1" in msg, msg
    assert ("static_shapes=False" if mode == "datadep" else "static_shapes=None") in msg, msg
    assert expect in msg and "float64[2, 4] requires_grad" in msg, msg
    # the receiver never completes the step on the placeholder it got: it fails with the
    # sender's error, or with its own if its stage chokes on the placeholder first
    other = recs[1 - sender]
    assert other["type"] in ("RemoteRankError", "StageError"), other
    if other["type"] == "RemoteRankError":
        assert "static shapes" in other["message"], other
    assert abs(other["t"] - s["t"]) < 10, (other["t"], s["t"])


async def test_auto_relearns_when_the_inputs_change(tmp_path: Path) -> None:
    """static_shapes=None (auto): a larger batch in step 2 runs with headers again, and exactly."""
    codes, _, errs = await spawn_ranks(2, [WORKER, str(tmp_path), "batch-auto"], timeout=90)
    assert codes == [0, 0], [e[-2000:] for e in errs]
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in recs:
        assert r["status"] == "ok", r
        assert r["headerless"] == [0, 4, 0], r  # step 2's inputs are new: learned with headers
    assert all(isinstance(x, float) for x in recs[0]["losses"]), recs[0]


REORDER = str(Path(__file__).parent / "ranks" / "reorder_worker.py")


@pytest.mark.parametrize("rule,schedule", [("ready", "ZBVZeroBubble"), ("critical", "ZBVZeroBubble"), ("ready", "LoopedBFS")])
async def test_the_dynamic_order_reorders_on_the_static_path_and_keeps_the_gradients(tmp_path: Path, rule: str, schedule: str) -> None:
    """gloo, static shapes (the default): a receive posted ahead that has landed makes its consumer ready, and
    the list's head waits in gloo for a payload not landed only when nothing else is ready.  Rank 1 is slow:
    rank 1 runs actions whose inputs landed ahead of a list head still waiting for its input (before, the
    head was always taken and waited for: ``ready`` never reordered on this path, ``critical`` only
    among actions with local inputs), and the gradients equal the deterministic order's.  No reordering
    holds an output for its turn in a peer's send order (LoopedBFS: both stages of rank 1 send their
    gradients to rank 0; a backward run ahead of its turn would hold its output: it is not run ahead)."""
    codes, _, errs = await spawn_ranks(2, [REORDER, str(tmp_path), rule, schedule], timeout=90)
    assert codes == [0, 0], [e[-3000:] for e in errs]
    recs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in recs:
        assert r["dynamic"]["headerless"] and r["deterministic"]["headerless"], r
        assert r["deterministic"]["out_of_order"] == 0, r
        assert r["max_diff"] <= 1e-12, r
        # and no reordering made an output wait for its turn in a peer's send order (held: the peer
        # waits longer than the reordering gains; LoopedBFS on 4 ranks lost 10-19% that way)
        assert r["dynamic"]["held"] == 0 and r["deterministic"]["held"] == 0, r
    if schedule == "ZBVZeroBubble":  # (LoopedBFS here: no reordering that would not hold a send)
        assert max(r["dynamic"]["out_of_order"] for r in recs) > 0, recs


_GATHER_CHILD = r"""
import os, sys, threading
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
import torch.distributed as dist
dist.init_process_group("gloo")
from pipeloom.runtime.pipeline import _gather_ints
gather = _gather_ints(None)
late = 0
for i in range(200):
    g = gather((i, 7))
    seen, ev = [], threading.Event()
    g.on_done(lambda g=g: (seen.append(g.done()), ev.set()))
    assert ev.wait(10), "the completion callback never ran"
    late += not seen[0]
    assert g.done() and g.result() == [(i, 7)]
dist.destroy_process_group()
print("late", late)
"""


def test_the_layout_agreement_is_done_when_its_callback_wakes_the_loop() -> None:
    # Each step's layout agreement (static_shapes auto) is a gloo all-gather the loop's thread polls;
    # gloo's completion callback wakes it. The callback runs before the Work reads completed (measured
    # 165 of 300 times in a world of one), so "done" must be the future's state: with the Work's, the
    # woken loop saw the gather pending and slept a whole liveness interval (steps of ~1 s, seen as the
    # gradient pool taking 2.5x longer).
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", _GATHER_CHILD, str(port)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["late", "0"], out.stdout
