"""Distributed checkpoints of a pipeline: resumable after a crash, loadable under another layout.

The problem.  A pipeline's state is spread over ranks: each rank holds some
stages, with FSDP each holds a shard of them, and with data parallelism
several ranks hold the same thing.  A checkpoint must hold every parameter,
buffer and optimizer state exactly once, must load under a different layout
(pipeline degree, schedule, stages per rank, FSDP degree), and must never be
loaded half-written after a crash.

Alternatives.  (a) Each rank ``torch.save``-s its own stages: simple, but the
files are keyed by rank, so a checkpoint only loads under the layout that
wrote it, and FSDP shards would have to be gathered first.  (b) Gather
everything on rank 0 and save one file: a full copy of the model through one
process, which does not scale and re-shards nothing.  (c) torch's
``torch.distributed.checkpoint`` (DCP): every rank writes its own tensors (and
shards) in parallel, keyed by name, deduplicating replicas, and on load every
rank reads exactly the pieces its own tensors need, whatever layout wrote
them.  pipeloom uses (c), as torchtitan does.

Keys.  Every tensor is keyed by the model's own fully qualified name:
:func:`~pipeloom.split_by_fqn` stages keep the full model's names
(``layers.3.attn.wq.weight``), as do stages from torch's tracer
(``stage_fn_from_pipe``), and FSDP2 keeps names too (its parameters become
DTensors, which DCP saves as shards and re-shards on load).  This rank's
stages are gathered into one *view* module whose attribute paths are those
names and whose parameters and buffers are the stages' own tensor objects, so
torch's ``get_state_dict``/``set_state_dict`` (``torch.distributed.checkpoint.
state_dict``) apply unchanged, optimizer included: its state is keyed by the
same names (``flatten_optimizer_state_dict=True``, one key per name and
setting, so a rank loads only the entries of the parameters it holds now).
A ``stage_fn`` whose stages do not carry the model's names (two stages that
both call a parameter ``lin.weight``) is refused with a clear error; pass
``stage_prefix=True`` to key by ``stage{S}.name`` instead (such a checkpoint
then loads only under the same number of stages).

Expert parallelism: the ep ranks of a stage hold different rows of each expert
tensor under the same name; each is saved as a DTensor sharded along dim 0 over
the stage's ep group (its optimizer state too), so DCP keeps every rank's rows
and any layout (another ep degree, none) reads back the rows it holds.

What else a bit-exact resume needs: the step counter and the caller's
``extra`` dict (data position, scheduler state...; any picklable values),
and every rank's random-number generators (torch CPU and CUDA, Python's
``random``), saved per rank and restored when the world size is the same
(under another layout each rank continues with its own seed: nothing to
match).

Atomicity.  A checkpoint is written into ``ROOT/.step-00000012.partial``;
when every rank has written its part (rank 0's DCP ``finish`` has written the
metadata, which needs every rank's result), rank 0 writes a ``COMPLETE``
marker and renames the directory to ``ROOT/step-00000012`` (``os.replace``, a
single atomic rename on one file system).  :func:`latest_checkpoint` and
:func:`load_checkpoint` only ever consider ``step-N`` directories with the
marker, so a checkpoint that was being written when a crash hit is invisible
(it is removed when the same step is saved again).  Deleting is the same in
reverse: a checkpoint replaced by a new save of its step, or pruned by
``keep_last``, is first renamed out of the ``step-N`` names, then deleted, so a
crash midway never leaves a ``step-N`` that has its marker but lacks a rank's
data (what it leaves is swept at a later save).

Asynchronous save.  ``save_checkpoint(..., async_save=True)`` copies the
state to CPU memory (DCP's stager) and returns; the files are written by a
background thread (``dcp.async_save``), over a separate gloo group so its
collectives never interleave with the training step's.  The returned
:class:`PendingCheckpoint` says when this rank's part is written (rank 0's:
when the checkpoint is in place); a later save or load waits for the previous
save on every rank and agrees on its outcome first (rank 0 finishes it last,
and a failure on one rank is raised on all), and :func:`wait_checkpoints` (or
``PendingCheckpoint.wait()``) must be called before the process group is
destroyed (before ``pipe.close()``).

Ranks that hang.  Every call takes ``timeout`` (seconds, default 600): the
longest a rank waits for its peers at one point of the call.  Each rank
records its place in the call in the job's store (:class:`_Call`); the
agreements on the checkpoint group are posted asynchronously and polled
against the timeout, and the group's gloo timeout is the call's, so DCP's
collectives are bounded by it too.  A rank that times out names the ranks
behind it from the store, marks the call abandoned (a late rank raises at
once), and retires the group (a new one next call).  Each raises
:class:`~pipeloom.CheckpointTimeoutError`.

Corrupt checkpoints.  A complete checkpoint whose files cannot be read is
found before anything is loaded (file sizes against the metadata; DCP reads
plain tensors into new ones, applied once every rank has read its part;
DTensors in place, see ``_fresh``), and every rank
raises :class:`~pipeloom.CheckpointReadError`; under a root, every rank falls
back to the next older complete checkpoint instead, with a warning.
"""

from __future__ import annotations

import functools
import io
import itertools
import json
import os
import random
import re
import shutil
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import (CheckpointError, CheckpointReadError, CheckpointTimeoutError, PeerLostError, PipelineConfigError,
                     PipelineError)

__all__ = [
    "DEFAULT_TIMEOUT",
    "CheckpointInfo",
    "PendingCheckpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "wait_checkpoints",
]

_NAME = re.compile(r"^step-(\d{8,})$")
_PARTIAL = re.compile(r"^\.step-(\d{8,})\.partial$")
MARKER = "COMPLETE"


# ---------------------------------------------------------------- directory layout


def _final_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _partial_dir(root: Path, step: int) -> Path:
    return root / f".step-{step:08d}.partial"


_DELETING = re.compile(r"^\.step-(\d{8,})\.deleting(-\d+)?$")


def _remove(path: Path) -> None:
    """Delete a checkpoint directory so that a crash midway never leaves a ``step-N`` that looks complete.

    ``shutil.rmtree`` removes the files one by one in directory order: cut by a crash, it could leave the
    marker and DCP's metadata beside a missing rank's data file, a checkpoint :func:`latest_checkpoint` took
    and every restart then failed to load.  The directory is first renamed out of the ``step-N`` names
    (atomic); what a crash leaves of it is deleted at a later save (:func:`_sweep`).
    """
    gone = path.parent / f".{path.name}.deleting-{os.getpid()}"
    os.replace(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def _sweep(root: Path) -> None:
    """Rank 0, before a save: delete what a crash left of earlier deletions."""
    for p in root.iterdir():
        if _DELETING.match(p.name):
            shutil.rmtree(p, ignore_errors=True)


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a checkpoint that finished writing (named ``step-N``, marker and metadata present)."""
    p = Path(path)
    return bool(_NAME.match(p.name)) and (p / MARKER).is_file() and (p / ".metadata").is_file()


def list_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first; partial ones are never listed."""
    r = Path(root)
    if not r.is_dir():
        return []
    out = []
    for p in r.iterdir():
        m = _NAME.match(p.name)
        if m and is_complete(p):
            out.append((int(m.group(1)), p))
    return sorted(out)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-N`` directory under ``root``, complete or not, as (step, path), oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), q) for q in root.iterdir() if (m := _NAME.match(q.name)) and q.is_dir())


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint of the highest step under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


# ---------------------------------------------------------------- the view module


def _owner(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    *path, leaf = fqn.split(".")
    node = root
    for part in path:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    return node, leaf


@dataclass
class _View:
    module: nn.Module
    #: buffers held by several local stages under one name: (kept, other copies)
    dup_buffers: list[tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=list)
    #: key -> stage, for every parameter
    param_stage: dict[str, int] = field(default_factory=dict)
    #: key -> (stage, tensor) of every local stage's copy, for every persistent buffer
    buffer_copies: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)


def _build_view(stages: Mapping[int, nn.Module], *, stage_prefix: bool, rank: int) -> _View:
    """One module holding this rank's stages' parameters and persistent buffers under their checkpoint keys."""
    root = nn.Module()
    view = _View(root)
    buffers: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for s in sorted(stages):
        m = stages[s]
        pre = f"stage{s}." if stage_prefix else ""
        persistent = set(m.state_dict(keep_vars=True))
        for name, p in m.named_parameters():
            key = pre + name
            if key in view.param_stage:
                raise PipelineConfigError(
                    f"rank {rank}: stages {view.param_stage[key]} and {s} both hold a parameter named {name!r}: "
                    "checkpoint keys are the model's names, which split_by_fqn and stage_fn_from_pipe keep; "
                    "build stages that keep them, or pass stage_prefix=True (keys stage{S}.name, "
                    "loadable only under the same number of stages)"
                )
            view.param_stage[key] = s
            node, leaf = _owner(root, key)
            node.register_parameter(leaf, p)
        for name, b in m.named_buffers():
            if name not in persistent:
                continue
            key = pre + name
            view.buffer_copies.setdefault(key, []).append((s, b))
            if key in buffers:  # a buffer every stage keeps (state on a split module): save it once
                buffers[key][1].append(b)
                continue
            buffers[key] = (b, [])
            node, leaf = _owner(root, key)
            node.register_buffer(leaf, b)
    view.dup_buffers = [(b, others) for b, others in buffers.values() if others]
    return view


