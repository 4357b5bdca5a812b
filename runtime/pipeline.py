"""The public ``Pipeline``: build a rank's stages, split batches, run steps.

Every rank constructs the same ``Pipeline`` with the same arguments and calls
``step`` with the same batch; each rank keeps the stages the schedule places
on it and ignores inputs it does not need.  The process group is initialised
from the environment that ``pipeloom launch`` and ``torchrun`` both set
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) if the script has not
done it: gloo on CPU, NCCL (with ``device_id``, so communicators are created
eagerly) on GPU.

Microbatches are cut with ``torch.tensor_split`` along dim 0, as torch's
pipelining does, so 66 rows in 4 microbatches give 17, 17, 16, 16.  Nothing
about shapes is fixed at construction: each transfer announces its own, so
there is no shape-inference pass and no stale receive buffer.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import sys
import time
import traceback
import zlib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..schedules import Dataflow, Schedule, ScheduleError, load_csv
from ..schedules.dispatch import OVERLAP_MARGIN
from ..transport.control import ControlPlane, choose_bind_host
from ..transport.tensor import TensorPlane, abort_communicators, guard_exit, make_pair_groups
from .actor import ActorStatistics, RankActor, StepInputs
from .agreement import (SetupAgreement, agent_attempt_store, check_heartbeats, check_stage_replicas, config_record, secret_field,
                        short_traceback, stage_tensors)
from .checks import Replicate, check_batch, install_stage_checks
from .data_parallel import DEFAULT_BUCKET_BYTES, Layout, StageCollectives, note_default_group
from .errors import PeerLostError, PipelineConfigError, PipelineError, RemoteRankError
from .fingerprint import ModelFingerprint
from .options import RuntimeOptions, resolve_options
from .stage import StageExecutor
from .ties import TiedCopies, refuse_ties_across_ranks, tie_sync_groups, ties_across_ranks
from .training import pending_collective
from .trace import FileSink, StreamSink, TraceRecorder, make_header

__all__ = ["Pipeline", "Microbatches", "Replicate", "split_microbatches"]

log = logging.getLogger("pipeloom.pipeline")


class Microbatches(list):  # type: ignore[type-arg]
    """Values already cut into microbatches, one per microbatch, each with its own shape.

    Pass one in place of a batch tensor (``pipe.step(Microbatches(chunks))``)
    when microbatches cannot share a shape, e.g. sequences of different
    lengths: nothing is padded, each transfer announces its own shape.
    """


class _Gathering:
    """An all-gather of one int64 per rank in flight: ``done()`` polls it, ``on_done(fn)`` calls ``fn`` (from
    gloo's thread) once it completes, ``result()`` the values by rank (raises gloo's error: a rank gone)."""

    __slots__ = ("work", "fut", "mine", "out")

    def __init__(self, work: Any, mine: torch.Tensor, out: list[torch.Tensor]) -> None:
        # (the future, not ``work.is_completed()``: gloo runs the future's callbacks before the Work
        # reads completed, so a waiter woken by the callback could see it pending and sleep on)
        self.work, self.fut, self.mine, self.out = work, work.get_future(), mine, out

    def done(self) -> bool:
        return bool(self.fut.done())

    def on_done(self, fn: Callable[[], None]) -> None:
        self.fut.add_done_callback(lambda _f: fn())

    def result(self) -> list[tuple[int, ...]]:
        self.fut.wait()  # (raises gloo's error)
        return [tuple(int(v) for v in t.tolist()) for t in self.out]


def _gather_ints(group: Any) -> Callable[[tuple[int, int]], _Gathering]:
    """Start an all-gather of two int64 per rank over the gloo ``group`` (None: the default group).

    Asynchronous (a gloo collective ``Work``): the caller polls it on its own thread rather than
    hopping to an executor thread and back for each step's gather (measured ~35 us for the
    gather itself on one rank, against a thread round trip of a few hundred)."""

    last: list[_Gathering] = []  # the previous gather: its buffers are reused once it has completed

    def gather(values: tuple[int, int]) -> _Gathering:
        prev = last[0] if last else None
        if prev is not None and prev.done():
            mine, out = prev.mine, prev.out
            mine[0], mine[1] = values
        else:  # (the first, or one a failed step left pending: gloo may still write into its buffers)
            mine = torch.tensor(values, dtype=torch.int64)
            out = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        g = _Gathering(dist.all_gather(out, mine, group=group, async_op=True), mine, out)
        last[:] = [g]
        return g

    return gather


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()


def _to(value: Any, device: torch.device | None) -> Any:
    if device is not None and isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device, non_blocking=True)
    return value


def _split_value(value: Any, n: int, what: str, device: torch.device | None = None) -> list[Any]:
    if isinstance(value, Replicate):
        return [_to(value.value, device)] * n
    if isinstance(value, Microbatches):
        if len(value) != n:
            raise PipelineConfigError(f"{what} holds {len(value)} microbatches, expected num_microbatches={n}")
        return [_to(v, device) for v in value]
    value = _to(value, device)
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return [value] * n
        if value.shape[0] < n:
            raise PipelineConfigError(
                f"{what} has {value.shape[0]} rows along dim 0, fewer than the {n} microbatches; "
                "every microbatch needs at least one row"
            )
        return list(torch.tensor_split(value, n, dim=0))
    return [value] * n  # non-tensors reach every microbatch unchanged


def call_check(args: tuple[Any, ...], kwargs: Mapping[str, Any], target: Any) -> int:
    """What every rank's ``step``/``eval`` call must agree on, in one int64 (``StepInputs.call_check``): the
    batch's rows (dim 0 of the first positional tensor, else of the first keyword tensor, else of the target;
    0 when there is none: a rank may pass nothing it does not use) in the high half, a digest of the keyword
    inputs' names in the low half.  Ranks that differ cut the batch into other microbatches (the last stage
    pairs a microbatch's output with another target's rows, broadcast by the loss without a word) or give
    their stages other keyword inputs (every stage gets every keyword input): a silently different model."""
    rows = 0
    for v in (*args, *kwargs.values(), target):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            rows = int(v.shape[0])
            break
    names = zlib.crc32("\0".join(sorted(kwargs)).encode()) if kwargs else 0
    return (min(rows, 0x7FFFFFFF) << 32) | names


def split_microbatches(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], target: Any, n: int, device: torch.device | None = None
) -> StepInputs:
    """Cut a batch into ``n`` microbatches along dim 0 (tensors, moved to ``device``); other values are shared.

    ``Replicate(t)`` gives ``t`` whole to every microbatch; 0-d tensors and non-tensors are shared too.
    """
    arg_chunks = [_split_value(a, n, f"positional input {i}", device) for i, a in enumerate(args)]
    kw_chunks = {k: _split_value(v, n, f"keyword input {k!r}", device) for k, v in kwargs.items()}
    targets = None if target is None else _split_value(target, n, "target", device)
    return StepInputs(
        args=list(zip(*arg_chunks)) if arg_chunks else [()] * n,
        kwargs=[{k: c[m] for k, c in kw_chunks.items()} for m in range(n)] if kw_chunks else [{} for _ in range(n)],
        targets=targets,
        layout_key=_layout_key(args, kwargs, target, n),
    )


_PLAIN = (type(None), bool, int, str)


def _uncut_key(value: Any) -> Any:
    """What fixes the layout (``actor._layout``) of ``_split_value``'s microbatches of ``value``, for the
    values whose key is cheap (tensors, plain scalars, ``Replicate`` of either); None for the others."""
    if isinstance(value, torch.Tensor):  # cut along dim 0 (or shared, 0-d): the shape and n fix the pieces'
        return ("T", value.shape, value.dtype, value.requires_grad)
    t = type(value)
    if t in _PLAIN:  # (the type too: True == 1)
        return (t, value)
    if t is float:  # (its repr, as the layout: 0.0 == -0.0)
        return (t, repr(value))
    if t is Replicate:
        inner = _uncut_key(value.value)
        return None if inner is None else ("R", inner)
    return None  # Microbatches, containers, other objects: the signature walks them


def _layout_key(args: tuple[Any, ...], kwargs: Mapping[str, Any], target: Any, n: int) -> Any:
    """``StepInputs.layout_key``: a key that fixes every microbatch's layout, or None."""
    keys = [_uncut_key(a) for a in args]
    keys += [(k, _uncut_key(v)) for k, v in kwargs.items()]
    keys.append(_uncut_key(target))
    if None in keys or any(k[1] is None for k in keys[len(args):len(args) + len(kwargs)]):
        return None
    # (grad mode: a piece of a tensor that requires grad does not under no_grad)
    return (n, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), len(args), *keys)


