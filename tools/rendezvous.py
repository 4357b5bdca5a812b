"""Node rendezvous for ``pipeloom launch --rdzv-backend c10d``: torch's own, driven by the launcher.

Problem: with ``--master-addr/--node-rank`` every node must be told its index
and the master's address up front, and the launchers never talk to each
other, so a failure on one node reaches the others only through their ranks.
torchrun's answer is a rendezvous: the launchers meet at an endpoint, agree
on node ranks, and restart together.

Alternatives: a home-made rendezvous over ZeroMQ (a second protocol to get
right, and not what torchrun users run), or torch's elastic agent as a whole
(its failure handling is what ``pipeloom launch`` replaces).  Chosen: torch's
rendezvous handler alone (``torch.distributed.elastic.rendezvous``, the
``c10d`` backend and the others registered there), so the endpoint, ``--rdzv-id``,
``--rdzv-conf`` and ``--nnodes MIN:MAX`` mean exactly what they mean to
torchrun; the launcher keeps its own supervision.  torch is imported here
only, and only when a rendezvous is asked for: ``pipeloom launch`` without
one still never imports torch.

After each rendezvous round the nodes exchange, through the round's store:
how many ranks each runs (so global ranks are contiguous per node, in node
order, as torchrun's), where global rank 0's TCP store will listen (node 0
picks a free port on its address), and the job secret (node 0 draws one
unless ``PIPELOOM_JOB_SECRET`` is set).  Ranks then meet through plain
``env://`` as on one node.  The same store carries failures between the
launchers: a node whose attempt failed writes ``pipeloom/failed``, and every
launcher polls it (and torch's "nodes waiting" count, which a node that
restarts raises) every ``--monitor-interval``.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RendezvousConfig", "Assignment", "NodeRendezvous", "free_port", "parse_nnodes", "parse_rdzv_conf"]

_FAILED = "pipeloom/failed"


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` -> (min, max); raises ValueError with the reason."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"expected N or MIN:MAX, got {text!r}")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo < 1 or hi < lo:
        raise ValueError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``k1=v1,k2=v2`` (torchrun's ``--rdzv-conf``) -> dict; raises ValueError."""
    out: dict[str, str] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected key=value pairs separated by commas, got {item!r}")
        out[key.strip()] = value.strip()
    return out


@dataclass(frozen=True, kw_only=True)
class RendezvousConfig:
    """What torchrun's rendezvous flags say."""

    backend: str
    """``c10d`` (a TCP store at the endpoint, hosted by whichever launcher gets there first) or another registered backend."""
    endpoint: str
    """``HOST:PORT`` of the rendezvous."""
    run_id: str
    """``--rdzv-id``: launchers with the same id form one job (``TORCHELASTIC_RUN_ID`` of the ranks)."""
    min_nodes: int
    max_nodes: int
    conf: Mapping[str, str] = field(default_factory=dict)
    """``--rdzv-conf`` (e.g. ``join_timeout=600``, ``last_call_timeout=30``, ``is_host=true``)."""
    local_addr: str | None = None
    """``--local-addr``: this node's address as the others reach it (default: the one that routes to the endpoint)."""


@dataclass(frozen=True)
class Assignment:
    """This node's place in one round of the job."""

    node_rank: int
    nnodes: int
    rank_offset: int
    """Global rank of this node's local rank 0."""
    world_size: int
    master_addr: str
    master_port: int
    job_secret: str
    round: int


def _route_addr(host: str) -> str:
    """The local address that routes to ``host`` (loopback for a local host)."""
    if host in ("localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent for a UDP connect
            return str(s.getsockname()[0])
    except OSError:
        return socket.getfqdn()


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for bind(0) and outgoing connections (Linux; else the usual one)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(addr: str = "") -> int:
    """A TCP port free on this host now, for a store that a rank will listen on seconds later.

    Chosen outside the kernel's ephemeral range when it can be: a port taken with bind(0) and
    released is ephemeral, and until the rank binds it any outgoing connection or bind(0) on the
    host may be given it (seen once in a test run beside other jobs: rank 0's TCPStore failed
    with EADDRINUSE).  Ports outside that range are only ever taken by an explicit bind.
    """
    lo, hi = _ephemeral_ports()
    outside = [(p, q) for p, q in ((20000, min(lo, 32768)), (max(hi + 1, 20000), 65536)) if q - p >= 1000]
    rng = random.Random()
    for _ in range(64 if outside else 0):
        start, stop = rng.choice(outside)
        port = rng.randrange(start, stop)
        if 29400 <= port < 29600:
            continue  # torchrun's default rendezvous and master ports: another job may be about to use them
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))  # every address: the store listens on all of them
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr if addr.startswith("127.") else "", 0))
        return int(s.getsockname()[1])


