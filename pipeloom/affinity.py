"""Which CPUs a rank's process runs on: ``pipeloom launch --cpu-bind`` (torchrun's ``--numa-binding``).

A pipeline rank on a GPU is often host-bound: one Python thread launches the kernels while a few
others (the backward worker of ``host_overlap_backward``, the receive threads, NCCL's proxies) hand
the interpreter lock back and forth.  Left to the OS, those threads may land on different sockets,
and every hand-off then crosses them.  Measured on 2 x H200 (``benchmarks/RESULTS.md``, session M:
``tune_grid.py`` on GPT size s, 1F1B with 8 microbatches, the (5,3) layer split, 8 alternating blocks
of 4 steps): free, the blocks read 56.5-64.0 ms and, in a second run, 54.0-71.3 ms (a fast and a slow
mode 25-35% apart, seen in every grid since session I); each rank bound to its own half of the CPUs,
53.8-58.0 ms, no slow mode.

Policies (``POLICIES``):

- ``none``: no binding (the default).
- ``slice``: the ``local_rank``-th of ``local_world`` equal slices of the CPUs the launcher may use,
  ordered by NUMA node, then core, then CPU, so that a core's hardware threads stay in one slice and
  slices fill the nodes in order (where the counts divide, every slice lies within one node).  No two
  ranks share a core while there are at least as many cores as ranks (else single CPUs are shared out).  (torchrun's ``--numa-binding exclusive`` maps here.)
- ``node``: every allowed CPU of one NUMA node: node ``local_rank * nodes // local_world``, so that
  consecutive local ranks (consecutive GPUs, which hosts usually number by node) share a node.
- ``socket``: the same by CPU package (socket).

Where the GPUs' NUMA nodes are known (``gpu_numa_nodes``: local rank ``i`` uses CUDA device ``i``, as
torchrun's ``--numa-binding`` assumes; the GPUs this process can use, from the driver's ``/proc`` list, which
a container sees scoped to its own), ranks follow their GPU: ``node`` binds a rank to its GPU's node,
``socket`` to that node's socket, and ``slice`` shares each node's CPUs among the ranks whose GPUs sit on it
(torchrun's ``exclusive``), so a rank never runs on the far socket from its GPU.  Otherwise (no NVIDIA
devices, GPUs named by UUID in ``CUDA_VISIBLE_DEVICES``, a GPU's node without enough CPUs this process may use
for the ranks on it) ranks are placed by local rank: consecutive local ranks share a node.  Several launchers on one host each bind their local ranks
as if alone.

The topology is read from sysfs (``/sys/devices/system``); where it is missing, every CPU counts as
node 0, socket 0, a core of its own.  Torch-free: the launcher imports this before any rank starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["POLICIES", "CpuTopology", "rank_cpus", "bind_this_process", "gpu_numa_nodes"]

POLICIES = ("none", "slice", "node", "socket")


@dataclass(frozen=True)
class CpuTopology:
    """Where each CPU the process may use sits: its NUMA node, its socket and its core."""

    cpus: tuple[int, ...]
    """The CPUs the process may run on (its affinity mask), ascending."""
    node: Mapping[int, int]
    """CPU -> NUMA node."""
    socket: Mapping[int, int]
    """CPU -> physical package."""
    core: Mapping[int, int]
    """CPU -> core id within its package (hardware threads of one core share it)."""

    @classmethod
    def read(cls, cpus: Iterable[int] | None = None, sysfs: str = "/sys/devices/system") -> "CpuTopology":
        """This machine's topology for ``cpus`` (default: this process's affinity mask)."""
        allowed = tuple(sorted(os.sched_getaffinity(0) if cpus is None else set(cpus)))
        node: dict[int, int] = {}
        try:
            for entry in os.listdir(os.path.join(sysfs, "node")):
                if entry.startswith("node") and entry[4:].isdigit():
                    with open(os.path.join(sysfs, "node", entry, "cpulist")) as f:
                        for c in parse_cpulist(f.read()):
                            node[c] = int(entry[4:])
        except OSError:
            pass

        def topo(cpu: int, name: str) -> int | None:
            try:
                with open(os.path.join(sysfs, "cpu", f"cpu{cpu}", "topology", name)) as f:
                    return int(f.read().strip())
            except (OSError, ValueError):
                return None

        socket = {c: topo(c, "physical_package_id") or 0 for c in allowed}
        core = {c: v if (v := topo(c, "core_id")) is not None else c for c in allowed}
        return cls(allowed, {c: node.get(c, 0) for c in allowed}, socket, core)


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's list format)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def gpu_numa_nodes(visible: str | None = None, sysfs_bus: str = "/sys/bus/pci", order: str | None = None,
                   proc_gpus: str = "/proc/driver/nvidia/gpus", dev: str = "/dev") -> list[int] | None:
    """The NUMA node of each GPU in CUDA's numbering of the visible ones (index ``i``: CUDA device ``i``), read
    without initializing CUDA (the launcher stays torch-free): NVIDIA's driver lists the GPUs this process can
    use under ``/proc/driver/nvidia/gpus`` by PCI address (a container sees its own), CUDA numbers identical GPUs
    in that order (``CUDA_DEVICE_ORDER=PCI_BUS_ID`` always), and sysfs gives each address's node.

    ``visible``: ``CUDA_VISIBLE_DEVICES`` (indices into that order); ``order``: ``CUDA_DEVICE_ORDER``.  None
    where it cannot tell: no NVIDIA GPUs, a GPU list that disagrees with the ``/dev/nvidiaN`` device files,
    GPUs named by UUID or MIG instance, an index out of range, none visible, a device without a node (-1),
    or GPUs of different models under CUDA's default order (fastest first)."""
    try:
        addrs = sorted(a for a in os.listdir(proc_gpus) if a.count(":") == 2 and "." in a)
        devs = [d for d in os.listdir(dev) if d.startswith("nvidia") and d[6:].isdigit()]
        nodes, models = [], set()
        for a in addrs:
            with open(os.path.join(sysfs_bus, "devices", a.lower(), "numa_node")) as f:
                nodes.append(int(f.read().strip()))
            try:
                with open(os.path.join(sysfs_bus, "devices", a.lower(), "device")) as f:
                    models.add(f.read().strip())
            except OSError:
                models.add(a)
    except (OSError, ValueError):
        return None
    if not nodes or len(devs) != len(nodes) or (len(models) > 1 and (order or "").upper() != "PCI_BUS_ID"):
        return None
    if visible is not None:  # (set but empty: no GPU visible)
        picked = []
        for v in visible.split(","):
            v = v.strip()
            if not v.isdigit() or int(v) >= len(nodes):
                return None
            picked.append(nodes[int(v)])
        nodes = picked
        if not nodes:
            return None
    return nodes if all(n >= 0 for n in nodes) else None


