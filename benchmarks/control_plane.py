"""Host cost of one control-plane message: ``ControlPlane.send`` and one message received.

Why a separate micro-benchmark: in a 1F1B step every cross-rank transfer is
announced on the control plane (on NCCL always, on gloo on the slow path), and
heartbeats and aborts take the same road, so what one message costs the host
is paid on the critical path of every step.  cProfile of a whole step inflates
small Python functions several times over, so the per-message cost is measured
here directly, without a profiler, on two real ZeroMQ sockets: two
``ControlPlane`` objects in this process (ranks 0 and 1 of a world of 2), rank
0 sending to rank 1's PULL socket over loopback TCP.

* **send**: wall time of ``ControlPlane.send`` (encode, sign, ``zmq.send``
  with ``NOBLOCK``), per call, for a typical message of each type.
* **receive**: wall time inside ``ControlPlane.drain`` per message delivered
  (``recv``, HMAC check, decode, validation, handing to a handler that only
  counts, and the ``ZMQ_EVENTS`` read that ends the drain), i.e. everything
  the receiving rank pays except its own handler and the event loop's wake.

Each ``--batch`` size B is one pattern: B messages are sent back to back,
then drained once they have arrived (untimed wait).  B = 1 is an
announcement's life in a step (one message, one wake, one drain: the send
also pays ZeroMQ waking its I/O thread); B = 100 is a burst.

Before/after: the same measurement runs, in alternating rounds, against a
reference copy of ``transport/messages.py`` and ``transport/control.py`` taken
from git (``--ref``, by default the commit before the lean host path), loaded
as a separate package so both live in one process under the same noise.  Each
cell is the median over all messages of all rounds (a send: one call; a
receive: one drain's time per message it delivered), with the mean in
parentheses; the ratio column is current/reference of the medians.  On a
loaded machine a few calls in a thousand take milliseconds (the process is
descheduled) and move the mean, not the median.  Compare the two columns of
one run, not absolute numbers across runs.

Usage::

    python benchmarks/control_plane.py [--rounds 15] [--n 500] [--batch 1,100] [--ref 8589052] [--no-ref]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import zmq

REPO = Path(__file__).resolve().parent.parent
DEFAULT_REF = "8589052"  # main before issue 12's lean host path (messages.py/control.py as profiled)

XFER = dict(seq=3, step=1, stage=1, mb=5, kind="F", tensors=[[[4, 16], "float32", True]], fast=False, last=False)
XFER3 = dict(seq=3, step=1, stage=1, mb=5, kind="B",
             tensors=[[[8, 512, 1024], "bfloat16", True], [[8, 512], "int64", False], None], fast=True, last=True)
HEARTBEAT = dict(step=12, t=1.7e9, state="busy", what="1F3", for_s=0.0123, stall_s=30.0)
ABORT = dict(step=3, stage=1, mb=2, action="1B2", error="RuntimeError: boom", traceback="Traceback ...\n" * 20)
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("xfer (1 tensor)", "xfer", XFER),
    ("xfer (3 specs)", "xfer", XFER3),
    ("heartbeat", "heartbeat", HEARTBEAT),
    ("abort", "abort", ABORT),
]


def load_reference(rev: str) -> ModuleType:
    """``transport/control.py`` (with its ``messages.py``) at git revision ``rev``, as package ``_ctl_ref``."""
    root = Path(tempfile.mkdtemp(prefix="pipeloom-ctl-ref-"))
    pkg = root / "_ctl_ref"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("messages.py", "control.py"):
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:transport/{name}"],
                              check=True, capture_output=True, text=True).stdout
        (pkg / name).write_text(text)
    sys.path.insert(0, str(root))
    return importlib.import_module("_ctl_ref.control")


class Pair:
    """Two ControlPlanes of one implementation, rank 0 pushing to rank 1."""

    def __init__(self, control: ModuleType) -> None:
        self.a = control.ControlPlane(0, 2, secret=os.urandom(32))
        self.b = control.ControlPlane(1, 2, secret=self.a._key)
        eps = [self.a.endpoint, self.b.endpoint]
        self.a.connect(eps)
        self.b.connect(eps)
        self.got = 0

        def handler(msg: dict[str, Any]) -> None:
            self.got += 1

        self.b._handler = handler  # drain() is called by hand here, not by an event loop

    def close(self) -> None:
        self.a.close()
        self.b.close()

    def round(self, msg_type: str, fields: dict[str, Any], n: int, batch: int) -> tuple[list[float], list[float]]:
        """Samples over ``n`` messages, us: each send call, and each drain's time per message it delivered."""
        send = self.a.send
        clock = time.perf_counter_ns
        sends: list[float] = []
        recvs: list[float] = []
        start = self.got
        pull = self.b._pull
        for lo in range(0, n, batch):
            k = min(batch, n - lo)
            for _ in range(k):
                t0 = clock()
                send(1, msg_type, **fields)
                sends.append((clock() - t0) / 1e3)
            want = start + lo + k
            deadline = time.monotonic() + 10
            while self.got < want:
                # wait (untimed) until the batch has reached rank 1's socket, then time draining it
                pull.poll(1000, zmq.POLLIN)
                if batch > 1:
                    time.sleep(0.002)
                before = self.got
                t0 = clock()
                self.b.drain()  # (the default limit: ends as a real wake does, on an empty socket)
                t = clock() - t0
                if self.got > before:
                    recvs.append(t / (self.got - before) / 1e3)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {self.got - start} of {lo + k} messages arrived")
        return sends, recvs


