"""Is ``pipeloom schedule tune``'s first pick the fastest configuration?  A measured grid on 2 GPUs (or CPUs).

The tuner ranks configurations by simulated step time from one short profiling
run.  This script checks the ranking against measurement, on the GPT of
``gpu_pipeline.py --model gpt`` (token embedding on the first stage, RMSNorm +
vocabulary head on the last: heavier end stages), built here from a layer
list so that any split of the blocks over the stages can be run:

1. **profile** (``--profile NAME:M:BLOCKS``, default Interleaved1F1B, 16
   microbatches, blocks 2,1,3,2: stages holding different numbers of blocks,
   so that the tuner can tell each action's fixed host time from its layers',
   :func:`pipeloom.tools.schedule_tune.host_split`), traced, steps
   alternating the full and half batch (the tuner separates each action's
   fixed cost from its per-row cost): on GPUs the trace holds each action's
   host span (its launch) and its device time (``device`` events, CUDA
   events in the engine), both sides of
   :func:`pipeloom.tools.run_costs.with_host_costs`; with ``--synced-device``
   (the older protocol) traced twice, once with ``check_finite`` (a device
   sync per action: the spans are device time plus the sync, the checks and
   the launch) and once without;
   then the same for ``--profile-iw`` (default ZBVZeroBubble, same blocks),
   whose I and W actions the tuner takes as measured
   (:func:`pipeloom.tools.run_costs.merge_types`: on the host a split
   backward costs more than a full one); a last, untraced run of the first
   configuration measures its real step time, to which the tuner calibrates
   (:func:`pipeloom.tools.schedule_tune.calibration`);
2. **tune**: rank 0 ranks schedules x ``--microbatches`` from the profile, with
   the model's layers (embedding, blocks, head; weights = FLOPs per token)
   and a layer-split search for the ``--search`` best;
3. **grid**: every schedule x microbatch count (even split) plus the
   searched splits, each built once and warmed up (``--warmup`` steps), then
   timed in ``--rounds`` rounds of alternating order (``--steps`` per round
   after one more warm-up step; a barrier and a device sync around each step,
   the wall time of the slowest rank); a configuration's step time is the
   median of its steps;
4. prints measured vs predicted per configuration, the error, the tuner's
   first pick and how far its measured step is from the best measured one
   (goal: within 3%), the same round by round (each round's fastest row; rows are timed minutes apart from
   the next round, and the machine does not stay alike) and the head to head block by block, and writes it
   all as JSON to ``--out``.  The tuner's
   device model (``--device-model``, default ``lanes``: the host commits ahead
   of the device, :data:`pipeloom.tools.schedule_tune.DEVICE_MODELS`) makes the
   pick; the other model's prediction of every row, its errors and its pick
   are printed beside it (same profile, same measurements), and a line per
   variant of the two-lane model (``lanes-flopshare``: the host side as before
   :func:`pipeloom.tools.schedule_tune.host_fit`; ``lanes-inline``: every backward launched inline, the model
   before it knew of the runtime's ``host_overlap_backward``; ``lanes-mean``: the profile's mean device times and
   every forward's host span, the model before :func:`pipeloom.tools.schedule_tune.gpu_profile_costs`).  The tuner's host fit
   (fixed + per block, embedding, head, by type) is printed under the first
   line, and each row has the model's busy time per rank (host launches |
   device work over a step, uncalibrated; the host's includes the runtime's
   time per action and the sends); with ``--trace-grid`` beside it the traced
   ones (the action spans alone, and the CUDA-event device times), so that a
   miss can be placed on the host or the device side, rank by rank; the same
   for the profile itself on the last line but one.

Run (2 GPUs; about 80 s for ``--size s``)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/tune_grid.py --out /tmp/tunegrid

and on CPU, tiny (a smoke test of the whole path)::

    pipeloom launch --nproc-per-node 2 benchmarks/tune_grid.py --smoke --out /tmp/tunegrid

The pair behind issue 13's misses, alone, with each rank's process pinned to its half of the CPUs
(``--also-split`` adds a split to every configuration with as many stages, whatever the search finds;
``--cpu-pin``; ``gpu_run.sh tunemodes`` runs it free, pinned and traced)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/tune_grid.py --names 1F1B --microbatches 8 \
        --also-split 5,3 --rounds 6 --final-rounds 8 --cpu-pin --out /tmp/tunemodes

and, without a run, a saved grid predicted again by the tuner as it is now (``--replay``: the
profile traces and ``tune_grid.json`` of a run's ``--out``; the measurements stay, the predictions,
errors and the tuner's order are recomputed, with the recorded and the current first pick)::

    python benchmarks/tune_grid.py --replay benchmarks/results/tunegrid-sessionI/grid-a benchmarks/results/tunegrid-sessionI/grid-b
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_pipeline.py beside this script

NAMES = ("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV", "LoopedBFS", "InterleavedZeroBubble")
SIZES = {
    # name: (layers, hidden, heads, sequences per step, sequence length, vocabulary)
    "s": (8, 1024, 8, 32, 1024, 32000),
    "smoke": (8, 64, 4, 16, 32, 512),
}


def gpt_stage_fn(args: argparse.Namespace, split: list[int], device: Any, dtype: Any) -> Any:
    """``stage_fn`` of the GPT cut into ``len(split)`` stages, stage ``i`` holding ``split[i]`` blocks (the first
    also the embedding, the last the final norm and the head).  Blocks are seeded by their index, so every
    split is the same model."""
    import torch
    from gpu_pipeline import gpt_classes

    Block, Stage = gpt_classes()

    def blocks(first: int, count: int) -> list[Any]:
        out = []
        for i in range(first, first + count):
            torch.manual_seed(100 + i)
            out.append(Block(args.hidden, args.heads))
        return out

    starts = [sum(split[:i]) for i in range(len(split))]

    def stage_fn(s: int) -> Any:
        torch.manual_seed(1)
        st = Stage(args.vocab, args.hidden, s == 0, s == len(split) - 1, lambda: blocks(starts[s], split[s]), tail_seed=2)
        return st.to(device=device, dtype=dtype)

    return stage_fn


def layer_weights(args: argparse.Namespace) -> list[float]:
    """FLOPs per token of each layer the tuner may move: embedding (a lookup: ~0), each block, the head
    (norm + vocabulary projection); attention scores counted at the full sequence length."""
    h, t = args.hidden, args.seq
    ffn = 256 * ((8 * h // 3 + 255) // 256)
    block = 2 * (3 * h * h + h * h + 3 * h * ffn) + 2 * 2 * t * h
    return [0.01 * block] + [float(block)] * args.layers + [2.0 * h * args.vocab]


def _units(split: list[int]) -> tuple[int, ...]:
    """Blocks per stage -> tuner layers per stage (the embedding joins the first stage, the head the last)."""
    u = list(split)
    u[0] += 1
    u[-1] += 1
    return tuple(u)


def _blocks(units: tuple[int, ...]) -> list[int]:
    b = list(units)
    b[0] -= 1
    b[-1] -= 1
    return b


def _loss(out: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(out.float().flatten(0, -2), target.flatten())


def _pin_cpus() -> list[int]:
    """Pin this rank's process to its own share of the CPUs it may use (``--cpu-pin``): ``pipeloom launch
    --cpu-bind slice``'s binding (``pipeloom.affinity``), so that no two ranks' threads (the actor's, autograd's
    backward thread, NCCL's proxies) share a core.  Called before torch starts its threads, which inherit the
    mask.  Returns the CPUs pinned to."""
    from pipeloom.affinity import bind_this_process

    return bind_this_process("slice") or []


def _rank_main(args: argparse.Namespace) -> None:
    pinned = _pin_cpus() if args.cpu_pin else None
    import torch
    import torch.distributed as dist
    from pipeloom.schedules import ScheduleError, generate

    import pipeloom

    gpu = torch.cuda.is_available() and not args.smoke
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if gpu else "gloo")
    if not gpu:
        torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    def release() -> None:
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
        dist.barrier()

    def build(name: str, m: int, v: int, blocks: list[int], **kw: Any) -> Any:
        return pipeloom.Pipeline(gpt_stage_fn(args, blocks, device, dtype), schedule=name, num_microbatches=m,
                                 stages_per_rank=v, loss_fn=_loss, device=device, **kw)

    def timed(pipe: Any, steps: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            pipe.step(x, target=y)
        out = []
        for _ in range(steps):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(x, target=y)
            sync()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.append(float(t.item()))
        return out

    t_start = time.perf_counter()
    # 1. profile: traced twice (with device syncs on GPUs: device time; without: host launch time), then the
    # same configuration untouched by tracing, to which the tuner calibrates
    pname, pm, pv, psplit = _profile_config(args.profile, args, world)
    profiles = {"": (pname, pm, pv, psplit)}
    if args.profile_iw:
        profiles["_iw"] = _profile_config(args.profile_iw, args, world)
        if profiles["_iw"][3] != psplit:
            raise SystemExit(f"--profile-iw {args.profile_iw}: give it the blocks of --profile ({psplit})")
    traces: dict[str, str] = {}
    # GPUs: the engine measures each traced action's device time with CUDA events (`device` events), so one
    # untouched traced run gives both sides; --synced-device: the device side from a second run with a device
    # sync per action (check_finite), whose spans also hold the launch, the sync and the checks
    events = gpu and not args.synced_device
    for tag, (name, m, v, split) in profiles.items():
        for side in (("host",) if events else ("device", "host")):
            path = traces[side + tag] = os.path.join(args.out, f"profile{tag}_{side}.jsonl")
            pipe = build(name, m, v, split, trace=path, check_finite=gpu and side == "device")
            for i in range(args.warmup + 2 * args.profile_steps):
                half = i >= args.warmup and (i - args.warmup) % 2 == 1
                pipe.step(x[: args.batch // 2] if half else x, target=y[: args.batch // 2] if half else y)
            pipe.close()
            del pipe
            release()
    pipe = build(pname, pm, pv, psplit)
    prof_real = statistics.median(timed(pipe, args.steps, args.warmup))
    pipe.close()
    del pipe
    release()
    t_profile = time.perf_counter() - t_start

    # 2. tune (rank 0), then tell everybody what to measure
    names = [n for n in args.names.split(",") if n]
    mbs = [int(v) for v in args.microbatches.split(",")]
    plan: list[Any] = [None]
    if rank == 0:
        try:
            from dataclasses import replace

            from pipeloom.tools.schedule_tune import Layers, _action_costs, _simulate, calibration, host_fit, tune

            run = profile_costs(traces, events)
            layers = Layers(tuple(layer_weights(args)), _units(psplit), ends=(1, 1))
            res = tune(run, schedules=names, microbatches=mbs, stages_per_rank=None, measured_step_ns=prof_real * 1e9,
                       layers=layers, search=args.search, device_model=args.device_model,
                       overlap_backward=OVERLAP[args.overlap_backward])
            cands = [c.to_json() for c in _with_splits(res, run, layers, world, args.also_split)]
            if not cands:
                raise ValueError("no configuration could be simulated: " + "; ".join(res.skipped[:3]))
            # the other device model's prediction of the same candidates, side by side (same profile, same grid)
            other = "max" if args.device_model == "lanes" else "lanes"
            cal_other = calibration(run, measured_step_ns=prof_real * 1e9, layers=layers, device_model=other)
            for c in cands:
                sched, sim = _simulate(run, c["schedule"], world, c["stages_per_rank"], c["microbatches"], layers=layers,
                                       split=tuple(c["split"]), device_model=other)
                c["step_ns_" + other] = sim.makespan * cal_other
                # what the two-lane model holds each rank busy with (uncalibrated): its host's launches and its
                # device's work over a step, to read against the grid's traces (which side bounds which rank)
                hc, dc, _ = _action_costs(run, world, c["stages_per_rank"], c["microbatches"], sched.stage_to_rank,
                                          layers=layers, split=tuple(c["split"]), lanes=True)
                c["host_busy_ns"], c["device_busy_ns"] = _busy(sched, hc, world), _busy(sched, dc, world)
            # variants of the two-lane model, for what the GPU run can tell apart (same profile, same grid): the
            # fixed 10 ms horizon of gpu_commit_ms alone; the device time as the whole synced span less the host's
            # fixed part (an upper bound: it keeps the sync, the checks and a device-side fixed part); one device lane
            # in launch order instead of one stream per stage
            variants = {"lanes-10ms": (run, {"commit_launches": 0.0}),
                        "lanes-span": (replace(run, sizes_fitted=False), {}),
                        "lanes-1stream": (run, {"stage_streams": False}),
                        # the host side as before schedule_tune.host_fit: the fixed part once, the rest of each
                        # recorded stage's host time shared among its layers by FLOPs (a head lends its launch time
                        # to the blocks beside it)
                        "lanes-flopshare": (run, {"host_units": False}),
                        # a host speed per rank, fitted where the two profiles put the same stages on different
                        # ranks (schedule_tune.host_fit(rank_speed=True)), the units fitted on both profiles' rows
                        "lanes-rankspeed": (run, {"host_rank_speed": True}),
                        # every backward launched inline: the model before it knew of the runtime's
                        # host_overlap_backward (auto by default on GPUs: a B launched beside the next F)
                        "lanes-inline": (run, {"overlap_backward": False}),
                        # the device times' means and every forward's host span (the model before session L: a
                        # host-bound rank's device time read at the host's pace, a forward beside a backward
                        # counted with the contention the model adds itself)
                        **({"lanes-mean": (profile_costs(traces, events, learned=False), {})} if events else {})}
            cal_variants = {}
            for label, (vrun, kw) in variants.items():
                cal_v = cal_variants[label] = (
                    calibration(vrun, measured_step_ns=prof_real * 1e9, layers=layers, device_model="lanes", **kw)
                    if not {"stage_streams", "host_units", "host_rank_speed"} & set(kw) else
                    prof_real * 1e9 / _simulate(vrun, pname, world, pv, pm, layers=layers, split=_units(psplit),
                                                device_model="lanes", **kw)[1].makespan)
                for c in cands:
                    _, sim = _simulate(vrun, c["schedule"], world, c["stages_per_rank"], c["microbatches"], layers=layers,
                                       split=tuple(c["split"]), device_model="lanes", **kw)
                    c["step_ns_" + label] = sim.makespan * cal_v
            # the profile itself, rank by rank: its traced busy time (host spans; device events) against what the
            # tuner's model of the same configuration holds each rank busy with
            psched = generate(pname, num_ranks=world, num_microbatches=pm, stages_per_rank=pv)
            phc, pdc, _ = _action_costs(run, world, pv, pm, psched.stage_to_rank, layers=layers, split=_units(psplit),
                                        lanes=True)
            profile_busy = {"model_host": _busy(psched, phc, world), "model_device": _busy(psched, pdc, world),
                            **_traced_busy(traces["host"], world,  # the full-batch steps (see the profile's loop)
                                           lambda st: st < args.warmup or (st - args.warmup) % 2 == 0)}
            plan[0] = {"candidates": cands, "calibration": res.calibration, "sizes_fitted": res.sizes_fitted,
                       "profile_busy": profile_busy,
                       "profile_step_s": prof_real, "host_fixed_ns": res.host_fixed_ns,
                       "host_units_ns": res.host_units_ns,
                       "host_rank_speed": getattr(host_fit(run, layers, run.ref_bytes, rank_speed=True), "speed", None),
                       "device_model": args.device_model,
                       "other_model": other, "calibration_other": cal_other, "variants": cal_variants}
        except Exception:  # tell rank 1 (waiting in the broadcast) instead of leaving it to NCCL's timeout
            import traceback

            plan[0] = {"error": traceback.format_exc()}
    dist.broadcast_object_list(plan, src=0)
    if "error" in plan[0]:
        if rank == 0:
            print(f"the tuner failed on the profiles {', '.join(traces.values())}:\n{plan[0]['error']}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(1)
    cands = plan[0]["candidates"]
    grid = []
    for c in cands:
        try:
            generate(c["schedule"], num_ranks=world, num_microbatches=c["microbatches"], stages_per_rank=c["stages_per_rank"])
        except ScheduleError:
            continue
        grid.append(c)
    # 3. measure the grid: every configuration built once (one set of communicators each) and warmed up, then
    # timed in rounds of alternating order, so that a drift of the machine hits them alike
    # --trace-grid: every configuration traced (its host side, for `pipeloom trace compare` against the tuner's plan;
    # off by default: the timed steps would then carry the recording)
    pipes = [build(c["schedule"], c["microbatches"], c["stages_per_rank"], _blocks(tuple(c["split"])),
                   **({"trace": os.path.join(args.out, f"grid{i:02d}.jsonl")} if args.trace_grid else {}))
             for i, c in enumerate(grid)]
    # the profiled configuration itself, measured beside the grid (alive with the others, traced with them, in
    # the same rounds): the step the tuner's calibration would have read had the profile run under the grid's
    # conditions (index -1 in the rounds)
    anchor = build(pname, pm, pv, psplit, **({"trace": os.path.join(args.out, "anchor.jsonl")} if args.trace_grid else {}))
    members = {**dict(enumerate(pipes)), -1: anchor}
    for pipe in members.values():
        timed(pipe, 0, args.warmup)
    times: dict[int, list[float]] = {}
    for r in range(args.rounds):
        order = [*range(len(grid)), -1] if r % 2 == 0 else [*range(len(grid)), -1][::-1]
        for i in order:
            times.setdefault(i, []).extend(timed(members[i], args.steps, 1))
    # 4. head to head: the grid's best measured row is the minimum of many noisy medians, so it reads low (the
    # winner's curse); the tuner's pick and that row (or, when the pick is it, the runner-up) measured again,
    # alone, alternating, is the fair comparison (every rank holds the same all-reduced times, so all agree)
    duel: dict[str, Any] = {}
    if args.final_rounds > 0 and len(grid) > 1:
        pick_i = 0  # (the grid keeps the tuner's order: schedule_tune.rank_candidates)
        by_meas = sorted(range(len(grid)), key=lambda i: statistics.median(times[i]))
        other_i = by_meas[0] if by_meas[0] != pick_i else by_meas[1]
        duel = {"pick": pick_i, "other": other_i, "other_is_best": other_i == by_meas[0],
                "pick_times_ns": [], "other_times_ns": []}
        for r in range(args.final_rounds):
            for i in ((pick_i, other_i) if r % 2 == 0 else (other_i, pick_i)):
                key = "pick_times_ns" if i == pick_i else "other_times_ns"
                duel[key].extend(t * 1e9 for t in timed(members[i], args.steps, 1))
    # each row's host_overlap_backward decisions per rank (auto decides on what the rank learned: a row near the
    # rule's boundary may have run either way; the replay reads them), gathered in the same order on every rank
    decisions: dict[int, list[Any]] = {}
    for i in range(len(grid)):
        mine = {f"{b}>{f}": v for (b, f), v in getattr(members[i]._actor, "_bg_decided", {}).items()}
        got: list[Any] = [None] * world
        dist.all_gather_object(got, mine)
        decisions[i] = got
    for pipe in members.values():
        pipe.close()
    del anchor, members
    del pipes
    release()
    if rank == 0:
        rows = []
        for i, c in enumerate(grid):
            meas = statistics.median(times[i]) * 1e9
            rows.append({**c, "measured_ns": meas, "error": c["step_ns"] / meas - 1,
                         "spread": [min(times[i]) * 1e9 / meas - 1, max(times[i]) * 1e9 / meas - 1],
                         "times_ns": [t * 1e9 for t in times[i]], "overlap_decided_by_rank": decisions.get(i),
                         **({"trace": f"grid{i:02d}.jsonl",
                             **_traced_busy(os.path.join(args.out, f"grid{i:02d}.jsonl"), world)} if args.trace_grid else {})})
        doc = {"profile": {"schedule": pname, "microbatches": pm, "stages_per_rank": pv, "blocks": psplit,
                           "split_backward_from": args.profile_iw or None,
                           "step_ns": prof_real * 1e9, "calibration": plan[0]["calibration"],
                           "step_in_grid_ns": statistics.median(times[-1]) * 1e9 if times.get(-1) else None,
                           "sizes_fitted": plan[0]["sizes_fitted"], "host_fixed_ns": plan[0]["host_fixed_ns"],
                           "host_units_ns": plan[0].get("host_units_ns"), "host_rank_speed": plan[0].get("host_rank_speed"),
                           "device_model": plan[0]["device_model"], "other_model": plan[0]["other_model"],
                           "calibration_other": plan[0]["calibration_other"], "variants": plan[0]["variants"],
                           "busy": plan[0].get("profile_busy")},
               "device": torch.cuda.get_device_name() if gpu else "cpu", "size": args.size, "rows": rows,
               **({"head_to_head": duel} if duel else {}),
               "rounds": args.rounds, "steps": args.steps, "cpu_pin": len(pinned) if pinned else None,
               "seconds": {"profile_and_tune": t_profile, "total": time.perf_counter() - t_start}}
        with open(os.path.join(args.out, "tune_grid.json"), "w") as f:
            json.dump(doc, f, indent=1)
        print(format_grid(doc), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _with_splits(res: Any, run: Any, layers: Any, world: int, also: list[list[int]] | None) -> list[Any]:
    """The tuner's candidates plus, for every schedule and microbatch count with as many stages as a split of
    ``also`` (blocks per stage, ``--also-split``) and not already among them, that split, predicted by the same model
    and calibration (``searched`` True: not the even split), all in the tuner's order (``rank_candidates``)."""
    from dataclasses import replace

    from pipeloom.tools.schedule_tune import _simulate, rank_candidates

    cands = list(res.candidates)
    seen = {(c.schedule, c.microbatches, c.stages_per_rank, c.split) for c in cands}
    for blocks in also or []:
        units = _units(blocks)
        for c in list(res.candidates):
            if world * c.stages_per_rank != len(units) or c.searched:
                continue
            k = (c.schedule, c.microbatches, c.stages_per_rank, units)
            if k in seen:
                continue
            seen.add(k)
            _, sim = _simulate(run, c.schedule, world, c.stages_per_rank, c.microbatches, layers=layers, split=units,
                               device_model=res.device_model or "lanes", overlap_backward=res.overlap_backward)
            peak = max(sim.peak_live_activations.values(), default=0)
            cands.append(replace(c, step_ns=sim.makespan * res.calibration, bubble=sim.overall_bubble_fraction,
                                 peak_live=peak, peak_activation_bytes=int(c.peak_activation_bytes * peak / c.peak_live)
                                 if c.peak_live else c.peak_activation_bytes, split=units, searched=True))
    return rank_candidates(cands) if also else cands


def profile_costs(traces: dict[str, str], events: bool, *, learned: bool = True) -> Any:
    """The tuner's ``RunCosts`` from the profile traces, as ``pipeloom schedule tune`` takes them (the typical steps,
    ``run_costs.TYPICAL``): ``traces`` maps ``host`` (and ``device`` without CUDA-event device times, ``events``
    False), and ``host_iw`` (``device_iw``) for the split-backward profile, to trace paths; the second profile's I
    and W taken as measured (``merge_types``).  With CUDA-event device times and ``learned`` (default), each side as
    :func:`pipeloom.tools.schedule_tune.gpu_profile_costs` reads it (device times as the runtime learns them, the
    host's forwards launched alone); ``learned`` False: the mean device times and every forward's span (the model
    before session L, for comparisons: ``--device-times mean``)."""
    from pipeloom.tools.run_costs import costs_from_trace, merge_types, with_host_costs
    from pipeloom.tools.schedule_tune import gpu_profile_costs
    from pipeloom.tools.trace_model import load_trace

    def costs(tag: str) -> Any:
        host_model = load_trace(traces["host" + tag])
        if events and learned:
            return gpu_profile_costs(host_model)
        dev = (costs_from_trace(host_model, typical=True, device=True) if events else
               costs_from_trace(load_trace(traces["device" + tag]), typical=True))
        return with_host_costs(dev, costs_from_trace(host_model, typical=True))

    run = costs("")
    if "host_iw" in traces:
        run = merge_types(run, costs("_iw"))  # I and W as measured, not shares of B
    return run


OVERLAP: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False}
"""``--overlap-backward``: the tuner's ``overlap_backward`` (:data:`pipeloom.tools.schedule_tune.OVERLAP_BACKWARD`)."""


