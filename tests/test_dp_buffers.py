"""Buffers updated in forward under data parallelism (BatchNorm): refused by default, or replica 0's after each step.

4 real gloo ranks (pp 2 x dp 2), a Linear + BatchNorm1d stage.  ``RuntimeOptions.dp_buffers="refuse"`` (the
default) names the buffer at the first training forward on every rank; ``"replica0"`` trains, and after every
training step the two replicas of each stage hold replica 0's running statistics (as torch DDP's
``broadcast_buffers``), which are not the initial ones (the statistics did move) and differ from what replica 1's
rows alone would give (the broadcast happened).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import spawn_ranks  # noqa: E402

SCRIPT = r'''
import json, os, sys
import torch
import torch.distributed as dist
from torch import nn
import pipeloom

torch.set_num_threads(1)
out = sys.argv[1]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
report = {}


def stage(s):
    torch.manual_seed(s)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 4, generator=g) * (1 + step), torch.randn(16, 4, generator=g)


for mode in ("refuse", "replica0"):
    pipe = pipeloom.Pipeline(stage, schedule="1F1B", num_microbatches=2, loss_fn=nn.functional.mse_loss, data_parallel=2,
                             options=pipeloom.RuntimeOptions(dp_buffers=mode))
    rec = {"means": []}
    try:
        for step in range(2):
            x, y = batch(step)
            pipe.step(x, target=y)
            mod = next(iter(pipe.stages.values()))
            rec["means"].append(mod[1].running_mean.tolist())
        rec["status"] = "ok"
    except Exception as exc:
        rec.update(status="error", type=type(exc).__name__, message=str(exc))
    finally:
        pipe.close()
    report[mode] = rec
    dist.barrier()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("dp_buffers")
    (tmp / "s.py").write_text(SCRIPT)
    codes, _, errs = asyncio.run(spawn_ranks(4, [str(tmp / "s.py"), str(tmp)], timeout=90))
    assert all(c == 0 for c in codes), (codes, [e[-3000:] for e in errs])
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.timeout(120)
def test_a_buffer_updated_under_data_parallelism_is_refused_by_default(ranks: list[dict[str, Any]]) -> None:
    for r, rep in enumerate(ranks):
        c = rep["refuse"]
        # (the first rank to run such a forward raises it; the others hear it from that rank)
        assert c["status"] == "error" and c["type"] in ("PipelineConfigError", "RemoteRankError"), (r, c)
        assert "updated the buffer '1." in c["message"] and "dp_buffers='replica0'" in c["message"], (r, c)


@pytest.mark.timeout(120)
def test_replica0_keeps_the_replicas_buffers_equal_after_each_step(ranks: list[dict[str, Any]]) -> None:
    # (the grid: ranks 0 and 1 hold stage 0's replicas, 2 and 3 stage 1's; or 0/2 and 1/3: found from the values)
    means = [rep["replica0"]["means"] for rep in ranks]
    assert all(rep["replica0"]["status"] == "ok" for rep in ranks), [rep["replica0"] for rep in ranks]
    for step in range(2):
        rows = [m[step] for m in means]
        assert all(any(v != 0.0 for v in row) for row in rows), rows  # the statistics moved
        # every rank's stage has a twin replica with the very same statistics, and the two stages differ
        pairs = {(i, j) for i in range(4) for j in range(4) if i < j and rows[i] == rows[j]}
        assert len(pairs) == 2 and len({i for p in pairs for i in p}) == 4, (step, rows)
