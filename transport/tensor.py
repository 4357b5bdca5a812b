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

NCCL.  Two things differ on GPUs.  (1) NCCL runs a pair's point-to-point ops
in order on one stream, so a send from A to B posted before A's receive from
B can wait for B's receive, queued behind B's own send to A: a deadlock that
dynamic order would make likely.  Each *ordered* pair of ranks therefore gets
its own two-rank process group (created eagerly, in the same order on every
rank), so traffic A->B never queues behind B->A.  (2) ``wait()`` on an NCCL
``Work`` only makes the calling thread's current stream wait; the host learns
completion from ``is_completed()`` (a CUDA event query), which the waiter
thread polls, so the dispatcher sees a receive as ready only when its data
is actually there and never blocks the host on it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TensorPlane", "TransferSpec", "dtype_from_name", "dtype_name", "make_pair_groups"]

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


def _nccl_options(max_ctas: int | None) -> Any:
    """NCCL options capping the CTAs (SMs) a pair's kernels may occupy.

    Receives are posted as soon as they are announced, so a receive kernel can
    sit resident while compute runs; each NCCL channel holds one CTA on an SM.
    Capping them leaves the SMs to compute at a small cost in transfer speed.
    """
    if max_ctas is None:
        return None
    try:
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.max_ctas = max_ctas
        opts.config.min_ctas = min(getattr(opts.config, "min_ctas", 1) or 1, max_ctas)
        return opts
    except (AttributeError, RuntimeError):  # an older torch without NCCL config
        return None


def make_pair_groups(
    edges: set[tuple[int, int]], *, backend: str | None = None, max_ctas: int | None = None
) -> dict[tuple[int, int], dist.ProcessGroup]:
    """One two-rank group per ordered pair in ``edges``; every rank must call this with the same set.

    ``new_group`` is collective over the whole job, so the pairs are created in
    sorted order everywhere; a rank outside a pair gets no group for it.
    """
    groups: dict[tuple[int, int], dist.ProcessGroup] = {}
    opts = _nccl_options(max_ctas) if dist.get_backend() == "nccl" else None
    for a, b in sorted(edges):
        g = dist.new_group([a, b] if a < b else [b, a], backend=backend, pg_options=opts)
        if dist.get_rank() in (a, b):
            groups[(a, b)] = g
    return groups


class _PeerWaiter:
    """A daemon thread that waits on one peer's receives, in posting order."""

    def __init__(self, peer: int, rank: int, *, poll: bool = False) -> None:
        self.peer = peer
        self._poll = poll
        self._q: queue.SimpleQueue[tuple[list[Any], Callable[[BaseException | None], None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"pipeloom-recv-r{rank}-from{peer}", daemon=True)
        self._thread.start()

    def submit(self, works: list[Any] | Callable[[], list[Any]], done: Callable[[BaseException | None], None]) -> None:
        self._q.put((works, done))

    def stop(self, timeout: float = 2.0) -> None:
        self._q.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            works, done = item
            err: BaseException | None = None
            w = None
            try:
                if callable(works):  # post the receives here, off the event loop (see TensorPlane.recv)
                    works = works()
                for w in works:
                    if self._poll:
                        delay = 5e-6
                        while not w.is_completed():
                            time.sleep(delay)
                            delay = min(delay * 2, 2e-4)
                    else:
                        w.wait()
            except BaseException as exc:  # gloo raises RuntimeError on a closed connection
                err = exc
            done(err)
            # Drop the Work objects here, not at interpreter shutdown: freeing a
            # gloo Work from a thread that outlives the interpreter aborts the process.
            works = done = item = err = w = None  # type: ignore[assignment]


class TensorPlane:
    """Posts sends and receives in the per-peer order both sides agree on."""

    def __init__(
        self,
        rank: int,
        *,
        device: torch.device,
        pair_groups: dict[tuple[int, int], dist.ProcessGroup] | None = None,
    ) -> None:
        self.rank = rank
        self.device = device
        #: (src, dst) -> the two-rank group that carries src's sends to dst (None: the default group)
        self.pair_groups = pair_groups or {}
        self._poll = device.type == "cuda"
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
            work = dist.isend(t, dst=peer, group=self.pair_groups.get((self.rank, peer)))
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
        """Wait until every posted send has completed (end of step).

        On NCCL this orders the current stream after the sends rather than
        blocking the host; the tensors stay referenced by their ``Work``.
        """
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
    ) -> tuple[list[torch.Tensor | None], list[Any]]:
        """Allocate buffers from the announced spec, post the receives, call ``done`` on the loop when complete.

        Returns the buffers and their ``Work`` objects, so a GPU consumer may
        also order its stream after them (``work.wait()``) before they complete.
        """
        loop = asyncio.get_running_loop()
        buffers: list[torch.Tensor | None] = []
        for s in spec.tensors:
            if s is None:
                buffers.append(None)
                continue
            shape, dtype, _ = s
            buf = torch.empty(shape, dtype=dtype_from_name(dtype), device=self.device)
            self.bytes_received += buf.numel() * buf.element_size()
            buffers.append(buf)
        group = self.pair_groups.get((peer, self.rank))
        real = [b for b in buffers if b is not None]
        works: list[Any] = []
        if self._poll:
            # GPU: post here, on the loop's thread and current stream, so a
            # consumer can be stream-ordered after these Works before they complete.
            works = [dist.irecv(b, src=peer, group=group) for b in real]

        def _complete(err: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(done, buffers, err)
            except RuntimeError:  # the loop is closed: the job is being torn down
                pass

        if not real:
            loop.call_soon(done, buffers, None)
            return buffers, works
        waiter = self._waiters.get(peer)
        if waiter is None:
            waiter = self._waiters[peer] = _PeerWaiter(peer, self.rank, poll=self._poll)
        if works:
            waiter.submit(works, _complete)
        else:
            # CPU (gloo): the peer's waiter thread posts the receives and waits on
            # them.  Posting an irecv contends with gloo's I/O thread while data
            # flows (hundreds of microseconds under load); off the loop, that
            # time no longer delays dispatch.  One thread per peer posts in
            # announcement order, so pairing order is unchanged.
            waiter.submit(lambda: [dist.irecv(b, src=peer, group=group) for b in real], _complete)
        return buffers, works

    def close(self) -> None:
        for w in self._waiters.values():
            w.stop()
        self._waiters.clear()
