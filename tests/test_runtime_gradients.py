"""Every named schedule on real gloo ranks: gradients, losses and outputs equal the unsplit model's.

Declarative: each case is a row (id, ranks, config); one pool of rank
processes per rank count runs all of its rows (starting torch per case would
cost more than the cases), then each row is checked on its own against

- the unsplit model run in this process on the same microbatches (float64,
  so the tolerance can be tight), and
- for ``oracle`` rows, torch.distributed.pipelining's class of the same name
  run on the same stages in the same rank pool.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import run_ranks  # noqa: E402
from reference import reference_run  # noqa: E402

from pipeloom.schedules import default_stages_per_rank, dump_csv, generate  # noqa: E402
from pipeloom.schedules.dispatch import OVERLAP_MARGIN  # noqa: E402

# float64 throughout.  On GPUs (PIPELOOM_TEST_BACKEND=nccl) the stages' reductions run in
# another order than the CPU reference's: the custom Function's parameter-gradient sum of
# the awkward model differed by up to 1.6e-11 absolute (2 x H100, torch 2.11), on 1F1B's
# full backward as much as on the split schedules.
TOL = dict(rtol=1e-10, atol=1e-12) if os.environ.get("PIPELOOM_TEST_BACKEND", "gloo") != "nccl" else dict(rtol=1e-9, atol=1e-10)

MICROBATCHES_2 = {
    "GPipe": [1, 3, 4],
    "1F1B": [2, 4, 5],
    "Interleaved1F1B": [2, 4, 6],
    "LoopedBFS": [2, 3],
    "InterleavedZeroBubble": [2, 4],
    "ZBVZeroBubble": [1, 4, 6],
    "DualPipeV": [4, 6],
}
MICROBATCHES_4 = {
    "GPipe": [4],
    "1F1B": [4, 8],
    "Interleaved1F1B": [8],
    "LoopedBFS": [4],
    "InterleavedZeroBubble": [4],
    "ZBVZeroBubble": [8],
    "DualPipeV": [8],
}


def _cases(world: int, table: dict[str, list[int]]) -> list[dict[str, Any]]:
    cases = []
    for name, mbs in table.items():
        for n in mbs:
            cases.append(dict(id=f"{name}-m{n}", schedule=name, microbatches=n, dim=4, batch=2 * n, steps=2, eval=True))
    return cases


def _special_cases_2() -> list[dict[str, Any]]:
    return [
        # several tensors between stages, a kwarg every stage uses, uneven split (66 rows in 4)
        dict(id="multi-kwargs-uneven", schedule="Interleaved1F1B", microbatches=4, dim=4, batch=66, multi=True, kwargs=True, steps=2, eval=True),
        dict(id="multi-zbv", schedule="ZBVZeroBubble", microbatches=4, dim=4, batch=8, multi=True, kwargs=True, steps=2, eval=True),
        dict(id="multi-dualpipev", schedule="DualPipeV", microbatches=4, dim=4, batch=10, multi=True, steps=1, eval=True),
        # sequence length changes across steps, and from microbatch to microbatch
        dict(id="seq-per-step", schedule="1F1B", microbatches=4, dim=4, batch=8, seq=[3, 7, 5], steps=3, eval=True),
        dict(id="seq-per-mb", schedule="ZBVZeroBubble", microbatches=4, dim=4, batch=8, seq="per_mb", steps=3, eval=True),
        dict(id="seq-per-mb-dualpipev", schedule="DualPipeV", microbatches=4, dim=4, batch=8, seq="per_mb", steps=2),
        # the batch shrinks and grows between steps
        dict(id="batch-changes", schedule="InterleavedZeroBubble", microbatches=4, dim=4, batch=[8, 6, 13], steps=3),
        dict(id="deterministic-zbv", schedule="ZBVZeroBubble", microbatches=4, dim=4, batch=8, steps=2, deterministic=True),
        dict(id="deterministic-i1f1b", schedule="Interleaved1F1B", microbatches=4, dim=4, batch=8, steps=2, deterministic=True),
        # each dispatch rule explicitly (the default "auto" picks one per schedule), uneven lengths included
        dict(id="dispatch-ready-zbv", schedule="ZBVZeroBubble", microbatches=6, dim=4, batch=12, seq="per_mb", steps=2, dispatch="ready"),
        dict(id="dispatch-guarded-zbv", schedule="ZBVZeroBubble", microbatches=6, dim=4, batch=12, seq="per_mb", steps=2, dispatch="guarded", eval=True),
        dict(id="dispatch-guarded-dualpipev", schedule="DualPipeV", microbatches=6, dim=4, batch=12, steps=2, dispatch="guarded"),
        dict(id="dispatch-ready-gpipe", schedule="GPipe", microbatches=4, dim=4, batch=8, seq="per_mb", steps=2, dispatch="ready"),
        dict(id="dispatch-critical-zbv", schedule="ZBVZeroBubble", microbatches=6, dim=4, batch=12, seq="per_mb", steps=2, dispatch="critical"),
        dict(id="dispatch-critical-i1f1b", schedule="Interleaved1F1B", microbatches=4, dim=4, batch=8, steps=2, dispatch="critical", eval=True),
        # a schedule read from a CSV file (written below)
        dict(id="csv", schedule="InterleavedZeroBubble", csv="@csv", microbatches=4, dim=4, batch=8, steps=2),
    ] + _awkward_cases(2)


# Stages that reuse parameters (a Linear twice, tied weights, recurrence, a parametrization,
# a custom Function, in-place ops), the same under activation checkpointing, compiled stages,
# and a trainable set that changes between steps: every split schedule (and 1F1B as control).
AWKWARD_SCHEDULES = {2: ["1F1B", "ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"], 4: ["ZBVZeroBubble", "DualPipeV"]}
_FREEZE = [["lin.weight"], [], ["cell.0.weight", "cell.0.bias", "gain"]]


def _nccl_protocol_cases(world: int, table: dict[str, list[int]]) -> list[dict[str, Any]]:
    """The NCCL transfer protocol (on gloo: ``emulate_nccl_transport``): headers, and static shapes.

    Static shapes: the first step of each kind (training, evaluation) learns the shapes with
    headers, the later ones run without (each rank sends in list order, receives posted before
    the sender has produced), so 3 steps with evaluation after each.
    """
    out = []
    for name, mbs in table.items():
        n = mbs[-1]
        base = dict(schedule=name, microbatches=n, dim=4, batch=2 * n, steps=3, eval=True)
        out.append({**base, "id": f"static-{name}", "options": {"static_shapes": True, "emulate_nccl_transport": True}})
        if world == 2:
            out.append({**base, "id": f"nccl-headers-{name}", "steps": 2, "options": {"static_shapes": False, "emulate_nccl_transport": True}})
            # auto (the default): headerless from the second step with the same inputs
            out.append({**base, "id": f"auto-{name}", "options": {"emulate_nccl_transport": True}, "headerless": [False, True, True]})
    if world == 2:
        opts = {"static_shapes": True, "emulate_nccl_transport": True}
        auto = {"emulate_nccl_transport": True}
        out += [
            # auto: two input layouts that recur (a batch size, a sequence length): each learned once
            dict(id="auto-batch-recurs", schedule="1F1B", microbatches=4, dim=4, batch=[8, 12, 8, 12, 8], steps=5, eval=True,
                 options=auto, headerless=[False, False, True, True, True]),
            dict(id="auto-seq-recurs-zbv", schedule="ZBVZeroBubble", microbatches=4, dim=4, batch=8, seq=[3, 5, 3, 5], steps=4,
                 eval=True, options=auto, headerless=[False, False, True, True]),
            # auto: a new layout after a headerless step, sharing the first microbatches' lengths with the
            # last layout that had headers (its transfers predicted from that step's: both sides must agree)
            dict(id="auto-new-layout-after-static", schedule="1F1B", microbatches=4, dim=4, batch=8,
                 seq=[[3, 5, 3, 5], [3, 5, 3, 5], [3, 5, 4, 4], [3, 5, 4, 4], [3, 5, 3, 5]], steps=5, eval=True,
                 options=auto, headerless=[False, True, False, True, True]),
            dict(id="gloo-new-layout-after-static-zbv", schedule="ZBVZeroBubble", microbatches=4, dim=4, batch=8,
                 seq=[[3, 5, 3, 5], [3, 5, 3, 5], [3, 5, 4, 4], [3, 5, 4, 4]], steps=4, eval=True,
                 headerless=[False, True, False, True]),
            # auto: every step's microbatch lengths differ from the last ones': always headers
            dict(id="auto-per-mb-dualpipev", schedule="DualPipeV", microbatches=4, dim=4, batch=8, seq="per_mb", steps=3,
                 options=auto, headerless=[False, False, False]),
            # several tensors per transfer, kwargs, an uneven last microbatch (shapes differ between microbatches)
            dict(id="static-multi-kwargs-uneven", schedule="Interleaved1F1B", microbatches=4, dim=4, batch=66, multi=True, kwargs=True,
                 steps=3, eval=True, options=opts),
            dict(id="static-awkward-zbv", schedule="ZBVZeroBubble", microbatches=4, dim=4, batch=8, model="awkward", steps=3, options=opts),
            dict(id="static-deterministic-dualpipev", schedule="DualPipeV", microbatches=6, dim=4, batch=12, steps=3, deterministic=True,
                 options=opts),
            dict(id="static-critical-zbv", schedule="ZBVZeroBubble", microbatches=6, dim=4, batch=12, steps=3, dispatch="critical", options=opts),
            # RuntimeOptions.batch_p2p: each transfer's payload posted as one batch_isend_irecv (several tensors,
            # kwargs, uneven, the first step with headers and the later without; gloo's own static path)
            dict(id="batch-p2p-multi-kwargs-uneven", schedule="Interleaved1F1B", microbatches=4, dim=4, batch=66, multi=True,
                 kwargs=True, steps=3, eval=True, options={**opts, "batch_p2p": True}),
            dict(id="batch-p2p-gloo-dualpipev", schedule="DualPipeV", microbatches=4, dim=4, batch=8, steps=3, eval=True,
                 options={"batch_p2p": True}, headerless=[False, True, True]),
            # RuntimeOptions.host_overlap_backward: each B followed by an F in the list launched on a worker thread
            # while the F runs (the first training step inline: it checks that the forwards draw no random
            # numbers); gradients equal the unsplit model's
            dict(id="host-overlap-1F1B", schedule="1F1B", microbatches=4, dim=4, batch=8, steps=3, eval=True,
                 options={"host_overlap_backward": True}, overlapped=[False, True, True]),
            dict(id="host-overlap-headers-1F1B", schedule="1F1B", microbatches=6, dim=4, batch=12, steps=3,
                 options={"host_overlap_backward": True, "static_shapes": False}, overlapped=[False, True, True]),
            dict(id="host-overlap-nccl-protocol-multi-kwargs-uneven", schedule="Interleaved1F1B", microbatches=4, dim=4,
                 batch=66, multi=True, kwargs=True, steps=3, eval=True, options={**opts, "host_overlap_backward": True},
                 overlapped=[False, True, True]),
            dict(id="host-overlap-awkward-ckpt-1F1B", schedule="1F1B", microbatches=4, dim=4, batch=8, model="awkward-ckpt",
                 steps=3, options={"host_overlap_backward": True}, overlapped=[False, True, True]),
            # RuntimeOptions.host_queue_backwards: a backward the list runs right after another queued behind it on
            # the worker (GPipe's backward phase, 1F1B's drain), its input's wait left to the worker (NCCL protocol)
            dict(id="host-queue-GPipe", deterministic=True, schedule="GPipe", microbatches=4, dim=4, batch=8, steps=3, eval=True,
                 options={"host_overlap_backward": True, "host_queue_backwards": True}, overlapped=[False, True, True],
                 queued=[False, True, True]),
            dict(id="host-queue-nccl-protocol-GPipe", deterministic=True, schedule="GPipe", microbatches=4, dim=4, batch=8, steps=3,
                 options={**opts, "host_overlap_backward": True, "host_queue_backwards": True},
                 overlapped=[False, True, True], queued=[False, True, True]),
            dict(id="host-queue-nccl-protocol-1F1B", schedule="1F1B", microbatches=6, dim=4, batch=12, steps=3,
                 options={**opts, "host_overlap_backward": True, "host_queue_backwards": True},
                 overlapped=[False, True, True]),
            dict(id="host-queue-headers-LoopedBFS", deterministic=True, schedule="LoopedBFS", microbatches=4, dim=4, batch=8, steps=3,
                 options={"host_overlap_backward": True, "host_queue_backwards": True, "static_shapes": False},
                 overlapped=[False, True, True]),  # (with headers a backward is queued only if its input came in time)
            dict(id="host-queue-awkward-ckpt-GPipe", deterministic=True, schedule="GPipe", microbatches=4, dim=4, batch=8, model="awkward-ckpt",
                 steps=3, options={"host_overlap_backward": True, "host_queue_backwards": True}, overlapped=[False, True, True],
                 queued=[False, True, True]),
            # auto (the default): never on CPU ranks; on GPUs, stages on two streams overlap from the second
            # training step, one stream once the B's host launch is learned to outlast the B's and the F's
            # device times (tiny stages: host-bound; decided once the two learning steps' launches are timed: their
            # events complete behind the learning sleeps (gpu_learn_sleep), a step or two after the host ended them)
            dict(id="host-overlap-auto-1F1B", schedule="1F1B", microbatches=4, dim=4, batch=8, steps=6,
                 overlapped={"gloo": [False] * 6, "nccl": [False, False, None, None, True, True]}),
            # (overlap_streams auto: Interleaved1F1B's stages share one stream, so the one-stream rule decides)
            dict(id="host-overlap-auto-Interleaved1F1B", schedule="Interleaved1F1B", microbatches=4, dim=4, batch=8, steps=6,
                 overlapped={"gloo": [False] * 6, "nccl": [False, False, None, None, True, True]}),
            # a stream per stage: B and F of different stages always side by side from the second training step
            dict(id="host-overlap-auto-streams-Interleaved1F1B", schedule="Interleaved1F1B", microbatches=4, dim=4, batch=8,
                 steps=3, options={"overlap_streams": True}, overlapped={"gloo": [False] * 3, "nccl": [False, True, True]}),
            # forwards that draw random numbers: the overlap stays off (a checkpoint's recomputation would race them)
            dict(id="host-overlap-draws-1F1B", schedule="1F1B", microbatches=4, dim=4, batch=8, model="draws", steps=3,
                 options={"host_overlap_backward": True}, overlapped=[False, False, False]),
        ]
    return out


def _awkward_cases(world: int) -> list[dict[str, Any]]:
    out = []
    for name in AWKWARD_SCHEDULES[world]:
        n = 2 * world
        base = dict(schedule=name, microbatches=n, dim=4, batch=2 * n, steps=2, model="awkward")
        out.append({**base, "id": f"awkward-{name}", "eval": True})
        if world == 2 or name == "ZBVZeroBubble":
            out.append({**base, "id": f"awkward-ckpt-{name}", "model": "awkward-ckpt"})
            out.append({**base, "id": f"awkward-freeze-{name}", "steps": 3, "freeze": _FREEZE})
        if world == 2 and name != "1F1B":
            out.append({**base, "id": f"compiled-{name}", "compile": "aot_eager", "steps": 2})
        if world == 2 and name in ("ZBVZeroBubble", "DualPipeV"):
            # a weight tied between the first and last stage, both on rank 0 (optimizer steps it once)
            out.append({**base, "id": f"tied-ends-{name}", "model": "tied-ends", "steps": 3})
    return out


def _graph_cases(world: int) -> list[dict[str, Any]]:
    """RuntimeOptions.cuda_graphs (GPUs only): captured after the first training step, replayed in the later ones
    (``graphed``: per step, whether every rank replayed forwards from graphs)."""
    if BACKEND != "nccl":
        return []
    g = {"cuda_graphs": True}
    n = 2 * world
    names = ["1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"] if world == 2 else ["1F1B", "Interleaved1F1B", "DualPipeV"]
    out = [dict(id=f"graphs-{name}", schedule=name, microbatches=n, dim=4, batch=2 * n, steps=3, eval=True, options=g,
                graphed=[False, True, True]) for name in names]
    if world == 2:
        awkward = dict(microbatches=n, dim=4, batch=2 * n, steps=3, options=g, graphed=[False, True, True])
        out += [
            # a custom Function, recurrence, a parameter used twice; checkpointing; a weight tied across two stages
            dict(awkward, id="graphs-awkward-1F1B", schedule="1F1B", model="awkward"),
            dict(awkward, id="graphs-awkward-ckpt-Interleaved1F1B", schedule="Interleaved1F1B", model="awkward-ckpt"),
            dict(awkward, id="graphs-tied-ends-DualPipeV", schedule="DualPipeV", model="tied-ends"),
            # the trainable set changes: the graphs are dropped and captured again
            dict(awkward, id="graphs-freeze-1F1B", schedule="1F1B", model="awkward", steps=4,
                 freeze=[["lin.weight"], ["lin.weight"], [], []], graphed=[False, True, False, True]),
            # backwards launched on the worker thread (their replays on its stream)
            dict(awkward, id="graphs-host-overlap-1F1B", schedule="1F1B", model="block",
                 options={**g, "host_overlap_backward": True}, overlapped=[False, True, True]),
            # another sequence length each step: only the captured one replays
            dict(id="graphs-seq-per-step", schedule="1F1B", microbatches=4, dim=4, batch=8, seq=[3, 7, 3], steps=3, options=g,
                 graphed=[False, False, True]),
            # a keyword tensor every stage takes: a graph input like the positional ones (replayed from step 1)
            dict(id="graphs-kwargs", schedule="1F1B", microbatches=4, dim=4, batch=8, kwargs=True, steps=2, options=g,
                 graphed=[False, True]),
            # the last stage's loss captured with it (cuda_graphs_loss)
            dict(awkward, id="graphs-loss-1F1B", schedule="1F1B", model="awkward", options={**g, "cuda_graphs_loss": True}),
            dict(awkward, id="graphs-loss-ZBVZeroBubble", schedule="ZBVZeroBubble", options={**g, "cuda_graphs_loss": True}),
        ]
    return out


ORACLE_2 = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
ORACLE_4 = ["Interleaved1F1B", "ZBVZeroBubble"]


def _oracle_cases(names: list[str], n: int, table: dict[str, list[int]]) -> list[dict[str, Any]]:
    """torch.distributed.pipelining's run of each schedule (one step, ``n`` microbatches, ``2 n`` rows); pipeloom's side
    is the first step of the row ``{name}-m{n}`` of ``table`` where there is one (the same stages, seed, batch and
    default options: its step 0 is that computation exactly), else a one-step row ``oracle-pipeloom-{name}``."""
    out = []
    for name in names:
        base = dict(schedule=name, microbatches=n, dim=4, batch=2 * n, steps=1)
        if n not in table.get(name, []):
            out.append({**base, "id": f"oracle-pipeloom-{name}"})
        out.append({**base, "id": f"oracle-torch-{name}", "engine": "torch"})
    return out


def _oracle_ours(world: int, name: str) -> str:
    """The row whose first step is pipeloom's side of the comparison with torch's ``name``."""
    n, table = (4, MICROBATCHES_2) if world == 2 else (8, MICROBATCHES_4)
    return f"{name}-m{n}" if n in table.get(name, []) else f"oracle-pipeloom-{name}"


# PIPELOOM_TEST_BACKEND=nccl runs the same cases on GPUs (one rank per GPU, so
# the 4-rank pool only where 4 GPUs are visible); the default is gloo on CPU.
BACKEND = os.environ.get("PIPELOOM_TEST_BACKEND", "gloo")
CASES = {
    2: _cases(2, MICROBATCHES_2) + _special_cases_2() + _oracle_cases(ORACLE_2, 4, MICROBATCHES_2) + _nccl_protocol_cases(2, MICROBATCHES_2)
    + _graph_cases(2),
    4: _cases(4, MICROBATCHES_4) + _oracle_cases(ORACLE_4, 8, MICROBATCHES_4) + _awkward_cases(4) + _nccl_protocol_cases(4, MICROBATCHES_4) + _graph_cases(4) + [
        dict(id="dispatch-guarded-dualpipev-4", schedule="DualPipeV", microbatches=8, dim=4, batch=16, seq="per_mb", steps=2, dispatch="guarded"),
        # options.host_overlap_backward on 4 ranks (the middle stages receive and send both ways)
        dict(id="host-overlap-1F1B-4", schedule="1F1B", microbatches=8, dim=4, batch=16, steps=3,
             options={"host_overlap_backward": True}, overlapped=[False, True, True]),
        # one process group per ordered rank pair, as on NCCL (connected in one global order at
        # construction), incl. the loop edge 3 -> 0; last: the worker keeps the variable set
        dict(id="pair-groups-interleaved1f1b", schedule="Interleaved1F1B", microbatches=8, dim=4, batch=16, steps=2,
             env={"PIPELOOM_PAIR_GROUPS": "1"}),
    ],
}
if BACKEND == "nccl" and torch.cuda.device_count() < 4:
    del CASES[4]
# PIPELOOM_TEST_CASES=graphs,static: only the rows whose id contains one of these (a GPU session's short run)
if os.environ.get("PIPELOOM_TEST_CASES"):
    _only = os.environ["PIPELOOM_TEST_CASES"].split(",")
    CASES = {w: [c for c in cs if any(o in c["id"] for o in _only)] for w, cs in CASES.items()}
    CASES = {w: cs for w, cs in CASES.items() if cs}


def _pool_world(item: pytest.Item) -> int:
    """The rank pool a collected test reads: its `world` parameter, else 4 for the four-rank tests, else 2."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "world" in callspec.params:
        return int(callspec.params["world"])
    return 4 if "four_ranks" in getattr(item, "originalname", item.name) else 2


