"""``pipeloom schedule``: look at, export, check and simulate pipeline schedules.

The subcommands are thin shells over :mod:`pipeloom.schedules`, so what the
command prints is exactly what the library computes (the tests compare the
two).  They exist because a schedule is easiest to reason about as a picture
(``show``), easiest to hand-edit or share as a CSV (``export``, which torch's
``_load_csv`` and torchtitan read too), and easiest to trust once a validator
and a cost model have looked at it (``check``, ``simulate``).

Exit codes follow the usual convention for checkers:

* 0 -- done (and, for ``check``, the schedule is valid);
* 1 -- ``check`` or ``simulate`` found problems in the schedule itself;
* 2 -- the request could not be carried out: unknown schedule name, a
  configuration the schedule rejects, a file that is missing or not a schedule
  CSV.  The message says which rule or which cell; never a traceback, since
  these are user errors, not bugs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from pipeloom.schedules import (
    SCHEDULE_NAMES,
    ActionParseError,
    Costs,
    Schedule,
    ScheduleConfigError,
    ScheduleError,
    ScheduleProblem,
    SimulationResult,
    canonical_name,
    dumps_csv,
    format_grid,
    generate,
    load_csv,
    lower,
    placement_style,
    simulate,
    validate,
)
from pipeloom.schedules.dispatch import stage_streams as resolve_streams

__all__ = ["add_parser"]

#: Errors a user can act on: reported in one line, exit status 2.
_USER_ERRORS: tuple[type[BaseException], ...] = (ScheduleConfigError, ScheduleError, ActionParseError, OSError)

#: Columns of the grid that ``check`` prints around a problem.
_GRID_STEPS = 10

_Handler = Callable[[argparse.Namespace], int]


class _UsageError(Exception):
    """A combination of arguments that argparse alone cannot reject."""


def add_parser(subparsers: Any) -> None:
    """Register ``schedule`` and its subcommands on the ``pipeloom`` parser."""
    names = ", ".join(SCHEDULE_NAMES)
    parser = subparsers.add_parser(
        "schedule",
        help="show, export, check and simulate pipeline schedules",
        description=f"Show, export, check and simulate pipeline schedules. Named schedules: {names}.",
    )
    sub = parser.add_subparsers(dest="schedule_command", metavar="SUBCOMMAND")
    sub.required = True

    show = sub.add_parser("show", help="print a named schedule as a rank-by-step grid")
    _add_generator_args(show, required=True)
    show.add_argument("--lowered", action="store_true", help="add sends/receives (and FSDP, grad reduction) first")
    show.add_argument("--fsdp", action="store_true", help="with --lowered: add UNSHARD/RESHARD (implies --lowered)")
    _add_recv_arg(show)
    show.add_argument("--max-steps", type=_positive_int, metavar="N", help="show at most N columns")
    show.set_defaults(func=_guarded(_cmd_show))

    export = sub.add_parser("export", help="write a named schedule as CSV (torch's _load_csv format)")
    _add_generator_args(export, required=True)
    export.add_argument("--lowered", action="store_true", help="export the lowered schedule (with communication)")
    export.add_argument("--fsdp", action="store_true", help="with --lowered: add UNSHARD/RESHARD (implies --lowered)")
    _add_recv_arg(export)
    export.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of standard output")
    export.set_defaults(func=_guarded(_cmd_export))

    check = sub.add_parser("check", help="validate a schedule CSV (exit 0 valid, 1 invalid, 2 unreadable)")
    check.add_argument("file", metavar="FILE.csv")
    check.add_argument("--ranks", type=_positive_int, metavar="P", help="expected number of ranks (rows)")
    check.set_defaults(func=_guarded(_cmd_check))

    simulate_p = sub.add_parser("simulate", help="estimate makespan, bubbles and memory of a schedule")
    simulate_p.add_argument("target", nargs="?", metavar="NAME|FILE.csv",
                            help="a named schedule (lowered first) or a CSV file (as loaded); with --costs-from, "
                            "default: the run's schedule, ranks, microbatches and stages per rank")
    _add_generator_args(simulate_p, required=False)
    simulate_p.add_argument("--fsdp", action="store_true", help="for a NAME: lower with UNSHARD/RESHARD")
    _add_recv_arg(simulate_p)
    simulate_p.add_argument(
        "--costs",
        type=_parse_costs,
        default=None,
        metavar="SPEC",
        help="action durations, e.g. F=1,B=2,I=1,W=1 (see the README for every key)",
    )
    simulate_p.add_argument(
        "--costs-from",
        metavar="RUN.jsonl",
        default=None,
        help="per-stage, per-type mean costs and transfer times measured on a recorded run (times in ns; "
        "see `pipeloom trace compare` to set the plan against the run)",
    )
    simulate_p.add_argument(
        "--policy",
        default=None,
        metavar="P1,P2",
        help="simulate dispatch policies instead of the list alone: static (the list order), dynamic (today's "
        "dispatcher), critical (longest remaining path first, W as filler), on uneven work (see --lengths, --jitter, "
        "--slow); NAME may be 'all' (every named schedule). Prints each policy's mean step time and its gain over static",
    )
    simulate_p.add_argument("--lengths", default="0.25:1", metavar="LO:HI",
                            help="with --policy: microbatch lengths uniform in LO..HI of the longest (compute follows "
                            "length; 'fixed' for equal lengths; default 0.25:1)")
    simulate_p.add_argument("--jitter", type=float, default=0.0, metavar="SIGMA",
                            help="with --policy: every action's cost times 1 + SIGMA * N(0,1) (default 0)")
    simulate_p.add_argument("--slow", default=None, metavar="R:X", help="with --policy: rank R's costs times X (R:X,R:X...)")
    simulate_p.add_argument("--trials", type=_positive_int, default=20, metavar="N", help="with --policy: random draws averaged (default 20)")
    simulate_p.add_argument("--seed", type=int, default=0, help="with --policy: random seed (default 0)")
    simulate_p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    simulate_p.add_argument(
        "--trace",
        metavar="OUT",
        default=None,
        help="also write the simulated step as a pipeloom trace (one cost unit = 1 ms) for `pipeloom trace view`",
    )
    simulate_p.add_argument(
        "--device-model",
        choices=("lanes", "one-lane"),
        default="lanes",
        help="with --costs-from a GPU run whose trace has device times: 'lanes' (default) simulates as `schedule tune` "
        "does, each rank's host launching its list ahead of its device (host launch times and device times from the "
        "trace, the runtime's commit horizon and backward overlap); 'one-lane' takes each action's host span as its "
        "duration (a CPU run's model, where the span is the compute)",
    )
    simulate_p.set_defaults(func=_guarded(_cmd_simulate))

    tune_p = sub.add_parser(
        "tune",
        help="rank schedules x microbatches x stages per rank by simulated step time, with a run's measured costs",
        description="From a recorded run's measured costs (see `simulate --costs-from`), simulate every candidate "
        "configuration (schedule, microbatches, stages per rank; same ranks and global batch) and print the fastest "
        "that fit the memory cap, with their predicted step time, bubble and peak activation memory. How costs are "
        "scaled to other configurations: see the README.",
    )
    tune_p.add_argument("--costs-from", required=True, metavar="RUN.jsonl",
                        help="a recorded run (trace); a GPU run's trace holds each action's device time (CUDA events) "
                        "beside its host span, and gives both sides (no --host-costs-from needed)")
    tune_p.add_argument("--host-costs-from", default=None, metavar="RUN.jsonl",
                        help="GPUs: the same configuration recorded again without device syncs, when --costs-from was "
                        "recorded with check_finite (a sync per action: its spans are device time, this run's the "
                        "host's launch time); each rank's host then launches ahead of its device (see --device-model)")
    tune_p.add_argument("--device-model", choices=("lanes", "max"), default="lanes",
                        help="with --host-costs-from: 'lanes' (default) each rank's host launches its list, committing "
                        "ahead of the device by --commit-ms of queued device work, and the device runs each action once "
                        "launched and its inputs landed (what the runtime does); 'max' one lane, each action the longer "
                        "of its host path and its device time (the older model)")
    tune_p.add_argument("--commit-ms", type=float, default=10.0, metavar="MS",
                        help="with --device-model lanes: the runtime's gpu_commit_ms the candidates run with (default 10)")
    tune_p.add_argument("--host-overlap-backward", choices=("auto", "on", "off"), default="auto",
                        help="with --device-model lanes: the runtime's host_overlap_backward the candidates run with: "
                        "'auto' (its default) a B followed by an F is launched beside it where the runtime's rule says "
                        "so on the candidate's host and device costs, 'on' always, 'off' never (the inline launch)")
    tune_p.add_argument("--commit-launches", type=float, default=3.0, metavar="N",
                        help="with --device-model lanes: the runtime's gpu_commit_launches (default 3): the horizon also "
                        "covers N launches of the slowest action type")
    tune_p.add_argument("--schedules", default=None, metavar="A,B", help="schedule names to try (default: every named schedule)")
    tune_p.add_argument("--microbatches", "-m", default=None, metavar="M1,M2",
                        help="microbatch counts to try (default: P, 2P, 4P, 8P and the run's)")
    tune_p.add_argument("--stages-per-rank", "-v", default="1,2", metavar="V1,V2", help="stages per rank to try (default 1,2)")
    tune_p.add_argument("--memory-cap", default=None, metavar="SIZE", help="per-rank activation memory cap, e.g. 8GiB")
    tune_p.add_argument("--activation-memory", default=None, metavar="SIZE",
                        help="activation memory of one microbatch on one stage in the recorded run (default: the "
                        "stage-boundary activation size, a lower bound)")
    tune_p.add_argument("--layers", type=_positive_int, default=None, metavar="N",
                        help="the stage function can split the model's N layers anywhere (split_by_fqn, a layer list): "
                        "stages hold whole layers, equal weights")
    tune_p.add_argument("--layer-weights", default=None, metavar="W1,W2,...",
                        help="the same with each layer's relative cost (e.g. FLOPs per token: an embedding ~0, a vocabulary "
                        "head heavy); a recorded stage's measured cost is shared among its layers by these weights")
    tune_p.add_argument("--recorded-split", default=None, metavar="C1,C2,...",
                        help="layers per stage in the recorded run (default: the even split)")
    tune_p.add_argument("--search-split", type=int, default=None, metavar="K",
                        help="search the layer split of the K fastest candidates (default 3 with --layers/--layer-weights)")
    tune_p.add_argument("--no-calibrate", action="store_true",
                        help="print the simulated step times as they are (default: scaled so that the recorded "
                        "configuration's is its measured median)")
    tune_p.add_argument("--top", type=_positive_int, default=5, metavar="K", help="configurations to print (default 5)")
    tune_p.add_argument("--json", action="store_true", help="print one JSON object")
    tune_p.set_defaults(func=_guarded(_cmd_tune))


# ---------------------------------------------------------------- arguments


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parse_costs(text: str) -> Costs:
    try:
        return Costs.parse(text)
    except (ValueError, TypeError, KeyError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_generator_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    if required:
        parser.add_argument("name", metavar="NAME", help="schedule name, e.g. 1F1B, Interleaved1F1B, ZBVZeroBubble")
    parser.add_argument("--ranks", "-p", type=_positive_int, required=required, metavar="P", help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=_positive_int, required=required, metavar="M", help="microbatches per step")
    parser.add_argument(
        "--stages-per-rank", "-v", type=_positive_int, default=None, metavar="V", help="stages per rank (default: the schedule's)"
    )


def _add_recv_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--recv",
        choices=("late", "early"),
        default=None,
        help="where lowering puts receives: right before their consumer (late, the default) or as soon as the "
        "simulated sender posts (early, for runtimes that post receives in list order); implies --lowered",
    )


def _guarded(handler: _Handler) -> _Handler:
    """Turn user errors into one line on stderr and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except BrokenPipeError:  # `... | head`: the reader left; cli.main handles it
            raise
        except _UsageError as exc:
            _error(str(exc))
        except _USER_ERRORS as exc:
            _error(_describe(exc))
        return 2

    run.__name__ = handler.__name__
    return run


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)


