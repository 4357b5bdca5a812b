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
from test_tied_sync import COMMON, TRAIN_BESIDE_REF  # noqa: E402

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

    SKIP = set()  # depths whose block this step passes over (on every rank and in the unsplit model)

    class Gate(nn.Module):
        def __init__(self, depth, block):
            super().__init__()
            self.depth, self.block = depth, block

        def forward(self, h):
            return h if self.depth in SKIP else self.block(h)

    class Gated(Albert):  # ALBERT's block at depths 0 and 2, either depth passed over in some steps
        def __init__(self):
            super().__init__()
            inner = [b for b in self.blocks]
            self.blocks = nn.ModuleList(Gate(i, inner[0] if i == 2 else inner[i]) for i in range(4))

        def tied(self):
            return self.blocks[0].block[0].weight

    MODELS = {"gated": Gated, "lm": LM, "albert": Albert, "albert3": Albert3, "both": Both, "frozen": Frozen}

    def xy(cls, g, rows=8):
        x, y = torch.randint(0, V, (rows, 3), generator=g), torch.randint(0, V, (rows, 3), generator=g)
        if cls in (Albert, Albert3, Gated):
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
                SKIP.clear(); SKIP.update(case.get("skip", [[]] * 9)[it * case.get("accumulate", 1) + k])
                if case.get("eval"):
                    ex, ey = xy(cls, g)
                    pipe.eval(ex, target=ey, return_outputs=True)
                pipe.step(x, target=y, return_outputs=case.get("outputs", False))
                ref_backward(ref, x, y, 4)
            if case.get("clip"):
                got, want = float(pipe.clip_grad_norm_(0.05)), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
                out["diffs"].append(abs(got - want) / want)
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
    {"model": "albert3", "schedule": "Interleaved1F1B", "stages": 4, "clip": True},
    {"model": "both", "schedule": "Interleaved1F1B", "stages": 4, "clip": True},
    {"model": "both", "schedule": "1F1B"},
    {"model": "lm", "schedule": "1F1B", "options": {"deterministic": True, "static_shapes": True}},
    {"model": "lm", "schedule": "1F1B", "options": {"host_overlap_backward": True}},
    {"model": "lm", "schedule": "DualPipeV", "stages": 4},
    {"model": "albert3", "schedule": "InterleavedZeroBubble", "stages": 4, "zeros": True},
    {"model": "albert", "schedule": "DualPipeV", "stages": 4, "options": {"dispatch": "critical"}},
    {"model": "both", "schedule": "ZBVZeroBubble", "stages": 4, "options": {"host_overlap_backward": True, "dispatch": "guarded"}},
    {"model": "albert3", "schedule": "InterleavedZeroBubble", "stages": 4, "options": {"dispatch": "ready", "static_shapes": True}},
    {"model": "both", "schedule": "InterleavedZeroBubble", "stages": 4, "options": {"deterministic": True, "host_overlap_backward": True}},
    {"model": "frozen", "schedule": "1F1B"},
    # one holder's copy gets no gradient in a step (its depth passed over), then the other's, then both's
    {"model": "gated", "schedule": "1F1B", "accumulate": 2, "skip": [[2], [0], [0, 2], [2], [0, 2], [0, 2]]},
    {"model": "gated", "schedule": "1F1B", "zeros": True, "skip": [[2], [0, 2], [0]]},  # frozen: rank 1's copy, built different, made rank 0's
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


