"""Ranks agree on the Pipeline they build, or every rank fails at construction.

The problem.  Every rank builds its own ``Pipeline`` from its own arguments.
If rank 0 asks for 4 microbatches and rank 1 for 8, or rank 0 for
Interleaved1F1B and rank 1 for ZBVZeroBubble, each rank's action list is
self-consistent, construction succeeds, and the first step waits forever for
transfers the peer will never send (heartbeats keep flowing, so no liveness
check fires).  Likewise a rank whose construction raises (a bad schedule file,
a ``stage_fn`` that fails) leaves its peers blocked in the next collective
until gloo reports "Connection closed by peer" on each of them, burying the
one error that matters.

What is done.  Construction has *checkpoints*; at each one every rank posts a
small record, either what it is about to build (:func:`config_record`: world
size, schedule name, microbatches, stage placement, data-parallel layout,
protocol version and a digest of every rank's lowered action list) or the
error that stopped it, and reads everybody else's.  Then every rank decides
the same thing from the same records:

- a peer posted an error: raise :class:`RemoteRankError` naming it (the peer
  raised its own error; here it is a consequence, reported as such);
- the records differ: raise :class:`PipelineConfigError` naming each field and
  every rank's setting (``num_microbatches differs: rank 0 has 4, rank 1 has 8``);
- a peer posted nothing within ``timeout``: raise :class:`PipelineConfigError`
  naming the ranks that never arrived.

Where the records go.  Alternatives: a collective (``all_gather_object``) on
the job's group blocks for the group's timeout (30 minutes on gloo) when a
peer never arrives, and cannot be polled; the control plane needs endpoints,
which themselves must be exchanged first.  The torch.distributed TCP store
that the job already rendezvoused through (MASTER_ADDR:MASTER_PORT, hosted by
global rank 0 under ``env://``, ``torchrun`` and ``pipeloom launch``) takes
keys from any client, can be polled, and bounds every wait; a client
connection costs about a millisecond.  Jobs initialised some other way (no
MASTER_ADDR/MASTER_PORT) fall back to ``all_gather_object``, unbounded.

Keys are ``pipeloom/setup/{n}/{checkpoint}/{rank}`` where ``n`` counts the
Pipelines this process built: every rank builds its Pipelines in the same
order, and every construction reaches each checkpoint (with a record or an
error), so the counts stay aligned.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .errors import PeerLostError, PipelineConfigError, RemoteRankError

__all__ = ["SetupAgreement", "config_record", "compare_records", "short_traceback"]

_BUILDS = itertools.count()
#: after an error, how long a rank waits for its peers to have read the records (so the
#: rank hosting the store does not take it away before they learn why)
_LINGER = 3.0
_PKG_DIRS = tuple(str(Path(__file__).resolve().parents[1] / d) for d in ("runtime", "transport", "schedules"))


def short_traceback(exc: BaseException, *, with_callers: bool = True, frames_only: bool = False) -> str:
    """The exception's traceback without pipeloom's own frames and without chained causes.

    What a user needs from a failed construction is the line of their script
    (or of their ``stage_fn``) and the error, not the setup's internals.  With
    ``with_callers`` the frames that called into pipeloom (the user's script,
    not yet in the traceback while the exception is being handled) come first.
    """
    frames = list(traceback.extract_stack()[:-1]) if with_callers else []
    frames += traceback.extract_tb(exc.__traceback__)
    frames = [f for f in frames if not f.filename.startswith(_PKG_DIRS)]
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)] if frames else []
    return "".join(lines if frames_only else lines + traceback.format_exception_only(type(exc), exc))


def _actions_digest(schedule: Any) -> str:
    text = "\n".join(f"{r}:" + ",".join(str(a) for a in schedule.actions[r]) for r in sorted(schedule.actions))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def config_record(
    *,
    world_size: int,
    schedule: Any,
    pp_size: int,
    data_parallel: int,
    fsdp: bool,
    mesh_grid: Any,
    scale_grads: bool,
    dp_options: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """What every rank must agree on, as a JSON-able record (field order = report order)."""
    from .. import __version__
    from ..transport.messages import PROTOCOL_VERSION

    rec: dict[str, Any] = {
        "protocol version": PROTOCOL_VERSION,
        "pipeloom version": __version__,
        "world size": world_size,
        "schedule": schedule.name,
        "num_microbatches": schedule.num_microbatches,
        "num_stages": schedule.num_stages,
        "stages_per_rank": schedule.num_stages // max(pp_size, 1),
        "stage placement": list(schedule.stage_to_rank),
        "data_parallel": data_parallel,
        "fsdp": fsdp,
        "mesh": mesh_grid,
        "scale_grads": scale_grads,
    }
    for k, v in (dp_options or {}).items():
        rec[k] = v
    # last: it differs whenever anything above does, so it is reported only on its own
    rec["schedule actions"] = _actions_digest(schedule)
    return rec


def _ranks(rs: Sequence[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(str(r) for r in rs)


def _show(v: Any) -> str:
    # (None is a setting of its own, e.g. static_shapes=None: auto; a field a rank's record lacks is "nothing")
    return "None" if v is None else json.dumps(v) if not isinstance(v, str) else v


_ABSENT = "\0absent"


def compare_records(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per field on which the ranks differ (``num_microbatches differs: rank 0 has 4, rank 1 has 8``)."""
    fields = [k for k in dict.fromkeys(k for rec in records for k in rec) if not k.startswith("_")]
    out = []
    for name in fields:
        groups: dict[str, list[int]] = {}
        for r, rec in enumerate(records):
            groups.setdefault(json.dumps(rec[name], sort_keys=True) if name in rec else _ABSENT, []).append(r)
        if len(groups) < 2:
            continue
        if name == "schedule actions" and out:
            continue  # implied by the differences already named
        parts = []
        for value, rs in groups.items():
            verb = "has" if len(rs) == 1 else "have"
            parts.append(f"{_ranks(rs)} {verb} {'nothing' if value == _ABSENT else _show(json.loads(value))}")
        out.append(f"{name} differs: " + ", ".join(parts))
    return out