def _digest(t: torch.Tensor) -> str | None:
    """The bytes of ``t`` hashed; None for a tensor that has no plain bytes here (a DTensor, a sparse or
    quantized one): not compared, and never an error on one rank alone before the collective that follows."""
    import hashlib

    try:
        data = t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes()
    except Exception:  # noqa: BLE001 - see above
        return None
    return f"{t.dtype}{tuple(t.shape)}:" + hashlib.blake2b(data, digest_size=16).hexdigest()


def _check_global_names(view: _View, group: Any, rank: int, call: _Call) -> None:
    """No parameter name may be held by two different stages anywhere (DCP would keep one of them), and the
    copies of a buffer several stages keep must be equal.

    Every stage of ``split_by_fqn`` keeps the buffers of the modules no stage owns (the root's): one key, one
    value in the checkpoint, as the unsplit model has one.  DCP saves one copy of a key several ranks hold (rank
    0's) and ``load_checkpoint`` gives it to every stage, so where a stage had changed its own copy (a buffer its
    forward updates, set on the last stage only) that value was dropped without a word, and a resumed run went
    on from another.  Such a save is refused, naming the buffer and the stages that differ.
    """
    digests = {key: [(s, _digest(b)) for s, b in copies] for key, copies in view.buffer_copies.items()}
    call.at("comparing the ranks' parameter names")
    everyone = _gather(group, (view.param_stage, digests), call, "comparing the ranks' parameter names")
    first: dict[str, tuple[int, int, str]] = {}
    for r, (_, theirs) in enumerate(everyone):
        for key, copies in theirs.items():
            for s, d in copies:
                if d is None:
                    continue
                r0, s0, d0 = first.setdefault(key, (r, s, d))
                if d != d0:
                    raise PipelineConfigError(
                        f"rank {rank}: the buffer {key!r} that stage {s0} (rank {r0}) and stage {s} (rank {r}) both keep "
                        "differs between them: a checkpoint holds one copy of it, as the unsplit model has one; keep "
                        "the copies equal (update it on every stage that keeps it), make it non-persistent "
                        "(register_buffer(..., persistent=False)), or pass stage_prefix=True (each stage's own)"
                    )
    seen: dict[str, tuple[int, int]] = {}
    for r, (names, _) in enumerate(everyone):
        for key, s in names.items():
            if key in seen and seen[key][0] != s:
                raise PipelineConfigError(
                    f"rank {rank}: parameter {key!r} is held by stage {seen[key][0]} (rank {seen[key][1]}) and by "
                    f"stage {s} (rank {r}): checkpoint keys are the model's names, which split_by_fqn and "
                    "stage_fn_from_pipe keep; build stages that keep them, or pass stage_prefix=True"
                )
            seen.setdefault(key, (s, r))


def _agree(group: Any, mine: Any, call: _Call, where: str) -> list[Any]:
    """Every rank's ``mine`` (all ranks call this together), so that all of them take the same decision.

    A check that fails on one rank only must stop every rank: the others
    would otherwise wait in DCP's next collective for a rank that has gone.
    Bounded by the call's timeout (:class:`CheckpointTimeoutError` naming the ranks that did not arrive).
    """
    call.at(where)
    everyone = _gather(group, (call.func, mine), call, where)
    # (ranks in different checkpoint calls at the same point, a save on one and a load on another: their payloads
    # differ in shape, and each rank failed with a bare "ValueError: too many values to unpack")
    calls = [func for func, _ in everyone]
    if len(set(calls)) > 1:
        shown = ", ".join(f"rank {r}: {func}" for r, func in enumerate(calls))
        raise PipelineConfigError(f"rank {call.rank}: {call.what}: the ranks are in different checkpoint calls ({shown}): "
                                  "every rank must make the same checkpoint calls in the same order")
    return [theirs for _, theirs in everyone]


def _settle(group: Any, rank: int, what: str, exc: BaseException | None, payload: Any = None, *,
            call: _Call, where: str) -> list[Any]:
    """After a part of a checkpoint call that each rank runs on its own: every rank's ``payload``, or, where any
    rank raised there, the error on every rank (all ranks call this together).

    A rank that raised alone (a directory it cannot create, a disk that is full, a state-dict hook, a file it
    cannot read) left its peers in the call's next collective until the process group's timeout (30 minutes
    on gloo).  Each rank's exception is caught here and agreed instead: a ``PipelineConfigError`` or
    ``FileNotFoundError`` is raised as that type with the failing rank's message (as before), anything else
    as :class:`CheckpointError` naming ``what`` and the failing rank; on the failing rank it is chained to
    the original.
    """
    mine = None
    if exc is not None:
        kind = ("config" if isinstance(exc, PipelineConfigError) else "missing" if isinstance(exc, FileNotFoundError)
                else "unreadable" if isinstance(exc, _Unreadable) else "other")
        text = str(exc)
        if kind != "other" and not text.startswith(f"rank {rank}"):
            text = f"rank {rank}: {text}"
        elif kind == "other":
            text = f"{type(exc).__name__}: {text}"
        mine = (kind, text)
    everyone = _agree(group, (mine, payload), call, where)
    bad = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if not bad:
        return [p for _, p in everyone]
    first_rank, (kind, text) = bad[0]
    more = f" (and {len(bad) - 1} other rank(s): ranks {[r for r, _ in bad[1:]]})" if len(bad) > 1 else ""
    err: Exception
    if kind == "config":
        err = PipelineConfigError(f"{text}{more}")
    elif kind == "missing":
        err = FileNotFoundError(f"{text}{more}")
    else:
        this = " (this rank)" if first_rank == rank else ""
        unreadable = any(k == "unreadable" for _, (k, _) in bad)
        err = (CheckpointReadError if unreadable else CheckpointError)(
            f"rank {rank}: {what} failed on rank {first_rank}{this}{more}: {text}; every rank stopped the call",
            rank=rank, failed_ranks=[r for r, _ in bad])
    raise err from exc


class _Any:
    """An argument that may differ from the other ranks' (``_ANY``)."""

    def __repr__(self) -> str:
        return "any"

    def __reduce__(self) -> str:  # (one object after pickling: compared by identity)
        return "_ANY"


_ANY = _Any()


def _optimizer_count(optimizer: Any, view: _View) -> Any:
    """How many optimizers this rank passed, or ``_ANY`` where its stages have nothing to train (a rank whose stages
    are frozen whole cannot build an optimizer: it passes None beside the others' optimizers)."""
    count = len(_optims(optimizer))
    return count if count or any(p.requires_grad for p in view.module.parameters()) else _ANY


def _same_arguments(rank: int, what: str, everyone: list[dict[str, Any]]) -> None:
    """Refuse, on every rank, a checkpoint call whose ranks passed different arguments.

    Each rank writes and reads its own part by what it was passed: ranks that passed different steps wrote
    their parts into different directories, and rank 0 marked its own complete without the others' data (every
    load of it then failed); an optimizer given on some ranks only made a checkpoint without the others'
    optimizer state (or loaded it on some ranks only); ``async_save`` on some ranks only left the others
    waiting in a collective the background thread runs.
    """
    for name in everyone[0]:
        values = [a[name] for a in everyone]
        if len({repr(v) for v in values if v is not _ANY}) > 1:
            shown = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values) if v is not _ANY)
            raise PipelineConfigError(f"rank {rank}: {what}: the ranks passed different {name} ({shown}): it is a "
                                      "collective call, every rank must pass the same")


def _dcp(fn: Any, group: Any, rank: int, what: str, call: _Call, where: str) -> Any:
    """``fn()`` (a DCP save or load), with DCP's ``CheckpointException`` raised as :class:`CheckpointError`.

    DCP gathers a failure of any rank's write or read and raises it on every rank, but as a
    ``BaseException`` whose text is a list of tracebacks: a training loop's ``except Exception`` missed it.
    DCP's collectives run on the checkpoint group, whose gloo timeout is the call's: one that timed out (a
    rank stuck in its write) is raised as :class:`CheckpointTimeoutError` naming the ranks behind.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    call.at(where)
    try:
        return fn()
    except CheckpointException as exc:
        raise _from_dcp(exc, group, rank, what, own_interrupt=True) from exc
    except RuntimeError as exc:
        err = call.failed_collective(exc, where)
        if err is exc:
            raise
        raise err from exc


def _from_dcp(exc: Any, group: Any, rank: int, what: str, *, own_interrupt: bool = False) -> BaseException:
    """DCP's ``CheckpointException`` (its ``failures``: group rank -> the error) as a :class:`CheckpointError`
    naming the global ranks that failed and the first one's error."""
    # (a KeyboardInterrupt or SystemExit of this rank's own, inside DCP's write or read, which DCP catches as a
    # failure of the call: raised as it is here, where it became a CheckpointError, an Exception, and a loop that
    # goes on after a failed save ignored the Ctrl-C; the other ranks raise CheckpointError naming it)
    # (only for DCP run by the caller's thread, _dcp: an asynchronous save's writer thread gets no signals)
    try:
        own = exc.failures.get(dist.get_rank(group))
    except Exception:  # noqa: BLE001 - no group rank: nothing of ours to re-raise
        own = None
    if own_interrupt and own is not None and isinstance(own[0], BaseException) and not isinstance(own[0], Exception):
        return own[0]  # type: ignore[return-value]
    ranks = sorted(dist.get_global_rank(group, r) for r in exc.failures)
    first = exc.failures[sorted(exc.failures)[0]][0] if exc.failures else exc
    more = f" (and {len(ranks) - 1} other rank(s): ranks {ranks[1:]})" if len(ranks) > 1 else ""
    where = f"rank {ranks[0]}" if ranks else "a rank"
    # (a rank that could not read its part of a checkpoint: the checkpoint is unreadable, not one that does not fit)
    unreadable = any(isinstance(f[0], _Unreadable) for f in exc.failures.values())
    return (CheckpointReadError if unreadable else CheckpointError)(
        f"rank {rank}: {what} failed on {where}{more}: {type(first).__name__}: {first}; every rank stopped the call",
        rank=rank, failed_ranks=ranks)