SCRIPT_MISC = "import faulthandler; faulthandler.dump_traceback_later(150, exit=True)\n" + COMMON + TRAIN_BESIDE_REF + EXTRA.split("cases = json.loads")[0] + textwrap.dedent("""\
    import transformers
    from pipeloom.hf import stage_fn_for_causal_lm
    res = {}

    def scaler_case():  # ALBERT's block tied across the ranks, an inf in one microbatch of the second step
        model, parts, ref = build(Albert, 2)
        pipe = pipeloom.Pipeline(lambda s: parts[s], schedule="1F1B", num_microbatches=4, loss_fn=loss_fn)
        scaler, ref_scaler = pipeloom.PipelineGradScaler(pipe, init_scale=256.0, growth_interval=1), torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1)
        opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        diffs, scales = [], []
        for it in range(3):
            x, y = xy(Albert, g)
            if it == 1:
                x[0, 0, 0] = float("inf")
            pipe.step(x, target=y, return_outputs=False)
            ref_scaler.scale(sum(loss_fn(ref(xb), yb) for xb, yb in zip(x.chunk(4), y.chunk(4))).div(4)).backward()
            scaler.step(opt); scaler.update(); opt.zero_grad()
            ref_scaler.step(ref_opt); ref_scaler.update(); ref_opt.zero_grad()
            diffs.append(compare(model, parts, ref, pipe)[0])
            scales.append([scaler.get_scale(), ref_scaler.get_scale()])
        pipe.close()
        return {"diffs": diffs, "scales": scales, "digest": digest(model.tied())}

    def two_alive():  # two Pipelines alive at once, each with its tie, stepped in turn
        a, b = build(LM, 2), build(Both, 2)
        pa = pipeloom.Pipeline(lambda s: a[1][s], schedule="1F1B", num_microbatches=4, loss_fn=loss_fn)
        pb = pipeloom.Pipeline(lambda s: b[1][s], schedule="1F1B", num_microbatches=4, loss_fn=loss_fn)
        g = torch.Generator().manual_seed(1)
        diffs = []
        for it in range(2):
            for (model, parts, ref), pipe in ((a, pa), (b, pb)):
                x, y = xy(LM, g)
                pipe.step(x, target=y, return_outputs=False)
                ref_backward(ref, x, y, 4)
                diffs.append(compare(model, parts, ref, pipe)[0])
        pa.close(); pb.close()
        return {"diffs": diffs}

    def gpt2(schedule, splits, twice):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=4, n_head=4, n_positions=16, bos_token_id=1,
                                      eos_token_id=2, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg).double()
        ref = copy.deepcopy(model)
        kw = {"layer_splits": splits} if splits else {"num_stages": 4 if schedule == "Interleaved1F1B" else 2}
        stage_fn, lfn = stage_fn_for_causal_lm(model, **kw)
        diffs = []
        g = torch.Generator().manual_seed(1)
        for build_no in range(2 if twice else 1):
            pipe = pipeloom.Pipeline(stage_fn, schedule=schedule, num_microbatches=4, loss_fn=lfn)
            opt, ref_opt = torch.optim.AdamW(pipe.parameters(), lr=0.01), torch.optim.AdamW(ref.parameters(), lr=0.01)
            if build_no:  # a second Pipeline from the same stage_fn: the model as it was built (ref restarted too)
                ref = copy.deepcopy(model); want = dict(ref.named_parameters(remove_duplicate=False))
                ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
                for stage in pipe.stages.values():
                    for n, p in stage.named_parameters():
                        diffs.append(float((p.detach() - want[n].detach()).abs().max()))
            train_beside_ref(pipe, ref, lfn, opt, ref_opt, g, diffs, steps=2, rows=8, microbatches=4)
            pipe.close()
        return {"diffs": diffs}

    def gpt2_checkpoint():  # saved under 1F1B (2 stages), loaded under Interleaved1F1B (4 stages) into another seed's model
        cfg = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=4, n_head=4, n_positions=16, bos_token_id=1,
                                      eos_token_id=2, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg).double()
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
        want = dict(ref.named_parameters(remove_duplicate=False))
        g = torch.Generator().manual_seed(1)
        diffs, tied = [], []
        for layout, seed in (("1F1B", 0), ("Interleaved1F1B", 5 + rank)):
            torch.manual_seed(seed)
            m = transformers.GPT2LMHeadModel(cfg).double()
            stage_fn, lfn = stage_fn_for_causal_lm(m, num_stages=2 if layout == "1F1B" else 4)
            pipe = pipeloom.Pipeline(stage_fn, schedule=layout, num_microbatches=4, loss_fn=lfn)
            opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
            if layout != "1F1B":
                pipeloom.load_checkpoint(sys.argv[1], pipe, opt)
            for it in range(2):
                ids = torch.randint(3, 40, (8, 7), generator=g)
                pipe.step(ids, target=ids, return_outputs=False)
                sum(lfn(ref(input_ids=part), part) for part in ids.chunk(4)).div(4).backward()
                opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
                for stage in pipe.stages.values():
                    for n, p in stage.named_parameters():
                        diffs.append(float((p.detach() - want[n].detach()).abs().max()))
                        if n in ("transformer.wte.weight", "lm_head.weight"):
                            tied.append(digest(p))
            if layout == "1F1B":
                pipeloom.save_checkpoint(sys.argv[1], pipe, opt, step=2)
            pipe.close()
        return {"diffs": diffs, "tied": tied}

    def many_groups():  # one block of 130 layers (260 parameters: a tie group each) at a depth on either rank
        class Many(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([nn.Sequential(*(nn.Linear(D, D) for _ in range(130)))] * 2)
                self.out = nn.Linear(D, V)
            def forward(self, x):
                return self.out(self.blocks[1](self.blocks[0](x)))
            def parts(self, n):
                return [self.blocks[0], nn.Sequential(self.blocks[1], self.out)]
            def tied(self):
                return self.blocks[0][-1].weight
        model, parts, ref = build(Many, 2)
        try:
            pipe = pipeloom.Pipeline(lambda s: parts[s], schedule="1F1B", num_microbatches=4, loss_fn=loss_fn)
        except pipeloom.PipelineConfigError as exc:
            return {"refused": str(exc)}
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 3, D, generator=g) * 0.1, torch.randint(0, V, (8, 3), generator=g)
        pipe.step(x, target=y, return_outputs=False)
        ref_backward(ref, x, y, 4)
        out = {"diffs": [compare(model, parts, ref, pipe)[0]]}
        pipe.close()
        return out

    def two_roots(parent=False):  # two tied models of one class built apart (no common parent), each split over both ranks
        torch.manual_seed(0)
        a, b = LM(), LM()
        holder = nn.ModuleDict({"a": a, "b": b}) if parent else None  # (the remedy the refusal names)
        with torch.no_grad():
            b.emb.weight.mul_(3.0)
        ra, rb = copy.deepcopy((a, b))
        class Both(nn.Module):  # one end of each model's tie, their outputs summed
            def __init__(self, a, b):
                super().__init__()
                self.a, self.b = a, b
            def forward(self, x):
                return self.a(x) + self.b(x)
        parts = [Both(a.emb, b.emb), Both(a.head, b.head)]
        try:
            pipe = pipeloom.Pipeline(lambda s: parts[s], schedule="1F1B", num_microbatches=4, loss_fn=loss_fn)
        except pipeloom.PipelineConfigError as exc:
            return {"refused": str(exc)}
        ref = nn.Sequential(Both(ra.emb, rb.emb), Both(ra.head, rb.head))
        g = torch.Generator().manual_seed(1)
        x, y = xy(LM, g)
        pipe.step(x, target=y, return_outputs=False)
        ref_backward(ref, x, y, 4)
        st = parts[0] if rank == 0 else parts[1]
        want = parts.index(st)
        diffs = [float((p.grad - q.grad).abs().max()) for p, q in zip(st.parameters(), ref[want].parameters())]
        pipe.close()
        return {"diffs": diffs}

    def failed():  # stage 1 raises in microbatch 2 of the second step: refused after, exits
        model, parts, ref = build(LM, 2)
        calls = {"n": 0}
        class Boom(nn.Module):
            def forward(self, h):
                calls["n"] += 1
                if calls["n"] == 7:
                    raise RuntimeError("boom")
                return h
        stages = [parts[0], nn.Sequential(Boom(), parts[1])]
        pipe = pipeloom.Pipeline(lambda s: stages[s], schedule="1F1B", num_microbatches=4, loss_fn=loss_fn,
                                 options=pipeloom.RuntimeOptions(heartbeat_timeout=5.0, stall_timeout=10.0))
        g = torch.Generator().manual_seed(1)
        out = {}
        try:
            for it in range(2):
                x, y = xy(LM, g)
                pipe.step(x, target=y, return_outputs=False)
                ref_backward(ref, x, y, 4)
                if it == 0:
                    out["first"] = compare(model, parts, ref, pipe)[0]
        except Exception as exc:
            out["error"] = type(exc).__name__
        return step_after_failure(pipe, g, out)

    def step_after_failure(pipe, g, out):  # the next step after a failed one (refused: why, in out["after"]), closed
        try:
            pipe.step(*xy(LM, g), return_outputs=False)
        except Exception as exc:
            out["after"] = str(exc)[:200]
        pipe.close()
        return out

    def failed_late(after=False):  # stage 0's last backward raises (after: rank 0 fails once its step's work is
        # done, as a failed merge of the outputs would): rank 1 is already in the tie's all-reduce, or waits there
        model, parts, ref = build(LM, 2)
        calls = {"n": 0}
        class Raise(torch.autograd.Function):
            @staticmethod
            def forward(ctx, h):
                return h.view_as(h)
            @staticmethod
            def backward(ctx, g):
                calls["n"] += 1
                if calls["n"] == 8 and not after:
                    raise RuntimeError("late boom")
                return g
        class Late(nn.Module):
            def forward(self, h):
                return Raise.apply(h)
        stages = [nn.Sequential(parts[0][0], Late(), *parts[0][1:]), parts[1]]
        pipe = pipeloom.Pipeline(lambda s: stages[s], schedule="1F1B", num_microbatches=4, loss_fn=loss_fn,
                                 options=pipeloom.RuntimeOptions(heartbeat_timeout=5.0, stall_timeout=10.0))
        g = torch.Generator().manual_seed(1)
        out = {}
        import time
        t0 = time.monotonic()
        try:
            for it in range(2):
                x, y = xy(LM, g)
                pipe.step(x, target=y, return_outputs=False)
                if it == 0:  # the gradient held before the failed step, and what that step accumulates here
                    if after and rank == 0:
                        run_step = pipe._actor.run_step
                        async def failing(*a, **k):
                            await run_step(*a, **k)
                            raise RuntimeError("failed after the step's work")
                        pipe._actor.run_step = failing
                    prev, last = model.tied().grad.clone(), {}
                    model.tied().register_post_accumulate_grad_hook(lambda p: last.__setitem__("g", p.grad.clone()))
        except Exception as exc:
            out["error"] = type(exc).__name__ + ": " + str(exc)[:200]
        out["seconds"] = time.monotonic() - t0
        # the gradient after the failed step: the one held before it, with what the step added locally
        out["restored"] = bool(torch.allclose(model.tied().grad, prev + last["g"], atol=1e-7))
        return step_after_failure(pipe, g, out)

    for name, fn in [("two_roots", two_roots), ("two_roots_parent", lambda: two_roots(True)), ("many_groups", many_groups), ("scaler", scaler_case), ("two_alive", two_alive),
                     ("gpt2_interleaved", lambda: gpt2("Interleaved1F1B", None, False)),
                     ("gpt2_splits_twice", lambda: gpt2("1F1B", [3, 1], True)),
                     ("gpt2_checkpoint", gpt2_checkpoint),
                     # (the failed Pipelines last: a Pipeline built after them in this process hung at times, rank 1
                     # blocked in a module's __init__, under the collector: see the report of this file's commit)
                     ("failed", failed), ("failed_late", failed_late), ("failed_after", lambda: failed_late(True))]:
        try:
            res[name] = fn()
        except Exception as exc:
            import traceback
            res[name] = {"error": traceback.format_exc()[-1500:]}
    print(json.dumps(res), flush=True)
""")


