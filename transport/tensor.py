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

Pre-posted receives (gloo).  gloo's send waits until the receiver has posted
the matching receive (a "ready" notice travels back first), so posting a
receive only when its announcement arrives costs a round trip on every
transfer.  The next transfer on a pair usually has the previous one's shapes,
so after each announcement the receiver pre-posts the next sequence number's
receives with those shapes, and the sender, which knows what was pre-posted,
sends straight into them (``fast``).  When the shapes differ, the sender
fills the pre-posted receives with placeholders and sends the real payload
under other tags, receiving buffers sized from the announcement as usual.
Tags are derived from the sequence number, so nothing can pair wrongly; the
announcement still carries every shape, and says which path was taken.
Pre-posting stops at the sender's last transfer of a step (the announcement
says so), so no receive stays pending between steps: a rank that finishes and
exits while its peers still work must not leave a gloo receive waiting.

NCCL.  Two things differ on GPUs.  (1) NCCL runs a pair's point-to-point ops
in order on one stream, so a send from A to B posted before A's receive from
B can wait for B's receive, queued behind B's own send to A: a deadlock that
dynamic order would make likely.  Each *ordered* pair of ranks therefore gets
its own two-rank process group (created eagerly, in the same order on every
rank), so traffic A->B never queues behind B->A.  (2) ``wait()`` on an NCCL
``Work`` only makes the calling thread's current stream wait.  The GPU actor
commits a receive's consumer as soon as the receive is posted (see
``runtime/device.py``): the consumer's stream waits on the Work, no host
thread polls it, and the Works are only kept until they complete.  (Given a
completion callback, a waiter thread polls ``is_completed()``, a CUDA event
query, and reports on the loop.)
"""

from __future__ import annotations

import asyncio
import functools
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

__all__ = [
    "SendError",
    "TensorPlane",
    "TransferSpec",
    "WorkWaiter",
    "abort_communicators",
    "dtype_from_name",
    "dtype_name",
    "make_pair_groups",
]

_SLOW = 1 << 30  #: tag offset of payloads sent outside a pre-posted receive
_MAX_PARTS = 64  #: tensors per transfer that get distinct tags


def _tag(seq: int, part: int, fast: bool) -> int:
    return (seq * _MAX_PARTS + part) % _SLOW + (0 if fast else _SLOW)


_Key = tuple[tuple[tuple[int, ...], str] | None, ...]


def _key(spec: TransferSpec) -> _Key:
    """What a receive buffer depends on: shape and dtype per tensor."""
    return tuple(None if s is None else (s[0], s[1]) for s in spec.tensors)


def _deliver(
    done: Callable[[list[torch.Tensor | None], BaseException | None], None],
    buffers: list[torch.Tensor | None],
    err: BaseException | None,
) -> None:
    done(buffers, err)


class _Slot:
    """Completion of a pre-posted receive, delivered on the loop to whoever claims it."""

    __slots__ = ("buffers", "done", "result")

    def __init__(self, buffers: list[torch.Tensor | None]) -> None:
        self.buffers = buffers
        self.done: Callable[[list[torch.Tensor | None], BaseException | None], None] | None = None
        self.result: tuple[BaseException | None] | None = None

    def complete(self, err: BaseException | None) -> None:
        if self.done is not None:
            self.done(self.buffers, err)
        else:
            self.result = (err,)

    def claim(self, loop: asyncio.AbstractEventLoop, done: Callable[[list[torch.Tensor | None], BaseException | None], None]) -> None:
        if self.result is not None:
            loop.call_soon(done, self.buffers, self.result[0])
        else:
            self.done = done

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
    nccl = dist.get_backend() == "nccl"
    for a, b in sorted(edges):
        # a fresh Options per group: torch writes each group's metadata into the one it is given
        opts = _nccl_options(max_ctas) if nccl else None
        g = dist.new_group([a, b] if a < b else [b, a], backend=backend, pg_options=opts)
        if dist.get_rank() in (a, b):
            groups[(a, b)] = g
    _connect(groups, torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"))
    return groups


def _connect(groups: dict[tuple[int, int], dist.ProcessGroup], dev: torch.device) -> None:
    """One tiny transfer per pair, now, while every rank is here.

    NCCL connects a pair's point-to-point channels at its first send/receive,
    and that handshake blocks the sending *host* until the peer posts its
    matching receive.  Done lazily, a rank's first send to a peer that is
    busy elsewhere (computing, or not yet in ``step``) would stall its whole
    dispatcher.  Pairs are connected in one global (sorted) order, so the
    first unconnected pair always has both its ranks at it: no deadlock.
    (gloo connects at group creation; the exchange there only checks the pairs.)
    """
    me = dist.get_rank()
    works = []
    for a, b in sorted(groups):
        t = torch.zeros(1, device=dev)
        if me == a:
            works.append((dist.isend(t, dst=b, group=groups[(a, b)]), t))
        else:
            works.append((dist.irecv(t, src=a, group=groups[(a, b)]), t))
    for w, _ in works:
        w.wait()
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


class SendError(RuntimeError):
    """A posted send failed while being waited for; ``peer`` is the rank it was going to."""

    def __init__(self, peer: int, error: BaseException) -> None:
        self.peer = peer
        super().__init__(f"send to rank {peer} failed: {error}")


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def abort_communicators(groups: Sequence[Any], *, world: bool) -> list[str]:
    """Abort NCCL communicators after a failure, without waiting for any peer; returns what was aborted.

    Why not ``destroy_process_group``: it finalizes each communicator, which
    waits for the operations still queued on it, and a receive from a rank
    that was SIGSTOPped or SIGKILLed never completes (seen on 2 GPUs: a rank
    that had named its stopped peer stayed in ``destroy`` until killed).
    ``ncclCommAbort`` stops the kernels and frees the communicator at once.

    ``world``: abort every group of the job (the default group included),
    through torch's ``_abort_process_group`` (private; in torch 2.11 and 2.13
    it wraps the aborts in one NCCL group call, so the aborts of several
    communicators cannot wait on each other) and forget them, so that
    ``dist.is_initialized()`` is False after.  Otherwise only ``groups`` (the
    ones pipeloom created) are aborted: through the same function per group,
    or the public ``ProcessGroup.abort()`` where it is missing.  Best effort:
    errors are logged, never raised (this runs while a failure is reported).
    """
    done: list[str] = []
    c10d = dist.distributed_c10d
    private = getattr(c10d, "_abort_process_group", None) if (2, 6) <= _torch_version() else None
    try:
        if world and dist.is_initialized():
            if private is not None:
                private(None)
                return ["world"]
            groups = [*groups, dist.group.WORLD]
        for g in groups:
            if g is None or g == getattr(c10d.GroupMember, "NON_GROUP_MEMBER", object()):
                continue
            try:
                if private is not None:
                    private(g)
                else:
                    g.abort()
                done.append(str(getattr(g, "group_name", "?")))
            except Exception:  # noqa: BLE001 - one group's failure must not spare the others
                log.exception("aborting the NCCL communicator of group %s failed", getattr(g, "group_name", "?"))
    except Exception:  # noqa: BLE001 - never mask the failure being reported
        log.exception("aborting NCCL communicators failed")
    return done


class WorkWaiter:
    """A daemon thread that waits on ``Work`` objects in submission order and reports each batch.

    ``poll=True`` checks ``is_completed()`` with a backoff of at most
    ``max_delay`` seconds and never parks inside ``wait()``: for NCCL (where
    ``wait()`` only orders a stream) and for gloo collectives (whose futures
    complete; a thread parked in gloo when a peer's connection drops can abort
    the process at exit).  gloo *point-to-point* receives must block in
    ``wait()``: their ``is_completed()`` stays False until someone waits, and
    a ``wait(timeout)`` that expires closes the pair.  A submitted item may be
    a callable that posts the Works on this thread and returns them.
    """

    def __init__(self, name: str, *, poll: bool = False, max_delay: float = 2e-4, wait_after_poll: bool = False) -> None:
        self._poll = poll
        self._max_delay = max_delay
        # After polling, wait() returns at once but raises the op's error (gloo).  Not
        # on CUDA: there it would order this thread's current stream after the op.
        self._wait_after_poll = wait_after_poll
        self._q: queue.SimpleQueue[tuple[list[Any] | Callable[[], list[Any]], Callable[[BaseException | None], None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
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
                            delay = min(delay * 2, self._max_delay)
                        if self._wait_after_poll:
                            w.wait()
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
        self._waiters: dict[int, WorkWaiter] = {}
        #: (Work, the tensors it holds alive, destination rank), in posting order
        self._inflight_sends: deque[tuple[Any, Sequence[torch.Tensor], int]] = deque()
        #: NCCL receives committed to a consumer's stream (no host waiter), kept until complete
        self._inflight_recvs: deque[Any] = deque()
        #: per peer we send to: the shapes the peer pre-posted for our next transfer
        self._sent_pred: dict[int, _Key] = {}
        #: per peer we receive from: (seq, shapes, slot) of the pre-posted receive
        self._prepost: dict[int, tuple[int, _Key, _Slot]] = {}

    # -- sending ----------------------------------------------------------
    def next_send_seq(self, peer: int) -> int:
        seq = self._send_seq.get(peer, 0)
        self._send_seq[peer] = seq + 1
        return seq

    def plan_send(self, peer: int, spec: TransferSpec, last: bool = False) -> tuple[bool, _Key | None]:
        """Decide how transfer ``spec`` to ``peer`` travels, before it is announced.

        Returns (fast, predicted): ``fast`` (gloo) means the payload goes into
        the receives the peer pre-posted, which the announcement must say;
        ``predicted`` is what the peer pre-posted (to be filled with
        placeholders when not fast).  ``last``: the last transfer to ``peer``
        in this step, after which the peer pre-posts nothing.  On NCCL
        transfers pair by order: never fast.
        """
        if self._poll:
            return False, None
        key = _key(spec)
        pred = self._sent_pred.get(peer)
        if last:
            self._sent_pred.pop(peer, None)
        else:
            self._sent_pred[peer] = key  # the peer pre-posts these shapes for our next transfer
        return pred == key, pred

    def send(self, peer: int, tensors: Sequence[torch.Tensor | None], seq: int, fast: bool, predicted: _Key | None) -> int:
        """Post the sends of transfer ``seq`` as ``plan_send`` decided; return its bytes."""
        group = self.pair_groups.get((self.rank, peer))
        if predicted is not None and not fast:
            self._fill_prepost(peer, seq, predicted)
        nbytes = 0
        part = 0
        for t in tensors:
            if t is None:
                continue
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            if self._poll:
                work = dist.isend(t, dst=peer, group=group)
            else:
                work = dist.isend(t, dst=peer, group=group, tag=_tag(seq, part, fast))
            part += 1
            nbytes += t.numel() * t.element_size()
            self._inflight_sends.append((work, (t,), peer))
        self._reap_sends()
        return nbytes

    def _fill_prepost(self, peer: int, seq: int, pred: _Key) -> None:
        """Complete the receives the peer pre-posted for ``seq`` with placeholders."""
        group = self.pair_groups.get((self.rank, peer))
        part = 0
        for ent in pred:
            if ent is None:
                continue
            t = torch.empty(ent[0], dtype=dtype_from_name(ent[1]), device=self.device)
            self._inflight_sends.append((dist.isend(t, dst=peer, group=group, tag=_tag(seq, part, True)), (t,), peer))
            part += 1

    def flush(self) -> None:
        """Release every receive peers pre-posted for us (before closing); best effort."""
        for peer, pred in list(self._sent_pred.items()):
            try:
                self._fill_prepost(peer, self._send_seq.get(peer, 0), pred)
            except Exception:  # the peer may be gone already
                pass
        self._sent_pred.clear()

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
            work, _, peer = self._inflight_sends.popleft()
            try:
                work.wait()
            except RuntimeError as exc:
                raise SendError(peer, exc) from exc
        self._reap_recvs()

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
        done: Callable[[list[torch.Tensor | None], BaseException | None], None] | None,
        *,
        seq: int = 0,
        fast: bool = False,
        last: bool = False,
    ) -> tuple[list[torch.Tensor | None], list[Any]]:
        """Receive transfer ``seq`` from ``peer``; call ``done`` on the loop when it has landed.

        Buffers come from the announced spec (or, ``fast``, are the ones
        pre-posted for this sequence number).  Returns the buffers and, on
        NCCL, their ``Work`` objects, so a GPU consumer may order its stream
        after them (``work.wait()``) before they complete.  On NCCL ``done``
        may be None: the receive is then *committed* (nobody waits for it on
        the host; its consumer's stream waits on the Works), which saves the
        waiter thread's polling and a thread hop per transfer.
        """
        loop = asyncio.get_running_loop()
        if self._poll:
            return self._recv_nccl(loop, peer, spec, done)
        if done is None:
            raise ValueError("a gloo receive needs a completion callback")
        pre = self._prepost.pop(peer, None)
        if pre is not None and pre[0] != seq:
            raise RuntimeError(f"rank {self.rank}: receive pre-posted for transfer {pre[0]} from rank {peer}, got transfer {seq}")
        key = _key(spec)
        if fast:
            if pre is None:
                if any(k is not None for k in key):
                    raise RuntimeError(f"rank {self.rank}: rank {peer} sent transfer {seq} into a receive that was never pre-posted")
                buffers: list[torch.Tensor | None] = [None] * len(key)
                loop.call_soon(done, buffers, None)
            else:
                if pre[1] != key:
                    raise RuntimeError(f"rank {self.rank}: transfer {seq} from rank {peer} claims pre-posted shapes {pre[1]}, announced {key}")
                buffers = pre[2].buffers
                pre[2].claim(loop, done)
        else:
            buffers = self._alloc(key)
            landed = functools.partial(_deliver, done, buffers)
            self._post(loop, peer, seq, buffers, fast=False, on_done=landed)
        # Pre-post the next transfer from this peer with these shapes; not after the
        # sender's last one of the step: a receive left pending across steps would block
        # this rank's exit if the peer stops sending (a rank that finishes and leaves first).
        if last:
            return buffers, []
        nxt = self._alloc(key)
        if any(b is not None for b in nxt):
            slot = _Slot(nxt)
            self._post(loop, peer, seq + 1, nxt, fast=True, on_done=slot.complete)
            self._prepost[peer] = (seq + 1, key, slot)
        return buffers, []

    def _alloc(self, key: _Key) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for ent in key:
            if ent is None:
                out.append(None)
                continue
            buf = torch.empty(ent[0], dtype=dtype_from_name(ent[1]), device=self.device)
            out.append(buf)
        return out

    def _waiter(self, peer: int) -> WorkWaiter:
        waiter = self._waiters.get(peer)
        if waiter is None:
            waiter = self._waiters[peer] = WorkWaiter(f"pipeloom-recv-r{self.rank}-from{peer}", poll=self._poll)
        return waiter

    def _post(
        self,
        loop: asyncio.AbstractEventLoop,
        peer: int,
        seq: int,
        buffers: list[torch.Tensor | None],
        *,
        fast: bool,
        on_done: Callable[[BaseException | None], None],
    ) -> None:
        """Post receives on the peer's waiter thread; ``on_done(err)`` runs on the loop when they land.

        Posting an irecv contends with gloo's I/O thread while data flows
        (hundreds of microseconds under load); on the waiter thread that time
        does not delay dispatch.  One thread per peer posts in order.
        """
        real = [b for b in buffers if b is not None]
        if not real:
            loop.call_soon(on_done, None)
            return
        group = self.pair_groups.get((peer, self.rank))

        def post() -> list[Any]:
            return [dist.irecv(b, src=peer, group=group, tag=_tag(seq, i, fast)) for i, b in enumerate(real)]

        def complete(err: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(on_done, err)
            except RuntimeError:  # the loop is closed: the job is being torn down
                pass

        self._waiter(peer).submit(post, complete)

    def _recv_nccl(
        self,
        loop: asyncio.AbstractEventLoop,
        peer: int,
        spec: TransferSpec,
        done: Callable[[list[torch.Tensor | None], BaseException | None], None] | None,
    ) -> tuple[list[torch.Tensor | None], list[Any]]:
        # Posted here, on the loop's thread, with the caller's current stream (the actor makes
        # that its transfer stream: NCCL orders its stream after the current one, which must
        # not hold queued compute).  The consumer orders its own stream after these Works.
        buffers = self._alloc(_key(spec))
        group = self.pair_groups.get((peer, self.rank))
        works = []
        for b in buffers:
            if b is not None:
                works.append(dist.irecv(b, src=peer, group=group))
        if done is None:
            # committed: nobody waits on the host; the Works are kept until they complete
            self._inflight_recvs.extend(works)
            self._reap_recvs()
            return buffers, works

        def complete(err: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(done, buffers, err)
            except RuntimeError:
                pass

        if not works:
            loop.call_soon(done, buffers, None)
        else:
            self._waiter(peer).submit(works, complete)
        return buffers, works

    def _reap_recvs(self) -> None:
        q = self._inflight_recvs
        while q and q[0].is_completed():
            q.popleft()

    def close(self, join_timeout: float = 1.0) -> None:
        for w in self._waiters.values():
            w.stop(join_timeout)
        self._waiters.clear()
