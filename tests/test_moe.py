"""Expert parallelism inside pipeline stages: pp 2 x ep 2 on 4 real rank processes.

The MoE model of ``tests/ranks/moe_model.py`` (every stage a dense layer and
an MoE layer whose 4 experts are sharded over the 2 ep ranks of the stage)
trains under every named schedule, DualPipeV's and ZBV's OVERLAP_F_B pairs
included; every rank's gradients must equal the unsplit model's on one
process with all experts gathered (float64, tight tolerance), the
non-expert ones whole and the expert ones for the experts the rank holds.
``PIPELOOM_TEST_BACKEND=nccl`` runs the same pool on 4 GPUs.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import run_ranks  # noqa: E402
from moe_model import EXPERTS, MoEStage, loss_fn, make_batch  # noqa: E402

from pipeloom.schedules import default_stages_per_rank  # noqa: E402

BACKEND = os.environ.get("PIPELOOM_TEST_BACKEND", "gloo")
TOL = dict(rtol=1e-10, atol=1e-12) if BACKEND == "gloo" else dict(rtol=1e-9, atol=1e-10)
WORLD, EP = 4, 2
PP = WORLD // EP
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
_BASE = dict(microbatches=4, ep=EP, rows=16, seq=3, steps=2)
# eval() (forwards only, their all-to-alls under no_grad) after the optimizer step, on two of them
# clip_grad_norm_ (max norm well under the gradients' norm, so it scales) on two of them
CASES: list[dict[str, Any]] = [dict(_BASE, id=f"ep-{s}", schedule=s, eval=s in ("DualPipeV", "Interleaved1F1B"),
                                    clip=0.01 if s in ("1F1B", "DualPipeV") else None)
                               for s in SCHEDULES]
# the same layout given as a DeviceMesh with dims ("pp", "ep")
CASES.append(dict(_BASE, id="ep-mesh-ZBVZeroBubble", schedule="ZBVZeroBubble", eval=False, clip=None,
                  mesh=True))
# DualPipeV with each pair's backward split: (F;I) overlapped, W after (schedules.overlap_input_only)
CASES.append(dict(_BASE, id="ep-DualPipeV-input-only", schedule="DualPipeV", eval=False, clip=None,
                  overlap_input_only=True))
# checkpoints: trained with pp 2 x ep 2 (momentum: optimizer state per expert shard), saved, then
# loaded under the same layout and under pp 4 without expert parallelism (every expert on each rank)
CKPT_CASES = [
    dict(_BASE, id="ckpt-save-ep2", schedule="DualPipeV", eval=False, clip=None, momentum=0.9, save="ckpt"),
    dict(_BASE, id="ckpt-load-ep2", schedule="DualPipeV", eval=False, clip=None, momentum=0.9, load="ckpt", steps=0),
    dict(_BASE, id="ckpt-load-ep1", schedule="1F1B", eval=False, clip=None, momentum=0.9, load="ckpt", steps=0, ep=1),
    # the same save written in the background (async_save=True: expert shards copied to CPU, written by DCP's thread)
    dict(_BASE, id="ckpt-save-ep2-async", schedule="DualPipeV", eval=False, clip=None, momentum=0.9, save="ckpt-async",
         async_save=True),
    dict(_BASE, id="ckpt-load-ep1-async", schedule="1F1B", eval=False, clip=None, momentum=0.9, load="ckpt-async", steps=0, ep=1),
]
WORKER = str(Path(__file__).parent / "ranks" / "moe_worker.py")


# ---------------------------------------------------------------- one process


def test_moe_block_equals_a_token_by_token_loop() -> None:
    from pipeloom.moe import MoE, capacity

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    moe = MoE(5, 7, 4, top_k=2, capacity_factor=0.75, generator=g, dtype=torch.float64)
    x = torch.randn(2, 6, 5, dtype=torch.float64)
    y = moe(x)
    tokens = x.reshape(-1, 5)
    c = capacity(12, num_experts=4, top_k=2, capacity_factor=0.75)
    assert c == 5
    probs = torch.softmax(tokens @ moe.router.weight.t(), -1)
    gate, idx = probs.topk(2, -1)
    want = torch.zeros_like(tokens)
    used = [0] * 4
    dropped = 0
    for j in range(2):  # first choices take the slots first
        for i in range(12):
            e = int(idx[i, j])
            if used[e] >= c:
                dropped += 1
                continue
            used[e] += 1
            h = torch.nn.functional.gelu(tokens[i] @ moe.w1[e])
            want[i] += gate[i, j] * (h @ moe.w2[e])
    assert dropped > 0, "the case should drop some assignments"
    torch.testing.assert_close(y.reshape(-1, 5), want, rtol=1e-12, atol=1e-12)
    y.sum().backward()  # gradients reach the router and the experts
    assert moe.router.weight.grad.abs().sum() > 0 and moe.w1.grad.abs().sum() > 0


def test_expert_shards_and_grid() -> None:
    from pipeloom.moe import MoE, is_expert_parameter
    from pipeloom.runtime.expert_parallel import StageContext, call_stage_fn, make_ep_grid

    full = MoE(4, 3, 4, generator=torch.Generator().manual_seed(1))
    part = MoE(4, 3, 4, ep_rank=1, ep_size=2, group=object(), generator=torch.Generator().manual_seed(1))
    assert torch.equal(part.w1, full.w1[2:]) and torch.equal(part.router.weight, full.router.weight)
    assert is_expert_parameter(part.w2) and not is_expert_parameter(part.router.weight)
    with pytest.raises(ValueError, match="multiple"):
        MoE(4, 3, 3, ep_rank=0, ep_size=2, group=object())
    grid, dp = make_ep_grid(world=8, data_parallel=2, expert_parallel=2, mesh=None)
    assert dp == 2 and grid == [[0, 1, 2, 3], [4, 5, 6, 7]]
    ctx = StageContext(stage=3, device=torch.device("cpu"))
    assert call_stage_fn(lambda s: s, 3, ctx) == 3
    assert call_stage_fn(lambda s, c: c.stage, 3, ctx) == 3
    from pipeloom.runtime.errors import PipelineConfigError

    with pytest.raises(PipelineConfigError, match="does not divide"):
        make_ep_grid(world=6, data_parallel=1, expert_parallel=4, mesh=None)


# ---------------------------------------------------------------- rank pool


def reference(cfg: dict[str, Any], num_stages: int) -> list[dict[str, Any]]:
    """The unsplit model, every expert on this process: each column's microbatches routed on their own."""
    stages = [MoEStage(s) for s in range(num_stages)]
    opt = torch.optim.SGD([p for m in stages for p in m.parameters()], lr=0.1)
    n, cols = cfg["microbatches"], cfg["ep"]
    out = []
    for step in range(cfg["steps"]):
        x, y = make_batch(step, rows=cfg["rows"], seq=cfg["seq"])
        opt.zero_grad(set_to_none=True)
        losses: list[list[torch.Tensor]] = []
        outputs = []
        for xc, yc in zip(torch.tensor_split(x, cols), torch.tensor_split(y, cols)):
            col_losses, col_out = [], []
            for xm, ym in zip(torch.tensor_split(xc, n), torch.tensor_split(yc, n)):
                h = xm
                for st in stages:
                    h = st(h)
                loss = loss_fn(h, ym)
                (loss / (n * cols)).backward()
                col_losses.append(loss.detach())
                col_out.append(h.detach())
            losses.append(col_losses)
            outputs.append(torch.cat(col_out))
        grads = {f"s{i}.{pn}": p.grad.clone() for i, m in enumerate(stages) for pn, p in m.named_parameters()}
        opt.step()
        evals = []
        with torch.no_grad():
            for xc in torch.tensor_split(x, cols):
                col_out = []
                for xm in torch.tensor_split(xc, n):
                    for st in stages:
                        xm = st(xm)
                    col_out.append(xm)
                evals.append(torch.cat(col_out))
        out.append({"grads": grads, "losses": losses, "outputs": outputs, "eval": evals})
    return out


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict[str, Any]]], float]:
    out = tmp_path_factory.mktemp("moe")
    t0 = time.monotonic()
    results = asyncio.run(run_ranks(WORLD, CASES + CKPT_CASES, out, timeout=240, worker=WORKER))
    return results, time.monotonic() - t0


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_expert_parallel_matches_unsplit_model(pool: Any, case_id: str) -> None:
    results = pool[0][case_id]
    cfg = next(c for c in CASES if c["id"] == case_id)
    ns = PP * default_stages_per_rank(cfg["schedule"])
    ref = reference(cfg, ns)
    local = EXPERTS // EP
    seen_experts = set()
    for rank, res in enumerate(results):
        col = rank % EP  # global rank = pp_index * ep + ep_index
        assert res["column"] == col and res["deterministic"], res["column"]
        for s in res["stages"]:
            assert res["ep_rank"][s] == col
        for step, want in enumerate(ref):
            got = res["grads"][step]
            assert got, f"rank {rank} holds no stage"
            for name, g in got.items():
                w = want["grads"][name]
                if name.endswith((".moe.w1", ".moe.w2")):
                    w = w[col * local : (col + 1) * local]
                    seen_experts.add((name, col))
                torch.testing.assert_close(g, w, **TOL, msg=lambda m, name=name, step=step, rank=rank: f"rank {rank} step {step} grad {name}: {m}")
            # Pipeline.last_loss(): the mean over every microbatch of every column, on every rank
            mean = torch.stack([l for col_losses in want["losses"] for l in col_losses]).mean()
            torch.testing.assert_close(torch.tensor(res["last_loss"][step], dtype=torch.float64), mean, **TOL)
            if ns - 1 in res["stages"]:
                for a, b in zip(res["losses"][step], want["losses"][col], strict=True):
                    torch.testing.assert_close(a, b, **TOL)
                torch.testing.assert_close(res["outputs"][step], want["outputs"][col], **TOL)
                if cfg["eval"]:
                    torch.testing.assert_close(res["eval"][step], want["eval"][col], **TOL)
    # every expert's gradient was checked on the rank that holds it
    assert len(seen_experts) == 2 * ns * EP
    if cfg["clip"]:
        # Pipeline.clip_grad_norm_ = torch's on the unsplit model: the norm over every parameter once
        # (each expert on the ep rank that holds it), the same on every rank, every gradient scaled
        want = ref[-1]["grads"]
        total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in want.values()]))
        coef = min(1.0, cfg["clip"] / (float(total) + 1e-6))
        assert coef < 0.5, coef  # it clipped
        for rank, res in enumerate(results):
            col = rank % EP
            torch.testing.assert_close(torch.tensor(res["clip_norm"], dtype=torch.float64), total, **TOL)
            for name, g in res["clipped"].items():
                w = want[name]
                if name.endswith((".moe.w1", ".moe.w2")):
                    w = w[col * local : (col + 1) * local]
                torch.testing.assert_close(g, w * coef, **TOL, msg=lambda m, name=name, rank=rank: f"rank {rank} clipped {name}: {m}")