def test_adversarial_misc_two_ranks(tmp_path: Path) -> None:
    """PipelineGradScaler with an inf in one microbatch (both copies skipped, torch's scale sequence); two Pipelines
    alive at once, each with its tie; a tied GPT-2 through pipeloom.hf under Interleaved1F1B (4 stages on 2 ranks)
    and with layer_splits, then a second Pipeline built from the same stage_fn (it shared the first one's trained
    embedding: 0.13 off); a stage raising in a forward, and in the last backward: refused after, gradients restored."""
    recs = run_json_script(tmp_path, SCRIPT_MISC, 2, str(tmp_path / "ck"), timeout=240)
    for rank, r in enumerate(recs):
        for name in ("scaler", "two_alive", "gpt2_interleaved", "gpt2_splits_twice", "gpt2_checkpoint"):
            assert "error" not in r[name], (rank, name, r[name])
            assert max(r[name]["diffs"]) < 1e-6, (rank, name, r[name]["diffs"])
        assert all(a == b for a, b in r["scaler"]["scales"]) and r["scaler"]["scales"][1][0] < r["scaler"]["scales"][0][0], r["scaler"]
        assert r["failed_after"]["restored"], (rank, r["failed_after"])
        for name in ("failed", "failed_late", "failed_after"):
            assert "error" in r[name] and "failed (" in r[name]["after"], (rank, r[name])
        assert r["failed"]["first"] < 1e-6 and r["failed_late"]["restored"], r
        # two tied models of one class built apart: one tie was lost (not synchronised, not refused: 1.7 off)
        assert r["two_roots"].get("refused", "").startswith(f"rank {rank}: two models of class LM alive"), (rank, r["two_roots"])
        assert "'emb.weight'" in r["two_roots"]["refused"], r["two_roots"]
        assert "diffs" in r["two_roots_parent"] and max(r["two_roots_parent"]["diffs"]) < 1e-6, r["two_roots_parent"]
        # 260 tie groups (one shared block of 130 layers): those past 256 were neither synchronised nor refused
        assert "error" not in r["many_groups"] and max(r["many_groups"]["diffs"]) < 1e-6, (rank, r["many_groups"])
    assert recs[0]["gpt2_checkpoint"]["tied"] == recs[1]["gpt2_checkpoint"]["tied"]
    assert recs[0]["scaler"]["digest"] == recs[1]["scaler"]["digest"]