def _error(message: str) -> None:
    print(f"pipeloom schedule: error: {message}", file=sys.stderr)


# ---------------------------------------------------------------- building


def _build(name: str, args: argparse.Namespace, *, lowered: bool, costs: Costs | None = None) -> Schedule:
    """Generate ``name``; lower it if asked to (``--lowered``, or an option that only lowering uses)."""
    schedule = generate(
        canonical_name(name),
        num_ranks=args.ranks,
        num_microbatches=args.microbatches,
        stages_per_rank=args.stages_per_rank,
    )
    if lowered or args.fsdp or args.recv is not None:
        schedule = lower(schedule, comms=True, fsdp=args.fsdp, recv_placement=args.recv or "late", costs=costs)
    return schedule


def _count(schedule: Schedule) -> int:
    return sum(len(acts) for acts in schedule.actions.values())


def _describe_schedule(schedule: Schedule, label: str, *, name: str | None = None) -> str:
    """``LABEL: P ranks, S stages (V per rank, PLACEMENT placement), M microbatches, ...``."""
    ranks, stages = schedule.num_ranks, schedule.num_stages
    per_rank = f"{stages // ranks} per rank" if ranks and stages % ranks == 0 else "uneven"
    placement = _placement(schedule, name)
    form = "lowered" if schedule.lowered else "compute-only"
    return (
        f"{label}: {ranks} ranks, {stages} stages ({per_rank}, {placement} placement), "
        f"{schedule.num_microbatches} microbatches, {form}, {_count(schedule)} actions"
    )


