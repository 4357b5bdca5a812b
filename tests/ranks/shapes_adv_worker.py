"""One rank of tests/test_shapes_adversarial.py: inputs that change over a job's life, against the unsplit model.

``python shapes_adv_worker.py JOB.json`` on every rank of a gloo job.  Each case builds a Pipeline (a schedule,
``RuntimeOptions(static_shapes=...)``, a model kind) and runs a *script* of steps and evals whose inputs change:
rows, sequence length, dtype, ``requires_grad`` of the batch, keyword tensors that come and go, ``Replicate``
values, ``Microbatches`` of different shapes, ``return_outputs`` / ``losses=``.  Every rank runs the same script on
the unsplit model (same seeds, float64 parameters, the batch cut as the Pipeline cuts it) and compares after each
op: the outputs, the losses, ``last_loss()``, every gradient of its stages (``None`` included) and the batch's
gradient.  Where the runtime must refuse (static shapes meeting a transfer it did not learn, a non-tensor handed
between stages), the error is recorded with how long the step took, and the case ends (a failed step is a
Pipeline's last).

Whether a step must fail is predicted here from the unsplit model: the *boundary signature* of a step is every
stage output's (shape, dtype, requires_grad) per microbatch.  ``static_shapes=False``: never.  ``True``: when it
differs from the first step of the same kind (step / eval).  ``None`` (auto): when the same input layout
(every microbatch's input shapes, dtypes, requires_grad and plain values, and the kind) ran before with another
boundary signature.  Results go to ``{out}/{case}-rank{R}.json``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import TensorDiffs  # noqa: E402
from harness import serve_job  # noqa: E402

D, V, F64 = 4, 11, torch.float64
DTYPES = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16}


class Stage(nn.Module):
    """One stage of a model of kind ``model`` (float64 parameters; the activations keep the batch's dtype):

    ``base``: ``tanh(lin(h)) * g`` (times ``scale``, plus ``bias``: keyword inputs, when given);
    ``ident``: stages ``ident`` (a list) return their input itself; ``tuple``: stages hand on ``(y, 2 y[..., :2])``,
    the last returns ``last_out`` (``dict``: ``{"y", "s"}``; ``tuple``: ``(y, y.sum(-1))``; ``str``: ``(y, "tag")``);
    ``slice``: stage 0 keeps ``T - 1`` positions of microbatches whose first element is negative (a data-dependent
    shape); ``detach``: stage 0 hands on a detached output for such microbatches; ``ids``: token ids (int64) go
    from stage to stage beside the activation, each stage adds its embedding of them; ``nontensor``: stage 0
    hands on ``(y, 3)``."""

    def __init__(self, s: int, ns: int, cfg: dict[str, Any]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(100 + s)
        self.s, self.last, self.model = s, s == ns - 1, cfg["model"]
        self.ident = s in cfg.get("ident", ())
        self.last_out = cfg.get("last_out", "dict")
        self.lin = nn.Linear(D, D, dtype=F64)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(D, D, generator=g, dtype=F64) * 0.5)
            self.lin.bias.copy_(torch.randn(D, generator=g, dtype=F64) * 0.1)
        self.g = nn.Parameter(1 + 0.1 * torch.randn(D, generator=g, dtype=F64))
        if self.model == "ids":
            self.emb = nn.Embedding(V, D, dtype=F64)
            with torch.no_grad():
                self.emb.weight.copy_(torch.randn(V, D, generator=g, dtype=F64) * 0.5)

    def forward(self, h: Any, *rest: Any, scale: Any = None, bias: Any = None, cast: Any = None) -> Any:
        if self.model == "ids":
            if self.s == 0:
                ids, e = h, self.emb(h)
            else:
                ids, e = h, rest[0] + self.emb(h)
            y = torch.tanh(self.lin(e)) * self.g
            return y if self.last else (ids, y)
        if self.ident:
            return h
        dt = h.dtype
        y = torch.tanh(self.lin(h.to(F64))) * self.g
        if rest and isinstance(rest[0], torch.Tensor):
            y = y + rest[0].to(F64).sum(-1, keepdim=True)
        if scale is not None:
            y = y * scale.to(F64)
        if bias is not None:
            y = y + bias.to(F64)
        y = y.to(dt if cast is None else cast)
        marked = self.s == 0 and bool(h.reshape(-1)[0] < 0)
        if self.model == "slice" and marked:
            y = y[:, :-1]
        if self.model == "detach" and marked:
            y = y.detach()
        if self.model == "nontensor" and self.s == 0:
            return y, 3
        if self.model == "tuple":
            if not self.last:
                return y, 2 * y[..., :2]
            if self.last_out == "dict":
                return {"y": y, "s": y.sum(-1)}
            if self.last_out == "tuple":
                return y, y.sum(-1)
            return y, "tag"
        return y


def loss_fn(out: Any, t: torch.Tensor) -> torch.Tensor:
    extra = None
    if isinstance(out, dict):
        out, extra = out["y"], out["s"]
    elif isinstance(out, (tuple, list)):
        out, extra = out[0], out[1] if isinstance(out[1], torch.Tensor) else None
    t = t[tuple(slice(0, n) for n in out.shape)]  # (the slice model's outputs may be shorter)
    loss = ((out.to(F64) - t.to(F64)) ** 2).mean()
    if extra is not None:
        loss = loss + 0.1 * (extra.to(F64) ** 2).mean()
    return loss


# ---------------------------------------------------------------- inputs of one op

def _rows_of(n_rows: int, n: int) -> list[int]:
    """The first row of each microbatch of ``n_rows`` rows cut in ``n`` (tensor_split)."""
    return [int(p[0]) for p in torch.tensor_split(torch.arange(n_rows), n)]


def make_inputs(op: dict[str, Any], n: int, model: str) -> dict[str, Any]:
    """The op's batch: ``x`` (a tensor or a list of microbatches), ``y``, keyword inputs, ``rg``."""
    g = torch.Generator().manual_seed(op.get("seed", 0))
    dt = DTYPES[op.get("dtype", "f64")]
    T = op.get("T")
    marks = op.get("marks", [0] * n)  # microbatches whose first element is made negative (slice/detach models)

    def one(rows: int, t: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (rows, D) if t is None else (rows, t, D)
        if model == "ids":
            x = torch.randint(0, V, shape[:-1], generator=g)
        else:
            x = (torch.randn(shape, generator=g, dtype=F64).abs() + 0.1).to(dt)
        return x, torch.randn(shape, generator=g, dtype=F64).to(dt if dt != torch.bfloat16 else F64)

    if "mbs" in op:  # Microbatches: (rows, T) per microbatch
        pairs = [one(r, t) for r, t in op["mbs"]]
        xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
        if model != "ids":
            for m, flag in enumerate(marks):
                if flag:
                    xs[m].view(-1)[0] = -xs[m].view(-1)[0]
        x: Any = xs
        y: Any = ys
    else:
        x, y = one(op["rows"], T)
        if model != "ids":
            for m, r in enumerate(_rows_of(op["rows"], n)):
                if marks[m]:
                    x[r].view(-1)[0] = -x[r].view(-1)[0]
    kw: dict[str, Any] = {}
    if op.get("scale"):  # a keyword tensor cut like the batch
        kw["scale"] = 1 + 0.1 * torch.randn(op["rows"], *(() if T is None else (T,)), D, generator=g, dtype=F64)
    if op.get("cast"):  # a non-tensor keyword input (a dtype) every stage casts its output to
        kw["cast"] = DTYPES[op["cast"]]
    if op.get("bias"):  # Replicate: one value for every microbatch, its shape (T, D) following the sequence
        kw["bias"] = 0.1 * torch.randn(*(() if T is None else (T,)), D, generator=g, dtype=F64)
    return {"x": x, "y": y, "kw": kw, "rg": bool(op.get("rg"))}


# ---------------------------------------------------------------- the unsplit model

class Ref:
    def __init__(self, cfg: dict[str, Any], ns: int) -> None:
        self.stages = [Stage(s, ns, cfg) for s in range(ns)]
        self.n = cfg["microbatches"]

    def run(self, inp: dict[str, Any], train: bool) -> dict[str, Any]:
        n = self.n
        x = inp["x"]
        leaf = None
        if isinstance(x, list):
            xs = x
            if inp["rg"]:
                xs = [t.detach().clone().requires_grad_(True) for t in xs]
                leaf = xs
        else:
            if inp["rg"]:
                leaf = x.detach().clone().requires_grad_(True)
                x = leaf
            xs = list(torch.tensor_split(x, n))
        ys = inp["y"] if isinstance(inp["y"], list) else list(torch.tensor_split(inp["y"], n))
        kws = [{} for _ in range(n)]
        for k, v in inp["kw"].items():
            parts = [v] * n if k in ("bias", "cast") else list(torch.tensor_split(v, n))
            for m in range(n):
                kws[m][k] = parts[m]
        outs, losses, bounds = [], [], []
        with torch.set_grad_enabled(train):
            for m in range(n):
                h: Any = (xs[m],)
                sig = []
                for st in self.stages:
                    o = st(*h, **kws[m])
                    if not st.last:
                        h = o if isinstance(o, tuple) else (o,)
                        sig.append(tuple((tuple(t.shape), str(t.dtype), t.requires_grad) if isinstance(t, torch.Tensor)
                                         else repr(t) for t in h))
                outs.append(o)
                losses.append(loss_fn(o, ys[m]))
                bounds.append(tuple(sig))
            if train:
                (torch.stack(losses).sum() / n).backward()
        xgrad = None
        if leaf is not None:
            xgrad = [t.grad for t in leaf] if isinstance(leaf, list) else leaf.grad
        return {"outs": outs, "losses": [v.detach() for v in losses], "bounds": tuple(bounds), "xgrad": xgrad}

    def zero(self) -> None:
        for st in self.stages:
            st.zero_grad(set_to_none=True)


def _layout(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), str(v.dtype), v.requires_grad)
    if isinstance(v, (list, tuple)):
        return tuple(_layout(t) for t in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _layout(t)) for k, t in v.items()))
    return repr(v)


