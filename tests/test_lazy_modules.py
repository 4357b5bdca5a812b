"""Stages built from lazy modules (``nn.LazyLinear``: parameters without a shape until the first forward), on 2
real gloo ranks: the first step failed on every rank with torch's "Can't access the shape of an uninitialized
parameter" from the runtime's model fingerprint; now the first step materialises them, as the unsplit model's first
forward does, and from the second step on the gradients equal the unsplit model's (float64) under a plain and a split
(I/W) backward.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import run_json_script  # noqa: E402

SCRIPT = textwrap.dedent("""\
    import copy, json, os, torch, torch.distributed as dist, pipeloom
    from torch import nn
    rank = int(os.environ["RANK"])
    torch.set_default_dtype(torch.float64)
    out = {"rank": rank, "runs": {}}
    for schedule, n_stages in (("1F1B", 2), ("ZBVZeroBubble", 4)):
        torch.manual_seed(0)
        pipe = pipeloom.Pipeline(lambda s: nn.Sequential(nn.LazyLinear(4), nn.Tanh()), schedule=schedule,
                                 num_microbatches=4, loss_fn=nn.functional.mse_loss)
        x0, y0, x1, y1 = (torch.randn(8, 4) for _ in range(4))
        pipe.step(x0, target=y0, return_outputs=False)       # materialises the lazy parameters
        for m in pipe.stages.values():
            m.zero_grad(set_to_none=True)
        mine = {s: {k: v.detach().clone() for k, v in m.state_dict().items()} for s, m in pipe.stages.items()}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        weights = {s: sd for d in every for s, sd in d.items()}
        ref = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(n_stages)])
        for s in range(n_stages):
            ref[s].load_state_dict(weights[s])
        pipe.step(x1, target=y1, return_outputs=False)
        nn.functional.mse_loss(ref(x1), y1).backward()
        diff = 0.0
        for s, m in pipe.stages.items():
            for (name, p), q in zip(m.named_parameters(), ref[s].parameters()):
                diff = max(diff, (p.grad - q.grad).abs().max().item())
        out["runs"][schedule] = {"diff": diff, "loss": pipe.last_loss(), "stages": sorted(pipe.stages)}
        pipe.close()
    print(json.dumps(out), flush=True)
""")


def test_lazy_stages_materialise_at_the_first_step_and_match_the_unsplit_model(tmp_path: Path) -> None:
    got = {d["rank"]: d for d in run_json_script(tmp_path, SCRIPT, 2, timeout=90)}
    for rank, res in got.items():
        for schedule, run in res["runs"].items():
            assert run["stages"], (rank, schedule)
            assert run["diff"] < 1e-12, (rank, schedule, run)
            assert run["loss"] > 0, (rank, schedule, run)


DP_SCRIPT = textwrap.dedent("""\
    import json, os, sys, torch, pipeloom
    from torch import nn
    rank = int(os.environ["RANK"])
    try:
        pipeloom.Pipeline(lambda s: nn.Sequential(nn.LazyLinear(4), nn.Tanh()), schedule="1F1B", num_microbatches=4,
                          loss_fn=nn.functional.mse_loss, data_parallel=2, fsdp=sys.argv[1] == "fsdp")
        rec = {"type": None}
    except Exception as exc:
        rec = {"type": type(exc).__name__, "message": str(exc)}
    print(json.dumps(rec), flush=True)
""")


def test_lazy_stages_with_data_parallelism_are_refused_naming_them(tmp_path: Path) -> None:
    """Replicas broadcast (DDP) or shard (FSDP) their parameters when the Pipeline is built: a lazy parameter has no
    shape then, and every rank failed with torch's "Can't access the shape of an uninitialized parameter", which
    says nothing of why or what to do."""
    for rank, rec in enumerate(run_json_script(tmp_path, DP_SCRIPT, 4, "ddp", timeout=90)):
        assert rec["type"] == "PipelineConfigError", rec
        assert rec["message"].startswith(f"rank {rank}: stage {rank // 2} holds lazy parameters not materialised yet "
                                         "(0.weight, 0.bias); data parallelism"), rec