SCRIPT_4 = COMMON + EXTRA.split("cases = json.loads")[0] + textwrap.dedent("""\
    def dp_case(case):  # pp 2 x dp 2: several steps per optimizer step, no_sync, eval, zeros
        cls = MODELS[case["model"]]
        model, parts, ref = build(cls, 2)
        pipe = pipeloom.Pipeline(lambda s: parts[s], schedule=case["schedule"], num_microbatches=2, loss_fn=loss_fn,
                                 data_parallel=2, options=pipeloom.RuntimeOptions(**case.get("options", {})))
        opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        out = {"diffs": [], "digests": [], "norms": []}
        try:
            for it in range(3):
                for k, mode in enumerate(case["plan"][it]):  # "n": no_sync step, "s": synchronised step, "e": eval
                    x, y = xy(cls, g)
                    if mode == "e":
                        pipe.eval(x, target=y, return_outputs=True)
                        continue
                    if mode == "n":
                        with pipe.no_sync():
                            pipe.step(x, target=y, return_outputs=False)
                    else:
                        pipe.step(x, target=y, return_outputs=False)
                    ref_backward(ref, x, y, 4)
                out["norms"].append([float(pipe.clip_grad_norm_(1e9)), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))])
                w, d = compare(model, parts, ref, pipe); out["diffs"].append(w); out["digests"].append(d)
                opt.step(); opt.zero_grad(set_to_none=not case.get("zeros")); ref_opt.step(); ref_opt.zero_grad(set_to_none=not case.get("zeros"))
                w, d = compare(model, parts, ref, pipe); out["diffs"].append(w); out["digests"].append(d)
        finally:
            pipe.close()
        return out

    res = {}
    cases = json.loads(sys.argv[1])
    for i, c in enumerate(cases):
        try:
            res[i] = run(c) if "plan" not in c else dp_case(c)
        except Exception as exc:
            import traceback
            res[i] = {"error": traceback.format_exc()[-1500:]}
    print(json.dumps(res), flush=True)
""")

