"""Checkpoints across layouts, global clipping, the step loss and accumulation, on real gloo ranks.

Two rank pools (tests/ranks/harness.py) run ``tests/ranks/ckpt_worker.py``:
4 ranks, then 2.  A checkpoint saved at PP=2 x FSDP=2 (Linears sharded, each
layer's ``gain`` replicated) is loaded at PP=4, at PP=2 x DP=2 with another
schedule and 2 stages per rank, and at PP=2 without data parallelism; each
must restore the saved parameters bit for bit and give the next step the loss
the unsplit model has there.  Clipping, the step loss and ``no_sync``
accumulation are compared with the unsplit model on one process (float64).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import RanksFailed, spawn_ranks  # noqa: E402
from net import batch, build_net, loss_fn, make_optimizer  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-12)
BASE = dict(dim=4, layers=4, batch=16, microbatches=4, clip=0.05)
WORKER = Path(__file__).parent / "ranks" / "ckpt_worker.py"


async def run_ranks(world: int, cases: list[dict[str, Any]], out: Path, *, timeout: float) -> dict[str, list[dict[str, Any]]]:
    """harness.run_ranks with ckpt_worker.py: every case on one pool of ``world`` ranks."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps({"cases": cases, "out": str(out)}))
    codes, _, errs = await spawn_ranks(world, [str(WORKER), str(out / "job.json")], timeout=timeout)
    if any(c != 0 for c in codes):
        tails = "\n".join(f"--- rank {r} (exit {c}) ---\n{e[-3000:]}" for r, (c, e) in enumerate(zip(codes, errs)))
        raise RanksFailed(f"ranks failed: exit codes {codes}\n{tails}", codes, errs)
    return {c["id"]: [torch.load(out / f"{c['id']}-rank{r}.pt", weights_only=False) for r in range(world)] for c in cases}


def _cases4(tmp: Path) -> list[dict[str, Any]]:
    ck, ck_async = str(tmp / "ckpt"), str(tmp / "ckpt-async")
    return [
        # save at PP=2 x FSDP=2 after 2 steps, train a third
        dict(BASE, id="save-fsdp", schedule="1F1B", data_parallel=2, fsdp=True, fsdp_wrap="linears", steps=3,
             save={"path": ck, "at": 2}),
        # ...resume at PP=4 (4 stages, 1F1B)...
        dict(BASE, id="load-pp4", schedule="1F1B", load=ck, steps=1),
        # ...and at PP=2 x DP=2 (DDP), another schedule with 2 stages per rank
        dict(BASE, id="load-ddp-interleaved", schedule="Interleaved1F1B", data_parallel=2, load=ck, steps=1),
        # an asynchronous save while training goes on (PP=2 x DP=2); loaded by the 2-rank pool
        dict(BASE, id="save-async-ddp", schedule="1F1B", data_parallel=2, steps=3, save={"path": ck_async, "at": 2, "async": True}),
        # ...loaded into FSDP shards: PP=2 x FSDP=2, every parameter a DTensor (fsdp_wrap="blocks"), ZBVZeroBubble
        dict(BASE, id="load-async-fsdp", schedule="ZBVZeroBubble", data_parallel=2, fsdp=True, fsdp_wrap="blocks",
             load=ck_async, steps=1),
        # clipping by the inf-norm at PP=4
        dict(BASE, id="clip-inf-pp4", schedule="1F1B", steps=2, norm_type=math.inf, clip=0.02),
        # accumulation: steps under no_sync, then one that reduces
        dict(BASE, id="accum-ddp", schedule="1F1B", data_parallel=2, accumulate=2, clip=None),
        dict(BASE, id="accum-fsdp", schedule="Interleaved1F1B", data_parallel=2, fsdp=True, accumulate=1, clip=None),
    ]