def _placement(schedule: Schedule, name: str | None) -> str:
    if name is not None:
        return str(placement_style(name))
    ranks = schedule.num_ranks
    mapping = schedule.stage_to_rank
    if ranks and all(r == s % ranks for s, r in enumerate(mapping)):
        return "loop"
    if len(mapping) == 2 * ranks and all(r == (s if s < ranks else 2 * ranks - 1 - s) for s, r in enumerate(mapping)):
        return "v"
    return "custom"


def _is_file(target: str) -> bool:
    return target.lower().endswith(".csv") or os.sep in target or os.path.exists(target)


# ---------------------------------------------------------------- subcommands


def _cmd_show(args: argparse.Namespace) -> int:
    name = canonical_name(args.name)
    schedule = _build(name, args, lowered=args.lowered)
    print(_describe_schedule(schedule, name, name=name))
    print(format_grid(schedule, max_steps=args.max_steps))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    schedule = _build(args.name, args, lowered=args.lowered)
    text = dumps_csv(schedule)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    with open(args.output, "w", newline="") as f:
        f.write(text)
    print(f"wrote {args.output}: {_describe_schedule(schedule, canonical_name(args.name), name=canonical_name(args.name))}", file=sys.stderr)
    return 0


def _report_problems(schedule: Schedule, problems: Sequence[ScheduleProblem], source: str) -> None:
    """Every problem on its own line, then the grid around the first one that has a place."""
    print(f"invalid: {source}: {len(problems)} problem{'s' if len(problems) != 1 else ''}")
    for problem in problems:
        print(f"  {problem}")
    located = next((p for p in problems if p.position is not None and p.rank in schedule.actions), None)
    if located is not None and located.rank is not None and located.position is not None:
        print()
        print(f"first located problem, rank {located.rank}, position {located.position}:")
        print(format_grid(schedule, mark=(located.rank, located.position), max_steps=_GRID_STEPS))