class NodeRendezvous:
    """One launcher's handle on the job's rendezvous.  Every method blocks: call it from a thread."""

    def __init__(self, config: RendezvousConfig) -> None:
        # torch's C++ side logs every failed store connection with a stack of frames, and its
        # Python side warns on each retry: the launcher reports what went wrong in one line.
        # (The level is read when torch loads; it is restored at once, so ranks keep theirs.)
        prev = os.environ.get("TORCH_CPP_LOG_LEVEL")
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        try:
            from torch.distributed.elastic.rendezvous import RendezvousParameters
            from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
        finally:
            if prev is None:
                del os.environ["TORCH_CPP_LOG_LEVEL"]
            else:
                os.environ["TORCH_CPP_LOG_LEVEL"] = prev
        logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)

        self.config = config
        params = RendezvousParameters(
            backend=config.backend, endpoint=config.endpoint, run_id=config.run_id,
            min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr, **dict(config.conf),
        )
        self._handler = get_rendezvous_handler(params)
        self._store: Any = None
        self._nnodes = 0
        self._round = 0

    def next_round(self, nproc_per_node: int, job_secret: str | None) -> Assignment:
        """Join the next round (the first, or after a failure) and agree on ranks, the master and the secret."""
        info = self._handler.next_rendezvous()
        # torch >= 2.4 returns a RendezvousInfo; older ones a (store, rank, world_size) tuple
        store, node_rank, nnodes = (info.store, info.rank, info.world_size) if hasattr(info, "store") else info
        self._store, self._nnodes = store, nnodes
        store.set(f"pipeloom/nproc/{node_rank}", str(nproc_per_node))
        counts = [int(store.get(f"pipeloom/nproc/{n}")) for n in range(nnodes)]
        if node_rank == 0:
            host = self.config.endpoint.rsplit(":", 1)[0].strip("[]")
            addr = self.config.local_addr or _route_addr(host)
            store.set("pipeloom/master", f"{addr}:{free_port(addr)}")
            store.set("pipeloom/secret", job_secret or secrets.token_hex(16))
        master = store.get("pipeloom/master").decode()
        secret = job_secret or store.get("pipeloom/secret").decode()
        addr, _, port = master.rpartition(":")
        self._round += 1
        return Assignment(
            node_rank=node_rank, nnodes=nnodes, rank_offset=sum(counts[:node_rank]), world_size=sum(counts),
            master_addr=addr, master_port=int(port), job_secret=secret, round=self._round,
        )

    def report_failure(self, text: str) -> None:
        """Tell the other launchers that this round failed here (best effort)."""
        try:
            if self._store is not None:
                self._store.set(_FAILED, text)
        except Exception:  # noqa: BLE001 - the store's host may be gone already
            pass

    def failure_elsewhere(self) -> str | None:
        """What another node reported this round, or None.  Never waits for the key."""
        try:
            if self._store is not None and self._store.check([_FAILED]):
                return bytes(self._store.get(_FAILED)).decode("utf-8", "replace")
        except Exception as exc:  # noqa: BLE001 - the store's host (another launcher) is gone
            return f"the rendezvous store stopped answering ({type(exc).__name__}): its launcher ended"
        return None

    def nodes_waiting(self) -> int:
        """Nodes waiting at the rendezvous for a new round (a node that restarts, or joins late)."""
        try:
            return int(self._handler.num_nodes_waiting())
        except Exception:  # noqa: BLE001
            return 0

    def shutdown(self, timeout: float = 10.0) -> None:
        """Close the rendezvous (no new rounds), then wait for the other nodes to get here too.

        The c10d store lives in one of the launchers; the barrier keeps that
        one from exiting (and taking the store along) while another launcher
        still reads it, as torchrun's exit barrier does.  Bounded by ``timeout``.
        """
        try:
            self._handler.shutdown()
        except Exception:  # noqa: BLE001
            pass
        store, nnodes = self._store, self._nnodes
        if store is None:
            return
        try:
            store.add("pipeloom/exit", 1)
            deadline = time.monotonic() + timeout
            while int(store.add("pipeloom/exit", 0)) < nnodes and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store's host is gone: nobody to wait for
            pass