def _merge(outputs: list[Any], *, precut: bool) -> Any:
    """Join the last stage's per-microbatch outputs as torch does (cat on dim 0).

    Microbatches passed pre-cut (``Microbatches``) may have different shapes,
    so their outputs come back as ``Microbatches`` too, and so do outputs whose
    shapes beyond dim 0 differ between microbatches (``torch.cat`` cannot join them).
    Tuples and lists are merged position by position, dicts key by key (when every
    microbatch gave the same positions or keys), ``None`` everywhere stays ``None``;
    other values come back as the list of the microbatches' values.
    """
    if precut:
        return Microbatches(outputs)
    if all(isinstance(o, torch.Tensor) for o in outputs):
        if outputs and all(o.dim() == 0 for o in outputs):
            return torch.stack(outputs)
        if outputs and any(o.dim() == 0 or o.shape[1:] != outputs[0].shape[1:] for o in outputs):
            # shapes beyond dim 0 that differ between microbatches (a data-dependent slice): torch.cat cannot
            # join them (its error, raised on the last stage's rank after the step, failed the step there while
            # its peers had ended it); they come back per microbatch, as for pre-cut inputs
            return Microbatches(outputs)
        return torch.cat(outputs, dim=0)
    if outputs and all(o is None for o in outputs):
        return None  # (a field no microbatch filled, e.g. a model's optional ``loss`` or ``past_key_values``)
    if outputs and all(isinstance(o, (tuple, list)) for o in outputs) and len({len(o) for o in outputs}) == 1:
        return type(outputs[0])(_merge(list(parts), precut=False) for parts in zip(*outputs))
    if outputs and all(isinstance(o, Mapping) for o in outputs) and all(o.keys() == outputs[0].keys() for o in outputs):
        # dicts with the same keys (a Hugging Face ``ModelOutput`` too), merged key by key as torch's
        # ``merge_chunks`` does through pytree; of another type than dict, rebuilt as that type where it takes the
        # fields as keywords, else a plain dict
        merged = {k: _merge([o[k] for o in outputs], precut=False) for k in outputs[0]}
        kind = type(outputs[0])
        if kind is dict:
            return merged
        try:
            return kind(**merged)
        except Exception:  # noqa: BLE001 (a mapping type that cannot be rebuilt from its fields)
            return merged
    return outputs


#: (MASTER_ADDR, MASTER_PORT) -> [the TCP store made from the environment by the first Pipeline that initialised
#: torch.distributed over it in this process, how many process groups have been made over it]
#: (see ``_init_process_group``)
_STORES: dict[tuple[str, str], list[Any]] = {}