def test_checkpoint_of_expert_shards_loads_under_the_same_and_another_layout(pool: Any) -> None:
    saved = {r: res["saved"] for r, res in enumerate(pool[0]["ckpt-save-ep2"])}
    same = {r: res["loaded"] for r, res in enumerate(pool[0]["ckpt-load-ep2"])}
    other = {r: res["loaded"] for r, res in enumerate(pool[0]["ckpt-load-ep1"])}
    assert all(res["loaded_step"] == 2 for res in pool[0]["ckpt-load-ep2"] + pool[0]["ckpt-load-ep1"])
    # the same layout: every rank gets back exactly what it saved (its own expert rows, momentum too)
    for r in range(WORLD):
        assert set(same[r]) == set(saved[r]) and any(k.endswith(":momentum") for k in saved[r]), sorted(saved[r])
        for k, v in saved[r].items():
            torch.testing.assert_close(same[r][k], v, rtol=0, atol=0, msg=lambda m, k=k, r=r: f"rank {r} {k}: {m}")
    # the whole model as saved: expert tensors are the ep ranks' rows in ep order
    full: dict[str, torch.Tensor] = {}
    for k in {k for r in range(WORLD) for k in saved[r]}:
        holders = [r for r in range(WORLD) if k in saved[r]]  # ranks r with r // EP = the stage's pipeline row
        parts = [saved[r][k] for r in sorted(holders, key=lambda r: r % EP)]
        if ".moe.w1" in k or ".moe.w2" in k:
            full[k] = torch.cat(parts)
        else:  # replicated over the ep ranks
            for p in parts[1:]:
                torch.testing.assert_close(p, parts[0], rtol=0, atol=0)
            full[k] = parts[0]
    # pp 4 without expert parallelism: rank r holds stage r whole
    for r in range(WORLD):
        assert set(other[r]) == {k for k in full if k.startswith(f"s{r}.")}, (r, sorted(other[r]))
        for k, v in other[r].items():
            torch.testing.assert_close(v, full[k], rtol=0, atol=0, msg=lambda m, k=k, r=r: f"rank {r} {k}: {m}")


