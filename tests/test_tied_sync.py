"""Weights tied across pipeline ranks trained as one weight (``RuntimeOptions.tied_weights="sync"``, the default;
see runtime/ties.py ``TiedCopies``), on real gloo ranks: an embedding on stage 0 and a head on the last stage sharing
one weight (GPT-2's ``lm_head.weight is transformer.wte.weight``), and one block object at two depths (ALBERT).
Every rank's parameters and gradients are compared with the unsplit model's (built from the same state dict, its
loss the mean of the microbatch losses, as the pipeline's is) after every step and optimizer step; the ranks'
copies of the tied weight must stay bit-equal.  Rank 1's copy starts different (as if built from another seed) in
every case: construction makes it rank 0's.  Each job runs several cases one Pipeline after another."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import run_json_script  # noqa: E402

COMMON = textwrap.dedent("""\
    import copy, hashlib, json, os, sys, torch, pipeloom
    import torch.nn.functional as F
    from torch import nn
    rank = int(os.environ["RANK"])
    V, D = 11, 6

    class LM(nn.Module):  # embedding and head share one weight
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4))
            self.head = nn.Linear(D, V, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            h = self.emb(x)
            for b in self.blocks:
                h = b(h)
            return self.head(h)

        def parts(self, n):
            if n == 2:
                return [nn.Sequential(self.emb, *self.blocks[:2]), nn.Sequential(*self.blocks[2:], self.head)]
            return [nn.Sequential(self.emb, self.blocks[0]), self.blocks[1], self.blocks[2], nn.Sequential(self.blocks[3], self.head)]

        def tied(self):
            return self.emb.weight

    class Albert(nn.Module):  # one block object at depths 0 and 2
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(D, D)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4))
            self.blocks[2] = self.blocks[0]
            self.out = nn.Linear(D, V)

        def forward(self, x):
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.out(h)

        def parts(self, n):
            if n == 2:
                return [nn.Sequential(self.inp, *self.blocks[:2]), nn.Sequential(*self.blocks[2:], self.out)]
            return [nn.Sequential(self.inp, self.blocks[0]), self.blocks[1], self.blocks[2], nn.Sequential(self.blocks[3], self.out)]

        def tied(self):
            return self.blocks[0][0].weight

    def loss_fn(out, y):
        return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))

    def digest(t):
        return hashlib.sha1(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()

    def build(cls, n_stages):
        torch.manual_seed(0)
        model = cls()
        parts = model.parts(n_stages)
        ref = copy.deepcopy(model)  # (tied as the model is: deepcopy keeps the tie)
        if rank != 0:  # this rank's copy starts different: construction makes it rank 0's
            with torch.no_grad():
                model.tied().add_(1.0)
        return model, parts, ref

    def compare(model, parts, ref, pipe):
        # max |pipeline - unsplit| over this rank's parameters and gradients, and the tied copy's digests
        want = dict(ref.named_parameters(remove_duplicate=False))
        names = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)
        worst = 0.0
        for s in range(len(parts)):
            if pipe.stage_to_rank[s] != rank:
                continue
            for p in parts[s].parameters():
                w = want[names[id(p)]]
                worst = max(worst, float((p.detach() - w.detach()).abs().max()))
                if (p.grad is None) != (w.grad is None):
                    return float("inf"), None
                if p.grad is not None:
                    worst = max(worst, float((p.grad - w.grad).abs().max()))
        t = model.tied()
        return worst, [digest(t), None if t.grad is None else digest(t.grad)]

    def ref_backward(ref, x, y, n):
        sum(loss_fn(ref(xb), yb) for xb, yb in zip(x.chunk(n), y.chunk(n))).div(n).backward()
""")

SCRIPT = COMMON + textwrap.dedent("""\
    def run(case):
        cls = Albert if case["model"] == "albert" else LM
        schedule = case["schedule"]
        n_stages = 2 if schedule in ("1F1B", "GPipe") else 4
        model, parts, ref = build(cls, n_stages)
        pipe = pipeloom.Pipeline(lambda s: parts[s], schedule=schedule, num_microbatches=4, loss_fn=loss_fn)
        out = {"start": digest(model.tied()), "want_start": digest(ref.tied()), "diffs": [], "digests": []}
        make = (lambda ps: torch.optim.Adam(ps, lr=0.01)) if case["opt"] == "adam" else (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        opt, ref_opt = make(pipe.parameters()), make(ref.parameters())
        g = torch.Generator().manual_seed(1)
        for it in range(3):
            for _ in range(case.get("accumulate", 1)):
                x, y = torch.randint(0, V, (8, 3), generator=g), torch.randint(0, V, (8, 3), generator=g)
                if cls is Albert:
                    x = torch.randn(8, 3, D, generator=g)
                pipe.step(x, target=y, return_outputs=False)
                ref_backward(ref, x, y, 4)
                worst, dig = compare(model, parts, ref, pipe)
                out["diffs"].append(worst)
                out["digests"].append(dig)
            if case.get("clip"):
                out.setdefault("norms", []).append([float(pipe.clip_grad_norm_(0.05)), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))])
                worst, dig = compare(model, parts, ref, pipe)
                out["diffs"].append(worst)
                out["digests"].append(dig)
            opt.step(); opt.zero_grad()
            ref_opt.step(); ref_opt.zero_grad()
            worst, dig = compare(model, parts, ref, pipe)
            out["diffs"].append(worst)
            out["digests"].append(dig)
        if case.get("checkpoint"):  # each holding rank saves its copy; loaded back equal
            path = sys.argv[2]
            pipeloom.save_checkpoint(path, pipe, opt, step=1, stage_prefix=True)
            before = model.tied().detach().clone()
            with torch.no_grad():
                model.tied().mul_(0.0)
            pipeloom.load_checkpoint(path, pipe, opt, stage_prefix=True)
            out["loaded"] = bool(torch.equal(model.tied(), before))
            out["loaded_digest"] = digest(model.tied())
        pipe.close()
        return out

    cases = json.loads(sys.argv[1])
    print(json.dumps([run(c) for c in cases]), flush=True)
