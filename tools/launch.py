"""``pipeloom launch``: start the ranks of a training script on one node.

Why a launcher of our own
-------------------------
``torchrun`` starts ranks well, but what it does when one of them fails is the
part that matters most for pipeline parallelism, and there it falls short: a
rank that raises leaves the others blocked in a collective until the NCCL
watchdog (ten minutes) or gloo's "Connection reset by peer" ends them; every
rank then prints a traceback, and the one that explains the failure is buried
among the consequences; the exit status does not say whether the code or the
machine failed.  pipeloom's runtime broadcasts an abort within seconds, so the
launcher's job is to make that visible and bounded:

* every rank runs in its own session (``start_new_session``), so the rank and
  whatever it forked (data-loader workers, compile workers) are killed together
  with :func:`os.killpg`;
* after the first failure the others get ``--grace`` seconds to stop by
  themselves (they normally do, having received the abort), then SIGTERM, then
  SIGKILL one second later (a stopped process, which would not act on
  SIGTERM, gets SIGKILL at once): the launcher exits within about ``grace + 1``
  seconds of the first failure, whatever the ranks do.  The first failure is
  the first unsuccessful exit *or* the first root-cause line (below),
  whichever comes first: a rank that reported can still hang on its way out
  (on NCCL, in a communicator that waits for a dead or stopped peer), and it
  is killed on the same clock as the others;
* one summary names the rank that failed first and, if it reported one, its
  root cause (stage, microbatch, action, error, traceback); ranks that stopped
  because of it are listed in one line, not with their own tracebacks;
* the exit status says what kind of failure it was (below);
* on Linux every rank also gets ``PR_SET_PDEATHSIG=SIGKILL``, so not even a
  SIGKILL of the launcher leaves a rank running, and a watchdog process
  (:class:`_Watchdog`) then kills the ranks' process groups, so nothing a
  rank started runs on either.

Alternatives considered: torch's elastic agent (imports torch at start-up,
its failure summary is per-rank, and its teardown waits 30 s for a rank that
ignores SIGTERM; we take its restart semantics, below), a thread per
pipe (works, but the exits, pipes, timers and signals are easiest to order on
one asyncio loop: a rank's exit, its output and SIGINT all arrive as callbacks
in one thread, so there are no locks).  The launcher imports torch only for a
rendezvous (:mod:`pipeloom.tools.rendezvous`) and to count GPUs for ``--nproc-per-node auto``.

Output
------
Each line a rank writes is echoed with a ``[rank{R}]: `` prefix (torchrun's
style; ``--no-prefix`` turns it off; torchrun's
``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` replaces it), stdout to stdout and stderr to stderr.
Pipes are read as data arrives, so a chatty rank never blocks; a last line
without a newline is flushed when the pipe closes.  ``--log-dir DIR``
additionally writes each rank's raw stdout and stderr, unprefixed and
interleaved by line, to ``DIR/rank{R}.log`` (``R`` is the global rank, so the
nodes of one job may share DIR).  Ranks read standard input from /dev/null.

Environment of every rank
-------------------------
What torchrun sets, so that a script runs the same under either launcher:
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``
(node rank), ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``,
``ROLE_NAME`` (``--role``), ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``,
``TORCHELASTIC_RUN_ID`` (``--rdzv-id``, default ``none``),
``TORCHELASTIC_SIGNALS_TO_HANDLE`` (``--signals-to-handle``),
``TORCHELASTIC_ERROR_FILE`` (one per rank and attempt: torch's ``@record``
writes the exception there, and the launcher reads it for the summary when the
rank wrote no root-cause line; a launcher given a ``TORCHELASTIC_ERROR_FILE``
of its own copies the root-cause rank's there when the job fails, as
torchrun's ``@record`` does), and ``OMP_NUM_THREADS=1`` when several ranks
share the node and it is not set already.  ``TORCHELASTIC_USE_AGENT_STORE`` is
*not* set: there is no agent store, and the rank-0 process creates the TCP
store as with plain ``env://``.  Then pipeloom's own, none of which a script
may *require*:

* ``PIPELOOM_LAUNCHER=1``;
* ``PIPELOOM_JOB_SECRET``: random hex shared by all ranks of the job (taken
  from the launcher's environment when set there; see multi-node below);
* ``PIPELOOM_BACKEND`` (``--backend``), ``PIPELOOM_TRACE`` (``--trace``, an
  absolute path), ``PIPELOOM_HEARTBEAT_TIMEOUT`` (``--heartbeat-timeout``,
  seconds), ``PIPELOOM_STALL_TIMEOUT`` (``--stall-timeout``, seconds),
  ``PIPELOOM_FIRST_STEP_STALL_TIMEOUT`` (``--first-step-stall-timeout``),
  ``PIPELOOM_CUDA_GRAPHS=1`` (``--cuda-graphs``): only when the flag is given;
* ``PIPELOOM_TRACE_ENDPOINT``: with ``--trace``, where ranks stream their
  trace events (see Tracing below).

Tracing
-------
With ``--trace FILE`` the launcher runs a collector
(:mod:`pipeloom.tools.trace_collector`): it binds a ZeroMQ PULL socket on
127.0.0.1 at a free port, exports it as ``PIPELOOM_TRACE_ENDPOINT`` (ranks
that see it stream signed batches instead of writing files), writes ONE file
for the job and republishes every batch live.  It prints, once::

    pipeloom: trace -> FILE (live: tcp://127.0.0.1:PORT)

and writes the live address into FILE's header, so ``pipeloom trace attach
--file FILE`` follows the job.  After the ranks exit, batches still queued are
drained for at most a second.  With several nodes each launcher collects its
own ranks into ``FILE.node{N}`` (``pipeloom trace`` merges the files).
Without a job secret (multi-node without ``PIPELOOM_JOB_SECRET``) frames
cannot be verified, so there is no collector: each rank writes
``FILE.rank{R}`` itself, as under torchrun.

Root-cause protocol
-------------------
A rank that fails may write, on its **stderr**, one line of the form::

    PIPELOOM_ROOT_CAUSE {"rank": 1, "stage": 2, "microbatch": 3, "action": "2B3",
                         "error": "ValueError: boom", "traceback": "Traceback ...",
                         "remote": false}

(all on one line: the JSON escapes the newlines of the traceback; the line must
start at the beginning of a line, at most 1 MiB).  Every field is optional and
unknown fields are ignored.  ``"remote": true`` marks a rank that stops
*because another rank failed* (it may name that rank in ``"failed_rank"``).
``"phase": "construction"`` (a Pipeline that could not be built: nothing to
place it by stage or action) puts the error on the summary's root-cause line.
The launcher removes these lines from the echoed output (the log file keeps
them), keeps the first one of each rank, and prints the one of the root-cause
rank once.  A line that is not a JSON object is echoed like any other.

Which rank is the root cause: the first rank to exit unsuccessfully whose
report is not ``remote``, so a rank that reacts to an abort faster than the
failing rank can exit is not blamed; if every report is ``remote`` and names
a rank of this node (one that stalled or was stopped, which the launcher then
terminated), that rank, with the report that blames it; without reports,
simply the first rank to exit unsuccessfully.  A rank that reported its own failure and exited 0 (its script
caught the failed step's error) is the root cause all the same, and the job exits 1: the report ended it.
Every other rank that ended
unsuccessfully (including those the launcher had to terminate) is listed once
as a consequence.

Exit status
-----------
* 0 -- every rank exited with status 0;
* 1 -- a rank's code failed: the root-cause rank exited with a non-zero status;
* 2 -- the launcher could not do its job: bad arguments, script not found, a
  rank that could not be started;
* 3 -- infrastructure: the root-cause rank was killed by a signal the launcher
  did not send (SIGKILL from the OOM killer, SIGSEGV, ...);
* 130 / 143 (/ 129 / 131) -- the launcher received SIGINT / SIGTERM (/ SIGHUP /
  SIGQUIT): it sent every rank's process group SIGINT for a SIGINT (as torchrun
  forwards the signal it got: a script's ``except KeyboardInterrupt`` and
  ``finally`` run, as on Ctrl-C under torchrun or plain python) and SIGTERM
  for the others, SIGKILL after ``--grace`` seconds (at once on a second
  signal), and exits with 128 + the signal.  Other signals named by torchrun's
  ``--signals-to-handle`` (SIGUSR1, SIGUSR2: SLURM's warning before a time
  limit) are handled the same way and reach the ranks as they are.

Restarts
--------
``--max-restarts N`` is torchrun's: after a failed attempt (the bounded
teardown above, then the summary, headed ``attempt K failed`` instead of
``job failed``) every rank of the node is started again, with
``TORCHELASTIC_RESTART_COUNT`` = K + 1 (``TORCHELASTIC_MAX_RESTARTS`` = N), at
most N times; the job's exit status is that of the last attempt.  Resuming is
the script's business, from its own checkpoints, as under torchrun.  A
signal to the launcher never restarts.  On a single node with no
``--master-port``, each attempt gets a fresh port (the old store's port may
linger).  With ``--log-dir``, attempt K > 0 writes ``rank{R}.restart{K}.log``.
With several nodes and a static ``--master-addr``, each launcher restarts its
own ranks (a failure elsewhere fails them too, so they restart together).

Rendezvous
----------
``--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID`` (and
``--nnodes MIN:MAX``, ``--rdzv-conf``, ``--local-addr``) meet the other
launchers through torch's own rendezvous (:mod:`pipeloom.tools.rendezvous`,
which imports torch; nothing else here does): node ranks, the global ranks
of each node, global rank 0's address and the job secret come from it, and
the launchers watch each other through its store every ``--monitor-interval``
seconds, so a failure (or a restart) on any node ends (or restarts) every
node's attempt.

Multi-node
----------
Run one launcher per node with the same ``--nnodes``, ``--nproc-per-node``,
``--master-addr`` and ``--master-port`` and each node's ``--node-rank``::

    node0$ pipeloom launch --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr host0 --master-port 29500 train.py
    node1$ pipeloom launch --nnodes 2 --node-rank 1 --nproc-per-node 4 --master-addr host0 --master-port 29500 train.py

Ranks are ``node_rank * nproc_per_node + local_rank`` of ``nnodes *
nproc_per_node``.  The launchers do not talk to each other: the rendezvous is
torch.distributed's TCP store on MASTER_ADDR:MASTER_PORT, created by global
rank 0 as with ``env://``.  Each launcher supervises only its own node's ranks;
a failure elsewhere reaches them through the runtime's abort (or
torch.distributed's own errors), after which they exit and their launcher
reports them as consequences.  Export the same ``PIPELOOM_JOB_SECRET`` on every
node (e.g. ``export PIPELOOM_JOB_SECRET=$(openssl rand -hex 16)`` once, shared
by your job scheduler): a launcher cannot hand a secret to the other nodes, so
without it a multi-node job runs with no job secret at all (as under torchrun)
and each launcher warns once.  Several "nodes" may be launchers on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import string
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from .rendezvous import RendezvousConfig, free_port, parse_nnodes, parse_rdzv_conf

__all__ = [
    "EXIT_OK",
    "EXIT_RANK_FAILED",
    "EXIT_USAGE",
    "EXIT_INFRA",
    "ROOT_CAUSE_PREFIX",
    "LaunchConfig",
    "RootCause",
    "parse_root_cause_line",
    "rank_environment",
    "config_from_args",
    "launch",
    "launch_async",
    "add_parser",
]

EXIT_OK = 0
"""Every rank exited with status 0."""
EXIT_RANK_FAILED = 1
"""The root-cause rank exited with a non-zero status (user code failed)."""
EXIT_USAGE = 2
"""The launcher could not do its job (arguments, missing script, spawn failure)."""
EXIT_INFRA = 3
"""The root-cause rank was killed by a signal the launcher did not send."""

ROOT_CAUSE_PREFIX = "PIPELOOM_ROOT_CAUSE "
"""Start of a root-cause line on a rank's stderr; a JSON object follows."""