def test_asynchronous_checkpoint_of_expert_shards_loads_under_another_layout(pool: Any) -> None:
    # written in the background while every parameter was changed right after the call returned: the
    # checkpoint holds the state as of the call (the same as the synchronous save's), loaded under pp 4 without ep
    sync = {r: res["saved"] for r, res in enumerate(pool[0]["ckpt-save-ep2"])}
    saved = {r: res["saved"] for r, res in enumerate(pool[0]["ckpt-save-ep2-async"])}
    assert all(res["save_was_async"] for res in pool[0]["ckpt-save-ep2-async"])
    for r in range(WORLD):
        assert set(saved[r]) == set(sync[r])
        for k, v in saved[r].items():
            torch.testing.assert_close(v, sync[r][k], rtol=0, atol=0)
    other = {r: res["loaded"] for r, res in enumerate(pool[0]["ckpt-load-ep1-async"])}
    assert all(res["loaded_step"] == 2 for res in pool[0]["ckpt-load-ep1-async"])
    for r in range(WORLD):
        assert other[r], r
        for k, v in other[r].items():
            holders = sorted((q for q in range(WORLD) if k in saved[q]), key=lambda q: q % EP)
            parts = [saved[q][k] for q in holders]
            want = torch.cat(parts) if (".moe.w1" in k or ".moe.w2" in k) else parts[0]
            torch.testing.assert_close(v, want, rtol=0, atol=0, msg=lambda m, k=k, r=r: f"rank {r} {k}: {m}")


