"""Random-delay soak of the gloo tensor plane's default path (static shapes, direct waits).

Problem: on gloo, ``RuntimeOptions.static_shapes=None`` (auto, the default) runs a layout's
first step with transfer headers and every later step with the same layout without any: each
rank posts its peers' next payloads ahead and the loop thread waits in gloo itself for the one
its next action needs (``runtime/direct_wait.py``, ``runtime/actor.py``).  A pairing mistake on
that path (a payload taken by the wrong receive, a receive posted ahead that nobody fills, a
wait that never ends) shows only under some arrival orders, which the test suite's quiet runs
barely vary.  This script varies them: every stage's forward sleeps a random 0-3 ms (1 call in
20: 20-50 ms instead), seeded by (run, rank, step, call), so each run interleaves the ranks'
sends and receives differently, and checks every result exactly.

Alternatives: a pytest test would have to stay short and deterministic (the suite has a time
budget); delays injected into the transport itself would test a transport nobody runs.  Delays
in the model's forward are what a real job's uneven compute does to the runtime.

What one run is: ``--ranks`` real gloo rank processes (this script, started like
``tests/ranks/harness.py`` ``spawn_ranks``: own session each, killed as a group, SIGUSR1 stack
dump on a timeout), one schedule, one microbatch count, stages of Linear+tanh in float64
(``tests/ranks/models.py``), ``--steps`` training steps with SGD between them on the same
batch shape (so steps 2+ run headerless), default ``RuntimeOptions`` (or ``static_shapes=False``
with ``--control``).  The driver compares every parameter's gradient and every microbatch's loss
of every step with a full single-process backward of the unsplit model on the same microbatches
(``tests/ranks/reference.py``), at rtol 1e-10 / atol 1e-12, and checks that steps 2+ sent headerless
transfers (default path) or none (control).  Per run it records (one JSON line in ``--out``): the
config, ``ok`` / ``mismatch`` (param, max abs diff) / ``error`` (each rank's error text) /
``hang`` (ranks still running after ``--timeout``; their stacks are saved), the exit codes, the
headerless sends per step and the wall time; failing runs' stderr goes beside it.

Run (from the repository root; about 5-15 s a run on 2 loaded cores)::

    python benchmarks/soak_delays.py --rounds 3 --out /tmp/soak          # default path
    python benchmarks/soak_delays.py --rounds 1 --control --out /tmp/soak-ctl
    python benchmarks/soak_delays.py --only ZBVZeroBubble:2:8 --seed 17  # one config, one seed
    python benchmarks/soak_delays.py --vary-seq --steps 8 --out /tmp/soak-seq

A round is every schedule at 2 ranks with 4 and 8 microbatches (14 runs) plus 1F1B,
Interleaved1F1B, ZBVZeroBubble and DualPipeV at 4 ranks with 8 microbatches (4 runs); each run's
delays come from its own seed (``--seed`` + run index).  Variants: ``--vary-batch`` (the rows per
microbatch change between steps: new layouts after headerless steps, then remembered ones),
``--vary-seq`` (3-D microbatches, each its own sequence length, changing per step so that a new
layout shares some transfers' shapes with the previous one), ``--dispatch ready`` (a reordering
rule instead of the default ``auto``, which mostly keeps the list order).  A configuration may be
invalid (DualPipeV needs >= 2 microbatches per rank): it fails at construction, every rank exit 1.

Results (``benchmarks/RESULTS.md``, "Random-delay soak of gloo's static path (default)"), 2 shared
cores with test suites beside it: at 009d37b, 206 runs of valid configurations (108 default, 36
``--vary-batch``, 8 more 4-rank, 36 ``--dispatch ready``, 18 ``--control``) all exact, no hang, no
crash; ``--vary-seq`` failed 3 of 3 there (``TypeError: Block.forward() missing ... 'h'``: the
bug fixed in 621ecff).  At e9f2aba: 190 runs (90 default, 10 more 4-rank, 36 ``ready``,
18 ``--vary-batch``, 18 ``--vary-seq``, 18 ``--vary-seq --dispatch ready``) all exact; largest gradient
difference 5.55e-17.  At d1b79c9: 36 more (18 default, 18 ``--vary-seq --dispatch ready``), all exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RANKS_DIR = REPO / "tests" / "ranks"
__all__ = ["main"]
sys.path.insert(0, str(RANKS_DIR))

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
FOUR_RANK = ["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"]
RTOL, ATOL = 1e-10, 1e-12


# ------------------------------------------------------------------ rank side


def _rank_main(job_path: str) -> None:
    import torch
    import torch.distributed as dist
    from data import make_step_batches
    from harness import init_backend, install_stack_dump
    from models import Block, build_stages, loss_fn
    from pipeloom.schedules import default_stages_per_rank

    import pipeloom

    install_stack_dump()
    job = json.loads(Path(job_path).read_text())
    cfg = job["cfg"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    init_backend()

    state = {"step": 0, "call": 0}
    base_forward = Block.forward

    def slow_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        rng = random.Random(f"{cfg['seed']}:{rank}:{state['step']}:{state['call']}")
        state["call"] += 1
        delay = rng.uniform(0.0, 0.003)
        if rng.random() < 1 / 20:
            delay = rng.uniform(0.020, 0.050)
        time.sleep(delay)
        return base_forward(self, *args, **kwargs)

    Block.forward = slow_forward  # type: ignore[method-assign]
    num_stages = world * default_stages_per_rank(cfg["schedule"])
    all_stages = build_stages(num_stages, dim=cfg["dim"], multi=False, seed=0, dtype=torch.float64)
    extra = {"dispatch": cfg["dispatch"]} if cfg.get("dispatch") else {}
    opts = pipeloom.RuntimeOptions(static_shapes=False, **extra) if cfg["control"] else pipeloom.RuntimeOptions(**extra)
    res: dict[str, Any] = {"grads": [], "losses": [], "headerless": [], "out_of_order": [], "status": "ok"}
    out = Path(job["out"])
    try:
        pipe = pipeloom.Pipeline(lambda s: all_stages[s], schedule=cfg["schedule"], num_microbatches=cfg["microbatches"],
                                 loss_fn=loss_fn, options=opts)
        opt = torch.optim.SGD(pipe.parameters(), lr=cfg["lr"])
        for step in range(cfg["steps"]):
            state["step"], state["call"] = step, 0
            b = make_step_batches(cfg, step)
            for m in pipe.stages.values():
                m.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            if "x_mbs" in b:  # --vary-seq: microbatches of different lengths
                pipe.step(pipeloom.Microbatches(b["x_mbs"]), target=pipeloom.Microbatches(b["y_mbs"]), losses=losses)
            else:
                pipe.step(b["x"], target=b["target"], losses=losses)
            res["grads"].append({f"s{s}.{n}": (p.grad.detach().clone() if p.grad is not None else None)
                                 for s, m in pipe.stages.items() for n, p in m.named_parameters()})
            res["losses"].append([l.detach().clone() for l in losses])
            st = pipe.statistics
            res["headerless"].append(None if st is None else st.headerless_sends)
            res["out_of_order"].append(None if st is None else st.out_of_order)
            opt.step()
    except Exception as exc:
        res.update(status="error", error=f"{type(exc).__name__}: {exc}")
        torch.save(res, out / f"rank{rank}.pt")
        raise
    torch.save(res, out / f"rank{rank}.pt")
    pipe.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver side

_REFERENCE: dict[tuple, list[dict[str, Any]]] = {}


def _reference(cfg: dict[str, Any], num_stages: int) -> list[dict[str, Any]]:
    from reference import reference_run

    key = (num_stages, cfg["microbatches"], json.dumps(cfg["batch"]), json.dumps(cfg.get("seq")), cfg["dim"], cfg["steps"], cfg["lr"])
    if key not in _REFERENCE:
        _REFERENCE[key] = reference_run({**cfg, "seed": 0, "dtype": "float64"}, num_stages)
    return _REFERENCE[key]


def _compare(cfg: dict[str, Any], results: list[dict[str, Any]], num_stages: int) -> tuple[str, str]:
    """('ok' | 'mismatch', detail)."""
    import torch

    ref = _reference(cfg, num_stages)
    worst: tuple[float, str] = (0.0, "")
    bad: list[str] = []
    seen: set[str] = set()
    for r, res in enumerate(results):
        for step, (grads, losses) in enumerate(zip(res["grads"], res["losses"])):
            for name, g in grads.items():
                seen.add(name)
                want = ref[step]["grads"][name]
                if g is None:
                    bad.append(f"step {step} rank {r} {name}: no gradient")
                    continue
                diff = (g - want).abs().max().item()
                worst = max(worst, (diff, f"step {step} {name}"))
                if not torch.allclose(g, want, rtol=RTOL, atol=ATOL):
                    bad.append(f"step {step} rank {r} {name}: max abs diff {diff:.3e}")
            if losses:
                got, want = torch.stack(losses), torch.stack(ref[step]["losses"])
                if got.shape != want.shape or not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
                    bad.append(f"step {step} rank {r} losses: {got.tolist()} vs {want.tolist()}")
    missing = set(ref[0]["grads"]) - seen
    if missing:
        bad.append(f"no rank reported {sorted(missing)}")
    if not any(res["losses"] and res["losses"][0] for res in results):
        bad.append("no rank reported losses")
    heads = [res["headerless"] for res in results]
    # default path: a step runs headerless exactly when a step before it had the same batch shape
    batches = cfg["batch"] if isinstance(cfg["batch"], list) else [cfg["batch"]] * cfg["steps"]
    if cfg.get("seq"):
        batches = [(b, tuple(q)) for b, q in zip(batches, cfg["seq"])]
    want_static = [not cfg["control"] and b in batches[:i] for i, b in enumerate(batches)]
    for r, hs in enumerate(heads):
        got_static = [bool(h) for h in hs]
        if got_static != want_static:
            bad.append(f"rank {r}: headerless sends per step {hs}, expected some exactly in steps "
                       f"{[i for i, w in enumerate(want_static) if w]}")
    disorder = sum(x or 0 for res in results for x in res.get("out_of_order", []))
    if bad:
        return "mismatch", "; ".join(bad[:6]) + (f" (+{len(bad) - 6} more)" if len(bad) > 6 else "")
    return "ok", f"max abs diff {worst[0]:.2e} ({worst[1]}); out-of-order actions {disorder}; headerless per step {heads}"


async def _run_one(cfg: dict[str, Any], out: Path, timeout: float) -> dict[str, Any]:
    import torch
    from harness import RanksFailed, spawn_ranks
    from pipeloom.schedules import default_stages_per_rank

    run_dir = out / f"run{cfg['index']:04d}"
    run_dir.mkdir(parents=True, exist_ok=True)
    job = run_dir / "job.json"
    job.write_text(json.dumps({"cfg": cfg, "out": str(run_dir)}))
    world = cfg["ranks"]
    rec: dict[str, Any] = {**cfg}
    t0 = time.monotonic()
    try:
        codes, _, errs = await spawn_ranks(world, [str(Path(__file__).resolve()), "--rank-job", str(job)], timeout=timeout)
    except RanksFailed as exc:
        rec.update(result="hang", codes=exc.returncodes, time=round(time.monotonic() - t0, 2), detail=str(exc).splitlines()[0])
        (run_dir / "stderr.txt").write_text(str(exc))
        return rec
    rec.update(codes=codes, time=round(time.monotonic() - t0, 2))
    saved = [run_dir / f"rank{r}.pt" for r in range(world)]
    results = [torch.load(p, weights_only=False) if p.exists() else None for p in saved]
    if any(c != 0 for c in codes) or any(r is None or r["status"] != "ok" for r in results):
        texts = [("no result" if r is None else r.get("error", "ok")) for r in results]
        rec.update(result="error", detail=" | ".join(f"rank {i}: {t}" for i, t in enumerate(texts)))
        (run_dir / "stderr.txt").write_text("\n".join(f"--- rank {r} (exit {c}) ---\n{e[-8000:]}"
                                                      for r, (c, e) in enumerate(zip(codes, errs))))
        return rec
    result, detail = _compare(cfg, results, world * default_stages_per_rank(cfg["schedule"]))
    rec.update(result=result, detail=detail)
    if result == "ok":
        for p in saved:
            p.unlink()
    return rec


#: rows per microbatch, step by step, with --vary-batch: new layouts (headers) at steps 0 and 2, remembered ones after
VARY_ROWS = [2, 2, 3, 2, 3, 3, 2, 3]
#: with --vary-seq, step by step: each microbatch's sequence length (its own per microbatch); layouts B and C share
#: microbatch 0's length with A, so a transfer of a new layout can match one of the previous step's shapes
VARY_SEQ = ["A", "A", "B", "A", "C", "B", "C", "A"]


def _seq_layout(name: str, mbs: int) -> list[int]:
    return [{"A": 3 + m % 2, "B": 3 + 2 * (m % 2), "C": 3 + (m % 3)}[name] for m in range(mbs)]



def _plan(rounds: int, seed: int, control: bool, steps: int, only: str | None, vary: bool,
          dispatch: str | None = None, vary_seq: bool = False) -> list[dict[str, Any]]:
    configs: list[tuple[str, int, int]] = []
    if only:
        for item in only.split(","):
            name, ranks, mbs = item.split(":")
            configs.append((name, int(ranks), int(mbs)))
    else:
        configs = [(s, 2, m) for s in SCHEDULES for m in (4, 8)] + [(s, 4, 8) for s in FOUR_RANK]
    plan = []
    for rnd in range(rounds):
        for name, ranks, mbs in configs:
            i = len(plan)
            plan.append({"index": i, "schedule": name, "ranks": ranks, "microbatches": mbs, "seed": seed + i,
                         "control": control, "steps": steps, "dispatch": dispatch,
                         "batch": [VARY_ROWS[k % len(VARY_ROWS)] * mbs for k in range(steps)] if vary else 2 * mbs,
                         "dim": 8, "lr": 0.1,
                         **({"seq": [_seq_layout(VARY_SEQ[k % len(VARY_SEQ)], mbs) for k in range(steps)]} if vary_seq else {})})
    return plan


def main() -> None:
    if "--rank-job" in sys.argv:
        _rank_main(sys.argv[sys.argv.index("--rank-job") + 1])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1, help="times to run every configuration")
    ap.add_argument("--seed", type=int, default=0, help="delay seed of the first run (run i: seed + i)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per run before its ranks are dumped and killed")
    ap.add_argument("--control", action="store_true", help="static_shapes=False (the header protocol) instead of the default")
    ap.add_argument("--only", help="configurations SCHEDULE:RANKS:MICROBATCHES[,...] instead of the standard round")
    ap.add_argument("--vary-batch", action="store_true",
                    help="batch rows change between steps (2, 2, 3, 2, 3, 3, 2, 3 rows per microbatch): relearned and remembered layouts")
    ap.add_argument("--vary-seq", action="store_true",
                    help="3-D microbatches whose sequence lengths differ per microbatch and step (layouts A A B A C B C A)")
    ap.add_argument("--dispatch", choices=["auto", "ready", "critical", "guarded"], default=None,
                    help="RuntimeOptions.dispatch (default: the default, auto, which mostly keeps the list order; "
                         "ready/critical reorder around the delays)")
    ap.add_argument("--out", type=Path, default=Path("soak-out"))
    ap.add_argument("--deadline", type=float, default=None, help="stop starting runs after this many seconds")
    args = ap.parse_args()
    for k in [k for k in os.environ if k.startswith("PIPELOOM_")]:
        del os.environ[k]  # the ranks run the options this script gives, nothing from the caller's shell
    args.out.mkdir(parents=True, exist_ok=True)
    plan = _plan(args.rounds, args.seed, args.control, args.steps, args.only, args.vary_batch, args.dispatch, args.vary_seq)
    log = args.out / "runs.jsonl"
    t_start = time.monotonic()
    counts: dict[str, dict[str, int]] = {}
    for cfg in plan:
        if args.deadline is not None and time.monotonic() - t_start > args.deadline:
            print(f"deadline reached after {cfg['index']} runs", flush=True)
            break
        rec = asyncio.run(_run_one(cfg, args.out, args.timeout))
        with log.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        key = f"{cfg['schedule']}:{cfg['ranks']}:{cfg['microbatches']}"
        counts.setdefault(key, {}).setdefault(rec["result"], 0)
        counts[key][rec["result"]] += 1
        print(f"[{cfg['index']:4d}] {key:26s} seed {cfg['seed']:5d} {rec['result']:8s} {rec['time']:6.1f}s "
              f"codes {rec.get('codes')} {rec.get('detail', '')[:200]}", flush=True)
    print("\nper configuration:")
    for key, c in counts.items():
        print(f"  {key:26s} " + " ".join(f"{k} {v}" for k, v in sorted(c.items())))
    total: dict[str, int] = {}
    for c in counts.values():
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    print("total: " + " ".join(f"{k} {v}" for k, v in sorted(total.items())), flush=True)


if __name__ == "__main__":
    main()