_ROOT_CAUSE_PREFIX_B = ROOT_CAUSE_PREFIX.encode()
_MAX_LINE = 1 << 20  # longer "lines" are echoed in pieces
_KILL_AFTER_TERM = 1.0  # seconds between SIGTERM and SIGKILL after a failure
_GIVE_UP_AFTER_KILL = 5.0  # a process in uninterruptible sleep: stop waiting
_PIPE_DRAIN = 0.5  # seconds to wait for a dead rank's pipes to close
_DEFAULT_MULTINODE_PORT = 29500
_PR_SET_PDEATHSIG = 1
_EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # always handled
_DEFAULT_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's --signals-to-handle default


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """One node's share of a job: what to run and how to supervise it."""

    command: tuple[str, ...]
    """The argv of every rank, e.g. ``(sys.executable, "-u", "train.py", "--lr", "0.1")``."""
    nproc_per_node: int = 1
    """Ranks started by this launcher."""
    nnodes: int = 1
    """Nodes (launchers) in the job."""
    node_rank: int = 0
    """This node's index in ``range(nnodes)``; global rank = node_rank * nproc_per_node + local rank."""
    master_addr: str = "127.0.0.1"
    """Host of the torch.distributed TCP store (global rank 0's machine)."""
    master_port: int = _DEFAULT_MULTINODE_PORT
    """Port of the torch.distributed TCP store."""
    job_secret: str | None = None
    """``PIPELOOM_JOB_SECRET`` for every rank; None leaves it unset."""
    backend: str | None = None
    """``PIPELOOM_BACKEND`` (``gloo`` or ``nccl``); None: the runtime chooses."""
    trace: str | None = None
    """``PIPELOOM_TRACE``: the job's trace file (written by the collector, or per rank without one)."""
    trace_endpoint: str | None = None
    """``PIPELOOM_TRACE_ENDPOINT``: the collector's address; set by the launcher once it has bound it."""
    heartbeat_timeout: float | None = None
    """``PIPELOOM_HEARTBEAT_TIMEOUT``, seconds without a heartbeat before a peer counts as lost."""
    stall_timeout: float | None = None
    """``PIPELOOM_STALL_TIMEOUT``, seconds a peer may stay busy in one action while others wait for it."""
    first_step_stall_timeout: float | None = None
    """``PIPELOOM_FIRST_STEP_STALL_TIMEOUT``: the same for a cold step (the first, or after the model changed: compiling)."""
    cuda_graphs: bool = False
    """``PIPELOOM_CUDA_GRAPHS=1``: the ranks' Pipelines replay their stages from CUDA graphs (``RuntimeOptions.cuda_graphs``)."""
    grace: float = 2.0
    """Seconds the other ranks get to exit by themselves after the first failure (or a signal)."""
    shutdown_timeout: float | None = None
    """torchrun's ``--shutdown-timeout``: seconds from the launcher's SIGTERM (SIGINT) to SIGKILL, for ranks
    that save something on the way out; None: 1 s after a failure, ``grace`` after a signal."""
    log_dir: Path | None = None
    """If set, each rank's raw output also goes to ``log_dir/rank{R}.log``."""
    prefix: bool = True
    prefix_template: str | None = None
    """torchrun's ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` (``${role_name}``, ``${rank}``, ``${local_rank}``): the
    prefix instead of ``[rank{R}]: ``."""
    """Prefix echoed lines with ``[rank{R}]: ``."""
    console_local_ranks: frozenset[int] | None = None
    """Local ranks whose output is echoed (None: all); log files always get everything."""
    max_restarts: int = 0
    """After a failure, stop every rank and start them all again, at most this many times (torchrun's ``--max-restarts``)."""
    restart_count: int = 0
    """Which attempt this is (0: the first); ranks see it as ``TORCHELASTIC_RESTART_COUNT``."""
    fresh_port_per_restart: bool = False
    """The launcher chose ``master_port`` itself: take a new free port at each restart (the old one may linger)."""
    rdzv: RendezvousConfig | None = None
    """Meet the other nodes through torch's rendezvous (``--rdzv-backend c10d``); None: static ``--node-rank``."""
    run_id: str = "none"
    """``TORCHELASTIC_RUN_ID`` of the ranks (``--rdzv-id``; torchrun's default is ``none``)."""
    rank_offset: int | None = None
    """Global rank of local rank 0, when a rendezvous assigned it (None: ``node_rank * nproc_per_node``)."""
    total_world_size: int | None = None
    """Ranks in the job, when a rendezvous assigned it (None: ``nnodes * nproc_per_node``)."""
    role: str = "default"
    """``ROLE_NAME`` of the ranks (torchrun's ``--role``)."""
    virtual_local_rank: bool = False
    """torchrun's ``--virtual-local-rank``: every rank sees ``LOCAL_RANK=0`` and only its own GPU, as
    ``CUDA_VISIBLE_DEVICES`` (the launcher's list, indexed by local rank; else the local rank)."""
    quiet_streams: Mapping[int, int] = field(default_factory=dict)
    """Local rank -> streams (1 stdout, 2 stderr, 3 both) not echoed to the console (``--redirects``)."""
    error_dir: Path | None = None
    """Where each rank's ``TORCHELASTIC_ERROR_FILE`` goes (``error{R}.json``); None: no error files."""
    monitor_interval: float = 0.5
    """Seconds between checks of the other nodes' state through the rendezvous (``--monitor-interval``)."""
    signals: tuple[int, ...] = _EXIT_SIGNALS
    """Signals that stop the job (torchrun's ``--signals-to-handle``, plus SIGINT, SIGTERM, SIGHUP and SIGQUIT
    always): SIGINT reaches the ranks as SIGINT, SIGTERM/SIGHUP/SIGQUIT as SIGTERM, any other (SIGUSR1, SIGUSR2: a
    SLURM job's warning before its time limit) as itself, as torchrun forwards it; SIGKILL follows."""
    signals_to_handle: str = _DEFAULT_SIGNALS_TO_HANDLE
    """The ranks' ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (torchrun's agent exports its ``--signals-to-handle``)."""
    parent_error_file: str | None = None
    """The launcher's own ``TORCHELASTIC_ERROR_FILE`` (a scheduler's, e.g. TorchX's): a failed job's root cause is
    written there, as torchrun's ``@record`` copies the root-cause rank's error file into it."""
    cpu_bind: str = "none"
    """Which CPUs each rank runs on (``--cpu-bind``; ``pipeloom.affinity.POLICIES``): ``none`` (the OS decides),
    ``slice`` (each local rank its own equal share of whole cores), ``node`` or ``socket`` (a NUMA node or socket per
    group of consecutive local ranks).  Set between fork and exec, so every thread of the rank inherits it."""

    @property
    def world_size(self) -> int:
        return self.total_world_size if self.total_world_size is not None else self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        base = self.rank_offset if self.rank_offset is not None else self.node_rank * self.nproc_per_node
        return base + local_rank

    def error_file(self, local_rank: int) -> Path | None:
        """The ``TORCHELASTIC_ERROR_FILE`` of a rank in this attempt."""
        if self.error_dir is None:
            return None
        return self.error_dir / f"attempt{self.restart_count}" / f"error{self.global_rank(local_rank)}.json"