def test_benchmark_measures_hidden_all_to_all_from_a_timeline(tmp_path: Path) -> None:
    # benchmarks/gpu_moe.py's analysis on a synthetic chrome trace: an all-to-all kernel on stream 7
    # (its launch inside the pipeloom.moe.all_to_all range), compute on stream 9 covering half of it
    import json

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from gpu_moe import a2a_overlap

    def span(cat: str, name: str, tid: int, ts: float, dur: float, **args: Any) -> dict[str, Any]:
        """One chrome-trace complete event (host spans on pid 1, kernels on pid 0 with tid = stream)."""
        return {"ph": "X", "cat": cat, "name": name, "pid": 0 if cat == "kernel" else 1, "tid": tid, "ts": ts, "dur": dur,
                **({"args": args} if args else {})}

    def kernel(name: str, stream: int, ts: float, dur: float, corr: int) -> dict[str, Any]:
        return span("kernel", name, stream, ts, dur, correlation=corr, stream=stream)

    ev = [
        span("user_annotation", "PP:(0F3;3B1)OVERLAP_F_B", 4, 0, 20),
        span("user_annotation", "pipeloom.moe.all_to_all", 5, 0, 10),
        span("cuda_driver", "cuLaunchKernelEx", 5, 2, 1, correlation=11),
        kernel("ncclDevKernel_SendRecv", 7, 100, 40, 11),
        # a later all-to-all on the same stream, its launch not seen: found by its stream
        kernel("ncclDevKernel_SendRecv", 7, 300, 10, 99),
        # a pipeline transfer (another NCCL stream) is neither all-to-all nor compute
        kernel("ncclDevKernel_SendRecv", 8, 100, 40, 12),
        kernel("gemm", 9, 90, 20, 13),
        kernel("gelu", 9, 105, 15, 14),
        # compute on the all-to-all's own stream hides nothing
        kernel("add", 7, 120, 20, 15),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    got = a2a_overlap(str(path))
    assert got is not None and got["a2a_kernels"] == 2 and got["a2a_found_by"] == "range,stream"
    assert got["a2a_kernel_ms"] == pytest.approx(0.05) and got["a2a_hidden_ms"] == pytest.approx(0.02)
    assert got["a2a_hidden"] == pytest.approx(0.4)
    # launched inside the OVERLAP_F_B action (from another thread, as autograd's): the pair's all-to-all
    assert got["pairs"] == 1 and got["pair_a2a_kernels"] == 1 and got["pair_a2a_hidden"] == pytest.approx(0.5)

    # with the ep peer's trace (its clock 50 us later): the peer launched the first all-to-all 20 us
    # after this rank, so its exchange is [120, 140] here, where no compute on stream 9 runs;
    # the second started together on both
    peer_ev = [
        span("user_annotation", "pipeloom.moe.all_to_all", 5, 0, 10),
        span("cuda_driver", "cuLaunchKernelEx", 5, 2, 1, correlation=21),
        kernel("ncclDevKernel_SendRecv", 3, 70, 20, 21),
        kernel("ncclDevKernel_SendRecv", 3, 250, 10, 22),
    ]
    peer = tmp_path / "peer.json"
    peer.write_text(json.dumps({"baseTimeNanoseconds": 50_000, "traceEvents": peer_ev}))
    got = a2a_overlap(str(path), peer_trace=str(peer))
    assert got["peer_match"].startswith("matched 2"), got["peer_match"]
    assert got["a2a_exchange_ms"] == pytest.approx(0.03) and got["a2a_exchange_hidden"] == pytest.approx(0.0)
    assert got["pair_a2a_exchange_ms"] == pytest.approx(0.02) and got["pair_a2a_exchange_hidden"] == pytest.approx(0.0)
    # kernels that do not end together are not the same exchange (clocks unaligned): no exchange figures
    peer_ev[2]["ts"] = 10
    peer.write_text(json.dumps({"baseTimeNanoseconds": 50_000, "traceEvents": peer_ev}))
    got = a2a_overlap(str(path), peer_trace=str(peer))
    assert "unaligned" in got["peer_match"] and "a2a_exchange_ms" not in got
    # a different number of all-to-alls per stream: unmatched
    peer.write_text(json.dumps({"baseTimeNanoseconds": 50_000, "traceEvents": peer_ev[:3]}))
    got = a2a_overlap(str(path), peer_trace=str(peer))
    assert "unmatched" in got["peer_match"] and "a2a_exchange_ms" not in got


def test_expert_parallel_configuration_errors(tmp_path: Path) -> None:
    import torch.distributed as dist

    import pipeloom
    from harness import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        stage = lambda s: MoEStage(s)  # noqa: E731
        with pytest.raises(pipeloom.PipelineConfigError, match="does not combine with fsdp"):
            pipeloom.Pipeline(stage, schedule="1F1B", num_microbatches=2, loss_fn=loss_fn, expert_parallel=2, fsdp=True)
        with pytest.raises(pipeloom.PipelineConfigError, match="does not divide the job's 1 ranks"):
            pipeloom.Pipeline(stage, schedule="1F1B", num_microbatches=2, loss_fn=loss_fn, expert_parallel=2)
    finally:
        dist.destroy_process_group()


def test_user_error_on_one_ep_rank_stops_every_rank(tmp_path: Path) -> None:
    # rank 1 (pipeline rank 0, ep rank 1) raises in its stage's forward in step 1, while its ep
    # peer (rank 0) is inside, or on its way into, the all-to-all that rank 1 never joins
    import json

    from harness import spawn_ranks

    case = dict(_BASE, id="fail", schedule="DualPipeV", fail={"rank": 1, "step": 1})
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"cases": [case], "out": str(tmp_path)}))
    # (on gloo also where the pool runs on NCCL: this is about the gloo all-to-all holding the host)
    # (spawn_ranks fails the test, with every rank's stack, if they are still running after 90 s)
    codes, _, errs = asyncio.run(spawn_ranks(WORLD, [WORKER, str(job)], timeout=90, env={"PIPELOOM_TEST_BACKEND": "gloo"}))
    assert all(c not in (0, None) for c in codes), (codes, [e[-1500:] for e in errs])
    recs = {r: json.loads((tmp_path / f"fail-rank{r}.json").read_text()) for r in range(WORLD)}
    assert recs[1]["type"] == "StageError" and "boom in user code" in recs[1]["message"], recs[1]
    for r in (0, 2, 3):
        # every other rank names rank 1, as the rank that failed or the peer it lost (its ep peer too,
        # whose all-to-all broke: not a StageError of its own)
        assert recs[r]["type"] in ("RemoteRankError", "PeerLostError"), recs[r]
        assert "rank 1" in recs[r]["message"], recs[r]


