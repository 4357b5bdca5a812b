"""A Pipeline's life in a process: several built one after another in one script (2 real gloo ranks).

A script that builds a second Pipeline after closing the first (another schedule, an evaluation pipeline, a
restart after a caught failure) hung in ``init_process_group``: the first Pipeline made the process group from
the environment and destroyed it at ``close``; the second made ``env://`` again, rank 0 served a new store on the
same port, and every rank waited for gloo peers that never connected.  The store is now made once per process,
each group under its own key prefix.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import run_json_script  # noqa: E402

SCRIPT = textwrap.dedent("""\
    import json, os, torch, torch.distributed as dist, pipeloom
    from torch import nn
    rank = int(os.environ["RANK"])
    seen = []
    for schedule in ("1F1B", "ZBVZeroBubble", "GPipe"):
        torch.manual_seed(0)
        pipe = pipeloom.Pipeline(lambda s: nn.Linear(4, 4), schedule=schedule, num_microbatches=2,
                                 loss_fn=nn.functional.mse_loss)
        pipe.step(torch.randn(4, 4), target=torch.randn(4, 4), return_outputs=False)
        seen.append([schedule, round(pipe.last_loss(), 6), dist.is_initialized()])
        pipe.close()
        seen[-1].append(dist.is_initialized())
    print(json.dumps({"rank": rank, "seen": seen}), flush=True)
""")


def test_pipelines_built_one_after_another_in_one_process(tmp_path: Path) -> None:
    got = {d["rank"]: d["seen"] for d in run_json_script(tmp_path, SCRIPT, 2, timeout=60)}
    assert [s[0] for s in got[0]] == ["1F1B", "ZBVZeroBubble", "GPipe"], got
    assert got[0] == got[1], got  # the same losses on both ranks (last_loss is reduced over the job)
    for _, loss, during, after in got[0]:
        assert loss > 0 and during and not after, got  # each Pipeline made the group and destroyed it at close