def _init_process_group(backend: str | None) -> bool:
    """Initialise torch.distributed from the environment if needed; True if we did.

    The store is made here (as ``env://`` would make it: rank 0 serves it unless the launcher's agent
    does) and kept for the life of the process; each process group made over it has its own key prefix
    (``pipeloom/0``, ``pipeloom/1``...).  A second Pipeline built after the first one's ``close`` (which destroys
    the group it made) used to initialise ``env://`` again: the store on that port (multi-tenant: the same
    server) still held the first group's keys (its gloo addresses), and every rank hung in
    ``init_process_group``.  The ranks build their Pipelines in the same order, so the prefixes agree.
    A new ``MASTER_PORT`` (or address) gets a new store.  No group of ours uses ``env://``'s own prefix
    (``default_pg``): a script's own ``init_process_group()`` on the same port (multi-tenant: the same server)
    before or after ours found that group's keys there, and hung in ``new_group``.
    """
    if dist.is_initialized():
        return False
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise PipelineConfigError(
            f"torch.distributed is not initialised and {', '.join(missing)} are not set; "
            "start the script with `pipeloom launch` or `torchrun`, or call init_process_group first"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    where = (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    if where not in _STORES:
        from datetime import timedelta

        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"  # (torchrun's agent serves it)
        store = dist.TCPStore(where[0], int(where[1]), world,
                              is_master=rank == 0 and not agent, timeout=timedelta(minutes=30), multi_tenant=True)
        store = agent_attempt_store(store)  # (torchrun's agent store: the prefix its env:// uses for this attempt)
        _STORES.clear()  # (a script that moved MASTER_PORT is done with the old store: rank 0 stops serving it)
        _STORES[where] = [store, 0]
    store, made = _STORES[where]
    _STORES[where][1] = made + 1
    store = dist.PrefixStore(f"pipeloom/{made}", store)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=torch.device("cuda", local))
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    return True


#: the default process group a Pipeline made (``_init_process_group``) and the Pipelines alive on it (by id):
#: the last of them to close destroys it.  The one that made it used to destroy it at its own close, under a
#: Pipeline built beside it (an evaluation Pipeline), whose next step failed with torch's "Default process group
#: has not been initialized".
_OWNED: dict[str, Any] = {"group": None, "users": set()}


def _join_owned_group(pipe: Any, made: bool) -> bool:
    """After ``_init_process_group``: True if the default group is one a Pipeline made (``pipe`` now shares it)."""
    world = dist.group.WORLD
    if made:
        _OWNED.update(group=world, users=set())
    if world is None or world is not _OWNED["group"]:
        return False
    _OWNED["users"].add(id(pipe))
    return True


def _leave_owned_group(pipe: Any) -> bool:
    """``pipe`` closes: True if it was the last Pipeline alive on the group a Pipeline made (destroy it now)."""
    _OWNED["users"].discard(id(pipe))
    if _OWNED["users"] or _OWNED["group"] is None or dist.group.WORLD is not _OWNED["group"]:
        return False
    _OWNED["group"] = None
    return True


def _dead_peers(procs: Sequence[tuple[str, int]], me: int) -> list[int]:
    """Ranks on this host whose process has exited (or is a zombie), from the (host, pid) of every rank."""
    host = socket.gethostname()
    dead = []
    for rank, (h, pid) in enumerate(procs):
        if rank == me or h != host:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    dead.append(rank)
        except FileNotFoundError:
            dead.append(rank)
        except (OSError, IndexError):  # no /proc: ask the kernel
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                dead.append(rank)
            except PermissionError:
                pass
    return dead


_HANDLED = [0]
"""Depth of :func:`handled_failures` blocks on this process."""


@contextlib.contextmanager
def handled_failures() -> Iterator[None]:
    """Inside: a Pipeline's construction or step errors are the caller's to handle (``measure_candidates``
    skips a candidate that fails on every rank), so they are not reported to ``pipeloom launch`` as the job's
    root cause (which starts its teardown).  A lost peer (:class:`PeerLostError`) is reported all the same."""
    _HANDLED[0] += 1
    try:
        yield
    finally:
        _HANDLED[0] -= 1


def _report_root_cause(exc: BaseException, *, remote: bool, traceback_text: str | None = None, error: str | None = None,
                       phase: str | None = None) -> None:
    """Under ``pipeloom launch``, write one root-cause line for the launcher's summary."""
    if os.environ.get("PIPELOOM_LAUNCHER") != "1" or getattr(exc, "_pipeloom_reported", False):
        return
    if _HANDLED[0] and not isinstance(exc, PeerLostError):
        return
    try:
        exc._pipeloom_reported = True  # type: ignore[attr-defined]
    except AttributeError:
        pass
    info: dict[str, Any] = {
        "rank": int(os.environ.get("RANK", "-1")),
        "stage": getattr(exc, "stage", None),
        "microbatch": getattr(exc, "microbatch", None),
        "action": getattr(exc, "action", None),
        "error": error or str(exc),
        "traceback": traceback_text or getattr(exc, "remote_traceback", None) or "".join(traceback.format_exception(exc)),
        "remote": remote,
    }
    if phase is not None:
        info["phase"] = phase  # "construction": the launcher puts the error on the root-cause line
    if isinstance(exc, RemoteRankError):
        info["failed_rank"] = exc.failed_rank
    elif isinstance(exc, PeerLostError):
        info["failed_rank"] = exc.peer
    sys.stderr.write("PIPELOOM_ROOT_CAUSE " + json.dumps(info, default=str) + "\n")
    sys.stderr.flush()


class Pipeline:
    """A pipeline-parallel model, this rank's share of it, and its schedule.

    Args:
        stage_fn: ``stage_fn(stage_index) -> nn.Module``, called for each stage this rank owns; a
            function of two positional parameters is called ``stage_fn(stage_index, ctx)`` with a
            :class:`~pipeloom.runtime.expert_parallel.StageContext` (the stage's expert-parallel group).
        schedule: a schedule name (``"1F1B"``, ``"ZBVZeroBubble"``...), a CSV path, or a ``Schedule``.
        num_microbatches: microbatches per step.
        loss_fn: ``loss_fn(output, target) -> scalar`` computed on the last stage.
        stages_per_rank: stages per rank; default per schedule (1, or 2 for interleaved and V).
        scale_grads: divide gradients by the number of microbatches (as torch does by default).
        deterministic: run each rank's list in exact order (debugging, bit-exact comparisons).
        device: where this rank's stages run; default cuda:LOCAL_RANK on NCCL, else CPU.
        heartbeat_interval: seconds between liveness heartbeats to every peer (default 0.5).
        heartbeat_timeout: seconds of silence after which a waiting rank declares a peer lost
            (default: $PIPELOOM_HEARTBEAT_TIMEOUT, else 10).
        stall_timeout: seconds one action of this rank may run while a peer waits for it before
            the peer reports it as stalled (default: $PIPELOOM_STALL_TIMEOUT, else 30).
        first_step_stall_timeout: the same budget for a *cold* step: the first one, and the
            first after the parameters (which, ``requires_grad``, shapes), the modules'
            train/eval mode or the step kind (step/eval) changed, when ``torch.compile``
            traces and compiles (default: $PIPELOOM_FIRST_STEP_STALL_TIMEOUT, else
            ``max(300, 10 * stall_timeout)``; never below ``stall_timeout``).
        setup_timeout: seconds a rank waits at a construction checkpoint for the other ranks
            to arrive (they all check there that they build the same Pipeline; see
            :mod:`pipeloom.runtime.agreement`) before it names the ranks that did not (300).
        check_finite: after every action, check its outputs, loss and gradients for NaN/inf
            and raise ``FloatingPointError`` (as a ``StageError``) naming the stage,
            microbatch and action where one first appears.  Off by default: it costs a
            reduction per tensor and, on GPUs, a device sync per action.
        forward_only: this Pipeline only runs ``eval``; without it the rank of the last stage
            requires ``loss_fn`` at construction.
        trace: record a trace to this path (default: $PIPELOOM_TRACE; under ``pipeloom launch
            --trace`` events stream to the launcher, which writes one file per job).
        options: the runtime's settings (:class:`~pipeloom.runtime.options.RuntimeOptions`);
            default ``RuntimeOptions.from_env()``.  Given, nothing is read from the
            environment.  The keyword arguments above and ``overlap_collectives`` that are not
            None override its fields.
        data_parallel: replicas of the pipeline (``pp x dp`` ranks; see
            :mod:`pipeloom.runtime.data_parallel`).  Every rank passes the *global* batch;
            replica ``d`` trains on part ``d`` of ``tensor_split(batch, data_parallel)``, and
            gradients are averaged over replicas.  ``step`` returns this replica's outputs and
            losses.  Replicas start from the parameters of replica 0 (broadcast, as DDP does).
        fsdp: shard each stage's parameters over its replicas with FSDP2's ``fully_shard``
            (parameters the optimizer sees are then DTensor shards).
        mesh: a 2-D DeviceMesh with dims ``("pp", "dp")`` to use instead of building one; with
            expert parallelism dims ``("pp", "ep")`` or ``("pp", "dp", "ep")``.
        expert_parallel: ranks that share each stage's experts (``pp x dp x ep`` ranks; see
            :mod:`pipeloom.runtime.expert_parallel` and :mod:`pipeloom.moe`).  Every (dp, ep)
            column trains on its own part of the global batch like a data-parallel replica;
            each stage gets its own ep group (``ctx.ep_group``); non-expert gradients are
            averaged over the columns, expert gradients are not.  Ranks then run their
            schedule row in list order (``deterministic``), so the ep peers of a stage issue
            their all-to-alls in the same order.  Not with ``fsdp``.
        fsdp_wrap: what ``fully_shard`` wraps: ``"stage"`` (one unit), ``"blocks"`` (each child
            of the stage that has parameters, each entry of a child ModuleList/ModuleDict such as
            a split model's ``layers``, and the stage itself for the rest, as torchtitan does), or a callable ``module -> bool`` (parameters of modules it does not pick stay
            replicated and are all-reduced; give the optimizer ``foreach=False`` then, since
            torch's foreach kernels reject plain tensors beside DTensors on GPUs).  Stages that
            already hold FSDP units are used as given.
        fsdp_kwargs: extra keyword arguments for ``fully_shard`` (``mp_policy``...);
            ``reshard_after_forward`` is always False (see data_parallel's docstring).
        prefetch: stage switches ahead of its use that a stage's all-gather is issued.
        bucket_bytes: size of the flat buffers that replicated gradients are all-reduced in.
        overlap_collectives: run the data-parallel collectives (UNSHARD's all-gather,
            REDUCE_GRAD's reduce-scatter and all-reduces) as events that overlap compute
            (True, the default).  False makes each one block this rank's dispatcher until it has
            completed (UNSHARD returns once the parameters are gathered, REDUCE_GRAD once the
            gradients are reduced), so no compute overlaps a collective: the naive baseline
            that the benchmarks compare against.  None: $PIPELOOM_OVERLAP_COLLECTIVES
            (``0`` turns overlap off), else True.
    """

    def __init__(
        self,
        stage_fn: Callable[[int], nn.Module],
        schedule: str | os.PathLike[str] | Schedule = "1F1B",
        num_microbatches: int = 8,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        stages_per_rank: int | None = None,
        *,
        scale_grads: bool = True,
        deterministic: bool | None = None,
        device: torch.device | str | None = None,
        heartbeat_interval: float | None = None,
        heartbeat_timeout: float | None = None,
        stall_timeout: float | None = None,
        first_step_stall_timeout: float | None = None,
        setup_timeout: float | None = None,
        check_finite: bool | None = None,
        forward_only: bool = False,
        trace: str | os.PathLike[str] | None = None,
        data_parallel: int = 1,
        fsdp: bool = False,
        mesh: Any = None,
        fsdp_wrap: Any = "stage",
        fsdp_kwargs: Mapping[str, Any] | None = None,
        expert_parallel: int = 1,
        prefetch: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap_collectives: bool | None = None,
        options: RuntimeOptions | None = None,
    ) -> None:
        try:
            opts = resolve_options(
                options, deterministic=deterministic, heartbeat_interval=heartbeat_interval,
                heartbeat_timeout=heartbeat_timeout, stall_timeout=stall_timeout,
                first_step_stall_timeout=first_step_stall_timeout, setup_timeout=setup_timeout, check_finite=check_finite,
                trace=None if trace is None else os.fspath(trace), overlap_collectives=overlap_collectives,
            )
        except ValueError as exc:
            raise PipelineConfigError(str(exc)) from None
        #: the runtime's settings, as resolved (keyword arguments over ``options`` over the environment)
        self.options = opts
        # shared by every Pipeline alive on the group a Pipeline made: the last to close destroys it
        self._owns_group = _join_owned_group(self, _init_process_group(opts.backend))
        note_default_group()  # (make_mesh: a default NCCL group made again after a first one was destroyed)
        #: the default group this Pipeline was built on (training.pending_collective: a collective left pending on it),
        #: weakly: a strong reference kept a destroyed gloo group alive until the collector freed it with the Pipeline,
        #: and that free blocked inside the collector (the setup-checks pool hung in construction)
        self._world_group = weakref.ref(dist.group.WORLD) if dist.group.WORLD is not None else None
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.num_microbatches = num_microbatches
        self.loss_fn = loss_fn
        backend = self._backend = dist.get_backend()
        self._aborted = False
        self._obj_group: Any = None
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        #: this Pipeline only runs ``eval`` (no loss_fn needed on the last stage)
        self.forward_only = bool(forward_only)
        dp_options = {"fsdp_wrap": fsdp_wrap if isinstance(fsdp_wrap, str) else "callable", "bucket_bytes": bucket_bytes,
                      "overlap_collectives": opts.overlap_collectives, "fsdp_reduce": opts.fsdp_reduce}
        # Construction has two checkpoints where every rank posts what it builds (or why it
        # failed) and reads everybody else's (runtime/agreement.py): once the settings are
        # known, and once the user's stage_fn has run.  Nothing collective runs between the
        # process-id exchange above and a passed checkpoint, so a rank that fails or
        # disagrees stops every rank at once with its reason, instead of leaving them
        # blocked in a collective.
        agreement = SetupAgreement(self.rank, self.world_size, timeout=opts.setup_timeout)
        checkpoint = "settings"
        try:
            try:
                record = self._settings(schedule, num_microbatches, stages_per_rank, data_parallel=data_parallel,
                                        fsdp=fsdp, mesh=mesh, prefetch=prefetch, scale_grads=scale_grads,
                                        dp_options=dp_options, expert_parallel=expert_parallel)
            except BaseException as exc:
                agreement.fail(checkpoint, exc)
                raise
            # Who runs where rides along: if a peer dies while this rank is in a construction
            # collective, gloo only says "Connection reset"; the pids tell which rank it was.
            record["_process"] = [socket.gethostname(), os.getpid()]
            # Settings that change which collectives construction runs (a rank with a job secret skips
            # its broadcast; pair groups are made collectively) or whether the ranks can hear each other
            # (signatures; heartbeats against timeouts): ranks that differ would otherwise hang in the
            # constructor or name a live peer lost in the first step.
            record["PIPELOOM_JOB_SECRET"] = secret_field()
            record["pair_groups"] = bool(backend == "nccl" or opts.emulate_nccl_transport or opts.static_shapes is not False
                                         or opts.pair_groups)
            record["_heartbeat"] = [opts.heartbeat_interval, opts.heartbeat_timeout]
            record["tied_weights"] = opts.tied_weights  # (which collectives construction and each step run)
            records = agreement.agree(checkpoint, record, check_heartbeats)
            self._procs: list[tuple[str, int]] = [tuple(r["_process"]) for r in records]  # type: ignore[misc]
            agreement.procs = self._procs
            agreement.dead_peers = lambda: _dead_peers(self._procs, self.rank)
            checkpoint = "stages"
            try:
                modules = self._make_stages(stage_fn, backend, data_parallel=data_parallel, mesh=mesh)
            except BaseException as exc:
                agreement.fail(checkpoint, exc)
                raise
            # ranks that hold the same stage (replicas) must build the same tensors: construction
            # broadcasts replica 0's into the others (agreement.check_stage_replicas says why)
            # (and which of the model's tied weights each stage holds: one tied across ranks is refused, runtime/ties.py)
            # (RuntimeOptions.tied_weights="sync": one tied across ranks is kept equal instead, runtime/ties.py)
            record = {"_stages": stage_tensors(modules)} if self._with_dp else {}
            sync_ties = opts.tied_weights == "sync"
            stage_records = agreement.agree(
                checkpoint, {**record, "_ties": self._tie_uses}, check_stage_replicas,
                refuse=lambda recs: ties_across_ranks(recs, self.schedule.stage_to_rank, sync=sync_ties, fsdp=self._fsdp,
                                                      expert_parallel=self._ep_grid is not None))
            tie_plan = tie_sync_groups(stage_records, self.schedule.stage_to_rank,
                                       frozen=not self._fsdp and self._ep_grid is None) if sync_ties else []
        except BaseException as exc:
            text = str(exc)
            if text.startswith(prefix := f"rank {self.rank}: "):
                text = text[len(prefix):]
            remote = isinstance(exc, (RemoteRankError, PeerLostError))
            _report_root_cause(exc, remote=remote, error=str(exc) if remote else f"{type(exc).__name__}: {text}",
                               traceback_text=short_traceback(exc, frames_only=True), phase="construction")
            if self._owns_group and _leave_owned_group(self) and backend != "nccl":  # (every peer has read why)
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - the construction error is what matters
                    pass
            if isinstance(exc, PipelineError):
                # Our own errors say all there is to say: no chained internals.
                exc.__cause__, exc.__suppress_context__ = None, True
                raise exc.with_traceback(None) from None
            raise
        finally:
            agreement.close()
        # Control traffic (object collectives) on gloo, also on NCCL jobs.
        obj_group = self._obj_group = dist.new_group(backend="gloo") if backend == "nccl" else None
        # NCCL: transfer headers travel through gloo (transport/tensor.py), in a group of their own
        # gloo with static shapes (auto or True): the same protocol, the loop waiting for its payloads itself
        nccl_protocol = backend == "nccl" or opts.emulate_nccl_transport or opts.static_shapes is not False
        self._header_group = dist.new_group(backend="gloo") if nccl_protocol else None
        if backend == "nccl":  # (the training loop's collectives must not connect NCCL's channels: see there)
            from .training import connect_training_collectives

            with self._construction("connecting the default group's all-reduce"):
                connect_training_collectives(self.device)
        lay = self.layout
        if self._ep_groups is not None and not opts.deterministic:
            # the ep peers of a stage must issue their all-to-alls in the same order (expert_parallel.py)
            opts = self.options = dataclasses.replace(opts, deterministic=True)
        grad_scale = 1.0 / num_microbatches if scale_grads else 1.0
        last = self.schedule.num_stages - 1
        self._executors: dict[int, StageExecutor] = {}
        split = {leaf.stage for a in self.schedule.actions[self.pp_rank] for leaf in a.leaves() if leaf.type.value in ("I", "W")}
        for s, module in modules.items():
            if lay is not None:
                from .data_parallel import sync_module_states, wrap_fsdp

                if self._ep_groups is not None:
                    from .expert_parallel import sync_stage

                    with self._construction(f"broadcasting stage {s}'s parameters over its replicas"):
                        sync_stage(module, self._ep_groups)
                elif lay.dp > 1:
                    with self._construction(f"broadcasting stage {s}'s parameters over its replicas"):
                        sync_module_states(module, lay.dp_group, src=lay.row[0])
                if fsdp:
                    module = wrap_fsdp(module, lay.dp_mesh, fsdp_wrap, fsdp_kwargs)
            self._executors[s] = StageExecutor(
                s, module, is_last=s == last, loss_fn=loss_fn, grad_scale=grad_scale, split_backward=s in split,
            )
            install_stage_checks(self._executors[s], rank=self.rank, stage_to_rank=self.stage_to_rank,
                                 check_finite=opts.check_finite,
                                 replicas=lay.dp if lay is not None and opts.dp_buffers == "refuse" else 1)
        #: RuntimeOptions.tied_weights="sync": this rank's copies of the weights tied across pipeline ranks (every rank
        #: makes their groups, in one order), made equal to the lowest holding rank's now, synchronised after each step
        self._ties: TiedCopies | None = None
        if tie_plan:
            with self._construction("making the tied weights' groups and broadcasting their copies"):
                self._ties = TiedCopies(modules, self._tie_uses, tie_plan, rank=self.rank, pp_rank=self.pp_rank,
                                        grid=lay.grid if lay is not None else [[r] for r in range(self.world_size)],
                                        dp_group=lay.dp_group if lay is not None and lay.dp > 1 else None)
                self._ties.broadcast()
        #: RuntimeOptions.dp_buffers="replica0": each stage's buffers are broadcast from its first replica after
        #: every training step (stages that have buffers only)
        self._sync_buffers = bool(lay is not None and lay.dp > 1 and self._ep_groups is None and opts.dp_buffers == "replica0"
                                  and any(True for m in modules.values() for _ in m.buffers()))
        if opts.cuda_graphs:
            from .cuda_graphs import StageGraphs, capturable_loss, slots_per_stage

            slots = slots_per_stage(self.schedule.actions[self.pp_rank])
            # a backward launched beside the next forward (host_overlap_backward) holds its slot until its
            # gradients are read, while that forward already wants one: one more slot than the list keeps alive
            # (two with host_queue_backwards: a second backward may be queued behind the first)
            extra = 0 if opts.host_overlap_backward is False else 2 if opts.host_queue_backwards else 1
            for s, ex in self._executors.items():
                # cuda_graphs_loss: the last stage's loss captured with it, unless the loss has parameters or buffers
                # of its own (a replay would not train or read them anew): then it runs eagerly after the replay
                lf = ex.loss_fn if ex.is_last and opts.cuda_graphs_loss else None
                if lf is not None and not capturable_loss(lf):
                    log.info("rank %d: cuda_graphs_loss: the loss_fn of stage %d has parameters or buffers: it runs eagerly",
                             self.rank, s)
                    lf = None
                ex.graphs = StageGraphs(s, ex.module, slots.get(s, 1) + extra, self.device,
                                        allowed_hooks=[StageExecutor._note_recompute], loss_fn=lf)
        #: parameter sets (and modes) this rank has run a step with: a new one is a cold step
        self._seen_fingerprints: set[Any] = set()
        self._fingerprint: ModelFingerprint | None = None
        #: whether data-parallel collectives overlap compute (False: each blocks the dispatcher until done)
        self.overlap_collectives = opts.overlap_collectives
        self._collectives: StageCollectives | None = None
        if lay is not None:
            self._collectives = StageCollectives(
                {s: e.module for s, e in self._executors.items()}, rank=self.rank, group=lay.dp_group,
                group_ranks=lay.row, device=self.device, bucket_bytes=bucket_bytes, overlap=self.overlap_collectives,
                fsdp_reduce=opts.fsdp_reduce,
                **({"expert_group": self._ep_groups.experts, "expert_divisor": lay.dp} if self._ep_groups is not None else {}),
            )
            # with expert parallelism the stages keep their own CUDA streams (the halves of an
            # OVERLAP_F_B overlap their all-to-alls), so REDUCE_GRAD launches on its stage's stream
            self._collectives.on_stage_streams = self._ep_groups is not None

        # Control plane: one endpoint per rank, exchanged over the job's group,
        # and a per-job secret that signs every message.
        secret = [os.environ.get("PIPELOOM_JOB_SECRET") or secrets.token_hex(16)]
        if not os.environ.get("PIPELOOM_JOB_SECRET"):
            with self._construction("sharing the job secret"):
                dist.broadcast_object_list(secret, src=0, group=obj_group)
        self._control = ControlPlane(
            self.rank, self.world_size, secret=secret[0].encode(), host=choose_bind_host(os.environ.get("MASTER_ADDR"))
        )
        self._control.stall_budget = opts.cold_stall_timeout
        endpoints: list[Any] = [None] * self.world_size
        with self._construction("exchanging control endpoints"):
            dist.all_gather_object(endpoints, self._control.endpoint, group=obj_group)
        self._control.connect([str(e) for e in endpoints])
        self._trace_sink, recorder = self._open_trace(opts.trace, opts.trace_endpoint, secret[0].encode())
        pair_groups = None
        if nccl_protocol or opts.pair_groups:
            columns = [[row[j] for row in lay.grid] for j in range(lay.dp)] if lay else [list(range(self.world_size))]
            links = Dataflow(self.schedule.stage_to_rank).links()  # in schedule rows
            # every replica's pipeline edges, in global ranks
            edges = {(column[a], column[b]) for column in columns for a, b in links}
            with self._construction("connecting the point-to-point groups"):
                pair_groups = make_pair_groups(edges, max_ctas=opts.p2p_max_ctas, batch_p2p=opts.batch_p2p)
        self._tensors = TensorPlane(self.rank, device=self.device, pair_groups=pair_groups, prepost_depth=self.options.gloo_prepost_depth,
                                    header_group=self._header_group, batch_p2p=self.options.batch_p2p)
        self._actor = RankActor(
            rank=self.rank,
            schedule=self.schedule,
            stages=self._executors,
            tensor_plane=self._tensors,
            control=self._control,
            device=self.device,
            options=opts,
            trace=recorder,
            pp_rank=self.pp_rank,
            stage_to_rank=self.stage_to_rank,
            collectives=self._collectives,
        )
        if self._actor._static and self._actor._auto and dist.get_world_size(obj_group) > 1:
            # static shapes: the ranks' input layouts, each step (a world of one has only its own: no
            # gather, whose completion on gloo's thread took 67 us median to be seen on this CPU machine)
            self._actor.agree = _gather_ints(obj_group)
        elif opts.static_shapes is False and self.world_size > 1:
            # gloo's header protocol: the same gather, for what the ranks' calls must agree on (the kind of
            # step, batch rows, keyword names: actor._agree_layout). Without it, ranks that disagree on the
            # kind post receives from another step kind's table, and a sender's packed header+payload landing
            # in a smaller receive ends the receiving process inside gloo (C++ terminate), unexplained.
            # Its own group: the transfers of this protocol may use the default group.
            self._actor.agree = _gather_ints(dist.new_group(backend="gloo") if obj_group is None else obj_group)
        self._control.start_heartbeats(opts.heartbeat_interval, lambda: self._actor.state)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bound_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        #: (step, error) of this Pipeline's first failed step: it runs no step after it (see ``_arun``)
        self._failed: tuple[int, BaseException] | None = None
        #: the last step's losses on this rank, by microbatch (empty off the last stage)
        self._last_losses: dict[int, torch.Tensor] = {}
        # A script that dies with an exception never calls close(); tearing
        # down sockets, threads and the process group it owns at exit (while
        # threads still run) keeps the process from aborting in C++
        # destructors, so its exit code still says "user code failed".
        atexit.register(self._close_at_exit)

    # ------------------------------------------------------------ setup
    def _settings(self, schedule: Any, n: int, stages_per_rank: int | None, *, data_parallel: int, fsdp: bool,
                  mesh: Any, prefetch: int, scale_grads: bool, dp_options: Mapping[str, Any],
                  expert_parallel: int = 1) -> dict[str, Any]:
        """The schedule and the pp x dp (x ep) sizes, from this rank's arguments alone (nothing collective)."""
        self.layout: Layout | None = None  #: the pp x dp grid (set after the settings checkpoint), or None
        self._with_dp = data_parallel != 1 or fsdp or mesh is not None
        self._fsdp = bool(fsdp)
        #: expert parallelism: the ep size and the pp x (dp * ep) grid; groups made with the stages
        self.expert_parallel = 1
        self._ep_grid: list[list[int]] | None = None
        self._ep_dp = 1
        self._ep_groups: Any = None
        grid = None
        mesh_names = tuple(getattr(mesh, "mesh_dim_names", None) or ()) if mesh is not None else ()
        if self.options.cuda_graphs:
            why = ("with fsdp (parameters are gathered and freed around each use)" if fsdp
                   else "with expert parallelism (the stages' all-to-alls)" if expert_parallel != 1 or "ep" in mesh_names
                   else "with data parallelism (not verified on GPUs yet)" if data_parallel != 1 or mesh is not None
                   else "the stages are not on a CUDA device (device " + str(self.device) + ")" if self.device.type != "cuda"
                   else None)
            if why is not None:
                raise PipelineConfigError(f"rank {self.rank}: RuntimeOptions.cuda_graphs: not available {why}")
        if expert_parallel != 1 or "ep" in mesh_names:
            from .expert_parallel import make_ep_grid

            if fsdp:
                raise PipelineConfigError(f"rank {self.rank}: expert_parallel does not combine with fsdp (not implemented)")
            if not isinstance(expert_parallel, int) or expert_parallel < 1:
                raise PipelineConfigError(f"rank {self.rank}: expert_parallel must be a positive int, got {expert_parallel!r}")
            try:
                grid, self._ep_dp = make_ep_grid(world=self.world_size, data_parallel=data_parallel,
                                                 expert_parallel=expert_parallel, mesh=mesh)
            except PipelineConfigError as exc:
                raise PipelineConfigError(f"rank {self.rank}: {exc}") from None
            self.expert_parallel = len(grid[0]) // self._ep_dp
            self._ep_grid = grid
            self._with_dp = True
            self.pp_size = len(grid)
            dp_options = dict(dp_options, expert_parallel=self.expert_parallel)
        elif mesh is not None:
            if getattr(mesh, "ndim", None) != 2:
                raise PipelineConfigError(f"rank {self.rank}: mesh must be a 2-D DeviceMesh with dims ('pp', 'dp')")
            grid = [[int(r) for r in row] for row in mesh.mesh.tolist()]
            self.pp_size = len(grid)
        else:
            if data_parallel < 1 or self.world_size % data_parallel:
                raise PipelineConfigError(f"rank {self.rank}: data_parallel={data_parallel} does not divide the job's {self.world_size} ranks")
            self.pp_size = self.world_size // data_parallel
        self.schedule = self._build_schedule(schedule, n, stages_per_rank)
        if self._with_dp:
            from .data_parallel import lower_for_data_parallel

            self.schedule = lower_for_data_parallel(self.schedule, fsdp=fsdp, prefetch=prefetch)
        rec = config_record(
            world_size=self.world_size, schedule=self.schedule, pp_size=self.pp_size, data_parallel=data_parallel,
            fsdp=fsdp, mesh_grid=grid, scale_grads=scale_grads,
            dp_options=dict(dp_options, prefetch=prefetch) if self._with_dp else None,
        )
        # (the transfer protocol of the later steps depends on it: every rank must agree)
        rec = {"static_shapes": self.options.static_shapes, "emulate_nccl_transport": self.options.emulate_nccl_transport,
               "batch_p2p": self.options.batch_p2p, **rec}
        return rec

    def _make_stages(self, stage_fn: Callable[[int], nn.Module], backend: str, *, data_parallel: int,
                     mesh: Any) -> dict[int, nn.Module]:
        """The layout (collective: every rank agreed on it), then this rank's stage modules from ``stage_fn``."""
        lay = None
        if self._ep_grid is not None:
            from .data_parallel import Layout
            from .expert_parallel import make_ep_groups

            grid = self._ep_grid
            i, j = next((i, row.index(self.rank)) for i, row in enumerate(grid) if self.rank in row)
            self._ep_groups = make_ep_groups(grid, rank=self.rank, ep=self.expert_parallel, dp=self._ep_dp,
                                             stage_to_row=self.schedule.stage_to_rank,
                                             timeout=self.options.cold_stall_timeout + self.options.heartbeat_timeout,
                                             device=self.device, max_ctas=self.options.ep_max_ctas)
            lay = self.layout = Layout(pp=len(grid), dp=len(grid[0]), pp_rank=i, dp_rank=j, mesh=None,
                                       grid=tuple(tuple(r) for r in grid), row_group=self._ep_groups.row,
                                       ep=self.expert_parallel)
        elif self._with_dp:
            from .data_parallel import make_layout

            lay = self.layout = make_layout(
                rank=self.rank, world=self.world_size, data_parallel=data_parallel, mesh=mesh,
                device_type="cuda" if backend == "nccl" else "cpu",
            )
        self.pp_size = lay.pp if lay else self.world_size
        self.pp_rank = lay.pp_rank if lay else self.rank
        self.data_parallel = lay.dp if lay else 1
        self.dp_rank = lay.dp_rank if lay else 0
        #: global rank of each stage in this replica
        self.stage_to_rank = [lay.column[r] for r in self.schedule.stage_to_rank] if lay else list(self.schedule.stage_to_rank)
        last = self.schedule.num_stages - 1
        modules: dict[int, nn.Module] = {}
        from .expert_parallel import StageContext, call_stage_fn

        for s in self.schedule.stages_of(self.pp_rank):
            ctx = StageContext(stage=s, device=self.device)
            if self._ep_groups is not None:
                g, ranks = self._ep_groups.stage_groups[s]
                ctx = StageContext(stage=s, device=self.device, ep_group=g, ep_rank=ranks.index(self.rank),
                                   ep_size=len(ranks), ep_ranks=tuple(ranks))
            module = call_stage_fn(stage_fn, s, ctx)
            if not isinstance(module, nn.Module):
                raise PipelineConfigError(f"rank {self.rank}: stage_fn({s}) returned {type(module).__name__}, not an nn.Module")
            modules[s] = module.to(self.device)
        self._tie_uses = refuse_ties_across_ranks(modules, self.rank, sync=self.options.tied_weights == "sync")
        if self._fsdp and len(modules) > 1:
            # FSDP shards each stage on its own: a parameter two local stages share (a weight tied between the
            # first and last stage of a V schedule) would be sharded twice, its gradients silently wrong
            held: dict[int, tuple[int, str]] = {}
            for s, module in modules.items():
                for name, p in module.named_parameters():
                    if id(p) in held and held[id(p)][0] != s:
                        raise PipelineConfigError(
                            f"rank {self.rank}: stages {held[id(p)][0]} and {s} share one parameter "
                            f"({held[id(p)][1]!r} of stage {held[id(p)][0]}, {name!r} of stage {s}); fsdp=True shards "
                            "each stage on its own and cannot shard it twice: untie it, or use data_parallel "
                            "without fsdp (which reduces a shared parameter once)"
                        )
                    held.setdefault(id(p), (s, name))
        if last in modules and self.loss_fn is None and not self.forward_only:
            raise PipelineConfigError(
                f"rank {self.rank} holds the last stage ({last}) but loss_fn is None: training needs "
                "loss_fn(output, target) -> scalar tensor there (pass forward_only=True for a Pipeline that only runs eval)"
            )
        return modules

    @contextlib.contextmanager
    def _construction(self, what: str) -> Iterator[None]:
        """Around a collective of the constructor: a peer that died during it is named, not gloo's error.

        gloo reports a peer that died mid-collective as "Connection reset by
        peer" from the pair it was on, without a rank.  The ranks exchanged
        (host, pid) first, so the dead one is found among those on this host
        (a zombie counts as dead: the launcher may not have reaped it yet).
        The error is reported as a root cause naming that rank (``remote``).
        An error that is not about a broken connection is raised unchanged.
        """
        try:
            yield
        except RuntimeError as exc:
            err = self._construction_error(what, exc)
            if err is None:
                raise
            _report_root_cause(err, remote=True)
            if self._backend == "nccl":
                self._aborted = True
                abort_communicators([g for g in (self._obj_group,) if g is not None], world=self._owns_group)
            raise err from None  # gloo's "Connection reset" says nothing the message does not

    def _construction_error(self, what: str, exc: RuntimeError) -> PipelineError | None:
        text = str(exc)
        procs = getattr(self, "_procs", None)
        dead: list[int] = []
        deadline = time.monotonic() + 1.0
        while procs is not None:
            dead = _dead_peers(procs, self.rank)
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.05)  # the kernel closes a dying process's sockets before it is a zombie
        if dead:
            host, pid = procs[dead[0]]
            also = f" (also gone: ranks {', '.join(map(str, dead[1:]))})" if len(dead) > 1 else ""
            return PeerLostError(
                f"{what} while building the Pipeline failed: its process (pid {pid} on {host}) is gone{also}",
                rank=self.rank, peer=dead[0],
            )
        if any(w in text for w in ("Connection reset", "Connection closed", "Broken pipe", "Connection refused")):
            where = "none of the ranks on this host is gone" if procs is not None else "ranks had not exchanged pids yet"
            return PipelineError(
                f"rank {self.rank}: {what} while building the Pipeline failed: a peer's connection broke ({where}; "
                f"a rank on another host?): {text.splitlines()[0][:300]}"
            )
        return None

    def _build_schedule(self, schedule: Any, n: int, stages_per_rank: int | None) -> Schedule:
        from ..schedules import check, generate

        try:
            if isinstance(schedule, Schedule):
                sched = schedule
            elif isinstance(schedule, os.PathLike) or (isinstance(schedule, str) and (schedule.endswith(".csv") or Path(schedule).is_file())):
                path = Path(schedule)
                if not path.is_file():
                    raise PipelineConfigError(
                        f"rank {self.rank}: schedule file {os.fspath(schedule)!r} "
                        f"{'is not a file' if path.exists() else 'does not exist'} (resolved: {path.resolve()})"
                    )
                sched = load_csv(schedule)
            else:
                sched = generate(str(schedule), num_ranks=self.pp_size, num_microbatches=n, stages_per_rank=stages_per_rank)
            if sched.num_ranks != self.pp_size:
                what = f"pipeline dimension has {self.pp_size} ranks" if self._with_dp else f"job has {self.world_size}"
                raise PipelineConfigError(f"the schedule has {sched.num_ranks} ranks but the {what}")
            if sched.num_microbatches != n:
                raise PipelineConfigError(f"the schedule has {sched.num_microbatches} microbatches but num_microbatches={n}")
            check(sched)
        except ScheduleError as exc:
            raise PipelineConfigError(f"rank {self.rank}: bad schedule: {exc}") from exc
        return sched

    def _open_trace(self, path: str | None, endpoint: str | None, secret: bytes) -> tuple[Any, TraceRecorder | None]:
        if not endpoint and not path:
            return None, None
        o = self.options
        header = make_header(
            world_size=self.world_size,
            schedule=self.schedule.name,
            num_microbatches=self.num_microbatches,
            stage_to_rank=self.schedule.stage_to_rank,
            # what `schedule simulate --costs-from` needs to plan this run as it ran (GPUs: the commit horizon, the
            # backward overlap, one stream per stage)
            options={"gpu_commit_ms": o.gpu_commit_ms, "gpu_commit_launches": o.gpu_commit_launches,
                     "host_overlap_backward": o.host_overlap_backward, "overlap_streams": o.overlap_streams,
                     "gpu_learn_sleep": o.gpu_learn_sleep, "dispatch": o.dispatch, "device": self.device.type,
                     "overlap_margin": OVERLAP_MARGIN, "cuda_graphs": o.cuda_graphs},
        )
        if endpoint:
            sink: Any = StreamSink(endpoint, self.rank, header, secret)
        else:
            sink = FileSink(os.fspath(path), self.rank, self.world_size, header)
        return sink, TraceRecorder(self.rank)

    # ------------------------------------------------------------ public
    @property
    def stages(self) -> dict[int, nn.Module]:
        """The stage modules this rank owns, by stage index (give their parameters to the optimizer)."""
        return {s: e.module for s, e in self._executors.items()}

    @property
    def has_last_stage(self) -> bool:
        return self.schedule.num_stages - 1 in self._executors

    @property
    def has_first_stage(self) -> bool:
        return 0 in self._executors

    @property
    def statistics(self) -> ActorStatistics | None:
        """What the dispatcher did in the last step."""
        return self._actor.statistics

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (two local stages may share one: a weight tied
        between the first and last stage of a V schedule, which both live on rank 0)."""
        seen: set[int] = set()
        out = []
        for m in self.stages.values():
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def step(self, *args: Any, target: Any = None, losses: list[Any] | None = None, return_outputs: bool = True,
             **kwargs: Any) -> Any:
        """Run one training step (forward and backward of every microbatch); blocking.

        Returns the last stage's outputs, merged over the microbatches, on the rank
        that holds it (None elsewhere).  ``return_outputs=False`` (torch's
        ``schedule.step(..., return_outputs=False)``): each microbatch's output is
        dropped once its loss is computed and the step returns None -- for training
        loops that only need the loss (``losses=``, :meth:`last_loss`), since the
        outputs of a whole step (a language model's batch x sequence x vocabulary
        logits) are otherwise held until the step ends.
        """
        return self._run_sync(self.astep(*args, target=target, losses=losses, return_outputs=return_outputs, **kwargs))

    def eval(self, *args: Any, target: Any = None, losses: list[Any] | None = None, return_outputs: bool = True,
             **kwargs: Any) -> Any:
        """Forward only, for every schedule; returns the output on the last stage's rank (see :meth:`step`)."""
        return self._run_sync(self.aeval(*args, target=target, losses=losses, return_outputs=return_outputs, **kwargs))

    async def astep(self, *args: Any, target: Any = None, losses: list[Any] | None = None, return_outputs: bool = True,
                    **kwargs: Any) -> Any:
        """``step`` inside a running event loop."""
        return await self._arun(args, kwargs, target, losses, train=True, return_outputs=return_outputs)

    async def aeval(self, *args: Any, target: Any = None, losses: list[Any] | None = None, return_outputs: bool = True,
                    **kwargs: Any) -> Any:
        """``eval`` inside a running event loop."""
        return await self._arun(args, kwargs, target, losses, train=False, return_outputs=return_outputs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over several steps without reducing them over the replicas (DDP's ``no_sync``).

        Steps run inside it skip the data-parallel reduction; the first step
        outside reduces everything accumulated since the last reduction, so::

            with pipe.no_sync():
                pipe.step(x0, target=y0)          # gradients stay local
            pipe.step(x1, target=y1)              # reduces the sum of both steps
            opt.step(); opt.zero_grad()

        gives the gradients of the sum of both steps' losses, each averaged
        over its microbatches and the replicas (divide by the number of
        steps, or scale the loss, for their mean).  Without data parallelism
        it changes nothing.
        """
        coll = self._collectives
        if coll is None:
            yield
            return
        before = coll.sync
        coll.sync = False
        try:
            yield
        finally:
            coll.sync = before

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        """RuntimeOptions.dp_buffers="replica0": every local stage's buffers from its first replica, in stage order
        (every replica of a stage holds the same stages, so the broadcasts pair)."""
        lay = self.layout
        for s in sorted(self._executors):
            for b in self._executors[s].module.buffers():
                dist.broadcast(b.data, src=lay.row[0], group=lay.dp_group)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip every stage's gradients by the norm of the whole model's; return that norm (call on every rank).

        Exact against ``torch.nn.utils.clip_grad_norm_`` on the unsplit model,
        across stages and data-parallel replicas (FSDP shards and replicated
        parameters each counted once); see :mod:`pipeloom.runtime.training`.
        """
        from .training import clip_grad_norm_

        if self._collectives is not None and not self._collectives.sync:
            raise PipelineConfigError(
                f"rank {self.rank}: clip_grad_norm_ inside no_sync(): the gradients are not reduced over the "
                "replicas yet; clip after the step that leaves no_sync()"
            )
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def last_loss(self, reduce_to: str | int = "all") -> float | None:
        """The last step's loss, the mean over every microbatch of every replica (call on every rank).

        ``reduce_to="all"``: every rank gets it; a rank number: only that rank
        does (the others get None).  A collective over the job: one small
        all-reduce (every rank checks that its peers called the same), no user code needed.
        """
        from .training import reduce_step_loss

        return reduce_step_loss(self, self._last_losses, reduce_to=reduce_to)

    def close(self) -> None:
        """Release sockets and threads; destroy the process group if this Pipeline created it."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        from .checkpoint import warn_pending

        warn_pending()  # an asynchronous save still writing needs the process group
        if self._trace_sink is not None:
            if self._actor.trace is not None and not self._aborted:
                try:  # GPUs: the device times of the last steps' actions (their events complete now)
                    self._actor.flush_device_times()
                    self._trace_sink.emit(self._actor.trace.drain())
                except Exception:  # noqa: BLE001 - closing must not fail on a trace
                    log.exception("rank %d: writing the last device times to the trace failed", self.rank)
            self._trace_sink.close()
        self._actor.close()
        self._control.stop()  # unregisters the socket's reader from the loop
        self._control.close()
        # After an abort the waiter threads may poll Works that never complete: do not wait for them.
        self._tensors.close(join_timeout=0.05 if self._aborted else 1.0)
        blocked = self._tensors.blocked_threads()
        if blocked:
            guard_exit(blocked)
        if self._collectives is not None:
            self._collectives.close()
        if self._loop is not None and not self._loop.is_running():
            self._loop.close()
        # (not after a training collective timed out: destroying a group with its Work pending waits for it forever)
        if (self._owns_group and _leave_owned_group(self) and dist.is_initialized() and not self._aborted
                and not getattr(self, "_collective_timed_out", False) and pending_collective(self) is None):
            dist.destroy_process_group()

    def _abort_nccl(self) -> None:
        """After a failed step on NCCL: abort the communicators now, so nothing waits for a lost peer.

        Operations queued on them (a receive from a stopped rank, a kernel ordered after it)
        would otherwise never complete, and ``destroy_process_group`` at exit, or any
        device synchronisation in the user's error handling, would wait for them forever.
        The Pipeline cannot run another step after a failure anyway (its peers are
        stopping).  gloo's operations fail by themselves when a connection closes.
        """
        if self._backend != "nccl" or self._aborted:
            return
        self._aborted = True
        groups = [*self._tensors.pair_groups.values(), self._obj_group, self._header_group]
        if self._ep_groups is not None:
            groups += [g for g in (*(g for g, _ in self._ep_groups.stage_groups.values()), self._ep_groups.row, self._ep_groups.experts) if g is not None]
        abort_communicators(groups, world=self._owns_group)

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit there is nobody left to tell
            pass

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _check_step_inputs(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], target: Any, *, train: bool) -> None:
        """What is wrong with a step's inputs, said before any compute (every rank checks the same)."""
        if train and self.has_last_stage:
            last = self.schedule.num_stages - 1
            if self.loss_fn is None:
                raise PipelineConfigError(
                    f"rank {self.rank}: step() trains, and stage {last} (the last, on this rank) has no loss_fn: "
                    "build the Pipeline with loss_fn=..., or call eval() for a forward pass"
                )
            if target is None:
                raise PipelineConfigError(
                    f"rank {self.rank}: step() got no target, and stage {last} (the last, on this rank) needs one "
                    "for its loss_fn: pass step(..., target=y) (eval() runs without one)"
                )
        check_batch(args, kwargs, target, rank=self.rank, microbatches=self.num_microbatches)
        if self._ep_groups is not None and self.layout is not None and self.layout.dp > 1:
            self._check_ep_shares(args, kwargs, target)
        if train and len(set(self.schedule.stage_to_rank)) > 1:
            for name, v in kwargs.items():
                vals = v if isinstance(v, Microbatches) else [v.value if isinstance(v, Replicate) else v]
                if any(isinstance(t, torch.Tensor) and t.requires_grad for t in vals):
                    raise PipelineConfigError(
                        f"rank {self.rank}: keyword input {name!r} requires grad; every stage gets it, on every rank, so "
                        "each rank's copy would receive only the gradient of its own stages (not the sum over the "
                        "whole model). Compute it inside a stage (e.g. as a parameter of the stage that uses it), "
                        "pass it detached, or as a positional input of the first stage"
                    )

    def _check_ep_shares(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], target: Any) -> None:
        """Expert parallelism: every (dp, ep) column's microbatch ``j`` must have the same shape.

        The ep peers of a stage exchange their microbatch's tokens with all-to-alls of equal, fixed-capacity
        splits (``pipeloom.moe``: the capacity comes from the token count), so peers whose microbatches hold
        different numbers of tokens issue all-to-alls of different sizes: gloo ends the receiving process from
        C++ ("Received data size doesn't match expected size"), its peers see a process gone; on NCCL a wrong
        result or a hang.  A batch of 17 rows over 2 columns (9 and 8) did that.  Every rank gets the same
        global batch (the step's gather checks its rows), so every rank refuses it here, before any compute.
        """
        cols = self.layout.dp
        n = self.num_microbatches
        named = [*((f"positional input {i}", v) for i, v in enumerate(args)),
                 *((f"keyword input {k!r}", v) for k, v in kwargs.items()), ("target", target)]
        for what, v in named:
            if isinstance(v, Microbatches):
                if len(v) != n * cols:
                    continue  # (replica_share says what is wrong with it)
                for j in range(n):
                    shapes = [tuple(v[c * n + j].shape) if isinstance(v[c * n + j], torch.Tensor) else None for c in range(cols)]
                    if len(set(shapes)) > 1:
                        raise PipelineConfigError(
                            f"rank {self.rank}: {what}: microbatch {j} has shape {shapes[0]} in column 0 and "
                            f"{next(s for s in shapes if s != shapes[0])} in column {next(c for c, s in enumerate(shapes) if s != shapes[0])}; "
                            f"with expert parallelism every (dp, ep) column's microbatch {j} must have the same shape "
                            "(the ep peers' all-to-alls exchange equal splits, sized by the token count)"
                        )
            elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] % cols:
                parts = [t.shape[0] for t in torch.tensor_split(v, cols)]
                raise PipelineConfigError(
                    f"rank {self.rank}: {what} has {v.shape[0]} rows along dim 0, which the {cols} (dp, ep) columns of "
                    f"expert parallelism cannot share evenly ({parts} rows): the ep peers' microbatches would hold "
                    "different numbers of tokens, and their all-to-alls exchange equal splits sized by the token count; "
                    f"pass a multiple of {cols} rows"
                )

    def _stall_budget(self, train: bool) -> float:
        """Seconds an action of this step may run while peers wait: generous while torch.compile may compile.

        A step is cold when this rank has not yet run one with the same parameters (which, their
        ``requires_grad``, shapes), module modes (train/eval) and step kind: compiled code
        is (re)traced then.  Peers read the budget from this rank's heartbeats.
        """
        if self._fingerprint is None:
            self._fingerprint = ModelFingerprint(self.stages.values())
        fingerprint = (train, self._fingerprint.key())  # (cheap: runtime/fingerprint.py says what it can miss)
        #: (StepInputs.model_key: static shapes learn the transfers per model state too; a frozen stage's
        #: outputs need no gradient)
        self._model_key = hash(fingerprint[1]) & 0x7FFFFFFFFFFFFFFF
        if fingerprint in self._seen_fingerprints:
            return self.options.stall_timeout
        if len(self._seen_fingerprints) > 64:
            self._seen_fingerprints.clear()
        self._seen_fingerprints.add(fingerprint)
        return self.options.cold_stall_timeout

    def _run_sync(self, coro: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise RuntimeError("Pipeline.step()/eval() called inside a running event loop; use `await pipe.astep(...)`")
        if self._loop is None:
            self._loop = _new_loop()
        return self._loop.run_until_complete(coro)

    def _after_graphed_step(self, graphs: list[Any], train: bool) -> None:
        """RuntimeOptions.cuda_graphs, after a step that ended on this rank: its forwards replayed from graphs in
        the statistics; after a training step, capture the stages whose layout is known (between steps: the capture
        synchronizes the device, and within a step a posted receive may wait on a peer that waits on this rank)."""
        st = self._actor.statistics
        if st is not None:
            self._actor.statistics = dataclasses.replace(st, graphed_forwards=sum(g.replays_step for g in graphs))
        if not train or not any(g.wants_capture() for g in graphs):
            return
        for g in graphs:
            if g.wants_capture():
                t0, m0 = time.perf_counter(), torch.cuda.memory_reserved(self.device)
                g.capture()
                if g.slots:  # (the pools' memory is reserved, not allocated, between replays)
                    log.info("rank %d: stage %d captured as %d CUDA graph pairs in %.0f ms, %.1f MiB more reserved",
                             self.rank, g.stage, len(g.slots), (time.perf_counter() - t0) * 1e3,
                             (torch.cuda.memory_reserved(self.device) - m0) / 2**20)
        # the captured stages launch in one call: their host and device times are learned again
        self._actor.relearn()

    async def _arun(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, losses: list[Any] | None, *, train: bool,
                    return_outputs: bool = True) -> Any:
        if self._closed:
            raise RuntimeError("this Pipeline is closed")
        broken = pending_collective(self)
        if broken is not None:  # (runtime/training.py _collective: a training-loop collective left pending)
            raise PipelineError(
                f"rank {self.rank}: an earlier training-loop collective {broken}; a step after it would run beside a "
                "collective still pending on this rank and never called on a peer: close this Pipeline and restart "
                "the job from a checkpoint")
        if self._failed is not None:
            # A failed step is the Pipeline's last, on every rank: it left gradients accumulated for some
            # microbatches and not others, transfers and data-parallel collectives cut mid-step on some ranks
            # (one replica's all-reduce issued, its peer's not: the next step's would pair with it), and its
            # peers hold the abort.  A step after it waited forever for a peer that raised at once (the
            # failing rank, while its peers re-raised the old error), or ran on torn state: refused at once.
            step, exc = self._failed
            raise PipelineError(
                f"rank {self.rank}: this Pipeline's step {step} failed ({type(exc).__name__}: {exc}); a Pipeline "
                "runs no step after a failed one (that step left gradients partly accumulated and transfers and "
                "collectives cut mid-step): close it, and to go on restart the job from a checkpoint "
                "(pipeloom launch --max-restarts N starts the ranks again)"
            ) from exc
        loop = asyncio.get_running_loop()
        if self._bound_loop is not loop:
            # Sockets and events belong to one loop; re-attach if the caller switched loops.
            self._control.stop()
            self._actor._started = False
            self._bound_loop = loop
        step = self._actor.step_index
        try:
            self._check_step_inputs(args, kwargs, target, train=train)
            self._control.stall_budget = self._stall_budget(train)
            check = call_check(args, kwargs, target)  # (the global batch, before a replica takes its share)
            if self.layout is not None and self.layout.dp > 1:
                from .data_parallel import replica_share

                args, kwargs, target = replica_share(args, kwargs, target, dp=self.layout.dp, index=self.dp_rank, n=self.num_microbatches)
            inputs = split_microbatches(args, kwargs, target, self.num_microbatches, self.device)
            inputs.call_check = check
            inputs.model_key = self._model_key
            graphs = [ex.graphs for ex in self._executors.values() if ex.graphs is not None]
            for g in graphs:
                g.start_step()
            # (RuntimeOptions.tied_weights="sync": each tied copy's gradient taken aside, for the step's own to be
            # summed over the holding ranks once its backward work is complete: runtime/ties.py TiedCopies)
            ties = self._ties if train else None
            held = ties.take() if ties else None
            try:
                results, mb_losses = await self._actor.run_step(inputs, train=train, keep_outputs=return_outputs)
            except BaseException:
                if held is not None:
                    ties.restore(held)
                raise
            finally:
                if self._collectives is not None:
                    self._collectives.end_step()
                if self._trace_sink is not None and self._actor.trace is not None:
                    self._trace_sink.emit(self._actor.trace.drain())
            if held is not None:
                try:
                    ties.sync(held, synced=self._collectives is None or self._collectives.sync,
                              check=self._actor.error_between_steps,
                              limit=self._control.stall_budget + self.options.heartbeat_timeout)
                except BaseException:  # (a peer failed after its step's work: nothing summed, the gradients put back)
                    ties.restore(held)
                    raise
            if graphs:
                self._after_graphed_step(graphs, train)
            if train and self._sync_buffers:
                self._broadcast_buffers()
            self._last_losses = mb_losses
            if not self.has_last_stage:
                return None
            if losses is not None:
                losses.extend(mb_losses[m] for m in sorted(mb_losses))
            if not return_outputs:
                return None
            precut = any(isinstance(v, Microbatches) for v in (*args, *kwargs.values()))
            return _merge([results[m] for m in range(self.num_microbatches)], precut=precut)
        except (RemoteRankError, PeerLostError) as exc:
            self._failed = (step, exc)
            if isinstance(exc, PeerLostError):
                # Ranks that never talk to the lost peer (another replica, another stage)
                # hear the root cause now instead of finding this rank silent later.
                self._actor.broadcast_abort(exc, None, step)
            _report_root_cause(exc, remote=True)
            self._abort_nccl()
            raise
        except BaseException as exc:
            # Whatever failed here (an action, input splitting, merging), the
            # other ranks must hear of it now rather than wait for data.
            self._failed = (step, exc)
            self._actor.broadcast_abort(exc, None, step)
            _report_root_cause(exc, remote=False)
            self._abort_nccl()
            raise