def _cmd_check(args: argparse.Namespace) -> int:
    schedule = load_csv(args.file, num_ranks=args.ranks)
    problems = validate(schedule)
    if problems:
        _report_problems(schedule, problems, args.file)
        return 1
    print(f"valid: {_describe_schedule(schedule, args.file)}")
    return 0


def _load_target(args: argparse.Namespace) -> tuple[Schedule, str, str | None]:
    """The schedule to simulate, its label, and its generator name (None for a file)."""
    if args.target is None:
        raise _UsageError("give a schedule NAME or FILE.csv (or --costs-from RUN.jsonl to simulate the run's configuration)")
    if _is_file(args.target):
        if args.microbatches is not None or args.stages_per_rank is not None or args.fsdp or args.recv is not None:
            raise _UsageError("--microbatches, --stages-per-rank, --fsdp and --recv apply to a NAME, not to a CSV file")
        return load_csv(args.target, num_ranks=args.ranks), args.target, None
    if args.ranks is None or args.microbatches is None:
        raise _UsageError(f"simulating the named schedule {args.target!r} needs --ranks and --microbatches")
    name = canonical_name(args.target)
    # Early receives are placed by simulating the timeline: use the costs being simulated.
    return _build(name, args, lowered=True, costs=args.costs), name, name


