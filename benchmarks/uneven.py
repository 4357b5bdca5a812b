"""Uneven work: pipeloom's dispatch rule against its deterministic order and torch, with the simulator's prediction.

Issue 19's benchmark.  Two models:

* ``--model sleep`` (CPU, gloo; the default): ranks whose "compute" is host
  sleeps proportional to each microbatch's length (so the comparison holds
  on a small, loaded machine): a forward sleeps ``--f-ms x length``, the
  input-gradient half of a backward (I) as long, the weight-gradient half
  (W) as long (a custom autograd Function on the weight, so the zero-bubble
  split puts it in W), a full B both.  The length is ``rows / max_rows``.
* ``--model gpt`` (GPUs with ``--backend nccl``; on CPU only as a smoke
  test): the GPT of ``benchmarks/gpu_pipeline.py`` (token embedding on the
  first stage, RMSNorm and vocabulary head on the last, ``--size s|l|tiny``),
  one sequence length per microbatch (``length x --seq``).  A slow or
  jittered rank does *device* work: extra matmuls after each forward and in
  each backward (an autograd Function on the stage's output), sized from
  the stage's own measured time, so what is uneven is the GPU's work, not
  the host's.

Microbatches have their own shapes (``pipeloom.Microbatches``).  Workloads
(``--workloads``):

* ``fixed`` -- every microbatch at the longest length;
* ``uniform`` -- lengths uniform in 0.25..1 of the longest;
* ``bimodal`` -- 70% at a quarter, 30% at full length (packed short
  documents and a few long ones);
* ``longtail`` -- log-normal lengths, most short, a few long;
* ``slow-rank`` -- fixed lengths, rank 1 ``--slow`` x slower (a slow stage);
* ``jitter`` -- fixed lengths, rank 1's every action x (1 + ``--jitter``
  N(0,1)) (on GPUs only the slowdowns: extra work cannot make it faster).

Each step uses one of ``--draws`` length vectors (seeded, the same for every
engine).  Engines, all alive in the same processes, timed in alternating
blocks so drift hits them alike: pipeloom ``deterministic=True``, pipeloom
with each rule of ``--rules`` (default ``auto``, the default dispatch; the
rule it resolves to is shown; ``list`` there is the deterministic order
itself), and ``torch.distributed.pipelining``'s class of the same name; torch
needs one shape for every microbatch, so on uneven work it gets them padded
to the longest (its work follows the padded length: what padding costs).

The measured gain is the median over pairs of steps with the same lengths,
timed one right after the other, of deterministic / dynamic - 1 (ranks
averaged), with its quartiles: the spread is this machine's noise.  Next to
it the simulator (``pipeloom.schedules.simulate_policy``, the runtime's own
dispatch rules) on the same lengths:

* ``predicted`` -- the rule's gain over the static order with the costs the
  benchmark *sets* (sleep model: the sleeps, ``--overhead-ms`` per
  transfer, ``--notice-ms``; GPT: each stage's forward and backward time measured at full
  length before the run, scaled by length);
* ``recorded`` (``--record``, CPU) -- the same with the costs of a recorded
  run: one more deterministic pipeline traces one step per length vector,
  and every action's measured duration plus its rank's runtime time per
  action (``pipeloom.tools.run_costs``) is the simulator's cost; the
  transfer time and the notice delay (``simulate_policy``'s ``notice``: a
  CPU rank sees an arrival only between actions) are the medians measured
  in the same trace (``--repredict`` recomputes them from a run's traces);
* ``ceiling`` -- the best of the rules ``ready``/``critical``/``guarded``
  per draw against the static order with the same costs (recorded where
  there are): what the runtime's rules could take on this workload.

    python benchmarks/uneven.py [--ranks 2] [--schedules ...] [--workloads ...] [--rules auto] [--record] [--json FILE]
    python benchmarks/uneven.py --backend nccl --model gpt --size s ...     (GPUs 0..ranks-1)
    python benchmarks/uneven.py --table FILE.jsonl                          (a markdown table of the rows)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from _procs import stop_ranks  # benchmarks/ is on sys.path: scripts run from there

__all__ = ["main"]

ALL_SCHEDULES = "GPipe,1F1B,Interleaved1F1B,LoopedBFS,InterleavedZeroBubble,ZBVZeroBubble,DualPipeV"
ALL_WORKLOADS = "fixed,uniform,bimodal,longtail,slow-rank,jitter"
RULE_POLICY = {"list": "static", "ready": "dynamic", "critical": "critical", "guarded": "guarded"}
#: GPT sizes: (layers, hidden, heads, vocab, seq, microbatches, sequences per microbatch)
GPT_SIZES = {
    "tiny": (4, 64, 4, 256, 64, 8, 1),
    "s": (8, 1024, 8, 32000, 1024, 16, 2),
    "l": (16, 2048, 16, 32000, 1024, 16, 2),
}


def _lengths(workload: str, m: int, draws: int, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(draws):
        if workload == "uniform":
            out.append([rng.uniform(0.25, 1.0) for _ in range(m)])
        elif workload == "bimodal":
            out.append([1.0 if rng.random() < 0.3 else 0.25 for _ in range(m)])
        elif workload == "longtail":
            out.append([min(1.0, 0.1 + 0.15 * rng.lognormvariate(0.0, 0.9)) for _ in range(m)])
        else:
            out.append([1.0] * m)
    return out


def _factor(args: argparse.Namespace, workload: str, rank: int, step: int, stage: int, mb: int, kind: str) -> float:
    """The slowdown of one action of ``rank`` (1 unless ``rank`` is the slow or jittered one)."""
    if rank != 1:
        return 1.0
    if workload == "slow-rank":
        return args.slow
    if workload == "jitter":
        r = random.Random(f"{step}:{stage}:{mb}:{kind}")  # a str seed: the same in every process
        return max(1.0 if args.model == "gpt" else 0.1, 1.0 + args.jitter * r.gauss(0.0, 1.0))
    return 1.0


def _median_ci(xs: list[float]) -> tuple[float, float]:
    """A 95% confidence interval of the median of ``xs`` (order statistics, normal approximation)."""
    v = sorted(xs)
    n = len(v)
    if n < 6:
        return v[0], v[-1]
    k = max(0, int((n - 1.96 * n ** 0.5) / 2))
    return v[k], v[min(n - 1, n - 1 - k)]


def _quant(x: float, unit: int) -> float:
    """A length as the benchmark realises it (``unit`` rows or tokens per full length)."""
    return max(1, round(x * unit)) / unit


def _unit(args: argparse.Namespace) -> int:
    return args.seq if args.model == "gpt" else args.max_rows


# ------------------------------------------------------------ the simulator's side
def _nominal_durations(args: argparse.Namespace, sched: Any, workload: str, vec: list[float], step: int,
                       stage_ms: dict[int, tuple[float, float]]) -> dict[tuple[int, str, int], float]:
    """Leaf durations (ms) as the benchmark sets them: sleeps, or measured full-length stage times x length."""
    from pipeloom.schedules.policy_sim import _compute_lists

    place = sched.stage_to_rank
    out: dict[tuple[int, str, int], float] = {}
    unit = _unit(args)
    for acts in _compute_lists(sched).values():
        for a in acts:
            for x in a.leaves():
                s, t, m = x.stage, x.type.value, x.microbatch
                ln = _quant(vec[m], unit)
                fac = lambda k: _factor(args, workload, place[s], step, s, m, k)  # noqa: E731
                if args.model == "sleep":
                    f = args.f_ms * ln
                    out[(s, t, m)] = {"F": f * fac("F"), "I": f * fac("I"), "W": f * fac("W"),
                                      "B": f * fac("I") + f * fac("W")}[t]
                else:  # GPT: extra device work after F and in the backward (the I half under a split)
                    f, b = stage_ms[s]
                    out[(s, t, m)] = {"F": f * ln * fac("F"), "B": b * ln * fac("B"),
                                      "I": b * ln / 2 + b * ln * (fac("B") - 1.0), "W": b * ln / 2}[t]
    return out


def _gains(sched: Any, steps: list[dict[tuple[int, str, int], float]], transfer: float, notice: float = 0.0,
           sends: str = "in_turn") -> dict[str, float]:
    """Gain over the static order per rule, and ``ceiling`` (each step's best rule), over the same steps."""
    from pipeloom.schedules import simulate_policy

    tot = dict.fromkeys(["static", "ready", "critical", "guarded", "ceiling"], 0.0)
    for durs in steps:
        sim = lambda p: simulate_policy(sched, p, durs, transfer=transfer, notice=notice, sends=sends).makespan  # noqa: E731
        got = {r: sim(RULE_POLICY[r]) for r in ("ready", "critical", "guarded")}
        tot["static"] += sim("static")
        for r, v in got.items():
            tot[r] += v
        tot["ceiling"] += min(got.values())
    out = {r: tot["static"] / v - 1.0 for r, v in tot.items() if r != "static" and v > 0}
    out["list"] = 0.0
    out["A/A"] = 0.0  # (the A/A control: the same order)
    return out


def _recorded_durations(paths: list[str]) -> tuple[dict[int, dict[tuple[int, str, int], float]], float, float]:
    """From a traced deterministic run: per step, every leaf's measured duration plus its rank's runtime
    time per action (ms); the transfer time (ms) and the notice delay (ms) for :func:`simulate_policy`.

    Transfer: the median time from a send's end to the data being there, over transfers that
    landed while their receiver was idle (waiting for them).  Notice: the median time from the end
    of the receiver's action to the data being there, over transfers that landed while it was busy
    (a CPU rank reads announcements and completes receives between actions).  Medians: the tail is
    the receiver busy with yet another action, which the simulator plays out itself."""
    import bisect

    from pipeloom.tools.run_costs import costs_from_trace
    from pipeloom.tools.trace_model import _leaves, load_trace

    model = load_trace(paths)
    rc = costs_from_trace(model, skip_warmup=0)
    over = rc.overhead_per_action_ns
    steps: dict[int, dict[tuple[int, str, int], float]] = {}
    for r, spans in model.actions.items():
        for sp in spans:
            if sp.type not in ("F", "B", "I", "W", "OVERLAP_F_B"):
                continue
            d = (sp.duration + over.get(r, 0.0)) / 1e6
            for s, t, m in _leaves(sp):
                if s is not None and m is not None:
                    steps.setdefault(sp.step, {})[(s, t, m)] = d
    acts = {r: sorted(v, key=lambda a: a.start) for r, v in model.actions.items()}
    starts = {r: [a.start for a in v] for r, v in acts.items()}
    idle, busy = [], []
    for send, recv in model.transfer_pairs():
        r, t = recv.rank, send.end
        i = bisect.bisect_right(starts.get(r, []), t) - 1
        if i >= 0 and acts[r][i].end > t:
            busy.append((recv.end - acts[r][i].end) / 1e6)
        else:
            idle.append((recv.end - send.end) / 1e6)
    transfer = statistics.median(idle) if idle else rc.costs.send_latency / 1e6
    notice = statistics.median(busy) if busy else 0.0
    return steps, max(0.0, transfer), max(0.0, notice)


def _recorded_gains(sched: Any, paths: list[str], rec_steps: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """Per workload, :func:`_gains` with the costs of the traced steps ``rec_steps[workload]``."""
    per_step, xfer, notice = _recorded_durations(paths)
    out = {}
    for wl, lst in rec_steps.items():
        steps = [per_step[st] for st in lst if st in per_step]
        if steps:
            out[wl] = _gains(sched, steps, xfer, notice)
            out[wl]["transfer_ms"], out[wl]["notice_ms"] = xfer, notice
    return out


def sends_table(json_path: str) -> str:
    """For the rows of a sleep-model run: the measured gain beside the nominal prediction under each send model."""
    from pipeloom.schedules import generate

    lines = ["| ranks | schedule | workload | rule | measured gain | median's 95% CI | predicted: free | in_turn | held |",
             "|---|---|---|---|---|---|---|---|---|"]
    for line in open(json_path):
        r = json.loads(line)
        if r.get("model") != "sleep" or r.get("rule") == "list":
            continue
        args = _parse(["--ranks", str(r["ranks"]), "--f-ms", str(r["f_ms"]), "--draws", str(r.get("draws", 4)),
                       "--backend", r.get("backend", "gloo")])
        sched = generate(r["schedule"], num_ranks=r["ranks"], num_microbatches=r["microbatches"])
        vectors = _lengths(r["workload"], r["microbatches"], args.draws, args.seed)
        nominal = [_nominal_durations(args, sched, r["workload"], vectors[i % len(vectors)], i, {}) for i in range(r["steps"])]
        got = {s: _gains(sched, nominal, args.overhead_ms, args.notice_ms, s)[r["rule"]] for s in ("free", "in_turn", "held")}
        lo, hi = r["gain_ci"]
        lines.append(f"| {r['ranks']} | {r['schedule']} | {r['workload']} | {r['rule']} | {r['gain']:+.1%} | [{lo:+.1%}, {hi:+.1%}] | "
                     f"{got['free']:+.1%} | {got['in_turn']:+.1%} | {got['held']:+.1%} |")
    return "\n".join(lines)


def repredict(json_path: str, trace_dir: str) -> list[dict[str, Any]]:
    """The rows of a ``--record`` run again, ``recorded`` and ``ceiling`` recomputed from its traces
    (``trace_dir``: the run's ``--record-dir``): for when the simulator changed after the run."""
    from pipeloom.schedules import generate

    rows = [json.loads(line) for line in open(json_path) if line.strip()]
    by: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["schedule"], r["ranks"]), []).append(r)
    for (name, world), rs in by.items():
        workloads = list(dict.fromkeys(r["workload"] for r in rs))
        draws = rs[0]["draws"]
        # the traced steps: per workload (in the run's order) one warm-up, then one per length vector
        rec_steps = {wl: [j * (draws + 1) + k for k in range(1, draws + 1)] for j, wl in enumerate(workloads)}
        paths = [os.path.join(trace_dir, f"{name}.jsonl.rank{r}") for r in range(world)]
        sched = generate(name, num_ranks=world, num_microbatches=rs[0]["microbatches"])
        got = _recorded_gains(sched, paths, rec_steps)
        for r in rs:
            g = got.get(r["workload"])
            if g is not None:
                r["recorded"], r["ceiling"] = round(g[r["rule"]], 4), round(g["ceiling"], 4)
                r["transfer_ms"], r["notice_ms"] = round(g["transfer_ms"], 3), round(g["notice_ms"], 3)
    return rows


