"""Pipeline x data parallel on 4 gloo ranks: PP=2 x DP=2 (DDP-style) and PP=2 x FSDP=2.

One pool of 4 rank processes runs every case (see tests/ranks/harness.py).
Each replica trains on its half of the global batch; after the gradient
reduction every rank's gradients (FSDP shards gathered whole) must equal the
unsplit model's on the whole global batch, cut into ``2 * num_microbatches``
microbatches, in float64 with a tight tolerance.  The traces must show the
reductions and all-gathers as events that overlap compute, and a fault test
kills one rank of one replica.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import run_ranks, spawn_ranks  # noqa: E402
from reference import reference_run  # noqa: E402

from pipeloom.runtime.trace import read_trace  # noqa: E402
from pipeloom.schedules import default_stages_per_rank  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-12)
# PIPELOOM_TEST_BACKEND=nccl runs the rank pool on 4 GPUs (the fault tests stay on gloo)
BACKEND = os.environ.get("PIPELOOM_TEST_BACKEND", "gloo")
WORLD, DP = 4, 2
PP = WORLD // DP
FAULT_WORKER = str(Path(__file__).parent / "ranks" / "fault_worker.py")

_BASE = dict(microbatches=4, dim=4, batch=16, steps=2, data_parallel=DP)
CASES: list[dict[str, Any]] = [
    # DDP-style replicas
    dict(_BASE, id="ddp-1F1B", schedule="1F1B", eval=True, trace=True),
    dict(_BASE, id="ddp-Interleaved1F1B", schedule="Interleaved1F1B", kwargs=True),
    dict(_BASE, id="ddp-ZBVZeroBubble", schedule="ZBVZeroBubble"),
    # tiny buckets: one collective per few parameters, several in flight at once
    dict(_BASE, id="ddp-small-buckets", schedule="Interleaved1F1B", multi=True, bucket_bytes=64),
    # FSDP2: one unit per stage; each block a unit and the stage one more (torchtitan's wrapping);
    # or only the Linear submodules ("linears": each stage's own `gain` stays replicated and is all-reduced)
    dict(_BASE, id="fsdp-1F1B", schedule="1F1B", fsdp=True, eval=True),
    dict(_BASE, id="fsdp-Interleaved1F1B", schedule="Interleaved1F1B", fsdp=True, trace=True),
    dict(_BASE, id="fsdp-ZBVZeroBubble", schedule="ZBVZeroBubble", fsdp=True, dim=5),  # uneven shards
    dict(_BASE, id="fsdp-blocks-1F1B", schedule="1F1B", fsdp=True, fsdp_wrap="blocks"),
    dict(_BASE, id="fsdp-blocks-ZBVZeroBubble", schedule="ZBVZeroBubble", fsdp=True, fsdp_wrap="blocks", multi=True),
    dict(_BASE, id="fsdp-blocks-Interleaved1F1B", schedule="Interleaved1F1B", fsdp=True, fsdp_wrap="blocks", eval=True),
    dict(_BASE, id="fsdp-linears-1F1B", schedule="1F1B", fsdp=True, fsdp_wrap="linears", trace=True),
    dict(_BASE, id="fsdp-linears-ZBVZeroBubble", schedule="ZBVZeroBubble", fsdp=True, fsdp_wrap="linears", multi=True),
    # Collectives without overlap (Pipeline(overlap_collectives=False), the benchmarks' naive
    # baseline): each UNSHARD / REDUCE_GRAD blocks the dispatcher until its collectives completed.
    # The worker's environment keeps a variable for the cases after it: the next case sets it back.
    dict(_BASE, id="fsdp-no-overlap-Interleaved1F1B", schedule="Interleaved1F1B", fsdp=True, fsdp_wrap="blocks", trace=True,
         env={"PIPELOOM_OVERLAP_COLLECTIVES": "0"}),
    # FSDP's own (synchronous on CPU) reduce-scatter, the path used for mixed precision or offload.
    # Last: the worker's environment keeps the variable for the cases after it.
    dict(_BASE, id="fsdp-own-reduce-ZBVZeroBubble", schedule="ZBVZeroBubble", fsdp=True, fsdp_wrap="blocks",
         env={"PIPELOOM_FSDP_REDUCE": "fsdp", "PIPELOOM_OVERLAP_COLLECTIVES": "1"}),
]


def _overlapped(cfg: dict[str, Any]) -> bool:
    """Whether the case runs its collectives as overlapping events (the default)."""
    return cfg.get("env", {}).get("PIPELOOM_OVERLAP_COLLECTIVES", "1") != "0"


# ---------------------------------------------------------------- in-process units


class _FakeUnit:
    """Stands in for an FSDPModule: unshard() has nothing in flight, so it lands at once."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def unshard(self, async_op: bool = False) -> None:
        self.calls.append("unshard")

    def reshard(self) -> None:
        self.calls.append("reshard")