def replay(directory: str, *, search: int = 3, device_model: str = "lanes",
           overlap_backward: bool | str | None = "auto", learned: bool = True,
           overlap_margin: float | None = None) -> tuple[dict[str, Any], list[str]]:
    """A saved grid (``tune_grid.json`` and the profile traces beside it, as a run writes them under ``--out``)
    predicted again with the tuner as it is now: (the grid's document with every row's prediction, error and model
    busy times recomputed and the rows in the tuner's order (``rank_candidates``), a summary of before and after).

    The profile is rebuilt as the run built it (:func:`profile_costs`, the model's layers of ``layer_weights``,
    the profile's measured step for the calibration) and ``tune`` ranks the grid's schedules and microbatch counts
    with the layer-split search (``search``); a measured row that the tuner now does not propose (a split the
    earlier search found) is simulated with the same calibration.  Rows keep their measurements, so the lead can
    show a model change on recorded grids without a GPU.  ``overlap_backward``: the runtime's host_overlap_backward
    the tuner predicts with (False for grids measured before session J, whose runtime launched every backward
    inline).  ``learned``: :func:`profile_costs`'s (False: the device times' means, every forward's host span).
    ``overlap_margin``: the auto rule's margin the grid ran with (None: the profile trace header's
    ``overlap_margin``, 1.0 where it has none: grids recorded before session M)."""
    from pipeloom.tools.schedule_tune import Candidate, Layers, _action_costs, _simulate, rank_candidates, tune

    with open(os.path.join(directory, "tune_grid.json")) as f:
        doc = json.load(f)
    prof = doc["profile"]
    if doc.get("size") not in SIZES:
        raise SystemExit(f"{directory}: size {doc.get('size')!r} is not one of {', '.join(SIZES)}")
    args = argparse.Namespace()
    args.layers, args.hidden, args.heads, args.batch, args.seq, args.vocab = SIZES[doc["size"]]

    def have(name: str) -> bool:
        path = os.path.join(directory, name)
        return os.path.exists(path) or os.path.exists(path + ".rank0")

    traces = {}
    for tag in ("", "_iw"):
        for side in ("host", "device"):
            if have(f"profile{tag}_{side}.jsonl"):
                traces[side + tag] = os.path.join(directory, f"profile{tag}_{side}.jsonl")
    if "host" not in traces:
        raise SystemExit(f"{directory}: no profile trace (profile_host.jsonl.rankN) beside tune_grid.json")
    run = profile_costs(traces, events="device" not in traces, learned=learned)
    if overlap_margin is None:
        from pipeloom.runtime.trace import expand_paths, read_header

        opts = read_header(expand_paths(traces["host"])[0]).get("options") or {}
        overlap_margin = float(opts.get("overlap_margin", 1.0))
    world = run.world_size
    layers = Layers(tuple(layer_weights(args)), _units(prof["blocks"]), ends=(1, 1))
    rows = doc["rows"]
    names = list(dict.fromkeys(r["schedule"] for r in rows))
    mbs = sorted({r["microbatches"] for r in rows})
    res = tune(run, schedules=names, microbatches=mbs, stages_per_rank=None, measured_step_ns=prof["step_ns"],
               layers=layers, search=search, device_model=device_model, overlap_backward=overlap_backward,
               overlap_margin=overlap_margin)

    def key(schedule: str, m: int, v: int, split: Any) -> tuple[Any, ...]:
        return (schedule, m, v, tuple(split))

    proposed = {key(c.schedule, c.microbatches, c.stages_per_rank, c.split): c for c in res.candidates}
    new_rows, cands = [], []
    for r in rows:
        k = key(r["schedule"], r["microbatches"], r["stages_per_rank"], r["split"])
        sched, sim = _simulate(run, r["schedule"], world, r["stages_per_rank"], r["microbatches"], layers=layers,
                               split=k[3], device_model=device_model, overlap_backward=overlap_backward,
                               overlap_margin=overlap_margin)
        step = proposed[k].step_ns if k in proposed else sim.makespan * res.calibration
        hc, dc, _ = _action_costs(run, world, r["stages_per_rank"], r["microbatches"], sched.stage_to_rank,
                                  layers=layers, split=k[3], lanes=True)
        even = k[3] == layers.even_split(world * r["stages_per_rank"])
        nr = {key_: val for key_, val in r.items() if not key_.startswith("step_ns_")}
        nr.update(step_ns=step, error=step / r["measured_ns"] - 1, searched=not even,
                  host_busy_ns=_busy(sched, hc, world), device_busy_ns=_busy(sched, dc, world))
        decided = r.get("overlap_decided_by_rank")
        if decided and device_model == "lanes":
            # the same row with the backwards the runtime really launched beside (the grid records them):
            # how much of the row's error is the rule's decision rather than the costs
            pairs = {rank: {tuple(map(int, k.split(">"))) for k, v in (d or {}).items() if v} for rank, d in enumerate(decided)}
            _, as_run = _simulate(run, r["schedule"], world, r["stages_per_rank"], r["microbatches"], layers=layers,
                                  split=k[3], device_model=device_model, overlap_pairs=pairs)
            nr["step_ns_as_decided"] = as_run.makespan * res.calibration
            nr["error_as_decided"] = nr["step_ns_as_decided"] / r["measured_ns"] - 1
        new_rows.append(nr)
        cands.append(Candidate(r["schedule"], r["microbatches"], r["stages_per_rank"], step, 0.0,
                               r.get("peak_live_microbatch_stages", 0), r.get("peak_activation_bytes", 0), True,
                               k[3], not even))
    order = [cands.index(c) for c in rank_candidates(cands)]
    new = {**doc, "rows": [new_rows[i] for i in order],
           "profile": {**{k: v for k, v in prof.items() if k not in ("variants", "other_model", "calibration_other",
                                                                       "busy", "host_rank_speed")},
                       "calibration": res.calibration, "sizes_fitted": res.sizes_fitted,
                       "host_fixed_ns": res.host_fixed_ns, "host_units_ns": res.host_units_ns,
                       "device_model": device_model}}
    new.pop("head_to_head", None)  # (its row indices are the recorded order's; summarised below instead)

    def summary(label: str, rs: list[dict[str, Any]]) -> str:
        errs = [abs(r["error"]) for r in rs]
        best = min(rs, key=lambda r: r["measured_ns"])
        pick = rs[0]
        return (f"{label}: first pick {pick['schedule']} m={pick['microbatches']} "
                f"({','.join(map(str, _blocks(tuple(pick['split']))))}) {pick['measured_ns'] / best['measured_ns'] - 1:+.1%} "
                f"from the best measured; error largest {max(errs):.1%}, median {statistics.median(errs):.1%}")

    lines = [summary("recorded tuner", rows), summary("current tuner", new["rows"])]
    as_run = [abs(r["error_as_decided"]) for r in new["rows"] if "error_as_decided" in r]
    if as_run:
        lines.append(f"current tuner with each row's recorded overlap decisions ({len(as_run)} rows): error largest "
                     f"{max(as_run):.1%}, median {statistics.median(as_run):.1%}")
    first = res.candidates[0] if res.candidates else None
    if first is not None and key(first.schedule, first.microbatches, first.stages_per_rank, first.split) not in {
            key(r["schedule"], r["microbatches"], r["stages_per_rank"], r["split"]) for r in rows}:
        lines.append(f"current tuner's own first pick {first.schedule} m={first.microbatches} "
                     f"({','.join(map(str, _blocks(tuple(first.split or ()))))}) was not measured in this grid")
    duel = doc.get("head_to_head")
    if duel:
        a, b = rows[duel["pick"]], rows[duel["other"]]
        ma, mb = statistics.median(duel["pick_times_ns"]), statistics.median(duel["other_times_ns"])
        lines.append(f"recorded head to head: {a['schedule']} m={a['microbatches']} "
                     f"({','.join(map(str, _blocks(tuple(a['split']))))}) {ma / 1e6:.2f} ms against {b['schedule']} "
                     f"m={b['microbatches']} ({','.join(map(str, _blocks(tuple(b['split']))))}) {mb / 1e6:.2f} ms: "
                     f"{ma / mb - 1:+.1%}")
    lines += [f"recorded tuner's pick, {x}" for x in _by_round(doc)]
    return new, lines


