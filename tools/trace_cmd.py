"""``pipeloom trace``: view, follow, export and summarise rank traces.

* ``view FILE...`` -- the terminal UI over a finished (or growing) trace;
  several files are per-rank files of one job (what ranks write under
  torchrun), merged.
* ``attach [ADDRESS] [--file FILE]`` -- the same UI on a running job,
  subscribed to the launcher's live address (``pipeloom launch --trace FILE``
  prints it and writes it into FILE's header, so ``--file FILE`` is enough);
  with ``--file`` the history so far is loaded first.
* ``export FILE... --chrome OUT.json`` -- Chrome trace JSON for Perfetto or
  ``chrome://tracing``.
* ``summary FILE... [--json] [--step N] [--skip-warmup N] [--include-eval]``
  -- the summary pane's numbers as text or JSON: attribution of every rank's
  step time, critical paths, action statistics (definitions in ``--help``).
* ``compare RUN PLAN`` -- a recorded run against a simulated plan, action by
  action (slip).

Every FILE may be the path the job was given (``PATH`` for the
``PATH.rank{R}`` files ranks write without the collecting launcher); files
of different jobs, or a plan mixed with a run, are refused (exit 2).

The commands import neither torch nor (except ``view``/``attach``) textual,
so they start at once.  Exit status: 0 done, 2 the request could not be
carried out (a missing or malformed file, no live address); the message
names the file and line, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_parser", "attach_app"]


class _UserError(Exception):
    pass


def add_parser(subparsers: Any) -> None:
    """Register ``trace`` and its subcommands on the ``pipeloom`` parser."""
    parser = subparsers.add_parser("trace", help="view, follow, export and summarise rank traces",
                                   description="View, follow, export and summarise pipeloom rank traces.")
    sub = parser.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    sub.required = True

    view = sub.add_parser("view", help="interactive timeline of a trace (q quits)")
    view.add_argument("files", nargs="+", metavar="FILE", help="a trace, or the per-rank files of one job")
    view.add_argument("--plan", metavar="PLAN.jsonl", default=None,
                      help="a simulated plan (schedule simulate --costs-from RUN --trace PLAN) drawn under each rank's lanes")
    view.set_defaults(func=_guarded(_cmd_view))

    attach = sub.add_parser("attach", help="the timeline of a running job, live")
    attach.add_argument("address", nargs="?", metavar="ADDRESS", help="the collector's live address, tcp://HOST:PORT")
    attach.add_argument("--file", metavar="FILE", help="the job's trace file: its history, and its live address")
    attach.set_defaults(func=_guarded(_cmd_attach))

    export = sub.add_parser("export", help="write Chrome trace JSON (Perfetto, chrome://tracing)")
    export.add_argument("files", nargs="+", metavar="FILE")
    export.add_argument("--chrome", required=True, metavar="OUT.json", help="where to write the Chrome trace")
    export.add_argument("--per-rank", action="store_true",
                        help="also write OUT.rankR.json per rank, with distributedInfo (what HTA loads)")
    export.set_defaults(func=_guarded(_cmd_export))

    from .trace_analysis import DEFINITIONS

    summary = sub.add_parser("summary", help="where the step time went: attribution, critical path, statistics",
                             description="Per rank: busy, idle and bubble, and where every nanosecond of the step "
                             "time went; per step: the critical path; per rank, stage and type: action durations; "
                             "step-time percentiles; the longest waits.",
                             epilog=DEFINITIONS, formatter_class=argparse.RawDescriptionHelpFormatter)
    summary.add_argument("files", nargs="+", metavar="FILE", help="a trace, the per-rank files of one job, or the path given to the job")
    summary.add_argument("--json", action="store_true", help="print one JSON object")
    summary.add_argument("--step", type=int, default=None, metavar="N", help="only step N")
    summary.add_argument("--skip-warmup", type=_nonneg, default=0, metavar="N", help="leave out the first N training steps")
    summary.add_argument("--include-eval", action="store_true", help="count eval steps too (left out by default)")
    summary.add_argument("--top", type=int, default=5, metavar="K", help="longest waits to list (default 5)")
    summary.set_defaults(func=_guarded(_cmd_summary))

    compare = sub.add_parser("compare", help="a recorded run against a simulated plan: per-action slip",
                             description="Set a recorded run against a plan (`pipeloom schedule simulate ... "
                             "--trace PLAN.jsonl`, best with --costs-from RUN.jsonl): for every action of a step, "
                             "its planned and actual start (from the step window's start) and duration, and the "
                             "slip (actual start - planned start).")
    compare.add_argument("run", metavar="RUN.jsonl", help="the recorded run (or the path given to the job)")
    compare.add_argument("plan", metavar="PLAN.jsonl", help="the simulated plan")
    compare.add_argument("--step", type=int, default=None, metavar="N", help="the run's step to compare (default: the last training step)")
    compare.add_argument("--json", action="store_true", help="print one JSON object")
    compare.add_argument("--top", type=int, default=10, metavar="K", help="largest slips to list (default 10; 0: every action)")
    compare.set_defaults(func=_guarded(_cmd_compare))


def _nonneg(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def _guarded(handler: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return int(handler(args) or 0)
        except BrokenPipeError:
            raise
        except (_UserError, ValueError) as exc:
            print(f"pipeloom trace: error: {exc}", file=sys.stderr)
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            print(f"pipeloom trace: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2

    run.__name__ = handler.__name__
    return run


def _load(files: list[str], *, warn: bool = True) -> Any:
    from .trace_model import load_trace

    model = load_trace(files)
    if warn and model.missing_ranks:
        given = ", ".join(files)
        print(f"pipeloom trace: warning: no events of rank{'s' if len(model.missing_ranks) > 1 else ''} "
              f"{', '.join(map(str, model.missing_ranks))} of {model.header.get('world_size')} in {given} "
              "(a per-rank file not given? give the path the job was given, or every PATH.rankN): left out",
              file=sys.stderr)
    return model


def _cmd_view(args: argparse.Namespace) -> int:
    from .trace_tui import TraceApp

    model = _load(args.files)
    plan = None
    if args.plan is not None:
        plan = _load([args.plan], warn=False)
        if plan.source != "simulation":
            raise _UserError(f"--plan {args.plan}: a recorded run, not a simulated plan")
        if model.source == "simulation":
            raise _UserError(f"{', '.join(args.files)}: a simulated plan; --plan goes with a recorded run")
    TraceApp(model, plan=plan).run()
    return 0


def attach_app(address: str | None, file: str | None) -> Any:
    """The live :class:`~pipeloom.tools.trace_tui.TraceApp` for ``trace attach`` (not running yet).

    The address is ADDRESS, else the ``live`` address in FILE's header; the
    socket subscribes before FILE's history is read, so no batch falls
    between the two (one that is in both is kept once).
    """
    from .trace_model import TraceBuffer, trace_api
    from .trace_tui import LiveSource, TraceApp

    if file is not None and not address:
        address = trace_api().read_header(file).get("live")
        if not address:
            raise _UserError(f"{file}: the header has no live address (was it written by `pipeloom launch --trace`?)")
    if not address:
        raise _UserError("give the collector's live address (tcp://HOST:PORT) or --file FILE")
    try:
        source = LiveSource(str(address))
    except Exception as exc:  # zmq.ZMQError: a malformed address
        raise _UserError(f"cannot subscribe to {address!r}: {exc}") from None
    buffer = TraceBuffer()
    if file is not None:
        tf = trace_api().read_trace(file)
        buffer = TraceBuffer(tf.header, tf.events)
    return TraceApp(buffer, live=source)


def _cmd_attach(args: argparse.Namespace) -> int:
    attach_app(args.address, args.file).run()
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .trace_export import chrome_trace

    model = _load(args.files)
    doc = chrome_trace(model)
    with open(args.chrome, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    n = sum(1 for e in doc["traceEvents"] if e.get("ph") in ("X", "b"))
    print(f"wrote {args.chrome}: {n} slices, {len(model.ranks)} ranks (open in https://ui.perfetto.dev or chrome://tracing)",
          file=sys.stderr)
    if args.per_rank:
        from .trace_export import per_rank_traces

        base = args.chrome[:-5] if args.chrome.endswith(".json") else args.chrome
        for r, d in per_rank_traces(model, doc).items():
            path = f"{base}.rank{r}.json"
            with open(path, "w") as f:
                json.dump(d, f, separators=(",", ":"))
            print(f"wrote {path}: rank {r} with distributedInfo", file=sys.stderr)
    return 0


def _cmd_summary(args: argparse.Namespace) -> int:
    from .trace_model import format_summary, summarize

    model = _load(args.files)
    if args.step is not None and args.step not in model.steps:
        raise _UserError(f"the trace has no step {args.step} (steps: {', '.join(map(str, model.steps)) or 'none'})")
    summary = summarize(model, step=args.step, top=args.top, skip_warmup=args.skip_warmup, include_eval=args.include_eval)
    if args.json:
        print(json.dumps(summary.to_json(), indent=2))
    else:
        print(format_summary(summary))
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from .trace_compare import compare, format_comparison

    run = _load([args.run])
    plan = _load([args.plan], warn=False)
    if run.source == "simulation" and plan.source != "simulation":
        raise _UserError(f"{args.run} is a simulated plan and {args.plan} a recorded run: give the run first "
                         f"(pipeloom trace compare {args.plan} {args.run})")
    if run.source == "simulation":
        raise _UserError(f"{args.run} is a simulated plan, not a recorded run")
    if plan.source != "simulation":
        raise _UserError(f"{args.plan} is a recorded run, not a simulated plan (make one with "
                         "`pipeloom schedule simulate NAME ... --costs-from RUN.jsonl --trace PLAN.jsonl`)")
    if args.step is not None and args.step not in run.steps:
        raise _UserError(f"{args.run} has no step {args.step} (steps: {', '.join(map(str, run.steps)) or 'none'})")
    result = compare(run, plan, step=args.step)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(format_comparison(result, top=args.top))
    return 0
