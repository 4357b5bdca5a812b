"""The tensor plane: point-to-point payloads through ``torch.distributed``.

Pairing.  NCCL point-to-point is tagless and FIFO per peer, so a receive pairs
with whatever the peer sent next.  The tensor plane therefore never lets the
two sides disagree on order: the sender numbers each transfer to a peer (a
per-peer sequence number) in exactly the order it posts the sends, and the
receiver posts its receives in that order.  Readiness stays dynamic (whichever
microbatch finishes first is sent first); pairing order is fixed by the
sender.  The sequence number is checked on arrival, so a lost or reordered
transfer is an error, never a silent mis-pairing.

Headers on the tensor plane (gloo).  gloo's send waits until the receiver has
posted the matching receive (a "ready" notice travels back first): measured
on this project's 2-core CI machine, a ping-pong of a small tensor takes about
100 us when the receive is already posted and 530 us when it is not.  And the
receiver cannot post a receive for a microbatch it does not know is coming.
Until protocol 3 each transfer was therefore announced on the control plane
(ZeroMQ) with its key and shapes, which cost about 280 us of host time per
transfer on the two ranks (encode, sign, two ZeroMQ I/O threads, drain,
decode, validate) -- the part of a step torch's runtime does not pay.  Now
every rank knows from the schedule how many transfers each peer sends it in a
step, so at the start of a step it posts them all (a few ahead, on one thread
per peer): each receive is a small int64 *header* (sequence number, step,
training or evaluation, kind, stage, microbatch, requires-grad bits) plus
payload buffers shaped like the same-numbered transfer of the previous step
of the same kind (training or evaluation).  The sender applies the same rule, so it knows what was
pre-posted: when its shapes match, the payload goes straight into those
buffers (``fast``); when they differ (the first step, or shapes that change
between microbatches), it fills them with placeholders and sends the shapes
(a short int64 spec) and the payload under other tags, into receives that the
peer's thread posts when the header says so.  No control message per
transfer, no receive left pending after a step (the count is exact), and
pairing still by sequence number: tags are derived from it.  The
alternatives were cheaper announcements (still two I/O threads and a drain
per transfer) or predicting shapes without telling the receiver (a mismatched
gloo receive fails the job).

Completion.  gloo's ``Work`` has no ``get_future()``; ``wait()`` blocks but
releases the GIL, and a point-to-point receive's ``is_completed()`` stays
False until someone waits.  Each peer therefore gets one daemon thread that
posts that peer's receives and waits on them in sequence order, handing each
landed transfer to the loop's thread through ``call_soon_threadsafe`` of the
object each step's plan carries: the loop that began the step (a caller may
run every step in a new loop), or the actor's landing queue
(``runtime/landing.py``), which the dispatcher drains itself and wakes the loop
only when it sleeps there.  While the dispatcher's thread is parked waiting for
a hand-off, the thread posts the next receive first, so that the hand-off is
its last Python before it waits again.  One thread per
peer (not a shared pool) because receives from one peer complete in order: a
pool could fill with receives whose data depends on our own progress while
the one we need sits queued.
Sends are not waited for on the hot path; their ``Work`` is kept (holding the
tensor alive) and waited for at the end of the step.  A gloo send's ``Work``
says it completed only once waited for, and a wait for a send whose receive the
peer never posts cannot be given up, so that wait runs on a thread -- unless
the peer's headers already said that every transfer sent to it has landed
(each gloo header carries how many of the receiver's transfers its sender has
landed: :meth:`TensorPlane.sends_landed`); then the waits return at once, on
the loop's thread.  In a pipeline the rank that finishes a step last has
usually heard so from its peer.

NCCL.  Two things differ on GPUs.  (1) NCCL runs a pair's point-to-point ops
in order on one stream, so a send from A to B posted before A's receive from
B can wait for B's receive, queued behind B's own send to A: a deadlock that
dynamic order would make likely.  Each *ordered* pair of ranks therefore gets
its own two-rank process group (created eagerly, in the same order on every
rank), so traffic A->B never queues behind B->A.  (2) ``wait()`` on an NCCL
``Work`` only makes the calling thread's current stream wait.  The GPU actor
commits a receive's consumer as soon as the receive is posted (see
``runtime/device.py``): the consumer's stream waits on the Work, no host
thread polls it, and the Works are only kept until they complete.  (3) The
headers travel as on gloo, through a
gloo group of their own (CPU memory: the receiver's thread reads them without
touching the GPU); when one lands the loop posts the payload's receive on the
consumer's stream, in header order, which is the order the peer sent in.
(4) With static shapes (``runtime/actor.py``, "Static shapes") a step whose
transfers are known carries no headers: the sender posts payloads in its list
order (:meth:`TensorPlane.send`), the receiver posts them in that order with
the learned shapes (:meth:`TensorPlane.recv_payload`), and the only header of
the step is one *end* header per peer (:meth:`TensorPlane.send_end`; an
abort header instead when the sender's step fails), which the peer waits for
before it finishes the step.  (5) ``static_shapes=True`` on gloo runs (3) and (4)
on CPU: the loop thread posts the payload receives and waits for them itself
(``runtime/direct_wait.py``; :meth:`TensorPlane.break_receives` frees a wait on a
lost peer).
"""

from __future__ import annotations

import asyncio
import atexit
import datetime
import logging
import queue
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "GlooReceiver",
    "Landed",
    "SendError",
    "TensorPlane",
    "TransferError",
    "WorkWaiter",
    "decode_spec",
    "encode_spec",
    "signature",
    "END",
    "abort_communicators",
    "dtype_from_name",
    "dtype_name",
    "make_pair_groups",
]

