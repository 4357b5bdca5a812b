"""``PipelineGradScaler``: float16-style loss scaling through a pipeline, against ``torch.amp.GradScaler`` on the unsplit
model (2 real gloo ranks, or NCCL ranks on a GPU host; float32 with scales near 2^100, so that overflows are placed exactly where the test wants).

In some steps stage 0 multiplies its input gradient by 2^40 (a custom Function), so only stage 0's gradients
overflow float32: only rank 0 finds an inf.  The unsplit model with torch's scaler skips those steps and
halves its scale; so must every rank of the pipeline.  A scaler per rank without the agreement would skip on rank 0
and step on rank 1 (its own gradients are finite): the stages would drift apart, silently.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import run_json_script  # noqa: E402

SCRIPT = textwrap.dedent("""\
    import json, os, torch, pipeloom
    from torch import nn
    rank = int(os.environ["RANK"])

    class Gain(torch.autograd.Function):
        factor = 1.0  # (set per step: 2^40 in the steps whose stage-0 gradients must overflow)

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * Gain.factor

    class Stage(nn.Module):
        def __init__(self, s):
            super().__init__()
            torch.manual_seed(100 + s)
            self.lin, self.s = nn.Linear(4, 4), s

        def forward(self, x):
            y = torch.tanh(self.lin(x))
            return Gain.apply(y) if self.s == 0 else y

    out = {"rank": rank, "runs": {}}
    for schedule, n_stages in (("1F1B", 2), ("ZBVZeroBubble", 4)):
        stages = {}
        pipe = pipeloom.Pipeline(lambda s: stages.setdefault(s, Stage(s)), schedule=schedule, num_microbatches=4,
                                 loss_fn=nn.functional.mse_loss)
        ref = nn.Sequential(*[Stage(s) for s in range(n_stages)])
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        scaler = pipeloom.PipelineGradScaler(pipe, init_scale=2.0 ** 100, growth_interval=2)
        ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100, growth_interval=2)
        run = out["runs"][schedule] = {"scales": [], "ref_scales": [], "diff": 0.0, "loss_diff": 0.0}
        torch.manual_seed(7)
        for step in range(10):
            Gain.factor = 2.0 ** 40 if step in (0, 1, 6) else 1.0
            x, y = torch.randn(8, 4), torch.randn(8, 4)
            pipe.step(x, target=y, return_outputs=False)
            if step % 2:
                scaler.unscale_(opt)
                pipe.clip_grad_norm_(10.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            loss = pipe.last_loss()
            ref_loss = nn.functional.mse_loss(ref(x), y)
            ref_scaler.scale(ref_loss).backward()
            if step % 2:
                ref_scaler.unscale_(ref_opt)
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 10.0)
            ref_scaler.step(ref_opt)
            ref_scaler.update()
            ref_opt.zero_grad()
            run["scales"].append(scaler.get_scale())
            run["ref_scales"].append(ref_scaler.get_scale())
            run["loss_diff"] = max(run["loss_diff"], abs(loss - ref_loss.item()))
        for s, m in stages.items():
            for a, b in zip(m.parameters(), ref[s].parameters()):
                run["diff"] = max(run["diff"], (a.detach().cpu() - b).abs().max().item())  # (stages on cuda on NCCL)
        pipe.close()
    # refused: a second scaler on one Pipeline, and check_finite (which fails on the overflows scaling skips)
    errors = []
    for opts in ({}, {"check_finite": True}):
        pipe = pipeloom.Pipeline(lambda s: Stage(s), schedule="1F1B", num_microbatches=2, loss_fn=nn.functional.mse_loss,
                                 options=pipeloom.RuntimeOptions(**opts))
        try:
            pipeloom.PipelineGradScaler(pipe)
            pipeloom.PipelineGradScaler(pipe)
        except pipeloom.PipelineConfigError as exc:
            errors.append(str(exc))
        pipe.close()
    out["errors"] = errors
    print(json.dumps(out), flush=True)
""")


def test_overflow_on_one_rank_skips_the_step_on_every_rank_as_the_unsplit_model_does(tmp_path: Path) -> None:
    got = {d["rank"]: d for d in run_json_script(tmp_path, SCRIPT, 2, timeout=120)}
    for rank, res in got.items():
        for schedule, run in res["runs"].items():
            where = f"rank {rank}, {schedule}"
            # torch's scaler on the unsplit model skips the steps where stage 0 overflows and halves its scale, and
            # grows it after 2 clean steps: the pipeline's scale follows it exactly on both ranks
            assert run["ref_scales"] == [2.0 ** e for e in (99, 98, 98, 99, 99, 100, 99, 99, 100, 100)], (where, run)
            assert run["scales"] == run["ref_scales"], (where, run)
            assert run["diff"] < 1e-5, (where, run)  # the same steps taken and skipped: the same parameters
            assert run["loss_diff"] < 1e-5, (where, run)  # the reported loss is the unscaled one
        assert "already has a PipelineGradScaler" in res["errors"][0], res["errors"]
        assert "check_finite=True" in res["errors"][1], res["errors"]