# ---------------------------------------------------------------- bounded waits: the call's ledger


#: a checkpoint call's default ``timeout`` (seconds): the longest a rank waits for its peers at one point of the call
DEFAULT_TIMEOUT = 600.0

_CALLS = itertools.count()
#: set where a background save of this rank failed in a way that may leave the checkpoint group out of step (a
#: collective timed out, a writer that never finished): the next call's agreement on the saves in flight retires
#: the group on every rank
_RETIRE_NEXT = [False]
#: asynchronous saves' writer threads that did not finish within their timeout (see _stuck_writers_at_exit)
_STUCK_THREADS: list[threading.Thread] = []
#: the ledger's keys this rank wrote (its place in each call; rank 0: the store agreements' keys), as
#: (call number, store, key): deleted once every rank is past that call (:meth:`_Call._forget_older`).  Kept, they
#: grew the job's store by world size + 2 keys at every checkpoint call, without bound (a long job saving every 100
#: steps on 1024 ranks: a million keys in rank 0's store after a thousand saves)
_LEDGER_KEYS: list[tuple[int, Any, str]] = []


def _ledger_store() -> Any:
    """The job's store (the default group's), under a prefix of ours; None where there is none (then a timeout
    cannot name the ranks that did not arrive, and the waits are bounded by the groups' timeouts alone)."""
    try:
        return dist.PrefixStore("pipeloom/ckpt-calls/", dist.distributed_c10d._get_default_store())
    except Exception:  # noqa: BLE001 - no store: unnamed timeouts
        return None


#: the largest ``timeout`` (seconds, about 31 years): a longer one overflowed torch's timedelta/gloo conversion with
#: a bare ``OverflowError`` in the middle of the call
_MAX_TIMEOUT = 1e9


def _check_timeout(timeout: Any, hint: str = "") -> None:
    """``timeout`` is None or a finite positive number of seconds (``float('inf')``, ``1e15``, 0, negative and NaN
    are refused with a clear error, on every rank alike, before anything is done)."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= _MAX_TIMEOUT:
        raise PipelineConfigError(
            f"timeout must be a positive, finite number of seconds (at most {_MAX_TIMEOUT:g}) or None (the process "
            f"group's own timeout), got {timeout!r}{hint}")


def _timed_out_text(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


class _Call:
    """One checkpoint call on this rank: its ``timeout``, and its place in the job's store.

    Each rank records in the store where it is in the call (``at``: a count of the points passed and what it
    does there: ``n/at/RANK``, ``n`` counting this process's checkpoint calls, which every rank makes in the same
    order).  A rank whose wait for its peers times out reads every rank's place and names the ranks behind it
    (one that has not called the function at all, one still writing its files), marks the call abandoned
    (``n/abandoned``: who gave up, where, on whom), and raises :class:`CheckpointTimeoutError`; a rank that
    comes late finds the mark at its next point and raises at once, instead of waiting for peers that have gone.
    After a timeout the checkpoint group is retired on every rank (a gloo group whose collective timed out
    is out of step: gloo closes its connections) and the next call makes a new one.
    """

    def __init__(self, what: str, timeout: float | None, pipe: Any) -> None:
        _check_timeout(timeout)
        self.what, self.timeout, self.pipe = what, None if timeout is None else float(timeout), pipe
        self.func = what.split("(", 1)[0]  # (save_checkpoint / load_checkpoint: how a lost peer's error names the call)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.n = next(_CALLS)
        self.store = _ledger_store() if self.world > 1 else None
        self.seq = 0
        self.label = "called"
        self.made_group = False
        self.threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def _key(self, *parts: Any) -> str:
        return "/".join(str(p) for p in (self.n, *parts))

    def at(self, label: str) -> None:
        """This rank reached ``label`` (recorded for the peers); raises at once if the call was abandoned."""
        with self._lock:
            self.seq += 1
            seq, self.label = self.seq, label
        if threading.current_thread() is not threading.main_thread():
            self.threads.add(threading.current_thread())
        if self.store is None:
            return
        try:
            self.store.set(self._key("at", self.rank), f"{seq}|{label}")
            if seq == 1:
                _LEDGER_KEYS.append((self.n, self.store, self._key("at", self.rank)))
            gone = self.store.check([self._key("abandoned")])
        except Exception:  # noqa: BLE001 - the ledger is best effort (its host may have exited)
            return
        if gone:
            raise self.late()

    def abandoned(self) -> list[Any] | None:
        try:
            if self.store is not None and self.store.check([self._key("abandoned")]):
                return json.loads(self.store.get(self._key("abandoned")))
        except Exception:  # noqa: BLE001 - best effort
            pass
        return None

    def positions(self) -> dict[int, tuple[int, str] | None]:
        """Every rank's place in this call (None: it has not reached the call)."""
        out: dict[int, tuple[int, str] | None] = {}
        for r in range(self.world):
            out[r] = None
            try:
                if self.store is not None and self.store.check([self._key("at", r)]):
                    seq, label = self.store.get(self._key("at", r)).decode().split("|", 1)
                    out[r] = (int(seq), label)
            except Exception:  # noqa: BLE001 - best effort
                pass
        return out

    def _seconds(self) -> str:
        return f"{self.timeout:g} s" if self.timeout is not None else "the process group's timeout"

    def timed_out(self, where: str) -> CheckpointTimeoutError:
        """This rank waited ``timeout`` for its peers at ``where``: name the ranks behind, mark the call abandoned,
        retire the group; the error to raise."""
        places = self.positions() if self.store is not None else {}
        behind = {r: p for r, p in places.items() if r != self.rank and (p is None or p[0] < self.seq)}
        if behind:
            parts = [f"rank {r} " + ("has not called it (still in other code, or stuck there)" if p is None
                                     else f"is still at '{p[1]}'") for r, p in sorted(behind.items())]
            who = "; ".join(parts)
        elif self.store is None:
            who = "which ranks did not arrive is not known (the job has no torch.distributed store)"
        else:
            who = ("every rank reached this point (" + ", ".join(f"rank {r}: '{p[1]}'" for r, p in sorted(places.items()) if p)
                   + "): the checkpoint group is out of step")
        self.mark_abandoned(where, sorted(behind))
        _retire_group()
        return CheckpointTimeoutError(
            f"rank {self.rank}: {self.what} timed out: this rank waited {self._seconds()} for its peers "
            f"({where}): {who}; every live rank stops the call (pass a larger timeout= if a rank is only slow)",
            rank=self.rank, failed_ranks=sorted(behind), call=self.what, timeout=self.timeout)

    def mark_abandoned(self, where: str, behind: list[int]) -> None:
        try:
            if self.store is not None:
                self.store.compare_set(self._key("abandoned"), "",
                                       json.dumps([self.rank, where, behind, self.made_group, self.what]))
        except Exception:  # noqa: BLE001 - best effort
            pass

    def late(self) -> CheckpointTimeoutError:
        """The call was abandoned by a peer that stopped waiting for this rank (or for another one)."""
        who, where, behind, made, theirs = self.abandoned() or [None, "?", [], False, self.what]
        if made and not self.made_group:
            _burn_group_name()  # (the peers made a process group in this call: the names of the next ones must match)
        _retire_group()
        named = f"ranks {behind}" if behind else "the ranks it waited for"
        return CheckpointTimeoutError(
            f"rank {self.rank}: {self.what}: rank {who} stopped waiting for {named} after {self._seconds()} "
            f"({theirs}, {where}); this rank reached that point too late: every live rank stops the call",
            rank=self.rank, failed_ranks=list(behind), call=self.what, timeout=self.timeout)

    def failed_collective(self, exc: BaseException, where: str) -> BaseException:
        """A collective of this call that raised (gloo's ``RuntimeError``): the error to raise for it."""
        if isinstance(exc, PipelineError):
            return exc
        if _timed_out_text(exc):
            lost = _lost_peer(self.pipe, exc, self.func, wait=0.2)
            return lost if lost is not None else self.timed_out(where)
        # "Connection closed by peer": a peer that timed out (gloo closes its connections then) or one that died
        deadline = time.monotonic() + 2.0
        while True:
            if self.abandoned() is not None:
                return self.late()
            lost = _lost_peer(self.pipe, exc, self.func, wait=0.0)
            if lost is not None:
                return lost
            if time.monotonic() > deadline:
                return exc
            time.sleep(0.05)

    def wait_work(self, work: Any, where: str) -> None:
        """Wait for a collective posted on the checkpoint group, bounded by ``timeout`` (gloo's own bound, set on
        the group; a work still pending past it is handed to the exit guard, as training.py's collectives are)."""
        start = time.monotonic()
        limit = None if self.timeout is None else self.timeout + 2.0
        delay, check_at = 1e-5, start + 0.5
        while not work.is_completed():
            now = time.monotonic()
            if (limit is not None and now - start > limit) or (now > check_at and self.abandoned() is not None):
                from ..transport.tensor import guard_exit_works

                guard_exit_works([work])  # (never to complete: it must not hold up the process's exit)
                if self.pipe is not None:
                    self.pipe._collective_timed_out = True  # (and close() must not destroy the group under it)
                raise (self.late() if self.abandoned() is not None else self.timed_out(where))
            if now > check_at:
                check_at = now + 0.5
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)
        try:
            work.wait()
        except RuntimeError as exc:
            err = self.failed_collective(exc, where)
            if err is exc:
                raise
            raise err from exc

    def _forget_older(self) -> None:
        """Every rank has reached this call's store agreement, so every rank is done with the earlier calls (their
        agreements read, their asynchronous saves waited for): delete the ledger keys this rank wrote for them.
        An ``abandoned`` mark is kept (rare, and a late rank reads it whenever it comes)."""
        keep = [entry for entry in _LEDGER_KEYS if entry[0] >= self.n]
        old = [entry for entry in _LEDGER_KEYS if entry[0] < self.n]
        _LEDGER_KEYS[:] = keep
        for _, store, key in old:
            try:
                store.delete_key(key)
            except Exception:  # noqa: BLE001 - best effort (an old store that is gone)
                pass

    def agree_small(self, mine: Any, where: str) -> list[list[Any]]:
        """Every rank's non-None ``mine`` (JSON), as ``[rank, mine]``, through the store: for the saves in flight,
        when the checkpoint group may be out of step (a background save's collective timed out)."""
        store, key = self.store, self._key("small", self.seq)
        try:
            if self.rank == 0:
                _LEDGER_KEYS.extend((self.n, store, f"{key}/{k}") for k in ("bad", "n", "all"))
            if mine is not None:
                store.append(f"{key}/bad", json.dumps([self.rank, mine]) + "\n")
            if store.add(f"{key}/n", 1) == self.world:
                store.set(f"{key}/all", "1")
            start, delay, probe = time.monotonic(), 1e-3, time.monotonic() + 0.25
            while not store.check([f"{key}/all"]):
                now = time.monotonic()
                if self.timeout is not None and now - start > self.timeout:
                    raise self.timed_out(where)
                if now > probe:
                    probe = now + 0.25
                    if self.abandoned() is not None:
                        raise self.late()
                    lost = _lost_peer(self.pipe, RuntimeError("no answer"), self.func, wait=0.0)
                    if lost is not None:
                        raise lost
                time.sleep(delay)
                delay = min(2 * delay, 0.02)
            self._forget_older()
            if not store.check([f"{key}/bad"]):
                return []
            # (by rank: the order the ranks appended in is not the same every time)
            return sorted((json.loads(line) for line in store.get(f"{key}/bad").decode().splitlines() if line.strip()),
                          key=lambda rm: rm[0])
        except PipelineError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store is gone: its host (rank 0) has exited
            lost = _lost_peer(self.pipe, exc, self.func, wait=1.0)
            if lost is not None:
                raise lost from exc
            raise CheckpointError(f"rank {self.rank}: {self.what}: lost the job's torch.distributed store ({where}): "
                                  f"{type(exc).__name__}: {exc}", rank=self.rank, failed_ranks=[]) from exc


