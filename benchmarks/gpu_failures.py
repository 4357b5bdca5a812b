"""Failure cases through ``pipeloom launch`` on NCCL (or gloo), timed from outside; prints one table.

Why a script and not tests: the NCCL cases need GPUs, which CI does not have,
and what matters here are times (a bound per case), which tests must not
assert.  The same cases run on gloo in ``tests/test_failures_launch.py`` and
``tests/test_runtime_faults.py``; this is their NCCL equivalent, in one call
of the GPU machine.

Each case starts ``pipeloom launch --nproc-per-node 2`` on this file's worker
(a 4-stage Interleaved1F1B pipeline of float32 linear stages, on
``cuda:LOCAL_RANK`` with NCCL), makes rank 1 misbehave in step 1 and measures, from the
worker's ``fault`` timestamp: when rank 0 reported (its own record), when the
launcher exited, its exit status, the first summary line and who it names,
whether rank 0 exited by itself (the summary does not say "the launcher
terminated rank 0") and whether any process of either rank's process group
is left.  Cases:

- ``raise``: ``ValueError`` in a forward;       goal: ended <= 2 s after it
- ``kill``: SIGKILL in a forward;               goal: <= 3 s
- ``stop``: SIGSTOP in a forward;               goal: <= heartbeat timeout + 3 s
- ``spin``: ``while True`` in a forward;        goal: <= stall timeout + 3 s
- ``early``: raises between steps 0 and 1, so it never reaches step 1 (its
  Pipeline says 'bye' at exit);                 goal: <= 3 s
- ``vanish``: SIGKILLed between steps 0 and 1 (nobody has a receive open from
  it);                                          goal: <= 3 s
- ``construct``: SIGKILLed inside ``Pipeline(...)`` (in ``stage_fn``), while
  rank 0 is in the construction's collectives; goal: <= 3 s
- ``stop-usergroup``: ``stop``, with the process group created by the script
  (the Pipeline then aborts only the groups it created);
                                                goal: <= heartbeat timeout + 3 s

Usage (from the repository root; the GPU machine's python3 is fine)::

    python3 benchmarks/gpu_failures.py [--backend nccl] [--cases raise,kill,...] [--grace S] [--logs DIR] [--md FILE] [--json FILE]

Not yet measured on GPUs: a run with a long ``--grace`` (e.g. 20), which would
show whether a rank that aborted its communicators exits by itself and how
long the abort and its exit take (see RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HB, STALL, GRACE = 5.0, 5.0, 2.0
CASES = ("raise", "kill", "stop", "spin", "early", "vanish", "construct", "stop-usergroup")
GOALS = {"raise": 2.0, "kill": 3.0, "stop": HB + 3, "spin": STALL + 3, "early": 3.0, "vanish": 3.0,
         "construct": 3.0, "stop-usergroup": HB + 3}


# ---------------------------------------------------------------- the rank


def worker(mode: str, out: str) -> None:
    rank = int(os.environ["RANK"])

    def note(name: str, value: object) -> None:
        tmp = os.path.join(out, f"{name}.tmp{rank}")
        with open(tmp, "w") as f:
            f.write(str(value))
        os.replace(tmp, os.path.join(out, name))

    note(f"pid{rank}", os.getpid())
    import torch
    from torch import nn

    import pipeloom

    def fault() -> None:
        note("fault", repr(time.time()))

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(256, 256)
            self.calls = 0
            self.step = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.step == 1 and rank == 1 and self.calls == 3 and mode in ("raise", "kill", "stop", "spin", "stop-usergroup"):
                fault()
                if mode == "raise":
                    raise ValueError("boom in user code")
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if mode in ("stop", "stop-usergroup"):
                    os.kill(os.getpid(), signal.SIGSTOP)
                while True:  # spin
                    pass
            return torch.tanh(self.lin(x))

    backend = os.environ.get("PIPELOOM_BACKEND", "gloo")
    if mode == "stop-usergroup":
        import torch.distributed as dist

        if backend == "nccl":
            local = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        else:
            dist.init_process_group("gloo")
    torch.manual_seed(0)
    stages = [Stage() for _ in range(4)]

    def stage_fn(s: int) -> nn.Module:
        if mode == "construct" and rank == 1:
            fault()
            os.kill(os.getpid(), signal.SIGKILL)
        return stages[s]

    record: dict[str, object] = {"rank": rank}
    try:
        pipe = pipeloom.Pipeline(stage_fn, schedule="Interleaved1F1B", num_microbatches=4, loss_fn=nn.functional.mse_loss)
        x, y = torch.randn(64, 256), torch.randn(64, 256)
        for step in range(3):
            if step == 1 and rank == 1 and mode in ("early", "vanish"):
                fault()
                if mode == "vanish":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("the data loader failed before step 1")
            for s in stages:
                s.step, s.calls = step, 0
            pipe.step(x, target=y)
        record.update(status="ok")
        pipe.close()
    except BaseException as exc:
        record.update(status="error", type=type(exc).__name__, message=str(exc)[:400], t=time.time())
        raise
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)


# ---------------------------------------------------------------- the driver


def _group_members(pgids: set[int]) -> list[int]:
    """Processes still alive (not zombies) in any of these process groups."""
    left = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in pgids:
            left.append(int(d))
    return left


def run_case(mode: str, backend: str, timeout: float, logs: str | None = None, grace: float = GRACE) -> dict[str, object]:
    out = Path(tempfile.mkdtemp(prefix=f"fail-{mode}-"))
    env = {**os.environ, "PIPELOOM_STALL_TIMEOUT": str(STALL), "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pipeloom.tools.cli", "launch", "--nproc-per-node", "2", "--backend", backend,
           "--heartbeat-timeout", str(HB), "--grace", str(grace), os.path.abspath(__file__), "--worker", mode, str(out)]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        rc = "hung"
    ended = time.time()
    if logs:  # the launcher's whole stderr (ranks' output, their tracebacks, the summary)
        Path(logs, f"{mode}.stderr.txt").write_text(err)
    pids = [int(p.read_text()) for p in out.glob("pid[0-9]")]
    time.sleep(0.2)
    left = _group_members(set(pids))
    for pid in left:  # clean up for the next case
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    fault = float((out / "fault").read_text()) if (out / "fault").exists() else t0
    rec0 = json.loads((out / "rank0.json").read_text()) if (out / "rank0.json").exists() else {}
    at = err.find("pipeloom launch: job failed")
    summary = err[at:] if at >= 0 else err[-1500:]
    first = summary.splitlines()[0] if summary else ""
    reported = summary.splitlines()[1].strip() if len(summary.splitlines()) > 1 else ""
    row = {
        "case": mode,
        "backend": backend,
        "rc": rc,
        "rank0_reported_s": round(float(rec0["t"]) - fault, 2) if "t" in rec0 else None,
        "rank0_error": f"{rec0.get('type')}: {rec0.get('message', '')[:160]}" if rec0.get("type") else rec0.get("status", "no record"),
        "ended_s": round(ended - fault, 2),
        "goal_s": GOALS[mode],
        "met": rc != "hung" and ended - fault <= GOALS[mode],
        "names_rank1": "rank 1" in first,
        "rank0_exited_itself": "the launcher terminated rank 0" not in summary and "terminated ranks 0" not in summary,
        "left": len(left),
        "summary": first.removeprefix("pipeloom launch: "),
        "detail": reported[:240],
    }
    shutil.rmtree(out, ignore_errors=True)
    return row


def table(rows: list[dict[str, object]]) -> str:
    head = "| case | rc | rank 0 reported (s) | job ended (s) | goal (s) | met | names rank 1 | rank 0 exited by itself | processes left | summary |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['rc']} | {r['rank0_reported_s']} | {r['ended_s']} | {r['goal_s']:g} | "
            f"{'yes' if r['met'] else 'NO'} | {'yes' if r['names_rank1'] else 'NO'} | "
            f"{'yes' if r['rank0_exited_itself'] else 'no'} | {r['left']} | {r['summary']} |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--timeout", type=float, default=45.0, help="seconds before a case counts as hung")
    p.add_argument("--json", default=None, help="append one JSON row per case to this file")
    p.add_argument("--md", default=None, help="also write the table to this file")
    p.add_argument("--logs", default=None, help="write each case's launcher stderr to DIR/CASE.stderr.txt")
    p.add_argument("--grace", type=float, default=GRACE,
                   help="the launcher's --grace (default 2); a long one shows whether ranks exit by themselves")
    args = p.parse_args()
    rows = []
    for mode in args.cases.split(","):
        row = run_case(mode, args.backend, args.timeout, args.logs, args.grace)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    text = table(rows)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")


if __name__ == "__main__":
    main()