def _cases2(tmp: Path) -> list[dict[str, Any]]:
    return [
        dict(BASE, id="load-pp2", schedule="1F1B", load=str(tmp / "ckpt"), steps=1),
        dict(BASE, id="load-async-pp2", schedule="ZBVZeroBubble", load=str(tmp / "ckpt-async"), steps=1),
        dict(BASE, id="clip-pp2", schedule="ZBVZeroBubble", steps=2, clip=0.03),
        dict(BASE, id="noclip-pp2", schedule="1F1B", steps=1, clip=100.0),  # a norm below max_norm: nothing scaled
        # ranks that pass different directories are refused together, none left waiting
        dict(BASE, id="per-rank-dirs", schedule="1F1B", per_rank_dirs=str(tmp / "mine"), load_from_rank0=str(tmp / "ckpt")),
        # the crash test's job, uninterrupted (the same code as under the launcher, in this pool's processes)
        dict(id="resume-clean", resume_clean=str(tmp / "clean"), steps=6),
    ]


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict[str, Any]]], Path]:
    tmp = tmp_path_factory.mktemp("ckpt")
    c4, c2 = _cases4(tmp), _cases2(tmp)
    results = asyncio.run(run_ranks(4, c4, tmp / "out4", timeout=240))
    results.update(asyncio.run(run_ranks(2, c2, tmp / "out2", timeout=180)))
    return results, tmp


def _case(cid: str) -> dict[str, Any]:
    return next(c for c in _cases4(Path("/")) + _cases2(Path("/")) if c["id"] == cid)