def secret_field() -> str:
    """The settings record's view of ``PIPELOOM_JOB_SECRET`` (every rank must see the same).

    A rank that has none takes rank 0's from a broadcast at construction, while a rank that has one
    skips that broadcast: ranks that differ here would pair that broadcast with the next collective
    (a hang), and ranks with different secrets drop each other's control messages as forged (a
    peer's heartbeats and aborts never count, so it is named lost after the heartbeat timeout).
    The secret itself is never posted, only a digest of it.
    """
    secret = os.environ.get("PIPELOOM_JOB_SECRET")
    if not secret:
        return "unset (rank 0 draws one and shares it)"
    return "set (digest " + hashlib.sha256(b"pipeloom job secret\0" + secret.encode()).hexdigest()[:12] + ")"


def check_heartbeats(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each rank's heartbeat interval against every rank's heartbeat timeout (``_heartbeat``: [interval, timeout]).

    A rank declares a peer lost after ``heartbeat_timeout`` of its own without a message from it; a
    peer that sends heartbeats less often than that is named lost while it is alive and well.
    Refused where an interval exceeds half a timeout (one late heartbeat would do it).
    """
    beats = [(r, rec["_heartbeat"]) for r, rec in enumerate(records) if rec.get("_heartbeat")]
    if not beats:
        return []
    r_int, (interval, _) = max(beats, key=lambda b: b[1][0])
    r_to, (_, timeout) = min(beats, key=lambda b: b[1][1])
    if interval * 2 <= timeout:
        return []
    who = f"rank {r_int}'s" if len(records) > 1 else "the"
    whose = f"rank {r_to}'s" if len(records) > 1 else "the"
    return [f"{who} heartbeat_interval ({interval:g} s) exceeds half of {whose} heartbeat_timeout ({timeout:g} s): a "
            "rank alive and well would be named lost between two heartbeats; every rank's heartbeat_interval must be "
            "at most half of every rank's heartbeat_timeout"]


#: parameters and buffers listed per stage in the construction record (beyond: the digest alone)
_MAX_LISTED = 2000


def stage_tensors(modules: Mapping[int, Any]) -> dict[str, Any]:
    """Per stage held here: its parameters' and buffers' names, shapes and dtypes, in the order a replica's
    broadcast at construction pairs them (``data_parallel.sync_module_states``), and a digest of the list."""
    from .data_parallel import refuse_lazy

    out: dict[str, Any] = {}
    for s, m in modules.items():
        refuse_lazy(m, f"stage {s}", "data parallelism (its parameters are broadcast or sharded over the replicas)")
        ents = [[n, list(t.shape), str(t.dtype).removeprefix("torch.")]
                for n, t in [*m.named_parameters(), *m.named_buffers()]]
        # Submodules whose non-tensor settings must agree too (``pipeloom.moe.MoE``: the ep peers of a stage
        # exchange all-to-alls sized by top_k and the capacity factor; peers that differ sent splits of other
        # sizes, and gloo ended the receiving process from C++; replicas without ep ran another model silently)
        for n, sub in m.named_modules():
            settings = getattr(sub, "replica_settings", None)
            if callable(settings):
                ents.append([n or "(the stage)", settings(), type(sub).__name__])
        digest = hashlib.sha256(json.dumps(ents).encode()).hexdigest()[:16]
        out[str(s)] = {"digest": digest, "tensors": ents[:_MAX_LISTED]}
    return out


def check_stage_replicas(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Ranks that hold the same stage (data-parallel replicas, expert-parallel peers) must hold the same tensors.

    Construction broadcasts replica 0's parameters and buffers to the others, tensor by tensor: a
    shape that differs ends the process inside gloo (C++ ``terminate``, which its peers see only as a
    process gone), and a dtype that differs copies raw bytes into the wrong type, silently.
    """
    held: dict[str, list[tuple[int, Any]]] = {}
    for r, rec in enumerate(records):
        for s, ent in (rec.get("_stages") or {}).items():
            held.setdefault(s, []).append((r, ent))
    out = []
    for s, ents in sorted(held.items(), key=lambda kv: int(kv[0])):
        (r0, e0), *rest = ents
        for r, e in rest:
            if e["digest"] == e0["digest"]:
                continue
            a, b = e0["tensors"], e["tensors"]
            show = lambda t: f"{t[0]} {t[2]}{t[1]}"  # noqa: E731
            diff = next((f"rank {r0} has {show(x)}, rank {r} has {show(y)}" for x, y in zip(a, b) if x != y), None)
            if diff is None:
                diff = (f"rank {r0} has {len(a)} tensors, rank {r} has {len(b)}" if len(a) != len(b)
                        else f"digests {e0['digest']} and {e['digest']}")
            out.append(f"stage {s} differs between the ranks that hold it (data-parallel replicas start from "
                       f"replica 0's parameters and buffers, which needs the same names, shapes and dtypes; "
                       f"expert-parallel peers exchange tokens sized by their MoE settings): {diff}")
            break
    return out


def agent_attempt_store(store: Any) -> Any:
    """``store`` (a client of the job's store at MASTER_ADDR:MASTER_PORT) under the key prefix of this launch
    attempt where torchrun's agent serves it (``TORCHELASTIC_USE_AGENT_STORE``): that store outlives an attempt,
    and a restarted rank read the failed attempt's keys (torchrun's own env:// rendezvous uses this prefix).
    Elsewhere each attempt's rank 0 serves a new store: ``store`` as it is."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return store
    return dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


class SetupAgreement:
    """Checkpoints of one Pipeline's construction, shared by every rank through the job's store."""

    def __init__(self, rank: int, world_size: int, *, timeout: float) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._prefix = f"pipeloom/setup/{next(_BUILDS)}"
        self._store: Any = None
        #: ranks whose process is known to be gone (set once the ranks' pids are known), so a
        #: peer killed while building is named at once instead of after ``timeout``
        self.dead_peers: Callable[[], Sequence[int]] | None = None
        #: rank -> (host, pid), for the message naming a dead peer
        self.procs: Sequence[Sequence[Any]] | None = None
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world_size > 1 and addr and port:
            try:
                # (connecting to a store that runs takes milliseconds: a long wait here means a wrong address)
                self._store = agent_attempt_store(dist.TCPStore(addr, int(port), is_master=False,
                                                                timeout=timedelta(seconds=max(min(timeout, 30.0), 1.0))))
            except Exception as exc:  # noqa: BLE001 - say where, not how
                raise PipelineConfigError(
                    f"rank {rank}: cannot reach the job's torch.distributed store at {addr}:{port} to check that "
                    f"every rank builds the same Pipeline ({type(exc).__name__}: {exc})"
                ) from None

    def close(self) -> None:
        self._store = None

    # ---------------------------------------------------------------- checkpoints
    def agree(self, checkpoint: str, record: Mapping[str, Any] | None,
              check: Callable[[list[dict[str, Any]]], list[str]] | None = None, *,
              refuse: Callable[[list[dict[str, Any]]], list[str]] | None = None) -> list[dict[str, Any]]:
        """Post this rank's record, read every rank's, raise if any failed or differs; return them (by rank).

        Fields whose name starts with ``_`` ride along without being compared (a rank's pid).
        ``check(records)``: more problems (one sentence each) found in every rank's records, reported
        as the differences are (every rank decides from the same records, so every rank raises them).
        ``refuse(records)``: the same for problems of what the ranks built together rather than differences
        between them (a weight tied across ranks), reported without the "built different Pipelines" preamble.
        """
        records = self._exchange(checkpoint, {"ok": dict(record or {})})
        failed = [(r, rec) for r, rec in enumerate(records) if "error" in rec]
        if failed:
            r, rec = failed[0]
            self._done(checkpoint, linger=True)
            raise RemoteRankError(
                rank=self.rank, failed_rank=r, step=None, stage=None, microbatch=None,
                action=None, error=f"while building its Pipeline: {rec['error']}", remote_traceback=rec.get("traceback", ""),
            )
        diffs = compare_records([rec["ok"] for rec in records])
        if check is not None:
            diffs += check([rec["ok"] for rec in records])
        if diffs:
            self._done(checkpoint, linger=True)
            raise PipelineConfigError(
                f"rank {self.rank}: the ranks built different Pipelines (every rank must pass the same settings): "
                + "; ".join(diffs)
            )
        problems = refuse([rec["ok"] for rec in records]) if refuse is not None else []
        if problems:
            self._done(checkpoint, linger=True)
            raise PipelineConfigError(f"rank {self.rank}: " + "; ".join(problems))
        self._done(checkpoint, linger=False)
        return [rec["ok"] for rec in records]

    def fail(self, checkpoint: str, exc: BaseException) -> None:
        """Tell the peers that this rank's construction failed at ``checkpoint`` (best effort, bounded)."""
        rec = {"error": f"{type(exc).__name__}: {exc}"[:20000], "traceback": short_traceback(exc)[-20000:]}
        try:
            if self._store is not None:
                self._store.set(self._key(checkpoint, self.rank), json.dumps(rec))
                self._done(checkpoint, linger=True)
            # (without a store the peers learn it from the collective failing)
        except Exception:  # noqa: BLE001 - the local error is what matters
            pass

    # ---------------------------------------------------------------- internals
    def _key(self, checkpoint: str, rank: int, what: str = "rec") -> str:
        return f"{self._prefix}/{checkpoint}/{what}/{rank}"

    def _exchange(self, checkpoint: str, mine: dict[str, Any]) -> list[dict[str, Any]]:
        if self.world_size == 1:
            return [mine]
        if self._store is None:
            out: list[Any] = [None] * self.world_size
            dist.all_gather_object(out, mine)
            return out
        store = self._store
        store.set(self._key(checkpoint, self.rank), json.dumps(mine))
        got: dict[int, dict[str, Any]] = {self.rank: mine}
        deadline = time.monotonic() + self.timeout
        next_probe = time.monotonic() + 0.25
        pause = 0.002
        while True:
            for r in range(self.world_size):
                if r in got:
                    continue
                key = self._key(checkpoint, r)
                try:
                    if store.check([key]):
                        got[r] = json.loads(store.get(key))
                except Exception as exc:  # noqa: BLE001 - the store went away: its host exited
                    raise PipelineConfigError(
                        f"rank {self.rank}: lost the job's torch.distributed store while waiting for rank {r} to build "
                        f"its Pipeline ({type(exc).__name__}: {exc}); the rank hosting it (rank 0) has exited, "
                        "probably because its own construction failed"
                    ) from None
                if "error" in got.get(r, {}):
                    return [got.get(i, {"ok": {}}) for i in range(self.world_size)]
            if len(got) == self.world_size:
                return [got[i] for i in range(self.world_size)]
            if self.dead_peers is not None and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + 0.25
                dead = [r for r in self.dead_peers() if r not in got]
                if dead:
                    where = f" (pid {self.procs[dead[0]][1]} on {self.procs[dead[0]][0]})" if self.procs else ""
                    also = f" (also gone: ranks {', '.join(map(str, dead[1:]))})" if len(dead) > 1 else ""
                    raise PeerLostError(
                        f"waiting for it at a construction checkpoint ({checkpoint}) while building the Pipeline "
                        f"failed: its process{where} is gone{also}",
                        rank=self.rank, peer=dead[0],
                    )
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if r not in got]
                raise PipelineConfigError(
                    f"rank {self.rank}: {_ranks(missing)} did not reach the same point of building the Pipeline "
                    f"({checkpoint}) within setup_timeout={self.timeout:g} s: every rank must construct the "
                    "same Pipelines in the same order (is that rank still busy elsewhere, or stuck?)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _done(self, checkpoint: str, *, linger: bool) -> None:
        """Mark this checkpoint read; on a failure, wait (bounded) until the peers have read it too."""
        store = self._store
        if store is None:
            return
        try:
            store.set(self._key(checkpoint, self.rank, "read"), b"1")
            if not linger:
                return
            end = time.monotonic() + min(_LINGER, self.timeout)
            while time.monotonic() < end:
                if all(store.check([self._key(checkpoint, r, "read")]) for r in range(self.world_size)):
                    return
                time.sleep(0.01)
        except Exception:  # noqa: BLE001 - only the orderly teardown is at stake
            pass
