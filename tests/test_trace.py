"""Rank traces end to end: the launcher's collector, the per-rank files, export and summary.

Two real 2-rank jobs run once per module (``ZBVZeroBubble``, 4 microbatches,
2 steps; about 5 s each, most of it importing torch): one under ``pipeloom
launch --trace`` (ranks stream to the collector, one file), one with
``PIPELOOM_TRACE`` set by hand as under torchrun (each rank writes its own
file).  Both traces must hold every compute action of every rank's schedule
exactly once per step, on the right rank, in an order the dependencies allow;
times of all ranks are on one host's aligned clock, so cross-rank order is
checked too.  Everything else (summary numbers, Chrome export, the collector's
handling of bad frames) runs on small hand-built inputs in process.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from ranks.harness import launch_script

from pipeloom.schedules import Costs, generate, lower, simulate
from pipeloom.tools.cli import main
from pipeloom.tools.trace_collector import TraceCollector
from pipeloom.tools.trace_export import chrome_trace
from pipeloom.tools.trace_model import TraceModel, format_summary, load_trace, summarize, trace_api

SCHEDULE, RANKS, MBS, STEPS = "ZBVZeroBubble", 2, 4, 2
SKEW_NS = 100_000
"""How far two processes' aligned clocks may disagree (each measures its offset once, at import)."""

SCRIPT = textwrap.dedent(
    f"""\
    import os, sys
    import torch, pipeloom
    from torch import nn
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)]
    pipe = pipeloom.Pipeline(lambda s: stages[s], schedule={SCHEDULE!r}, num_microbatches={MBS},
                             loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    for _ in range({STEPS}):
        pipe.step(x, target=y)
    pipe.close()
    sys.stdout.flush(); sys.stderr.flush()
    # The trace is complete once close() returns; skip interpreter teardown, where
    # a rank occasionally aborts in native code (not a tracing matter, reported apart).
    os._exit(0)
    """
)


def _launch(tmp: Path, *, trace_flag: str | None, env_trace: str | None) -> subprocess.CompletedProcess[str]:
    return launch_script(tmp, SCRIPT, nproc=RANKS, launch_args=("--trace", trace_flag) if trace_flag is not None else (),
                         env={"PIPELOOM_TRACE": env_trace} if env_trace is not None else None, timeout=150)


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    d = tmp_path_factory.mktemp("streamed")
    proc = _launch(d, trace_flag=str(d / "run.jsonl"), env_trace=None)
    assert proc.returncode == 0, proc.stderr
    return d, proc


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("per_rank")
    proc = _launch(d, trace_flag=None, env_trace=str(d / "run.jsonl"))
    assert proc.returncode == 0, proc.stderr
    return d


def _check_complete_and_ordered(model: TraceModel) -> None:
    sched = generate(SCHEDULE, num_ranks=RANKS, num_microbatches=MBS)
    place = sched.stage_to_rank
    assert model.steps == list(range(STEPS))
    for rank in range(RANKS):
        expected = Counter(str(a) for a in sched.actions[rank] if a.is_compute)
        for step in range(STEPS):
            got = Counter(a.name for a in model.actions_of(rank, step))
            assert got == expected, f"rank {rank} step {step}"
    for rank, acts in model.actions.items():
        for a in acts:
            assert place[a.stage] == rank == a.event["rank"], a
    # Dependencies.  On a rank, an action ends before a dependent one starts.  Across
    # ranks the chain is checked link by link: producer ends -> send posted -> data
    # landed on the consumer -> consumer starts.
    recv_of = {(t.step, t.event["kind"], t.stage, t.mb): t for lst in model.transfers.values() for t in lst if t.kind == "recv"}
    send_of = {(t.step, t.event["kind"], t.stage, t.mb): t for lst in model.transfers.values() for t in lst if t.kind == "send"}
    last = len(place) - 1

    def after(producer: Any, consumer: Any, kind: str, to_stage: int) -> None:
        if producer.rank == consumer.rank:
            assert producer.end <= consumer.start, (consumer.step, producer.name, consumer.name)
            return
        key = (consumer.step, kind, to_stage, consumer.mb)
        send, recv = send_of[key], recv_of[key]
        assert (send.rank, recv.rank) == (producer.rank, consumer.rank)
        # the action's span covers its compute; its outputs are sent right after it
        assert producer.end <= send.start, (producer.name, send.name)
        assert producer.end <= consumer.start + SKEW_NS, (producer.name, consumer.name)
        assert send.start <= recv.end + SKEW_NS, (send.name, recv.name)
        assert recv.end <= consumer.start, (recv.name, consumer.name)

    for step in range(STEPS):
        by = {(a.type, a.stage, a.mb): a for r in model.ranks for a in model.actions_of(r, step)}
        for (typ, s, m), a in by.items():
            if typ == "F" and s > 0:
                after(by[("F", s - 1, m)], a, "F", s)
            if typ in ("B", "I"):
                after(by[("F", s, m)], a, "F", s)
                if s < last:
                    after(by.get(("I", s + 1, m)) or by[("B", s + 1, m)], a, "B", s)
            if typ == "W":
                after(by[("I", s, m)], a, "W", s)
    # every transfer was seen on both sides
    sends = [t for lst in model.transfers.values() for t in lst if t.kind == "send"]
    assert sends and len(model.transfer_pairs()) == len(sends)


