"""Host-overlapped backwards in the simulator against the GPU runs that measured them (issue 13, session J).

Problem.  The runtime launches a full backward on a worker thread beside the forwards after it
(``RuntimeOptions.host_overlap_backward``, auto on GPUs).  The tuner's two-lane model
(``schedules/simulate.py``) had no such lane, so on host-bound GPU configurations it predicted the
inline step, ~25% too slow.  ``simulate(host_overlap_backward=..., overlap_contention=...)`` models it;
this script checks that model against the measured overlap/inline ratios and fits its one free
parameter, the contention of the two host threads.

What it does.  For every pair of rows (same file, schedule and model) of ``gpu_pipeline.py`` where engine
``pipeloom`` ran with the overlap (auto) and ``pipeloom-x`` with ``host_overlap_backward=false`` (inline), it
simulates the row's configuration (schedule, microbatches, GPUs as ranks, lowered as the tuner lowers it,
each stage on its own stream, the row's commit horizon) with each stage's learned costs (``overlapped_by_rank``:
F/B host launch ms and device ms, the mean of the two rows' values, both learned inline), once inline and
once with the auto row's own per-rank decisions (``decided``: call 4 froze one rank's decision too early,
the simulation replays what ran), and compares the predicted overlap/inline ratio with the measured one.
Rows of call 3 learned only B's times: there F's host and device times are B's times the mean F/B ratio
of the same model in call 4 (marked ``~``).  ``overlap_contention`` is fitted (least squares over the
pairs where some rank overlapped) on a grid from 1 to 2; the table is printed at the fit and at
``--contention`` values given.  ``rule`` says whether the simulator's auto rule on these costs decides as
the run did; ``auto rule now`` is the simulated ratio with the rule's decisions on these costs (what the
runtime decides since b8612bf, and what the tuner predicts), ``forced on`` with every pair overlapped
(``host_overlap_backward=True``).

Usage::

    python benchmarks/host_overlap_sim.py [FILE.jsonl ...] [--transfer-ms 0.05] [--contention 1.0 1.5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

from pipeloom.schedules import Costs, generate, lower, simulate
from pipeloom.schedules.dispatch import backward_overlap_pays

__all__ = ["main", "pairs", "simulate_pair"]

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_FILES = [os.path.join(HERE, "results", f"gpu-call{k}-sessionJ.jsonl") for k in (3, 4)]


def _learned(row: dict[str, Any]) -> dict[str, list[float]] | None:
    """``{"F0": [host ms, device ms], "B0": [...], ...}`` over all ranks; call 3's ``learned_B`` as ``B<stage>``."""
    out: dict[str, list[float]] = {}
    for rank in row.get("overlapped_by_rank") or []:
        if "learned" in rank:
            out.update({k: list(v[:2]) for k, v in rank["learned"].items()})
        elif "learned_B" in rank:
            out.update({f"B{k}": list(v[:2]) for k, v in rank["learned_B"].items()})
    return out or None


def pairs(files: list[str]) -> list[dict[str, Any]]:
    """The (auto, inline) row pairs of each file with learned costs."""
    out = []
    for path in files:
        with open(path) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        auto = {(r["schedule"], r["model"]): r for r in rows if r["engine"] == "pipeloom" and not r.get("variant")}
        inline = {(r["schedule"], r["model"]): r for r in rows
                  if r["engine"] == "pipeloom-x" and r.get("variant") == "host_overlap_backward=false"}
        for key, a in auto.items():
            b = inline.get(key)
            if b is None or _learned(a) is None or _learned(b) is None:
                continue
            out.append({"file": os.path.basename(path), "auto": a, "inline": b})
    return out


