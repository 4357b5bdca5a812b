"""Rank script for tests/test_trace_device.py: a traced 2-rank run; each rank writes what its trace holds.

``python trace_device_worker.py OUT``: 1F1B and ZBVZeroBubble (I and W), 4 microbatches, 3 steps each,
traced to OUT/{schedule}.jsonl (per-rank files), then the Pipeline closes (which writes the last device
times).  On NCCL (``PIPELOOM_TEST_BACKEND=nccl``) every action has a ``device`` event; on gloo none.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from harness import init_backend  # noqa: E402

import pipeloom  # noqa: E402

out = Path(sys.argv[1])
backend = init_backend()
rank = dist.get_rank()
device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
torch.manual_seed(0)
report = {}
for name in ("1F1B", "ZBVZeroBubble"):
    n_stages = 4 if name == "ZBVZeroBubble" else 2
    mods = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()).to(device) for _ in range(n_stages)]
    pipe = pipeloom.Pipeline(mods.__getitem__, schedule=name, num_microbatches=4, loss_fn=nn.functional.mse_loss,
                             device=device, trace=str(out / f"{name}.jsonl"))
    x, y = torch.randn(8, 16, device=device), torch.randn(8, 16, device=device)
    for _ in range(3):
        pipe.step(x, target=y)
    pipe.close()
    files = sorted(out.glob(f"{name}*.jsonl*"))
    mine = [f for f in files if f.name.endswith(f"rank{rank}")] or files
    acts, devs = [], []
    for f in mine:
        for line in f.read_text().splitlines()[1:]:
            ev = json.loads(line)
            if ev.get("rank") != rank:
                continue
            if ev["ev"] == "action":
                acts.append((ev["step"], ev["name"]))
            elif ev["ev"] == "device":
                devs.append((ev["step"], ev["name"], ev["ns"], ev["type"]))
    report[name] = {"actions": sorted(acts), "device": sorted(devs)}
    dist.barrier()
(out / f"rank{rank}.json").write_text(json.dumps({"backend": backend, **report}))
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
