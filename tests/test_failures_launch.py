"""Failures of real pipeloom ranks under the real ``pipeloom launch`` command.

``test_launch.py`` checks the launcher with tiny torch-free scripts and
``test_runtime_faults.py`` checks the runtime with ranks started directly;
here both run together, as a user runs them: ``pipeloom launch`` (the console
script, a subprocess) starts two ranks of ``ranks/launch_worker.py``, which
train a 4-stage Interleaved1F1B pipeline on gloo, and one rank misbehaves
(raises, is SIGKILLed, is SIGSTOPped, spins forever in a forward), or the
launcher gets SIGINT / SIGTERM, or an outsider sends wrongly signed frames to
a rank's control endpoint.  Each test checks the launcher's exit status, what
it printed, how long detection and teardown took (printed: ``pytest -s``
shows them), and that no rank process survives (the worker writes its pid
before importing torch).  Every launcher runs under a subprocess timeout and
every test kills whatever is left in a ``finally`` (the ``jobs`` fixture).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from pipeloom.transport.messages import PROTOCOL_VERSION, sign

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import pid_alive as _alive, wait_dead as _wait_dead  # noqa: E402

WORKER = str(Path(__file__).parent / "ranks" / "launch_worker.py")
_EXE = shutil.which("pipeloom")
LAUNCH = [_EXE, "launch"] if _EXE else [sys.executable, "-m", "pipeloom.tools.cli", "launch"]
WORLD = 2
HB_TIMEOUT, STALL_TIMEOUT = 2.0, 3.0


def _wait_file(path: Path, proc: subprocess.Popen[str], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the launcher exited ({proc.returncode}) before {path.name} appeared"
        assert time.monotonic() < end, f"{path.name} did not appear within {timeout} s"
        time.sleep(0.02)


class Job:
    """One ``pipeloom launch`` of two worker ranks, with everything it needs to clean up."""

    def __init__(self, out: Path, mode: str, *flags: str, env: dict[str, str] | None = None, **popen: Any) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [*LAUNCH, "--nproc-per-node", str(WORLD), *flags, WORKER, mode, str(out)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **popen,
        )  # fmt: skip

    def pids(self) -> list[int]:
        return [int(p.read_text()) for p in self.out.glob("pid[0-9]*")]

    def wait(self, timeout: float = 40.0) -> tuple[int, str, str, float]:
        """Launcher's exit status, stdout, stderr, and the time.time() it exited."""
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err, time.time()

    def assert_no_survivor(self) -> None:
        pids = self.pids()
        assert len(pids) == WORLD, f"pid files: {pids}"
        assert not _wait_dead(pids, 0.5), "a rank outlived the launcher"

    def record(self, rank: int) -> dict[str, Any]:
        p = self.out / f"rank{rank}.json"
        return json.loads(p.read_text()) if p.exists() else {"rank": rank, "status": "no record"}

    def fault_time(self) -> float:
        return float((self.out / "fault").read_text())

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        for pid in self.pids() if self.out.exists() else []:
            for kill in (os.killpg, os.kill):
                for sig in (signal.SIGKILL, signal.SIGCONT):  # SIGCONT: a stopped rank
                    try:
                        kill(pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    started: list[Job] = []
    try:
        yield started
    finally:
        for job in started:
            job.cleanup()


def _summary(err: str) -> str:
    """The launcher's closing summary (what follows the echoed rank output)."""
    at = err.find("pipeloom launch: job failed")
    assert at >= 0, err[-3000:]
    return err[at:]


# ---------------------------------------------------------------- a rank raises


def test_rank_raises_root_cause_once_and_fast_teardown(tmp_path: Path, jobs: list[Job]) -> None:
    job = Job(tmp_path, "raise")
    jobs.append(job)
    code, out, err, ended = job.wait()
    fault = job.fault_time()
    r0, r1 = job.record(0), job.record(1)
    stopped = r0["t"] - fault
    exited = ended - fault
    print(f"\nraise: every rank stopped {stopped * 1e3:.0f} ms after the fault; launcher exited after {exited:.2f} s (exit {code})")
    assert code == 1, err[-3000:]
    job.assert_no_survivor()
    assert r1["type"] == "StageError" and r0["type"] == "RemoteRankError" and r0["failed_rank"] == 1
    # The runtime's part is milliseconds; the rest is the ranks' interpreter shutdown (torch's
    # modules take 0.4-1 s to tear down on this loaded 2-core machine) and the launcher.
    assert stopped < 1.0
    # Target 2 s, met on an idle machine (0.6-1.6 s); at load average 5 the ranks' shutdown alone
    # took over 2 s, so the bound here is looser: their shutdown plus the launcher's grace + 1 s.
    assert exited < 5.0, f"launcher exited {exited:.2f} s after the fault"
    # The root cause, once: rank, stage, microbatch, action, then the user's traceback.
    summary = _summary(err)
    # (the grace counts from rank 1's report: if its interpreter's shutdown outlasts it, the launcher ends it)
    first, _, rest = summary.partition("\n")
    assert first in ("pipeloom launch: job failed: rank 1 exited with code 1",
                     "pipeloom launch: job failed: rank 1 failed (still exiting after --grace: was killed by SIGTERM by the launcher)"), summary
    head = f"  root cause: rank 1, stage {r1['stage']}, microbatch {r1['microbatch']}, action {r1['action']}\n"
    assert rest.startswith(head), summary
    assert 'raise ValueError("boom in user code")' in summary and summary.count("ValueError: boom in user code") == 2  # error line + traceback
    assert summary.rstrip("\n").split("\n")[-1].startswith("pipeloom launch: also stopped: rank 0 (consequence of rank 1"), summary
    assert "RemoteRankError" not in summary and "rank 0 stopped because" not in summary
    assert err.count("root cause:") == 1 and err.count("job failed") == 1
    assert "PIPELOOM_ROOT_CAUSE" not in err + out


# ---------------------------------------------------------------- a rank is SIGKILLed


def test_sigkilled_rank_is_named_exit_3(tmp_path: Path, jobs: list[Job]) -> None:
    job = Job(tmp_path, "kill")
    jobs.append(job)
    code, _, err, ended = job.wait()
    fault = job.fault_time()
    r0 = job.record(0)
    # Rank 0 sees the broken connection at once if it had a receive posted from rank 1; if it was
    # waiting for an announcement instead, only the heartbeat timeout (default 10 s) would tell it,
    # and the launcher's grace (2 s) ends it first.  Either way the job is gone within grace + 1 s.
    how = f"raised {r0['type']} after {(r0['t'] - fault) * 1e3:.0f} ms" if "t" in r0 else "was terminated by the launcher"
    print(f"\nSIGKILL: rank 0 {how}; launcher exited after {ended - fault:.2f} s (exit {code})")
    assert code == 3, err[-3000:]
    job.assert_no_survivor()
    assert ended - fault < 3.0
    summary = _summary(err)
    assert summary.startswith("pipeloom launch: job failed: rank 1 was killed by SIGKILL\n"), summary
    assert "pipeloom launch: also stopped: rank 0 (consequence of rank 1" in summary
    if "t" in r0:
        assert r0["type"] == "PeerLostError" and r0["peer"] == 1, r0
        # what rank 0 was doing when it found out: waiting for rank 1's transfer, or sending it one
        # (static shapes: its receives are posted ahead, so a send can be what breaks first)
        assert "this rank was waiting for" in r0["message"] or (
            "sending " in r0["message"] and " failed: " in r0["message"]), r0["message"]
        assert "  rank 0 reports: rank 0: lost rank 1: " in summary
    else:
        assert "the launcher terminated rank 0" in summary


# ---------------------------------------------------------------- a rank stalls


@pytest.mark.parametrize(
    ("mode", "timeout", "says"),
    [("stop", HB_TIMEOUT, "no heartbeat for"), ("spin", STALL_TIMEOUT, "it has been running 1F2 for")],
    ids=["sigstop", "endless-loop"],
)
def test_stalled_rank_is_detected_and_named(tmp_path: Path, jobs: list[Job], mode: str, timeout: float, says: str) -> None:
    env = {**os.environ, "PIPELOOM_STALL_TIMEOUT": str(STALL_TIMEOUT)}
    job = Job(tmp_path, mode, "--heartbeat-timeout", str(HB_TIMEOUT), "--grace", "1", env=env)
    jobs.append(job)
    code, _, err, ended = job.wait()
    fault = job.fault_time()
    r0 = job.record(0)
    detected = r0["t"] - fault
    print(f"\n{mode}: detected by rank 0 after {detected:.2f} s (timeout {timeout:g} s); "
          f"launcher exited after {ended - fault:.2f} s (grace 1, exit {code})")
    assert code == 1, err[-3000:]
    job.assert_no_survivor()
    assert r0["type"] == "PeerLostError" and r0["peer"] == 1, r0
    # checked every min(1, heartbeat_timeout / 4) s while waiting, plus slack for a loaded machine; the
    # silence counts from rank 1's last message, which on a loaded machine can precede the fault by up
    # to a second (a heartbeat every 0.5 s, from a thread that competes for the GIL)
    assert timeout - 1.0 <= detected <= timeout + 1.5
    summary = _summary(err)
    lines = summary.splitlines()
    assert lines[0].startswith("pipeloom launch: job failed: rank 1 was killed by SIG") and "(stopped by the launcher)" in lines[0], summary
    assert lines[1].startswith("  rank 0 reports: rank 0: lost rank 1: ") and says in lines[1], summary
    waiting = lines[1].split("this rank was waiting for ", 1)[1]
    assert "from rank 1" in waiting or "on rank 1" in waiting  # by stage and microbatch
    assert " microbatch " in waiting and " stage " in waiting
    # The grace counts from rank 0's report, so rank 0 is terminated too if its own exit takes longer.
    assert lines[-1].startswith("pipeloom launch: also stopped: rank 0 (consequence of rank 1"), summary
    if mode == "stop":  # a stopped rank gets SIGKILL at the end of the grace, not a SIGTERM it cannot act on
        assert lines[0].startswith("pipeloom launch: job failed: rank 1 was killed by SIGKILL"), summary
    # bounded by the report, not by the reporting rank's exit: grace (1) + SIGKILL after 1 s + slack
    assert ended - r0["t"] < 1 + 1 + 2.0, f"launcher exited {ended - r0['t']:.2f} s after rank 0 reported"
    assert "Traceback" not in summary and "TimeoutError" not in err  # no wait-internals in the rank's traceback


# ---------------------------------------------------------------- signals to the launcher


@pytest.mark.parametrize(("sig", "expected"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["sigint", "sigterm"])
def test_signal_to_launcher_while_training(tmp_path: Path, jobs: list[Job], sig: signal.Signals, expected: int) -> None:
    # Its own session, so that SIGINT can go to its whole process group as a terminal's Ctrl-C does.
    job = Job(tmp_path, "train", start_new_session=True)
    jobs.append(job)
    _wait_file(tmp_path / "step1", job.proc)  # both ranks are training
    t0 = time.time()
    os.killpg(job.proc.pid, sig)
    code, _, err, ended = job.wait(timeout=15)
    print(f"\n{sig.name} to the launcher while training: launcher exited after {ended - t0:.2f} s (exit {code})")
    assert code == expected, err[-3000:]
    job.assert_no_survivor()
    assert ended - t0 < 2.0 + 1.0  # SIGTERM at once; SIGKILL after --grace (2)
    assert f"pipeloom launch: stopped by {sig.name}; terminated ranks 0, 1\n" in err
    assert "job failed" not in err and "PIPELOOM_ROOT_CAUSE" not in err


# ---------------------------------------------------------------- an outsider with the wrong secret


def _forged_frames(to_rank: int) -> list[bytes]:
    """Frames a process outside the job might send: each would disturb training if it were accepted.

    Built with msgpack directly (not ``encode``, which validates against the
    current schema): the signature is checked before anything else.
    """
    src = 1 - to_rank
    wrong = b"0123456789abcdef" * 2

    def msg(msg_type: str, /, **fields: Any) -> bytes:
        return msgpack.packb({"v": PROTOCOL_VERSION, "type": msg_type, "src": src, **fields}, use_bin_type=True)

    msgs = [
        msg("abort", step=1, stage=1, mb=0, action="1F0", error="ValueError: forged", traceback="forged"),
        msg("heartbeat", step=1, t=time.time(), state="busy", what="1F0", for_s=1e6, stall_s=1.0),
        msg("xfer", seq=7, step=1, stage=0, mb=0, kind="B", tensors=[[[4, 8], "float32", False]]),
    ]
    frames = [sign(wrong, m) for m in msgs]
    frames += msgs  # unsigned
    frames.append(sign(wrong, msgpack.packb({"v": PROTOCOL_VERSION, "type": "abort"})))
    return frames


def _reference_losses() -> list[float]:
    """The worker's microbatch losses, computed in one process (4 rows per microbatch)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    lins = [nn.Linear(8, 8) for _ in range(4)]
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    out = []
    with torch.no_grad():
        for xm, ym in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4)):
            h = xm
            for lin in lins:
                h = torch.tanh(lin(h))
            out.append(float(nn.functional.mse_loss(h, ym)))
    return out


def test_wrongly_signed_messages_are_rejected_and_training_completes(tmp_path: Path, jobs: list[Job]) -> None:
    env = {**os.environ, "PIPELOOM_JOB_SECRET": "feedc0de" * 4}
    job = Job(tmp_path, "forged", env=env)
    jobs.append(job)
    ctx = zmq.Context()
    sent = [0] * WORLD
    try:
        for r in range(WORLD):
            _wait_file(tmp_path / f"endpoint{r}", job.proc)
        for r in range(WORLD):
            endpoint = (tmp_path / f"endpoint{r}").read_text()
            assert endpoint.startswith("tcp://127.0.0.1:")  # single-host job: loopback only
            s = ctx.socket(zmq.PUSH)
            s.connect(endpoint)
            for frame in _forged_frames(r):
                s.send(frame)
                sent[r] += 1
    finally:
        ctx.destroy(linger=1000)  # closes every socket, delivering what is queued (bounded)
        (tmp_path / "forged").write_text("")
    code, out, err, _ = job.wait()
    recs = [job.record(r) for r in range(WORLD)]
    print(f"\nforged frames: sent {sent}, rejected {[r.get('rejected') for r in recs]}; exit {code}")
    assert code == 0, err[-3000:]
    job.assert_no_survivor()
    assert all(r["status"] == "ok" for r in recs), recs
    assert all(r["rejected"] >= n for r, n in zip(recs, sent)), (recs, sent)
    for r in range(WORLD):
        assert f"[rank{r}]: rank {r}: rejected a control message: bad signature" in err, err[-3000:]
        # summarised, not one line per frame: the first in full, the rest counted in one line
        assert err.count(f"[rank{r}]: rank {r}: rejected a control message") == 1, err[-3000:]
        assert f"[rank{r}]: rank {r}: rejected {sent[r] - 1} more control messages in the last " in err, err[-3000:]
    assert recs[1]["losses"] == pytest.approx(_reference_losses(), rel=1e-5)


# ---------------------------------------------------------------- restarts


def test_killed_rank_restarts_and_training_resumes_from_checkpoint(tmp_path: Path) -> None:
    """``--max-restarts 1``: rank 1 is SIGKILLed in step 3; every rank restarts, resumes from the
    last step both saved and ends with exactly the parameters of an uninterrupted run.  The uninterrupted run is
    the same worker on 2 rank processes of the test harness (forked, torch already imported: the launcher's part
    is the killed run's; a job that succeeds is not restarted: test_launch's max-restarts tests)."""
    import asyncio

    import torch

    sys.path.insert(0, str(Path(__file__).parent / "ranks"))
    from harness import spawn_ranks

    worker = str(Path(__file__).parent / "ranks" / "resume_worker.py")
    results = {}
    out = tmp_path / "clean"
    out.mkdir()
    codes, _, errs = asyncio.run(spawn_ranks(2, [worker, "clean", str(out), "6"], timeout=120,
                                             env={"TORCHELASTIC_RESTART_COUNT": "0"}))
    assert codes == [0, 0], "\n".join(e[-3000:] for e in errs)
    results["clean"] = (out, "")
    out = tmp_path / "kill"
    out.mkdir()
    proc = subprocess.run([*LAUNCH, "--nproc-per-node", "2", "--grace", "0.5", "--max-restarts", "1",
                           worker, "kill", str(out), "6"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results["kill"] = (out, proc.stderr)
    out, err = results["kill"]
    assert "attempt 0 failed: rank 1 was killed by SIGKILL" in err and "restarting every rank (restart 1" in err
    assert (out / "attempts1").read_text().split() == ["0:0", "1:3"]
    assert (out / "attempts0").read_text().split() == ["0:0", "1:3"]
    assert [(out.parent / "clean" / f"attempts{r}").read_text().split() for r in range(2)] == [["0:0"], ["0:0"]]
    for rank in range(2):
        clean = torch.load(results["clean"][0] / f"final{rank}.pt")
        resumed = torch.load(out / f"final{rank}.pt")
        for index in clean:
            for name, value in clean[index].items():
                assert torch.equal(value, resumed[index][name]), (rank, index, name)
