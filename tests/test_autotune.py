"""``pipeloom.measure_candidates``: a tuner's top candidates measured in the job, on 2 real gloo ranks."""

from __future__ import annotations

import json
import os
import statistics
import sys
import textwrap
from pathlib import Path

import pytest

import pipeloom
from pipeloom.runtime.autotune import TuneCandidate
sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import launch_script  # noqa: E402

JOB = textwrap.dedent("""\
    import json, os, sys, time, torch, torch.distributed as dist, pipeloom
    from torch import nn
    from pipeloom import TuneCandidate, PipelineConfigError

    backend = os.environ.get("PIPELOOM_TEST_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    rank = dist.get_rank()
    out = sys.argv[1]

    class Stage(nn.Module):
        def __init__(self, delay, boom=False):
            super().__init__()
            self.lin, self.delay, self.boom = nn.Linear(8, 8), delay, boom

        def forward(self, x):
            if self.delay:
                time.sleep(self.delay)
            if self.boom:
                raise RuntimeError("boom in the candidate's forward")
            return torch.tanh(self.lin(x))

    def build(c):
        torch.manual_seed(0)
        delay = 0.02 if c.label == "slow" else 0.0
        boom = c.label == "raises" and rank == 1
        return pipeloom.Pipeline(lambda s: Stage(delay, boom), schedule=c.schedule, num_microbatches=c.num_microbatches,
                                 loss_fn=nn.functional.mse_loss, stages_per_rank=c.stages_per_rank)

    x, y = torch.randn(16, 8), torch.randn(16, 8)
    fast = TuneCandidate(schedule="1F1B", num_microbatches=4)
    slow = TuneCandidate(schedule="1F1B", num_microbatches=4, label="slow")
    bad = TuneCandidate(schedule="NoSuchSchedule", num_microbatches=4)
    v = TuneCandidate(schedule="Interleaved1F1B", num_microbatches=4, stages_per_rank=2)
    raises = TuneCandidate(schedule="1F1B", num_microbatches=4, label="raises")

    # ranks given different lists: refused on every rank, before any candidate is built
    try:
        pipeloom.measure_candidates([fast] if rank == 0 else [fast, slow], build, x, target=y)
        mismatch = None
    except PipelineConfigError as exc:
        mismatch = str(exc)

    got = pipeloom.measure_candidates([slow, bad, raises, fast, v], build, x, target=y, warmup=1, steps=3, rounds=2)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"mismatch": mismatch, "got": [m.to_json() for m in got]}, f)
    dist.destroy_process_group()
""")


def test_measure_candidates_orders_by_measured_step_and_agrees_on_every_rank(tmp_path):
    # (PIPELOOM_TEST_BACKEND=nccl: the same job on 2 GPUs)
    proc = launch_script(tmp_path, JOB, str(tmp_path), nproc=2, timeout=240,
                         env={"PIPELOOM_TEST_BACKEND": os.environ.get("PIPELOOM_TEST_BACKEND", "gloo")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["got"] == ranks[1]["got"], "every rank must return the same measurements"
    for r, doc in enumerate(ranks):
        assert doc["mismatch"] is not None and "every rank must pass the same list" in doc["mismatch"], (r, doc["mismatch"])
    got = ranks[0]["got"]
    names = [g["name"] for g in got]
    # the refused ones last, in the order given, with the runtime's own errors and the ranks they came from
    # (under pipeloom launch, which would have ended the job had they been reported as its failure)
    assert names[-2:] == ["NoSuchSchedule m=4", "raises"], names
    assert got[-2]["step_ms"] is None and got[-2]["refused"].startswith("build: rank 0:"), got[-2]
    assert "NoSuchSchedule" in got[-2]["refused"] and "rank 1:" in got[-2]["refused"]
    assert got[-1]["step_ms"] is None and got[-1]["refused"].startswith("step: "), got[-1]
    assert "boom in the candidate's forward" in got[-1]["refused"] and "StageError" in got[-1]["refused"], got[-1]
    measured = {g["name"]: g for g in got[:-2]}
    assert set(measured) == {"1F1B m=4", "slow", "Interleaved1F1B m=4 v=2"}
    for g in measured.values():
        assert len(g["steps_ms"]) == 3 * 2 and g["refused"] == "", g
        assert g["step_ms"] == pytest.approx(statistics.median(g["steps_ms"])) and g["step_ms"] > 0
    # 20 ms of sleep in each of the 4 forwards of each rank's stage: the slow candidate's steps are >= 80 ms longer
    assert measured["slow"]["step_ms"] > measured["1F1B m=4"]["step_ms"] + 60, measured
    assert names.index("slow") > names.index("1F1B m=4")
    # fastest first among the measured
    ms = [g["step_ms"] for g in got[:-2]]
    assert ms == sorted(ms)


def test_measure_candidates_needs_the_process_group_and_sane_settings():
    c = TuneCandidate(schedule="1F1B", num_microbatches=4)
    with pytest.raises(pipeloom.PipelineConfigError, match="init_process_group"):
        pipeloom.measure_candidates([c], lambda c: None)


def test_candidates_from_the_tuner_json():
    doc = {"candidates": [
        {"schedule": "Interleaved1F1B", "microbatches": 8, "stages_per_rank": 2, "split": [2, 2, 2, 2], "fits": True},
        {"schedule": "GPipe", "microbatches": 32, "stages_per_rank": 1, "split": None, "fits": False},
        {"schedule": "1F1B", "microbatches": 8, "stages_per_rank": 1, "split": [5, 3], "fits": True},
        {"schedule": "1F1B", "microbatches": 8, "stages_per_rank": 1, "split": [4, 4], "fits": True},
    ]}
    top = TuneCandidate.top_from_tune(doc, k=2)
    assert [t.name() for t in top] == ["Interleaved1F1B m=8 v=2 (2,2,2,2)", "1F1B m=8 v=1 (5,3)"]
    assert top[1].split == (5, 3) and top[0].stages_per_rank == 2
    with pytest.raises(pipeloom.PipelineConfigError, match="not a row"):
        TuneCandidate.from_tune({"schedule": "1F1B"})
    with pytest.raises(pipeloom.PipelineConfigError, match="candidates"):
        TuneCandidate.top_from_tune({"ranking": []})
