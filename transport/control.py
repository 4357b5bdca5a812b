"""The control plane: ZeroMQ sockets carrying msgpack messages between ranks.

Shape: each rank binds one PULL socket and connects one PUSH socket to every
peer's PULL.  Messages are one-way (announcements, heartbeats, aborts), so
there is nothing to reply to and no ROUTER identity bookkeeping; PUSH queues
messages for a peer that has not connected yet instead of dropping them.
Announcements from one peer arrive in the order it sent them (one PUSH -> one
PULL pipe is FIFO), which is what the tensor plane relies on.

Sending uses plain synchronous sockets with ``NOBLOCK`` (a send never waits
for the network); receiving is ``zmq.asyncio`` so the rank's event loop is
woken when a message lands.  One context per process, created after any fork;
``LINGER`` is short so closing never hangs on a dead peer.

Endpoints are exchanged once through ``torch.distributed`` (an all-gather over
the job's own process group), so no extra rendezvous service is needed.

Every frame is signed with a per-job secret (HMAC, see ``messages.sign``):
the launcher's ``PIPELOOM_JOB_SECRET``, or one that rank 0 draws and shares
through the job's store.  A process outside the job cannot inject messages; its
frames are rejected and logged like any other malformed input.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from .messages import MessageError, decode, encode, sign, verify

__all__ = ["ControlPlane", "choose_bind_host"]

log = logging.getLogger("pipeloom.control")

_LINGER_MS = 200


def choose_bind_host(master_addr: str | None) -> str:
    """Loopback for single-host jobs, else the local address that routes to the master."""
    if not master_addr or master_addr in ("localhost", "::1") or master_addr.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))  # no packet is sent for a UDP connect
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class ControlPlane:
    """One rank's end of the control plane."""

    def __init__(self, rank: int, world_size: int, *, secret: bytes, host: str = "127.0.0.1") -> None:
        self.rank = rank
        self._key = secret
        self.world_size = world_size
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context.shadow(self._ctx)
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # oversized frames never reach the decoder
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._push: dict[int, zmq.Socket[Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self.rejected = 0  #: messages rejected by validation (statistics for tests and traces)
        self._closed = False
        self._endpoints: list[str] = []
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self.step = 0  #: the step this rank is in, reported in heartbeats

    def connect(self, endpoints: list[str]) -> None:
        """Connect a PUSH socket to every other rank's endpoint (index = rank)."""
        self._endpoints = list(endpoints)
        for peer, ep in enumerate(endpoints):
            if peer == self.rank or peer in self._push:
                continue
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, _LINGER_MS)
            s.setsockopt(zmq.SNDHWM, 100_000)
            s.connect(ep)
            self._push[peer] = s

    def send(self, dst: int, msg_type: str, /, **fields: Any) -> bool:
        """Send a message without ever blocking; False if the peer's queue is full."""
        data = sign(self._key, encode(msg_type, self.rank, **fields))
        try:
            self._push[dst].send(data, zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.warning("rank %d: control queue to rank %d is full; %s dropped", self.rank, dst, msg_type)
            return False

    def broadcast(self, msg_type: str, /, **fields: Any) -> None:
        for dst in self._push:
            self.send(dst, msg_type, **fields)

    def start_heartbeats(self, interval: float, state: Callable[[], tuple[str, str, float]] | None = None) -> None:
        """Send a heartbeat to every peer every ``interval`` seconds from a daemon thread.

        A thread, not a loop task, because the event loop only runs during a
        step: between steps (optimizer, data loading, checkpointing) the rank
        is alive and must not look dead to a peer already in the next step.
        Heartbeats therefore prove that the *process* lives; a SIGKILLed or
        SIGSTOPped rank falls silent.  The thread owns its own PUSH sockets
        (ZeroMQ sockets are not thread-safe).
        """
        if self._hb_thread is not None:
            return
        self._hb_state = state or (lambda: ("idle", "", time.monotonic()))
        self._hb_thread = threading.Thread(target=self._heartbeat, args=(interval,), name=f"pipeloom-heartbeat-{self.rank}", daemon=True)
        self._hb_thread.start()

    def _heartbeat(self, interval: float) -> None:
        socks = []
        for peer, ep in enumerate(self._endpoints):
            if peer == self.rank:
                continue
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 16)
            s.connect(ep)
            socks.append(s)
        try:
            while not self._hb_stop.wait(interval):
                state, what, since = self._hb_state()
                data = sign(self._key, encode(
                    "heartbeat", self.rank, step=self.step, t=time.time(), state=state, what=what[:200],
                    for_s=max(0.0, time.monotonic() - since),
                ))
                for s in socks:
                    try:
                        s.send(data, zmq.NOBLOCK)
                    except zmq.Again:
                        pass
        finally:
            for s in socks:
                s.close()

    def start(self, handler: Callable[[dict[str, Any]], None]) -> None:
        """Start delivering validated messages to ``handler`` on the running loop."""
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read(handler), name=f"pipeloom-control-{self.rank}")

    async def _read(self, handler: Callable[[dict[str, Any]], None]) -> None:
        pull = self._pull
        while True:
            data = await pull.recv(copy=True)
            while True:
                self._deliver(data, handler)
                try:  # drain what is already queued without a trip through the loop
                    data = pull.recv(zmq.NOBLOCK, copy=True)  # type: ignore[assignment]
                    if isinstance(data, asyncio.Future):
                        data = await data
                except zmq.Again:
                    break

    def _deliver(self, data: bytes, handler: Callable[[dict[str, Any]], None]) -> None:
        try:
            msg = decode(verify(self._key, data), world_size=self.world_size, rank=self.rank)
        except MessageError as exc:
            self.rejected += 1
            log.warning("rank %d: rejected a control message: %s", self.rank, exc)
            return
        try:
            handler(msg)
        except Exception:  # a handler bug must not kill the reader: the rank would go deaf
            self.rejected += 1
            log.exception("rank %d: handling a %s message from rank %s failed", self.rank, msg.get("type"), msg.get("src"))

    def stop(self) -> asyncio.Task[None] | None:
        """Stop the reader task; return it so the caller can let its loop finish cancelling it."""
        task, self._reader = self._reader, None
        if task is not None:
            task.cancel()
        return task

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop()
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=2)
        for s in self._push.values():
            s.close()
        self._pull.close()
        self._ctx.term()