def reference(cfg: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    """The unsplit model on one process: per step the mean loss, the norm, the clipped grads, the params after."""
    model = build_net(cfg)
    opt = make_optimizer(model.parameters(), cfg)
    pieces = cfg.get("data_parallel", 1) * cfg["microbatches"]  # replica d's microbatches follow replica d-1's
    out = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = batch(cfg, step)
        losses = [loss_fn(model(xm), ym) for xm, ym in zip(torch.tensor_split(x, pieces), torch.tensor_split(y, pieces))]
        (sum(losses) / pieces).backward()
        rec: dict[str, Any] = {"loss": float(torch.stack(losses).detach().mean())}
        if cfg.get("clip") is not None:
            rec["norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"], cfg.get("norm_type", 2.0))
        rec["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        rec["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append(rec)
    return out


def _merged(results: list[dict[str, Any]], key: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for res in results:
        for n, t in res[key].items():
            if n in out:  # replicas (and FSDP shards gathered whole) agree exactly
                assert torch.equal(out[n], t), n
            out[n] = t
    return out


def _check_steps(cid: str, results: list[dict[str, Any]], first: int = 0) -> None:
    cfg = _case(cid)
    ref = reference(cfg, first + cfg["steps"])
    for i, want in enumerate(ref[first:]):
        for rank, res in enumerate(results):
            got = res["steps"][i]
            assert got["loss_all"] == pytest.approx(want["loss"], rel=1e-12), (cid, rank, i)
            assert (got["loss0"] is None) == (rank != 0), (cid, rank)
            if rank == 0:
                assert got["loss0"] == got["loss_all"]
            if "norm" in want:
                assert float(got["norm"]) == pytest.approx(float(want["norm"]), rel=1e-12), (cid, rank, i)
                assert got["norm"] == results[0]["steps"][i]["norm"]  # every rank: the same number
        grads = _merged([{"g": r["steps"][i]["grads"]} for r in results], "g")
        assert grads.keys() == want["grads"].keys()
        for n, g in want["grads"].items():
            torch.testing.assert_close(grads[n], g, **TOL, msg=f"{cid} step {i} {n}")
    params = _merged(results, "params")
    for n, p in ref[-1]["params"].items():
        torch.testing.assert_close(params[n], p, **TOL, msg=f"{cid} params {n}")


def test_saved_under_pp2_fsdp2_training_matches_the_unsplit_model(pools: Any) -> None:
    _check_steps("save-fsdp", pools[0]["save-fsdp"])
    assert all(float(r["norm"]) > BASE["clip"] for r in reference(_case("save-fsdp"), 3))  # clipping was active


@pytest.mark.parametrize("cid", ["load-pp4", "load-ddp-interleaved", "load-pp2"])
def test_a_checkpoint_loads_under_another_layout(pools: Any, cid: str) -> None:
    results, tmp = pools
    saved = results["save-fsdp"]
    got = results[cid]
    ref = reference(_case("save-fsdp"), 3)
    for rank, res in enumerate(got):
        assert res["loaded"]["step"] == 2 and res["loaded"]["extra"] == {"case": "save-fsdp", "next": 2}
        assert res["loaded"]["path"].endswith("step-00000002")
        assert res["loaded"]["rng"] == (len(got) == 4)  # RNG restored only under the same world size
    # the parameters restored are those of the unsplit model after 2 steps (the FSDP run's, within float
    # reordering), identical on every layout that loaded them, bit for bit
    loaded = _merged(got, "loaded_params")
    for n, p in ref[1]["params"].items():
        torch.testing.assert_close(loaded[n], p, **TOL)
    for other in ("load-pp4", "load-ddp-interleaved", "load-pp2"):
        theirs = _merged(results[other], "loaded_params")
        assert all(torch.equal(loaded[n], theirs[n]) for n in ref[1]["params"]), (cid, other)
    # the buffer kept on every stage is restored on every stage
    assert all(torch.equal(t, build_net(BASE).offset) for n, t in loaded.items() if n.startswith("buffer:"))
    # the next step: the same loss as the saving layout's third step and the unsplit model's
    nxt = got[0]["steps"][0]["loss_all"]
    assert nxt == pytest.approx(saved[0]["steps"][2]["loss_all"], rel=1e-12)
    assert nxt == pytest.approx(ref[2]["loss"], rel=1e-12)
    params = _merged(got, "params")
    for n, p in ref[2]["params"].items():
        torch.testing.assert_close(params[n], p, **TOL, msg=f"{cid} {n}")


@pytest.mark.parametrize("cid", ["load-async-pp2", "load-async-fsdp"])
def test_an_async_save_holds_the_state_of_its_step(pools: Any, cid: str) -> None:
    results, _ = pools
    _check_steps("save-async-ddp", results["save-async-ddp"])
    ref = reference(_case("save-async-ddp"), 3)
    got = results[cid]
    loaded = _merged(got, "loaded_params")
    for n, p in ref[1]["params"].items():  # step 2's parameters, though training went on to step 3 meanwhile
        torch.testing.assert_close(loaded[n], p, **TOL)
    assert got[0]["steps"][0]["loss_all"] == pytest.approx(ref[2]["loss"], rel=1e-12)
    # the optimizer state came along too: the step after the load is the unsplit model's third
    params = _merged(got, "params")
    for n, p in ref[2]["params"].items():
        torch.testing.assert_close(params[n], p, **TOL, msg=f"{cid} {n}")


def test_ranks_that_disagree_on_the_directory_are_all_refused(pools: Any) -> None:
    results, tmp = pools
    save_errors = [r["errors"][0] for r in results["per-rank-dirs"]]
    load_errors = [r["errors"][1] for r in results["per-rank-dirs"]]
    for e in save_errors:
        assert e and "the ranks passed different checkpoint directories" in e, e
    for e in load_errors:  # rank 0 would load the step-2 checkpoint; rank 1 sees none in its own directory
        assert e and "rank 0 would load" in e and "step-00000002" in e and "ranks [1] see ['nothing']" in e, e
    assert not any((tmp / "mine").rglob("*.distcp"))  # nothing was written


@pytest.mark.parametrize("cid", ["clip-inf-pp4", "clip-pp2", "noclip-pp2"])
def test_clipping_by_the_global_norm_matches_the_unsplit_model(pools: Any, cid: str) -> None:
    _check_steps(cid, pools[0][cid])
    ref = reference(_case(cid), 1)
    clipped = float(ref[0]["norm"]) > _case(cid)["clip"]
    assert clipped == (cid != "noclip-pp2")


@pytest.mark.parametrize("cid", ["accum-ddp", "accum-fsdp"])
def test_no_sync_accumulates_without_reducing(pools: Any, cid: str) -> None:
    cfg = _case(cid)
    results = pools[0][cid]
    k = cfg["accumulate"]
    # the unsplit model, backward of k + 1 steps' losses without zeroing in between
    model = build_net(cfg)
    pieces = cfg["data_parallel"] * cfg["microbatches"]
    total = 0.0
    for step in range(k + 1):
        x, y = batch(cfg, step)
        losses = [loss_fn(model(xm), ym) for xm, ym in zip(torch.tensor_split(x, pieces), torch.tensor_split(y, pieces))]
        (sum(losses) / pieces).backward()
        total = float(torch.stack(losses).detach().mean())
    grads = _merged([{"g": r["steps"][-1]["grads"]} for r in results], "g")
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, **TOL, msg=f"{cid} {n}")
    assert results[0]["steps"][-1]["loss_all"] == pytest.approx(total, rel=1e-12)  # the last step's loss
    assert all("clip_grad_norm_ inside no_sync()" in r["clip_in_no_sync"] for r in results)
    if not cfg.get("fsdp"):
        # inside no_sync the two replicas of a stage held different (their own, unreduced) gradients
        by_row: dict[int, list[dict[str, torch.Tensor]]] = {}
        for rank, res in enumerate(results):
            by_row.setdefault(rank // 2, []).append(res["steps"][0]["local"])
        for a, b in by_row.values():
            assert any(not torch.equal(a[n], b[n]) for n in a)


# ---------------------------------------------------------------- crash and resume


def test_killed_mid_save_resumes_from_the_last_complete_checkpoint_bit_exactly(pools: Any, tmp_path: Path) -> None:
    """``pipeloom launch --max-restarts 1``: rank 1 is SIGKILLed inside the (asynchronous) save of step 4,
    after writing its files; the restart must ignore that unfinished checkpoint, resume from step 2 and end
    with the parameters of an uninterrupted run of the same job, bit for bit (CPU, float64, deterministic,
    dropout).  The uninterrupted run is the 2-rank pool's ``resume-clean`` case (the same code)."""
    import subprocess

    worker = str(Path(__file__).parent / "ranks" / "ckpt_resume_worker.py")
    launch = [sys.executable, "-m", "pipeloom.tools.cli", "launch", "--nproc-per-node", "2", "--grace", "0.5"]
    out = tmp_path / "kill"
    out.mkdir()
    proc = subprocess.run([*launch, "--max-restarts", "1", worker, "kill", str(out), "6"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    err = proc.stderr
    assert "attempt 0 failed: rank 1 was killed by SIGKILL" in err, err[-3000:]
    for rank in range(2):
        first, second = (out / f"attempts{rank}").read_text().split()
        assert first == "0:0:-"
        # the restart saw step 4's unfinished directory holding rank 1's data file (and rank 0's, unless
        # the launcher stopped rank 0 before its background writer got to it), and resumed from step 2
        restart, start, left = second.split(":", 2)
        assert (restart, start) == ("1", "2") and left.startswith("partial:") and "__1_0.distcp" in left, second
    clean_dir = pools[1] / "clean"
    assert [line.split(":")[:2] for line in (clean_dir / "attempts0").read_text().split()] == [["0", "0"]]
    runs = {"clean": (clean_dir, "")}
    for rank in range(2):
        clean = torch.load(runs["clean"][0] / f"final{rank}.pt")
        resumed = torch.load(out / f"final{rank}.pt")
        assert clean.keys() == resumed.keys() and clean
        for name, value in clean.items():
            assert torch.equal(value, resumed[name]), (rank, name)
        # the losses of the steps run after the resume (3..6) are those of the uninterrupted run's
        assert torch.load(out / f"losses{rank}.pt") == torch.load(runs["clean"][0] / f"losses{rank}.pt")[2:]
    # step 4 was saved again by the restarted run: complete now, and the latest is step 6
    from pipeloom.runtime.checkpoint import list_checkpoints

    assert [s for s, _ in list_checkpoints(out / "ckpt")] == [2, 4, 6]


PEER_DIES = """\
import json, os, sys, time, torch, pipeloom
from torch import nn
rank = int(os.environ["RANK"])
mode, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
pipe = pipeloom.Pipeline(lambda s: nn.Linear(4, 4), schedule="1F1B", num_microbatches=2, loss_fn=nn.functional.mse_loss)
opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
opt.step()
pipeloom.save_checkpoint(out, pipe, opt, step=1, stage_prefix=True)
if rank == 1:  # dies inside the next call: in its state-dict hook (save), in DCP's read (load)
    if mode == "save":
        for m in pipe.stages.values():
            m.register_state_dict_post_hook(lambda *a, **k: os._exit(7))
    else:
        import torch.distributed.checkpoint as dcp
        dcp.load = lambda *a, **k: os._exit(7)
t = time.monotonic()
try:
    if mode == "save":
        pipeloom.save_checkpoint(out, pipe, opt, step=2, stage_prefix=True)
    else:
        pipeloom.load_checkpoint(out, pipe, opt, stage_prefix=True)
    rec = {"type": None}
except Exception as exc:
    rec = {"type": type(exc).__name__, "message": str(exc), "peer": getattr(exc, "peer", None)}
rec["seconds"] = time.monotonic() - t
print(json.dumps(rec), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("mode", ["save", "load"])
def test_a_peer_dying_inside_a_checkpoint_call_is_named(tmp_path: Path, mode: str) -> None:
    """A rank that dies inside save/load: its peers failed within 0.1 s but with gloo's raw ``RuntimeError``
    ("Connection reset by peer"), naming no rank; now a ``PeerLostError`` naming the lost rank and the call."""
    script = tmp_path / "job.py"
    script.write_text(PEER_DIES)
    codes, outs, errs = asyncio.run(spawn_ranks(2, [str(script), mode, str(tmp_path / "ckpt")], timeout=90))
    assert codes == [0, 7], errs
    rec = json.loads(outs[0].strip().splitlines()[-1])
    assert rec["type"] == "PeerLostError" and rec["peer"] == 1, rec
    assert rec["message"].startswith(f"rank 0: lost rank 1: {mode}_checkpoint: its process ended during the call"), rec
    assert rec["seconds"] < 10, rec


OTHER_OPTIMIZER = """\
import json, os, sys, torch, pipeloom
from torch import nn
torch.manual_seed(0)
pipe = pipeloom.Pipeline(lambda s: nn.Linear(4, 4), schedule="1F1B", num_microbatches=2, loss_fn=nn.functional.mse_loss)
opt = torch.optim.AdamW(pipe.parameters(), lr=0.1)
pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
opt.step()
pipeloom.save_checkpoint(sys.argv[1], pipe, opt, step=1, stage_prefix=True)
rec = {}
try:
    pipeloom.load_checkpoint(sys.argv[1], pipe, torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9), stage_prefix=True)
except pipeloom.PipelineConfigError as exc:
    rec["error"] = str(exc)
rec["alone"] = pipeloom.load_checkpoint(sys.argv[1], pipe, None, stage_prefix=True).step
print(json.dumps(rec), flush=True)
"""


def test_loading_into_another_optimizer_class_is_refused_by_name(tmp_path: Path) -> None:
    """An AdamW checkpoint loaded into SGD failed with DCP's "Missing key ... momentum_buffer"; now refused on every
    rank naming both classes and the way out (optimizer=None loads the model alone, which then works)."""
    script = tmp_path / "job.py"
    script.write_text(OTHER_OPTIMIZER)
    codes, outs, errs = asyncio.run(spawn_ranks(2, [str(script), str(tmp_path / "ckpt")], timeout=90))
    assert codes == [0, 0], errs
    for o in outs:
        rec = json.loads(o.strip().splitlines()[-1])
        assert "holds the state of AdamW but this rank loads it into SGD: pass optimizer=None" in rec["error"], rec
        assert rec["alone"] == 1, rec