@pytest.fixture(scope="module")
def pool_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, list[dict[str, Any]]]]:
    # only the pools the selected tests read: `-k four_ranks` must not wait for the 2-rank pool first (on NCCL the
    # two pools together outlast the per-test timeout that the first test's setup runs under)
    needed = {_pool_world(item) for item in request.session.items if "pool_results" in getattr(item, "fixturenames", ())}
    results = {}
    for world, cases in CASES.items():
        if world not in needed:
            continue
        out = tmp_path_factory.mktemp(f"ranks{world}")
        for c in cases:
            if c.get("csv") == "@csv":
                path = out / "schedule.csv"
                dump_csv(generate(c["schedule"], num_ranks=world, num_microbatches=c["microbatches"]), path)
                c["csv"] = str(path)
        results[world] = asyncio.run(run_ranks(world, cases, out, timeout=240))
    return results


def _num_stages(cfg: dict[str, Any], world: int) -> int:
    return world * (cfg.get("stages_per_rank") or default_stages_per_rank(cfg["schedule"]))


def _merged(results: list[dict[str, Any]], key: str, step: int) -> Any:
    merged: dict[str, Any] = {}
    for r in results:
        merged.update(r[key][step])
    return merged


def _last_rank(results: list[dict[str, Any]], num_stages: int) -> dict[str, Any]:
    return next(r for r in results if num_stages - 1 in r.get("stages", [num_stages - 1]))