def _run_costs(path: str, *, flag: str = "--costs-from", typical: bool = False, both_sides: bool = False) -> Any:
    """:func:`~pipeloom.tools.run_costs.costs_from_trace` of a run, user errors as _UsageError.

    ``both_sides``: a GPU run whose trace has the actions' device times (``device`` events) gives its device
    side and its host side at once (:func:`~pipeloom.tools.schedule_tune.gpu_profile_costs`: the device times
    as the runtime learns them, the forwards' host time as launched alone)."""
    from .run_costs import costs_from_trace
    from .schedule_tune import gpu_profile_costs
    from .trace_model import load_trace

    try:
        model = load_trace(path)
        if both_sides and model.device_ns:
            # the device side as the runtime learns it, the host's forwards as launched alone (see gpu_profile_costs)
            return gpu_profile_costs(model, typical=typical)
        return costs_from_trace(model, typical=typical)
    except ValueError as exc:
        raise _UsageError(f"{flag} {path}: {exc}") from None


def _policy_args(args: argparse.Namespace) -> tuple[list[str], tuple[float, float] | None, dict[int, float]]:
    from pipeloom.schedules import POLICIES

    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise _UsageError(f"--policy {args.policy!r}: policies are {', '.join(POLICIES)}")
    if "static" not in policies:
        policies.insert(0, "static")
    lengths: tuple[float, float] | None = None
    if args.lengths.lower() != "fixed":
        try:
            lo, hi = (float(x) for x in args.lengths.split(":"))
        except ValueError:
            raise _UsageError(f"--lengths {args.lengths!r}: expected LO:HI (e.g. 0.25:1) or 'fixed'") from None
        if not 0 < lo <= hi:
            raise _UsageError(f"--lengths {args.lengths!r}: needs 0 < LO <= HI")
        lengths = (lo, hi)
    slow: dict[int, float] = {}
    for item in (args.slow or "").split(","):
        if not item.strip():
            continue
        try:
            r, x = item.split(":")
            slow[int(r)] = float(x)
        except ValueError:
            raise _UsageError(f"--slow {args.slow!r}: expected RANK:FACTOR[,RANK:FACTOR...]") from None
    if args.jitter < 0:
        raise _UsageError("--jitter must be >= 0")
    return policies, lengths, slow