def parts(ref: ModuleType | None, repeats: int) -> dict[str, float]:
    """In-process cost of the message layer alone (no sockets): best of ``repeats`` blocks, us per call."""
    from pipeloom.transport import messages as cur

    key = os.urandom(32)
    fields = XFER
    cases: dict[str, Any] = {}
    if ref is not None:
        rm = sys.modules["_ctl_ref.messages"]
        rframe = rm.sign(key, rm.encode("xfer", 1, **fields))
        cases["reference encode+sign"] = lambda: rm.sign(key, rm.encode("xfer", 1, **fields))
        cases["reference verify+decode"] = lambda: rm.decode(rm.verify(key, rframe), world_size=2, rank=0)
    checked = cur.Codec(key, rank=1, world_size=2)
    unchecked = cur.Codec(key, rank=1, world_size=2, check_outgoing=False)
    reader = cur.Codec(key, rank=0, world_size=2)
    frame = checked.frame("xfer", dict(fields))
    cases["Codec.frame"] = lambda: checked.frame("xfer", dict(fields))
    cases["Codec.frame, check_outgoing=False"] = lambda: unchecked.frame("xfer", dict(fields))
    cases["Codec.read"] = lambda: reader.read(frame)
    best = {k: float("inf") for k in cases}
    for _ in range(repeats):
        for k, f in cases.items():
            t0 = time.perf_counter_ns()
            for _ in range(100):
                f()
            best[k] = min(best[k], (time.perf_counter_ns() - t0) / 100 / 1e3)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="alternating rounds per implementation")
    p.add_argument("--n", type=int, default=500, help="messages per round")
    p.add_argument("--batch", default="1,100", help="comma-separated: messages queued before one timed drain")
    p.add_argument("--ref", default=DEFAULT_REF, help="git revision of the reference implementation")
    p.add_argument("--no-ref", action="store_true", help="measure the current implementation only")
    args = p.parse_args()
    batches = [int(b) for b in args.batch.split(",")]

    from pipeloom.transport import control as current

    impls: dict[str, ModuleType] = {"current": current}
    if not args.no_ref:
        impls = {"reference": load_reference(args.ref), "current": current}
    pairs = {name: Pair(mod) for name, mod in impls.items()}
    results: dict[tuple[int, str, str], tuple[list[float], list[float]]] = {}
    try:
        for label, msg_type, fields in CASES:  # warm-up
            for pair in pairs.values():
                pair.round(msg_type, fields, 200, max(batches))
        for _ in range(args.rounds):
            for batch in batches:
                for label, msg_type, fields in CASES:
                    for name, pair in pairs.items():
                        sends, recvs = pair.round(msg_type, fields, args.n, batch)
                        acc = results.setdefault((batch, label, name), ([], []))
                        acc[0].extend(sends)
                        acc[1].extend(recvs)
    finally:
        for pair in pairs.values():
            pair.close()
    layer = parts(impls.get("reference"), 300)

    ref_note = f"; reference: git {args.ref}" if "reference" in impls else ""
    print(f"control-plane host cost per message, us: median (mean) over {args.rounds} alternating rounds of "
          f"{args.n} messages each{ref_note}")
    print("(the median is the cost; the mean adds the times this process was descheduled on a busy machine)")
    for batch in batches:
        for i, what in enumerate(("send", "receive")):
            how = ("one message, then wait for it to arrive" if batch == 1 else f"{batch} back to back") if i == 0 else \
                ("one drain per message (as on a wake)" if batch == 1 else f"drained {batch} per call")
            print(f"\n{what}, {how}:")
            print(f"  {'message':18s}" + "".join(f"{name:>18s}" for name in impls) + ("   ratio" if len(impls) > 1 else ""))
            for label, _, _ in CASES:
                rs = {name: results[(batch, label, name)][i] for name in impls}
                med = {name: statistics.median(v) for name, v in rs.items()}
                line = f"  {label:18s}" + "".join(f"{med[n]:10.1f} ({statistics.fmean(rs[n]):5.1f})" for n in impls)
                if len(impls) > 1:
                    line += f"{med['current'] / med['reference']:8.2f}"
                print(line)
    print("\nmessage layer alone (xfer with 1 tensor, no sockets), best of 300 blocks of 100, us per call:")
    for k, v in layer.items():
        print(f"  {k:36s}{v:6.2f}")


if __name__ == "__main__":
    main()