def _f_ratios(ps: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """model -> mean (F host / B host, F device / B device) over the stages of rows that learned both."""
    acc: dict[str, list[tuple[float, float]]] = {}
    for p in ps:
        for row in (p["auto"], p["inline"]):
            got = _learned(row) or {}
            for k, (h, d) in got.items():
                if k.startswith("F") and "B" + k[1:] in got:
                    bh, bd = got["B" + k[1:]]
                    acc.setdefault(row["model"], []).append((h / bh, d / bd))
    return {m: (statistics.fmean(x for x, _ in v), statistics.fmean(y for _, y in v)) for m, v in acc.items()}


def _costs(p: dict[str, Any], ratios: dict[str, tuple[float, float]]) -> tuple[dict[Any, float], dict[Any, float], bool]:
    """(host ms, device ms) per (stage, type, None), the mean of the two rows'; True where F was estimated."""
    a, b = _learned(p["auto"]) or {}, _learned(p["inline"]) or {}
    host: dict[Any, float] = {}
    dev: dict[Any, float] = {}
    estimated = False
    stages = sorted({int(k[1:]) for k in a if k.startswith("B")})
    for s in stages:
        for t in ("B", "F"):  # (B first: an unlearned F is estimated from it)
            k = f"{t}{s}"
            if k in a and k in b:
                h, d = (a[k][0] + b[k][0]) / 2, (a[k][1] + b[k][1]) / 2
            else:  # call 3: F from B by the model's ratios in call 4
                rh, rd = ratios[p["auto"]["model"]]
                h, d = host[(s, "B", None)] * rh, dev[(s, "B", None)] * rd
                estimated = True
            host[(s, t, None)], dev[(s, t, None)] = h, d
    return host, dev, estimated


def _decided(row: dict[str, Any]) -> dict[int, set[tuple[int, int]]]:
    out: dict[int, set[tuple[int, int]]] = {}
    for rank, info in enumerate(row.get("overlapped_by_rank") or []):
        out[rank] = {tuple(map(int, k.split(">"))) for k, v in info.get("decided", {}).items() if v}  # type: ignore[misc]
    return out


def simulate_pair(p: dict[str, Any], ratios: dict[str, tuple[float, float]], contention: float,
                  transfer_ms: float) -> dict[str, Any]:
    """Inline and overlapped simulations of one pair of rows; the predicted and measured ratios."""
    auto, inline = p["auto"], p["inline"]
    v = 2 if auto["schedule"] in ("Interleaved1F1B", "DualPipeV", "ZBVZeroBubble", "LoopedBFS") else 1
    sched = generate(auto["schedule"], num_ranks=auto["gpus"], num_microbatches=auto["microbatches"], stages_per_rank=v)
    low = lower(sched, comms=True, recv_placement="early", costs=Costs())
    host, dev, estimated = _costs(p, ratios)
    kw: dict[str, Any] = {"action_costs": host, "device_costs": dev, "device_transfer": transfer_ms, "device_streams": True}
    sim_in = simulate(low, Costs(), commit_horizon=inline.get("horizon_ms") or 10.0, **kw)
    ran = _decided(auto)
    sim_ov = simulate(low, Costs(), commit_horizon=auto.get("horizon_ms") or 10.0, overlap_pairs=ran,
                      overlap_contention=contention, **kw)
    sim_auto = simulate(low, Costs(), commit_horizon=auto.get("horizon_ms") or 10.0, host_overlap_backward="auto",
                        overlap_contention=contention, **kw)
    sim_all = simulate(low, Costs(), commit_horizon=auto.get("horizon_ms") or 10.0, host_overlap_backward=True,
                       overlap_contention=contention, **kw)
    # the rule on these costs, pair by pair, against what the run decided
    rule_agrees = True
    for rank, info in enumerate(auto.get("overlapped_by_rank") or []):
        for k, val in info.get("decided", {}).items():
            bs, fs = map(int, k.split(">"))
            # (the runs recorded here decided without the margin session M added)
            want = backward_overlap_pays(bs == fs, host[(bs, "B", None)], dev[(bs, "B", None)], dev[(fs, "F", None)],
                                         margin=1.0)
            rule_agrees &= bool(want) == bool(val)
    meas = auto["step_ms"] / inline["step_ms"]
    rounds = [x / y for x in auto.get("round_ms", []) for y in inline.get("round_ms", [])]
    return {"file": p["file"], "schedule": auto["schedule"], "model": auto["model"], "gpus": auto["gpus"],
            "m": auto["microbatches"], "estimated": estimated,
            "n_run": [r.get("n", 0) for r in auto.get("overlapped_by_rank") or []],
            "n_sim": [sim_ov.overlapped_backwards.get(r, 0) for r in range(auto["gpus"])],
            "sim_inline": sim_in.makespan, "sim_overlap": sim_ov.makespan, "pred": sim_ov.makespan / sim_in.makespan,
            "pred_auto": sim_auto.makespan / sim_in.makespan, "pred_all": sim_all.makespan / sim_in.makespan,
            "meas": meas, "meas_lo": min(rounds, default=meas), "meas_hi": max(rounds, default=meas),
            "inline_ms": inline["step_ms"], "overlap_ms": auto["step_ms"], "rule_agrees": rule_agrees}


def fit(ps: list[dict[str, Any]], ratios: dict[str, tuple[float, float]], transfer_ms: float) -> tuple[float, float]:
    """(contention, rms residual of the ratios) minimising the squared ratio errors over ``ps``'s pairs where some
    rank overlapped, on a grid of 0.01 from 1 to 2."""
    used = [p for p in ps if any(_decided(p["auto"]).values())]
    if not used:
        return float("nan"), float("nan")
    best = (1.0, float("inf"))
    for k in range(101):
        c = 1.0 + k / 100
        res = [simulate_pair(p, ratios, c, transfer_ms) for p in used]
        rms = (sum((r["pred"] - r["meas"]) ** 2 for r in res) / max(len(res), 1)) ** 0.5
        if rms < best[1] - 1e-12:
            best = (c, rms)
    return best


def table(ps: list[dict[str, Any]], ratios: dict[str, tuple[float, float]], c: float, transfer_ms: float) -> str:
    head = ("file", "schedule", "model", "gpus", "m", "B overlapped/rank (run; sim)", "sim inline ms (vs measured)", "sim overlap ms (vs measured)",
            "predicted", "measured (rounds)", "residual", "rule", "auto rule now", "forced on")
    rows = [head]
    for p in ps:
        r = simulate_pair(p, ratios, c, transfer_ms)
        rows.append((r["file"].replace("-sessionJ.jsonl", ""), r["schedule"], r["model"] + ("~" if r["estimated"] else ""),
                     str(r["gpus"]), str(r["m"]), f"{','.join(map(str, r['n_run']))}; {','.join(map(str, r['n_sim']))}",
                     f"{r['sim_inline']:.1f} ({r['sim_inline'] / r['inline_ms'] - 1:+.0%})",
                     f"{r['sim_overlap']:.1f} ({r['sim_overlap'] / r['overlap_ms'] - 1:+.0%})", f"x{r['pred']:.3f}",
                     f"x{r['meas']:.3f} ({r['meas_lo']:.2f}-{r['meas_hi']:.2f})", f"{r['pred'] - r['meas']:+.3f}",
                     "same" if r["rule_agrees"] else "differs", f"x{r['pred_auto']:.3f}", f"x{r['pred_all']:.3f}"))
    widths = [max(len(row[k]) for row in rows) for k in range(len(head))]
    return "\n".join("| " + " | ".join(x.ljust(w) for x, w in zip(row, widths)) + " |" for row in rows[:1]) + "\n" + \
        "| " + " | ".join("-" * w for w in widths) + " |\n" + \
        "\n".join("| " + " | ".join(x.ljust(w) for x, w in zip(row, widths)) + " |" for row in rows[1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", default=DEFAULT_FILES, help="gpu_pipeline.py result rows (JSON Lines)")
    ap.add_argument("--transfer-ms", type=float, default=0.05, help="a stage-boundary transfer on the device (ms)")
    ap.add_argument("--contention", type=float, nargs="*", default=[], help="also print the table at these values")
    args = ap.parse_args(argv)
    missing = [f for f in args.files if not os.path.exists(f)]
    if missing:
        print(f"missing result files: {', '.join(missing)}", file=sys.stderr)
        return 2
    ps = pairs(args.files)
    if not ps:
        print("no pair of rows (engine pipeloom, and pipeloom-x with host_overlap_backward=false) with learned costs",
              file=sys.stderr)
        return 2
    ratios = _f_ratios(ps)
    c, rms = fit(ps, ratios, args.transfer_ms)
    print("F/B ratios used where only B was learned (host, device): "
          + ", ".join(f"{m} {h:.2f}, {d:.2f}" for m, (h, d) in sorted(ratios.items())))
    print(f"fitted overlap_contention = {c:.2f} (rms residual of the ratio {rms:.3f} over the pairs where a rank "
          f"overlapped)")
    for label, sub in (("call 4 only (F measured, the current rule)", [p for p in ps if "call4" in p["file"]]),
                       ("model gpt-s", [p for p in ps if p["auto"]["model"] == "gpt-s"]),
                       ("model gpt-l", [p for p in ps if p["auto"]["model"] == "gpt-l"])):
        cs, rs = fit(sub, ratios, args.transfer_ms)
        print(f"  fitted on {label}: {cs:.2f} (rms {rs:.3f})")
    print()
    print(table(ps, ratios, c, args.transfer_ms))
    for extra in args.contention:
        print(f"\noverlap_contention = {extra:.2f}\n")
        print(table(ps, ratios, extra, args.transfer_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