def _cmd_policy(args: argparse.Namespace) -> int:
    from pipeloom.schedules import default_stages_per_rank, policy_ceiling

    policies, lengths, slow = _policy_args(args)
    if args.ranks is None or args.microbatches is None:
        raise _UsageError("--policy needs a NAME (or 'all') with --ranks and --microbatches")
    names = list(SCHEDULE_NAMES) if args.target.lower() == "all" else [canonical_name(args.target)]
    costs = args.costs if args.costs is not None else Costs()
    rows = []
    for name in names:
        try:
            sched = generate(name, num_ranks=args.ranks, num_microbatches=args.microbatches,
                             stages_per_rank=args.stages_per_rank or default_stages_per_rank(name))
        except ScheduleConfigError as exc:
            if len(names) == 1:
                raise
            rows.append({"schedule": name, "skipped": str(exc)})
            continue
        means = policy_ceiling(sched, costs, policies=policies, trials=args.trials, seed=args.seed, length_range=lengths,
                               jitter=args.jitter, slow=slow)
        rows.append({"schedule": name, "mean_step": means,
                     "gain_over_static": {p: means["static"] / v - 1 if v else 0.0 for p, v in means.items() if p != "static"}})
    if args.json:
        print(json.dumps({"policies": policies, "lengths": lengths, "jitter": args.jitter, "slow": slow, "trials": args.trials,
                          "costs": asdict(costs), "schedules": rows}, indent=2))
        return 0
    work = "fixed lengths" if lengths is None else f"lengths uniform in {lengths[0]:g}..{lengths[1]:g} of the longest"
    extra = (f", jitter {args.jitter:g}" if args.jitter else "") + (f", slow {slow}" if slow else "")
    print(f"policies on uneven work ({work}{extra}; mean step time over {args.trials} draws; gain = static / policy - 1):")
    cols = [*policies, "best", "bound"]
    table = [("schedule", *cols)]
    for r in rows:
        if "skipped" in r:
            table.append((r["schedule"], *(["-"] * len(cols))))
            continue
        cells = []
        for p in cols:
            v = r["mean_step"][p]
            cells.append(_num(round(v, 3)) if p == "static" else f"{_num(round(v, 3))} ({r['gain_over_static'][p]:+.1%})")
        table.append((r["schedule"], *cells))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    print("best: each draw's best policy; bound: no dispatch order can beat it (per rank: the earliest any of its "
          "actions can start + all its work + the shortest chain after it; or the longest chain), the ceiling of any "
          "reordering (not necessarily reachable)")
    skipped = [r for r in rows if "skipped" in r]
    for r in skipped:
        print(f"{r['schedule']}: skipped ({r['skipped']})")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    if args.policy is not None:
        if args.target is None:
            raise _UsageError("--policy needs a NAME (or 'all')")
        return _cmd_policy(args)
    run = None
    if args.costs_from is not None:
        if args.costs is not None:
            raise _UsageError("give --costs or --costs-from, not both")
        run = _run_costs(args.costs_from)
        if args.target is None:
            if not run.schedule or not run.num_microbatches:
                raise _UsageError(f"{args.costs_from}: the header names no schedule and microbatch count; give NAME -p -m")
            args.target = run.schedule
            args.ranks = args.ranks or run.world_size
            args.microbatches = args.microbatches or run.num_microbatches
            if args.stages_per_rank is None:
                args.stages_per_rank = run.stages_per_rank
        args.costs = run.costs
        if args.recv is None and not (args.target and _is_file(args.target)):
            args.recv = "early"  # pipeloom posts a receive when the sender announces it
    schedule, label, name = _load_target(args)
    # The simulator only says "cannot finish"; the validator says where and why.
    problems = validate(schedule)
    if problems:
        _report_problems(schedule, problems, label)
        return 1
    costs = args.costs if args.costs is not None else Costs()
    action_costs = run.action_costs if run is not None else None
    lanes = None
    if run is not None and name is not None and not args.fsdp and args.device_model == "lanes":
        lanes = _two_lanes(args.costs_from, name, schedule)
    if lanes is not None:
        # a GPU run: its spans are host launch times, not the compute; simulated as the tuner does
        schedule, costs, result, action_costs = lanes
    else:
        result = simulate(schedule, costs, action_costs=action_costs)
    unit = 1 if run is not None else None
    if args.trace is not None:
        _write_simulation_trace(args.trace, schedule, costs, result, time_unit_ns=unit, action_costs=action_costs)
    same = run is not None and (schedule.name, schedule.num_microbatches, list(schedule.stage_to_rank)) == (
        run.schedule, run.num_microbatches, run.stage_to_rank)
    if args.json:
        doc = _simulation_json(schedule, label, costs, result)
        if run is not None:
            doc["device_model"] = "lanes" if lanes is not None else "one-lane"
            doc["costs_from"] = {"file": args.costs_from, **run.to_json()}
            doc["time_unit"] = "ns"
            if same:
                doc["measured_step_ns"] = run.step_ns
        print(json.dumps(doc, indent=2))
    else:
        print(_describe_schedule(schedule, label, name=name))
        if run is not None and lanes is not None:
            print(f"costs measured on {args.costs_from} (steps {', '.join(map(str, run.steps))}), in ns: host launch "
                  "times and device times (CUDA events) apart; two lanes, as `schedule tune`: each rank's host launches "
                  "its list ahead of its device, within the runtime's commit horizon, backwards launched beside "
                  "forwards where host_overlap_backward's auto rule would; per stage, host: "
                  + ", ".join(f"{s}{t}={v / 1000:.1f}us" for (s, t, _), v in sorted(action_costs.items()) if t in "FBIW"))
        elif run is not None:
            print(f"costs measured on {args.costs_from} (steps {', '.join(map(str, run.steps))}), in ns; per stage: "
                  + ", ".join(f"{s}{t}={v / 1000:.1f}us" for (s, t, _), v in sorted(run.action_costs.items()))
                  + " (mean duration + the rank's runtime time per action)")
        print(_simulation_table(costs, result))
        if same and run.step_ns:
            err = (result.makespan - run.step_ns) / run.step_ns
            print(f"measured step time {run.step_ns / 1e6:.3f} ms, simulated {result.makespan / 1e6:.3f} ms ({err:+.1%})")
    return 0