def test_launch_trace_writes_one_complete_file(streamed: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    d, proc = streamed
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("run.jsonl")) == ["run.jsonl"]
    header = trace_api().read_header(d / "run.jsonl")
    assert header["live"].startswith("tcp://127.0.0.1:")
    assert f"pipeloom: trace -> {d / 'run.jsonl'} (live: {header['live']})" in proc.stderr
    assert header["schedule"] == SCHEDULE and header["world_size"] == RANKS
    _check_complete_and_ordered(load_trace(d / "run.jsonl"))


def test_per_rank_files_without_the_collector(per_rank: Path) -> None:
    files = sorted(str(p) for p in per_rank.iterdir() if p.name.startswith("run.jsonl"))
    assert [os.path.basename(f) for f in files] == ["run.jsonl.rank0", "run.jsonl.rank1"]
    assert "live" not in trace_api().read_header(files[0])
    _check_complete_and_ordered(load_trace(files))


def test_chrome_export_of_a_real_run(streamed: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path) -> None:
    d, _ = streamed
    out = tmp_path / "chrome.json"
    assert main(["trace", "export", str(d / "run.jsonl"), "--chrome", str(out)]) == 0
    doc = json.loads(out.read_text())
    evs = doc["traceEvents"]
    model = load_trace(d / "run.jsonl")
    n_actions = sum(len(v) for v in model.actions.values())
    compute = [e for e in evs if e["ph"] == "X" and e["cat"] == "compute"]
    assert len(compute) == n_actions
    assert Counter((e["pid"], e["name"]) for e in compute) == Counter(
        (a.rank, "PP:" + a.name) for lst in model.actions.values() for a in lst
    )
    names = {(e["pid"], e["name"]) for e in evs if e["ph"] in ("X", "b")}
    assert (0, "PP:0F0") in names and (1, "PP:1F0") in names
    # stage 0 (rank 0) sends its forward of microbatch 0 to stage 1 (rank 1): named from the producer
    assert (0, "PP:0SEND_F0") in names and (1, "PP:1RECV_F0") in names
    assert (1, "PP:2SEND_F0") in names and (0, "PP:3RECV_F0") in names
    # receives are async slices: no overflow rows of "comm recv" however many overlap
    assert not any(e["ph"] == "M" and e["name"] == "thread_name" and e["args"]["name"].startswith("comm recv (") for e in evs)
    n_recv = sum(1 for lst in model.transfers.values() for t in lst if t.kind == "recv")
    assert sum(1 for e in evs if e["ph"] == "b") == sum(1 for e in evs if e["ph"] == "e") == n_recv
    procs = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}
    threads = {(e["pid"], e["args"]["name"]) for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(0, "compute"), (0, "comm send"), (0, "comm recv"), (0, "waits")} <= threads
    starts = {e["id"]: e for e in evs if e["ph"] == "s"}
    ends = {e["id"]: e for e in evs if e["ph"] == "f"}
    pairs = model.transfer_pairs()
    assert len(starts) == len(ends) == len(pairs) > 0 and set(starts) == set(ends)
    for i, s in starts.items():
        f = ends[i]
        assert f["bp"] == "e" and s["pid"] != f["pid"] and s["ts"] <= f["ts"]
    assert any(e["ph"] == "C" for e in evs)
    # per-rank files for HTA
    assert main(["trace", "export", str(d / "run.jsonl"), "--chrome", str(out), "--per-rank"]) == 0
    for r in (0, 1):
        one = json.loads((tmp_path / f"chrome.rank{r}.json").read_text())
        assert one["distributedInfo"]["rank"] == r and one["distributedInfo"]["world_size"] == 2
        assert one["traceEvents"] and all(e.get("pid") == r for e in one["traceEvents"])


