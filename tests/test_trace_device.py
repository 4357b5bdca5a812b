"""GPU traces carry each action's device time (``device`` events): present for every action on NCCL, absent on gloo.

The device time is measured by the engine with CUDA events (``runtime/device.py``, ``on_timed``) and written
when the events complete, the last steps' at ``Pipeline.close``; ``pipeloom schedule tune`` takes a GPU
run's host and device sides from one trace with them (tests/test_schedule_tune.py).  On CPUs an action's span
is its work, and no ``device`` event may appear (the tools would take it for a GPU run's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import spawn_ranks  # noqa: E402

WORKER = str(Path(__file__).parent / "ranks" / "trace_device_worker.py")


async def test_device_times_in_the_trace_on_gpus_only(tmp_path: Path) -> None:
    codes, _, errs = await spawn_ranks(2, [WORKER, str(tmp_path)], timeout=120)
    assert codes == [0, 0], [e[-3000:] for e in errs]
    for r in range(2):
        rec = json.loads((tmp_path / f"rank{r}.json").read_text())
        for name in ("1F1B", "ZBVZeroBubble"):
            acts, devs = rec[name]["actions"], rec[name]["device"]
            assert len(acts) == 3 * (8 if name == "1F1B" else 24), (name, len(acts))  # 3 steps of the rank's list
            if rec["backend"] == "nccl":
                # every action of every step, the last step's too (written at close), each once, with a time
                assert sorted((s, n) for s, n, _, _ in devs) == sorted((s, n) for s, n in acts), (name, r)  # JSON: lists
                assert all(ns > 0 for _, _, ns, _ in devs)
            else:
                assert devs == [], (name, r, devs[:3])