def _ratio_ci(a: list[float] | None, b: list[float] | None, draws: int = 2000) -> tuple[float, float] | None:
    """95% bootstrap interval of ``median(a) / median(b) - 1`` (each configuration's measured steps resampled),
    seeded: how far apart two measured configurations really are, given their step-to-step spread."""
    if not a or not b or len(a) < 3 or len(b) < 3:
        return None
    import random

    rng = random.Random(0)
    out = sorted(statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b))) - 1
                 for _ in range(draws))
    return out[int(0.025 * draws)], out[int(0.975 * draws) - 1]


def _traced_busy(path: str, world: int, keep: Any = None) -> dict[str, list[float]]:
    """A traced configuration's measured busy time per rank, the median over its training steps after the first
    (those ``keep(step)`` accepts, if given): ``host_busy_traced_ns`` (its action spans: the host's launches) and,
    where the trace has CUDA-event device times, ``device_busy_traced_ns``; {} where the trace cannot be read."""
    try:
        from pipeloom.tools.trace_model import load_trace

        model = load_trace(path)
    except (OSError, ValueError) as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return {}
    steps = [st for st in model.train_steps[1:] or model.train_steps if keep is None or keep(st)]
    out: dict[str, list[float]] = {}
    host = [[sum(a.duration for a in model.actions.get(r, []) if a.step == st) for st in steps] for r in range(world)]
    out["host_busy_traced_ns"] = [float(statistics.median(h)) if h else 0.0 for h in host]
    if model.device_ns:
        dev = [[sum(ns for (r1, st1, _), ns in model.device_ns.items() if r1 == r and st1 == st) for st in steps]
               for r in range(world)]
        out["device_busy_traced_ns"] = [float(statistics.median(d)) if d else 0.0 for d in dev]
    return out