def _two_lanes(path: str, name: str, schedule: Schedule) -> tuple[Schedule, Costs, SimulationResult, Any] | None:
    """``simulate --costs-from`` a GPU run whose trace has device times: (lowered schedule, link costs, simulation,
    host costs) by ``schedule tune``'s two-lane model (:func:`~pipeloom.tools.schedule_tune._simulate`) for the
    configuration of ``schedule``; None for a run without device times (a CPU run: one lane)."""
    from pipeloom.runtime.trace import expand_paths, read_header

    from .schedule_tune import COMMIT_LAUNCHES, COMMIT_MS, _action_costs, _link_costs, _simulate

    try:
        run = _run_costs(path, both_sides=True)
    except _UsageError as exc:  # device events that do not match the host spans: the host side alone, as before
        print(f"{exc}; simulating with one lane (the host spans)", file=sys.stderr)
        return None
    if run.host is None:
        return None
    p = schedule.num_ranks
    v, m = schedule.num_stages // p, schedule.num_microbatches
    # as the run ran: its RuntimeOptions from the trace header (runs recorded before it carried them: defaults)
    try:
        opts = read_header(expand_paths(path)[0]).get("options") or {}
    except (OSError, ValueError):
        opts = {}
    overlap = opts.get("host_overlap_backward")
    # the schedule validated above (lowered as asked: --recv), not one the tuner would lower itself
    _, result = _simulate(run, name, p, v, m, lowered={(name, p, v, m): (schedule, schedule)},
                          commit_ns=float(opts.get("gpu_commit_ms", COMMIT_MS)) * 1e6,
                          commit_launches=float(opts.get("gpu_commit_launches", COMMIT_LAUNCHES)),
                          # (a run recorded before auto: True, the default then)
                          stage_streams=resolve_streams(opts.get("overlap_streams", True),
                                                      [a for row in schedule.actions.values() for a in row]),
                          overlap_backward="auto" if overlap is None else bool(overlap),
                          # the auto rule's margin (runs recorded before session M: none, 1.0)
                          overlap_margin=float(opts.get("overlap_margin", 1.0)))
    host, _, _ = _action_costs(run, p, v, m, schedule.stage_to_rank, lanes=True)
    return schedule, _link_costs(run, m), result, host


def _write_simulation_trace(path: str, schedule: Schedule, costs: Costs, result: SimulationResult, *,
                            time_unit_ns: int | None = None, action_costs: Any = None) -> None:
    """The simulated step in the trace format (see :mod:`pipeloom.tools.trace_export` for the time scale)."""
    from .trace_export import SIMULATION_UNIT_NS, simulation_trace
    from .trace_model import trace_api

    unit = SIMULATION_UNIT_NS if time_unit_ns is None else time_unit_ns
    header, events = simulation_trace(schedule, result, costs, time_unit_ns=unit)
    if action_costs:
        header["action_costs"] = {f"{s}{t}" + ("" if m is None else f"@{m}"): v for (s, t, m), v in sorted(action_costs.items(), key=str)}
    trace_api().write_trace(path, header, events)
    what = f"1 time unit = {unit // 1_000_000} ms" if unit >= 1_000_000 else f"1 time unit = {unit} ns"
    print(f"wrote {path}: simulated trace, {what}", file=sys.stderr)


def _simulation_json(schedule: Schedule, label: str, costs: Costs, result: SimulationResult) -> dict[str, Any]:
    return {
        "schedule": label,
        "num_ranks": schedule.num_ranks,
        "num_stages": schedule.num_stages,
        "num_microbatches": schedule.num_microbatches,
        "lowered": schedule.lowered,
        "num_actions": _count(schedule),
        "costs": asdict(costs),
        "makespan": result.makespan,
        "bubble_fraction": result.overall_bubble_fraction,
        "ranks": [
            {
                "rank": r,
                "busy": result.busy[r],
                "idle": result.idle[r],
                "bubble_fraction": result.bubble_fraction[r],
                "peak_live_activations": result.peak_live_activations[r],
            }
            for r in sorted(result.busy)
        ],
    }