def input_layout(inp: dict[str, Any], n: int, train: bool) -> Any:
    """What static_shapes=None keys its learned transfers by: every microbatch's inputs' layout, and the kind (and,
    beside it, the model's state: which stages are frozen)."""
    x = inp["x"]
    if not isinstance(x, list):
        x = list(torch.tensor_split(x.detach().requires_grad_(inp["rg"]) if inp["rg"] else x, n))
    elif inp["rg"]:
        x = [t.detach().requires_grad_(True) for t in x]
    return (train, tuple(("T", tuple(t.shape), str(t.dtype), inp["rg"]) for t in x), _layout(inp["y"] if isinstance(inp["y"], list) else
            list(torch.tensor_split(inp["y"], n))), _layout({k: (v if k in ("bias", "cast") else list(torch.tensor_split(v, n)))
                                                            for k, v in inp["kw"].items()}))


# ---------------------------------------------------------------- comparisons

class Compare(TensorDiffs):
    def output(self, what: str, got: Any, want: list[Any], precut: bool) -> None:
        """``got``: what the Pipeline returned; ``want``: the unsplit model's outputs by microbatch.  Microbatches
        in: Microbatches out; else merged as torch does (cat on dim 0, tuples position by position, dicts key by
        key, non-tensors listed)."""
        if precut:
            if not isinstance(got, list) or len(got) != len(want):
                self.diffs[what] = f"got {type(got).__name__}, want a list of {len(want)} microbatches' outputs"
                return
            for m, (a, b) in enumerate(zip(got, want)):
                self.value(f"{what}[{m}]", a, b)
            return
        self.merged(what, got, want)

    def merged(self, what: str, got: Any, want: list[Any]) -> None:
        if isinstance(want[0], torch.Tensor):
            if len({w.shape[1:] for w in want}) > 1:  # (torch.cat cannot join them: one per microbatch)
                self.output(what, got, want, True)
                return
            if not isinstance(got, torch.Tensor):
                self.diffs[what] = f"got {type(got).__name__}, want a tensor"
                return
            self.tensors(what, got, torch.cat(want))
        elif isinstance(want[0], tuple):
            if not isinstance(got, tuple) or len(got) != len(want[0]):
                self.diffs[what] = f"got {type(got).__name__}, want a tuple of {len(want[0])}"
                return
            for j in range(len(got)):
                self.merged(f"{what}[{j}]", got[j], [w[j] for w in want])
        elif isinstance(want[0], dict):
            if not isinstance(got, dict) or list(got) != list(want[0]):
                self.diffs[what] = f"got {got!r:.80}, want a dict of {list(want[0])}"
                return
            for k in got:
                self.merged(f"{what}.{k}", got[k], [w[k] for w in want])
        elif got != want:
            self.diffs[what] = f"got {got!r:.80}, want {want!r:.80}"

    def value(self, what: str, got: Any, want: Any) -> None:
        if isinstance(want, torch.Tensor):
            if not isinstance(got, torch.Tensor):
                self.diffs[what] = f"got {type(got).__name__}, want a tensor"
            else:
                self.tensors(what, got, want)
        elif isinstance(want, dict):
            if not isinstance(got, dict) or set(got) != set(want):
                self.diffs[what] = f"got {got!r:.80}, want a dict of {sorted(want)}"
                return
            for k in want:
                self.value(f"{what}.{k}", got[k], want[k])
        elif isinstance(want, tuple):
            if not isinstance(got, tuple) or len(got) != len(want):
                self.diffs[what] = f"got {type(got).__name__}, want a tuple of {len(want)}"
                return
            for j in range(len(want)):
                self.value(f"{what}[{j}]", got[j], want[j])
        elif got != want:
            self.diffs[what] = f"got {got!r:.80}, want {want!r:.80}"

    def grads(self, what: str, stages: dict[int, nn.Module], ref: Ref) -> None:
        for s, mod in stages.items():
            rp = dict(ref.stages[s].named_parameters())
            for name, p in mod.named_parameters():
                self.tensors(f"{what} grad s{s}.{name}", p.grad, rp[name].grad)