def _busy(sched: Any, costs: dict[Any, float], world: int) -> list[float]:
    """Per rank, the sum of ``costs`` (stage, type, None) over the schedule's compute actions (an OVERLAP_F_B's
    halves counted as theirs)."""
    busy = [0.0] * world
    for rank, acts in sched.actions.items():
        for a in acts:
            for sub in a.sub_actions or (a,):
                busy[rank] += costs.get((sub.stage, sub.type.value, None), 0.0)
    return busy


def _units_even(layers: int, stages: int) -> list[int]:
    q, r = divmod(layers, stages)
    return [q + (1 if i < r else 0) for i in range(stages)]


def _profile_config(spec: str, args: argparse.Namespace, world: int) -> tuple[str, int, int, list[int]]:
    """(schedule, microbatches, stages per rank, blocks per stage) of a profile ``NAME:M[:B1,B2,...]``."""
    from pipeloom.schedules import default_stages_per_rank

    parts = spec.split(":")
    name, m = parts[0], int(parts[1]) if len(parts) > 1 and parts[1] else 16
    v = default_stages_per_rank(name)
    split = [int(b) for b in parts[2].split(",")] if len(parts) > 2 and parts[2] else _units_even(args.layers, world * v)
    if len(split) != world * v or sum(split) != args.layers or min(split) < 1:
        raise SystemExit(f"profile {spec}: {name} has {world * v} stages on {world} ranks; the split must give "
                         f"each at least one of the {args.layers} blocks")
    return name, m, v, split