def _tiny_trace() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Two ranks, two steps, numbers chosen so every statistic is easy to compute by hand."""
    header = trace_api().make_header(world_size=2, schedule="1F1B", num_microbatches=1, stage_to_rank=[0, 1])
    A = lambda r, s, n, t, st, a, b: {"ev": "action", "rank": r, "step": s, "name": n, "type": t, "stage": st, "mb": 0, "start": a, "end": b}  # noqa: E731
    events = [
        {"ev": "step", "rank": 0, "step": 0, "start": 1000, "end": 1100},
        {"ev": "step", "rank": 1, "step": 0, "start": 1010, "end": 1110},
        A(0, 0, "0F0", "F", 0, 1000, 1020),
        {"ev": "send", "rank": 0, "step": 0, "peer": 1, "stage": 1, "mb": 0, "kind": "F", "seq": 0, "bytes": 64, "start": 1015, "end": 1020},
        {"ev": "wait", "rank": 0, "step": 0, "start": 1020, "end": 1060, "for": ["0B0: gradient from stage 1 microbatch 0 on rank 1"]},
        A(0, 0, "0B0", "B", 0, 1060, 1100),
        {"ev": "wait", "rank": 1, "step": 0, "start": 1010, "end": 1025, "for": ["1F0: activation of stage 0 microbatch 0 from rank 0"]},
        {"ev": "recv", "rank": 1, "step": 0, "peer": 0, "stage": 1, "mb": 0, "kind": "F", "seq": 0, "bytes": 64, "start": 1016, "end": 1024},
        A(1, 0, "1F0", "F", 1, 1025, 1045),
        A(1, 0, "1B0", "B", 1, 1045, 1055),
        {"ev": "step", "rank": 0, "step": 1, "start": 1200, "end": 1300},
        {"ev": "step", "rank": 1, "step": 1, "start": 1200, "end": 1300},
        A(0, 1, "0F0", "F", 0, 1200, 1250),
        A(1, 1, "1F0", "F", 1, 1250, 1300),
        {"ev": "memory", "rank": 0, "step": 1, "t": 1300, "live_mb": 1},
    ]
    return header, events


def test_summary_numbers_by_hand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    header, events = _tiny_trace()
    path = tmp_path / "tiny.jsonl"
    trace_api().write_trace(path, header, events)
    model = load_trace(path)
    s = summarize(model)
    assert s.step_times_ns == {0: 110, 1: 100}  # step 0: earliest start 1000, latest end 1110
    r0, r1 = s.ranks
    assert (r0.window_ns, r0.busy_ns, r0.idle_ns, r0.waiting_ns, r0.actions) == (210, 110, 100, 40, 3)
    assert (r1.window_ns, r1.busy_ns, r1.idle_ns, r1.waiting_ns, r1.actions) == (210, 80, 130, 15, 3)
    assert r0.busy_fraction == pytest.approx(110 / 210) and r0.bubble_fraction == pytest.approx(100 / 210)
    assert r1.busy_fraction == pytest.approx(80 / 210)
    assert (r0.bytes_sent, r0.bytes_received, r1.bytes_sent, r1.bytes_received) == (64, 0, 0, 64)
    assert s.bubble_fraction == pytest.approx(230 / 420)
    w = s.longest_waits
    assert [(x.rank, x.duration_ns, x.before) for x in w] == [(0, 40, "0B0"), (1, 15, "1F0")]
    assert w[0].waiting_for == ("0B0: gradient from stage 1 microbatch 0 on rank 1",) and w[0].start_ns == 20

    one = summarize(model, step=1)
    assert [(r.window_ns, r.busy_ns) for r in one.ranks] == [(100, 50), (100, 50)] and not one.longest_waits

    assert main(["trace", "summary", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads(json.dumps(s.to_json()))
    assert doc["ranks"][0]["busy_fraction"] == pytest.approx(110 / 210)
    assert main(["trace", "summary", str(path), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == format_summary(one) and "50.0%" in out
    assert main(["trace", "summary", str(path), "--step", "7"]) == 2
    assert "no step 7" in capsys.readouterr().err


def test_chrome_export_by_hand() -> None:
    header, events = _tiny_trace()
    doc = chrome_trace(TraceModel(header, events))
    x = {(e["pid"], e["name"]): e for e in doc["traceEvents"] if e["ph"] == "X" and e.get("cat") != "critical_path" and e["args"]["step"] == 0}
    f0 = x[(0, "PP:0F0")]
    assert f0["ts"] == 0.0 and f0["dur"] == pytest.approx(0.02) and f0["args"]["stage"] == 0
    send, consumer = x[(0, "PP:0SEND_F0")], x[(1, "PP:1F0")]
    # a receive is an async slice (b/e), never an overflow row
    b, e_ = ([e for e in doc["traceEvents"] if e["ph"] == ph and e.get("name") == "PP:1RECV_F0"] for ph in ("b", "e"))
    assert len(b) == len(e_) == 1 and b[0]["id"] == e_[0]["id"] and b[0]["pid"] == 1
    assert b[0]["ts"] == pytest.approx(0.016) and e_[0]["ts"] == pytest.approx(0.024) and b[0]["args"]["peer"] == 0
    assert send["args"]["bytes"] == 64 and send["args"]["peer"] == 1
    flows = [e for e in doc["traceEvents"] if e["ph"] in ("s", "f")]
    assert sorted(e["ph"] for e in flows) == ["f", "s"] and flows[0]["id"] == flows[1]["id"]
    s, f = sorted(flows, key=lambda e: e["ph"], reverse=True)
    assert s["tid"] == send["tid"] and send["ts"] <= s["ts"] <= send["ts"] + send["dur"]
    # the arrow ends on the action that consumed the data
    assert f["tid"] == consumer["tid"] and consumer["ts"] <= f["ts"] <= consumer["ts"] + consumer["dur"]
    assert f["args"]["landed_us"] == pytest.approx(0.024)
    assert [e["args"] for e in doc["traceEvents"] if e["ph"] == "C"] == [{"live_mb": 1}]


def test_simulation_trace_matches_the_simulator(tmp_path: Path) -> None:
    out = tmp_path / "plan.jsonl"
    assert main(["schedule", "simulate", "1F1B", "-p", "2", "-m", "4", "--costs", "F=1,B=2,latency=0.5", "--trace", str(out)]) == 0
    model = load_trace(out)
    assert model.header["source"] == "simulation" and model.header["time_unit_ns"] == 1_000_000
    costs = Costs.parse("F=1,B=2,latency=0.5")
    result = simulate(lower(generate("1F1B", num_ranks=2, num_microbatches=4), comms=True), costs)
    s = summarize(model)
    assert s.step_times_ns == {0: round(result.makespan * 1e6)}
    for r in s.ranks:
        assert r.busy_ns == pytest.approx(result.busy[r.rank] * 1e6)
        assert r.bubble_fraction == pytest.approx(result.bubble_fraction[r.rank])
    assert len(model.transfer_pairs()) == 2 * 4 * 1  # F and B of each microbatch across the one boundary
    assert s.longest_waits and s.longest_waits[0].waiting_for


# ---------------------------------------------------------------- the collector


def test_collector_rejects_bad_frames_and_republishes(tmp_path: Path) -> None:
    from pipeloom.transport.messages import sign

    secret = b"0123456789abcdef"
    said: list[str] = []
    path = tmp_path / "job.jsonl"
    col = TraceCollector(str(path), secret=secret, world_size=2, say=said.append)
    col.start()
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(col.live_address)
        push = ctx.socket(zmq.PUSH)
        push.connect(col.endpoint)
        header, events = _tiny_trace()
        good = {"v": 1, "type": "trace", "src": 0, "header": header, "events": events[:4], "dropped": 0}
        time.sleep(0.2)  # let the subscriber join before anything is published
        push.send(sign(b"not the job secret", msgpack.packb(good)))
        push.send(sign(secret, msgpack.packb({"v": 1, "type": "trace", "src": 0, "events": [{"no": "ev"}]})))
        push.send(b"short")
        push.send(sign(secret, msgpack.packb(good)))
        push.send(sign(secret, msgpack.packb({**good, "src": 1, "header": None, "events": events[4:], "dropped": 3})))
        assert sub.poll(5000), "nothing republished"
        live = msgpack.unpackb(sub.recv(), raw=False)
        assert live["events"] == events[:4] and live["header"]["live"] == col.live_address
        push.close(linger=1000)
        sub.close()
    finally:
        ctx.term()
    stats = col.close()
    assert (stats.rejected, stats.batches, stats.events) == (3, 2, len(events))
    assert stats.ranks == {0, 1} and stats.dropped == {1: 3}
    assert any("bad signature" in m for m in said) and any("rank 1 dropped 3 events" in m for m in said)
    tf = trace_api().read_trace(path)
    assert tf.header["live"] == col.live_address and len(tf.events) == len(events)


def test_collector_with_no_batches_leaves_a_valid_file(tmp_path: Path) -> None:
    col = TraceCollector(str(tmp_path / "empty.jsonl"), secret=b"k", world_size=3, drain_timeout=0.2)
    col.start()
    col.close()
    tf = trace_api().read_trace(tmp_path / "empty.jsonl")
    assert tf.events == [] and tf.header["world_size"] == 3 and tf.header["live"]