_SLOW = 1 << 30  #: tag offset of payloads sent outside a pre-posted receive
_BREAK_TAG = (1 << 31) - 1  #: tag of the receive that closes a pair on purpose (never sent)
_MAX_PARTS = 64  #: tensors per transfer that get distinct tags


def _tag(seq: int, part: int, fast: bool) -> int:
    return (seq * _MAX_PARTS + part) % _SLOW + (0 if fast else _SLOW)


#: gloo transfer header, int64 words: magic, seq, step, kind (0 F, 1 B), consuming stage,
#: microbatch, flags, requires-grad bits (by tensor position), words of the spec that follows,
#: and (gloo) how many of the receiver's transfers the sender has landed so far, which tells the
#: receiver that its sends below that number have completed (80 bytes: a payload packed after
#: it stays aligned for every dtype)
_HEADER_WORDS = 10
_HEADER_BYTES = _HEADER_WORDS * 8
#: gloo: headers are written and read as bytes (native int64, what a CPU int64 tensor holds) in a
#: ``bytearray`` that a tensor shares through ``torch.frombuffer``: a struct call instead of three
#: or four torch operations (a few microseconds each) per transfer on each side
_HEADER = struct.Struct(f"={_HEADER_WORDS}q")
#: a predicted transfer of one tensor of at most this many bytes travels packed after its header,
#: one message instead of two (the copy costs less than a gloo send and receive)
_PACK_MAX = 64 << 10
_MAGIC = 0x706C6F6F6D  # "ploom"
_FLAG_FAST = 1  #: the payload went into the pre-posted buffers
_FLAG_ABORT = 2  #: no payload: the sender's step failed (it fills what was posted for it)
_FLAG_END = 8  #: no payload: the sender's step ended with every transfer sent (NCCL, static shapes)
#: the kind of the Landed that an end-of-step header delivers
END = "E"
_FLAG_TRAIN = 4  #: sent in a training step (the sender predicted from its training table)
_HEADER_PART = _MAX_PARTS - 1  #: tag part of the header (pre-posted, fast tag space)
_SPEC_PART = _MAX_PARTS - 1  #: tag part of the spec of an unpredicted transfer (slow tag space)
_MAX_TENSORS = _MAX_PARTS - 1  #: tensor positions per transfer (the requires-grad bits, the tags)
_KINDS = ("F", "B")
_MAX_SPEC_WORDS = 1 + _MAX_TENSORS * 40


_Key = tuple[tuple[tuple[int, ...], str] | None, ...]


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


_DTYPE_LIST = tuple(_DTYPES.values())
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPE_LIST)}


def encode_spec(key: _Key) -> list[int]:
    """The int64 words that tell a receiver the shapes and dtypes of an unpredicted transfer."""
    out = [len(key)]
    for ent in key:
        if ent is None:
            out.append(-1)
            continue
        shape, dt = ent
        out += [_DTYPE_CODE[dtype_from_name(dt)], len(shape), *shape]
    return out


def decode_spec(words: Sequence[int]) -> _Key:
    """Inverse of :func:`encode_spec`; ValueError on anything malformed."""
    try:
        n = words[0]
        if not 0 <= n <= _MAX_TENSORS:
            raise ValueError(f"{n} tensors")
        out: list[tuple[tuple[int, ...], str] | None] = []
        i = 1
        for _ in range(n):
            code = words[i]
            i += 1
            if code == -1:
                out.append(None)
                continue
            if not 0 <= code < len(_DTYPE_LIST):
                raise ValueError(f"dtype code {code}")
            ndim = words[i]
            if not 0 <= ndim <= 32:
                raise ValueError(f"{ndim} dimensions")
            shape = tuple(words[i + 1 : i + 1 + ndim])
            if len(shape) != ndim:
                raise IndexError
            if any(d < 0 for d in shape):
                raise ValueError(f"shape {shape}")
            i += 1 + ndim
            out.append((shape, dtype_name(_DTYPE_LIST[code])))
        if i != len(words):
            raise ValueError(f"{len(words) - i} trailing words")
        return tuple(out)
    except IndexError:
        raise ValueError("truncated") from None


#: _packed's answers by key (a step's transfers repeat a few keys)
_PACKED: dict[_Key, int | None] = {}


def _packed(key: _Key | None) -> int | None:
    """Payload bytes if a transfer predicted as ``key`` travels packed after its header, else None."""
    if key is None:
        return None
    try:
        return _PACKED[key]
    except KeyError:
        pass
    real = [e for e in key if e is not None]
    size: int | None = None
    if len(real) == 1:
        shape, dt = real[0]
        n = dtype_from_name(dt).itemsize
        for d in shape:
            n *= d
        size = n if n <= _PACK_MAX else None
    if len(_PACKED) < 4096:
        _PACKED[key] = size
    return size