def _by_round(doc: dict[str, Any]) -> list[str]:
    """The grid round by round (rows timed one after another, minutes apart from the next round): each round's
    fastest row and the tuner's pick against it, and the head to head block by block (``--steps`` each).

    Why: a configuration's measured step is the median over every round, and the machine does not stay alike
    between rounds (on 2 x H200, session I: a host-bound row ran 33% slower in rounds 2-3 than in round 1 while a
    device-bound one moved 5%); a pick that is best in one round and not in the next is not a model error alone.
    Nothing where the steps per round are not known (``rounds``, default 3, must divide the steps)."""
    rows = doc["rows"]
    n = min((len(r.get("times_ns") or []) for r in rows), default=0)
    rounds = doc.get("rounds") or 3
    if not n or n % rounds or len(rows) < 2:
        return []
    steps = n // rounds

    def name(r: dict[str, Any]) -> str:
        return f"{r['schedule']} m={r['microbatches']} ({','.join(map(str, _blocks(tuple(r['split']))))})"

    out = []
    for k in range(rounds):
        med = [statistics.median(r["times_ns"][k * steps:(k + 1) * steps]) for r in rows]
        best = min(range(len(rows)), key=lambda i: med[i])
        out.append(f"round {k + 1}: fastest {name(rows[best])} {med[best] / 1e6:.2f} ms; the pick {name(rows[0])} "
                   f"{med[0] / 1e6:.2f} ms ({med[0] / med[best] - 1:+.1%})")
    duel = doc.get("head_to_head")
    if duel and duel.get("pick_times_ns") and len(duel["pick_times_ns"]) % steps == 0:
        def blocks(ts: list[float]) -> str:
            return " ".join(f"{statistics.median(ts[i:i + steps]) / 1e6:.1f}" for i in range(0, len(ts), steps))

        out.append(f"head to head by block of {steps} steps (ms): the pick {blocks(duel['pick_times_ns'])}; "
                   f"{name(rows[duel['other']])} {blocks(duel['other_times_ns'])}")
    return out


