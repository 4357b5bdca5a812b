"""The tensor plane: point-to-point payloads through ``torch.distributed``.

Pairing.  NCCL point-to-point is tagless and FIFO per peer, so a receive pairs
with whatever the peer sent next.  The tensor plane therefore never lets the
two sides disagree on order: the sender announces each transfer on the
control plane (with a per-peer sequence number) in exactly the order it posts
the sends, and the receiver posts its receives in announcement order, which a
single PUSH->PULL pipe preserves.  Readiness stays dynamic (whichever
microbatch finishes first is sent first); pairing order is fixed by the
sender.  The sequence number is checked on arrival, so a lost or reordered
announcement is an error, never a silent mis-pairing.

Completion.  gloo's ``Work`` has no ``get_future()``; ``wait()`` blocks but
releases the GIL.  Each peer gets one daemon thread that waits on that peer's
receives in posting order and hands each completion to the event loop with
``call_soon_threadsafe``.  One thread per peer (not a shared pool) because
receives from one peer complete in order: a pool could fill with receives
whose data depends on our own progress while the one we need sits queued.
Sends are not waited for on the hot path; their ``Work`` is kept (holding the
tensor alive) and reaped when completed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TensorPlane", "TransferSpec", "dtype_from_name", "dtype_name"]

log = logging.getLogger("pipeloom.tensor")

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
        torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} in a transfer announcement; supported: {', '.join(_DTYPES)}") from None


@dataclass(frozen=True)
class TransferSpec:
    """What a transfer carries: per tensor (shape, dtype, requires_grad), or None for an absent tensor."""

    tensors: tuple[tuple[tuple[int, ...], str, bool] | None, ...]

    @staticmethod
    def of(tensors: Sequence[torch.Tensor | None]) -> TransferSpec:
        return TransferSpec(
            tuple(None if t is None else (tuple(t.shape), dtype_name(t.dtype), bool(t.requires_grad)) for t in tensors)
        )

    def to_wire(self) -> list[Any]:
        return [None if s is None else [list(s[0]), s[1], s[2]] for s in self.tensors]

    @staticmethod
    def from_wire(specs: list[Any]) -> TransferSpec:
        return TransferSpec(tuple(None if s is None else (tuple(s[0]), s[1], s[2]) for s in specs))


class _PeerWaiter:
    """A daemon thread that waits on one peer's receives, in posting order."""

    def __init__(self, peer: int, rank: int) -> None:
        self.peer = peer
        self._q: queue.SimpleQueue[tuple[list[Any], Callable[[BaseException | None], None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"pipeloom-recv-r{rank}-from{peer}", daemon=True)
        self._thread.start()

    def submit(self, works: list[Any], done: Callable[[BaseException | None], None]) -> None:
        self._q.put((works, done))

    def stop(self) -> None:
        self._q.put(None)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            works, done = item
            err: BaseException | None = None
            try:
                for w in works:
                    w.wait()
            except BaseException as exc:  # gloo raises RuntimeError on a closed connection
                err = exc
            done(err)


class TensorPlane:
    """Posts sends and receives in the per-peer order both sides agree on."""

    def __init__(self, rank: int, *, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        self.rank = rank
        self.device = device
        self.group = group
        self._send_seq: dict[int, int] = {}
        self._recv_seq: dict[int, int] = {}
        self._waiters: dict[int, _PeerWaiter] = {}
        self._inflight_sends: deque[tuple[Any, Sequence[torch.Tensor]]] = deque()
        self.bytes_sent = 0
        self.bytes_received = 0

    # -- sending ----------------------------------------------------------
    def next_send_seq(self, peer: int) -> int:
        seq = self._send_seq.get(peer, 0)
        self._send_seq[peer] = seq + 1
        return seq

    def send(self, peer: int, tensors: Sequence[torch.Tensor | None]) -> int:
        """Post the sends of one transfer (its announcement must already be out); return its bytes."""
        nbytes = 0
        for t in tensors:
            if t is None:
                continue
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            work = dist.isend(t, dst=peer, group=self.group)
            nbytes += t.numel() * t.element_size()
            self._inflight_sends.append((work, (t,)))
        self.bytes_sent += nbytes
        self._reap_sends()
        return nbytes

    def _reap_sends(self) -> None:
        q = self._inflight_sends
        while q and q[0][0].is_completed():
            q.popleft()

    def drain_sends(self) -> None:
        """Wait until every posted send has completed (end of step)."""
        while self._inflight_sends:
            work, _ = self._inflight_sends.popleft()
            work.wait()

    @property
    def pending_sends(self) -> int:
        self._reap_sends()
        return len(self._inflight_sends)

    # -- receiving --------------------------------------------------------
    def check_recv_seq(self, peer: int, seq: int) -> None:
        expected = self._recv_seq.get(peer, 0)
        if seq != expected:
            raise RuntimeError(
                f"rank {self.rank}: transfer from rank {peer} arrived with sequence number {seq}, expected {expected}; "
                "announcements were lost or reordered, so receives cannot be paired safely"
            )
        self._recv_seq[peer] = expected + 1

    def recv(
        self,
        peer: int,
        spec: TransferSpec,
        done: Callable[[list[torch.Tensor | None], BaseException | None], None],
    ) -> None:
        """Allocate buffers from the announced spec, post the receives, call ``done`` on the loop when complete."""
        loop = asyncio.get_running_loop()
        buffers: list[torch.Tensor | None] = []
        works = []
        for s in spec.tensors:
            if s is None:
                buffers.append(None)
                continue
            shape, dtype, _ = s
            buf = torch.empty(shape, dtype=dtype_from_name(dtype), device=self.device)
            works.append(dist.irecv(buf, src=peer, group=self.group))
            self.bytes_received += buf.numel() * buf.element_size()
            buffers.append(buf)

        def _complete(err: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(done, buffers, err)
            except RuntimeError:  # the loop is closed: the job is being torn down
                pass

        if not works:
            loop.call_soon(done, buffers, None)
            return
        waiter = self._waiters.get(peer)
        if waiter is None:
            waiter = self._waiters[peer] = _PeerWaiter(peer, self.rank)
        waiter.submit(works, _complete)

    def close(self) -> None:
        for w in self._waiters.values():
            w.stop()
        self._waiters.clear()
