"""Adversarial cases for weights tied across pipeline ranks (``RuntimeOptions.tied_weights="sync"``, runtime/ties.py):
every rank's parameters and gradients against the unsplit model (same state dict, loss the mean over microbatches),
on real gloo ranks, several cases per rank job (one job per world size)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import run_json_script  # noqa: E402
from test_tied_sync import COMMON  # noqa: E402

EXTRA = textwrap.dedent("""\
    class Albert3(nn.Module):  # one block object at depths 0, 1 and 2
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(D, D)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4))
            self.blocks[1] = self.blocks[0]
            self.blocks[2] = self.blocks[0]
            self.out = nn.Linear(D, V)

        forward = Albert.forward
        parts = Albert.parts

        def tied(self):
            return self.blocks[0][0].weight

    class Both(LM):  # embedding/head tied, and one block object at depths 0 and 2
        def __init__(self):
            super().__init__()
            self.blocks[2] = self.blocks[0]

    class Frozen(LM):  # the tie frozen at construction
        def __init__(self):
            super().__init__()
            self.emb.weight.requires_grad_(False)

    MODELS = {"lm": LM, "albert": Albert, "albert3": Albert3, "both": Both, "frozen": Frozen}

    def xy(cls, g, rows=8):
        x, y = torch.randint(0, V, (rows, 3), generator=g), torch.randint(0, V, (rows, 3), generator=g)
        if cls in (Albert, Albert3):
            x = torch.randn(rows, 3, D, generator=g)
        return x, y

    def holds(model, pipe):
        return any(p is model.tied() for st in pipe.stages.values() for p in st.parameters())

    def run(case):
        cls = MODELS[case["model"]]
        schedule = case["schedule"]
        n_stages = case.get("stages", 2)
        model, parts, ref = build(cls, n_stages)
        opts = pipeloom.RuntimeOptions(**case.get("options", {}))
        pipe = pipeloom.Pipeline(lambda s: parts[s], schedule=schedule, num_microbatches=4, loss_fn=loss_fn, options=opts)
        out = {"diffs": [], "digests": [], "case": case}
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        none = not case.get("zeros")
        if case.get("unfreeze"):
            model.tied().requires_grad_(True); ref.tied().requires_grad_(True)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        try:
            train(case, cls, model, parts, ref, pipe, opt, ref_opt, g, none, out)
        finally:
            pipe.close()
        return out

    def train(case, cls, model, parts, ref, pipe, opt, ref_opt, g, none, out):
        for it in range(3):
            for k in range(case.get("accumulate", 1)):
                x, y = xy(cls, g)
                if case.get("eval"):
                    ex, ey = xy(cls, g)
                    pipe.eval(ex, target=ey, return_outputs=True)
                pipe.step(x, target=y, return_outputs=case.get("outputs", False))
                ref_backward(ref, x, y, 4)
            worst, dig = compare(model, parts, ref, pipe)
            out["diffs"].append(worst); out["digests"].append(dig if holds(model, pipe) else None)
            opt.step(); opt.zero_grad(set_to_none=none)
            ref_opt.step(); ref_opt.zero_grad(set_to_none=none)
            worst, dig = compare(model, parts, ref, pipe)
            out["diffs"].append(worst); out["digests"].append(dig)

    cases = json.loads(sys.argv[1])
    res = []
    for c in cases:
        try:
            res.append(run(c))
        except Exception as exc:
            res.append({"error": f"{type(exc).__name__}: {exc}"[:600], "case": c})
    print(json.dumps(res), flush=True)
""")

SCRIPT = COMMON + EXTRA

CASES_2 = [
    {"model": "lm", "schedule": "1F1B", "zeros": True},
    {"model": "lm", "schedule": "1F1B", "eval": True, "outputs": True, "accumulate": 2},
    {"model": "albert3", "schedule": "Interleaved1F1B", "stages": 4},
    {"model": "both", "schedule": "Interleaved1F1B", "stages": 4},
    {"model": "both", "schedule": "1F1B"},
    {"model": "lm", "schedule": "1F1B", "options": {"deterministic": True, "static_shapes": True}},
    {"model": "lm", "schedule": "1F1B", "options": {"host_overlap_backward": True}},
    {"model": "lm", "schedule": "DualPipeV", "stages": 4},
    {"model": "albert3", "schedule": "InterleavedZeroBubble", "stages": 4, "zeros": True},
    {"model": "frozen", "schedule": "1F1B"},  # frozen: rank 1's copy, built different, made rank 0's
    {"model": "frozen", "schedule": "1F1B", "unfreeze": True, "refused": "was frozen (requires_grad=False) when this Pipeline was built"},
]


def _check(recs, cases):
    bad = []
    for i, case in enumerate(cases):
        rs = [r[i] for r in recs]
        if case.get("refused"):
            for rank, r in enumerate(rs):
                if not r.get("error", "").startswith(f"PipelineConfigError: rank {rank}: the weight tied") or case["refused"] not in r["error"]:
                    bad.append((case, r))
            continue
        for r in rs:
            if "error" in r:
                bad.append((case, r["error"]))
            elif max(r["diffs"]) > 1e-6:
                bad.append((case, r["diffs"]))
        held = [r["digests"] for r in rs if "digests" in r and r["digests"][0] is not None]
        if not bad and any(d != held[0] for d in held):
            bad.append((case, "digests differ"))
    assert not bad, bad


def test_adversarial_two_ranks(tmp_path: Path) -> None:
    recs = run_json_script(tmp_path, SCRIPT, 2, json.dumps(CASES_2), timeout=240)
    _check(recs, CASES_2)
