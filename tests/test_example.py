"""examples/train_gpt.py under ``pipeloom launch``: it trains (the loss falls) and refuses bad flags.

Real subprocesses, as a user would run it: the launcher starts 2 CPU ranks.
The model is shrunk so the run stays within a few seconds of compute; the
time that remains is starting torch in each rank.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_gpt.py"
LAUNCH = [sys.executable, "-m", "pipeloom.tools.cli", "launch", "--nproc-per-node", "2"]
SMALL = ["--steps", "30", "--layers", "2", "--dim", "32", "--seq", "16", "--batch", "8", "--eval-every", "15"]
FINAL = re.compile(r"final: first_loss=(?P<first>[0-9.]+) last_loss=(?P<last>[0-9.]+)")


def _launch(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LAUNCH, str(EXAMPLE), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_example_trains_and_the_loss_falls() -> None:
    proc = _launch(*SMALL, "--schedule", "ZBVZeroBubble")
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    found = FINAL.search(proc.stdout)
    assert found, f"no final line in:\n{proc.stdout[-3000:]}"
    first, last = float(found["first"]), float(found["last"])
    assert last < first - 0.5, (first, last)
    assert "held-out loss" in proc.stdout


def test_example_refuses_a_microbatch_count_the_schedule_rejects() -> None:
    proc = _launch("--schedule", "DualPipeV", "--microbatches", "3", "--steps", "1")
    assert proc.returncode != 0
    assert "DualPipeV needs num_microbatches >= 2 x num_ranks" in proc.stderr, proc.stderr[-3000:]