def _retire_group() -> None:
    """Stop using the checkpoint group (a collective of it timed out: gloo closed its connections, and a late rank
    would pair with what is left of it); the next call makes a new one.  Not destroyed here: a work of it may be
    pending."""
    _GROUP.pop("gloo", None)


def _burn_group_name() -> None:
    """Count one process group made, as the peers did in a call this rank came to late (torch names groups by a
    count every rank must keep alike)."""
    try:
        dist.distributed_c10d._process_group_name([], use_hashed_name=False)
    except Exception:  # noqa: BLE001 - another torch: nothing to keep alike
        pass


def _group_timeout() -> timedelta:
    """The job's own timeout (the default group's), for ``timeout=None``."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        dev = torch.device("cpu") if torch.device("cpu") in pg._device_types else torch.device("cuda")
        return pg._get_backend(dev).options._timeout
    except Exception:  # noqa: BLE001 - torch's default for gloo
        return dist.distributed_c10d._get_default_timeout(dist.Backend.GLOO)


def _gather(group: Any, obj: Any, call: _Call, where: str) -> list[Any]:
    """``all_gather_object`` over the checkpoint group, each of its collectives bounded by the call's timeout."""
    import pickle

    world = dist.get_world_size(group)
    if world == 1:
        return [obj]
    data = pickle.dumps(obj)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    call.wait_work(dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.long), group=group, async_op=True), where)
    most = max(int(s) for s in sizes)
    buf = torch.zeros(most, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.empty(most, dtype=torch.uint8) for _ in range(world)]
    call.wait_work(dist.all_gather(outs, buf, group=group, async_op=True), where)
    return [pickle.loads(outs[r][: int(sizes[r])].numpy().tobytes()) for r in range(world)]


def _stuck_writers_at_exit() -> None:
    """At interpreter exit (threading's hook, before it joins the threads): an asynchronous save's writer that
    did not finish within its timeout (a write that blocks) would hold the exit forever.  Given a few seconds, then
    the process ends without waiting for it, with exit code 1: its atexit handlers are skipped and the script's own
    exit code cannot be read here (a ``sys.exit(3)`` ended as 0 before), and the checkpoint it wrote is not complete,
    so a launcher must not take the job for a success."""
    alive = [t for t in _STUCK_THREADS if t.is_alive()]
    if not alive:
        return
    end = time.monotonic() + 3.0
    for t in alive:
        t.join(max(0.0, end - time.monotonic()))
    if not any(t.is_alive() for t in alive):
        return
    import sys

    try:
        sys.stderr.write("pipeloom: an asynchronous checkpoint's writer that timed out is still running; exiting "
                         "without waiting for it, with exit code 1 (that checkpoint is not complete)\n")
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    from ..transport.tensor import exit_now

    exit_now(1)


try:  # (after concurrent.futures' own hook, which joins the executors' threads: threading runs them last first)
    import concurrent.futures.thread  # noqa: F401 (imported for its hook's place)

    threading._register_atexit(_stuck_writers_at_exit)  # type: ignore[attr-defined]
except Exception:  # noqa: BLE001 - another Python: no hook
    pass


