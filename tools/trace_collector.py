"""The launcher's trace collector: one file per job, and a live feed for viewers.

Under ``pipeloom launch --trace FILE`` ranks do not write files: each streams
its events (signed msgpack batches, see ``StreamSink`` in
:mod:`pipeloom.runtime.trace`) to a ZeroMQ PULL socket that the launcher
binds, and this collector

* verifies every frame with the job's secret and validates the batch; a frame
  that fails is counted, logged (the first few) and dropped, so a stray or
  hostile process cannot put events into the trace or break the file;
* writes ONE JSON Lines file: the header of the first batch that carries one
  (plus ``"live"``, the address below), then events as they arrive, flushed
  after every batch, so the file is valid at any moment and a viewer can tail
  it;
* republishes every accepted batch on a PUB socket for ``pipeloom trace
  attach``: unsigned (viewers need not know the job secret; the socket is on
  the loopback), and always carrying the job's header so a viewer that
  attaches late knows what it is looking at.

Why in the launcher: one file per job instead of one per rank (ranks'
clocks already line up on one host), a crash of a rank loses at most its
unsent batch, and the launcher already outlives every rank.  Why a thread:
the launcher's asyncio loop must stay free to react to exits and signals;
ZeroMQ sockets are owned by the collector thread from ``start`` on.

When ranks exit, :meth:`TraceCollector.close` drains what is still queued
(a rank's ``close`` lingers until its last batch is out) for at most
``drain_timeout`` seconds after the socket goes quiet, then closes the file.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = ["TraceCollector", "CollectorStatistics", "MAX_FRAME_BYTES"]

MAX_FRAME_BYTES = 64 << 20
"""Frames larger than this are refused by ZeroMQ before they are read (a batch is far smaller)."""
_MAC_BYTES = 16  # as transport.messages.MAC_BYTES: truncated HMAC-SHA256 in front of the payload
_LOGGED_REJECTS = 3
_QUIET_S = 0.1  # after close(): a socket silent this long is drained


def _verify(key: bytes, frame: bytes) -> bytes:
    """``transport.messages.verify`` without importing the transport package (it imports torch)."""
    if len(frame) < _MAC_BYTES:
        raise ValueError(f"frame of {len(frame)} bytes is too short to carry a signature")
    mac, payload = frame[:_MAC_BYTES], frame[_MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(key, payload, hashlib.sha256).digest()[:_MAC_BYTES]):
        raise ValueError("bad signature: the sender does not hold this job's secret")
    return payload


@dataclass
class CollectorStatistics:
    """What the collector did (read after :meth:`TraceCollector.close`)."""

    batches: int = 0
    events: int = 0
    rejected: int = 0
    ranks: set[int] = field(default_factory=set)
    dropped: dict[int, int] = field(default_factory=dict)
    """Events each rank could not send (its queue was full), as the rank reported them."""


class TraceCollector:
    """Collects one job's trace batches into ``path`` and republishes them live."""

    def __init__(
        self,
        path: str,
        *,
        secret: bytes,
        host: str = "127.0.0.1",
        world_size: int | None = None,
        say: Callable[[str], None] | None = None,
        drain_timeout: float = 1.0,
    ) -> None:
        self.path = path
        self._key = secret
        self._host = host
        self._world_size = world_size
        self._say = say or (lambda _msg: None)
        self.drain_timeout = drain_timeout
        self.stats = CollectorStatistics()
        self.endpoint = ""
        """Where ranks send (``PIPELOOM_TRACE_ENDPOINT``)."""
        self.live_address = ""
        """Where viewers subscribe (``pipeloom trace attach``)."""
        self._header: dict[str, Any] | None = None
        self._pending: list[dict[str, Any]] = []  # events that came before any header
        self._file: IO[str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle (launcher thread)

    def start(self) -> None:
        """Bind both sockets, open the file, start the thread."""
        import zmq

        from .trace_model import trace_api

        self._api = trace_api()
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._pull.setsockopt(zmq.RCVHWM, 100_000)
        port = self._pull.bind_to_random_port(f"tcp://{self._host}")
        self.endpoint = f"tcp://{self._host}:{port}"
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 10_000)
        port = self._pub.bind_to_random_port(f"tcp://{self._host}")
        self.live_address = f"tcp://{self._host}:{port}"
        self._file = open(self.path, "w")
        self._thread = threading.Thread(target=self._run, name="pipeloom-trace-collector", daemon=True)
        self._thread.start()

    def close(self) -> CollectorStatistics:
        """Drain what is queued (bounded), close the file and the sockets; idempotent."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(self.drain_timeout + 2.0)
            self._thread = None
            self._finish()
        return self.stats

    # -- the thread

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        deadline: float | None = None
        try:
            while True:
                stopping = self._stop.is_set()
                if stopping and deadline is None:
                    deadline = time.monotonic() + self.drain_timeout
                ready = dict(poller.poll(int(_QUIET_S * 1000) if stopping else 50))
                if self._pull in ready:
                    for _ in range(1000):  # then look at the stop flag again
                        try:
                            frame = self._pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(frame)
                elif stopping:
                    break  # quiet for _QUIET_S after the ranks are gone
                if deadline is not None and time.monotonic() > deadline:
                    break
        except Exception as exc:  # never take the launcher down; say why the trace ends here
            self._say(f"trace: collector stopped: {type(exc).__name__}: {exc}")

    def _reject(self, why: str) -> None:
        self.stats.rejected += 1
        if self.stats.rejected <= _LOGGED_REJECTS:
            self._say(f"trace: rejected a frame: {why}")

    def _handle(self, frame: bytes) -> None:
        import msgpack

        try:
            payload = _verify(self._key, frame)
        except ValueError as exc:
            self._reject(str(exc))
            return
        try:
            msg = msgpack.unpackb(payload, raw=False, strict_map_key=True)
            self._api.check_batch(msg)
        except Exception as exc:  # msgpack raises several types on garbage
            self._reject(f"not a trace batch: {exc}")
            return
        src = msg["src"]
        events = msg["events"]
        self.stats.batches += 1
        self.stats.events += len(events)
        self.stats.ranks.add(src)
        if msg.get("dropped"):
            self.stats.dropped[src] = max(self.stats.dropped.get(src, 0), int(msg["dropped"]))
        if self._header is None and msg.get("header") is not None:
            self._write_header(dict(msg["header"]))
        if self._header is None:
            self._pending.extend(events)
        else:
            self._write(events)
        try:
            out = {"v": 1, "type": "trace", "src": src, "header": self._header, "events": events, "dropped": msg.get("dropped", 0)}
            self._pub.send(msgpack.packb(out, use_bin_type=True), self._zmq.NOBLOCK)
        except self._zmq.Again:  # a slow viewer does not slow the job
            pass

    def _write_header(self, header: dict[str, Any]) -> None:
        header["live"] = self.live_address
        self._header = header
        assert self._file is not None
        self._file.write(json.dumps(header, separators=(",", ":")) + "\n")
        pending, self._pending = self._pending, []
        self._write(pending)

    def _write(self, events: list[dict[str, Any]]) -> None:
        assert self._file is not None
        self._file.write("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events))
        self._file.flush()

    def _finish(self) -> None:
        if self._header is None and self._file is not None:  # no rank got as far as tracing: still a valid file
            header: dict[str, Any] = {"format": self._api.TRACE_FORMAT, "version": self._api.TRACE_VERSION, "clock": "ns", "source": "run"}
            if self._world_size is not None:
                header["world_size"] = self._world_size
            self._write_header(header)
        if self._file is not None:
            self._file.close()
            self._file = None
        self._pull.close()
        self._pub.close()
        self._ctx.term()
        s = self.stats
        if s.rejected > _LOGGED_REJECTS:
            self._say(f"trace: rejected {s.rejected} frames in all")
        for rank, n in sorted(s.dropped.items()):
            self._say(f"trace: rank {rank} dropped {n} events (the collector fell behind)")