def _unpack(raw: bytearray, buf: torch.Tensor, key: _Key) -> list[torch.Tensor | None]:
    """The payload of a packed receive buffer (``buf`` shares ``raw``), by tensor position (see :func:`_packed`)."""
    out: list[torch.Tensor | None] = []
    for ent in key:
        if ent is None:
            out.append(None)
            continue
        shape, dt = ent
        dtype = dtype_from_name(dt)
        n = len(raw) - _HEADER_BYTES
        if n:
            out.append(torch.frombuffer(raw, dtype=dtype, offset=_HEADER_BYTES, count=n // dtype.itemsize).view(shape))
        else:  # (frombuffer refuses an empty range)
            out.append(buf[_HEADER_BYTES:].view(dtype).view(shape))
    return out


def _header_buffer(words: Sequence[int] | None = None) -> tuple[bytearray, torch.Tensor]:
    """gloo: a header's bytes and the int64 tensor that shares them (filled with ``words`` if given)."""
    raw = bytearray(_HEADER_BYTES)
    if words is not None:
        _HEADER.pack_into(raw, 0, *words)
    return raw, torch.frombuffer(raw, dtype=torch.int64)


def _packed_buffer(size: int) -> tuple[bytearray, torch.Tensor]:
    """gloo: the bytes of a header with a packed payload of ``size`` bytes after it, and a uint8 tensor sharing them."""
    raw = bytearray(_HEADER_BYTES + size)
    return raw, torch.frombuffer(raw, dtype=torch.uint8)


#: id(process group), global rank -> (the group, the rank's number in it); the group stays
#: referenced here, so its id cannot be reused by another
_PEERS: dict[tuple[int, int], tuple[Any, int]] = {}


def _peer(group: Any, rank: int) -> tuple[Any, int]:
    pg = group if group is not None else dist.group.WORLD  # (the default group of now: re-init safe)
    got = _PEERS.get((id(pg), rank))
    if got is None:
        got = _PEERS[(id(pg), rank)] = (pg, dist.get_group_rank(pg, rank))
    return got


def _real(t: torch.Tensor) -> torch.Tensor:
    """What goes on the wire for ``t``: a complex tensor as its real view (the backends move real data)."""
    return torch.view_as_real(t) if t.is_complex() else t


def _isend(t: torch.Tensor, peer: int, group: Any, tag: int = 0) -> Any:
    """``dist.isend`` without its per-call checks and rank translation (ProcessGroup.send, public):
    about 100 us of Python per call on a GPU host, paid twice per transfer."""
    pg, r = _peer(group, peer)
    return pg.send([torch.view_as_real(t) if t.is_complex() else t], r, tag)


def _irecv(b: torch.Tensor, peer: int, group: Any, tag: int = 0) -> Any:
    """``dist.irecv`` the same way (see :func:`_isend`)."""
    pg, r = _peer(group, peer)
    return pg.recv([torch.view_as_real(b) if b.is_complex() else b], r, tag)


_EXIT_GUARD: list[threading.Thread] = []


def guard_exit(threads: Sequence[threading.Thread], grace: float = 3.0) -> None:
    """Make sure no thread parked in a gloo receive returns into a finalizing interpreter.

    After a failure, peers fill each other's posted receives (``abort_step``),
    but a peer that is stopped (SIGSTOP) or hung cannot: a receiver thread may
    stay parked in gloo until that peer is killed and its connection closes.
    If that happens while this interpreter finalizes, the thread cannot take
    the GIL and C++ terminates the process ("terminate called without an
    active exception", exit -6) instead of the exit code the failure deserves.
    gloo has no way to cancel a posted receive, so at exit, when the program
    is ending with an uncaught exception, this waits up to ``grace`` seconds for
    the threads and then ends the process with exit code 1 without finalizing.
    """
    global _EXIT_GRACE
    _EXIT_GRACE = grace
    _EXIT_GUARD.extend(threads)


_EXIT_GRACE = 3.0
#: gloo Works posted on the loop's thread that a failed step will never complete (see guard_exit_works)
_EXIT_WORKS: list[Any] = []


def guard_exit_works(works: Sequence[Any]) -> None:
    """Keep ``works`` (gloo receives posted by the loop's thread, which a failed step will never
    consume or see completed) alive until exit, and have the exit guard end a failing process
    with exit code 1 without finalizing: destroying a pending gloo Work at finalization ends
    the process with C++'s terminate (exit -6) instead of the failure's exit code."""
    _EXIT_WORKS.extend(works)


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a Work that cannot say is treated as pending
        return False


def _exit_guard() -> None:
    # Registered at import, so it runs after every Pipeline's own exit handler (atexit runs
    # handlers last-registered first) -- a Pipeline closed at exit adds its threads just before.
    import sys

    if not _EXIT_GUARD and not _EXIT_WORKS:
        return
    deadline = time.monotonic() + _EXIT_GRACE
    for t in _EXIT_GUARD:
        t.join(max(0.0, deadline - time.monotonic()))
    failing = getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None
    if failing and (any(not _completed(w) for w in _EXIT_WORKS) or any(t.is_alive() for t in _EXIT_GUARD)):
        log.warning("pipeloom: receives from a failed peer are still pending in gloo; exiting without finalizing")
        exit_now(1)


def exit_now(code: int) -> None:
    """End the process at once with ``code`` (``os._exit``: no finalization, no atexit handlers), its standard
    streams flushed first so that what it printed is not lost."""
    import os
    import sys

    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(code)


atexit.register(_exit_guard)


def _sendable(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its value in plain contiguous memory: a send reads memory, and a conjugate or
    negative view (``z.conj()``, ``z.conj().imag``) holds the conjugate or negation of its value."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def signature(tensors: Sequence[torch.Tensor | None], kind: str, stage: int, mb: int, *,
              sendable: bool = True) -> tuple[list[torch.Tensor], _Key, int]:
    """A transfer's sendable tensors, its shapes and dtypes by position, and its requires-grad bits.

    ``sendable=False``: the tensors as given (detached), no copies.  Making a sendable copy (a
    non-contiguous output, a conjugate view) launches a kernel on the current stream, so on a GPU
    it belongs where the send is posted: on the producer's stream (``RankActor._send_one``), or
    it may read the output before its producer has written it.

    Raises ValueError (naming the stage and microbatch) for what the tensor plane cannot send.
    """
    if len(tensors) > _MAX_TENSORS:
        raise ValueError(
            f"a stage output of {len(tensors)} tensors cannot be sent (at most {_MAX_TENSORS}): "
            f"stage {stage} microbatch {mb}; return fewer tensors (e.g. stack them)"
        )
    real: list[torch.Tensor] = []
    key_l: list[tuple[tuple[int, ...], str] | None] = []
    mask = 0
    for j, t in enumerate(tensors):
        if t is None:
            key_l.append(None)
            continue
        if t.dtype not in _DTYPE_CODE:
            raise ValueError(
                f"the {'activation' if kind == 'F' else 'gradient'} for stage {stage} microbatch {mb} holds a tensor of "
                f"dtype {dtype_name(t.dtype)} (position {j}), which the tensor plane cannot send; supported: {', '.join(_DTYPES)}"
            )
        if t.requires_grad:
            mask |= 1 << j
        t = _sendable(t.detach()) if sendable else t.detach()
        real.append(t)
        key_l.append((tuple(t.shape), dtype_name(t.dtype)))
    return real, tuple(key_l), mask


def _alloc(key: _Key, device: torch.device) -> list[torch.Tensor | None]:
    return [None if ent is None else torch.empty(ent[0], dtype=dtype_from_name(ent[1]), device=device) for ent in key]


@dataclass(frozen=True)
class Landed:
    """A transfer that has landed (gloo), or whose header has (NCCL: the payload is to be received)."""

    src: int
    seq: int
    step: int
    kind: str
    stage: int  #: the consuming stage
    microbatch: int
    buffers: list[torch.Tensor | None]
    requires_grad: tuple[bool, ...]  #: per tensor position (activations: the consumer's inputs)
    header_ns: int  #: when the header arrived (trace clock)
    done_ns: int  #: when the payload had landed
    fast: bool  #: the payload went into the buffers posted ahead (shapes as predicted)
    shapes: _Key = ()  #: shape and dtype per tensor position (what an NCCL receive allocates)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers if b is not None)


class TransferError(RuntimeError):
    """A gloo transfer from ``peer`` failed or was malformed; ``seq``: which one."""

    def __init__(self, peer: int, seq: int, message: str) -> None:
        self.peer = peer
        self.seq = seq
        super().__init__(message)


class _Abandon(Exception):
    """A receiver thread stops: a transfer failed (already reported)."""


class GlooReceiver:
    """One peer's gloo receives: posted ahead from step plans, waited in order, handed to the loop.

    ``expect(step, train, seq0, n, loop, deliver, announce)`` (from the loop,
    at the start of a step) queues the step's ``n`` transfers from the peer,
    sequence numbers ``seq0`` on, to be handed to ``loop`` (the one running
    that step: a caller may run each step in a new loop).  The thread keeps ``depth`` of them posted ahead, each a header plus
    buffers shaped like the same-numbered transfer of the previous step of the
    same kind (``train``); it waits on them in order, reads each header
    (checking magic, sequence number and step), posts the real receives for an
    unpredicted one, and calls ``deliver(landed, None)`` on the loop -- or
    ``deliver(None, TransferError)`` once, after which it stops.  ``announce``
    (optional) is called on the loop with (step, kind, stage, microbatch) when
    an unpredicted transfer's header has arrived and its payload is still on
    the way.  The sender keeps the same table (:meth:`TensorPlane.send_transfer`).
    """

    def __init__(
        self,
        rank: int,
        peer: int,
        *,
        group: Any,
        device: torch.device,
        depth: int,
        payload: bool = True,
    ) -> None:
        self.rank = rank
        self.peer = peer
        #: False (NCCL): only headers travel here; the loop receives the payload on the GPU
        self._payload = payload
        self._group = group
        self._device = device
        self._depth = max(1, depth)
        # the step being received: where its transfers go (set from its plan, on the thread)
        self._loop: Any = None  #: anything with call_soon_threadsafe (an event loop, a LandingQueue)
        self._deliver: Callable[[Landed | None, TransferError | None], None] | None = None
        self._announce: Callable[[tuple[int, str, int, int]], None] | None = None
        #: per kind of step (train?): the shapes of the previous step's transfers, by position
        self._tables: dict[bool, list[_Key]] = {}
        #: gloo: the peer's transfers landed here (every one below this sequence number), and how
        #: many of ours the peer said it had landed (its headers' last word); see TensorPlane.sends_landed
        self.landed = 0
        self.acked = 0
        self._plans: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"pipeloom-recv-r{rank}-from{peer}", daemon=True)
        self._thread.start()

    def expect(
        self,
        step: int,
        train: bool,
        seq0: int,
        n: int,
        loop: Any,
        deliver: Callable[[Landed | None, TransferError | None], None],
        announce: Callable[[tuple[int, str, int, int]], None] | None = None,
    ) -> None:
        self._plans.put((step, train, seq0, n, loop, deliver, announce))

    def stop(self, timeout: float = 1.0) -> None:
        self._plans.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[union-attr]
        except RuntimeError:  # the loop is closed: the job is being torn down
            pass

    def _run(self) -> None:
        while True:
            plan = self._plans.get()
            if plan is None:
                return
            step, train, seq0, n, self._loop, self._deliver, self._announce = plan
            try:
                self._receive_step(step, train, seq0, n)
            except _Abandon:
                return

    def _irecv(self, buf: torch.Tensor, seq: int, part: int, fast: bool) -> Any:
        return _irecv(buf, self.peer, self._group, _tag(seq, part, fast))

    def _post(self, seq: int, pred: _Key | None) -> tuple[int, _Key | None, torch.Tensor | bytearray, Any, list[torch.Tensor | None], list[Any]]:
        # the header: a tensor (headers only, NCCL) or the bytes a gloo header lands in
        if not self._payload:
            header = torch.empty(_HEADER_WORDS, dtype=torch.int64)
            return seq, pred, header, self._irecv(header, seq, _HEADER_PART, True), [], []
        size = _packed(pred)
        if size is not None:  # header and payload in one message
            assert pred is not None
            raw, buf = _packed_buffer(size)
            return seq, pred, raw, self._irecv(buf, seq, _HEADER_PART, True), _unpack(raw, buf, pred), []
        raw, ht = _header_buffer()
        hwork = self._irecv(ht, seq, _HEADER_PART, True)
        header = raw
        buffers = _alloc(pred, self._device) if pred is not None else []
        works = [self._irecv(b, seq, i, True) for i, b in enumerate(x for x in buffers if x is not None)]
        return seq, pred, header, hwork, buffers, works

    def _receive_step(self, step: int, train: bool, seq0: int, n: int) -> None:
        prev = self._tables.get(train, [])
        cur: list[_Key] = []
        posted: deque[tuple[int, _Key | None, torch.Tensor | bytearray, Any, list[torch.Tensor | None], list[Any]]] = deque()
        i = 0
        seq = seq0
        try:
            while i < n or posted:
                while i < n and len(posted) < self._depth:
                    posted.append(self._post(seq0 + i, prev[i] if i < len(prev) else None))
                    i += 1
                seq, pred, header, hwork, buffers, works = posted.popleft()
                hwork.wait()
                header_ns = time.monotonic_ns()
                if getattr(self._loop, "parked", False):
                    # The loop thread is blocked waiting for this hand-off (runtime/landing.py): keep
                    # ``depth`` posted now rather than after it, so that the hand-off is this thread's
                    # last Python before it waits again and the woken loop thread finds the GIL free.
                    # (When the loop thread is busy, the hand-off goes first: each receive posted
                    # releases the GIL, which the busy thread takes, delaying the hand-off.)
                    while i < n and len(posted) < self._depth:
                        posted.append(self._post(seq0 + i, prev[i] if i < len(prev) else None))
                        i += 1
                h = _HEADER.unpack_from(header) if isinstance(header, bytearray) else header.tolist()
                # checked before waiting for the payload: a sender that predicted from another
                # table sends no payload (or placeholders) into these buffers
                if h[0] != _MAGIC or h[1] != seq:
                    raise TransferError(self.peer, seq, f"malformed transfer header from rank {self.peer} for transfer {seq} "
                                                        f"(step {step}): {h}")
                if h[2] != step:
                    raise TransferError(
                        self.peer, seq,
                        f"rank {self.peer} sent a transfer of its step {h[2]} while this rank expects step {step}'s: "
                        "the ranks disagree on which step they run (every rank must call step()/eval() in the same order)",
                    )
                if bool(h[6] & _FLAG_TRAIN) != train:
                    what = ("a training step", "an evaluation step")
                    raise TransferError(
                        self.peer, seq,
                        f"rank {self.peer} sent a transfer of {what[not h[6] & _FLAG_TRAIN]} (step {step}) while this rank runs "
                        f"{what[not train]}: every rank must call step() or eval() alike, in the same order",
                    )
                for w in works:  # the payload (fast) or the sender's placeholders
                    w.wait()
                # (read by the loop's thread: its sends to the peer below h[9] have landed there;
                # the peer's below seq + 1 have landed here)
                self.acked = max(self.acked, h[9])
                self.landed = seq + 1
                if h[6] & _FLAG_ABORT:
                    # the sender's step failed: it fills every receive of the step this way, so that
                    # no thread stays parked in gloo (the failure itself comes as an abort message)
                    cur.append(pred if pred is not None else ())
                    continue
                if h[6] & _FLAG_END:
                    # static shapes (headers mode only): the sender sent all of the step's payloads.
                    # Not a transfer: it takes no place in the table the next step with headers is
                    # predicted from (the sender's send_end takes none in its own table either)
                    self._call(self._deliver, Landed(self.peer, seq, step, END, -1, -1, [], (), header_ns, header_ns, False), None)
                    continue
                if not 0 <= h[3] < len(_KINDS):
                    raise TransferError(self.peer, seq, f"malformed transfer header from rank {self.peer}: kind {h[3]}")
                kind = _KINDS[h[3]]
                fast = bool(h[6] & _FLAG_FAST)
                if fast:
                    if pred is None:
                        raise TransferError(self.peer, seq, f"rank {self.peer} sent transfer {seq} into buffers that were never posted")
                    key = pred
                else:
                    if not 1 <= h[8] <= _MAX_SPEC_WORDS:
                        raise TransferError(self.peer, seq, f"malformed transfer header from rank {self.peer}: {h[8]} spec words")
                    spec = torch.empty(h[8], dtype=torch.int64)
                    self._irecv(spec, seq, _SPEC_PART, False).wait()
                    try:
                        key = decode_spec(spec.tolist())
                    except ValueError as exc:
                        raise TransferError(self.peer, seq, f"malformed transfer spec from rank {self.peer}: {exc}") from None
                    if self._payload:
                        if self._announce is not None:
                            self._call(self._announce, (step, kind, h[4], h[5]))
                        buffers = _alloc(key, self._device)
                        for w in [self._irecv(b, seq, j, False) for j, b in enumerate(x for x in buffers if x is not None)]:
                            w.wait()
                cur.append(key)
                rg = tuple(bool(h[7] >> j & 1) for j in range(len(key)))
                landed = Landed(self.peer, seq, step, kind, h[4], h[5], buffers, rg,
                                header_ns, time.monotonic_ns(), fast, key)
                self._call(self._deliver, landed, None)
                landed = buffers = None  # type: ignore[assignment]
        except TransferError as exc:
            self._call(self._deliver, None, exc)
            raise _Abandon from None
        except BaseException as exc:  # gloo raises RuntimeError on a closed connection
            self._call(self._deliver, None, TransferError(self.peer, seq, f"receiving transfer {seq} from rank {self.peer} failed: {exc}"))
            raise _Abandon from None
        finally:
            # drop the Works here, not at interpreter shutdown (see WorkWaiter)
            posted.clear()
        if cur:
            # (a headerless step, only its end header: the prediction stays the last step with
            # headers, as on the sender, whose table changes only in steps it sends transfers in)
            self._tables[train] = cur


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
    edges: set[tuple[int, int]], *, backend: str | None = None, max_ctas: int | None = None, batch_p2p: bool = False
) -> dict[tuple[int, int], dist.ProcessGroup]:
    """One two-rank group per ordered pair in ``edges``; every rank must call this with the same set.
    ``batch_p2p``: the payloads will be posted with ``batch_isend_irecv`` (``RuntimeOptions.batch_p2p``), so the
    pairs are connected that way (a process group without a bound device gives NCCL's coalesced point-to-point
    operations a communicator of their own, which must not be created mid-step).

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
    _connect(groups, torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"), batched=batch_p2p)
    return groups


def _connect(groups: dict[tuple[int, int], dist.ProcessGroup], dev: torch.device, *, batched: bool = False) -> None:
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
        if batched:
            op = dist.P2POp(dist.isend, t, b, groups[(a, b)]) if me == a else dist.P2POp(dist.irecv, t, a, groups[(a, b)])
            works += [(w, t) for w in dist.batch_isend_irecv([op])]
        elif me == a:
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
        prepost_depth: int = 2,
        header_group: Any = None,
        batch_p2p: bool = False,
    ) -> None:
        self.rank = rank
        self.device = device
        #: post a transfer's payload operations as one batch_isend_irecv (RuntimeOptions.batch_p2p)
        self.batch_p2p = batch_p2p
        #: NCCL: the gloo group that carries transfer headers (the payloads go through the pair
        #: groups, received by the loop when the header has landed); None: headers and payloads
        #: both through gloo
        self.header_group = header_group
        #: (src, dst) -> the two-rank group that carries src's sends to dst (None: the default group)
        self.pair_groups = pair_groups or {}
        #: gloo: transfers from one peer posted ahead of the one being waited for
        self.prepost_depth = prepost_depth
        self._send_seq: dict[int, int] = {}
        self._recv_seq: dict[int, int] = {}
        self._receivers: dict[int, GlooReceiver] = {}
        #: (Work, the tensors it holds alive, destination rank), in posting order
        self._inflight_sends: deque[tuple[Any, Sequence[torch.Tensor], int]] = deque()
        #: NCCL receives committed to a consumer's stream (no host waiter), kept until complete
        self._inflight_recvs: deque[Any] = deque()
        # gloo, sending side of the header protocol (see the module docstring)
        self._send_train = True
        #: per peer: sequence number of our first transfer to it in this step
        self._send_base: dict[int, int] = {}
        #: per (peer, train?): shapes of the previous such step's transfers to it, by position
        self._send_tables: dict[tuple[int, bool], list[_Key]] = {}
        #: per peer: shapes of this step's transfers so far
        self._send_cur: dict[int, list[_Key]] = {}
        #: the step being sent (number, transfers to send each peer in it)
        self._send_step: tuple[int, dict[int, int]] = (-1, {})
        self._closed_threads: list[threading.Thread] = []
        #: gloo: transfers sent into buffers posted ahead / with their shapes (for debug_state, benchmarks)
        self.sent_fast = 0
        self.sent_slow = 0

    # -- steps (gloo) -------------------------------------------------------
    def begin_step(
        self,
        step: int,
        train: bool,
        recv_counts: dict[int, int],
        send_counts: dict[int, int],
        deliver: Callable[[Landed | None, TransferError | None], None],
        announce: Callable[[tuple[int, str, int, int]], None] | None = None,
        loop: Any = None,
    ) -> None:
        """Start a step in which each peer ``p`` sends ``recv_counts[p]`` transfers to this rank.

        ``send_counts``: how many this rank sends each peer (for :meth:`abort_step`).
        ``loop``: what the receiver threads hand landings to, through its
        ``call_soon_threadsafe``: the running loop by default, or the actor's
        ``runtime.landing.LandingQueue``, which drains them on the loop's thread.

        Queues their receives on the peers' receiver threads (``deliver`` is
        called on the loop's thread as each lands) and turns the previous
        step's sends into the prediction of this step's.  Must be called by
        every rank at the start of every step, in the same order of steps.
        """
        for peer, keys in self._send_cur.items():
            self._send_tables[(peer, self._send_train)] = keys
        self._send_cur = {}
        self._send_train = train
        self._send_base = dict(self._send_seq)
        self._send_step = (step, dict(send_counts))
        if loop is None:
            loop = asyncio.get_running_loop()
        for peer, n in sorted(recv_counts.items()):
            if n <= 0:
                continue
            seq0 = self._recv_seq.get(peer, 0)
            self._recv_seq[peer] = seq0 + n
            rx = self._receivers.get(peer)
            if rx is None:
                headers_only = self.header_group is not None
                rx = self._receivers[peer] = GlooReceiver(
                    self.rank, peer, group=self.header_group if headers_only else self.pair_groups.get((peer, self.rank)),
                    device=self.device, depth=self.prepost_depth, payload=not headers_only,
                )
            rx.expect(step, train, seq0, n, loop, deliver, announce)

    def send_transfer(self, peer: int, step: int, kind: str, stage: int, mb: int, tensors: Sequence[torch.Tensor | None]) -> tuple[int, int, bool]:
        """gloo: send one transfer (header, then payload) to ``peer``; return (seq, bytes, fast).

        ``stage`` is the consuming stage.  The payload goes into the buffers the
        peer posted ahead when its shapes are the predicted ones (the same
        position's shapes in our previous step of this kind); otherwise the
        header says so and the shapes and payload follow under other tags.
        """
        # Whatever can refuse the tensors does so before the transfer takes its sequence number:
        # a number taken is a transfer the peer's thread waits for, and abort_step fills only
        # the numbers not taken.
        real, key, mask = signature(tensors, kind, stage, mb)
        seq = self.next_send_seq(peer)
        idx = seq - self._send_base.get(peer, 0)
        prev = self._send_tables.get((peer, self._send_train))
        pred = prev[idx] if prev is not None and idx < len(prev) else None
        self._send_cur.setdefault(peer, []).append(key)
        fast = pred == key
        if fast:
            self.sent_fast += 1
        else:
            self.sent_slow += 1
        spec = [] if fast else encode_spec(key)
        group = self.pair_groups.get((self.rank, peer))
        flags = (_FLAG_FAST if fast else 0) | (_FLAG_TRAIN if self._send_train else 0)
        rx = self._receivers.get(peer)
        words = [_MAGIC, seq, step, _KINDS.index(kind), stage, mb, flags, mask, len(spec), rx.landed if rx is not None else 0]
        q = self._inflight_sends
        if self.header_group is not None:
            # NCCL: the header (and the shapes when unpredicted) through gloo now, on the host; the
            # payload through the pair's communicator, ordered after the caller's stream
            hg = self.header_group
            header = torch.tensor(words, dtype=torch.int64)
            q.append((_isend(header, peer, hg, _tag(seq, _HEADER_PART, True)), (header,), peer))
            if not fast:
                st = torch.tensor(spec, dtype=torch.int64)
                q.append((_isend(st, peer, hg, _tag(seq, _SPEC_PART, False)), (st,), peer))
            return seq, self.send(peer, real), fast
        size = _packed(pred)
        if size is not None:
            # the peer posted one buffer for header and payload: fill it (with the payload when fast)
            raw, buf = _packed_buffer(size)
            _HEADER.pack_into(raw, 0, *words)
            if fast and size:
                buf[_HEADER_BYTES:].copy_(real[0].reshape(-1).view(torch.uint8))
            q.append((_isend(buf, peer, group, _tag(seq, _HEADER_PART, True)), (buf,), peer))
            if fast:
                self._reap_sends()
                return seq, size, True
        else:
            header = _header_buffer(words)[1]
            q.append((_isend(header, peer, group, _tag(seq, _HEADER_PART, True)), (header,), peer))
            if not fast and pred is not None:  # release the buffers the peer posted ahead
                for j, ent in enumerate(e for e in pred if e is not None):
                    ph = torch.empty(ent[0], dtype=dtype_from_name(ent[1]))
                    q.append((_isend(ph, peer, group, _tag(seq, j, True)), (ph,), peer))
        if not fast:
            st = torch.tensor(spec, dtype=torch.int64)
            q.append((_isend(st, peer, group, _tag(seq, _SPEC_PART, False)), (st,), peer))
        nbytes = 0
        for j, t in enumerate(real):
            q.append((_isend(t, peer, group, _tag(seq, j, fast)), (t,), peer))
            nbytes += t.numel() * t.element_size()
        self._reap_sends()
        return seq, nbytes, fast

    def abort_step(self) -> int:
        """This rank's step failed: fill what every peer still expects from us in it; returns how many.

        Each remaining transfer of the step goes as a header flagged abort (and
        placeholders where the peer posted payload buffers), so the peers'
        receiver threads finish the step instead of staying parked in gloo,
        where a thread woken by a connection closing during interpreter exit
        takes the process down with "terminate called".  Best effort: a peer
        that is gone makes the sends fail, which is ignored.
        """
        step, counts = self._send_step
        filled = 0
        for peer, total in sorted(counts.items()):
            for _ in range(total - (self._send_seq.get(peer, 0) - self._send_base.get(peer, 0))):
                try:
                    self._send_abort(peer, step)
                    filled += 1
                except Exception:  # noqa: BLE001 - the peer may be gone; its thread ended by itself
                    break
        self._send_step = (step, {})
        return filled

    def send_end(self, peer: int, step: int) -> None:
        """NCCL, static shapes: tell ``peer`` that every payload of this step to it is posted.

        Its one header of the step: the peer does not finish its step without it (or an abort
        header, when this rank's step fails), so a step whose transfer could not be sent as
        predicted never completes on the receiving rank either.
        """
        seq = self.next_send_seq(peer)
        flags = _FLAG_END | (_FLAG_TRAIN if self._send_train else 0)
        words = torch.tensor([_MAGIC, seq, step, 0, 0, 0, flags, 0, 0, 0], dtype=torch.int64)
        self._inflight_sends.append((_isend(words, peer, self.header_group, _tag(seq, _HEADER_PART, True)), (words,), peer))

    def _send_abort(self, peer: int, step: int) -> None:
        seq = self.next_send_seq(peer)
        idx = seq - self._send_base.get(peer, 0)
        prev = self._send_tables.get((peer, self._send_train))
        pred = prev[idx] if prev is not None and idx < len(prev) else None
        self._send_cur.setdefault(peer, []).append(pred if pred is not None else ())
        flags = _FLAG_ABORT | (_FLAG_TRAIN if self._send_train else 0)
        words = torch.tensor([_MAGIC, seq, step, 0, 0, 0, flags, 0, 0, 0], dtype=torch.int64)
        q = self._inflight_sends
        if self.header_group is not None:
            q.append((_isend(words, peer, self.header_group, _tag(seq, _HEADER_PART, True)), (words,), peer))
            return
        group = self.pair_groups.get((self.rank, peer))
        size = _packed(pred)
        if size is not None:
            raw, buf = _packed_buffer(size)
            raw[:_HEADER_BYTES] = _HEADER.pack(*words.tolist())
            q.append((_isend(buf, peer, group, _tag(seq, _HEADER_PART, True)), (buf,), peer))
            return
        q.append((_isend(words, peer, group, _tag(seq, _HEADER_PART, True)), (words,), peer))
        for j, ent in enumerate(e for e in (pred or ()) if e is not None):
            ph = torch.empty(ent[0], dtype=dtype_from_name(ent[1]))
            q.append((_isend(ph, peer, group, _tag(seq, j, True)), (ph,), peer))

    # -- sending (NCCL) ---------------------------------------------------
    def next_send_seq(self, peer: int) -> int:
        seq = self._send_seq.get(peer, 0)
        self._send_seq[peer] = seq + 1
        return seq

    def send(self, peer: int, tensors: Sequence[torch.Tensor | None]) -> int:
        """NCCL: post the payload sends of one transfer, in order; return its bytes."""
        group = self.pair_groups.get((self.rank, peer))
        nbytes = 0
        if self.batch_p2p:
            ts = tuple(_sendable(t.detach()) for t in tensors if t is not None)
            if ts:
                # (one Work per batch on NCCL, one per operation on gloo: each keeps the whole batch alive)
                for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, _real(t), peer, group) for t in ts]):
                    self._inflight_sends.append((work, ts, peer))
                nbytes = sum(t.numel() * t.element_size() for t in ts)
            self._reap_sends()
            return nbytes
        for t in tensors:
            if t is None:
                continue
            t = _sendable(t.detach())
            work = _isend(t, peer, group)
            nbytes += t.numel() * t.element_size()
            self._inflight_sends.append((work, (t,), peer))
        self._reap_sends()
        return nbytes

    def send_placeholder(self, peer: int, expected: _Key) -> None:
        """NCCL, static shapes: fill the receive the peer posted with ``expected`` shapes (a transfer
        that cannot be sent as predicted), so that no receive kernel waits forever on its GPU."""
        self.send(peer, [b for b in _alloc(expected, self.device) if b is not None])

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

    def sends_landed(self) -> bool:
        """gloo: whether every transfer posted so far has landed at its peer, as the peers' headers said.

        Then :meth:`drain_sends` cannot block on a peer (each send's data has
        arrived; at most its completion is being recorded by this process's
        gloo thread), so it may run on the loop's thread.
        """
        for peer, n in self._send_seq.items():
            if n:
                rx = self._receivers.get(peer)
                if rx is None or rx.acked < n:
                    return False
        return True

    @property
    def pending_sends(self) -> int:
        self._reap_sends()
        return len(self._inflight_sends)

    # -- receiving --------------------------------------------------------
    def recv_payload(self, peer: int, shapes: _Key) -> tuple[list[torch.Tensor | None], list[Any]]:
        """Headers mode (NCCL): post the payload receives of a transfer whose header has landed.

        Posted on the caller's current stream, in header order (the order the
        peer sent), through the pair's group without tags, so they pair with
        the peer's sends; returns the buffers and their Works (kept here until
        complete; the consumer's stream waits on them).
        """
        buffers = _alloc(shapes, self.device)
        group = self.pair_groups.get((peer, self.rank))
        if self.batch_p2p:
            ops = [dist.P2POp(dist.irecv, _real(b), peer, group) for b in buffers if b is not None]
            works = dist.batch_isend_irecv(ops) if ops else []
        else:
            works = [_irecv(b, peer, group) for b in buffers if b is not None]
        self._inflight_recvs.extend(works)
        self._reap_recvs()
        return buffers, works

    def break_receives(self, peer: int) -> None:
        """gloo: make a receive from ``peer`` that a thread is blocked in raise, by closing the pair.

        A gloo wait cannot be given up, and torch binds no ``Work.abort()``; but a wait
        whose timeout expires closes its pair's connection, failing every operation pending
        on it.  So a receive of nothing, waited for 1 ms, does it (``runtime/direct_wait.py``:
        a peer declared lost while the loop thread waits for it).  The pair is unusable after.
        """
        pg, r = _peer(self.pair_groups.get((peer, self.rank)), peer)
        if pg is dist.group.WORLD:
            raise RuntimeError("break_receives needs the pair groups (it would close the default group)")
        try:
            pg.recv([torch.empty(1)], r, _BREAK_TAG).wait(datetime.timedelta(milliseconds=1))
        except RuntimeError:
            pass  # expected: the wait expired and the pair is closed

    def _reap_recvs(self) -> None:
        q = self._inflight_recvs
        while q and q[0].is_completed():
            q.popleft()

    def blocked_threads(self) -> list[threading.Thread]:
        """Receiver threads still alive after :meth:`close` (parked in a gloo receive from a peer that failed)."""
        return [t for t in self._closed_threads if t.is_alive()]

    def close(self, join_timeout: float = 1.0) -> None:
        self._closed_threads = [r._thread for r in self._receivers.values()]
        for r in self._receivers.values():
            r.stop(join_timeout)
        self._receivers.clear()