def _collectives(schedule: str, rank: int = 0) -> tuple[Any, list[Any], dict[int, _FakeUnit]]:
    from torch import nn

    from pipeloom.runtime.data_parallel import StageCollectives
    from pipeloom.schedules import generate, lower

    lowered = lower(generate(schedule, num_ranks=2, num_microbatches=4), comms=False, fsdp=True, reduce_grad=True)
    actions = [a for a in lowered.actions[rank] if a.is_compute or a.type.value in ("UNSHARD", "RESHARD", "REDUCE_GRAD")]
    stages = {s: nn.Linear(2, 2) for s in lowered.stages_of(rank)}
    coll = StageCollectives(stages, rank=rank, group=None, group_ranks=[rank], device=torch.device("cpu"))
    units = {s: _FakeUnit() for s in stages}
    coll._units = {s: [u] for s, u in units.items()}  # as if fully_shard had wrapped every stage
    coll._reduce_sharded = lambda s, units: units[0].calls.append("reduce")  # no FSDP here
    coll.begin_step(actions)
    return coll, actions, units


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_events_follow_their_dependencies(schedule: str) -> None:
    coll, actions, units = _collectives(schedule)
    pending = list(actions)
    ran: list[str] = []
    # a compute of an FSDP stage is not ready before its UNSHARD ran
    first_compute = next(a for a in pending if a.is_compute)
    assert not coll.ready(first_compute)
    # run everything the way the dispatcher would if every input were there, but take the
    # *last* ready action each time: readiness alone must keep the events in a valid order
    while pending:
        ready = [a for a in pending if coll.ready(a)]
        assert ready, f"stuck with {pending[:4]}"
        a = ready[-1]
        pending.remove(a)
        if a.type.value in ("UNSHARD", "RESHARD", "REDUCE_GRAD"):
            coll.run(a, 0)
        coll.done(a)
        ran.append(str(a))
    # collectives were issued in list order (the same on every replica)
    listed = [str(a) for a in actions if a.type.value in ("UNSHARD", "REDUCE_GRAD")]
    assert [x for x in ran if "UNSHARD" in x or "REDUCE_GRAD" in x] == listed
    for s, u in units.items():
        assert u.calls == ["unshard", "reduce", "reshard"]
        pos = {x: i for i, x in enumerate(ran)}
        stage_work = [i for i, x in enumerate(ran) if x[0] == str(s) and x[1:2] in ("F", "B", "I", "W")]
        assert pos[f"{s}UNSHARD"] < min(stage_work)
        assert pos[f"{s}REDUCE_GRAD"] > max(i for i in stage_work if ran[i][1] in "BW")
        assert pos[f"{s}RESHARD"] > max(stage_work) and pos[f"{s}RESHARD"] > pos[f"{s}REDUCE_GRAD"]
    assert coll.outstanding == 0


def test_reduce_grad_waits_for_every_backward_and_collectives_keep_list_order() -> None:
    coll, actions, _ = _collectives("Interleaved1F1B")
    by_name = {str(a): a for a in actions}
    r2, r0 = by_name["2REDUCE_GRAD"], by_name["0REDUCE_GRAD"]
    assert not coll.ready(by_name["2UNSHARD"])  # 0UNSHARD is listed first
    coll.run(by_name["0UNSHARD"], 0)
    coll.run(by_name["2UNSHARD"], 0)
    for a in actions:
        if a.is_compute and a.stage == 0:
            coll.done(a)
    assert not coll.ready(r0)  # 2REDUCE_GRAD is listed first...
    assert not coll.ready(r2)  # ...and waits for stage 2's backward
    assert "B/W done" in coll.describe(r2)
    for a in actions:
        if a.is_compute and a.stage == 2:
            coll.done(a)
    assert coll.ready(r2) and not coll.ready(r0)