def format_grid(doc: dict[str, Any]) -> str:
    from pipeloom.tools.schedule_tune import format_host_units

    rows = doc["rows"]
    prof = doc["profile"]
    host = prof.get("host_fixed_ns")
    model, other = prof.get("device_model", "max"), prof.get("other_model")
    key_o = f"step_ns_{other}" if other else None
    has_other = key_o is not None and all(key_o in r for r in rows)
    busy = all("host_busy_ns" in r for r in rows)
    traced = any("host_busy_traced_ns" in r for r in rows)
    blocks = ",".join(map(str, prof["blocks"])) if prof.get("blocks") else "even"
    lines = [f"device {doc['device']}, GPT size {doc['size']}; profile {prof['schedule']} m={prof['microbatches']} "
             f"(blocks {blocks}): step {prof['step_ns'] / 1e6:.2f} ms, calibration x{prof['calibration']:.3f}"
             + (f" ({model}; {other}: x{prof['calibration_other']:.3f})" if has_other else "") + ", "
             f"{'fixed + per-row compute' if prof['sizes_fitted'] else 'one size: proportional compute'}, host per "
             + ("action " + (", ".join(f"{t} {v / 1e6:.3f} ms" for t, v in host.items()) if host else "not separated"))
             + (f"; I, W measured on {prof['split_backward_from']}" if prof.get("split_backward_from") else ""),
             *([f"host fit (start: embedding, end: head + loss): {format_host_units(prof['host_units_ns'])}"
                + ("; host speed by rank (variant lanes-rankspeed): "
                   + ", ".join(f"{r} x{v:.3f}" for r, v in sorted(prof['host_rank_speed'].items()))
                   if prof.get("host_rank_speed") else "")]
               if prof.get("host_units_ns") else []),
             f"{'schedule':<22} {'m':>3} {'v':>2} {'blocks per stage':>18} {'measured':>10} {'predicted':>10} {'error':>7} "
             f"{'recal.':>7} {'rank meas/pred':>14}" + (f" {other + ' model':>11} {'error':>7}" if has_other else "")
             + f" {'spread':>12}" + ("  model busy ms per rank: host | device" if busy else "")
             + ("  traced: host | device" if traced else "")]
    # the profiled configuration as measured in the grid: the tuner's calibration redone under the grid's
    # conditions (a machine whose speed drifted between the profile and the grid shifts every row alike)
    ref = [r for r in rows if r["schedule"] == prof["schedule"] and r["microbatches"] == prof["microbatches"]
           and r["stages_per_rank"] == prof.get("stages_per_rank", 1) and not r["searched"]]
    recal = ref[0]["measured_ns"] / ref[0]["step_ns"] if ref else 1.0
    # the profiled configuration measured among the grid's (same rounds, same conditions): every prediction
    # rescaled by its step there over the profile run's own (what the calibration would have been)
    anchored = prof["step_in_grid_ns"] / prof["step_ns"] if prof.get("step_in_grid_ns") else None
    by_meas = sorted(range(len(rows)), key=lambda i: rows[i]["measured_ns"])
    by_pred = sorted(range(len(rows)), key=lambda i: rows[i]["step_ns"])
    rm = {i: k + 1 for k, i in enumerate(by_meas)}
    rp = {i: k + 1 for k, i in enumerate(by_pred)}
    for i in by_pred:
        r = rows[i]
        split = ",".join(map(str, _blocks(tuple(r["split"])))) + (" *" if r["searched"] else "")
        sp = r.get("spread")
        lines.append(f"{r['schedule']:<22} {r['microbatches']:>3} {r['stages_per_rank']:>2} {split:>18} "
                     f"{r['measured_ns'] / 1e6:>8.2f}ms {r['step_ns'] / 1e6:>8.2f}ms {r['error']:>+7.1%} "
                     f"{r['step_ns'] * recal / r['measured_ns'] - 1:>+7.1%} {rm[i]:>6}/{rp[i]:<7}"
                     + (f" {r[key_o] / 1e6:>9.2f}ms {r[key_o] / r['measured_ns'] - 1:>+7.1%}" if has_other else "")
                     + (f" {sp[0]:+.0%}..{sp[1]:+.0%}" if sp else "")
                     + (f"  {'/'.join(f'{x / 1e6:.1f}' for x in r['host_busy_ns'])} | "
                        f"{'/'.join(f'{x / 1e6:.1f}' for x in r['device_busy_ns'])}" if busy else "")
                     + (f"  {'/'.join(f'{x / 1e6:.1f}' for x in r.get('host_busy_traced_ns', []))} | "
                        f"{'/'.join(f'{x / 1e6:.1f}' for x in r.get('device_busy_traced_ns', [])) or '-'}" if traced else ""))

    def stats(errs: list[float]) -> str:
        return f"largest {max(errs):.1%}, median {statistics.median(errs):.1%}, {sum(e <= 0.10 for e in errs)} within 10%"

    errs = [abs(r["error"]) for r in rows]
    rerrs = [abs(r["step_ns"] * recal / r["measured_ns"] - 1) for r in rows]
    # the tuner's first pick: its first row (the rows keep its order, schedule_tune.rank_candidates, which within a
    # predicted tie puts the even split and the least memory first)
    pick, best = rows[0], rows[by_meas[0]]
    lines.append(f"{len(rows)} configurations (* = the tuner's layer split); {model} model: error {stats(errs)}; "
                 f"recalibrated to the grid's {prof['schedule']} m={prof['microbatches']} (x{recal:.3f}): {stats(rerrs)}")
    if anchored is not None:
        aerrs = [abs(r["step_ns"] * anchored / r["measured_ns"] - 1) for r in rows]
        lines.append(f"the profiled configuration measured in the grid: {prof['step_in_grid_ns'] / 1e6:.2f} ms against "
                     f"{prof['step_ns'] / 1e6:.2f} ms in the profile run (x{anchored:.3f}); calibrated to it: {stats(aerrs)}")
    ci = _ratio_ci(pick.get("times_ns"), best.get("times_ns")) if pick is not best else None
    lines.append(f"tuner's first pick {pick['schedule']} m={pick['microbatches']} ({','.join(map(str, _blocks(tuple(pick['split']))))}): "
                 f"measured {pick['measured_ns'] / 1e6:.2f} ms; best measured {best['schedule']} m={best['microbatches']} "
                 f"({','.join(map(str, _blocks(tuple(best['split']))))}): {best['measured_ns'] / 1e6:.2f} ms; "
                 f"pick is {pick['measured_ns'] / best['measured_ns'] - 1:+.1%} from the best (goal: within 3%)"
                 + (f"; 95% interval of that difference over the steps measured: {ci[0]:+.1%}..{ci[1]:+.1%}" if ci else ""))
    # the workflow pipeloom.measure_candidates serves: the model prunes to its top 3, a measurement decides
    top = rows[:3]
    conf = min(top, key=lambda r: r["measured_ns"])
    lines.append(f"the tuner's top {len(top)} measured (pipeloom.measure_candidates): fastest {conf['schedule']} "
                 f"m={conf['microbatches']} ({','.join(map(str, _blocks(tuple(conf['split']))))}), "
                 f"{conf['measured_ns'] / best['measured_ns'] - 1:+.1%} from the best (from the grid's own measurements)")
    duel = doc.get("head_to_head")
    if duel:
        a, b = rows[duel["pick"]], rows[duel["other"]]
        ma, mb = statistics.median(duel["pick_times_ns"]), statistics.median(duel["other_times_ns"])
        dci = _ratio_ci(duel["pick_times_ns"], duel["other_times_ns"])
        lines.append(f"head to head ({len(duel['pick_times_ns'])} steps each, alternating, after the grid): the pick "
                     f"{ma / 1e6:.2f} ms against {'the best measured' if duel['other_is_best'] else 'the runner-up'} "
                     f"{b['schedule']} m={b['microbatches']} ({','.join(map(str, _blocks(tuple(b['split']))))}) "
                     f"{mb / 1e6:.2f} ms: pick is {ma / mb - 1:+.1%}"
                     + (f" (95% interval {dci[0]:+.1%}..{dci[1]:+.1%})" if dci else "")
                     + (f"; {a['schedule']} m={a['microbatches']} is the grid's best" if not duel["other_is_best"] else ""))
    lines += _by_round(doc)
    if has_other:
        assert key_o is not None
        oerrs = [abs(r[key_o] / r["measured_ns"] - 1) for r in rows]
        opick = min(rows, key=lambda r: r[key_o])
        lines.append(f"{other} model on the same grid: error {stats(oerrs)}; its pick {opick['schedule']} "
                     f"m={opick['microbatches']} ({','.join(map(str, _blocks(tuple(opick['split']))))}) is "
                     f"{opick['measured_ns'] / best['measured_ns'] - 1:+.1%} from the best")
    for label, cal_v in (prof.get("variants") or {}).items():
        key = "step_ns_" + label
        if all(key in r for r in rows):
            verrs = [abs(r[key] / r["measured_ns"] - 1) for r in rows]
            vpick = min(rows, key=lambda r: r[key])
            lines.append(f"variant {label} (calibration x{cal_v:.3f}): error {stats(verrs)}; its pick {vpick['schedule']} "
                         f"m={vpick['microbatches']} is {vpick['measured_ns'] / best['measured_ns'] - 1:+.1%} from the best")
    pb = prof.get("busy")
    if pb and pb.get("host_busy_traced_ns"):
        def ms(v: list[float]) -> str:
            return "/".join(f"{x / 1e6:.1f}" for x in v)

        lines.append(f"profile busy ms per rank, host | device: model {ms(pb['model_host'])} | {ms(pb['model_device'])}; "
                     f"traced {ms(pb['host_busy_traced_ns'])} | {ms(pb.get('device_busy_traced_ns') or []) or '-'} "
                     "(model: launch + runtime + sends per action, full batch; traced: action spans, median full step)")
    if doc.get("seconds"):  # (absent from a grid reconstructed from its printed table)
        lines.append(f"time: profile + tune {doc['seconds']['profile_and_tune']:.0f} s, total {doc['seconds']['total']:.0f} s"
                     + (f"; each rank pinned to {doc['cpu_pin']} CPUs (--cpu-pin)" if doc.get("cpu_pin") else ""))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="s", choices=sorted(SIZES))
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU/gloo (the whole path in seconds)")
    p.add_argument("--names", default="1F1B,GPipe,Interleaved1F1B,ZBVZeroBubble,DualPipeV")
    p.add_argument("--microbatches", default="8,16,32")
    p.add_argument("--profile", default="Interleaved1F1B:16:2,1,3,2",
                   help="NAME:MICROBATCHES:BLOCKS of the profiling run; an uneven split (stages holding different "
                   "numbers of blocks) lets the tuner tell each action's fixed host time from its layers'")
    p.add_argument("--profile-iw", default="ZBVZeroBubble:16:2,1,3,2",
                   help="NAME:MICROBATCHES:BLOCKS of a second profile with a split backward (I and W; same blocks), "
                   "whose I and W the tuner takes as measured ('' : none: I and W as shares of B)")
    p.add_argument("--profile-steps", type=int, default=3, help="per batch size")
    p.add_argument("--search", type=int, default=3, help="layer-split search for this many of the best")
    p.add_argument("--trace-grid", action="store_true", help="trace every grid configuration (grid00.jsonl ... under "
                   "--out, row i of tune_grid.json in gridI.jsonl); the timed steps then carry the recording")
    p.add_argument("--device-model", choices=("lanes", "max"), default="lanes",
                   help="the tuner's model of host and device (schedule_tune.DEVICE_MODELS); the other one's "
                   "predictions are printed beside it")
    p.add_argument("--synced-device", action="store_true",
                   help="GPUs: take the device side from a profile run with a device sync per action (check_finite) "
                   "instead of the engine's CUDA-event device times of the untouched traced run")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (>= 1), the order reversed every other one")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--final-rounds", type=int, default=6,
                   help="after the grid, the tuner's pick and the best measured row (the runner-up if the pick is the "
                        "best) timed again in this many alternating rounds of --steps (0: none)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--also-split", metavar="B1,B2,...", action="append", default=None,
                   type=lambda t: [int(x) for x in t.split(",")],
                   help="also measure this split (blocks per stage) for every configuration with as many stages "
                   "(repeatable), e.g. --names 1F1B --microbatches 8 --also-split 5,3: the searched split against "
                   "the even one whatever the search finds")
    p.add_argument("--cpu-pin", action="store_true",
                   help="pin each rank's process to its own equal share of the CPUs (no two ranks' threads on one "
                   "core): whether a configuration's slow rounds follow where the OS put the host threads")
    p.add_argument("--out", default="/tmp/tunegrid")
    p.add_argument("--table", metavar="JSON", default=None, help="print the table of an earlier run's tune_grid.json")
    p.add_argument("--overlap-backward", choices=sorted(OVERLAP), default="auto",
                   help="the runtime's host_overlap_backward the tuner predicts with (default auto, what the grid runs "
                   "with: the runtime's default); 'off' to --replay a grid measured before session J (every backward "
                   "inline); the variant lanes-inline prints the inline prediction beside it")
    p.add_argument("--device-times", choices=("learned", "mean"), default="learned",
                   help="--replay: the profile's device times as the runtime learns them and the host's forwards "
                   "launched alone (schedule_tune.gpu_profile_costs; default), or 'mean': the device times' means and "
                   "every forward's span (the model before session L)")
    p.add_argument("--replay", metavar="DIR", nargs="+", default=None,
                   help="no run: predict saved grids again with the tuner as it is now (each DIR holds a run's "
                   "tune_grid.json and profile traces, e.g. benchmarks/results/tunegrid-sessionI/grid-a) and print "
                   "the table, with the recorded and the current tuner's first pick and errors (uses --search, "
                   "--device-model)")
    args = p.parse_args()
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be >= 1")
    if args.final_rounds < 0:
        p.error("--final-rounds must be >= 0")
    if args.table:
        with open(args.table) as f:
            print(format_grid(json.load(f)))
        return
    if args.replay:
        for i, directory in enumerate(args.replay):
            doc, summary = replay(directory, search=args.search, device_model=args.device_model,
                                  overlap_backward=OVERLAP[args.overlap_backward],
                                  learned=args.device_times == "learned")
            print(("\n" if i else "") + f"=== {directory} (replayed)")
            print(format_grid(doc))
            print("\n".join(summary))
        return
    if args.smoke:
        args.size = "smoke"
        args.microbatches = "4,8,16" if args.microbatches == p.get_default("microbatches") else args.microbatches
        args.profile = "Interleaved1F1B:8:2,1,3,2" if args.profile == p.get_default("profile") else args.profile
        args.profile_iw = "ZBVZeroBubble:8:2,1,3,2" if args.profile_iw == p.get_default("profile_iw") else args.profile_iw
    args.layers, args.hidden, args.heads, args.batch, args.seq, args.vocab = SIZES[args.size]
    for blocks in args.also_split or []:
        if sum(blocks) != args.layers or min(blocks) < 1:
            p.error(f"--also-split {','.join(map(str, blocks))}: give every stage at least one of the {args.layers} blocks")
    os.makedirs(args.out, exist_ok=True)
    _rank_main(args)


if __name__ == "__main__":
    main()