def _writer(path: Path, call: _Call) -> Any:
    """DCP's file writer, telling the call's ledger when this rank's files are written (so a peer that times out
    waiting for them names this rank while it writes)."""
    # (the plain writer, not FileSystemWriter, which is an AsyncStager too: dcp.async_save would stage the state
    # with it instead of its DefaultStager)
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    class _Writer(_FileSystemWriter):
        def prepare_local_plan(self, plan: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                call.threads.add(threading.current_thread())
            return super().prepare_local_plan(plan)

        def write_data(self, plan: Any, planner: Any) -> Any:
            fut = super().write_data(plan, planner)
            call.at("wrote its files, waiting for the other ranks'")
            return fut

    return _Writer(str(path))


class _Unreadable(Exception):
    """A checkpoint's file that cannot be read (raised on the rank that reads it; every rank then raises
    :class:`CheckpointReadError`)."""


def _reader(path: Path, call: _Call) -> Any:
    """DCP's file reader: a failure to read this rank's part is a :class:`CheckpointReadError` (an unreadable
    checkpoint, not a checkpoint that does not fit), and the ledger is told when the part is read."""
    from torch.distributed.checkpoint import FileSystemReader

    class _Reader(FileSystemReader):
        def read_data(self, plan: Any, planner: Any) -> Any:
            try:
                fut = super().read_data(plan, planner)
            except PipelineError:
                raise
            except Exception as exc:  # noqa: BLE001 - gathered by DCP: every rank raises CheckpointReadError
                raise _Unreadable(f"reading {path}: {type(exc).__name__}: {exc}") from exc
            call.at("read its part, waiting for the other ranks")
            return fut

    return _Reader(str(path))


def _check_files(ckpt: Path, metadata: Any) -> None:
    """Every data file the metadata names is there and long enough (a truncated or deleted file is found before
    anything is read)."""
    need: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(need.items()):
        f = ckpt / rel
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise _Unreadable(f"{f} is missing (the checkpoint's metadata names it)") from None
        if size < end:
            raise _Unreadable(f"{f} is {size} bytes, the checkpoint's metadata needs {end}: truncated")


# ---------------------------------------------------------------- groups, state


_GROUP: dict[str, Any] = {}


def _ckpt_group(call: _Call) -> Any:
    """A gloo group over every rank, created at the first checkpoint call (a collective call on every rank), and
    again after one of its collectives timed out (:func:`_retire_group`).

    DCP's coordination (and an asynchronous save's background thread) runs
    there, never on the group the pipeline's transfers use.  Its gloo timeout is the call's, so DCP's own
    collectives are bounded by it too.
    """
    key = "gloo"
    # (made anew under a new default group: a Pipeline's close destroys the group it made, and the next
    # Pipeline's checkpoint calls ran DCP on a group destroyed with it: "is not initialized in the world group map")
    world = dist.group.WORLD
    limit = timedelta(seconds=call.timeout) if call.timeout is not None else _group_timeout()
    if key not in _GROUP or _GROUP[key][0] is not world:
        call.at("making the checkpoint group")
        call.made_group = True
        try:
            _GROUP[key] = (world, dist.new_group(backend="gloo", timeout=limit))
        except RuntimeError as exc:
            err = call.failed_collective(exc, "making the checkpoint group (a collective over every rank)")
            if err is exc:
                raise
            raise err from exc
    group = _GROUP[key][1]
    dist.distributed_c10d._set_pg_timeout(limit, group)
    return group


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _optims(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if isinstance(optimizer, Iterable):
        out = list(optimizer)
        for o in out:
            if not isinstance(o, torch.optim.Optimizer):
                raise PipelineConfigError(f"optimizer must be a torch.optim.Optimizer or a list of them, got {type(o).__name__}")
        return out
    raise PipelineConfigError(f"optimizer must be a torch.optim.Optimizer or a list of them, got {type(optimizer).__name__}")


def _state_dicts(view: _View, optims: list[torch.optim.Optimizer]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if not optims:
        return get_model_state_dict(view.module, options=_options()), None
    # torch gives an optimizer without state (not stepped yet) its state entries by a step with zero gradients
    # and lr 0, but only where no parameter has a gradient: a load after a backward, before the optimizer's
    # first step (a warm-up step, a step to build lazy modules), found no entries to read, and the optimizer
    # went on with none of the checkpoint's state (AdamW's moments and step counts), without a word.  The
    # gradients are set aside for it and put back.
    aside = [(q, q.grad) for o in optims if not o.state for g in o.param_groups for q in g["params"] if q.grad is not None]
    for q, _ in aside:
        q.grad = None
    try:
        msd, osd = get_state_dict(view.module, optims if len(optims) > 1 else optims[0], options=_options())
    finally:
        for q, grad in aside:
            q.grad = grad
    return msd, osd


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _pickled(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unpickled(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


# ---------------------------------------------------------------- expert parallelism


def _expert_meshes(pipe: Any, view: _View) -> dict[str, Any]:
    """Expert parallelism: each expert parameter's key -> a 1-D DeviceMesh over its stage's ep group.

    An ep rank holds rows ``[e * n, (e + 1) * n)`` of each expert tensor (``pipeloom.moe``),
    under the same name as its ep peers; saved as a DTensor sharded along dim 0 over the
    group (``Shard(0)``), each rank writes its rows and any layout reads back the rows it
    holds, the whole tensor without expert parallelism.
    """
    groups = getattr(pipe, "_ep_groups", None)
    if getattr(pipe, "expert_parallel", 1) <= 1 or groups is None:
        return {}
    from torch.distributed.device_mesh import DeviceMesh

    from pipeloom.moe import is_expert_parameter

    # (every key: a parameter several local stages share, an MoE block of a V schedule's first and last stage,
    # is under each stage's key, which named_parameters() lists once; the other key raised a KeyError here)
    params = dict(view.module.named_parameters(remove_duplicate=False))
    meshes: dict[int, Any] = {}
    out: dict[str, Any] = {}
    for key, stage in view.param_stage.items():
        if not is_expert_parameter(params[key]):
            continue
        if stage not in meshes:
            g, ranks = groups.stage_groups[stage]
            if dist.get_process_group_ranks(g) != list(ranks):
                raise PipelineConfigError(
                    f"rank {dist.get_rank()}: stage {stage}'s ep group orders its ranks {dist.get_process_group_ranks(g)}, "
                    f"its experts by {list(ranks)}: a checkpoint cannot place the expert shards"
                )
            meshes[stage] = DeviceMesh.from_group(g, pipe.device.type)
        out[key] = meshes[stage]
    return out


def _shard_experts(state: dict[str, Any] | None, meshes: Mapping[str, Any], *, optim: bool) -> dict[str, Any] | None:
    """``state`` with each expert tensor as a DTensor over its ep group (the optimizer's per-parameter
    tensors too: flattened keys ``state.{key}.{name}`` of the parameter's shape)."""
    if state is None or not meshes:
        return state
    from torch.distributed.tensor import DTensor, Shard

    def wrap(v: Any, mesh: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            return v  # a step counter: the same on every ep rank
        return DTensor.from_local(v, mesh, [Shard(0)], run_check=False)

    out = dict(state)
    for k, v in state.items():
        if _expert_key(k, meshes, optim=optim):
            out[k] = wrap(v, meshes[k if not optim else k[len("state."):].rsplit(".", 1)[0]])
    return out


def _expert_key(k: str, meshes: Mapping[str, Any], *, optim: bool) -> bool:
    if not optim:
        return k in meshes
    return k.startswith("state.") and k[len("state."):].rsplit(".", 1)[0] in meshes


def _local(state: dict[str, Any] | None, meshes: Mapping[str, Any], *, optim: bool) -> dict[str, Any] | None:
    """The expert tensors that :func:`_shard_experts` wrapped back to this rank's rows (FSDP's DTensors stay)."""
    if state is None or not meshes:
        return state
    from torch.distributed.tensor import DTensor

    return {k: (v.to_local() if isinstance(v, DTensor) and _expert_key(k, meshes, optim=optim) else v)
            for k, v in state.items()}


# ---------------------------------------------------------------- save


class PendingCheckpoint:
    """A checkpoint being written (``async_save=True``), or one already written.

    ``path`` is where it will be once complete; :meth:`wait` blocks until this
    rank's part is written and, on rank 0, the checkpoint renamed into place
    (it re-raises a failure of the background writer).
    """

    def __init__(self, path: Path, step: int, future: Future[Any] | None, group: Any = None,
                 call: _Call | None = None) -> None:
        self.path = path
        self.step = step
        self._future = future
        self._group = group
        self._call = call
        #: this rank's wait for it timed out once already (the next wait does not wait again)
        self._stuck = False
        #: the timeout of the wait that gave up on it (what a later wait's message reports)
        self._gave_up: float | None = None

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = DEFAULT_TIMEOUT) -> Path:
        """This rank's part written (rank 0: the checkpoint in place); a failure of the background writer is
        raised, a write that failed on any rank (DCP's ``CheckpointException``) as :class:`CheckpointError`.

        ``timeout``: seconds to wait (None: no bound here; the background writer's collectives are bounded by
        the save's own ``timeout``).  A writer still running after it (a write that blocks), or a background
        collective that timed out waiting for a peer's part, raises :class:`CheckpointTimeoutError`; the next
        checkpoint call then agrees on it with every rank and starts over on a new checkpoint group.  A wait that
        gives up abandons the save on every rank (it never completes), so it must be a bound, not a poll: 0 is
        refused (``done()`` polls).
        """
        _check_timeout(timeout, " (PendingCheckpoint.wait: a wait that gives up abandons the save on every rank; "
                                "poll with done())")
        if self._future is None:
            return self.path
        import concurrent.futures

        from torch.distributed.checkpoint.api import CheckpointException

        rank = dist.get_rank()
        what = f"the asynchronous save of step {self.step}"
        try:
            self._future.result(0 if self._stuck else timeout)
        except concurrent.futures.TimeoutError:
            # (a later wait does not wait again: it reports the wait that gave up, not its own timeout, which
            # said "did not complete within 600 s" after none)
            again = self._stuck
            if not again:
                self._stuck, self._gave_up = True, timeout
            timeout = self._gave_up
            _RETIRE_NEXT[0] = True
            call = self._call
            threads = call.threads if call is not None else set()
            _STUCK_THREADS.extend(t for t in threads if t not in _STUCK_THREADS)
            within = "no bound" if timeout is None else f"{timeout:g} s"
            if again:
                within += " (this rank's earlier wait, which gave up on it: it is abandoned, and not waited for again)"
            # (this rank's writer may be done, waiting in a collective for a peer still writing: named then)
            places = call.positions() if call is not None and call.store is not None else {}
            behind = {r: q for r, q in places.items() if r != rank and (q is None or q[0] < call.seq)}
            if behind:
                who = "; ".join(f"rank {r} " + ("has not reached it" if q is None else f"is still at '{q[1]}'")
                                for r, q in sorted(behind.items()))
                text = (f"rank {rank}: {what} did not complete within {within}: this rank's files are written, and "
                        f"its writer waits for its peers: {who}")
            else:
                place = f" (its writer is at '{call.label}')" if call is not None else ""
                text = (f"rank {rank}: {what} did not complete on this rank within {within}{place}: a write that "
                        "blocks (a file system that hangs?), or one that takes longer than that (pass a larger timeout)")
            failing = sorted(behind) or [rank]
            if call is not None:
                call.mark_abandoned(f"rank {rank}'s wait for the asynchronous save", failing)
            raise CheckpointTimeoutError(f"{text}; the next checkpoint call agrees on it with every rank",
                                         rank=rank, failed_ranks=failing, call=what, timeout=timeout) from None
        except CheckpointException as exc:
            raise _from_dcp(exc, self._group, rank, what) from exc
        except RuntimeError as exc:
            if isinstance(exc, PipelineError) or not _timed_out_text(exc) or self._call is None:
                raise
            _RETIRE_NEXT[0] = True
            err = self._call.timed_out(f"the background writer's collective, {what}")
            raise err from exc
        return self.path


_PENDING: list[PendingCheckpoint] = []


def wait_checkpoints(*, timeout: float | None = DEFAULT_TIMEOUT) -> None:
    """Wait for every asynchronous save of this process (call before destroying the process group).

    This rank's own part: on a rank other than 0 it returns once its files are written, maybe before rank 0
    has put the checkpoint in place (the next ``save_checkpoint``/``load_checkpoint`` agree on it first).
    ``timeout``: seconds to wait for each (see :meth:`PendingCheckpoint.wait`)."""
    _check_timeout(timeout, " (wait_checkpoints: a wait that gives up abandons the save on every rank)")
    while _PENDING:
        _PENDING.pop(0).wait(timeout=timeout)


def _settle_pending(call: _Call) -> None:
    """The asynchronous saves still in flight, waited for on every rank and agreed (all ranks call this together).

    ``wait_checkpoints`` alone is each rank's own: rank 0 finishes a save (marker, rename) after the others'
    parts are written, so another rank went on at once and, in ``load_checkpoint``, looked for the latest
    checkpoint before it was in place (every rank then refused "rank 0 would load step-N but ranks [1] see
    step-M"); and a save that failed on rank 0 alone (its marker or rename) raised there only, while its peers
    went into the call's next collective and waited for it until the process group's timeout.

    Each wait is bounded by the call's timeout (a writer that never finishes: a write that blocks).  The
    agreement goes through the job's store, not the checkpoint group: a background save whose collective timed
    out left that group out of step.  After any failure every rank retires the group (a new one next time).
    """
    from torch.distributed.checkpoint.api import CheckpointException

    rank = call.rank
    call.at("waiting for the asynchronous saves in flight")
    failed: Exception | None = None
    steps: list[int] = []
    timed = False
    while _PENDING:
        pending = _PENDING[0]
        try:
            pending.wait(timeout=call.timeout)
        except Exception as exc:  # noqa: BLE001 - agreed below: every rank raises it
            if failed is None:
                failed, steps = exc, [pending.step]
            timed = timed or isinstance(exc, CheckpointTimeoutError)
            if not isinstance(exc.__cause__, CheckpointException):  # (DCP's own failures leave the group in step)
                _RETIRE_NEXT[0] = True
        _PENDING.pop(0)
    mine = None
    if failed is not None:
        ranks = list(getattr(failed, "failed_ranks", None) or [rank])
        cause = failed.__cause__ if isinstance(failed, CheckpointError) else None
        if cause is not None and getattr(cause, "failures", None):  # DCP's: the first failing rank's own error
            first = cause.failures[sorted(cause.failures)[0]][0]
            text = f"{type(first).__name__}: {first}"
        else:
            text = f"{type(failed).__name__}: {failed}"
        mine = [ranks, text, steps, timed]
    retire = _RETIRE_NEXT[0]
    if call.store is not None:
        bad = [m for _, m in call.agree_small(None if mine is None and not retire else [mine, retire], "agreeing on "
                                              "the asynchronous saves in flight")]
        retire = any(r for _, r in bad)
        bad = [m for m, _ in bad if m is not None]
    else:
        group = _ckpt_group(call)
        bad = [e for e in _agree(group, mine, call, "agreeing on the asynchronous saves in flight") if e is not None]
    if retire or bad:
        _retire_group()
        _RETIRE_NEXT[0] = False
    if bad:
        failing = sorted({r for ranks, _, _, _ in bad for r in ranks})
        _, text, (step, *_), _ = bad[0]
        kind = CheckpointTimeoutError if any(t for *_, t in bad) else CheckpointError
        extra = {"call": f"the asynchronous save of step {step}", "timeout": call.timeout} if kind is CheckpointTimeoutError else {}
        raise kind(
            f"rank {rank}: {call.what}: the asynchronous save of step {step} did not complete (it failed on rank(s) "
            f"{failing}: {text}); every rank stopped the call", rank=rank, failed_ranks=failing, **extra) from failed


def warn_pending() -> None:
    """Warn if an asynchronous save is still being written (``Pipeline.close`` calls it; it does not wait:
    after a failure the save may never finish)."""
    left = [p for p in _PENDING if not p.done()]
    if left:
        import warnings

        warnings.warn(
            f"asynchronous checkpoint(s) of step {', '.join(str(p.step) for p in left)} still being written while the "
            "pipeline closes: call pipeloom.wait_checkpoints() before close(), or they may never complete",
            RuntimeWarning, stacklevel=3,
        )


def _finalize(partial: Path, final: Path, step: int, meta: dict[str, Any], keep_last: int | None) -> None:
    """Rank 0, after every rank's data and DCP's metadata are written: marker, then one atomic rename."""
    with open(partial / MARKER, "w") as f:
        json.dump({"step": step, "time": time.time(), **meta}, f)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # the same step saved again (after a resume): the new one wins
        old = final.parent / f".{final.name}.deleting-{os.getpid()}"
        os.replace(final, old)  # out of the step-N names first: a crash from here on leaves no torn step-N
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)
    try:
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # pragma: no cover - a file system without directory fsync
        pass
    if keep_last is not None:
        for _, stale in list_checkpoints(final.parent)[:-keep_last]:
            if stale == final:  # a step below the latest (saved after going back to an older checkpoint): kept
                continue
            try:
                _remove(stale)
            except OSError:  # pragma: no cover - removed meanwhile: nothing to prune
                pass


def _lost_peer(pipe: Any, exc: BaseException, what: str, wait: float = 2.0) -> PeerLostError | None:
    """A collective of a checkpoint call that failed because a peer died (gloo: "Connection reset/closed by
    peer", a raw ``RuntimeError`` naming no rank): the lost rank, once this host's process table or the
    control plane shows it (within ``wait`` seconds), as a :class:`PeerLostError`; None if no peer is found lost
    (the error is then not a peer's death, and is raised as it is)."""
    from .pipeline import _dead_peers

    procs = getattr(pipe, "_procs", None)
    control = getattr(getattr(pipe, "_actor", None), "control", None)
    rank = dist.get_rank()
    after = ("; this checkpoint is not complete: a restart resumes from the last complete one" if what.startswith("save")
             else "; the load did not complete" if what.startswith("load") else "")  # (training-loop collectives: nothing)
    deadline = time.monotonic() + wait
    while True:
        dead = _dead_peers(procs, rank) if procs else []
        dead += [p for p in sorted(getattr(control, "disconnected", {}) or {}) if p not in dead]
        if dead:
            more = f" (also ranks {dead[1:]})" if len(dead) > 1 else ""
            return PeerLostError(f"{what}: its process ended during the call{more} ({type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:300]}){after}", rank=rank, peer=dead[0])
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _names_a_lost_peer(what: str) -> Any:
    """Decorator: a checkpoint call whose collective broke on a dead peer raises :class:`PeerLostError` naming
    it, instead of gloo's raw ``RuntimeError`` (survivors fail about 0.1 s after the death either way)."""
    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except PipelineError:
                raise
            except RuntimeError as exc:
                pipe = args[1] if len(args) > 1 else kwargs.get("pipe")
                lost = _lost_peer(pipe, exc, what)
                if lost is None:
                    raise
                raise lost from exc
        return call
    return wrap


@_names_a_lost_peer("save_checkpoint")
def save_checkpoint(
    root: str | os.PathLike[str],
    pipe: Any,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    *,
    step: int,
    extra: Mapping[str, Any] | None = None,
    async_save: bool = False,
    keep_last: int | None = None,
    stage_prefix: bool = False,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> PendingCheckpoint:
    """Save the pipeline's model and optimizer state as ``root/step-{step:08d}``; call on every rank.

    Args:
        root: the directory holding this job's checkpoints (created if needed).
        pipe: the :class:`~pipeloom.Pipeline` (or anything with a ``stages`` dict of modules).
        optimizer: the optimizer(s) over ``pipe.parameters()``, or None for the model alone.
        step: the number of optimizer steps taken (what a resumed run starts from).
        extra: the caller's picklable state (data position, scheduler, ...), from rank 0.
        async_save: copy the state to CPU memory and write it in a background thread
            (``dcp.async_save``); the result says when it is complete.
        keep_last: after this checkpoint is complete, delete all but the newest ``keep_last``.
        stage_prefix: key by ``stage{S}.name`` (for stages that do not keep the model's names).
        timeout: the longest this rank waits for its peers at any one point of the call, in seconds (a peer
            that has not called it, or hangs in it: its write blocks); then every live rank raises
            :class:`~pipeloom.CheckpointTimeoutError` naming the ranks that did not arrive.  It bounds DCP's
            collectives too, so it must exceed the time the slowest rank takes to write its files (None: the
            process group's own timeout, 30 minutes on gloo).

    Returns:
        a :class:`PendingCheckpoint` (already complete unless ``async_save``).
    """
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    r = Path(root).resolve()
    what = f"save_checkpoint(step {step})"
    call = _Call(what, timeout, pipe)
    call.at(f"called {what}")
    _settle_pending(call)  # one save in flight at a time, in order
    group = _ckpt_group(call)
    failed: Exception | None = None
    args: dict[str, Any] = {}
    try:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise PipelineConfigError(f"step must be a non-negative int, got {step!r}")
        if keep_last is not None and keep_last < 1:
            raise PipelineConfigError(f"keep_last must be at least 1, got {keep_last}")
        view = _build_view(pipe.stages, stage_prefix=stage_prefix, rank=rank)
        args = {"step": step, "async_save": bool(async_save), "keep_last": keep_last, "stage_prefix": bool(stage_prefix),
                "optimizers": _optimizer_count(optimizer, view)}
    except Exception as exc:  # noqa: BLE001 - agreed below: every rank raises it
        failed = exc
    everyone = _settle(group, rank, what, failed, (str(r), args), call=call, where="comparing the ranks' arguments")
    roots = {directory for directory, _ in everyone}
    if len(roots) > 1:
        raise PipelineConfigError(
            f"rank {rank}: the ranks passed different checkpoint directories ({sorted(roots)}): every rank must "
            "pass the same directory, one they all see (a shared file system across nodes)"
        )
    _same_arguments(rank, what, [a for _, a in everyone])
    _check_global_names(view, group, rank, call)
    partial, final = _partial_dir(r, step), _final_dir(r, step)
    extra_bytes: bytes | None = None
    try:
        optims = _optims(optimizer)
        # An optimizer that has not stepped yet has no state, and get_state_dict makes some: a step with zero
        # gradients and lr 0, which leaves the parameters alone but counts a step (AdamW's bias correction
        # then differed from a run that did not save at step 0).  Its state is cleared again after, and saved
        # as none (load_checkpoint leaves a parameter without saved state stateless).
        fresh = [o for o in optims if not o.state]
        msd, osd = _state_dicts(view, optims)
        if fresh:
            mine = {id(p) for o in fresh for g in o.param_groups for p in g["params"]}
            gone = tuple(f"state.{key}." for key, p in view.module.named_parameters() if id(p) in mine)
            if osd is not None and gone:
                osd = {k: v for k, v in osd.items() if not k.startswith(gone)}
            for o in fresh:
                o.state.clear()
        meshes = _expert_meshes(pipe, view)
        msd, osd = _shard_experts(msd, meshes, optim=False), _shard_experts(osd, meshes, optim=True)
        if rank == 0:
            # DCP keeps one copy of a value every rank has, from whichever rank it picks: rank 0's, sent below
            extra_bytes = _pickled(dict(extra or {}))
            r.mkdir(parents=True, exist_ok=True)
            _sweep(r)
            if partial.exists():  # left by a crash while this step was being saved
                shutil.rmtree(partial)
            partial.mkdir()
        failed = None
    except Exception as exc:  # noqa: BLE001 - agreed below: every rank raises it
        failed = exc
    extra_bytes = _settle(group, rank, what, failed, extra_bytes, call=call, where="preparing the directory")[0]
    state: dict[str, Any] = {
        "model": msd,
        "pipeloom": {"step": step, "extra": extra_bytes},
        f"rng_rank{rank}": _pickled(_rng_state()),
    }
    if osd is not None:
        state["optim"] = osd
    meta = {"world_size": dist.get_world_size(), "optimizer": osd is not None, "stage_prefix": stage_prefix,
            # (rank 0's optimizer classes: a load into another class is refused by name, not by DCP's "Missing key")
            "optimizer_types": [type(o).__name__ for o in _optims(optimizer)]}
    if not async_save:
        _dcp(lambda: dcp.save(state, checkpoint_id=str(partial), storage_writer=_writer(partial, call), process_group=group),
             group, rank, what, call, "writing its files")
        failed = None
        if rank == 0:
            try:
                _finalize(partial, final, step, meta, keep_last)
            except Exception as exc:  # noqa: BLE001 - agreed below (the others waited in a barrier for it)
                failed = exc
        _settle(group, rank, what, failed, call=call, where="putting the checkpoint in place (rank 0)")
        return PendingCheckpoint(final, step, None)
    upload: Future[Any]
    call.at("writing its files (in the background)")
    try:
        res = dcp.async_save(state, checkpoint_id=str(partial), storage_writer=_writer(partial, call), process_group=group)
        upload = getattr(res, "upload_completion", res)  # AsyncSaveResponse (torch >= 2.9) or a Future
    except Exception as exc:  # noqa: BLE001 - this rank's copy to CPU memory failed: see _join_failed
        upload = Future()
        upload.set_exception(_join_failed(exc, partial, group))
    done: Future[Any] = upload
    if rank == 0:
        done = Future()

        def finish(f: Future[Any]) -> None:
            try:
                f.result()
                _finalize(partial, final, step, meta, keep_last)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                done.set_exception(exc)
            else:
                done.set_result(final)

        upload.add_done_callback(finish)

    def timed_out(f: Future[Any]) -> None:
        # (a background collective that timed out waiting for a peer's part: the call is abandoned, so that the
        # peer, when its write returns, stops at once instead of waiting for the others in turn)
        exc = f.exception()
        if exc is not None and not isinstance(exc, PipelineError) and _timed_out_text(exc):
            _RETIRE_NEXT[0] = True
            call.mark_abandoned("the background writer's collective", [])

    upload.add_done_callback(timed_out)
    pending = PendingCheckpoint(final, step, done, group, call)
    _PENDING.append(pending)
    return pending


def _join_failed(exc: Exception, partial: Path, group: Any) -> BaseException:
    """This rank's asynchronous save failed before its writer started (copying the state to CPU memory: out of
    memory); the other ranks' writers are already waiting in DCP's first collective for it.

    Left there they waited until the process group's timeout, and so did every later checkpoint call (their
    wait for the pending save first): a hang on every rank.  This rank joins that collective with a save that
    fails in its planning, so every rank's writer fails with this rank's error, and, as for any asynchronous
    save, every rank raises it at its next checkpoint call.  Returns the error to hand to whoever waits.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class _Failing(DefaultSavePlanner):
        def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
            raise exc

    try:
        dcp.save({}, checkpoint_id=str(partial), process_group=group, planner=_Failing())
    except CheckpointException as failed:
        return failed
    except Exception as failed:  # noqa: BLE001 - handed to whoever waits
        return failed
    return exc  # pragma: no cover - the failing planner always fails the save


# ---------------------------------------------------------------- load


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load_checkpoint` restored besides the tensors."""

    #: the checkpoint directory read
    path: Path
    #: the optimizer steps taken when it was saved
    step: int
    #: the caller's ``extra`` dict as saved
    extra: dict[str, Any]
    #: whether this rank's random-number generators were restored (same world size)
    rng_restored: bool
    #: newer complete checkpoints under the root that could not be read and were passed over: (path, why)
    skipped: tuple[tuple[Path, str], ...] = ()


def _fresh(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """``state`` with every plain tensor replaced by a new, uninitialised one of its shape and dtype in CPU memory,
    for DCP to read into: those are left as they are until every rank has read its part (a read that fails midway,
    on any rank, leaves them untouched).  DTensors (FSDP shards, expert rows) are read in place, as DCP does: a copy
    of each would double the device memory the sharded state takes at the moment a large job resumes.  The files
    are checked against the metadata before (sizes), so what can still fail midway is an I/O error, which every
    rank raises (from a root, the fallback to an older checkpoint then overwrites every shard)."""
    if state is None:
        return None
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, DTensor):
            out[k] = v
        elif isinstance(v, torch.Tensor):
            out[k] = torch.empty(v.shape, dtype=v.dtype, device="cpu")
        else:
            out[k] = v
    return out


@_names_a_lost_peer("load_checkpoint")
def load_checkpoint(
    path: str | os.PathLike[str],
    pipe: Any,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    *,
    restore_rng: bool = True,
    stage_prefix: bool = False,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> CheckpointInfo | None:
    """Load a checkpoint into this rank's stages (and optimizer); call on every rank.

    ``path`` is a checkpoint directory (``step-N``) or a root holding them, of
    which the latest complete one is loaded; None is returned when a root holds
    none (a fresh start).  The pipeline may have another layout than the one
    that saved: another number of ranks, stages per rank, schedule, or FSDP
    degree; every rank reads the pieces its tensors need.  Raises
    ``FileNotFoundError`` for a ``step-N`` directory that is not complete.

    A complete checkpoint that cannot be read (a data file truncated or missing, its metadata or marker
    garbled: on any rank) is refused on every rank before anything is loaded: under a root, every rank warns
    and loads the next older complete one instead (all the same one; ``CheckpointInfo.skipped`` lists those
    passed over), and raises :class:`~pipeloom.CheckpointReadError` if none can be read; an explicit
    ``step-N`` directory raises it.  A ``step-N`` directory under the root that lacks its marker or metadata (only
    ever made complete: damaged since) is passed over the same way, never taken for a fresh start.  ``timeout``: as for :func:`save_checkpoint`.
    """
    rank = dist.get_rank()
    p = Path(path).resolve()
    # Which checkpoint: every rank looks, rank 0's answer counts, and a rank that sees another
    # (a directory not shared, a different path) stops every rank rather than loading something else.
    what = f"load_checkpoint({str(p)!r})"
    call = _Call(what, timeout, pipe)
    call.at(f"called {what}")
    _settle_pending(call)  # an asynchronous save in flight: in place before anyone looks
    group = _ckpt_group(call)
    seen: str | None = None
    candidates: list[str] = []
    explicit = False
    failed: Exception | None = None
    args: dict[str, Any] = {}
    try:
        args = {"optimizers": _optimizer_count(optimizer, _build_view(pipe.stages, stage_prefix=stage_prefix, rank=rank)),
                "restore_rng": bool(restore_rng), "stage_prefix": bool(stage_prefix)}
        if _PARTIAL.match(p.name):
            raise FileNotFoundError(f"{p} is a partial checkpoint: a save that did not complete (cut by a crash, or still being written)")
        elif _NAME.match(p.name) or (p / ".metadata").exists():
            explicit = True
            if is_complete(p):
                seen = str(p)
                candidates = [seen]
            else:
                raise FileNotFoundError(f"{p} is not a complete checkpoint (no {MARKER} marker or no DCP metadata)")
        else:
            # (a step-N directory is only ever made complete, by one rename: one that lacks its marker or metadata was
            # damaged since; tried, and passed over with a warning like any unreadable one, so that a root whose only
            # checkpoints are damaged raises CheckpointReadError instead of returning None, a fresh start)
            candidates = [str(c) for _, c in reversed(_step_dirs(p))]
            seen = candidates[0] if candidates else None
    except Exception as exc:  # noqa: BLE001 - agreed below: every rank raises it
        failed = exc
    agreed = _settle(group, rank, what, failed, (seen, candidates, args), call=call, where="choosing the checkpoint")
    _same_arguments(rank, what, [a for _, _, a in agreed])
    everyone = [theirs for theirs, _, _ in agreed]
    chosen = everyone[0]
    differ = [r for r, theirs in enumerate(everyone) if theirs != chosen]
    if differ:
        raise PipelineConfigError(
            f"rank {rank}: rank 0 would load {chosen or 'nothing'} but ranks {differ} see "
            f"{[everyone[r] or 'nothing' for r in differ]}: every rank must pass the same directory, "
            "one they all see (a shared file system across nodes)"
        )
    if chosen is None:
        return None
    skipped: list[tuple[Path, str]] = []
    bad_ranks: set[int] = set()
    for i, ckpt in enumerate(agreed[0][1]):  # rank 0's list, newest first: every rank tries them in the same order
        try:
            info = _load_one(Path(ckpt), pipe, optimizer, group, call, restore_rng=restore_rng, stage_prefix=stage_prefix)
        except CheckpointReadError as exc:
            if explicit:
                raise CheckpointReadError(
                    f"{exc}; {ckpt} is complete by its marker but cannot be read, and an explicit checkpoint is "
                    "never replaced by another: load another step-N, or pass the root to fall back to the latest "
                    "readable one", rank=rank, failed_ranks=exc.failed_ranks) from exc
            skipped.append((Path(ckpt), str(exc)))
            bad_ranks.update(exc.failed_ranks)
            older = agreed[0][1][i + 1:]  # (by step: step-100000000 sorts before step-99999999 as text)
            then = f"loading the next older complete checkpoint, {older[0]}" if older else "no older complete checkpoint"
            warnings.warn(f"rank {rank}: the checkpoint {ckpt} cannot be read ({exc}); {then}", RuntimeWarning,
                          stacklevel=3)
            continue
        return CheckpointInfo(info.path, info.step, info.extra, info.rng_restored, tuple(skipped))
    shown = "; ".join(f"{c.name}: {why}" for c, why in skipped)
    from torch.distributed.tensor import DTensor

    # (DTensors are read in place, see _fresh: a read that failed midway may have filled some of them)
    sharded = any(isinstance(p, DTensor) for p in getattr(pipe, "parameters", lambda: ())())
    loaded = ("nothing was loaded into the plain tensors, but FSDP shards and expert rows are read in place and may "
              "be partly overwritten: do not train on this Pipeline's state" if sharded else "nothing was loaded")
    raise CheckpointReadError(
        f"rank {rank}: {what}: none of the {len(skipped)} checkpoint(s) under it can be read ({shown}); "
        f"{loaded} (delete or repair them, or load an explicit step-N)",
        rank=rank, failed_ranks=sorted(bad_ranks))


def _load_one(ckpt: Path, pipe: Any, optimizer: Any, group: Any, call: _Call, *, restore_rng: bool,
              stage_prefix: bool) -> CheckpointInfo:
    """Load the complete checkpoint ``ckpt`` (all ranks call this together): :class:`CheckpointReadError` on every
    rank, with nothing loaded, where any rank cannot read it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    rank = dist.get_rank()
    chosen = str(ckpt)
    what = f"load_checkpoint({chosen!r})"
    failed: Exception | None = None
    meshes: dict[str, Any] = {}
    stateless: list[tuple[str, torch.Tensor]] = []
    fresh_state: dict[str, Any] = {}
    saved_keys: Any = {}
    try:
        view = _build_view(pipe.stages, stage_prefix=stage_prefix, rank=rank)
        optims = _optims(optimizer)
        if not is_complete(ckpt):
            lacks = " and ".join(n for n in (MARKER, ".metadata") if not (ckpt / n).is_file())
            raise _Unreadable(f"{ckpt} lacks its {lacks} (a step-N directory is only made complete: it was damaged, or "
                              "is being copied)")
        reader = dcp.FileSystemReader(str(ckpt))
        try:  # (what the checkpoint holds: a file that cannot be read makes it unreadable, not unfit)
            metadata = reader.read_metadata()
            saved_keys = metadata.state_dict_metadata
            with open(ckpt / MARKER) as f:
                marker = json.load(f)
            if not isinstance(marker, dict):
                raise ValueError(f"the {MARKER} marker holds {type(marker).__name__}, not a JSON object")
        except Exception as exc:  # noqa: BLE001 - agreed below: every rank raises CheckpointReadError
            raise _Unreadable(f"{ckpt}: its metadata or {MARKER} marker cannot be read: {type(exc).__name__}: {exc}") from exc
        _check_files(ckpt, metadata)
        if optims and not any(k.startswith("optim.") for k in saved_keys):
            raise PipelineConfigError(f"{ckpt} holds no optimizer state (it was saved with optimizer=None)")
        saved_types = marker.get("optimizer_types")  # (None: a checkpoint from before it was recorded)
        mine = [type(o).__name__ for o in optims]
        if optims and saved_types is not None and mine != saved_types:
            raise PipelineConfigError(
                f"rank {rank}: {ckpt} holds the state of {', '.join(saved_types)} but this rank loads it into "
                f"{', '.join(mine)}: pass optimizer=None to load the model alone (the new optimizer starts fresh)"
            )
        msd, osd = _state_dicts(view, optims)
        if osd is not None:
            # A parameter that never had a gradient before the save (unused, or not used yet) has no
            # optimizer state in the checkpoint, while get_state_dict gives a fresh optimizer state for
            # every parameter (a step with zero gradients): DCP then refused the load ("Missing key").
            # Such parameters are left out of the load, and their state dropped after it (below), as
            # in the run that saved.
            saved_state = set()
            for k in saved_keys:
                if k.startswith("optim.state."):
                    parts = k[len("optim.state."):].split(".")
                    saved_state.update(".".join(parts[:i]) for i in range(1, len(parts)))
            stateless = [(key, param) for key, param in view.module.named_parameters() if key not in saved_state]
            if stateless:
                gone = tuple(f"state.{key}." for key, _ in stateless)
                # (their fresh entries go back in beside what DCP reads: set_state_dict wants every entry the
                # optimizer holds, and with none it would make the zero-gradient step again)
                fresh_state = {k: v for k, v in osd.items() if k.startswith(gone)}
                osd = {k: v for k, v in osd.items() if not k.startswith(gone)}
        meshes = _expert_meshes(pipe, view)
        msd, osd = _shard_experts(msd, meshes, optim=False), _shard_experts(osd, meshes, optim=True)
        missing = sorted(k for k in msd if f"model.{k}" not in saved_keys)
        if missing:
            shown = ", ".join(missing[:6]) + ("..." if len(missing) > 6 else "")
            raise PipelineConfigError(
                f"rank {rank}: {ckpt} holds no {shown} ({len(missing)} of this rank's tensors); "
                "was it saved from the same model (and the same stage_prefix)?"
            )
        same_world = marker.get("world_size") == dist.get_world_size()
    except Exception as exc:  # noqa: BLE001 - agreed below: every rank raises it
        failed = exc
    everyone = _settle(group, rank, what, failed, None if failed else sorted(msd), call=call,
                       where="reading the checkpoint's metadata")
    # Every tensor of the checkpoint's model must go somewhere, as load_state_dict(strict=True) wants: a
    # checkpoint of more stages (stage_prefix keys stage{S}.*) or of a larger model loaded its first part
    # into this pipeline without a word, which then trained another model.
    loaded = {k for keys in everyone for k in keys}
    unloaded = sorted(k[len("model."):] for k in saved_keys if k.startswith("model.") and k[len("model."):] not in loaded)
    if unloaded:
        shown = ", ".join(unloaded[:6]) + ("..." if len(unloaded) > 6 else "")
        raise PipelineConfigError(
            f"rank {rank}: {ckpt} holds {len(unloaded)} tensor(s) that no stage of this pipeline has: {shown}; "
            "it was saved from another model (with stage_prefix=True: another number of stages, keys stage{S}.*)"
        )
    # Read plain tensors into new ones (DTensors in place, see _fresh): applied once every rank has read its part.
    state: dict[str, Any] = {"model": _fresh(msd), "pipeloom": {"step": 0, "extra": b""}}
    if osd is not None:
        state["optim"] = _fresh(osd)
    rng_key = f"rng_rank{rank}"
    want_rng = restore_rng and same_world and rng_key in saved_keys
    if want_rng:
        state[rng_key] = b""
    _dcp(lambda: dcp.load(state, checkpoint_id=chosen, storage_reader=_reader(ckpt, call), process_group=group),
         group, rank, what, call, "reading its part")
    failed = None
    extra: Any = None
    rng: Any = None
    try:
        try:
            extra = _unpickled(state["pipeloom"]["extra"])
            rng = _unpickled(state[rng_key]) if want_rng else None
        except Exception as exc:  # noqa: BLE001 - agreed below: every rank raises CheckpointReadError
            raise _Unreadable(f"{ckpt}: its step's extra or this rank's RNG state cannot be unpickled: "
                              f"{type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - agreed below: every rank raises it
        failed = exc
    _settle(group, rank, what, failed, call=call, where="checking what every rank read")
    failed = None
    try:
        # (expert shards: back to this rank's rows, which DCP filled)
        if osd is not None:
            set_state_dict(view.module, optims if len(optims) > 1 else optims[0],
                           model_state_dict=_local(state["model"], meshes, optim=False),
                           optim_state_dict={**fresh_state, **_local(state["optim"], meshes, optim=True)}, options=_options())
            for _, param in stateless:
                for o in optims:
                    o.state.pop(param, None)
        else:
            set_model_state_dict(view.module, _local(state["model"], meshes, optim=False), options=_options())
        with torch.no_grad():
            for kept, others in view.dup_buffers:
                for b in others:
                    b.copy_(kept)
        if want_rng:
            _restore_rng(rng)
    except Exception as exc:  # noqa: BLE001 - agreed below (the others waited in a barrier for it)
        failed = exc
    _settle(group, rank, what, failed, call=call, where="loading what was read into the model and optimizer")
    return CheckpointInfo(ckpt, int(state["pipeloom"]["step"]), extra, want_rng)
