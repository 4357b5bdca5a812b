"""examples/train_gpt.py under ``pipeloom launch``: it trains (the loss falls), checkpoints, resumes, refuses bad flags.

Real subprocesses, as a user would run it: the launcher starts 2 CPU ranks.
The model is shrunk so the run stays within a few seconds of compute; the
time that remains is starting torch in each rank.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_gpt.py"
LAUNCH = [sys.executable, "-m", "pipeloom.tools.cli", "launch", "--nproc-per-node", "2"]
SMALL = ["--steps", "30", "--layers", "2", "--dim", "32", "--seq", "16", "--batch", "8", "--eval-every", "15"]
FINAL = re.compile(r"final: first_loss=(?P<first>[0-9.]+) last_loss=(?P<last>[0-9.]+)")


def _launch(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LAUNCH, str(EXAMPLE), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_example_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = _launch(*SMALL, "--schedule", "ZBVZeroBubble", "--ckpt-dir", str(ckpt), "--ckpt-every", "10", "--keep-last", "2")
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    found = FINAL.search(proc.stdout)
    assert found, f"no final line in:\n{proc.stdout[-3000:]}"
    first, last = float(found["first"]), float(found["last"])
    assert last < first - 0.5, (first, last)
    assert "held-out loss" in proc.stdout
    # progress lines with the loss, throughput and ETA; the loss table at the end
    assert re.search(r"step 30/30 loss [0-9.]+ +[0-9,]+ tok/s .*ETA", proc.stdout), proc.stdout[-3000:]
    assert "loss by steps" in proc.stdout
    # checkpoints at 10, 20, 30, of which the newest two are kept
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000020", "step-00000030"]

    # resume on one more step budget, under another schedule: continues from step 30, the history kept
    proc = _launch(*SMALL[2:], "--steps", "40", "--schedule", "1F1B", "--ckpt-dir", str(ckpt), "--resume")
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert "resumed from" in proc.stdout and "(step 30)" in proc.stdout, proc.stdout[-3000:]
    assert "step 40/40" in proc.stdout and "step 10/40" not in proc.stdout
    assert "1-5" in proc.stdout and "36-40" in proc.stdout  # the table covers all 40 steps (history from the checkpoint)
    assert FINAL.search(proc.stdout)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000020", "step-00000030", "step-00000040"]  # --keep-last 3


def test_example_refuses_a_microbatch_count_the_schedule_rejects() -> None:
    proc = _launch("--schedule", "DualPipeV", "--microbatches", "3", "--steps", "1")
    assert proc.returncode != 0
    assert "DualPipeV needs num_microbatches >= 2 x num_ranks" in proc.stderr, proc.stderr[-3000:]


def test_example_checks_its_checkpoint_flags(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import train_gpt
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    for argv, message in ((["--resume"], "--resume and --ckpt-every need --ckpt-dir"),
                          (["--ckpt-every", "5"], "--resume and --ckpt-every need --ckpt-dir"),
                          (["--clip", "-1"], "must be a non-negative number")):
        with pytest.raises(SystemExit) as exc:
            train_gpt.parse_args(argv, world=2)
        assert exc.value.code == 2 and message in capsys.readouterr().err
    args = train_gpt.parse_args(["--ckpt-dir", "d", "--resume", "--clip", "0"], world=2)
    assert args.resume and args.clip == 0 and args.ckpt_every == 0 and args.keep_last == 3
    assert not train_gpt.parse_args(["--ckpt-dir", "d"], world=2).resume
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # restarted by the launcher: it resumes
    assert train_gpt.parse_args(["--ckpt-dir", "d"], world=2).resume
    assert not train_gpt.parse_args([], world=2).resume
