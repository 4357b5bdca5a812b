"""The gloo header protocol of the tensor plane (transport/tensor.py), on two real gloo ranks.

What could go wrong and is checked: a payload landing in the wrong buffers
(every byte compared), a transfer predicted when it should not be (or the
reverse), the packed single-message path and the unpacked one, shapes and
dtypes that change between steps, tensors absent at some positions, 0-dim
and empty tensors, evaluation steps keeping their own prediction, a transfer
count that grows, and ranks that disagree on the step (a clear error).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from pipeloom.transport.tensor import decode_spec, encode_spec

from ranks.harness import linear_job, spawn_ranks

WORKER = Path(__file__).with_name("ranks") / "transport_worker.py"


def test_spec_round_trip() -> None:
    key = (((4, 16), "float32"), None, ((), "float64"), ((0, 3, 2), "bfloat16"), ((7,), "int64"))
    assert decode_spec(encode_spec(key)) == key
    assert decode_spec(encode_spec(())) == ()


@pytest.mark.parametrize(
    "words, what",
    [([], "truncated"), ([1, 0, 2, 4], "truncated"), ([1, 99, 1, 4], "dtype code"), ([1, 0, 1, -4], "shape"),
     ([1, 0, 40], "dimensions"), ([1, -1, 5], "trailing"), ([70], "tensors")],
)
def test_malformed_spec_is_rejected(words: list[int], what: str) -> None:
    with pytest.raises(ValueError, match=what):
        decode_spec(words)


async def _run(script: str, *extra: str, depth: int = 2, headers: bool = False) -> list[dict]:
    env = {"DEPTH": str(depth), "HEADERS": "1" if headers else "0"}
    codes, outs, errs = await spawn_ranks(2, [str(WORKER), script, *extra], timeout=90, env=env)
    assert codes == [0, 0], "\n".join(e[-3000:] for e in errs)
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def _fast_pattern(report: dict) -> list[list[bool]]:
    return [[row["fast"] for row in st["landed"]] for st in report["steps"]]


@pytest.mark.asyncio
@pytest.mark.parametrize("depth, headers", [(1, False), (2, False), (5, False), (2, True)])
async def test_shapes_change_and_eval_steps(depth: int, headers: bool) -> None:
    """``headers``: the arrangement used on NCCL (headers through their own gloo group), on gloo."""
    r0, r1 = await _run("shapes", depth=depth, headers=headers)
    for rep in (r0, r1):
        assert "error" not in rep, rep["error"]
        for st in rep["steps"]:
            assert all(row["equal"] and row["rg_ok"] for row in st["landed"]), st
    # rank 1 receives the forward transfers: the first step of each kind unpredicted, then predicted
    # except where a shape or dtype changed (positions 1 and 2 of step 2)
    assert _fast_pattern(r1) == [
        [False] * 3, [True] * 3, [True, False, False], [True] * 3, [False, False], [True] * 3, [True, True],
    ]
    assert _fast_pattern(r0) == [[False] * 2, [True] * 2, [True] * 2, [True] * 2, [], [True] * 2, []]
    # sequence numbers run on across steps, in order
    seqs = [row["seq"] for st in r1["steps"] for row in st["landed"]]
    assert seqs == list(range(len(seqs)))
    assert [(row["kind"], row["stage"], row["mb"]) for row in r1["steps"][2]["landed"]] == [("F", 1, i) for i in range(3)]


@pytest.mark.asyncio
@pytest.mark.parametrize("headers", [False, True])
async def test_mixed_payloads(headers: bool) -> None:
    r0, r1 = await _run("mixed", headers=headers)
    for rep in (r0, r1):
        assert "error" not in rep, rep["error"]
        for st in rep["steps"]:
            assert all(row["equal"] and row["rg_ok"] for row in st["landed"]), st
    # step 1: predicted except the sixth transfer (step 0 had five); step 2: positions 0 and 2 changed size
    assert _fast_pattern(r1) == [[False] * 5, [True] * 5 + [False], [False, True, False, True, True, True]]
    assert _fast_pattern(r0) == [[False, False], [True, True], [True, True]]


@pytest.mark.asyncio
async def test_ranks_disagreeing_on_the_step_fail_clearly() -> None:
    r0, r1 = await _run("shapes", "--wrong-step")
    assert "error" in r1 and r1["steps"] and len(r1["steps"]) == 1
    assert "rank 0 sent a transfer of its step 8 while this rank expects step 1" in r1["error"]
    assert "disagree" in r1["error"]


@pytest.mark.asyncio
@pytest.mark.parametrize("headers", [False, True])
async def test_a_failed_step_fills_the_peers_receives(headers: bool) -> None:
    """After a failure the sender fills what the peer posted, so no receiver thread stays parked in gloo."""
    r0, r1 = await _run("shapes", "--abort", headers=headers)
    assert r0["filled"] == 2  # 3 transfers in the step, 1 sent
    assert r1["landed_before_abort"] == 1 and r1["filled"] == 2  # rank 1 had sent none of its 2
    assert r0["blocked"] == 0 and r1["blocked"] == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("headers", [False, True])
async def test_each_step_in_a_new_event_loop(headers: bool) -> None:
    """``asyncio.run(pipe.astep(...))`` per step: every step's transfers reach the loop running it
    (the receiver threads once kept the first step's loop and dropped every later arrival)."""
    r0, r1 = await _run("shapes", "--new-loops", headers=headers)
    for rep in (r0, r1):
        assert "error" not in rep, rep["error"]
        assert len(rep["steps"]) == 7
        for st in rep["steps"]:
            assert all(row["equal"] and row["rg_ok"] for row in st["landed"]), st
    assert _fast_pattern(r1) == [
        [False] * 3, [True] * 3, [True, False, False], [True] * 3, [False, False], [True] * 3, [True, True],
    ]



@pytest.mark.asyncio
@pytest.mark.parametrize("headers", [False, True])
async def test_layouts_whose_memory_is_not_their_value(headers: bool) -> None:
    """Conjugate and negative views, transposed tensors and complex dtypes arrive with their values
    (a conjugate view once failed the send; a contiguous negative view arrived negated)."""
    r0, r1 = await _run("layouts", headers=headers)
    for rep in (r0, r1):
        assert "error" not in rep, rep["error"]
        assert len(rep["steps"]) == 2
        for st in rep["steps"]:
            assert all(row["equal"] and row["rg_ok"] for row in st["landed"]), st
    assert _fast_pattern(r1) == [[False] * 6, [True] * 6]


@pytest.mark.asyncio
async def test_a_refused_transfer_is_filled_too() -> None:
    """A transfer refused before anything was sent (a dtype the plane cannot send) is still one the
    peer expects: the failed step's fill covers it, so the peer's receiver thread is not left parked."""
    r0, r1 = await _run("shapes", "--abort-bad-dtype")
    assert "uint16" in r0["send_error"] and "stage 1 microbatch 1" in r0["send_error"]
    assert r0["filled"] == 2  # 3 transfers in the step, 1 sent, 1 refused
    assert r1["landed_before_abort"] == 1 and r1["filled"] == 2
    assert r0["blocked"] == 0 and r1["blocked"] == 0



@pytest.mark.asyncio
@pytest.mark.parametrize("script, headers", [("shapes", True), ("big", False)])
async def test_ranks_disagreeing_on_training_or_evaluation_fail_clearly(script: str, headers: bool) -> None:
    """Step 1 is an evaluation step on rank 0 and a training step on rank 1: their predictions come from
    different tables, so the receives posted ahead do not match what is sent (this ended in gloo's read
    timeout, with no word of the cause).  Not checked: gloo with payloads packed after their header, where the header
    message itself has the predicted size and gloo ends the process on the size mismatch."""
    r0, r1 = await _run(script, "--wrong-kind", headers=headers)
    says = {0: "rank 1 sent a transfer of a training step (step 1) while this rank runs an evaluation step",
            1: "rank 0 sent a transfer of an evaluation step (step 1) while this rank runs a training step"}
    recs = {0: r0, 1: r1}
    clear = [r for r in (0, 1) if says[r] in recs[r].get("error", "")]
    assert clear, (r0, r1)
    for r in (0, 1):
        if r not in clear:
            # (a loaded machine: the peer found the disagreement first, reported it and closed the
            # connection before this rank read the offending header; seen once in 3 CI runs with headers)
            assert "receiving transfer" in recs[r]["error"] and f"from rank {1 - r} failed" in recs[r]["error"], recs[r]


@pytest.mark.asyncio
async def test_pipeline_steps_each_in_a_new_event_loop(tmp_path: Path) -> None:
    """The same through Pipeline: ``asyncio.run(pipe.astep(...))`` per step, an evaluation between
    (this hung in step 1 while the receiver threads kept the first step's loop)."""
    script = tmp_path / "loops.py"
    script.write_text(linear_job("""
        asyncio.run(pipe.astep(x, target=y))
        first = asyncio.run(pipe.aeval(x))
        for _ in range(2):
            asyncio.run(pipe.astep(x, target=y))
        again = asyncio.run(pipe.aeval(x))
        assert (first is None) == (rank == 0) and (rank == 0 or torch.equal(first, again))  # no optimizer: same output
        pipe.close()
        print("done", rank, flush=True)
    """, microbatches=2, rows=8, pipe_args="stall_timeout=20", imports=", asyncio"))
    codes, outs, errs = await spawn_ranks(2, [str(script)], timeout=60)
    assert codes == [0, 0], "\n".join(e[-3000:] for e in errs)
    assert all(f"done {r}" in outs[r] for r in range(2))


@pytest.mark.asyncio
async def test_pipelines_disagreeing_on_training_or_evaluation_fail_at_the_steps_start(tmp_path: Path) -> None:
    """Static shapes, auto (NCCL's default; here its protocol emulated on gloo): once both kinds of step have run, their transfers carry no headers; a
    rank calling eval() while the other calls step() fails on both ranks at the step's start, naming each
    side (the per-step layout agreement carries the kind; before, the end-of-step header caught it on one
    rank, after the step's transfers, and that rank reported the other as lost)."""
    outs = await _disagree_on_the_kind(tmp_path)
    for r in range(2):
        line = next(ln for ln in outs[r].splitlines() if ln.startswith("error"))
        assert f"rank {r} step 4: the ranks disagree on the kind of step" in line, line
        assert "rank(s) 0 run a training step" in line and "rank(s) 1 an evaluation step" in line, line


async def _disagree_on_the_kind(tmp_path: Path, before: str = "") -> list[str]:
    """2 ranks, static shapes (emulated NCCL protocol): two training and evaluation steps, ``before`` (a block of
    the script), then rank 0 calls step() and rank 1 eval(); each prints the error it got; their outputs."""
    script = tmp_path / "kinds.py"
    script.write_text(linear_job(f"""
        for _ in range(2):
            pipe.step(x, target=y)
            pipe.eval(x)
{textwrap.indent(textwrap.dedent(before), " " * 8)}
        try:
            pipe.step(x, target=y) if rank == 0 else pipe.eval(x)
        except pipeloom.PipelineError as exc:
            print("error", type(exc).__name__, str(exc).replace("\\n", " "), flush=True)
        pipe.close()
    """, microbatches=2, rows=8, pipe_args="options=pipeloom.RuntimeOptions(stall_timeout=20, emulate_nccl_transport=True)"))
    codes, outs, errs = await spawn_ranks(2, [str(script)], timeout=60)
    assert codes == [0, 0], "\n".join(e[-3000:] for e in errs)
    return outs


@pytest.mark.asyncio
async def test_a_rank_whose_gather_lands_after_the_peers_abort_still_names_the_disagreement(tmp_path: Path) -> None:
    """The same disagreement, with rank 1's side of the layout gather delivered 200 ms late (as a loaded host
    may): rank 0 sees the result first and aborts, and its abort reaches rank 1 while its gather is pending.
    Rank 1 still judges the gather itself (a bounded grace), so it names the disagreement rather than only
    relaying rank 0's failure (seen in CI under load before the grace)."""
    outs = await _disagree_on_the_kind(tmp_path, before="""
        import time
        if rank == 1:
            orig = pipe._actor.agree

            class Late:
                def __init__(self, g):
                    self.g, self.t0, self.work = g, time.monotonic(), g.work

                def done(self):
                    return self.g.done() and time.monotonic() - self.t0 > 0.2

                def on_done(self, fn):
                    self.g.on_done(fn)

                def result(self):
                    return self.g.result()

            pipe._actor.agree = lambda value: Late(orig(value))
    """)
    line = next(ln for ln in outs[1].splitlines() if ln.startswith("error"))
    assert line.startswith("error PipelineError") and "rank 1 step 4: the ranks disagree on the kind of step" in line, line


@pytest.mark.asyncio
async def test_headers_tell_the_sender_which_of_its_transfers_landed(tmp_path: Path) -> None:
    """A gloo header carries how many of the receiver's transfers its sender has landed, so a rank
    knows which of its sends completed without waiting for them (the end of a step then needs no
    thread).  gloo's header protocol (``static_shapes=False``; static shapes send no headers after the
    first step).  1F1B on 2 ranks: rank 1's last gradient of a step comes after it landed every
    activation of rank 0, which therefore knows all its sends landed; nothing comes back to rank 1
    after its last gradient, so it does not know that (and waits for the sends on a thread)."""
    script = tmp_path / "acks.py"
    script.write_text(linear_job("""
        for _ in range(2):
            pipe.step(x, target=y)
        t = pipe._tensors
        rx = t._receivers[1 - rank]
        print("acks", rank, t.sends_landed(), rx.acked, rx.landed, t._send_seq[1 - rank], flush=True)
        pipe.close()
    """, microbatches=3, rows=12, pipe_args="options=pipeloom.RuntimeOptions(stall_timeout=20, static_shapes=False)"))
    codes, outs, errs = await spawn_ranks(2, [str(script)], timeout=60)
    assert codes == [0, 0], "\n".join(e[-3000:] for e in errs)
    got = {}
    for r in range(2):
        line = next(ln for ln in outs[r].splitlines() if ln.startswith("acks"))
        _, rank, landed, acked, from_peer, sent = line.split()
        got[int(rank)] = (landed == "True", int(acked), int(from_peer), int(sent))
    assert got[0] == (True, 6, 6, 6)  # 3 activations a step, all landed at rank 1 before its last gradient
    landed1, acked1, from0, sent1 = got[1]
    assert not landed1 and sent1 == 6 and from0 == 6
    # rank 0's last activation of step 2 acknowledged step 1's three gradients and those of step 2
    # that had landed before it was sent (one or two, as the dispatcher ordered F2 and B1), never B2
    assert 3 < acked1 < 6
