"""CPU binding of ranks (``pipeloom.affinity``; ``pipeloom launch --cpu-bind`` / torchrun's ``--numa-binding``).

The policies are checked on synthetic topologies written as sysfs trees (two NUMA nodes, two hardware
threads per core, numbered the way Linux numbers them: siblings far apart); the launcher's binding on
real rank processes is in ``tests/test_launch.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeloom.affinity import CpuTopology, bind_this_process, gpu_numa_nodes, parse_cpulist, rank_cpus


def _sysfs(root: Path, nodes: int, cores_per_node: int, threads: int) -> list[int]:
    """A sysfs tree like a two-socket host's: CPU ids run over all cores first, then the second threads."""
    ncores = nodes * cores_per_node
    cpus = []
    for t in range(threads):
        for core in range(ncores):
            cpu = t * ncores + core
            cpus.append(cpu)
            d = root / "cpu" / f"cpu{cpu}" / "topology"
            d.mkdir(parents=True)
            (d / "physical_package_id").write_text(f"{core // cores_per_node}\n")
            (d / "core_id").write_text(f"{core % cores_per_node}\n")
    for n in range(nodes):
        mine = [c for c in cpus if (c % ncores) // cores_per_node == n]
        (root / "node" / f"node{n}").mkdir(parents=True)
        (root / "node" / f"node{n}" / "cpulist").write_text(",".join(map(str, mine)) + "\n")
    return sorted(cpus)


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []


def test_slice_gives_whole_cores_within_one_node(tmp_path: Path) -> None:
    cpus = _sysfs(tmp_path, nodes=2, cores_per_node=4, threads=2)  # 16 CPUs: 0-7 first threads, 8-15 siblings
    topo = CpuTopology.read(cpus, sysfs=str(tmp_path))
    assert topo.node[9] == 0 and topo.node[12] == 1 and topo.core[9] == topo.core[1] == 1
    got = [rank_cpus("slice", r, 4, topo) for r in range(4)]
    assert got == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    assert all(len({topo.node[c] for c in g}) == 1 for g in got)  # never across nodes
    # more ranks than cores: whole cores no longer fit, single CPUs are shared out, still disjoint
    sixteen = [rank_cpus("slice", r, 16, topo) for r in range(16)]
    assert sorted(c for g in sixteen for c in g) == cpus and all(len(g) == 1 for g in sixteen)
    # an uneven count: every CPU used once, slices differ by at most one core
    three = [rank_cpus("slice", r, 3, topo) for r in range(3)]
    assert sorted(c for g in three for c in g) == cpus and {len(g) for g in three} <= {4, 6}


def test_node_and_socket_group_consecutive_ranks(tmp_path: Path) -> None:
    cpus = _sysfs(tmp_path, nodes=2, cores_per_node=2, threads=2)
    topo = CpuTopology.read(cpus, sysfs=str(tmp_path))
    node0 = [c for c in cpus if topo.node[c] == 0]
    node1 = [c for c in cpus if c not in node0]
    assert node0 == [0, 1, 4, 5]
    assert [rank_cpus("node", r, 4, topo) for r in range(4)] == [node0, node0, node1, node1]
    assert rank_cpus("socket", 0, 2, topo) == node0
    assert rank_cpus("none", 0, 2, topo) is None
    # only part of the machine allowed (a container's cpuset): only those CPUs are handed out
    part = CpuTopology.read([0, 1, 2, 3, 4, 5], sysfs=str(tmp_path))
    assert rank_cpus("slice", 0, 2, part) == [0, 1, 4, 5] and rank_cpus("slice", 1, 2, part) == [2, 3]
    assert rank_cpus("node", 0, 2, part) == [0, 1, 4, 5] and rank_cpus("node", 1, 2, part) == [2, 3]


def test_missing_sysfs_counts_every_cpu_as_its_own_core(tmp_path: Path) -> None:
    topo = CpuTopology.read([0, 1, 2, 3], sysfs=str(tmp_path / "absent"))
    assert [rank_cpus("slice", r, 2, topo) for r in range(2)] == [[0, 1], [2, 3]]
    assert rank_cpus("node", 1, 2, topo) == [0, 1, 2, 3]


def test_bad_requests_say_what_is_wrong(tmp_path: Path) -> None:
    topo = CpuTopology.read([0, 1], sysfs=str(tmp_path))
    with pytest.raises(ValueError, match="3 ranks on this node but only 2 CPUs"):
        rank_cpus("slice", 0, 3, topo)
    with pytest.raises(ValueError, match="unknown CPU binding 'numa'"):
        rank_cpus("numa", 0, 1, topo)
    with pytest.raises(ValueError, match=r"local rank 2 is not in range\(2\)"):
        rank_cpus("slice", 2, 2, topo)


def test_bind_this_process_sets_the_mask_threads_inherit() -> None:
    before = os.sched_getaffinity(0)
    try:
        got = bind_this_process("slice", local_rank=0, local_world=1)
        assert got == sorted(before) and os.sched_getaffinity(0) == before
        if len(before) >= 2:
            got = bind_this_process("slice", local_rank=1, local_world=2)
            assert got and set(got) < before and os.sched_getaffinity(0) == set(got)
    finally:
        os.sched_setaffinity(0, before)


def test_a_rank_bound_by_the_launcher_is_not_sliced_again(monkeypatch: pytest.MonkeyPatch) -> None:
    before = os.sched_getaffinity(0)
    monkeypatch.setenv("PIPELOOM_CPU_BIND", "slice")
    try:
        assert bind_this_process("slice", local_rank=1, local_world=2) == sorted(before)
        assert os.sched_getaffinity(0) == before
        assert bind_this_process("none") is None
    finally:
        os.sched_setaffinity(0, before)


def test_the_launchers_binding_never_stops_a_rank_from_starting() -> None:
    from pipeloom.tools import launch

    before = os.sched_getaffinity(0)
    try:
        launch._try_bind([10**6])  # no such CPU: the rank runs unbound rather than not at all
        assert os.sched_getaffinity(0) == before
    finally:
        os.sched_setaffinity(0, before)


def _gpus(root: Path, nodes: list[int], models: list[str] | None = None, switches: int = 0) -> dict[str, str]:
    """A host with one GPU per entry of ``nodes`` (its NUMA node): sysfs's PCI devices, NVIDIA's ``/proc`` list
    of the GPUs (written out of PCI order, as a directory may list them) and the ``/dev/nvidiaN`` files; the
    driver's sysfs directory also holds ``switches`` NVSwitch bridges, which are not GPUs.  The paths, as
    ``gpu_numa_nodes``'s keyword arguments."""
    bus, proc, dev = root / "bus", root / "proc", root / "dev"
    for d in (bus / "drivers" / "nvidia", proc, dev):
        d.mkdir(parents=True)
    for i in reversed(range(len(nodes))):
        addr = f"0000:{0x18 + 0x10 * i:02x}:00.0"
        d = bus / "devices" / addr
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{nodes[i]}\n")
        (d / "device").write_text((models[i] if models else "0x2335") + "\n")
        (bus / "drivers" / "nvidia" / addr).mkdir()
        (proc / addr).mkdir()
        (dev / f"nvidia{i}").write_text("")
    for j in range(switches):
        addr = f"0000:{0xc0 + j:02x}:00.0"
        (bus / "devices" / addr).mkdir(parents=True)
        (bus / "devices" / addr / "numa_node").write_text("0\n")
        (bus / "drivers" / "nvidia" / addr).mkdir()
    (dev / "nvidiactl").write_text("")
    return {"sysfs_bus": str(bus), "proc_gpus": str(proc), "dev": str(dev)}


def test_gpu_numa_nodes_from_the_drivers_gpu_list(tmp_path: Path) -> None:
    host = _gpus(tmp_path / "a", [1, 1, 0, 0], switches=2)  # the first two GPUs on the second socket
    assert gpu_numa_nodes(None, **host) == [1, 1, 0, 0]  # (the switches bound to the driver are not GPUs)
    assert gpu_numa_nodes("2,3,0", **host) == [0, 0, 1]  # CUDA_VISIBLE_DEVICES picks and orders them
    assert gpu_numa_nodes(" 2 , 3", **host) == [0, 0]
    assert gpu_numa_nodes("", **host) is None and gpu_numa_nodes("-1", **host) is None  # set, but no GPU visible
    assert gpu_numa_nodes("GPU-8b79edc0", **host) is None  # by UUID: not known here
    assert gpu_numa_nodes("7", **host) is None
    assert gpu_numa_nodes(None, **{**host, "proc_gpus": str(tmp_path / "absent")}) is None  # no NVIDIA driver
    # the /proc list and the device files disagree (a container whose /proc is not scoped): not trusted
    (Path(host["dev"]) / "nvidia0").unlink()
    assert gpu_numa_nodes(None, **host) is None
    mixed = _gpus(tmp_path / "mixed", [0, 1], models=["0x2335", "0x2330"])  # CUDA's default order may differ from PCI's
    assert gpu_numa_nodes(None, **mixed) is None and gpu_numa_nodes(None, order="PCI_BUS_ID", **mixed) == [0, 1]
    assert gpu_numa_nodes(None, **_gpus(tmp_path / "noloc", [-1, -1])) is None


def test_ranks_follow_their_gpus_node(tmp_path: Path) -> None:
    cpus = _sysfs(tmp_path, nodes=2, cores_per_node=4, threads=2)  # node 0: cores of CPUs 0-3 (+8-11)
    topo = CpuTopology.read(cpus, sysfs=str(tmp_path))
    node0 = [c for c in cpus if topo.node[c] == 0]
    node1 = [c for c in cpus if topo.node[c] == 1]
    gpus = [1, 1, 0, 0]  # local ranks 0 and 1 drive GPUs on node 1
    assert [rank_cpus("node", r, 4, topo, gpus) for r in range(4)] == [node1, node1, node0, node0]
    assert rank_cpus("socket", 0, 4, topo, gpus) == node1
    # slice: each node's CPUs shared by the ranks whose GPUs sit on it, whole cores
    got = [rank_cpus("slice", r, 4, topo, gpus) for r in range(4)]
    assert got == [[4, 5, 12, 13], [6, 7, 14, 15], [0, 1, 8, 9], [2, 3, 10, 11]]
    # three ranks on one node: still disjoint, still on that node
    uneven = [rank_cpus("slice", r, 3, topo, [0, 0, 0]) for r in range(3)]
    assert sorted(c for g in uneven for c in g) == node0
    # the GPUs' nodes unknown, too few of them, or a node this process may not use: by local rank, as before
    assert rank_cpus("node", 0, 4, topo, None) == node0
    assert rank_cpus("node", 0, 4, topo, [1, 1]) == node0
    part = CpuTopology.read(node0, sysfs=str(tmp_path))
    assert rank_cpus("node", 0, 2, part, [1, 1]) == node0
    # one GPU node with fewer CPUs than ranks on it: every rank falls back alike, so slices never overlap
    few = CpuTopology.read([0, *node1], sysfs=str(tmp_path))
    got = [rank_cpus("slice", r, 4, few, [0, 0, 1, 1]) for r in range(4)]
    assert got == [rank_cpus("slice", r, 4, few) for r in range(4)]
    assert sorted(c for g in got for c in g) == sorted([0, *node1])