def test_unshard_of_a_parameterless_root_stays_asynchronous() -> None:
    # fsdp_wrap="blocks" wraps the stage root too; with every parameter in a child, the root's
    # unshard handle holds no groups, and all_gather_works must still return the children's Works
    import torch.distributed as dist
    from torch import nn

    from pipeloom.runtime._fsdp_private import all_gather_works
    from pipeloom.runtime.data_parallel import wrap_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    from harness import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        stage = wrap_fsdp(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), mesh, "blocks")
        handles = [m.unshard(async_op=True) for m in (stage, stage[0], stage[1])]
        works = all_gather_works(handles)
        assert works is not None, "a parameter-less root made UNSHARD fall back to a blocking wait"
        for h in handles:
            if h is not None:
                h.wait()
    finally:
        dist.destroy_process_group()


def test_fsdp_param_groups_of_either_torch() -> None:
    # torch 2.13 keeps a list of parameter groups per FSDP state and unshard handle; 2.11 one (or None)
    from types import SimpleNamespace

    from pipeloom.runtime._fsdp_private import param_groups

    a, b = object(), object()
    assert param_groups(SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]
    assert param_groups(SimpleNamespace(_fsdp_param_group=a)) == [a]
    assert param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
    # a 2.13 handle of a unit without parameters of its own (a stage root whose children hold them all):
    # no groups, so nothing to wait for; not "unknown internals", which would make UNSHARD block
    assert param_groups(SimpleNamespace(_fsdp_param_groups=None)) == []
    assert param_groups(SimpleNamespace()) is None


def test_buckets_and_replica_share() -> None:
    from pipeloom.runtime.data_parallel import _make_buckets, replica_share
    from pipeloom.runtime.pipeline import Microbatches

    params = [torch.zeros(10), torch.zeros(3, dtype=torch.float64), torch.zeros(4, dtype=torch.float64), torch.zeros(100)]
    buckets = _make_buckets(params, cap_bytes=64)
    # reverse order, one dtype per bucket, at most the cap unless a tensor alone exceeds it
    assert [len(b.params) for b in buckets] == [1, 2, 1]
    assert buckets[0].params[0] is params[3] and buckets[2].params[0] is params[0]
    assert sum(b.numel for b in buckets) == 117
    x = torch.arange(12).reshape(12, 1)
    args, kwargs, target = replica_share((x,), {"k": x, "s": 3}, x, dp=2, index=1, n=3)
    assert args[0].flatten().tolist() == list(range(6, 12)) and kwargs["s"] == 3 and target.shape[0] == 6
    mbs = replica_share((Microbatches(list(range(6))),), {}, None, dp=2, index=0, n=3)[0][0]
    assert isinstance(mbs, Microbatches) and list(mbs) == [0, 1, 2]
    with pytest.raises(ValueError, match="data_parallel"):
        replica_share((torch.zeros(5, 1),), {}, None, dp=2, index=0, n=3)


# ---------------------------------------------------------------- rank pool


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict[str, Any]]], Path, float]:
    out = tmp_path_factory.mktemp("dp")
    cases = [dict(c, trace=str(out / f"{c['id']}.trace")) if c.get("trace") else c for c in CASES]
    t0 = time.monotonic()
    results = asyncio.run(run_ranks(WORLD, cases, out, timeout=240))
    return results, out, time.monotonic() - t0


def _num_stages(cfg: dict[str, Any]) -> int:
    return PP * default_stages_per_rank(cfg["schedule"])


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_replicas_match_unsplit_model_on_global_batch(pool: Any, case_id: str) -> None:
    results = pool[0][case_id]
    cfg = next(c for c in CASES if c["id"] == case_id)
    n = cfg["microbatches"]
    ns = _num_stages(cfg)
    # the unsplit model on the whole global batch, in DP * n microbatches
    ref = reference_run({**cfg, "microbatches": DP * n}, ns)
    for rank, res in enumerate(results):
        d = rank % DP  # global rank = pp_index * DP + dp_index
        for step, want in enumerate(ref):
            got = res["grads"][step]
            assert got, f"rank {rank} holds no stage"
            for name, g in got.items():
                torch.testing.assert_close(
                    g, want["grads"][name], **TOL, msg=lambda m, name=name, step=step, rank=rank: f"rank {rank} step {step} grad {name}: {m}"
                )
            if ns - 1 in res["stages"]:
                mine = want["losses"][d * n : (d + 1) * n]
                assert len(res["losses"][step]) == n
                for a, b in zip(res["losses"][step], mine):
                    torch.testing.assert_close(a, b, **TOL)
                torch.testing.assert_close(res["outputs"][step], torch.cat(want["outputs"][d * n : (d + 1) * n]), **TOL)
                if want["eval"] is not None:
                    torch.testing.assert_close(res["eval"][step], torch.cat(want["eval"][d * n : (d + 1) * n]), **TOL)
            else:
                assert res["outputs"][step] is None
    # both replicas hold the same (updated) parameters
    for r in range(0, WORLD, DP):
        for name, p in results[r]["params"].items():
            torch.testing.assert_close(results[r + 1]["params"][name], p, rtol=0, atol=0)