def _ids(world: int) -> list[str]:
    return [c["id"] for c in CASES.get(world, []) if not c["id"].startswith("oracle-")]


def _has(world: int, *ids: str) -> bool:
    """Whether the pool of ``world`` ranks runs these cases (``PIPELOOM_TEST_CASES`` may leave them out)."""
    have = {c["id"] for c in CASES.get(world, [])}
    return all(i in have for i in ids)


def _check_against_reference(world: int, cfg: dict[str, Any], results: list[dict[str, Any]]) -> None:
    ns = _num_stages(cfg, world)
    ref = reference_run(cfg, ns)
    last = _last_rank(results, ns)
    for step, want in enumerate(ref):
        got = _merged(results, "grads", step)
        assert set(got) == set(want["grads"]), f"step {step}: parameters differ"
        for name, g in want["grads"].items():
            torch.testing.assert_close(got[name], g, **TOL, msg=lambda m, name=name, step=step: f"step {step} grad {name}: {m}")
        assert len(last["losses"][step]) == cfg["microbatches"]
        for m, (a, b) in enumerate(zip(last["losses"][step], want["losses"])):
            torch.testing.assert_close(a, b, **TOL, msg=lambda msg, m=m: f"step {step} loss of microbatch {m}: {msg}")
        out = last["outputs"][step]
        if isinstance(out, list):  # pre-cut microbatches of their own lengths: a list of outputs
            assert isinstance(out, list) and len(out) == cfg["microbatches"]
            for a, b in zip(out, want["outputs"]):
                torch.testing.assert_close(a, b, **TOL)
        else:
            torch.testing.assert_close(out, torch.cat(want["outputs"]), **TOL)
        if want["eval"] is not None:
            ev = last["eval"][step]
            if isinstance(ev, list):
                for a, b in zip(ev, want["eval"]):
                    torch.testing.assert_close(a, b, **TOL)
            else:
                torch.testing.assert_close(ev, torch.cat(want["eval"]), **TOL)
    # ranks not holding the last stage return None
    for r in results:
        if r is not last:
            assert all(o is None for o in r["outputs"])


