"""Weights tied across stages on different ranks in a hand-written split (2 real gloo ranks): refused at
construction on every rank (see runtime/ties.py); each rank trained its own copy with its part of the gradient
before, silently.  The same model untied, or with the tied stages on one rank (a V schedule), builds."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import run_json_script  # noqa: E402

SCRIPT = textwrap.dedent("""\
    import json, os, sys, torch, pipeloom
    from torch import nn
    rank = int(os.environ["RANK"])
    case = sys.argv[1]

    class TinyLM(nn.Module):
        def __init__(self, tie):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
            self.head = nn.Linear(8, 16, bias=False)
            if tie:
                self.head.weight = self.emb.weight

    torch.manual_seed(0)
    model = TinyLM(tie=case != "untied")
    if case == "v":  # stage 0 and the last stage on one rank: the tie is real there
        parts = [nn.Sequential(model.emb, model.body[0]), model.body[1:3], model.body[3], model.head]
        schedule = "ZBVZeroBubble"
    else:
        parts = [nn.Sequential(model.emb, model.body[:2]), nn.Sequential(model.body[2:], model.head)]
        schedule = "1F1B"
    loss = lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    try:
        pipe = pipeloom.Pipeline(lambda s: parts[s], schedule=schedule, num_microbatches=2, loss_fn=loss)
        pipe.step(torch.randint(0, 16, (4, 5)), target=torch.randint(0, 16, (4, 5)), return_outputs=False)
        rec = {"built": True}
        pipe.close()
    except pipeloom.PipelineConfigError as exc:
        rec = {"built": False, "message": str(exc)}
    print(json.dumps(rec), flush=True)
""")


@pytest.mark.parametrize("case", ["tied", "untied", "v"])
def test_weights_tied_across_ranks_are_refused(tmp_path: Path, case: str) -> None:
    recs = run_json_script(tmp_path, SCRIPT, 2, case, timeout=90)
    if case != "tied":
        assert all(r["built"] for r in recs), recs
        return
    assert not any(r["built"] for r in recs), recs
    # each rank names its own end of the tie
    assert recs[0]["message"].startswith("rank 0: parameter '0.weight' (Embedding) of stage 0 is also the parameter 'weight' of a "
                                         "Linear that no stage of this rank holds"), recs[0]
    assert recs[1]["message"].startswith("rank 1: parameter '1.weight' (Linear) of stage 1 is also the parameter 'weight' of a "
                                         "Embedding that no stage of this rank holds"), recs[1]