def _compute(e: dict[str, Any]) -> bool:
    return e["ev"] == "action" and e["type"] in ("F", "B", "I", "W", "OVERLAP_F_B")


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES if c.get("trace") and _overlapped(c)])
def test_trace_shows_collectives_overlapping_compute(pool: Any, case_id: str) -> None:
    cfg = next(c for c in CASES if c["id"] == case_id)
    out = pool[1]
    trace = read_trace(sorted(str(p) for p in out.glob(f"{case_id}.trace.rank*")))
    assert {e["rank"] for e in trace.events} == set(range(WORLD))
    fsdp = cfg.get("fsdp", False)
    ns = _num_stages(cfg)
    overlapped = 0
    # training steps (eval steps, numbered in between, have forwards only)
    steps = sorted({e["step"] for e in trace.events if e["ev"] == "action" and e["type"] in ("B", "W", "OVERLAP_F_B")})
    assert len(steps) == cfg["steps"]
    for step in steps:
        evs = [e for e in trace.events if e.get("step") == step and e["ev"] == "action"]
        last_compute_end = max(e["end"] for e in evs if _compute(e))
        reduces = [e for e in evs if e["type"] == "REDUCE_GRAD"]
        # every stage reduced once on each of its replicas
        assert sorted(e["stage"] for e in reduces) == sorted(s for s in range(ns) for _ in range(DP))
        assert any(e["start"] < last_compute_end for e in reduces), f"step {step}: no reduction overlapped compute"
        if fsdp:
            unshards = [e for e in evs if e["type"] == "UNSHARD"]
            reshards = [e for e in evs if e["type"] == "RESHARD"]
            assert len(unshards) == len(reshards) >= ns * DP
            assert all(e["start"] < last_compute_end for e in unshards)
            # no compute of a stage before its all-gather was issued
            for r in range(WORLD):
                first_un = {e["stage"]: e["start"] for e in sorted(unshards, key=lambda e: -e["start"]) if e["rank"] == r}
                for e in evs:
                    if e["rank"] == r and _compute(e) and e["type"] != "OVERLAP_F_B":
                        assert e["start"] >= first_un[e["stage"]]
        else:
            assert not any(e["type"] in ("UNSHARD", "RESHARD") for e in evs)
        # each launch has its collective span: from the launch to when the dispatcher saw it complete
        colls = [e for e in trace.events if e["ev"] == "collective" and e["step"] == step]
        for a in reduces + ([e for e in evs if e["type"] == "UNSHARD"] if fsdp else []):
            mine = [c for c in colls if c["rank"] == a["rank"] and c["name"] == a["name"]]
            assert mine, f"no collective span for {a['name']} on rank {a['rank']}"
            assert all(a["start"] <= c["start"] <= a["end"] <= c["end"] and c["bytes"] > 0 for c in mine)
        if default_stages_per_rank(cfg["schedule"]) > 1:
            # a rank computes another stage while one stage's collective is in flight
            # (the first replica to launch a collective waits for its partner; its computes do not)
            overlapped += sum(
                1 for c in colls for e in evs
                if _compute(e) and e["rank"] == c["rank"] and c["start"] < e["start"] < c["end"]
            )
        kinds = {c["kind"] for c in colls}
        # (gloo: FSDP's gradients go through an all-reduce too, see data_parallel's docstring)
        fsdp_reduce = "reduce-scatter" if BACKEND == "nccl" else "all-reduce"
        want = {"all-gather", fsdp_reduce} if fsdp else {"all-reduce"}
        if fsdp and cfg.get("fsdp_wrap") == "linears":
            want.add("all-reduce")  # the stage's own parameters stay replicated
        assert kinds == want
    if default_stages_per_rank(cfg["schedule"]) > 1:
        assert overlapped > 0, "no compute ran while a collective of its rank was in flight"


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES if c.get("trace") and not _overlapped(c)])
def test_trace_without_overlap_shows_collectives_blocking(pool: Any, case_id: str) -> None:
    # overlap_collectives=False: every collective completes inside the UNSHARD / REDUCE_GRAD
    # action that launched it, and its rank computes nothing meanwhile
    cfg = next(c for c in CASES if c["id"] == case_id)
    trace = read_trace(sorted(str(p) for p in pool[1].glob(f"{case_id}.trace.rank*")))
    steps = sorted({e["step"] for e in trace.events if e["ev"] == "action" and e["type"] in ("B", "W")})
    assert len(steps) == cfg["steps"]
    ns = _num_stages(cfg)
    for step in steps:
        evs = [e for e in trace.events if e.get("step") == step and e["ev"] == "action"]
        colls = [e for e in trace.events if e["ev"] == "collective" and e["step"] == step]
        launches = [e for e in evs if e["type"] in ("UNSHARD", "REDUCE_GRAD")]
        assert len([e for e in launches if e["type"] == "REDUCE_GRAD"]) == ns * DP
        for a in launches:
            mine = [c for c in colls if c["rank"] == a["rank"] and c["name"] == a["name"]]
            assert mine, f"no collective span for {a['name']} on rank {a['rank']}"
            assert all(a["start"] <= c["start"] <= c["end"] <= a["end"] for c in mine), (a, mine)
        for c in colls:
            assert not any(
                _compute(e) and e["rank"] == c["rank"] and c["start"] < e["end"] and e["start"] < c["end"] for e in evs
            ), f"rank {c['rank']} computed during {c['name']}'s {c['kind']}"


