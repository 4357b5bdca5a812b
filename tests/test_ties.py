"""Weights tied across stages on different ranks in a hand-written split (2 real gloo ranks).  With
``RuntimeOptions.tied_weights="sync"`` (the default) they are trained as one weight: every rank's gradients equal
the unsplit model's (tests/test_tied_sync.py tests the sync itself); with ``"refuse"`` they are refused at
construction on every rank (see runtime/ties.py), as before the sync existed: each rank trained its own copy with
its part of the gradient before, silently.  The same model untied, or with the tied stages on one rank (a V
schedule), builds either way."""

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
    case, mode = sys.argv[1], sys.argv[2]

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
    x, y = torch.randint(0, 16, (4, 5)), torch.randint(0, 16, (4, 5))
    try:
        pipe = pipeloom.Pipeline(lambda s: parts[s], schedule=schedule, num_microbatches=2, loss_fn=loss,
                                 options=pipeloom.RuntimeOptions(tied_weights=mode))
        pipe.step(x, target=y, return_outputs=False)
        pipe.close()
    except pipeloom.PipelineConfigError as exc:
        print(json.dumps({"built": False, "message": str(exc)}), flush=True)
        sys.exit(0)
    ref = TinyLM(tie=case != "untied")  # the unsplit model, its loss the mean over the microbatches
    ref.load_state_dict(model.state_dict())
    ref.body = nn.Sequential(*ref.body)
    f = lambda xb: ref.head(ref.body(ref.emb(xb)))
    sum(loss(f(xb), yb) for xb, yb in zip(x.chunk(2), y.chunk(2))).div(2).backward()
    want, names = dict(ref.named_parameters(remove_duplicate=False)), {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    diffs = {names[id(p)]: float((p.grad - want[names[id(p)]].grad).abs().max())
             for s in range(len(parts)) if pipe.stage_to_rank[s] == rank for p in parts[s].parameters()}
    print(json.dumps({"built": True, "diffs": diffs}), flush=True)
""")


@pytest.mark.parametrize("case,mode", [("tied", "sync"), ("untied", "sync"), ("v", "sync"), ("tied", "refuse"),
                                       ("untied", "refuse"), ("v", "refuse")])
def test_weights_tied_across_ranks_train_as_one_or_are_refused(tmp_path: Path, case: str, mode: str) -> None:
    recs = run_json_script(tmp_path, SCRIPT, 2, case, mode, timeout=90)
    if case != "tied" or mode == "sync":
        assert all(r["built"] for r in recs), recs
        for r in recs:  # each rank's gradients (the tied weight's on both ranks) are the unsplit model's
            assert r["diffs"] and all(d < 1e-6 for d in r["diffs"].values()), recs
        if case == "tied":
            assert "emb.weight" in recs[0]["diffs"] and "emb.weight" in recs[1]["diffs"], recs
        return
    assert not any(r["built"] for r in recs), recs
    # each rank names its own end of the tie
    assert recs[0]["message"].startswith("rank 0: parameter '0.weight' (Embedding) of stage 0 is also the parameter 'weight' of a "
                                         "Linear that no stage of this rank holds"), recs[0]
    assert recs[1]["message"].startswith("rank 1: parameter '1.weight' (Linear) of stage 1 is also the parameter 'weight' of a "
                                         "Embedding that no stage of this rank holds"), recs[1]


# Ties the rule by kind cannot see (runtime/ties.py, rule 2), every rank building the whole model: two Linears
# sharing a weight, one block object at two depths (ALBERT), one module object used at both ends of the model.
SCRIPT2 = textwrap.dedent("""\
    import json, os, sys, torch, pipeloom
    from torch import nn
    rank = int(os.environ["RANK"])
    case, schedule, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    D = 6
    keep = []

    class Block(nn.Module):
        def __init__(self, inner_tie=False):
            super().__init__()
            self.lin = nn.Linear(D, D)
            self.lin2 = nn.Linear(D, D)
            self.norm = nn.LayerNorm(D)
            if inner_tie:  # a tie inside one block: on one stage whatever the split
                self.lin2.weight = self.lin.weight

        def forward(self, x):
            return x + torch.tanh(self.lin2(torch.tanh(self.lin(self.norm(x)))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(D, D)
            self.blocks = nn.ModuleList(Block(inner_tie=case == "inner") for _ in range(4))
            self.out = nn.Linear(D, D)
            if case.startswith(("linear", "frozen")):  # two Linears of one kind, one weight
                self.out.weight = self.inp.weight
            if case.startswith("albert"):  # one block object at depths 0 and 2
                self.blocks[2] = self.blocks[0]
            if case.startswith("module"):  # one module object at both ends
                self.out = self.inp
            if case == "unused_end":  # a tied layer that no stage holds: not a use
                self.spare = nn.Linear(D, D)
                self.spare.weight = self.inp.weight
            if case == "buffer":  # one buffer on both ends: state, not a trained weight
                self.register_buffer("table", torch.ones(D))
                self.blocks[3].register_buffer("table", self.table)

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.out(x)

    def parts_of(m):
        if schedule != "1F1B":  # 4 stages, 0 and 3 on rank 0
            return [nn.Sequential(m.inp, m.blocks[0]), m.blocks[1], m.blocks[2], nn.Sequential(m.blocks[3], m.out)]
        if case == "albert_one_stage":  # both depths in stage 0
            return [nn.Sequential(m.inp, *m.blocks[:3]), nn.Sequential(m.blocks[3], m.out)]
        return [nn.Sequential(m.inp, *m.blocks[:2]), nn.Sequential(*m.blocks[2:], m.out)]

    if case == "own_model":  # each stage from a small model of its own (kept alive), tied inside it
        def stage_fn(s):
            keep.append(nn.ModuleDict({"block": Block(inner_tie=True)}))
            return keep[-1]["block"]
        model, stages = None, 2
    else:
        torch.manual_seed(0)
        model = Net()
        if case == "frozen":
            model.inp.weight.requires_grad_(False)
        parts = parts_of(model)
        stage_fn, stages = (lambda s: parts[s]), len(parts)
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, D), torch.randn(4, 3, D)
    loss = lambda out, t: ((out - t) ** 2).mean()
    try:
        pipe = pipeloom.Pipeline(stage_fn, schedule=schedule, num_microbatches=4, loss_fn=loss,
                                 options=pipeloom.RuntimeOptions(tied_weights=mode))
    except pipeloom.PipelineConfigError as exc:
        print(json.dumps({"built": False, "message": str(exc)}), flush=True)
        sys.exit(0)
    pipe.step(x, target=y, return_outputs=False)
    pipe.close()
    diffs = {}
    if model is not None:  # against the unsplit model (the pipeline's loss: the mean over the microbatches)
        ref = Net()
        ref.load_state_dict(model.state_dict())
        ref.inp.weight.requires_grad_(model.inp.weight.requires_grad)
        sum(loss(ref(xb), yb) for xb, yb in zip(x.chunk(4), y.chunk(4))).div(4).backward()
        want = dict(ref.named_parameters())
        names = {id(p): n for n, p in model.named_parameters()}
        for s in [s for s in range(stages) if pipe.stage_to_rank[s] == rank]:
            for p in parts[s].parameters():
                n = names[id(p)]
                g, w = (None if p.grad is None else p.grad.cpu()), want[n].grad  # (NCCL: the stage is on its GPU)
                diffs[n] = "none" if g is None and w is None else "missing" if g is None or w is None else float((g - w).abs().max())
    print(json.dumps({"built": True, "diffs": diffs}), flush=True)
""")

REFUSED = {  # case -> (schedule, the names, the stages each rank reports)
    "linear": ("1F1B", "'inp.weight', 'out.weight'", "stage 0 on rank 0 (as '0.weight'), stage 1 on rank 1 (as '2.weight')"),
    "albert": ("1F1B", "'blocks.0.lin.weight', 'blocks.2.lin.weight'",
               "stage 0 on rank 0 (as '1.lin.weight'), stage 1 on rank 1 (as '0.lin.weight')"),
    "module": ("1F1B", "'inp.weight', 'out.weight'", "stage 0 on rank 0 (as '0.weight'), stage 1 on rank 1 (as '2.weight')"),
    # the V puts stages 0 and 3 on rank 0, 1 and 2 on rank 1: depths 0 and 2 are on different ranks
    "albert_v": ("ZBVZeroBubble", "'blocks.0.lin.weight', 'blocks.2.lin.weight'",
                 "stage 0 on rank 0 (as '1.lin.weight'), stage 2 on rank 1 (as 'lin.weight')"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_ties_of_one_kind_or_through_one_module_across_ranks_train_as_one(tmp_path: Path, case: str) -> None:
    """tied_weights="sync" (the default): every rank's gradients, each rank's copy of the tied weight's included,
    are the unsplit model's."""
    recs = run_json_script(tmp_path, SCRIPT2, 2, case, REFUSED[case][0], "sync", timeout=90)
    assert all(r["built"] for r in recs), recs
    tied = {"linear": "inp.weight", "module": "inp.weight"}.get(case, "blocks.0.lin.weight")
    for r in recs:
        assert tied in r["diffs"], recs  # (both ranks hold a copy)
        bad = {n: d for n, d in r["diffs"].items() if d == "missing" or (d != "none" and d > 1e-6)}
        assert not bad, r["diffs"]


@pytest.mark.parametrize("case", list(REFUSED))
def test_ties_of_one_kind_or_through_one_module_across_ranks_are_refused(tmp_path: Path, case: str) -> None:
    """tied_weights="refuse": refused on every rank, naming the tie, the stages and their ranks."""
    schedule, names, uses = REFUSED[case]
    recs = run_json_script(tmp_path, SCRIPT2, 2, case, schedule, "refuse", timeout=90)
    assert not any(r["built"] for r in recs), recs
    for rank, rec in enumerate(recs):
        msg = rec["message"]
        assert msg.startswith(f"rank {rank}: weights tied across stages on different ranks would be trained as "
                              "separate copies"), msg
        assert f"one parameter of the Net is tied under the names {names} and used by {uses}" in msg, msg
        assert "ranks built different Pipelines" not in msg, msg


ALLOWED = {
    "untied": "1F1B",
    "inner": "1F1B",  # tied inside one block
    "albert_one_stage": "1F1B",  # both depths in one stage
    "frozen": "1F1B",  # a frozen weight gets no gradient: its copies stay equal
    "unused_end": "1F1B",
    "buffer": "1F1B",
    "own_model": "1F1B",  # each rank's stage tied inside a small model of its own: the same key on both ranks
    "linear_v": "ZBVZeroBubble",  # the tied ends on stages 0 and 3, both on rank 0: shared for real
    "module_v": "DualPipeV",
}


@pytest.mark.parametrize("case", list(ALLOWED))
def test_ties_on_one_rank_or_not_across_ranks_build_and_train_the_unsplit_model(tmp_path: Path, case: str) -> None:
    recs = run_json_script(tmp_path, SCRIPT2, 2, case, ALLOWED[case], "sync", timeout=90)
    assert all(r["built"] for r in recs), recs
    diffs = {n: d for r in recs for n, d in r["diffs"].items()}
    if case != "own_model":
        assert diffs, recs
    bad = {n: d for n, d in diffs.items() if d != "none" and (d == "missing" or d > 1e-6)}
    assert not bad, diffs
    if case == "frozen":
        assert diffs["inp.weight"] == "none", diffs


def _group(stages: dict[int, list[str]], *, complete: bool = False) -> dict:
    return {"g": {"names": ["a.weight", "b.weight"], "count": 2, "stages": {str(s): n for s, n in stages.items()},
                  "complete": complete}}


def test_the_decision_from_every_ranks_record() -> None:
    """ties_across_ranks alone (what every rank decides from the posted records; 4 ranks: pp 2 x dp 2, replicas of
    stage s on ranks s and s + 2): replicas are one use, a tie spanning pipeline ranks is refused naming them."""
    from pipeloom.runtime.ties import ties_across_ranks

    pp = [0, 1]
    replicas = [{"_ties": _group({0: ["0.weight"]})}, {}, {"_ties": _group({0: ["0.weight"]})}, {}]
    assert ties_across_ranks(replicas, pp) == []
    across = [{"_ties": _group({0: ["0.weight"]})}, {"_ties": _group({1: ["2.weight"]})}] * 2
    (msg,) = ties_across_ranks(across, pp)
    assert ("tied under the names 'a.weight', 'b.weight' and used by stage 0 on ranks 0, 2 (as '0.weight'), "
            "stage 1 on ranks 1, 3 (as '2.weight')") in msg, msg
    # a V: stages 0 and 3 on pipeline rank 0
    assert ties_across_ranks([{"_ties": _group({0: ["x"], 3: ["y"]}, complete=True)}, {}], [0, 1, 1, 0]) == []
    # each rank's stage holds every end of its own model's tie: the same key, not one tie
    own = [{"_ties": _group({0: ["x", "y"]}, complete=True)}, {"_ties": _group({1: ["x", "y"]}, complete=True)}]
    assert ties_across_ranks(own, pp) == []
    # ...but one rank holding a part of it is one tie spanning them
    assert ties_across_ranks([own[0], {"_ties": _group({1: ["x"]})}], pp)
    # records of a rank that posted none (no tie group used) are nothing
    assert ties_across_ranks([{}, {"_ties": {}}], pp) == []


def test_the_local_record_in_one_process() -> None:
    """refuse_ties_across_ranks' record for stages built from a model alive in the process: the groups the local
    stages hold, under which names, and whether every end is local (no distributed job needed)."""
    from torch import nn

    from pipeloom.runtime.ties import refuse_ties_across_ranks

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(3, 3) for _ in range(4))
            self.blocks[3] = self.blocks[0]
            self.frozen = nn.ModuleList([nn.Linear(3, 3).requires_grad_(False)])
            self.frozen.append(self.frozen[0])

    model = Net()
    rec = refuse_ties_across_ranks({0: nn.Sequential(model.blocks[0], model.frozen[0])}, 0)
    assert rec == {"Net:blocks.0.weight": {"names": ["blocks.0.weight", "blocks.3.weight"], "count": 2,
                                           "stages": {"0": ["0.weight"]}, "complete": False},
                   "Net:blocks.0.bias": {"names": ["blocks.0.bias", "blocks.3.bias"], "count": 2,
                                         "stages": {"0": ["0.bias"]}, "complete": False}}, rec
    both = refuse_ties_across_ranks({0: nn.Sequential(model.blocks[0]), 3: nn.Sequential(model.blocks[3])}, 0)
    assert all(g["complete"] and set(g["stages"]) == {"0", "3"} for g in both.values()), both
    assert refuse_ties_across_ranks({1: model.blocks[1]}, 0) == {}


def test_a_parameter_collection_outside_the_stages_is_not_a_tie() -> None:
    """An ``nn.ParameterList`` (or ``ParameterDict``) kept alive beside the model holding its parameters (parameter
    groups for an optimizer, a list of the weights to decay) was taken by the rule by kind for a layer of another
    kind holding a stage's weight: every rank refused a model with no tie ("parameter '0.weight' (Linear) of stage 0
    is also the parameter '0' of a ParameterList").  A ParameterList that is part of the model, tying one of its
    weights, is still one tie group of the model (rule 2)."""
    from torch import nn

    from pipeloom.runtime.ties import refuse_ties_across_ranks

    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    decay = nn.ParameterList([p for p in model.parameters() if p.ndim > 1])  # noqa: F841 (alive: what is checked)
    by_name = nn.ParameterDict({n.replace(".", "_"): p for n, p in model.named_parameters()})  # noqa: F841
    assert refuse_ties_across_ranks({0: model[0]}, 0) == {}
    assert refuse_ties_across_ranks({1: model[2]}, 1) == {}

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(3, 3)
            self.extra = nn.ParameterList([self.inp.weight])  # used by forward elsewhere: a tie in the model

    net = Net()
    rec = refuse_ties_across_ranks({0: net.inp}, 0)
    assert rec == {"Net:inp.weight": {"names": ["inp.weight", "extra.0"], "count": 2, "stages": {"0": ["weight"]},
                                      "complete": False}}, rec