def rank_environment(config: LaunchConfig, local_rank: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one rank: ``base`` (default: ours) plus what torchrun sets plus pipeloom's own."""
    env = dict(os.environ if base is None else base)
    # Inherited from an enclosing torchrun, this would make rank 0 wait for a store nobody creates.
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    rank = config.global_rank(local_rank)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(config.world_size),
        LOCAL_WORLD_SIZE=str(config.nproc_per_node),
        GROUP_RANK=str(config.node_rank),
        GROUP_WORLD_SIZE=str(config.nnodes),
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(config.world_size),
        ROLE_NAME=config.role,
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(config.master_port),
        TORCHELASTIC_RESTART_COUNT=str(config.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(config.max_restarts),
        TORCHELASTIC_RUN_ID=config.run_id,
        TORCHELASTIC_SIGNALS_TO_HANDLE=config.signals_to_handle,
        PIPELOOM_LAUNCHER="1",
    )
    if config.virtual_local_rank:  # as torchrun's agent does it
        env["LOCAL_RANK"] = "0"
        parent = env.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = parent.split(",")[local_rank].strip() if parent is not None else str(local_rank)
    error_file = config.error_file(local_rank)
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    else:
        env.pop("TORCHELASTIC_ERROR_FILE", None)  # an outer launcher's file is not this rank's
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: N ranks x all cores each would oversubscribe
    if config.trace is not None and config.trace_endpoint is None:
        env.pop("PIPELOOM_TRACE_ENDPOINT", None)  # inherited from an outer launcher: write our own files
    optional = {
        "PIPELOOM_JOB_SECRET": config.job_secret,
        "PIPELOOM_BACKEND": config.backend,
        "PIPELOOM_TRACE": config.trace,
        "PIPELOOM_TRACE_ENDPOINT": config.trace_endpoint,
        "PIPELOOM_HEARTBEAT_TIMEOUT": None if config.heartbeat_timeout is None else repr(config.heartbeat_timeout),
        "PIPELOOM_STALL_TIMEOUT": None if config.stall_timeout is None else repr(config.stall_timeout),
        "PIPELOOM_FIRST_STEP_STALL_TIMEOUT": (
            None if config.first_step_stall_timeout is None else repr(config.first_step_stall_timeout)
        ),
        "PIPELOOM_CUDA_GRAPHS": "1" if config.cuda_graphs else None,
        # the rank is bound already (pipeloom.affinity.bind_this_process then leaves its mask alone)
        "PIPELOOM_CPU_BIND": None if config.cpu_bind == "none" else config.cpu_bind,
    }
    for key, value in optional.items():
        if value is not None:
            env[key] = value
    return env


# ---------------------------------------------------------------- root cause


@dataclass(frozen=True)
class RootCause:
    """A rank's own account of why it failed (the JSON of a ``PIPELOOM_ROOT_CAUSE`` line)."""

    rank: int | None = None
    stage: int | None = None
    microbatch: int | None = None
    action: str | None = None
    error: str | None = None
    traceback: str | None = None
    remote: bool = False
    """True when the rank stopped because another rank failed."""
    failed_rank: int | None = None
    """With ``remote``: the rank it blames."""
    fields: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The whole JSON object, unknown fields included."""

    def where(self, default_rank: int) -> str:
        parts = [f"rank {self.rank if self.rank is not None else default_rank}"]
        for name, value in (("stage", self.stage), ("microbatch", self.microbatch), ("action", self.action)):
            if value is not None:
                parts.append(f"{name} {value}")
        return ", ".join(parts)


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _opt_str(value: object) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value)


def parse_root_cause_line(line: bytes | str) -> RootCause | None:
    """Parse one ``PIPELOOM_ROOT_CAUSE {...}`` line; None if it is not one (then it is ordinary output)."""
    if isinstance(line, str):
        line = line.encode("utf-8", "replace")
    if not line.startswith(_ROOT_CAUSE_PREFIX_B) or len(line) > _MAX_LINE:
        return None
    try:
        obj = json.loads(line[len(_ROOT_CAUSE_PREFIX_B) :].decode("utf-8", "replace"))
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    return RootCause(
        rank=_opt_int(obj.get("rank")),
        stage=_opt_int(obj.get("stage")),
        microbatch=_opt_int(obj.get("microbatch")),
        action=_opt_str(obj.get("action")),
        error=_opt_str(obj.get("error")),
        traceback=_opt_str(obj.get("traceback")),
        remote=obj.get("remote") is True,
        failed_rank=_opt_int(obj.get("failed_rank")),
        fields=obj,
    )


# ---------------------------------------------------------------- output


class _Console:
    """A byte sink over the launcher's stdout or stderr that never raises (a closed pipe must not orphan ranks)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._broken = False

    def write(self, data: bytes) -> None:
        if self._broken or not data:
            return
        try:
            buffer = getattr(self._stream, "buffer", None)
            if buffer is not None:
                buffer.write(data)
                buffer.flush()
            else:  # a captured or wrapped text stream
                self._stream.write(data.decode("utf-8", "replace"))
                self._stream.flush()
        except (OSError, ValueError):
            self._broken = True

    def say(self, text: str) -> None:
        """One message of the launcher's own: the first line is marked as such, the rest follow as they are."""
        self.write(f"pipeloom launch: {text.rstrip()}\n".encode("utf-8", "replace"))


class _RankStream:
    """One pipe of one rank: splits it into lines, echoes them prefixed, logs them raw, picks out root causes."""

    def __init__(
        self,
        rank: _Rank,
        *,
        is_stderr: bool,
        console: _Console | None,
        log: IO[bytes] | None,
        prefix: bytes,
        on_cause: Callable[[_Rank], None] | None = None,
    ) -> None:
        self._rank = rank
        self._on_cause = on_cause
        self._is_stderr = is_stderr
        self._console = console
        self._log = log
        self._prefix = prefix
        self._buf = bytearray()
        self.closed = False

    def feed(self, data: bytes) -> None:
        self._buf += data
        echo: list[bytes] = []
        start = 0
        while (newline := self._buf.find(b"\n", start)) >= 0:
            self._line(bytes(self._buf[start : newline + 1]), echo, terminated=True)
            start = newline + 1
        del self._buf[:start]
        if len(self._buf) >= _MAX_LINE:
            self._line(bytes(self._buf), echo, terminated=False)
            self._buf.clear()
        self._emit(echo)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        echo: list[bytes] = []
        if self._buf:
            self._line(bytes(self._buf), echo, terminated=False)
            self._buf.clear()
        self._emit(echo)

    def _line(self, line: bytes, echo: list[bytes], *, terminated: bool) -> None:
        if self._log is not None:
            self._log.write(line)
        if self._is_stderr and line.startswith(_ROOT_CAUSE_PREFIX_B):
            cause = parse_root_cause_line(line.rstrip(b"\r\n"))
            if cause is not None:
                if self._rank.root_cause is None:
                    self._rank.root_cause = cause
                    if self._on_cause is not None:
                        self._on_cause(self._rank)
                return
        if self._console is not None:
            echo.append(self._prefix + line if terminated else self._prefix + line + b"\n")

    def _emit(self, echo: list[bytes]) -> None:
        if self._log is not None:
            try:
                self._log.flush()
            except OSError:
                pass
        if echo and self._console is not None:
            self._console.write(b"".join(echo))


# ---------------------------------------------------------------- ranks


@dataclass(eq=False)
class _Rank:
    local_rank: int
    rank: int
    pid: int | None = None
    transport: asyncio.SubprocessTransport | None = None
    returncode: int | None = None
    signalled: bool = False
    """The launcher sent this rank's group a signal while it was alive."""
    root_cause: RootCause | None = None
    streams: dict[int, _RankStream] = field(default_factory=dict)
    log: IO[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self.pid is not None and self.returncode is None

    @property
    def pipes_closed(self) -> bool:
        return all(s.closed for s in self.streams.values())

    def outcome(self) -> str:
        if self.returncode is None:
            return f"rank {self.rank} did not exit"
        if self.returncode < 0:
            return f"rank {self.rank} was killed by {_signal_name(-self.returncode)}"
        return f"rank {self.rank} exited with code {self.returncode}"


class _RankProtocol(asyncio.SubprocessProtocol):
    def __init__(self, job: _Job, rank: _Rank) -> None:
        self._job = job
        self._rank = rank
        self._transport: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.SubprocessTransport)
        self._transport = transport

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        stream = self._rank.streams.get(fd)
        if stream is not None:
            stream.feed(data if isinstance(data, bytes) else data.encode())

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        stream = self._rank.streams.get(fd)
        if stream is not None:
            stream.close()
        self._job.wake()

    def process_exited(self) -> None:
        assert self._transport is not None
        self._job.on_exit(self._rank, self._transport.get_returncode())


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _plural(ranks: Sequence[_Rank]) -> str:
    numbers = ", ".join(str(r.rank) for r in sorted(ranks, key=lambda r: r.rank))
    return f"rank{'s' if len(ranks) > 1 else ''} {numbers}"


def _stopped(pid: int) -> bool:
    """True if ``pid`` is stopped (SIGSTOP, SIGTSTP, a tracer); False if running or unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _try_bind(cpus: Sequence[int]) -> None:
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        pass


def _pdeathsig_hook(cpus: Sequence[int] | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the kernel SIGKILL the rank if the launcher dies (Linux only), and binds the
    rank to ``cpus`` (``--cpu-bind``) before it execs, so that every thread it starts inherits the mask."""
    if not sys.platform.startswith("linux"):
        return None if cpus is None else (lambda: _try_bind(cpus))
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None
    parent = os.getpid()

    def hook() -> None:  # runs in the child between fork and exec: keep it tiny
        if cpus is not None:
            try:  # (the kernel drops offline CPUs and those outside the cpuset; it fails only if none is left)
                os.sched_setaffinity(0, cpus)
            except OSError:
                pass  # unbound rather than not started: the mask was checked when the job was configured
        if prctl is None:
            return
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return hook if prctl is not None or cpus is not None else None


_WATCHDOG = """\
import os, signal, sys
groups = set()
for line in sys.stdin:
    if line == "done\\n":
        sys.exit(0)
    if line[:1] in "+-" and line[1:].strip().isdigit():
        (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
for g in groups:  # the launcher is gone (SIGKILL, the OOM killer) without saying "done"
    try:
        os.killpg(g, signal.SIGKILL)
    except OSError:
        pass
"""


class _Watchdog:
    """A tiny process that outlives a launcher killed by SIGKILL and kills the ranks' process groups then.

    PR_SET_PDEATHSIG kills each rank when the launcher dies, but not what the rank started (a
    subprocess, a worker pool): those would run on.  The watchdog holds the groups of the live ranks
    (``+PGID`` / ``-PGID`` lines on its stdin); when its stdin closes without a ``done`` line (the
    launcher died), it SIGKILLs them.  Its own session keeps it out of signals sent to the launcher's
    group.  Best effort: if it cannot start or dies, the ranks still have PDEATHSIG.
    """

    def __init__(self) -> None:
        self._proc: Any = None
        if not sys.platform.startswith("linux"):
            return
        import subprocess

        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHDOG], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
            )
        except OSError:
            self._proc = None

    def _send(self, line: str) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(line.encode())
            self._proc.stdin.flush()
        except (OSError, ValueError):
            self._proc = None

    def add(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def discard(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")

    def close(self) -> None:
        """The launcher ends normally: the watchdog exits without killing anything."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.write(b"done\n")
            proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            proc.wait(timeout=2.0)
        except Exception:  # noqa: BLE001 - never block the launcher's exit on it
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- the job


class _Job:
    """Spawns one node's ranks, supervises them on the running loop, and reports."""

    def __init__(self, config: LaunchConfig, *, stdout: IO[str], stderr: IO[str]) -> None:
        self.config = config
        self.out = _Console(stdout)
        self.err = _Console(stderr)
        self.ranks: list[_Rank] = []
        self.exit_order: list[_Rank] = []
        self.failure_at: float | None = None
        self.remote_failure: str | None = None
        """What another node reported (through the rendezvous) that ended this attempt."""
        self.summary_line = ""
        """The first line of the last attempt's failure summary (told to the other nodes)."""
        self._rdzv: Any = None
        self.interrupt: int | None = None
        self.interrupt_count = 0
        self._spawning = 0
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: _Watchdog | None = None

    # -- callbacks (loop thread)

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def on_exit(self, rank: _Rank, returncode: int | None) -> None:
        assert self._loop is not None
        rank.returncode = returncode if returncode is not None else -signal.SIGKILL
        self.exit_order.append(rank)
        if self._watchdog is not None and rank.pid is not None:
            try:
                os.killpg(rank.pid, 0)
            except ProcessLookupError:  # its group is empty: its number may be reused, the watchdog must forget it
                self._watchdog.discard(rank.pid)
            except PermissionError:
                pass
        if rank.returncode != 0 and self.failure_at is None and self.interrupt is None:
            self.failure_at = self._loop.time()
        self.wake()

    def on_root_cause(self, rank: _Rank) -> None:
        """A rank reported a failure: the teardown clock starts now, exited or not.

        A rank that reported can still hang on its way out (on NCCL, in a
        communicator that waits for a stopped peer), so waiting for its exit
        could wait forever; the grace is counted from the report.
        """
        assert self._loop is not None
        if self.failure_at is None and self.interrupt is None:
            self.failure_at = self._loop.time()
        self.wake()

    def on_signal(self, signum: int) -> None:
        if self.interrupt is None:
            self.interrupt = signum
        self.interrupt_count += 1
        self.wake()

    # -- driving

    async def run(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        installed = []
        for sig in self.config.signals:
            try:
                self._loop.add_signal_handler(sig, self.on_signal, sig)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / not POSIX
                pass
        collector = None
        temp_errors: str | None = None
        try:
            if self.config.error_dir is None:
                temp_errors = tempfile.mkdtemp(prefix="pipeloom-errors-")
                self.config = replace(self.config, error_dir=Path(temp_errors))
            if self.config.rdzv is not None:
                rdzv = self.config.rdzv
                self.err.say(f"rendezvous {rdzv.backend} at {rdzv.endpoint}, id {rdzv.run_id!r}, "
                             f"{rdzv.min_nodes}{'' if rdzv.max_nodes == rdzv.min_nodes else f':{rdzv.max_nodes}'} node(s)")
                try:
                    self._rdzv = await self._blocking(_make_rendezvous, rdzv)
                except Exception as exc:  # noqa: BLE001 - torch's errors, reported as a usage error
                    self.err.say(f"error: rendezvous at {rdzv.endpoint} failed: {type(exc).__name__}: {exc}")
                    return 128 + self.interrupt if self.interrupt is not None else EXIT_USAGE
            while True:
                if self._rdzv is not None and not await self._join_round():
                    return 128 + self.interrupt if self.interrupt is not None else EXIT_USAGE
                if collector is None:
                    collector = self._start_collector()
                code = await self._attempt()
                cfg = self.config
                if self._rdzv is not None and code not in (EXIT_OK, EXIT_USAGE) and self.remote_failure is None:
                    try:
                        await self._blocking(self._rdzv.report_failure, f"node {cfg.node_rank}: {self.summary_line}", timeout=10.0)
                    except _Interrupted:
                        pass
                if code in (EXIT_OK, EXIT_USAGE) or self.interrupt is not None or cfg.restart_count >= cfg.max_restarts:
                    return code
                self._next_attempt()
        finally:
            if collector is not None:
                await asyncio.to_thread(collector.close)  # drains the last batches, bounded
            if self._rdzv is not None:
                try:
                    await self._blocking(self._rdzv.shutdown, timeout=12.0)
                except _Interrupted:
                    pass
            for sig in installed:
                self._loop.remove_signal_handler(sig)
            self._close_attempt()
            if self._watchdog is not None:
                self._watchdog.close()
            if temp_errors is not None:
                shutil.rmtree(temp_errors, ignore_errors=True)

    async def _blocking(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """Run a blocking call (torch's rendezvous) on a daemon thread; give up on a signal or ``timeout``.

        Not ``asyncio.to_thread``: its worker threads are joined at interpreter
        exit, so a rendezvous still waiting for absent nodes would keep a
        launcher that was told to stop alive.
        """
        assert self._loop is not None and self._wake is not None
        loop = self._loop
        fut: asyncio.Future[Any] = loop.create_future()

        def body() -> None:
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop
                loop.call_soon_threadsafe(lambda e=exc: fut.done() or fut.set_exception(e))
            else:
                loop.call_soon_threadsafe(lambda r=result: fut.done() or fut.set_result(r))

        threading.Thread(target=body, name="pipeloom-rendezvous", daemon=True).start()
        deadline = None if timeout is None else loop.time() + timeout
        while not fut.done():
            if self.interrupt is not None:
                raise _Interrupted()
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return None
            self._wake.clear()
            waiter = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait({fut, waiter}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        return fut.result()

    async def _join_round(self) -> bool:
        """The next rendezvous round: this node's rank, the job's ranks, master and secret; False if it failed."""
        assert self._rdzv is not None
        cfg = self.config
        try:
            got = await self._blocking(self._rdzv.next_round, cfg.nproc_per_node, cfg.job_secret)
        except _Interrupted:
            self.err.say(f"stopped by {_signal_name(self.interrupt or signal.SIGINT)} while waiting at the rendezvous")
            return False
        except Exception as exc:  # noqa: BLE001 - torch's rendezvous errors (timeout, closed...)
            why = str(exc)
            if not why and type(exc).__name__ == "RendezvousTimeoutError":  # torch raises it without a message
                rdzv = cfg.rdzv
                assert rdzv is not None
                why = (f"fewer than {rdzv.min_nodes} node(s) joined within join_timeout "
                       f"({rdzv.conf.get('join_timeout', '600')} s; --rdzv-conf join_timeout=SECONDS)")
            self.err.say(f"error: rendezvous failed: {type(exc).__name__}: {why}")
            return False
        self.config = replace(
            cfg, node_rank=got.node_rank, nnodes=got.nnodes, rank_offset=got.rank_offset, total_world_size=got.world_size,
            master_addr=got.master_addr, master_port=got.master_port, job_secret=got.job_secret,
        )
        self.remote_failure = None
        self.err.say(f"rendezvous round {got.round}: node {got.node_rank} of {got.nnodes}, ranks "
                     f"{got.rank_offset}..{got.rank_offset + cfg.nproc_per_node - 1} of {got.world_size}, "
                     f"master {got.master_addr}:{got.master_port}")
        return True

    async def _watch_other_nodes(self) -> None:
        """While the ranks run: another node's failure (or restart) ends this node's attempt too."""
        assert self._rdzv is not None and self._loop is not None
        rdzv = self._rdzv
        while True:
            await asyncio.sleep(self.config.monitor_interval)
            if self.failure_at is not None or self.interrupt is not None:
                return
            try:
                failed = await self._blocking(rdzv.failure_elsewhere, timeout=30.0)
                waiting = 0 if failed else await self._blocking(rdzv.nodes_waiting, timeout=30.0)
            except _Interrupted:
                return
            if failed or waiting:
                what = failed or f"{waiting} node(s) waiting at the rendezvous for a new round (a node restarted)"
                self.remote_failure = what
                if self.failure_at is None and self.interrupt is None:
                    self.failure_at = self._loop.time()
                self.wake()
                return

    async def _attempt(self) -> int:
        """Start this attempt's ranks, supervise them to the end, and report; returns the exit status."""
        cfg = self.config
        self.ranks = [_Rank(local_rank=lr, rank=cfg.global_rank(lr)) for lr in range(cfg.nproc_per_node)]
        self.exit_order = []
        self.failure_at = None
        watcher = asyncio.ensure_future(self._watch_other_nodes()) if self._rdzv is not None else None
        try:
            try:
                await self._spawn_all()
            except OSError as exc:
                self.err.say(f"error: could not start rank {self._spawning}: {exc}")
                self._signal_all(signal.SIGKILL)
                await self._wait_until(lambda: not any(r.alive for r in self.ranks), _GIVE_UP_AFTER_KILL)
                await self._drain()
                return EXIT_USAGE
            await self._supervise()
            await self._drain()
            return self._report()
        finally:
            if watcher is not None:
                watcher.cancel()
            self._close_attempt()

    def _close_attempt(self) -> None:
        for r in self.ranks:
            if r.transport is not None:
                r.transport.close()
            for s in r.streams.values():
                s.close()
            if r.log is not None:
                r.log.close()
                r.log = None

    def _next_attempt(self) -> None:
        """torchrun's restart: every rank of this node starts again, with TORCHELASTIC_RESTART_COUNT + 1."""
        cfg = self.config
        restart = cfg.restart_count + 1
        port = _free_port(cfg.master_addr) if cfg.fresh_port_per_restart else cfg.master_port
        self.config = replace(cfg, restart_count=restart, master_port=port)
        self.err.say(f"restarting every rank (restart {restart} of --max-restarts {cfg.max_restarts})")

    def _start_collector(self) -> Any:
        """With ``--trace``: start the collector and point the ranks at it (None: ranks write files)."""
        cfg = self.config
        if cfg.trace is None:
            return None
        if not cfg.job_secret:
            self.err.say(f"warning: no job secret to verify trace frames with; each rank writes {cfg.trace}.rank{{R}}")
            return None
        from .trace_collector import TraceCollector

        path = cfg.trace if cfg.nnodes == 1 else f"{cfg.trace}.node{cfg.node_rank}"
        collector = TraceCollector(path, secret=cfg.job_secret.encode(), world_size=cfg.world_size, say=self.err.say)
        try:
            collector.start()
        except OSError as exc:
            self.err.say(f"warning: could not start the trace collector ({exc}); each rank writes {cfg.trace}.rank{{R}}")
            return None
        self.config = replace(cfg, trace_endpoint=collector.endpoint)
        self.err.write(f"pipeloom: trace -> {path} (live: {collector.live_address})\n".encode())
        return collector

    async def _spawn_all(self) -> None:
        assert self._loop is not None
        cfg = self.config
        bound: dict[int, list[int] | None] = {}
        if cfg.cpu_bind != "none":
            from ..affinity import CpuTopology, gpu_numa_nodes, rank_cpus

            try:
                topo = CpuTopology.read()
                gpus = gpu_numa_nodes(os.environ.get("CUDA_VISIBLE_DEVICES"), order=os.environ.get("CUDA_DEVICE_ORDER"))
                bound = {r.local_rank: rank_cpus(cfg.cpu_bind, r.local_rank, cfg.nproc_per_node, topo, gpus) for r in self.ranks}
            except ValueError as exc:  # (the mask changed since the job was configured: a restart)
                raise OSError(f"--cpu-bind {cfg.cpu_bind}: {exc}") from None
        if cfg.log_dir is not None:
            cfg.log_dir.mkdir(parents=True, exist_ok=True)
        if self._watchdog is None:
            self._watchdog = _Watchdog()
        for r in self.ranks:
            if self.interrupt is not None:
                return
            self._spawning = r.rank
            if cfg.log_dir is not None:
                name = f"rank{r.rank}.log" if cfg.restart_count == 0 else f"rank{r.rank}.restart{cfg.restart_count}.log"
                r.log = open(cfg.log_dir / name, "wb")
            shown = cfg.console_local_ranks is None or r.local_rank in cfg.console_local_ranks
            quiet = cfg.quiet_streams.get(r.local_rank, 0)  # --redirects: these go to the log file only
            text = (f"[rank{r.rank}]: " if cfg.prefix_template is None else
                    string.Template(cfg.prefix_template).safe_substitute(role_name=cfg.role, rank=r.rank, local_rank=r.local_rank))
            prefix = text.encode() if cfg.prefix else b""
            r.streams = {
                1: _RankStream(r, is_stderr=False, console=self.out if shown and not quiet & 1 else None, log=r.log,
                               prefix=prefix),
                2: _RankStream(r, is_stderr=True, console=self.err if shown and not quiet & 2 else None, log=r.log,
                               prefix=prefix, on_cause=self.on_root_cause),
            }
            error_file = cfg.error_file(r.local_rank)
            if error_file is not None:
                error_file.parent.mkdir(parents=True, exist_ok=True)
                error_file.unlink(missing_ok=True)
            transport, _ = await self._loop.subprocess_exec(
                lambda r=r: _RankProtocol(self, r),  # type: ignore[misc]
                *cfg.command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=rank_environment(cfg, r.local_rank),
                start_new_session=True,
                preexec_fn=_pdeathsig_hook(bound.get(r.local_rank)),
            )
            r.transport = transport
            r.pid = transport.get_pid()
            self._watchdog.add(r.pid)

    async def _supervise(self) -> None:
        """Wait for every rank; enforce the grace -> SIGTERM -> SIGKILL timeline after a failure or a signal."""
        assert self._loop is not None and self._wake is not None
        loop = self._loop
        term_at: float | None = None
        kill_at: float | None = None
        term_sent = False
        killed_at: float | None = None
        while any(r.alive for r in self.ranks):
            now = loop.time()
            if self.interrupt is not None and not term_sent:
                term_at = now  # a signal to the launcher: SIGTERM now, SIGKILL after the grace
                kill_at = now + (self.config.grace if self.config.shutdown_timeout is None else self.config.shutdown_timeout)
            elif self.failure_at is not None and term_at is None:
                term_at = self.failure_at + self.config.grace
                kill_at = term_at + (_KILL_AFTER_TERM if self.config.shutdown_timeout is None else self.config.shutdown_timeout)
            if self.interrupt_count > 1 and kill_at is not None:
                kill_at = min(kill_at, now)  # asked twice: no more patience
            if term_at is not None and now >= term_at and not term_sent:
                # Ctrl-C reaches the ranks as SIGINT, as under torchrun (which forwards the signal it got) and
                # plain python: a script's `except KeyboardInterrupt` / `finally` runs.  Otherwise SIGTERM.
                # SIGHUP and SIGQUIT as SIGTERM (a rank's SIGTERM handler runs, no rank dumps core); any other
                # signal of --signals-to-handle (SIGUSR1 from SLURM before the time limit) as itself, as torchrun.
                sig = self.interrupt if self.interrupt not in (None, *_EXIT_SIGNALS) else signal.SIGTERM
                self._signal_all(signal.SIGINT if self.interrupt == signal.SIGINT else sig)
                term_sent = True
            if kill_at is not None and now >= kill_at and killed_at is None:
                self._signal_all(signal.SIGKILL)
                killed_at = now
            if killed_at is not None and now >= killed_at + _GIVE_UP_AFTER_KILL:
                stuck = [r for r in self.ranks if r.alive]
                self.err.say(f"warning: {_plural(stuck)} did not exit after SIGKILL; giving up on them")
                return
            deadlines = [t for t in (term_at, kill_at) if t is not None and t > now]
            if killed_at is not None:
                deadlines.append(killed_at + _GIVE_UP_AFTER_KILL)
            timeout = (min(deadlines) - now) if deadlines else None
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _signal_all(self, sig: int) -> None:
        for r in self.ranks:
            if r.alive and r.pid is not None:
                r.signalled = True
                # A stopped process does not act on SIGTERM (SIGINT) until resumed: it gets SIGKILL at once.
                now = signal.SIGKILL if sig != signal.SIGKILL and _stopped(r.pid) else sig
                try:
                    os.killpg(r.pid, now)
                except (ProcessLookupError, PermissionError):
                    pass

    async def _wait_until(self, done: Callable[[], bool], timeout: float) -> None:
        assert self._loop is not None and self._wake is not None
        deadline = self._loop.time() + timeout
        while not done():
            left = deadline - self._loop.time()
            if left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                return

    async def _drain(self) -> None:
        """Collect the last output, then kill whatever the ranks left behind in their process groups."""
        spawned = [r for r in self.ranks if r.pid is not None]
        await self._wait_until(lambda: all(r.pipes_closed for r in spawned), _PIPE_DRAIN)
        for r in spawned:
            if r.returncode is not None:  # the leader is reaped; its pid stays reserved while its group lives
                try:
                    os.killpg(r.pid, signal.SIGKILL)  # type: ignore[arg-type]
                except (ProcessLookupError, PermissionError):
                    pass
                if self._watchdog is not None:
                    self._watchdog.discard(r.pid)  # type: ignore[arg-type]
        await self._wait_until(lambda: all(r.pipes_closed for r in spawned), _PIPE_DRAIN)

    # -- the summary

    def _root(self, failures: list[_Rank]) -> _Rank:
        def blames_itself(r: _Rank) -> bool:
            return r.root_cause is None or not r.root_cause.remote

        for r in failures:  # in exit order
            if not r.signalled and blames_itself(r):
                return r
        for r in failures:  # stopped by us, but it had told us it was the cause
            if r.root_cause is not None and not r.root_cause.remote:
                return r
        for r in failures:  # only consequences: the rank they blame, if it is one of ours (a stalled rank)
            blamed = self._blamed_by(r)
            if blamed is not None:
                return blamed
        return failures[0]

    def _error_file_cause(self, r: _Rank) -> RootCause | None:
        """The rank's ``TORCHELASTIC_ERROR_FILE``, as torch's ``@record`` writes it, read as a root cause."""
        path = self.config.error_file(r.local_rank)
        try:
            data = json.loads(path.read_text()) if path is not None else None
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        message = data.get("message")
        if isinstance(message, dict):  # {"message": {"message": "T: msg", "extraInfo": {"py_callstack": ...}}}
            extra = message.get("extraInfo") if isinstance(message.get("extraInfo"), dict) else {}
            error, tb = _opt_str(message.get("message")), _opt_str(extra.get("py_callstack"))
        else:  # the newer plain-string form
            error, tb = _opt_str(message), None
        return RootCause(rank=r.rank, error=error, traceback=tb, fields={"error_file": str(path)})

    def _write_parent_error_file(self, root: _Rank, path: str) -> None:
        """torchrun's ``@record`` on its main: the root-cause rank's error file, copied into the launcher's own
        ``TORCHELASTIC_ERROR_FILE`` with ``errorCode`` set to the rank's exit code (how TorchX and other
        schedulers learn why a job failed).  Where the rank wrote none but reported a ``PIPELOOM_ROOT_CAUSE``,
        that report in the same format (torchrun would write nothing)."""
        source = self.config.error_file(root.local_rank)
        data: Any = None
        try:
            data = json.loads(source.read_text()) if source is not None else None
        except (OSError, ValueError):
            data = None
        code = root.returncode if root.returncode is not None else -signal.SIGKILL
        if isinstance(data, dict):
            if isinstance(data.get("message"), dict) and code:
                data["message"]["errorCode"] = code  # as torch's override_error_code_in_rootcause_data
        elif root.root_cause is not None and not root.root_cause.remote and root.root_cause.error:
            cause = root.root_cause
            data = {"message": {"message": cause.error, "extraInfo": {"py_callstack": cause.traceback or "",
                                                                       "timestamp": str(int(time.time()))},
                                "errorCode": code}}
        else:
            return  # nothing to copy: torchrun leaves the file alone too
        try:
            Path(path).unlink(missing_ok=True)
            Path(path).write_text(json.dumps(data))
        except OSError as exc:
            self.err.say(f"warning: could not write TORCHELASTIC_ERROR_FILE {path}: {exc}")

    def _blamed_by(self, r: _Rank) -> _Rank | None:
        cause = r.root_cause
        if cause is None or not cause.remote or cause.failed_rank is None or cause.failed_rank == r.rank:
            return None
        return next((o for o in self.ranks if o.rank == cause.failed_rank and o.returncode != 0), None)

    def _report(self) -> int:
        failures = [r for r in self.exit_order if r.returncode != 0]
        failures += [r for r in self.ranks if r.returncode is None and r.pid is not None]  # gave up on these
        if self.interrupt is None:
            # A rank that reported its own failure and then exited 0: its script caught the step's error and
            # went on.  The failure ended the job all the same (the grace counts from the report), so it is the
            # root cause, not whichever peer was still exiting when the grace ran out (or, had every rank
            # exited in time, nobody: exit 0 for a failed step, by timing).
            caught = [r for r in self.exit_order if r.returncode == 0 and r.root_cause is not None and not r.root_cause.remote]
            failures = caught + failures
        code = EXIT_OK
        own = [r for r in failures if not (r.signalled and self.interrupt is not None)]
        cfg = self.config
        final = cfg.restart_count >= cfg.max_restarts or self.interrupt is not None
        what = "job failed" if final else f"attempt {cfg.restart_count} failed"
        for r in own:
            if r.root_cause is None:
                r.root_cause = self._error_file_cause(r)
        if own and self.remote_failure is not None and all(r.signalled or (r.root_cause and r.root_cause.remote) for r in own):
            # Nothing went wrong here: another node failed (or restarted) and this one followed.
            self.summary_line = f"{what} on another node: {self.remote_failure}"
            self.err.say(self.summary_line)
            terminated = [r for r in own if r.signalled]
            note = f"; the launcher terminated {_plural(terminated)}" if terminated else ""
            self.err.say(f"also stopped: {_plural(own)} (consequence{note})")
            own = []
            code = EXIT_RANK_FAILED
        if own:
            root = self._root(own)
            cause = root.root_cause
            if root.signalled and cause is not None and not cause.remote:
                # It reported its failure but had not exited when the grace (counted from the report) ran out.
                outcome = f"rank {root.rank} failed (still exiting after --grace: {root.outcome()[len(f'rank {root.rank} '):]} by the launcher)"
            elif root.returncode == 0:
                outcome = (f"rank {root.rank} failed (its script caught the error and exited 0; a failed step ends the "
                           "job: the ranks get --grace seconds from the report)")
            else:
                outcome = root.outcome() + (" (stopped by the launcher)" if root.signalled else "")
            lines = [f"{what}: {outcome}"]
            self.summary_line = lines[0]
            if cause is not None and not cause.remote:
                tb = (cause.traceback or "").rstrip("\n")
                if cause.error and cause.fields.get("phase") == "construction":
                    # nothing to place it by (the Pipeline could not be built): the error is the root-cause line
                    lines.append(f"  root cause: {cause.where(root.rank)}: {cause.error}")
                    tb_lines = tb.splitlines()
                    if tb_lines and tb_lines[-1].endswith(cause.error):
                        tb_lines.pop()  # (said above)
                    lines += [f"  {line}" for line in tb_lines]
                else:
                    lines.append(f"  root cause: {cause.where(root.rank)}")
                    if cause.error and not tb.endswith(cause.error):
                        lines.append(f"  error: {cause.error}")
                    lines += [f"  {line}" for line in tb.splitlines()]
            elif cause is None and (blamer := next((r for r in failures if self._blamed_by(r) is root), None)):
                lines.append(f"  rank {blamer.rank} reports: {blamer.root_cause.error}")  # type: ignore[union-attr]
            elif cause is not None:  # only consequences here: the root cause is on another node
                blamed = f"rank {cause.failed_rank}" if cause.failed_rank is not None else "another rank"
                lines.append(f"  it reports that {blamed} failed" + (f": {cause.error}" if cause.error else ""))
            self.err.say("\n".join(lines))
            others = [r for r in failures if r is not root]
            if others:
                terminated = [r for r in others if r.signalled]
                note = f"; the launcher terminated {_plural(terminated)}" if terminated else ""
                self.err.say(f"also stopped: {_plural(others)} (consequence of rank {root.rank}{note})")
            infra = root.returncode is not None and root.returncode < 0 and not root.signalled
            reported = cause is not None and not cause.remote
            code = EXIT_INFRA if infra and not reported else EXIT_RANK_FAILED
            if final and self.interrupt is None and cfg.parent_error_file:
                self._write_parent_error_file(root, cfg.parent_error_file)
        if self.interrupt is not None:
            stopped = [r for r in self.ranks if r.signalled]
            what = f"; terminated {_plural(stopped)}" if stopped else ""
            self.err.say(f"stopped by {_signal_name(self.interrupt)}{what}")
            code = 128 + self.interrupt
        return code


async def launch_async(config: LaunchConfig, *, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    """Run one node's ranks to completion on the running loop; returns the launcher's exit status."""
    return await _Job(config, stdout=stdout or sys.stdout, stderr=stderr or sys.stderr).run()


def launch(config: LaunchConfig, *, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    """Run one node's ranks to completion (a fresh event loop); returns the launcher's exit status."""
    try:
        return asyncio.run(launch_async(config, stdout=stdout, stderr=stderr))
    except KeyboardInterrupt:  # before our handler was installed; nothing was started yet
        return 128 + signal.SIGINT


# ---------------------------------------------------------------- command line

_EPILOG = """\
exit status:
  0    every rank exited with status 0
  1    a rank failed: the root-cause rank exited with a non-zero status
  2    launcher or usage error (bad arguments, script not found, spawn failure)
  3    infrastructure failure: the root-cause rank was killed by a signal the
       launcher did not send (e.g. SIGKILL from the OOM killer, SIGSEGV)
  130  the launcher got SIGINT (Ctrl-C); 143: SIGTERM; 129: SIGHUP; 131: SIGQUIT.
       Ranks get SIGINT (for a SIGINT, as under torchrun) or SIGTERM at once and
       SIGKILL after --grace seconds (at once on a second signal)

after a rank fails (exits unsuccessfully, or reports a root cause), every rank
gets --grace seconds to exit, then SIGTERM (SIGKILL if it is stopped), then
SIGKILL one second later. One summary names the root-cause rank (see the
PIPELOOM_ROOT_CAUSE protocol in pipeloom.tools.launch) and lists the ranks that
stopped as a consequence.

multi-node: run one launcher per node with the same --nnodes, --nproc-per-node,
--master-addr, --master-port and that node's --node-rank; export the same
PIPELOOM_JOB_SECRET on every node.
"""


class _UsageError(Exception):
    pass


class _Interrupted(Exception):
    """The launcher got a signal while a blocking rendezvous call was in flight."""


def _make_rendezvous(config: RendezvousConfig) -> Any:
    from .rendezvous import NodeRendezvous  # imports torch: only for a rendezvous

    return NodeRendezvous(config)


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _nonneg_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a number of seconds > 0")
    return value


def _int_arg(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _ranks_filter(text: str) -> frozenset[int] | None:
    if not text.strip():
        return None  # torchrun's: an empty filter shows every rank
    try:
        ranks = frozenset(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated local ranks, got {text!r}") from None
    if any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"expected local ranks >= 0, got {text!r}")
    return ranks


_IGNORED_FLAGS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--start-method", "--start_method"), {}),
    (("--event-log-handler", "--event_log_handler"), {}),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters"), {}),
    (("--duplicate-stderr-filters", "--duplicate_stderr_filters"), {}),
    (("--logs-specs", "--logs_specs"), {}),
]
_IGNORED_WHY = {
    "start_method": "ranks are always fresh processes (exec), as with 'spawn'",
    "event_log_handler": "pipeloom logs no torchelastic events",
    "duplicate_stdout_filters": "use --log-dir (every rank's whole output)",
    "duplicate_stderr_filters": "use --log-dir (every rank's whole output)",
    "logs_specs": "log files are DIR/rank{R}.log under --log-dir",
}


def _absent_local_ranks(flag: str, ranks: Sequence[int], nproc: int) -> str:
    """The note for local ranks named in ``flag`` that this node does not run (torchrun ignores them silently:
    one command line serves nodes with different numbers of GPUs)."""
    listed = ", ".join(map(str, sorted(ranks)))
    return f"note: {flag}: local rank{'s' if len(ranks) > 1 else ''} {listed} not on this node (0..{nproc - 1}): ignored"


def _stream_spec(text: str, nproc: int, flag: str, notes: list[str]) -> dict[int, int]:
    """torchrun's ``-r``/``-t`` value: ``3`` (every local rank) or ``0:1,1:2`` -> {local rank: streams}."""
    try:
        if ":" not in text:
            value = int(text)
            if not 0 <= value <= 3:
                raise ValueError
            return {lr: value for lr in range(nproc)} if value else {}
        out = {}
        for item in text.split(","):
            lr, _, value = item.partition(":")
            if not 0 <= int(value) <= 3 or int(lr) < 0:
                raise ValueError
            out[int(lr)] = int(value)
    except ValueError:
        raise _UsageError(f"{flag}: expected 0-3 (1 stdout, 2 stderr, 3 both) or LOCAL_RANK:0-3,..., "
                          f"local ranks 0..{nproc - 1}; got {text!r}") from None
    if absent := [lr for lr in out if lr >= nproc]:
        notes.append(_absent_local_ranks(flag, absent, nproc))
    return {lr: v for lr, v in out.items() if lr < nproc}


def add_parser(subparsers: Any) -> None:
    """Register ``launch`` on the ``pipeloom`` parser."""
    p = subparsers.add_parser(
        "launch",
        help="start the ranks of a training script (torchrun's flags; clear failure summaries)",
        description="Start the ranks of a training script on this node, with torchrun's environment,\n"
        "prefixed output, a bounded teardown after a failure and one root-cause summary.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=True,  # as torchrun's parser: `--redirect 3`, `--nproc_per 2` work there
    )
    add = p.add_argument
    add("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default=None, metavar="N",
        help="ranks on this node: an integer, or 'auto' (CUDA devices if any, else CPU cores) (default 1)")
    add("--nnodes", default=None, metavar="N|MIN:MAX",
        help="nodes in the job (default 1); MIN:MAX with a rendezvous backend other than static")
    add("--node-rank", "--node_rank", dest="node_rank", type=_int_arg, default=None, metavar="I",
        help="this node's index (default 0; static rendezvous only)")
    add("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default=None, metavar="NAME",
        help="static (--node-rank, --master-addr; default) or c10d (torch's rendezvous, node ranks assigned)")
    add("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default=None, metavar="HOST:PORT",
        help="where the launchers meet (c10d: a TCP store hosted by the first launcher on that host)")
    add("--rdzv-id", "--rdzv_id", dest="rdzv_id", default=None, metavar="ID",
        help="job id shared by the launchers of one job (TORCHELASTIC_RUN_ID; default none)")
    add("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", default=None, metavar="K=V,...",
        help="rendezvous settings, as torchrun's (join_timeout, last_call_timeout, is_host, ...)")
    add("--local-addr", "--local_addr", dest="local_addr", default=None, metavar="HOST",
        help="this node's address as the others reach it (rendezvous; default: the one routing to the endpoint)")
    add("--monitor-interval", "--monitor_interval", dest="monitor_interval", type=_positive_float, default=None,
        metavar="SECONDS", help="how often the other nodes' state is read from the rendezvous (default 0.5); "
        "ranks' exits and output are events, not polled")
    add("--master-addr", "--master_addr", dest="master_addr", default=None, metavar="HOST",
        help="host of global rank 0, where the torch.distributed store listens (default 127.0.0.1)")
    add("--master-port", "--master_port", dest="master_port", type=_int_arg, default=None, metavar="PORT",
        help=f"port of the store (default: a free port on one node, {_DEFAULT_MULTINODE_PORT} on several)")
    add("--standalone", action="store_true", default=None, help="single-node job on a free local port (implies --nnodes 1)")
    add("--log-dir", "--log_dir", dest="log_dir", type=Path, default=None, metavar="DIR",
        help="also write each rank's raw stdout+stderr to DIR/rank{R}.log")
    add("-r", "--redirects", dest="redirects", default=None, metavar="SPEC",
        help="torchrun's: streams to send to the log files only, not the console: 1 stdout, 2 stderr, 3 both, "
             "for every local rank (-r 3) or per local rank (-r 0:1,1:2)")
    add("-t", "--tee", dest="tee", default=None, metavar="SPEC",
        help="torchrun's: streams to write to the log files and the console (same SPEC as -r)")
    add("--local-ranks-filter", "--local_ranks_filter", dest="ranks_filter", type=_ranks_filter, default=None,
        metavar="R,R", help="echo only these local ranks' output to the console (log files get all)")
    add("--no-prefix", dest="prefix", action="store_false", help="do not prefix echoed lines with [rank{R}]: ")
    add("--backend", choices=("gloo", "nccl"), default=None, help="torch.distributed backend (PIPELOOM_BACKEND)")
    add("--trace", default=None, metavar="FILE",
        help="record the job's trace to FILE, streamed through the launcher (live viewers: pipeloom trace attach --file FILE)")
    add("--heartbeat-timeout", dest="heartbeat_timeout", type=_positive_float, default=None, metavar="SECONDS",
        help="declare a silent peer lost after SECONDS (PIPELOOM_HEARTBEAT_TIMEOUT)")
    add("--stall-timeout", dest="stall_timeout", type=_positive_float, default=None, metavar="SECONDS",
        help="declare a peer stuck once it has run one action for SECONDS while others wait for it "
             "(PIPELOOM_STALL_TIMEOUT; default 30; must exceed the slowest action)")
    add("--first-step-stall-timeout", dest="first_step_stall_timeout", type=_positive_float, default=None,
        metavar="SECONDS", help="the same for a cold step: the first, and the first after the model changed, when "
        "torch.compile compiles (PIPELOOM_FIRST_STEP_STALL_TIMEOUT; default max(300, 10 x --stall-timeout))")
    add("--cuda-graphs", dest="cuda_graphs", action="store_true",
        help="GPUs: replay each stage's forward and backward from CUDA graphs (PIPELOOM_CUDA_GRAPHS=1; "
             "RuntimeOptions.cuda_graphs: for host-bound stages; the stage must be a function of its inputs and parameters)")
    add("--grace", type=_nonneg_float, default=2.0, metavar="SECONDS",
        help="after a failure, wait this long for the other ranks before SIGTERM (default 2)")
    add("--shutdown-timeout", "--shutdown_timeout", dest="shutdown_timeout", type=_nonneg_float, default=None,
        metavar="SECONDS", help="torchrun's: seconds from SIGTERM (SIGINT) to SIGKILL, for ranks that save something "
        "on the way out (default: 1 after a failure, --grace after a signal to the launcher; torchrun's is 30)")
    add("--max-restarts", "--max_restarts", dest="max_restarts", type=_int_arg, default=None, metavar="N",
        help="after a failure, stop every rank and restart them all, at most N times; ranks see "
             "TORCHELASTIC_RESTART_COUNT (default 0)")
    add("--cpu-bind", dest="cpu_bind", choices=("none", "slice", "node", "socket"), default=None,
        help="bind each rank to CPUs: slice (its own equal share of whole cores, ordered by NUMA node), node or "
             "socket (one per group of consecutive local ranks), none (default: the OS places the threads). A "
             "host-bound GPU rank's threads hand the interpreter lock back and forth; on 2 x H200 a free run had a "
             "slow mode 25-35%% behind that slice removed (benchmarks/RESULTS.md)")
    add("--numa-binding", "--numa_binding", dest="numa_binding", choices=("node", "socket", "exclusive", "core-complex"),
        default=None, help="torchrun's: node and socket as --cpu-bind; exclusive and core-complex bind as --cpu-bind slice")
    add("--signals-to-handle", "--signals_to_handle", dest="signals_to_handle", default=None, metavar="SIG,...",
        help="torchrun's: signals that stop the job (default SIGTERM,SIGINT,SIGHUP,SIGQUIT, always handled); the "
             "ranks get SIGINT for SIGINT, SIGTERM for SIGTERM/SIGHUP/SIGQUIT, any other (SIGUSR1, SIGUSR2) as it is, "
             "then SIGKILL after --grace (--shutdown-timeout)")
    add("--role", default=None, help="ROLE_NAME of the ranks (default 'default')")
    add("--virtual-local-rank", "--virtual_local_rank", dest="virtual_local_rank", action="store_true", default=None,
        help="torchrun's: every rank sees LOCAL_RANK=0 and only its own GPU (CUDA_VISIBLE_DEVICES)")
    add("-m", "--module", action="store_true", default=None, help="run SCRIPT as a module, like python -m")
    add("--no-python", "--no_python", dest="no_python", action="store_true", default=None, help="run SCRIPT as an executable, not with python")
    add("--run-path", "--run_path", dest="run_path", action="store_true", default=None,
        help="run SCRIPT through runpy.run_path, as torchrun does (takes precedence over --no-python)")
    # torchrun's flags that do not apply here: accepted, with a one-line note, so command lines carry over
    for names, kw in _IGNORED_FLAGS:
        add(*names, dest=names[0].lstrip("-").replace("-", "_"), default=None, help=argparse.SUPPRESS, **kw)
    add("script", metavar="SCRIPT", help="the training script (or module with -m, executable with --no-python)")
    add("script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments of the script")
    p.set_defaults(func=_cmd_launch)


def _cpu_count() -> int:
    """torch._utils.cpu_count, as torchrun counts: the CPUs this process may run on (taskset, cgroups), not all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def _nproc(text: str) -> int:
    if text in ("auto", "gpu", "cpu"):
        if text != "cpu":
            try:
                import torch  # only here: counting devices is the one thing that needs it

                if torch.cuda.is_available():
                    return int(torch.cuda.device_count())
            except ImportError:
                pass
            if text == "gpu":
                raise _UsageError("--nproc-per-node gpu: no CUDA device")
        return _cpu_count()
    try:
        value = int(text)
    except ValueError:
        raise _UsageError(f"--nproc-per-node: expected an integer or 'auto', got {text!r}") from None
    if value < 1:
        raise _UsageError(f"--nproc-per-node must be at least 1, got {value}")
    return value


def _free_port(host: str) -> int:
    return free_port("127.0.0.1" if host in ("127.0.0.1", "localhost") else "")


def _check_script(script: str) -> None:
    """What python can run as a script: a file (a zip too) or a directory with ``__main__.py``; else a usage error."""
    path = Path(script)
    if path.is_dir():
        if not (path / "__main__.py").is_file():
            raise _UsageError(f"{script} is a directory without __main__.py: python cannot run it")
    elif not path.exists():
        raise _UsageError(f"script not found: {script}")


def _env_flag(text: str) -> bool:
    return bool(int(text))  # torchrun's check_env: "0" or "1" (anything else is an error there too)


# torchrun's flags that take their default from ``PET_{DEST}`` (torch.distributed.argparse_util.env/check_env):
# pipeloom's dest -> (torchrun's dest, flag, the default without the variable, how to read the variable).
# Kubeflow's PyTorchJob, for one, starts ``torchrun train.py`` with PET_NNODES, PET_NPROC_PER_NODE,
# PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT and no flags at all.
_TORCHRUN_ENV: dict[str, tuple[str, str, Any, Callable[[str], Any]]] = {
    "nnodes": ("NNODES", "--nnodes", "1", str),
    "nproc_per_node": ("NPROC_PER_NODE", "--nproc-per-node", "1", str),
    "rdzv_backend": ("RDZV_BACKEND", "--rdzv-backend", "static", str),
    "rdzv_endpoint": ("RDZV_ENDPOINT", "--rdzv-endpoint", "", str),
    "rdzv_id": ("RDZV_ID", "--rdzv-id", "none", str),
    "rdzv_conf": ("RDZV_CONF", "--rdzv-conf", "", str),
    "standalone": ("STANDALONE", "--standalone", False, _env_flag),
    "max_restarts": ("MAX_RESTARTS", "--max-restarts", 0, _int_arg),
    "monitor_interval": ("MONITOR_INTERVAL", "--monitor-interval", 0.5, _positive_float),
    "role": ("ROLE", "--role", "default", str),
    "shutdown_timeout": ("SHUTDOWN_TIMEOUT", "--shutdown-timeout", None, _nonneg_float),
    "virtual_local_rank": ("VIRTUAL_LOCAL_RANK", "--virtual-local-rank", False, _env_flag),
    "module": ("MODULE", "-m", False, _env_flag),
    "no_python": ("NO_PYTHON", "--no-python", False, _env_flag),
    "run_path": ("RUN_PATH", "--run-path", False, _env_flag),
    "log_dir": ("LOG_DIR", "--log-dir", None, Path),
    "redirects": ("REDIRECTS", "--redirects", "0", str),
    "tee": ("TEE", "--tee", "0", str),
    "ranks_filter": ("LOCAL_RANKS_FILTER", "--local-ranks-filter", None, _ranks_filter),
    "node_rank": ("NODE_RANK", "--node-rank", None, _int_arg),
    "master_addr": ("MASTER_ADDR", "--master-addr", "127.0.0.1", str),
    "master_port": ("MASTER_PORT", "--master-port", None, _int_arg),
    "local_addr": ("LOCAL_ADDR", "--local-addr", None, str),
    "signals_to_handle": ("SIGNALS_TO_HANDLE", "--signals-to-handle", _DEFAULT_SIGNALS_TO_HANDLE, str),
}


def _apply_torchrun_env(args: argparse.Namespace, env: Mapping[str, str]) -> list[str]:
    """Fill the torchrun flags not given on the command line from ``PET_*`` (as torchrun does), else their
    defaults; returns a note naming the variables that were used (a launcher's settings should not come from
    nowhere).  Raises _UsageError for a value that the flag would refuse."""
    used = []
    for dest, (name, flag, default, read) in _TORCHRUN_ENV.items():
        if getattr(args, dest, None) is not None:
            continue  # the command line wins
        value = default
        text = env.get(f"PET_{name}")
        if text is not None and text != "" and not (read is _env_flag and text.strip() == "0"):
            try:
                value = read(text)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise _UsageError(f"PET_{name}={text!r} (torchrun's default for {flag}): {exc}") from None
            used.append(f"PET_{name}={text}")
        setattr(args, dest, value)
    if used:
        return [f"note: torchrun's environment defaults in effect: {', '.join(used)}"]
    return []


def config_from_args(args: argparse.Namespace, *, environ: Mapping[str, str] | None = None) -> tuple[LaunchConfig, list[str]]:
    """Validate parsed arguments into a config; also returns warnings to print.  Raises _UsageError."""
    env = os.environ if environ is None else environ
    pet = _apply_torchrun_env(args, env)
    try:
        return _config_from_args(args, env, list(pet))
    except _UsageError as exc:
        if pet:  # the bad value may have come from the environment, not the command line: say so
            raise _UsageError(f"{exc} ({pet[0].removeprefix('note: ')})") from None
        raise


def _config_from_args(args: argparse.Namespace, env: Mapping[str, str], warnings: list[str]) -> tuple[LaunchConfig, list[str]]:
    run_id = args.rdzv_id
    if args.standalone:
        # torchrun's --standalone: a c10d rendezvous on localhost:0 with a fresh id, whatever --rdzv-* said
        given = [flag for flag, value, default in (("--rdzv-backend", args.rdzv_backend, "static"),
                                                   ("--rdzv-endpoint", args.rdzv_endpoint, ""),
                                                   ("--rdzv-id", args.rdzv_id, "none")) if value != default]
        # torchrun's c10d rendezvous on localhost:0 ignores --master-addr/--master-port and --node-rank too (with a
        # warning for the last): ranks meet on a free local port
        given += [flag for flag, value, default in (("--master-addr", args.master_addr, "127.0.0.1"),
                                                    ("--master-port", args.master_port, None),
                                                    ("--node-rank", args.node_rank, None)) if value != default]
        if given:
            warnings.append(f"note: --standalone overrides {', '.join(given)} (as torchrun's does): one node, a free local port")
        args.rdzv_backend, args.rdzv_endpoint = "static", ""
        args.master_addr, args.master_port, args.node_rank = "127.0.0.1", None, None
        run_id = str(uuid.uuid4())
    nproc = _nproc(args.nproc_per_node)
    try:
        min_nodes, max_nodes = parse_nnodes(args.nnodes)
    except ValueError as exc:
        raise _UsageError(f"--nnodes: {exc}") from None
    if args.standalone and min_nodes == 1 and max_nodes > 1:
        # torchrun accepts it: its rendezvous on localhost:0 (a port no other node can know) waits last_call_timeout
        # (30 s) for more nodes, then runs this one alone; here it runs at once
        warnings.append(f"note: --standalone --nnodes {args.nnodes}: one node (no other node can join a standalone job)")
        max_nodes = 1
    nnodes = max_nodes
    if run_id == "none" and args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None \
            and max_nodes == 1:
        # torchrun (2.13) runs such a job as --standalone: a fresh run id (an explicit --rdzv-id is kept here;
        # torchrun would replace it too)
        run_id = str(uuid.uuid4())
    backend = args.rdzv_backend
    rdzv: RendezvousConfig | None = None
    if backend != "static":
        if args.standalone:
            raise _UsageError("--standalone is a single-node job on a local port; drop it or --rdzv-backend")
        if not args.rdzv_endpoint:
            raise _UsageError(f"--rdzv-backend {backend} needs --rdzv-endpoint HOST:PORT")
        try:
            conf = parse_rdzv_conf(args.rdzv_conf)
        except ValueError as exc:
            raise _UsageError(f"--rdzv-conf: {exc}") from None
        rdzv = RendezvousConfig(backend=backend, endpoint=args.rdzv_endpoint, run_id=args.rdzv_id, min_nodes=min_nodes,
                                max_nodes=max_nodes, conf=conf, local_addr=args.local_addr)
        for flag, value in (("--node-rank", args.node_rank), ("--master-port", args.master_port)):
            if value is not None:
                warnings.append(f"note: {flag} is ignored with --rdzv-backend {backend} (the rendezvous assigns it)")
        if args.master_addr != "127.0.0.1":
            warnings.append(f"note: --master-addr is ignored with --rdzv-backend {backend} (node 0's address is used)")
        node_rank = 0
        port = 0
    else:
        if min_nodes != max_nodes:
            raise _UsageError("--nnodes MIN:MAX needs a rendezvous (--rdzv-backend c10d --rdzv-endpoint HOST:PORT)")
        if args.rdzv_endpoint:  # torchrun's static rendezvous: the endpoint is the master
            host, _, port_text = args.rdzv_endpoint.rpartition(":")
            if not host or not port_text.isdigit():
                raise _UsageError(f"--rdzv-endpoint: expected HOST:PORT, got {args.rdzv_endpoint!r}")
            args.master_addr, args.master_port = host.strip("[]"), int(port_text)
        elif args.master_addr.startswith("[") and args.master_addr.endswith("]"):
            args.master_addr = args.master_addr[1:-1]  # torchrun's form for IPv6 ('[::1]'); the ranks see '::1'
        if args.rdzv_conf:
            warnings.append("note: --rdzv-conf is ignored with the static rendezvous")
        node_rank = 0 if args.node_rank is None else args.node_rank
        if args.standalone and nnodes != 1:
            # torchrun waits join_timeout (600 s) for nodes that cannot find its localhost:0 rendezvous, then fails
            raise _UsageError(f"--standalone is a single-node job, but --nnodes {args.nnodes} needs {min_nodes} nodes; "
                              "drop --standalone and meet through --rdzv-backend c10d --rdzv-endpoint HOST:PORT")
        if nnodes < 1:
            raise _UsageError(f"--nnodes must be at least 1, got {nnodes}")
        if not 0 <= node_rank < nnodes:
            raise _UsageError(f"--node-rank must be in [0, {nnodes}), got {node_rank}")
        port = args.master_port
        if port is None:
            port = _free_port(args.master_addr) if (args.standalone or nnodes == 1) else _DEFAULT_MULTINODE_PORT
        if not 0 < port < 65536:
            raise _UsageError(f"--master-port must be in 1..65535, got {port}")
    for dest, why in _IGNORED_WHY.items():
        if getattr(args, dest, None) is not None:
            flag = "--" + dest.replace("_", "-")
            warnings.append(f"note: {flag} does not apply to pipeloom launch and is ignored: {why}")
    redirects = _stream_spec(args.redirects, nproc, "--redirects", warnings)
    tee = _stream_spec(args.tee, nproc, "--tee", warnings)
    quiet = {lr: v & ~tee.get(lr, 0) for lr, v in redirects.items() if v & ~tee.get(lr, 0)}
    log_dir = args.log_dir
    if (redirects or tee) and log_dir is None:
        log_dir = Path(tempfile.mkdtemp(prefix="pipeloom-logs-"))
        warnings.append(f"note: -r/-t without --log-dir: the rank logs go to {log_dir}")

    if args.max_restarts < 0:
        raise _UsageError(f"--max-restarts must be at least 0, got {args.max_restarts}")
    shutdown_timeout = args.shutdown_timeout
    if shutdown_timeout is None and env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        # torchrun's default for --shutdown-timeout (its own default, 30 s, is not pipeloom's)
        try:
            shutdown_timeout = _nonneg_float(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
        except argparse.ArgumentTypeError as exc:
            raise _UsageError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={env['TORCH_ELASTIC_SHUTDOWN_TIMEOUT']!r}: {exc}") from None
    signals = list(_EXIT_SIGNALS)
    for name in args.signals_to_handle.split(","):
        sig = getattr(signal, name.strip(), None) if name.strip().startswith("SIG") else None
        if not isinstance(sig, signal.Signals) or sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            # torchrun logs that it could not register a handler and goes on
            warnings.append(f"note: --signals-to-handle: {name.strip()!r} is not a signal that can be handled: ignored")
        elif sig not in signals:
            signals.append(sig)
    cpu_bind = args.cpu_bind
    if args.numa_binding is not None:
        mapped = {"node": "node", "socket": "socket"}.get(args.numa_binding, "slice")
        if cpu_bind is not None and cpu_bind != mapped:
            raise _UsageError(f"--numa-binding {args.numa_binding} (binds as --cpu-bind {mapped}) and --cpu-bind {cpu_bind} disagree")
        if mapped != args.numa_binding:
            warnings.append(f"note: --numa-binding {args.numa_binding} binds each rank as --cpu-bind slice "
                            "(its own share of whole cores, ordered by NUMA node)")
        cpu_bind = mapped
    cpu_bind = cpu_bind or "none"
    if cpu_bind != "none":
        from ..affinity import CpuTopology, gpu_numa_nodes, rank_cpus

        try:
            topo = CpuTopology.read()
            gpus = gpu_numa_nodes(os.environ.get("CUDA_VISIBLE_DEVICES"), order=os.environ.get("CUDA_DEVICE_ORDER"))
            for lr in range(nproc):
                rank_cpus(cpu_bind, lr, nproc, topo, gpus)
        except (ValueError, OSError) as exc:
            raise _UsageError(f"--cpu-bind {cpu_bind}: {exc}") from None
    if args.module and args.no_python:
        raise _UsageError("-m and --no-python exclude each other")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if args.virtual_local_rank and visible is not None and nproc > len(visible.split(",")):
        raise _UsageError(f"--virtual-local-rank: {nproc} ranks but CUDA_VISIBLE_DEVICES={visible!r} names "
                          f"{len(visible.split(','))} device(s)")
    python = env.get("PYTHON_EXEC") or sys.executable  # torchrun's: the interpreter of the ranks
    if args.run_path:
        if args.module:
            raise _UsageError("--run-path and -m exclude each other")
        _check_script(args.script)
        # (torchrun runs the script in its own spawned interpreter: sys.executable, not PYTHON_EXEC)
        runner = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
        command = (sys.executable, "-u", "-c", runner, args.script, *args.script_args)
    elif args.no_python:
        command = (args.script, *args.script_args)
    elif args.module:
        command = (python, "-u", "-m", args.script, *args.script_args)
    else:
        _check_script(args.script)
        command = (python, "-u", args.script, *args.script_args)

    secret = env.get("PIPELOOM_JOB_SECRET") or None
    if secret is None and nnodes == 1 and rdzv is None:
        secret = secrets.token_hex(16)
    elif secret is None and rdzv is None:
        warnings.append(
            "warning: multi-node job without PIPELOOM_JOB_SECRET: the ranks get no job secret; "
            "export the same value on every node (e.g. $(openssl rand -hex 16))"
        )
    if args.ranks_filter is not None and (absent := [r for r in args.ranks_filter if r >= nproc]):
        warnings.append(_absent_local_ranks("--local-ranks-filter", absent, nproc))

    config = LaunchConfig(
        command=command,
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=args.master_addr,
        master_port=port,
        job_secret=secret,
        backend=args.backend,
        trace=None if args.trace is None else os.path.abspath(args.trace),
        heartbeat_timeout=args.heartbeat_timeout,
        stall_timeout=args.stall_timeout,
        first_step_stall_timeout=args.first_step_stall_timeout,
        cuda_graphs=args.cuda_graphs,
        grace=args.grace,
        shutdown_timeout=shutdown_timeout,
        log_dir=log_dir,
        prefix=args.prefix,
        prefix_template=env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None,
        console_local_ranks=args.ranks_filter,
        max_restarts=args.max_restarts,
        fresh_port_per_restart=rdzv is None and args.master_port is None and (args.standalone or nnodes == 1),
        rdzv=rdzv,
        run_id=run_id,
        role=args.role,
        virtual_local_rank=args.virtual_local_rank,
        quiet_streams=quiet,
        monitor_interval=args.monitor_interval,
        cpu_bind=cpu_bind,
        signals=tuple(signals),
        signals_to_handle=args.signals_to_handle,
        parent_error_file=env.get("TORCHELASTIC_ERROR_FILE") or None,
    )
    return config, warnings


def _cmd_launch(args: argparse.Namespace) -> int:
    err = _Console(sys.stderr)
    try:
        config, warnings = config_from_args(args)
    except _UsageError as exc:
        err.say(f"error: {exc}")
        return EXIT_USAGE
    for warning in warnings:
        err.say(warning)
    return launch(config)