@pytest.mark.skipif(os.environ.get("PIPELOOM_TEST_BACKEND") == "nccl" and torch.cuda.device_count() < 8,
                    reason="8 NCCL ranks need 8 GPUs (one per rank); on 4 it ran to its bound")
def test_clipping_and_checkpoints_with_data_and_expert_parallelism(tmp_path: Path) -> None:
    # 8 ranks: pp 2 x dp 2 x ep 2 (columns d * ep + e).  Gradients and the clipped gradients equal
    # the unsplit model's over the 4 columns' data (each expert counted once, not once per dp
    # replica); the checkpoint then loads under pp 2 x dp 4 without expert parallelism
    base = dict(microbatches=4, rows=16, seq=3, steps=1, eval=False)
    cases = [dict(base, id="dpep", schedule="DualPipeV", ep=2, dp=2, clip=0.01, save="ckpt"),
             dict(base, id="dp4-load", schedule="DualPipeV", ep=1, dp=4, load="ckpt", steps=0)]
    res = asyncio.run(run_ranks(8, cases, tmp_path, timeout=300, worker=WORKER))
    want = reference(dict(base, ep=4), 2 * default_stages_per_rank("DualPipeV"))[0]["grads"]
    total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in want.values()]))
    coef = min(1.0, 0.01 / (float(total) + 1e-6))
    assert coef < 0.5
    local = EXPERTS // 2

    def mine(name: str, w: torch.Tensor, col: int) -> torch.Tensor:
        e = col % 2
        return w[e * local : (e + 1) * local] if name.endswith((".moe.w1", ".moe.w2")) else w

    for r, rr in enumerate(res["dpep"]):
        col = rr["column"]
        torch.testing.assert_close(torch.tensor(rr["clip_norm"], dtype=torch.float64), total, **TOL)
        for name, g in rr["grads"][0].items():
            torch.testing.assert_close(g, mine(name, want[name], col), **TOL, msg=lambda m, name=name, r=r: f"rank {r} {name}: {m}")
        for name, g in rr["clipped"].items():
            torch.testing.assert_close(g, mine(name, want[name], col) * coef, **TOL)
    # the whole model as saved (the rows of dp index 0's ep ranks), loaded by every rank of pp 2 x dp 4
    saved = [(rr["column"], rr["saved"]) for rr in res["dpep"]]
    full: dict[str, torch.Tensor] = {}
    for k in {k for _, sv in saved for k in sv}:
        parts = [sv[k] for col, sv in sorted(saved, key=lambda cs: cs[0]) if k in sv and col < 2]
        full[k] = torch.cat(parts) if k.endswith((".moe.w1", ".moe.w2", ".moe.w1:momentum", ".moe.w2:momentum")) else parts[0]
    for r, rr in enumerate(res["dp4-load"]):
        assert rr["loaded"] and rr["loaded_step"] == 1
        for k, v in rr["loaded"].items():
            torch.testing.assert_close(v, full[k], rtol=0, atol=0, msg=lambda m, k=k, r=r: f"rank {r} {k}: {m}")