# ------------------------------------------------------------ the ranks
def _rank_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F

    import pipeloom
    from pipeloom.runtime.options import RuntimeOptions
    from pipeloom.schedules import default_stages_per_rank, generate

    torch.set_num_threads(1)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.backend == "nccl":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    cuda = dev.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    state: dict[str, Any] = {"workload": "fixed", "step": 0}
    gpt = args.model == "gpt"
    dtype = torch.bfloat16 if cuda else torch.float32

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def reduce(vals: list[float], op: Any = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(vals, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def factor(stage: int, mb: int, kind: str) -> float:
        return _factor(args, state["workload"], rank, state["step"], stage, mb, kind)

    # ---- the sleep model
    class SleepGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor, ms: float) -> torch.Tensor:
            ctx.ms = ms
            return t.view_as(t)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
            time.sleep(ctx.ms / 1e3)
            return g, None

    class SleepStage(nn.Module):
        def __init__(self, s: int) -> None:
            super().__init__()
            self.s = s
            self.lin = nn.Linear(args.dim, args.dim)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mb = self.calls
            self.calls += 1
            length = x.shape[0] / args.max_rows
            time.sleep(args.f_ms * length * factor(self.s, mb, "F") / 1e3)
            w = SleepGrad.apply(self.lin.weight, args.f_ms * length * factor(self.s, mb, "W"))
            y = torch.tanh(F.linear(x, w, self.lin.bias))
            if y.requires_grad:
                ms = args.f_ms * length * factor(self.s, mb, "I")
                y.register_hook(lambda g, ms=ms: (time.sleep(ms / 1e3), g)[1])
            return y

    # ---- the GPT: extra device work on the slow / jittered rank
    burn_a = torch.randn(args.burn_dim, args.burn_dim, device=dev, dtype=dtype)
    burn_c = torch.empty_like(burn_a)

    def burn(n: int) -> None:
        for _ in range(n):
            torch.mm(burn_a, burn_a, out=burn_c)

    class Burn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, y: torch.Tensor, nf: int, nb: int) -> torch.Tensor:
            ctx.nb = nb
            burn(nf)
            return y.clone()  # (a view of the input breaks torch's zero-bubble backward-input)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            burn(ctx.nb)
            return g, None, None

    stage_ms: dict[int, tuple[float, float]] = {}  # stage -> (F, B) ms at full length, every rank's
    unit_ms = [1.0]  # one burn matmul

    class GptStage(nn.Module):
        def __init__(self, s: int, inner: nn.Module) -> None:
            super().__init__()
            self.s = s
            self.inner = inner
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mb = self.calls
            self.calls += 1
            y = self.inner(x)
            ff, fb = factor(self.s, mb, "F"), factor(self.s, mb, "B")
            if ff > 1.0 or fb > 1.0:
                ln = x.shape[1] / args.seq
                f, b = stage_ms[self.s]
                y = Burn.apply(y, round((ff - 1.0) * f * ln / unit_ms[0]), round((fb - 1.0) * b * ln / unit_ms[0]))
            return y

    def gpt_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float().flatten(0, -2), target.flatten())

    def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target)

    loss_fn = gpt_loss if gpt else mse_loss

    def clock(fn: Any, reps: int = 3) -> float:
        """ms of ``fn`` (the least of ``reps`` after one warm-up)."""
        fn()
        best = float("inf")
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, (time.perf_counter() - t0) * 1e3)
        return best

    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    gpt_cfg = argparse.Namespace(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab)
    if gpt:
        from gpu_pipeline import _gpt_model  # benchmarks/ is on sys.path

    results: list[dict[str, Any]] = []
    unit = _unit(args)
    shared = [args.record_dir or (tempfile.mkdtemp(prefix="uneven-") if rank == 0 else None)]
    dist.broadcast_object_list(shared, src=0)  # every rank's trace file in one folder
    tmp = shared[0]
    os.makedirs(tmp, exist_ok=True)
    for name in args.schedules.split(","):
        spr = default_stages_per_rank(name)
        S = world * spr
        m = args.microbatches
        sched = generate(name, num_ranks=world, num_microbatches=m)
        place = sched.stage_to_rank
        mine = [s for s in range(S) if place[s] == rank]
        built: dict[str, list[Any]] = {}
        inner: dict[int, Any] = {}
        if gpt:  # one model, shared by the engines (each wraps it with its own microbatch counter)
            inner = {s: _gpt_model(gpt_cfg, S, s, device=dev, dtype=dtype) for s in mine}
            mbs = args.mbsize

            def probe(s: int, backward: bool) -> None:
                if s == 0:
                    x = torch.randint(0, args.vocab, (mbs, args.seq), device=dev)
                else:
                    x = torch.randn(mbs, args.seq, args.hidden, device=dev, dtype=dtype, requires_grad=True)
                out = inner[s](x)
                if backward:
                    if s == S - 1:
                        gpt_loss(out, torch.zeros(out.shape[:-1], dtype=torch.long, device=dev)).backward()
                    else:
                        out.backward(torch.ones_like(out))

            mine_ms = {}
            for s in mine:
                f = clock(lambda s=s: probe(s, False))
                fb = clock(lambda s=s: probe(s, True))
                mine_ms[s] = (f, max(fb - f, 1e-3))
                inner[s].zero_grad(set_to_none=True)
            unit_ms[0] = max(clock(lambda: burn(20)) / 20, 1e-4)
            allms: list[Any] = [None] * world
            dist.all_gather_object(allms, mine_ms)
            stage_ms.clear()
            for d in allms:
                stage_ms.update(d)

        def make(tag: str) -> Any:
            def fn(s: int) -> nn.Module:
                if gpt:
                    st: nn.Module = GptStage(s, inner[s])
                else:
                    torch.manual_seed(s)
                    st = SleepStage(s)
                built.setdefault(tag, []).append(st)
                return st
            return fn

        pipes: dict[str, Any] = {"det": pipeloom.Pipeline(make("det"), schedule=name, num_microbatches=m, loss_fn=loss_fn, deterministic=True)}
        rules: dict[str, str] = {}
        for r in args.rules.split(","):
            if r == "aa":  # the A/A control: a second deterministic pipeline, the noise floor of the comparison
                pipes[r] = pipeloom.Pipeline(make(r), schedule=name, num_microbatches=m, loss_fn=loss_fn, deterministic=True)
                rules[r] = "A/A"
                continue
            pipes[r] = pipeloom.Pipeline(make(r), schedule=name, num_microbatches=m, loss_fn=loss_fn,
                                         options=RuntimeOptions.from_env(dispatch=r))
            rules[r] = pipes[r]._actor.dispatch_rule if hasattr(pipes[r], "_actor") else "?"
        rec = None
        if args.record:
            rec_path = os.path.join(tmp, f"{name}.jsonl")
            rec = pipeloom.Pipeline(make("rec"), schedule=name, num_microbatches=m, loss_fn=loss_fn, deterministic=True,
                                    trace=rec_path)
        # torch: its own stages, placed as pipeloom places them
        t_stages = {s: make("torch")(s) for s in mine}
        t_sched = None
        try:
            if args.no_torch:
                raise RuntimeError("--no-torch")
            cls = get_schedule_class(name)
            if gpt:
                def ex(s: int, out: bool) -> torch.Tensor:
                    if s == 0 and not out:
                        return torch.zeros(args.mbsize, args.seq, dtype=torch.long, device=dev)
                    width = args.vocab if (out and s == S - 1) else args.hidden
                    return torch.empty(args.mbsize, args.seq, width, device=dev, dtype=dtype, requires_grad=out or s != 0)

                pst = [PipelineStage(t_stages[s], s, S, dev, input_args=(ex(s, False),), output_args=(ex(s, True),)) for s in mine]
            else:
                pst = [PipelineStage(t_stages[s], s, S, dev) for s in mine]
            single = issubclass(cls, PipelineScheduleSingle)
            t_sched = cls(pst[0] if single else pst, m, loss_fn=loss_fn)
        except Exception as exc:  # a schedule torch does not build this way: reported, not fatal
            if rank == 0 and not args.no_torch:
                print(f"uneven.py: torch {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
        rec_steps: dict[str, list[int]] = {}  # workload -> its traced steps
        rec_count = 0
        pending_rows: list[dict[str, Any]] = []
        for workload in args.workloads.split(","):
            state["workload"] = workload
            vectors = _lengths(workload, m, args.draws, args.seed)
            gen = torch.Generator().manual_seed(1)
            batches = []
            for vec in vectors:
                sizes = [max(1, round(x * unit)) for x in vec]
                if gpt:
                    xs = [torch.randint(0, args.vocab, (args.mbsize, t), generator=gen).to(dev) for t in sizes]
                    ys = [torch.randint(0, args.vocab, (args.mbsize, t), generator=gen).to(dev) for t in sizes]
                    xp = torch.cat([F.pad(x, (0, unit - x.shape[1])) for x in xs])
                    yp = torch.cat([F.pad(y, (0, unit - y.shape[1])) for y in ys])
                else:
                    xs = [torch.randn(r, args.dim, generator=gen) for r in sizes]
                    ys = [torch.randn(r, args.dim, generator=gen) for r in sizes]
                    xp = torch.cat([torch.cat([x, x.new_zeros(unit - x.shape[0], args.dim)]) for x in xs])
                    yp = torch.cat([torch.cat([y, y.new_zeros(unit - y.shape[0], args.dim)]) for y in ys])
                batches.append((xs, ys, xp, yp))
            reordered: dict[str, list[int]] = {r: [] for r in rules}  # this rank's actions run out of list order, per step

            def run(engine: str, i: int) -> None:
                xs, ys, xp, yp = batches[i % len(batches)]
                state["step"] = i
                for st in built.get(engine, []):
                    st.calls = 0
                if engine == "torch":
                    for s in mine:
                        t_stages[s].zero_grad(set_to_none=True)
                    t_sched.step(*((xp,) if 0 in mine else ()), target=yp if S - 1 in mine else None)  # type: ignore[union-attr]
                    return
                pipe = rec if engine == "rec" else pipes[engine]
                for mod in pipe.stages.values():
                    mod.zero_grad(set_to_none=True)
                pipe.step(pipeloom.Microbatches(xs), target=pipeloom.Microbatches(ys))
                if engine in reordered and pipe.statistics is not None:
                    reordered[engine].append(pipe.statistics.out_of_order)

            engines = ["det", *rules] + (["torch"] if t_sched is not None else [])
            times: dict[str, list[float]] = {e: [] for e in engines}
            per_block = max(1, args.steps // args.blocks)

            def timed(e: str, i: int) -> None:
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                run(e, i)
                sync()
                times[e].append(time.perf_counter() - t0)

            # pipeloom's orders alternate in blocks (drift hits them alike); torch after them,
            # on its own (its transfers share the default group with pipeloom's)
            ours = ["det", *rules]
            for e in ours:
                for i in range(args.warmup):
                    dist.barrier()
                    run(e, i)
            for b in range(args.blocks):
                order = ours if b % 2 == 0 else ours[::-1]
                for e in order:
                    for i in range(per_block):
                        timed(e, b * per_block + i)
            if "torch" in engines:
                sync()
                dist.barrier()
                for i in range(args.warmup):
                    dist.barrier()
                    run("torch", i)
                for i in range(max(2, per_block * args.blocks // 2)):
                    timed("torch", i)
            if rec is not None:  # one traced deterministic step per length vector (after one untraced-in-effect warm-up)
                for k in range(len(vectors) + 1):
                    dist.barrier()
                    run("rec", k % len(vectors))
                    if k:
                        rec_steps.setdefault(workload, []).append(rec_count)
                    rec_count += 1
            meds = {e: reduce([statistics.median(times[e])], dist.ReduceOp.MAX)[0] * 1e3 for e in engines}
            for r, rule in rules.items():
                # the gain from pairs of steps with the same lengths, timed next to each other
                # (median of det/dyn - 1); its spread (quartiles) is the noise of this machine
                pair = reduce([a / b for a, b in zip(times["det"], times[r])])
                pair = sorted(x / world for x in pair)
                q = statistics.quantiles(pair, n=4) if len(pair) >= 2 else [pair[0]] * 3
                lo, hi = _median_ci(pair)
                ooo = reduce([float(sum(reordered[r])) / max(1, len(reordered[r]))])[0]
                row = {"schedule": name, "workload": workload, "ranks": world, "microbatches": m, "option": r, "rule": rule,
                       "model": args.model if not gpt else f"gpt-{args.size}", "backend": args.backend,
                       "reordered_per_step": round(ooo, 2),
                       "det_ms": round(meds["det"], 2), "dyn_ms": round(meds[r], 2),
                       "torch_ms": round(meds["torch"], 2) if "torch" in meds else None,
                       "gain": round(q[1] - 1.0, 4), "gain_q1": round(q[0] - 1.0, 4), "gain_q3": round(q[2] - 1.0, 4),
                       "gain_ci": [round(lo - 1.0, 4), round(hi - 1.0, 4)], "pairs": len(pair)}
                if rank == 0:
                    nominal = [_nominal_durations(args, sched, workload, vectors[i % len(vectors)], i, stage_ms)
                               for i in range(len(vectors))]
                    g = _gains(sched, nominal, args.overhead_ms, args.notice_ms, args.sends)
                    row["predicted"] = round(g[rule], 4)
                    row["ceiling_nominal"] = round(g["ceiling"], 4)
                    row["ceiling"] = row["ceiling_nominal"]
                pending_rows.append(row)
        dist.barrier()
        for p in pipes.values():
            p.close()
        if rec is not None:
            rec.close()
        dist.barrier()
        if rank == 0:
            recorded: dict[str, dict[str, float]] = {}
            if rec is not None:
                try:
                    recorded = _recorded_gains(sched, [f"{rec_path}.rank{r}" for r in range(world)], rec_steps)
                except Exception as exc:  # noqa: BLE001 - a prediction left out, not the measurement
                    print(f"uneven.py: {name}: recorded costs: {type(exc).__name__}: {exc}", file=sys.stderr)
            for row in pending_rows:
                g = recorded.get(row["workload"])
                if g is not None:
                    row["recorded"] = round(g[row["rule"]], 4)
                    row["ceiling"] = round(g["ceiling"], 4)
                    row["transfer_ms"], row["notice_ms"] = round(g["transfer_ms"], 3), round(g["notice_ms"], 3)
                print(f"{name:22} {row['workload']:9} {row['option']}->{row['rule']:8} det {row['det_ms']:8.1f} dyn {row['dyn_ms']:8.1f} "
                      f"torch {row['torch_ms'] if row['torch_ms'] is not None else '-':>8} gain {row['gain']:+.1%} "
                      f"[{row['gain_q1']:+.1%}, {row['gain_q3']:+.1%}] median CI [{row['gain_ci'][0]:+.1%}, {row['gain_ci'][1]:+.1%}] "
                      f"predicted {row['predicted']:+.1%}"
                      + (f" recorded {row['recorded']:+.1%}" if "recorded" in row else "")
                      + f" ceiling {row['ceiling']:+.1%} reordered/step {row['reordered_per_step']}", flush=True)
                if args.json:
                    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
                    with open(args.json, "a") as f:
                        f.write(json.dumps({**row, "f_ms": args.f_ms if not gpt else None, "steps": args.steps, "draws": args.draws,
                                            "torch": torch.__version__, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
                                            "date": date}) + "\n")
        results += pending_rows
        del pipes, rec, t_sched, inner
        if cuda:
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def table(path: str) -> str:
    """The rows of a ``--json`` file as a markdown table."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    pct = lambda v: "-" if v is None else f"{v:+.1%}"  # noqa: E731
    out = ["| ranks | schedule | workload | rule | det ms | dyn ms | torch ms | measured gain [quartiles] | median's 95% CI | predicted | recorded | ceiling | reordered |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = r.get("gain_ci")
        out.append(f"| {r['ranks']} | {r['schedule']} | {r['workload']} | {r['rule']} | {r['det_ms']:.1f} | {r['dyn_ms']:.1f} | "
                   f"{r['torch_ms'] if r.get('torch_ms') is not None else '-'} | {pct(r['gain'])} [{pct(r['gain_q1'])}, {pct(r['gain_q3'])}] | "
                   f"{'[' + pct(ci[0]) + ', ' + pct(ci[1]) + ']' if ci else '-'} | "
                   f"{pct(r.get('predicted'))} | {pct(r.get('recorded'))} | {pct(r.get('ceiling'))} | {r.get('reordered_per_step')} |")
    return "\n".join(out)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--model", default="sleep", choices=("sleep", "gpt"))
    ap.add_argument("--size", default="s", choices=sorted(GPT_SIZES), help="GPT size (layers, hidden, heads, vocab, seq, microbatches, sequences)")
    ap.add_argument("--schedules", default=ALL_SCHEDULES)
    ap.add_argument("--workloads", default=ALL_WORKLOADS)
    ap.add_argument("--rules", default="auto", help="dispatch options measured against deterministic (auto, ready, critical, guarded; "
                    "aa: a second deterministic pipeline, the A/A control whose 'gain' is the comparison's own bias and noise)")
    ap.add_argument("--microbatches", type=int, default=None, help="default: 8 (sleep), the size's (gpt)")
    ap.add_argument("--f-ms", type=float, default=8.0, help="sleep model: forward sleep of a full-length microbatch (I and W as long)")
    ap.add_argument("--max-rows", type=int, default=32)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--seq", type=int, default=None, help="GPT: the longest sequence (default: the size's)")
    ap.add_argument("--burn-dim", type=int, default=None, help="GPT: matmul size of the extra work (default 4096 on GPUs, 32 on CPU)")
    ap.add_argument("--slow", type=float, default=1.5)
    ap.add_argument("--jitter", type=float, default=0.3)
    ap.add_argument("--draws", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=12, help="alternations of the pipeloom engines (steps / blocks each)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overhead-ms", type=float, default=0.4, help="the simulator's transfer time for `predicted` (ms)")
    ap.add_argument("--sends", choices=("in_turn", "held", "free"), default="in_turn",
                    help="the simulator's send model for `predicted` (simulate_policy's sends; in_turn: the runtime "
                         "with static shapes, the default; free: static_shapes=False)")
    ap.add_argument("--notice-ms", type=float, default=None,
                    help="the simulator's notice delay for `predicted` (ms; default 0.4 on gloo, 0 on NCCL: simulate_policy's notice)")
    ap.add_argument("--repredict", default=None, metavar="JSONL", help="recompute `recorded` of a --record run's rows from its "
                    "traces (--record-dir) and print the table")
    ap.add_argument("--sends-table", default=None, metavar="JSONL",
                    help="print a sleep-model run's measured gains beside the predictions under each send model, and exit")
    ap.add_argument("--record", action="store_true", help="also predict with the costs of a traced deterministic run (CPU)")
    ap.add_argument("--record-dir", default=None)
    ap.add_argument("--no-torch", action="store_true", help="leave torch.distributed.pipelining out")
    ap.add_argument("--json", default=None)
    ap.add_argument("--table", default=None, help="print the markdown table of a --json file and exit")
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args(argv)
    layers, hidden, heads, vocab, seq, mbs, per = GPT_SIZES[args.size]
    args.layers, args.hidden, args.heads, args.vocab, args.mbsize = layers, hidden, heads, vocab, per
    if args.seq is None:
        args.seq = seq
    if args.microbatches is None:
        args.microbatches = mbs if args.model == "gpt" else 8
    if args.notice_ms is None:
        args.notice_ms = 0.4 if args.backend == "gloo" else 0.0
    if args.burn_dim is None:
        args.burn_dim = 4096 if args.backend == "nccl" else 32
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.table:
        print(table(args.table))
        return 0
    if args.sends_table:
        print(sends_table(args.sends_table))
        return 0
    if args.repredict:
        if not args.record_dir:
            raise SystemExit("--repredict needs --record-dir (the run's traces)")
        rows = repredict(args.repredict, args.record_dir)
        if args.json:
            with open(args.json, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            print(table(args.json))
        return 0
    if "RANK" in os.environ:
        return _rank_main(args)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(args.ranks):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.ranks), LOCAL_WORLD_SIZE=str(args.ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])], env=env))
    deadline = time.monotonic() + args.timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
            stop_ranks(procs)
            return 1
        time.sleep(0.2)
    return 0 if all(p.returncode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
