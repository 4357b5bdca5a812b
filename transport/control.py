"""The control plane: ZeroMQ sockets carrying msgpack messages between ranks.

Shape: each rank binds one PULL socket and connects one PUSH socket to every
peer's PULL.  Messages are one-way (announcements, heartbeats, aborts), so
there is nothing to reply to and no ROUTER identity bookkeeping; PUSH queues
messages for a peer that has not connected yet instead of dropping them.
Announcements from one peer arrive in the order it sent them (one PUSH -> one
PULL pipe is FIFO), which is what the tensor plane relies on.

Sending uses plain synchronous sockets with ``NOBLOCK`` (a send never waits
for the network).  Receiving is done by the rank's event loop itself: the PULL
socket's ``ZMQ_FD`` is registered with ``loop.add_reader`` and every wake
drains the socket with ``recv(NOBLOCK)`` and hands each message to the handler
right there -- no ``zmq.asyncio`` future, no reader task to resume, so a
message costs one loop callback.  ``ZMQ_FD`` is edge-triggered (it signals
that ZeroMQ has commands to process, not that a message is waiting), so a wake
always drains until the socket is empty (a failed ``recv`` or ``ZMQ_EVENTS``
without ``POLLIN``), and what was queued before the reader was registered is
drained once on start.  One context per
process, created after any fork; ``LINGER`` is short so closing never hangs on
a dead peer.

Endpoints are exchanged once through ``torch.distributed`` (an all-gather over
the job's own process group), so no extra rendezvous service is needed.

Every frame is signed with a per-job secret (HMAC, see ``messages.Codec``):
the launcher's ``PIPELOOM_JOB_SECRET``, or one that rank 0 draws and shares
through the job's store.  A process outside the job cannot inject messages; its
frames are rejected like any other malformed input.  Rejections are logged in
summary (:class:`RejectionLog`): the first of each reason in full, then one
line per reason per interval with the count, so anyone who can reach a rank's
port cannot make it write a log line per frame.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from .messages import Codec, MessageError

__all__ = ["ControlPlane", "RejectionLog", "choose_bind_host"]

log = logging.getLogger("pipeloom.control")

_LINGER_MS = 200
# Plain ints: pyzmq's ``getsockopt`` costs about a microsecond more when given the enum member.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_REJECTION_INTERVAL = 5.0  #: seconds between summary lines of one rejection reason


class RejectionLog:
    """Rate-limited logging of rejected control frames: at most one line per reason per interval.

    The first rejection of a reason is logged in full at once (it says what is
    wrong); later ones within ``interval`` seconds are only counted, and the
    count is logged as one line when the interval has passed (checked on the
    next rejection and by :meth:`flush`, which the heartbeat thread calls
    periodically and ``close`` calls last).  The reason is the message with
    numbers and details after the first ``:`` dropped, so frames that differ
    only in size or value share a line.  Thread-safe.
    """

    def __init__(self, rank: int, *, interval: float = _REJECTION_INTERVAL, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger = log) -> None:
        self.rank = rank
        self.interval = interval
        self._clock = clock
        self._log = logger
        self._lock = threading.Lock()
        #: reason -> (start of its interval, rejections counted but not yet logged)
        self._pending: dict[str, tuple[float, int]] = {}

    @staticmethod
    def reason(exc: BaseException) -> str:
        head = str(exc).split(":", 1)[0].split(" (", 1)[0]
        return re.sub(r"\d+", "N", head)

    def rejected(self, exc: BaseException) -> None:
        key = self.reason(exc)
        now = self._clock()
        with self._lock:
            entry = self._pending.get(key)
            if entry is None:
                self._pending[key] = (now, 0)
                first = True
            else:
                self._pending[key] = (entry[0], entry[1] + 1)
                first = False
        if first:
            self._log.warning("rank %d: rejected a control message: %s (more like it are counted, one line per %g s)",
                              self.rank, exc, self.interval)
        self.flush(now)

    def flush(self, now: float | None = None, *, force: bool = False) -> None:
        """Log the counts whose interval has passed (all of them with ``force``)."""
        now = self._clock() if now is None else now
        lines = []
        with self._lock:
            for key, (since, count) in list(self._pending.items()):
                if force or now - since >= self.interval:
                    if count:
                        lines.append((count, now - since, key))
                        self._pending[key] = (now, 0)
                    else:
                        del self._pending[key]  # quiet for a whole interval: the next one is logged in full
        for count, span, key in lines:
            self._log.warning("rank %d: rejected %d more control message%s in the last %.1f s: %s",
                              self.rank, count, "s" if count > 1 else "", span, key)


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

    def __init__(self, rank: int, world_size: int, *, secret: bytes, host: str = "127.0.0.1",
                 check_outgoing: bool = True) -> None:
        """``check_outgoing``: validate this rank's own messages before sending (see :class:`Codec`)."""
        self.rank = rank
        self._key = secret
        self._codec = Codec(secret, rank=rank, world_size=world_size, check_outgoing=check_outgoing)
        self.world_size = world_size
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # oversized frames never reach the decoder
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._push: dict[int, zmq.Socket[Any]] = {}
        self._fd: int = self._pull.getsockopt(zmq.FD)
        self._reader_loop: asyncio.AbstractEventLoop | None = None  #: the loop whose reader watches ``_fd``
        self._handler: Callable[[dict[str, Any]], None] | None = None
        self.rejected = 0  #: messages rejected by validation (statistics for tests and traces)
        self.rejections = RejectionLog(rank)
        self._closed = False
        self._endpoints: list[str] = []
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        #: the step this rank is in and its kind (training: True, evaluation: False), reported in heartbeats; one
        #: tuple, set at once, so that the heartbeat thread never pairs one step with another's kind
        self.position: tuple[int, bool] = (0, True)
        #: peer -> when (monotonic) its heartbeat connection closed and has not come back
        #: (written by the heartbeat thread, read by the actor's liveness check)
        self.disconnected: dict[int, float] = {}
        #: when (monotonic) the heartbeat thread last read the connection events: a
        #: disconnect counts only once a later read still shows no reconnect
        self.monitors_read_at = 0.0
        self.steps_done = 0  #: steps this rank completed (set by the actor), said in ``bye``
        #: peers whose ``bye`` this rank read: their control planes are closed, so ``close`` sends them nothing
        #: (a message to a closed peer waits out the whole ``LINGER`` in ``term``: 200 ms on every job's last rank)
        self.peers_closed: set[int] = set()
        #: the rank whose abort this rank heard (set by the actor; -1: none), said in ``bye``
        self.bye_cause = -1
        #: seconds one action of this rank's current step may run while peers wait for it
        #: (set per step by the Pipeline: longer while torch.compile may compile), in heartbeats
        self.stall_budget = 30.0

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
        data = self._codec.frame(msg_type, fields)
        try:
            self._push[dst].send(data, _NOBLOCK)  # (not through _send: one call less on every announcement)
            return True
        except zmq.Again:
            log.warning("rank %d: control queue to rank %d is full; %s dropped", self.rank, dst, msg_type)
            return False

    def broadcast(self, msg_type: str, /, **fields: Any) -> None:
        """Send one message to every peer (encoded and signed once)."""
        data = self._codec.frame(msg_type, fields)
        for dst in self._push:
            self._send(dst, data, msg_type)

    def _send(self, dst: int, data: bytes, msg_type: str) -> bool:
        try:
            self._push[dst].send(data, _NOBLOCK)
            return True
        except zmq.Again:
            log.warning("rank %d: control queue to rank %d is full; %s dropped", self.rank, dst, msg_type)
            return False

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
        monitors: list[tuple[int, zmq.Socket[Any]]] = []
        for peer, ep in enumerate(self._endpoints):
            if peer == self.rank:
                continue
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 16)
            # Connection events of this socket: a peer whose process ends closes its end at
            # once, so "disconnected and not back" tells a dead peer long before its
            # heartbeats are missed (see ``disconnected``).
            monitors.append((peer, s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)))
            s.connect(ep)
            socks.append(s)
        try:
            while not self._hb_stop.wait(interval):
                self._read_monitors(monitors)
                self.rejections.flush()
                state, what, since = self._hb_state()
                step, train = self.position
                data = self._codec.frame("heartbeat", dict(
                    step=step, train=train, t=time.time(), state=state, what=what[:200],
                    for_s=max(0.0, time.monotonic() - since), stall_s=float(self.stall_budget),
                ))
                for s in socks:
                    try:
                        s.send(data, zmq.NOBLOCK)
                    except zmq.Again:
                        pass
        finally:
            for (_, mon), s in zip(monitors, socks):
                try:
                    s.disable_monitor()
                except zmq.ZMQError:
                    pass
                mon.close()
                s.close()

    def _read_monitors(self, monitors: list[tuple[int, zmq.Socket[Any]]]) -> None:
        from zmq.utils.monitor import recv_monitor_message

        for peer, mon in monitors:
            while True:
                try:
                    event = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    break
                if event == zmq.EVENT_DISCONNECTED:
                    self.disconnected.setdefault(peer, time.monotonic())
                elif event == zmq.EVENT_CONNECTED:
                    self.disconnected.pop(peer, None)
        self.monitors_read_at = time.monotonic()

    def start(self, handler: Callable[[dict[str, Any]], None]) -> None:
        """Deliver validated messages to ``handler`` from the running loop (a reader on the socket's FD)."""
        loop = asyncio.get_running_loop()
        self._handler = handler
        if self._reader_loop is loop:
            return
        self.stop()
        loop.add_reader(self._fd, self.drain)
        self._reader_loop = loop
        # Edge-triggered: messages queued before the reader existed raised their edge already.
        loop.call_soon(self.drain)

    def drain(self, limit: int = 512) -> int:
        """Deliver every message already queued on the PULL socket; return how many.

        Called by the loop when the socket's FD fires (and safe to call
        directly from the loop's thread: it never blocks).  After
        ``limit`` messages it yields to the loop and continues on its next
        turn, so a flood cannot starve the dispatcher; the edge it consumed
        will not fire again, hence the explicit ``call_soon``.

        The FD is re-armed by ZeroMQ processing its pending commands, which
        both a failed ``recv(NOBLOCK)`` and reading ``ZMQ_EVENTS`` do.  A wake
        almost always has a message, so the first ``recv`` is tried without
        asking (a wake without one costs one ``zmq.Again``); after each
        message ``ZMQ_EVENTS`` says whether another is waiting, and the loop
        ends only on a failed ``recv`` or an ``EVENTS`` without ``POLLIN``:
        either way the FD fires again when the next message comes.
        """
        handler = self._handler
        if handler is None or self._closed:
            return 0
        pull = self._pull
        recv = pull.recv
        events = pull.getsockopt
        read = self._codec.read
        n = 0
        while True:
            try:
                data = recv(_NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                msg = read(data)  # type: ignore[arg-type]
            except MessageError as exc:
                self.rejected += 1
                self.rejections.rejected(exc)
            else:
                if msg["type"] == "bye":
                    self.peers_closed.add(msg["src"])
                try:
                    handler(msg)
                except Exception:  # a handler bug must not kill the reader: the rank would go deaf
                    self.rejected += 1
                    log.exception("rank %d: handling a %s message from rank %s failed", self.rank, msg["type"], msg["src"])
            if n >= limit:
                loop = self._reader_loop
                if loop is not None and not loop.is_closed():
                    loop.call_soon(self.drain)
                break
            if not events(_EVENTS) & _POLLIN:
                break
        return n

    def stop(self) -> None:
        """Stop watching the socket (messages stay queued in ZeroMQ until ``start`` on a loop again)."""
        loop, self._reader_loop = self._reader_loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)

    def _read_byes(self) -> None:
        """At ``close``: the ``bye`` among the messages still queued (unread since ``stop``), noted in
        ``peers_closed``; every other message is dropped, as closing would drop it."""
        while True:
            try:
                data = self._pull.recv(_NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._codec.read(data)  # type: ignore[arg-type]
            except MessageError:
                continue
            if msg["type"] == "bye":
                self.peers_closed.add(msg["src"])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop()
        if self._push:
            self._read_byes()
            data = self._codec.frame("bye", dict(steps=self.steps_done, cause=self.bye_cause))
            for dst, sock in self._push.items():
                if dst in self.peers_closed:
                    sock.setsockopt(zmq.LINGER, 0)  # (nobody reads it: closing must not wait for it)
                else:
                    self._send(dst, data, "bye")  # (LINGER gives it time to leave)
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=2)
        self.rejections.flush(force=True)
        for s in self._push.values():
            s.close()
        self._pull.close()
        self._ctx.term()