CASES_4 = [
    {"model": "albert3", "schedule": "1F1B", "stages": 4, "clip": True},  # one block at depths on stages of 3 ranks
    {"model": "both", "schedule": "1F1B", "stages": 4, "zeros": True, "clip": True},  # two tie groups, on ranks {0, 3} and {0, 2}
    {"model": "albert3", "schedule": "GPipe", "stages": 4, "accumulate": 2, "eval": True},
    {"model": "lm", "schedule": "1F1B", "plan": [["n", "s"], ["s", "e", "s"], ["n", "n", "s"]]},
    {"model": "both", "schedule": "1F1B", "plan": [["s", "n", "s"], ["e", "s"], ["n", "s"]], "zeros": True},
    {"model": "gated", "schedule": "GPipe", "plan": [["n", "s"], ["s", "s"], ["n", "s"]]},
]


def test_adversarial_four_ranks(tmp_path: Path) -> None:
    """pp 4: ALBERT's block on stages of 3 ranks, two tie groups at once; pp 2 x dp 2: no_sync and synchronised steps
    mixed before each optimizer step, evaluation between them, zero_grad(set_to_none=False); all four ranks against
    the unsplit model, the holders' copies bit-equal."""
    recs = run_json_script(tmp_path, SCRIPT_4, 4, json.dumps(CASES_4), timeout=240)
    bad = []
    for i, case in enumerate(CASES_4):
        rs = [r[str(i)] for r in recs]
        for rank, r in enumerate(rs):
            if "error" in r or max(r["diffs"]) > 1e-6:
                bad.append((case, rank, r.get("error") or r["diffs"]))
            for got, want in r.get("norms", []):
                if abs(got - want) > 1e-6 * max(1.0, want):
                    bad.append((case, rank, r["norms"]))
        held = [r["digests"] for r in rs if "digests" in r and all(d is not None for d in r["digests"]) and r["digests"][0][0] is not None]
        if any(d != held[0] for d in held):
            bad.append((case, "digests differ"))
    assert not bad, bad


def test_more_tie_groups_than_recorded_are_refused(monkeypatch) -> None:
    """Tie groups past the record's limit were left out silently (neither synchronised nor refused): refused now."""
    import pytest
    from torch import nn

    from pipeloom.runtime import ties

    monkeypatch.setattr(ties, "_MAX_GROUPS", 2)
    block = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))  # 4 parameters, each tied (the block at two depths)
    model = nn.Sequential(block, nn.Tanh(), block)
    with pytest.raises(ties.PipelineConfigError, match=r"rank 3: the stages use more than 2 tied parameters"):
        ties.refuse_ties_across_ranks({0: model[0]}, 3, sync=True)
    del model
