"""Does attaching the live viewer slow the job?  ``pipeloom trace attach`` on a running ``train_gpt.py``.

Issue 13 saw a run take 22.4-22.8 s with the viewer attached against 19.2 s
without, on a loaded machine.  The viewer is a separate process, but on a
small machine it competes with the ranks for the cores: it rebuilt its whole
trace model (linear in the events so far) at every 0.25 s poll, so a long
trace kept it busy all the time.  It now rebuilds at most once per
``LIVE_DUTY`` x the last rebuild's cost (``tools/trace_tui.py``).

This benchmark runs ``pipeloom launch --trace`` on ``examples/train_gpt.py``
(``--steps``, no evaluation) in ``--runs`` rounds, each round every variant
once in rotating order:

* ``none``: no viewer;
* ``attached``: a viewer attached live (the Textual app, headless, through
  ``pipeloom.tools.trace_cmd.attach_app``, exactly what ``trace attach --file``
  runs, with a virtual 160x50 screen);
* ``unthrottled``: the same viewer with the old behaviour (``LIVE_DUTY = 0``:
  a rebuild at every poll that brought events).

and reports per variant the median training time (the trace's first step
start to its last step end, so process start-up is left out) and the
viewer's CPU time.  Usage::

    python benchmarks/viewer_attach.py [--runs 3] [--steps 200] [--variants none,attached,unthrottled]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _viewer(trace: str, unthrottled: bool) -> None:
    """Child process: attach to the job writing ``trace`` and keep the app running until SIGTERM."""
    from pipeloom.tools import trace_tui
    from pipeloom.tools.trace_cmd import attach_app
    from pipeloom.tools.trace_model import trace_api

    if unthrottled:
        trace_tui.LIVE_DUTY = 0.0
    while True:
        try:
            if trace_api().read_header(trace).get("live"):
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    app = attach_app(None, trace)
    stop = asyncio.Event()

    async def main() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with app.run_test(size=(160, 50)) as pilot:
            while not stop.is_set():
                await pilot.pause(0.2)

    asyncio.run(main())
    print(json.dumps({"events": len(app.buffer.events)}), flush=True)


def _train_time(trace: str) -> float:
    from pipeloom.tools.trace_model import load_trace

    m = load_trace(trace)
    spans = [w for s, w in m.windows.items()]
    return (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--variants", default="none,attached,unthrottled")
    p.add_argument("--viewer", metavar="TRACE", default=None, help=argparse.SUPPRESS)
    p.add_argument("--unthrottled", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.viewer:
        _viewer(args.viewer, args.unthrottled)
        return
    variants = args.variants.split(",")
    out = tempfile.mkdtemp(prefix="pipeloom-viewer-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELOOM_")}
    rows: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
    for r in range(args.runs):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            trace = os.path.join(out, f"{v}-{r}.jsonl")
            t0 = time.perf_counter()
            job = subprocess.Popen([sys.executable, "-m", "pipeloom.tools.cli", "launch", "--nproc-per-node", "2",
                                    "--trace", trace, str(REPO / "examples" / "train_gpt.py"), "--steps", str(args.steps),
                                    "--eval-every", "0"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True)
            viewer = None
            if v != "none":
                viewer = subprocess.Popen([sys.executable, __file__, "--viewer", trace]
                                          + (["--unthrottled"] if v == "unthrottled" else []), env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            _, err = job.communicate()
            wall = time.perf_counter() - t0
            if job.returncode != 0:
                raise SystemExit(f"{v} run {r}: the job failed:\n{err[-2000:]}")
            cpu = 0.0
            if viewer is not None:
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                viewer.send_signal(signal.SIGTERM)
                vout, verr = viewer.communicate(timeout=60)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
                if viewer.returncode != 0:
                    raise SystemExit(f"{v} run {r}: the viewer failed:\n{verr[-2000:]}")
            rows[v].append((_train_time(trace), wall, cpu))
            print(f"run {r} {v:<12} training {rows[v][-1][0]:7.2f} s  wall {wall:7.2f} s  viewer CPU {cpu:6.2f} s", flush=True)
    base = statistics.median(t for t, _, _ in rows[variants[0]])
    print(f"\n{'variant':<12} {'training (median)':>18} {'vs ' + variants[0]:>10} {'paired':>8} {'viewer CPU (median)':>20}   runs")
    for v in variants:
        t = statistics.median(x for x, _, _ in rows[v])
        c = statistics.median(x for _, _, x in rows[v])
        # the same round's run without a viewer: the machine's drift between rounds cancels
        paired = statistics.median(a[0] / b[0] for a, b in zip(rows[v], rows[variants[0]]))
        print(f"{v:<12} {t:>16.2f} s {t / base - 1:>+10.1%} {paired - 1:>+8.1%} {c:>18.2f} s   "
              f"{' '.join(f'{x:.2f}' for x, _, _ in rows[v])}")


if __name__ == "__main__":
    main()