def _simulation_table(costs: Costs, result: SimulationResult) -> str:
    lines = [
        "costs: " + ", ".join(f"{k}={_num(v)}" for k, v in asdict(costs).items()),
        f"makespan: {_num(result.makespan)}",
        f"bubble: {result.overall_bubble_fraction:.1%} overall (idle time / (ranks x makespan))",
        "",
    ]
    rows = [("rank", "busy", "idle", "bubble", "peak activations")]
    for r in sorted(result.busy):
        rows.append(
            (
                str(r),
                _num(result.busy[r]),
                _num(result.idle[r]),
                f"{result.bubble_fraction[r]:.1%}",
                str(result.peak_live_activations[r]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _num(value: float | int | None) -> str:
    """Costs are usually small integers; print them without a trailing ``.0``."""
    if value is None:
        return "none"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.3f}".rstrip("0")


def _int_list(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _UsageError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise _UsageError(f"{what}: expected positive integers, got {text!r}")
    return out


def _tune_layers(args: argparse.Namespace, run: Any) -> Any:
    """The :class:`~pipeloom.tools.schedule_tune.Layers` of ``--layers``/``--layer-weights``/``--recorded-split``."""
    from .schedule_tune import Layers

    if args.layers is None and args.layer_weights is None:
        if args.recorded_split is not None:
            raise _UsageError("--recorded-split needs the layers: give --layers N or --layer-weights")
        return None
    if args.layer_weights is not None:
        try:
            weights = tuple(float(w) for w in args.layer_weights.split(",") if w.strip())
        except ValueError:
            raise _UsageError(f"--layer-weights: expected comma-separated numbers, got {args.layer_weights!r}") from None
        if args.layers is not None and args.layers != len(weights):
            raise _UsageError(f"--layers {args.layers} but --layer-weights gives {len(weights)} weights")
    else:
        weights = (1.0,) * args.layers
    n0 = len(run.stage_to_rank) or 1
    try:
        recorded = tuple(_int_list(args.recorded_split, "--recorded-split") or Layers.even(len(weights), n0))
        return Layers(weights, recorded)
    except ValueError as exc:
        raise _UsageError(f"layers: {exc}") from None


def _run_margin(path: str) -> float | None:
    """The auto overlap rule's margin a recorded run ran with (its trace header; 1.0 for a run recorded before the
    header carried it); None where the header cannot be read (then the runtime's own)."""
    from .trace_model import trace_api

    api = trace_api()  # (the trace module without torch)
    try:
        opts = api.read_header(api.expand_paths(path)[0]).get("options") or {}
    except (OSError, ValueError, IndexError):
        return None
    return float(opts.get("overlap_margin", 1.0))


def _cmd_tune(args: argparse.Namespace) -> int:
    from .schedule_tune import format_tune, parse_size, tune

    # the tuner predicts the typical (median) step: costs from the typical steps (run_costs.TYPICAL)
    run = _run_costs(args.costs_from, typical=True, both_sides=args.host_costs_from is None)
    if args.host_costs_from is not None:
        from .run_costs import with_host_costs

        host = _run_costs(args.host_costs_from, flag="--host-costs-from", typical=True)
        try:
            run = with_host_costs(run, host)
        except ValueError as exc:
            raise _UsageError(f"--host-costs-from {args.host_costs_from}: {exc}") from None
    names = SCHEDULE_NAMES if args.schedules is None else [canonical_name(n.strip()) for n in args.schedules.split(",") if n.strip()]
    try:
        cap = None if args.memory_cap is None else parse_size(args.memory_cap)
        act = None if args.activation_memory is None else parse_size(args.activation_memory)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    layers = _tune_layers(args, run)
    search = args.search_split if args.search_split is not None else (3 if layers is not None else 0)
    if search and layers is None:
        raise _UsageError("--search-split needs the layers: give --layers N or --layer-weights")
    result = tune(run, schedules=names, microbatches=_int_list(args.microbatches, "--microbatches"),
                  stages_per_rank=_int_list(args.stages_per_rank, "--stages-per-rank") or [1, 2],
                  memory_cap=cap, activation_memory=act, calibrate=not args.no_calibrate, layers=layers, search=search,
                  device_model=args.device_model, commit_ms=args.commit_ms, commit_launches=args.commit_launches,
                  overlap_backward={"auto": "auto", "on": True, "off": False}[args.host_overlap_backward],
                  calibration_margin=_run_margin(args.costs_from))
    if not result.candidates:
        raise _UsageError("no candidate configuration could be simulated: " + "; ".join(result.skipped[:3]))
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(format_tune(result, top=args.top))
    return 0 if any(c.fits for c in result.candidates) else 1
