"""host_overlap_backward's worker thread sees what an inline backward would (one CPU rank, explicit True).

The backward launched beside the forwards runs on a worker thread: thread-local state of the
caller's does not follow it by itself.  The caller's autocast must (a custom Function's
backward, or a recomputation, runs under it inline).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import run_one_rank  # noqa: E402

AUTOCAST = r"""
import json, threading
import torch
from torch import nn
import pipeloom

seen = []

class Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        seen.append([threading.current_thread().name.startswith("pipeloom-backward"), torch.is_autocast_enabled("cpu")])
        return g

class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return Probe.apply(self.lin(x))

torch.manual_seed(0)
mods = [Stage() for _ in range(2)]
pipe = pipeloom.Pipeline(lambda s: mods[s], schedule="Interleaved1F1B", num_microbatches=4,
                         loss_fn=lambda out, y: ((out.float() - y) ** 2).mean(),
                         options=pipeloom.RuntimeOptions(host_overlap_backward=True))
x, y = torch.randn(8, 4), torch.randn(8, 4)
steps = []
with torch.autocast("cpu", dtype=torch.bfloat16):
    for _ in range(3):
        seen.clear()
        pipe.step(x, target=y)
        steps.append({"overlapped": pipe.statistics.overlapped_backwards, "seen": list(seen)})
pipe.close()
print(json.dumps(steps))
"""


async def test_the_worker_runs_the_backward_under_the_callers_autocast(tmp_path: Path) -> None:
    steps = await run_one_rank(tmp_path, "autocast.py", AUTOCAST, timeout=90)
    assert steps[0]["overlapped"] == 0 and steps[2]["overlapped"] > 0, steps  # the first training step inline
    on_worker = [s for st in steps for s in st["seen"] if s[0]]
    assert on_worker, steps  # some backwards ran on the worker thread...
    assert all(autocast for _, autocast in (s for st in steps for s in st["seen"])), steps  # ...under autocast, as inline


def test_auto_stays_off_for_stages_with_collectives_of_their_own() -> None:
    from torch import nn

    from pipeloom.runtime.actor import _own_collectives

    assert not _own_collectives(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    assert _own_collectives(nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2)))


def test_auto_sees_dtensor_parameters_without_importing_dtensor_itself() -> None:
    # the check must not import torch.distributed.tensor (seconds of sympy in every rank's constructor: a
    # GPU host's harness test timed out inside it); a DTensor parameter exists only once the user imported it
    code = textwrap.dedent("""
        import sys, torch
        from torch import nn
        from pipeloom.runtime.actor import _own_collectives
        assert not _own_collectives(nn.Linear(2, 2))
        assert "torch.distributed.tensor" not in sys.modules, "the check imported DTensor"
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_module
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        mod = distribute_module(nn.Linear(2, 2), mesh)
        assert _own_collectives(mod)
        assert not _own_collectives(nn.Linear(2, 2))
        dist.destroy_process_group()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