def predict(cfg: dict[str, Any], train: bool, layout: Any, bounds: Any, seen: OrderedDict[str, Any]) -> tuple[bool, bool]:
    """(whether this op must fail: static shapes meeting a transfer it did not learn; whether it runs on learned
    transfers, without headers), updating what is learned: ``static_shapes=True`` learns the first step of each kind,
    auto every new layout (the last 16 remembered, the oldest forgotten)."""
    mode = cfg.get("static")
    if mode is False:
        return False, False
    key = repr((train,) if mode is True else layout)
    learned = seen.get(key)
    if learned is None:
        seen[key] = bounds
        while len(seen) > 16:
            seen.popitem(last=False)
        return False, False
    seen.move_to_end(key)
    return learned != bounds, True


def run_case(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    import pipeloom
    from pipeloom.schedules import default_stages_per_rank

    spr = default_stages_per_rank(cfg["schedule"])
    ns = dist.get_world_size() * spr
    n = cfg["microbatches"]
    opts = pipeloom.RuntimeOptions(static_shapes=cfg.get("static"), heartbeat_timeout=5.0, stall_timeout=10.0,
                                   first_step_stall_timeout=20.0)
    fo = bool(cfg.get("forward_only"))
    pipe = pipeloom.Pipeline(lambda s: Stage(s, ns, cfg), schedule=cfg["schedule"], num_microbatches=n,
                             loss_fn=None if fo else loss_fn, forward_only=fo, stages_per_rank=spr, options=opts)
    ref = Ref(cfg, ns)
    cmp = Compare()
    errors: list[str] = []
    ops: list[dict[str, Any]] = []
    seen: OrderedDict[str, Any] = OrderedDict()
    try:
        for i, op in enumerate(cfg["script"]):
            train = op["op"] == "step"
            inp = make_inputs(op, n, cfg["model"])
            frozen = set(op.get("freeze", ()))  # stages whose parameters are all frozen for this op
            for stages in (dict(enumerate(ref.stages)), pipe.stages):
                for s, st in stages.items():
                    st.requires_grad_(s not in frozen)
            want = ref.run(inp, train)
            must_fail, learned = predict(cfg, train, (input_layout(inp, n, train), sorted(frozen)), want["bounds"], seen)
            x = inp["x"]
            precut = isinstance(x, list)
            if precut:
                x = [t.detach().clone().requires_grad_(inp["rg"]) for t in x]
                arg: Any = pipeloom.Microbatches(x)
                tgt: Any = pipeloom.Microbatches(inp["y"])
            else:
                x = x.detach().clone().requires_grad_(inp["rg"])
                arg, tgt = x, inp["y"]
            kw = {k: (pipeloom.Replicate(v) if k == "bias" else v) for k, v in inp["kw"].items()}
            ret = op.get("ret", True)
            losses: list[torch.Tensor] | None = [] if op.get("losses", True) else None
            rec: dict[str, Any] = {"i": i, "must_fail": must_fail, "learned": learned}
            ops.append(rec)
            t0 = time.monotonic()
            try:
                fn = pipe.step if train else pipe.eval
                out = fn(arg, target=None if fo else tgt, losses=losses, return_outputs=ret, **kw)
            except Exception as exc:  # noqa: BLE001 - the error is the result
                rec.update(error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - t0)
            else:
                rec["seconds"] = time.monotonic() - t0
                st = pipe.statistics
                rec["headerless"] = st.headerless_sends if st is not None else None
                rec["known"] = len(getattr(pipe._actor, "_known", ()))  # (static shapes: the layouts remembered)
            # (a rank whose step ended while a peer's failed after it, e.g. merging its outputs, must not go on
            # into last_loss's collective alone: the ranks agree on how the op went first)
            flags = [torch.zeros(1) for _ in range(dist.get_world_size())]
            dist.all_gather(flags, torch.tensor([float("error" in rec)]))
            if any(float(f) for f in flags):
                rec.setdefault("error", "(a peer failed this op)")
                break
            tag = f"op{i}:{op['op']}"
            if pipe.has_last_stage:
                if ret:
                    cmp.output(f"{tag} output", out, want["outs"], precut)
                elif out is not None:
                    cmp.diffs[f"{tag} output"] = f"return_outputs=False returned {type(out).__name__}"
                if losses is not None and not fo:
                    if len(losses) != n:
                        cmp.diffs[f"{tag} losses"] = f"{len(losses)} losses for {n} microbatches"
                    else:
                        cmp.tensors(f"{tag} losses", torch.stack([v.detach() for v in losses]), torch.stack(want["losses"]))
            elif out is not None:
                cmp.diffs[f"{tag} output"] = f"a rank without the last stage returned {type(out).__name__}"
            if not fo:
                ll = pipe.last_loss()
                cmp.tensors(f"{tag} last_loss", torch.tensor(ll, dtype=F64), torch.stack(want["losses"]).to(F64).mean())
            if train:
                cmp.grads(tag, pipe.stages, ref)
                if pipe.has_first_stage:
                    got_xg = [t.grad for t in x] if precut else x.grad
                    if precut:
                        for m, (a, b) in enumerate(zip(got_xg, want["xgrad"] or [None] * n)):
                            cmp.tensors(f"{tag} x.grad[{m}]", a, b)
                    else:
                        cmp.tensors(f"{tag} x.grad", got_xg, want["xgrad"])
            for st in pipe.stages.values():
                st.zero_grad(set_to_none=True)
            ref.zero()
    except Exception as exc:  # noqa: BLE001
        errors.append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}")
    finally:
        pipe.close()
    return {"diffs": cmp.diffs, "errors": errors, "ops": ops}


def main() -> None:
    # (hard_exit: a step that failed on purpose may leave gloo receives posted in its Pipeline's groups)
    serve_job(lambda cfg, job, rank: run_case(cfg, rank), empty={"ops": []}, hard_exit=True)


if __name__ == "__main__":
    main()
