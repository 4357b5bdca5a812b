"""How far a rank's host runs ahead of its device, from a torch.profiler trace (``gpu_pipeline.py --profile-dir``).

    python benchmarks/profile_lead.py TRACE.json[.gz] [TRACE2 ...] [--bin-ms 20]

For each trace (one rank, one engine), from the CUDA runtime's launch calls and the kernels they launched
(correlation ids):

- **lead**: per time bin, the median of (kernel start - its launch) on the busiest stream: milliseconds mean the
  host runs ahead and the device never waits for it; tens of microseconds mean the device runs each kernel as soon
  as the host launches it (the step is the host's).  Session O: pipeloom's last rank 0.01-0.5 ms in the steady
  state, torch's 10-30 ms.
- **switches**: between two actions (launch groups separated by NCCL launches), the host time from one action's
  last kernel launch to the next one's first (median, mean), and the device gap between them.
- **spans**: per launch group size (kernels), the median host span (first to last launch) and device span.

Two traces of the same rank (pipeloom and torch) side by side say whether the host is slower per action, or
leaves the device waiting between actions (``benchmarks/RESULTS.md``, session O).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
from typing import Any


def _load(path: str) -> list[dict[str, Any]]:
    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def analyse(events: list[dict[str, Any]], bin_ms: float = 20.0) -> dict[str, Any]:
    """The lead, switch and span figures of one trace (see the module docstring)."""
    kernels = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("kernel", "gpu_memset")}
    launches = []  # (host ts, is nccl, kernel start, kernel end, stream)
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and ("aunch" in e["name"] or "Memset" in e["name"]):
            k = kernels.get(e.get("args", {}).get("correlation"))
            if k is None:
                continue
            start = float(k["ts"])
            launches.append((float(e["ts"]), "nccl" in k["name"].lower(), start, start + float(k.get("dur", 0)),
                             k["args"].get("stream")))
    launches.sort()
    compute = [x for x in launches if not x[1]]
    if not compute:
        return {"kernels": 0}
    main = collections.Counter(x[4] for x in compute).most_common(1)[0][0]
    t0 = min(x[2] for x in compute)
    bins: dict[int, list[float]] = collections.defaultdict(list)
    for host, _, start, _, stream in compute:
        if stream == main:
            bins[int((start - t0) / (bin_ms * 1e3))].append(start - host)
    lead = [(b * bin_ms, statistics.median(v), len(v)) for b, v in sorted(bins.items())]
    groups: list[list[tuple[Any, ...]]] = []
    cur: list[tuple[Any, ...]] = []
    switches = []
    for i, x in enumerate(launches):
        if x[1]:
            if cur:
                groups.append(cur)
                cur = []
            continue
        if i and launches[i - 1][1] and groups:  # the first launch after NCCL launches: a switch
            prev = groups[-1][-1]
            switches.append((x[0] - prev[0], x[2] - prev[3]))
        cur.append(x)
    if cur:
        groups.append(cur)
    spans: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    for g in groups:
        spans[len(g)].append((g[-1][0] - g[0][0], g[-1][3] - g[0][2]))
    return {
        "kernels": len(compute),
        "lead": lead,
        "switches": len(switches),
        "switch_host_us": (statistics.median(s for s, _ in switches), statistics.mean(s for s, _ in switches)) if switches else None,
        "switch_device_gap_us": statistics.median(d for _, d in switches) if switches else None,
        "spans": {n: (len(v), statistics.median(a for a, _ in v), statistics.median(b for _, b in v))
                  for n, v in sorted(spans.items()) if len(v) >= 3},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--bin-ms", type=float, default=20.0, help="the lead's time bins (ms)")
    args = ap.parse_args(argv)
    for path in args.traces:
        r = analyse(_load(path), args.bin_ms)
        print(f"== {path}: {r['kernels']} compute kernels")
        if not r["kernels"]:
            continue
        if r["switch_host_us"]:
            print(f"switches: {r['switches']}, host median {r['switch_host_us'][0]:.0f} us (mean {r['switch_host_us'][1]:.0f}), "
                  f"device gap median {r['switch_device_gap_us']:.0f} us")
        for n, (count, host, dev) in r["spans"].items():
            print(f"actions of {n} kernels x{count}: host span median {host:.0f} us, device span median {dev:.0f} us")
        print("lead (kernel start - launch), median per bin:")
        for t, med, n in r["lead"]:
            print(f"  {t:8.0f} ms  {med / 1e3:8.2f} ms  ({n} kernels)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