def _check_overlapped(world: int, cfg: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """options.host_overlap_backward: which steps launched backwards on the worker thread (every rank)."""
    want = cfg.get("overlapped")
    if isinstance(want, dict):  # (auto: per backend)
        want = want[BACKEND]
    if want is None:
        if BACKEND == "nccl" and cfg.get("options", {}).get("host_overlap_backward") is None:
            return  # auto on GPUs: where the learned times say so (the gradients are checked all the same)
        assert all(s["overlapped_backwards"] == 0 for r in results for s in r["stats"] if s is not None)
        return
    auto = cfg.get("options", {}).get("host_overlap_backward") is None
    for step, on in enumerate(want):
        if on is None:  # (auto, one stream: the step that learns the times may go either way)
            continue
        n = [r["stats"][step]["overlapped_backwards"] for r in results]
        if on and auto and BACKEND == "nccl":
            # auto on one stream: by this step every rank has decided, by the rule on what it learned (whether a
            # dim-4 model's backward launch outlasts its kernels depends on the host: a fast one may say no), and
            # launched accordingly
            for rank, r in enumerate(results):
                bg = r["bg"][step]
                assert bg["decided"], f"rank {rank} step {step}: host_overlap_backward auto undecided: {bg}"
                for pair, yes in bg["decided"].items():
                    if not bg["one_stream"][pair]:
                        assert yes, f"rank {rank} step {step}: a pair on two streams not overlapped: {bg}"
                        continue
                    # (what the decision read then: the host mean keeps learning after it)
                    host_b, dev_b, dev_f = bg["inputs"][pair]
                    assert None not in (host_b, dev_b, dev_f), f"rank {rank} step {step}: decided unlearned: {bg}"
                    assert yes == (host_b > OVERLAP_MARGIN * (dev_b + dev_f)), f"rank {rank} step {step}: not the rule: {bg}"
                # (host_overlap_trial: a host-heavy pair the rule kept inline went beside in this step if the trial
                # was in a beside block, or had kept it; the state is the one the step ran under)
                trial = bg.get("trial") or {}
                tried = bool(trial.get("pairs")) and bool(trial.get("on"))
                assert (n[rank] > 0) == (any(bg["decided"].values()) or tried), (
                    f"rank {rank} step {step}: {n[rank]} backwards overlapped, decisions {bg}")
            continue
        assert all(x > 0 for x in n) if on else n == [0] * world, f"step {step}: backwards overlapped per rank {n}"
    for step, on in enumerate(cfg.get("queued") or []):  # (host_queue_backwards: queued behind another one)
        n = [r["stats"][step]["queued_backwards"] for r in results]
        assert all(x > 0 for x in n) if on else n == [0] * world, f"step {step}: backwards queued per rank {n}"


def _check_headerless(world: int, cfg: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """Static shapes: which steps ran without headers (True: all after the first; auto: as listed)."""
    want = cfg.get("headerless")
    if want is None:
        if not cfg.get("options", {}).get("static_shapes"):
            return
        want = [step > 0 for step in range(cfg["steps"])]
    for step in range(cfg["steps"]):
        sent = [r["stats"][step]["headerless_sends"] for r in results]
        if not want[step]:
            assert sent == [0] * world, f"step {step} must learn the shapes with headers: {sent}"
        else:
            assert all(n > 0 for n in sent), f"step {step}: some rank sent with headers: {sent}"


def _check_graphed(cfg: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """options.cuda_graphs: which steps replayed forwards from graphs, on every rank (none without the option)."""
    want = cfg.get("graphed")
    # every rank's count per step in the message (a GPU session sees all ranks' outcome from one failure)
    counts = [[(s or {}).get("graphed_forwards", 0) for s in r["stats"]] for r in results]
    for k, r in enumerate(results):
        for step, s in enumerate(r["stats"]):
            if s is None:
                continue
            n = s.get("graphed_forwards", 0)
            if want is None or not want[step]:
                assert n == 0, f"rank {k} step {step}: {n} forwards replayed from graphs, expected none (per rank and step: {counts})"
            else:
                assert n > 0, (f"rank {k} step {step}: no forward replayed from a graph (not captured: {r.get('graphs_disabled')}; "
                               f"per rank and step: {counts})")


@pytest.mark.parametrize("case_id", _ids(2))
def test_two_ranks_match_unsplit_model(pool_results: Any, case_id: str) -> None:
    cfg = next(c for c in CASES[2] if c["id"] == case_id)
    _check_against_reference(2, cfg, pool_results[2][case_id])
    _check_headerless(2, cfg, pool_results[2][case_id])
    _check_overlapped(2, cfg, pool_results[2][case_id])
    _check_graphed(cfg, pool_results[2][case_id])


@pytest.mark.parametrize("case_id", _ids(4))
def test_four_ranks_match_unsplit_model(pool_results: Any, case_id: str) -> None:
    cfg = next(c for c in CASES[4] if c["id"] == case_id)
    _check_against_reference(4, cfg, pool_results[4][case_id])
    _check_headerless(4, cfg, pool_results[4][case_id])
    _check_overlapped(4, cfg, pool_results[4][case_id])
    _check_graphed(cfg, pool_results[4][case_id])


@pytest.mark.parametrize("world,name", [(w, n) for w, names in ((2, ORACLE_2), (4, ORACLE_4)) for n in names
                                         if _has(w, _oracle_ours(w, n), f"oracle-torch-{n}")])
def test_same_gradients_as_torch_pipelining(pool_results: Any, world: int, name: str) -> None:
    ours = pool_results[world][_oracle_ours(world, name)]
    theirs = pool_results[world][f"oracle-torch-{name}"]
    g_ours, g_theirs = _merged(ours, "grads", 0), _merged(theirs, "grads", 0)
    assert set(g_ours) == set(g_theirs)
    for k in g_ours:
        torch.testing.assert_close(g_ours[k], g_theirs[k], **TOL, msg=lambda m, k=k: f"{name} grad {k}: {m}")
    ns = world * default_stages_per_rank(name)
    l_ours = _last_rank(ours, ns)["losses"][0]
    l_theirs = [l for r in theirs for l in r["losses"][0]]
    torch.testing.assert_close(torch.stack(l_ours), torch.stack(l_theirs), **TOL)


@pytest.mark.parametrize("dyn_id,det_id", [("ZBVZeroBubble-m6", "deterministic-zbv")] if _has(2, "ZBVZeroBubble-m6", "deterministic-zbv") else [])
def test_dynamic_dispatch_reorders_but_deterministic_does_not(pool_results: Any, dyn_id: str, det_id: str) -> None:
    dyn = pool_results[2][dyn_id]
    det = pool_results[2][det_id]
    assert all(s["out_of_order"] == 0 for r in det for s in r["stats"])
    # every rank ran every one of its actions in each step
    for r in dyn + det:
        assert all(s["actions_run"] > 0 for s in r["stats"])