""")

CASES = [
    {"model": "lm", "schedule": "1F1B", "opt": "sgd"},
    {"model": "lm", "schedule": "1F1B", "opt": "adam", "clip": True},
    {"model": "lm", "schedule": "Interleaved1F1B", "opt": "sgd"},
    {"model": "lm", "schedule": "GPipe", "opt": "adam", "accumulate": 2},
    {"model": "lm", "schedule": "InterleavedZeroBubble", "opt": "sgd", "clip": True},  # I/W split, the tie across ranks
    {"model": "albert", "schedule": "ZBVZeroBubble", "opt": "adam", "checkpoint": True},  # depths 0 and 2 on ranks 0, 1
    {"model": "albert", "schedule": "1F1B", "opt": "sgd", "accumulate": 2, "clip": True},
]


def _check(recs: list, cases: list) -> None:
    for i, case in enumerate(cases):
        a, b = recs[0][i], recs[1][i]
        for r in (a, b):
            assert r["start"] == r["want_start"], (case, r)  # (rank 1's built different)
            assert max(r["diffs"]) < 1e-6, (case, r["diffs"])
        # rank 1's copy, built different, was made rank 0's; the copies stay bit-equal, gradients too
        assert a["digests"] == b["digests"], case
        if case.get("clip"):
            for r in (a, b):
                for got, want in r["norms"]:
                    assert abs(got - want) < 1e-6 * max(1.0, want), (case, r["norms"])
                    assert want > 0.05  # (the clip clipped)
        if case.get("checkpoint"):
            assert a["loaded"] and b["loaded"] and a["loaded_digest"] == b["loaded_digest"], (a, b)


def test_tied_weights_across_two_ranks_train_as_the_unsplit_model(tmp_path: Path) -> None:
    """1F1B, Interleaved1F1B, GPipe, InterleavedZeroBubble (I/W split), ZBVZeroBubble (ALBERT's block at depths on
    both ranks); SGD with momentum and Adam; gradient accumulation (two steps per optimizer step); clip_grad_norm_
    (the unsplit model's norm, clipped equally); a checkpoint saved and loaded back with the tied copies."""
    import json

    recs = run_json_script(tmp_path, SCRIPT, 2, json.dumps(CASES), str(tmp_path / "ck"), timeout=120)
    _check(recs, CASES)


SCRIPT_DP = COMMON + textwrap.dedent("""\
    # 4 ranks, pp 2 x dp 2: first FSDP with a tie across ranks (refused), then data parallelism (trained)
    model, parts, ref = build(LM, 2)
    rec = {}
    try:
        pipeloom.Pipeline(lambda s: parts[s], schedule="1F1B", num_microbatches=2, loss_fn=loss_fn, data_parallel=2, fsdp=True)
        rec["fsdp"] = "built"
    except pipeloom.PipelineConfigError as exc:
        rec["fsdp"] = str(exc)
    pipe = pipeloom.Pipeline(lambda s: parts[s], schedule="1F1B", num_microbatches=2, loss_fn=loss_fn, data_parallel=2)
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    rec["diffs"], rec["digests"] = [], []
    for it in range(3):
        x, y = torch.randint(0, V, (8, 3), generator=g), torch.randint(0, V, (8, 3), generator=g)
        if it == 1:  # accumulation across a no_sync step
            with pipe.no_sync():
                pipe.step(x, target=y, return_outputs=False)
            ref_backward(ref, x, y, 4)  # (each replica's 2 microbatches of 4 rows: the mean over 4 microbatches)
            x, y = torch.randint(0, V, (8, 3), generator=g), torch.randint(0, V, (8, 3), generator=g)
        pipe.step(x, target=y, return_outputs=False)
        ref_backward(ref, x, y, 4)
        rec["norm"] = [float(pipe.clip_grad_norm_(1e9)), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))]
        w, d = compare(model, parts, ref, pipe); rec["diffs"].append(w); rec["digests"].append(d)
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
        w, d = compare(model, parts, ref, pipe); rec["diffs"].append(w); rec["digests"].append(d)
    pipe.close()
    print(json.dumps(rec), flush=True)
""")


def test_tied_weights_with_data_parallelism_and_fsdp_refused(tmp_path: Path) -> None:
    """pp 2 x dp 2: every rank equal to the unsplit model on the global batch (a no_sync step accumulated in
    between), the copies bit-equal on all four ranks; fsdp=True with the tie across ranks is refused, saying so."""
    recs = run_json_script(tmp_path, SCRIPT_DP, 4, timeout=120)
    for r in recs:
        assert "not implemented with fsdp=True" in r["fsdp"] and "'emb.weight', 'head.weight'" in r["fsdp"], r["fsdp"]
        assert max(r["diffs"]) < 1e-6, r["diffs"]
        got, want = r["norm"]
        assert abs(got - want) < 1e-6 * want, r["norm"]
    assert all(r["digests"] == recs[0]["digests"] for r in recs), [r["digests"] for r in recs]


#: A rank job's function (tiny causal LMs of token ids 3..39): ``steps`` training steps of ``pipe`` beside the
#: unsplit ``ref`` (the same batches, cut into ``microbatches``, the loss their mean), both optimizers stepped; every
#: local parameter's gradient and then value, against the reference's by name, appended to ``diffs``.
TRAIN_BESIDE_REF = textwrap.dedent("""\
    def train_beside_ref(pipe, ref, loss_fn, opt, ref_opt, g, diffs, *, steps, rows, microbatches):
        want = dict(ref.named_parameters(remove_duplicate=False))
        for it in range(steps):
            ids = torch.randint(3, 40, (rows, 7), generator=g)
            pipe.step(ids, target=ids, return_outputs=False)
            sum(loss_fn(ref(input_ids=part), part) for part in ids.chunk(microbatches)).div(microbatches).backward()
            for stage in pipe.stages.values():
                for n, p in stage.named_parameters():
                    diffs.append(float((p.grad - want[n].grad).abs().max()))
            opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
            for stage in pipe.stages.values():
                for n, p in stage.named_parameters():
                    diffs.append(float((p.detach() - want[n].detach()).abs().max()))
""")

SCRIPT_HF = TRAIN_BESIDE_REF + textwrap.dedent("""\
    import copy, json, os, sys, torch, transformers, pipeloom
    from pipeloom.hf import stage_fn_for_causal_lm
    rank = int(os.environ["RANK"])
    mode, family = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(cfg).double()
    else:  # GPT-2: a position embedding added to the token embedding, and an embedding dropout (0 here: exact)
        cfg = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=4, n_head=4, n_positions=16, bos_token_id=1,
                                      eos_token_id=2, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg).double()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    ref = copy.deepcopy(model)
    stage_fn, loss_fn = stage_fn_for_causal_lm(model, num_stages=2)
    try:
        pipe = pipeloom.Pipeline(stage_fn, schedule="1F1B", num_microbatches=2, loss_fn=loss_fn,
                                 options=pipeloom.RuntimeOptions(tied_weights=mode))
    except pipeloom.PipelineConfigError as exc:
        print(json.dumps({"built": False, "message": str(exc)}), flush=True)
        sys.exit(0)
    opt, ref_opt = torch.optim.AdamW(pipe.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
    diffs = []
    train_beside_ref(pipe, ref, loss_fn, opt, ref_opt, torch.Generator().manual_seed(1), diffs, steps=2, rows=4, microbatches=2)
    names = sorted(n for stage in pipe.stages.values() for n, _ in stage.named_parameters())
    pipe.close()
    print(json.dumps({"built": True, "diff": max(diffs), "names": names}), flush=True)
""")


@pytest.mark.parametrize("mode, family", [("sync", "llama"), ("refuse", "llama"), ("sync", "gpt2")])
def test_hf_causal_lm_with_tied_embeddings_trains_through_two_ranks(tmp_path: Path, mode: str, family: str) -> None:
    """pipeloom.hf: a tiny Llama with tie_word_embeddings=True, its embedding on stage 0 and its head on stage 1,
    trains as the unsplit model (AdamW, 2 steps); with tied_weights="refuse" the Pipeline refuses it.  GPT-2
    (tied too) was refused by pipeloom.hf before: its forward adds a position embedding to the token embedding,
    which a pass-through on stage 1 added again (the position ids); now stage 1 adds nothing there."""
    pytest.importorskip("transformers")
    recs = run_json_script(tmp_path, SCRIPT_HF, 2, mode, family, timeout=120)
    if mode == "refuse":
        for rank, r in enumerate(recs):
            assert not r["built"], r
            assert r["message"].startswith(f"rank {rank}: weights tied across stages on different ranks"), r
            assert "'model.embed_tokens.weight', 'lm_head.weight'" in r["message"], r
        return
    assert all(r["built"] for r in recs), recs
    emb = "model.embed_tokens.weight" if family == "llama" else "transformer.wte.weight"
    assert emb in recs[0]["names"] and "lm_head.weight" in recs[1]["names"], recs
    for r in recs:
        assert r["diff"] < 1e-9, recs