def _cores(topo: CpuTopology, cpus: Iterable[int]) -> list[list[int]]:
    """``cpus`` grouped by core, ordered by node, socket and core."""
    order = sorted(cpus, key=lambda c: (topo.node[c], topo.socket[c], topo.core[c], c))
    cores: list[list[int]] = []
    for c in order:
        key = (topo.node[c], topo.socket[c], topo.core[c])
        if cores and (topo.node[cores[-1][0]], topo.socket[cores[-1][0]], topo.core[cores[-1][0]]) == key:
            cores[-1].append(c)
        else:
            cores.append([c])
    return cores


def _slice(cores: list[list[int]], index: int, count: int) -> list[int]:
    """The ``index``-th of ``count`` equal shares of ``cores``: whole cores where there are enough."""
    units = cores if len(cores) >= count else [[c] for u in cores for c in u]
    lo, hi = index * len(units) // count, (index + 1) * len(units) // count
    return sorted(c for u in units[lo:hi] for c in u)


def rank_cpus(policy: str, local_rank: int, local_world: int, topo: CpuTopology,
              gpu_nodes: list[int] | None = None) -> list[int] | None:
    """The CPUs local rank ``local_rank`` of ``local_world`` is bound to under ``policy``; None for ``none``.

    ``gpu_nodes``: the NUMA node of each local rank's GPU (``gpu_numa_nodes``); used where it covers every
    local rank and each of those nodes has CPUs this process may use, else ranks are placed by local rank.
    Raises ValueError for an unknown policy, a rank out of range, or a ``slice`` with fewer CPUs than ranks."""
    if policy not in POLICIES:
        raise ValueError(f"unknown CPU binding {policy!r}: expected one of {', '.join(POLICIES)}")
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is not in range({local_world})")
    if policy == "none":
        return None
    per_node: dict[int, int] = {}
    for c in topo.cpus:
        per_node[topo.node[c]] = per_node.get(topo.node[c], 0) + 1
    ranks_on: dict[int, int] = {}
    for n in (gpu_nodes or [])[:local_world]:
        ranks_on[n] = ranks_on.get(n, 0) + 1
    # (decided for all ranks alike: every GPU's node has CPUs for the ranks on it, so slices never overlap)
    by_gpu = (gpu_nodes is not None and len(gpu_nodes) >= local_world
              and all(per_node.get(n, 0) >= k for n, k in ranks_on.items()))
    if by_gpu:
        assert gpu_nodes is not None
        mine = gpu_nodes[local_rank]
        in_node = [c for c in topo.cpus if topo.node[c] == mine]
        if policy == "node":
            return in_node
        if policy == "socket":
            sock = min(topo.socket[c] for c in in_node)
            return [c for c in topo.cpus if topo.socket[c] == sock]
        peers = [r for r in range(local_world) if gpu_nodes[r] == mine]
        return _slice(_cores(topo, in_node), peers.index(local_rank), len(peers))
    if policy == "slice":
        if len(topo.cpus) < local_world:
            raise ValueError(f"--cpu-bind slice: {local_world} ranks on this node but only {len(topo.cpus)} CPUs "
                             f"({_fmt(list(topo.cpus))}) to share among them")
        return _slice(_cores(topo, topo.cpus), local_rank, local_world)
    group = topo.node if policy == "node" else topo.socket
    ids = sorted(set(group[c] for c in topo.cpus))
    mine = ids[local_rank * len(ids) // local_world]
    return [c for c in topo.cpus if group[c] == mine]


def bind_this_process(policy: str, local_rank: int | None = None, local_world: int | None = None) -> list[int] | None:
    """Bind the calling process to its CPUs under ``policy`` (``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` by default).

    For a script started by torchrun without its ``--numa-binding``: call it first, before torch starts its
    threads (threads inherit the mask of the thread that creates them).  Returns the CPUs, or None (``none``).
    Under ``pipeloom launch --cpu-bind`` (``PIPELOOM_CPU_BIND`` set) the rank is bound already: its mask is
    returned unchanged (slicing the slice again would leave each rank a fraction of its share)."""
    if policy != "none" and os.environ.get("PIPELOOM_CPU_BIND"):
        return sorted(os.sched_getaffinity(0))
    lr = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    lw = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_world is None else local_world
    cpus = rank_cpus(policy, lr, lw, CpuTopology.read(),
                     gpu_numa_nodes(os.environ.get("CUDA_VISIBLE_DEVICES"), order=os.environ.get("CUDA_DEVICE_ORDER")))
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    return cpus


def _fmt(cpus: list[int]) -> str:
    return ",".join(map(str, cpus)) if len(cpus) <= 8 else f"{cpus[0]}..{cpus[-1]}"
