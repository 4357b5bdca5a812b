"""benchmarks/profile_lead.py on a synthetic profiler trace: the host's lead, the switches between actions."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import profile_lead  # noqa: E402


def _trace(host_ahead_us: float) -> list[dict[str, Any]]:
    """Two actions of three 100-us kernels on stream 7, an NCCL kernel between them; each compute kernel starts
    ``host_ahead_us`` after its launch (or right after the previous kernel, if later)."""
    ev: list[dict[str, Any]] = []
    corr = 0
    host = 0.0
    dev_free = 0.0

    def launch(name: str, stream: int, dur: float, host_cost: float) -> None:
        nonlocal corr, host, dev_free
        corr += 1
        ev.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": host, "dur": 2, "args": {"correlation": corr}})
        start = max(host + host_ahead_us, dev_free) if stream == 7 else host + 5
        ev.append({"cat": "kernel", "name": name, "ts": start, "dur": dur, "args": {"correlation": corr, "stream": stream}})
        if stream == 7:
            dev_free = start + dur
        host += host_cost

    for _ in range(3):
        launch("gemm", 7, 100, 20)
    host += 500  # the switch: the runtime's work between the actions
    launch("ncclDevKernel_SendRecv", 20, 30, 20)
    for _ in range(3):
        launch("gemm", 7, 100, 20)
    return ev


def test_lead_and_switch_from_a_synthetic_trace() -> None:
    ahead = profile_lead.analyse(_trace(5000.0), bin_ms=1000)
    behind = profile_lead.analyse(_trace(10.0), bin_ms=1000)
    assert ahead["kernels"] == behind["kernels"] == 6
    assert ahead["lead"][0][1] >= 5000  # the device starts each kernel 5 ms after its launch
    assert behind["lead"][0][1] < 200
    # one switch: from the first action's last launch (host 40) to the second's first (40 + 20 + 500 + 20)
    assert ahead["switches"] == behind["switches"] == 1
    assert behind["switch_host_us"][0] == 540
    assert behind["spans"] == {} and profile_lead.analyse([], 20) == {"kernels": 0}