def test_pool_time(pool: Any) -> None:
    # the whole 4-rank pool (start-up included) stays well inside the suite's budget
    assert pool[2] < 120, f"the data-parallel pool took {pool[2]:.1f} s"


# ---------------------------------------------------------------- faults


def _records(out: Path) -> list[dict[str, Any]]:
    recs = []
    for r in range(WORLD):
        p = out / f"rank{r}.json"
        recs.append(json.loads(p.read_text()) if p.exists() else {"rank": r, "status": "no record"})
    return recs


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
async def test_dead_rank_of_one_replica_stops_every_rank(tmp_path: Path, fsdp: bool) -> None:
    # rank 1 is pipeline rank 0 of replica 1; it SIGKILLs itself in the middle of step 1
    env = {"HB_TIMEOUT": "2", "DP": str(DP), "FSDP": "1" if fsdp else "0"}
    t0 = time.monotonic()
    codes, _, errs = await spawn_ranks(WORLD, [FAULT_WORKER, "kill", str(tmp_path)], timeout=60, env=env)
    elapsed = time.monotonic() - t0
    assert codes[1] == -signal.SIGKILL, errs[1][-2000:]
    recs = _records(tmp_path)
    for r in (0, 2, 3):
        assert codes[r] == 1, f"rank {r}: exit {codes[r]}\n{errs[r][-3000:]}"
        assert recs[r]["status"] == "error", recs[r]
        assert recs[r]["type"] in ("PeerLostError", "RemoteRankError"), recs[r]
    # every survivor names rank 1: its pipeline peer and its data-parallel peer from their own
    # failed transfers, the rest from their abort message (or, at worst, a heartbeat timeout)
    for r in (0, 2, 3):
        assert "lost rank 1" in recs[r]["message"], recs[r]
    times = [recs[r]["t"] for r in (0, 2, 3)]
    assert max(times) - min(times) < 3, times
    assert elapsed < 45


async def test_user_error_on_one_replica_stops_every_rank(tmp_path: Path) -> None:
    env = {"DP": str(DP), "FSDP": "1"}
    codes, _, errs = await spawn_ranks(WORLD, [FAULT_WORKER, "raise", str(tmp_path)], timeout=60, env=env)
    assert codes == [1] * WORLD, [e[-1500:] for e in errs]
    recs = _records(tmp_path)
    assert recs[1]["type"] == "StageError" and "boom in user code" in recs[1]["message"]
    for r in (0, 2, 3):
        assert recs[r]["type"] == "RemoteRankError" and recs[r]["failed_rank"] == 1, recs[r]
        assert abs(recs[r]["t"] - recs[1]["t"]) < 3.0
