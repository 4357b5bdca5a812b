"""Adversarial sweep of ``PipelineGradScaler`` and of a Pipeline's life in a process (real gloo ranks).

Scaler rows (``ranks/scaler_adv_worker.py``): against ``torch.amp.GradScaler`` on the unsplit model in the same
process, float32 with scales near 2^100 and a Function that multiplies column 0 of a chosen stage's gradient by 2^40
in chosen steps on a chosen replica, so that overflows land exactly there (with FSDP in one rank's shard only).
Every row compares the scale after every step, and the parameters at the end, on every rank.  Found and fixed:

- ``fused``: an optimizer that unscales in its own kernel (``AdamW(fused=True)``): torch's ``step`` checks it with
  ``_check_inf_per_device``, not ``unscale_``, so the flag was this rank's own: the rank without the overflow took
  the step and grew its scale, silently (parameters 0.3 apart after 5 steps);
- ``frozen1``/``frozen0``: a rank whose stages are all frozen has no optimizer: torch's ``update`` raised "No inf
  checks were recorded" there and its peers waited out the agreement's bound ("lost rank -1"); it now calls
  ``scaler.unscale_(None)``/``step(None)`` where its peers unscale/step theirs; likewise a rank that lacks one of
  its peers' optimizers (``optimizer_on_one_rank``: the agreements no longer pair, every rank waited 40 s and
  named a "lost rank -1");
- a scaler kept after its Pipeline's close (lifecycle row ``scaler_after_close``): the next Pipeline does not scale
  its losses by it, and its ``unscale_`` divided that Pipeline's gradients by the scale, silently: refused now;
- ``fail``: after a failed step the agreement raises at once, and a second ``step(opt)`` used to apply the partial
  gradients on the strength of this rank's own flag (torch had recorded it as unscaled): now it skips.

Lifecycle rows (one 4-rank script, in sequence): Pipelines of other schedules, stage counts and meshes one after
another; found and fixed: a script's own ``init_process_group()`` before a Pipeline (then ``destroy`` and a new
Pipeline) or after one (on the same port: the same multi-tenant store server) hung in ``init_process_group`` or
``new_group`` on the other's keys under env://'s ``default_pg`` prefix; an evaluation Pipeline built beside the one
that made the group failed ("Default process group has not been initialized") once that one closed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import launch_script, run_job, spawn_ranks  # noqa: E402

WORKER = Path(__file__).parent / "ranks" / "scaler_adv_worker.py"
OVERFLOW = [[0, 1, 0], [3, 2, 0]]

# (id, world, case): scaler rows
SCALER_ROWS: list[tuple[str, int, dict[str, Any]]] = [
    ("interleaved", 2, dict(schedule="Interleaved1F1B", stages=4, mb=4, steps=6, overflow=OVERFLOW, clip=True, eval=True)),
    ("dualpipev", 2, dict(schedule="DualPipeV", stages=4, mb=4, steps=6, overflow=OVERFLOW, clip=True, eval=True)),
    ("izb_two_optims", 2, dict(schedule="InterleavedZeroBubble", stages=4, mb=4, steps=6, overflow=[[1, 0, 0], [4, 3, 0]],
                               clip=True, optim="two")),
    # the weights' gradients alone overflow: their optimizer skips, the biases' steps (torch's flags are per optimizer).
    # (Not with clipping: the pipeline accumulates microbatches, where +inf and -inf make a NaN norm that the clip
    # spreads into the biases; the unsplit reference's one backward has no such sum.)
    ("two_optims_weights_only", 2, dict(schedule="1F1B", stages=2, mb=2, steps=5, overflow=[[0, 0, 0], [3, 1, 0]],
                                        optim="two", weights_only=True)),
    ("zbv_two_optims_weights_only", 2, dict(schedule="ZBVZeroBubble", stages=4, mb=4, steps=5, overflow=[[0, 0, 0], [3, 3, 0]],
                                            optim="two", weights_only=True)),
    # an optimizer only some ranks have (stage 0's biases alone train): the others pass None in its place
    ("optimizer_on_one_rank", 2, dict(schedule="1F1B", stages=2, mb=2, steps=5, overflow=[[0, 0, 0], [3, 1, 0]],
                                      optim="bias0", clip=True)),
    ("optimizer_on_one_rank_interleaved", 2, dict(schedule="Interleaved1F1B", stages=4, mb=4, steps=5,
                                                  overflow=[[0, 0, 0], [3, 3, 0]], optim="bias0", weights_only=True)),
    ("fused", 2, dict(schedule="1F1B", stages=2, mb=2, steps=5, overflow=[[0, 0, 0], [3, 0, 0]], optim="fused")),
    ("ckpt_resume", 2, dict(schedule="1F1B", stages=2, mb=2, steps=6, overflow=[[0, 0, 0], [4, 0, 0]], ckpt_at=2, clip=True)),
    ("disabled", 2, dict(schedule="1F1B", stages=2, mb=2, steps=3, enabled=False, overflow=[])),
    ("frozen1", 2, dict(schedule="1F1B", stages=2, mb=2, steps=4, overflow=[[0, 0, 0], [2, 0, 0]], frozen=1, clip=True)),
    ("frozen0", 2, dict(schedule="1F1B", stages=2, mb=2, steps=4, overflow=[[0, 1, 0], [2, 1, 0]], frozen=0, clip=True)),
    ("fail", 2, dict(schedule="1F1B", stages=2, mb=2, steps=3, fail_at=1)),
    ("ddp", 4, dict(schedule="1F1B", stages=2, dp=2, mb=2, steps=5, overflow=[[0, 0, 1], [3, 1, 0]], clip=True)),
    ("fsdp_fused", 4, dict(schedule="Interleaved1F1B", stages=4, dp=2, fsdp=True, mb=2, steps=5,
                           overflow=[[0, 0, 1], [3, 0, 0]], clip=True, optim="fused")),
    ("fsdp_no_sync_two_optims", 4, dict(schedule="1F1B", stages=2, dp=2, fsdp=True, mb=2, steps=3, acc=2,
                                        overflow=[[1, 0, 1], [4, 0, 0]], clip=True, optim="two")),
    ("ddp_frozen", 4, dict(schedule="1F1B", stages=2, dp=2, mb=2, steps=4, overflow=[[0, 0, 1], [2, 0, 0]], frozen=1, clip=True)),
    ("ep_dualpipev", 4, dict(ep=2, schedule="DualPipeV", stages=4, mb=4, steps=5, overflow=[[0, 0, 1], [3, 2, 0]])),
    ("ddp_no_sync", 4, dict(schedule="1F1B", stages=2, dp=2, mb=2, steps=3, acc=3, overflow=[[1, 0, 1], [6, 1, 0]], clip=True)),
]


@pytest.fixture(scope="module")
def scaler_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    base = tmp_path_factory.mktemp("scaler")
    for world in (2, 4):
        cases = [{"id": i, **c} for i, w, c in SCALER_ROWS if w == world]
        out.update(asyncio.run(run_job(world, WORKER, cases, base / f"out{world}", base / f"ck{world}", timeout=150)))
    return out


@pytest.mark.parametrize("row", [r[0] for r in SCALER_ROWS])
def test_scaler_row(row: str, scaler_results: dict[str, list[dict[str, Any]]]) -> None:
    cfg = next(c for i, _, c in SCALER_ROWS if i == row)
    for rank, res in enumerate(scaler_results[row]):
        where = f"{row}, rank {rank}"
        assert not res["errors"], (where, res["errors"])
        if "fail_at" in cfg:
            fail = res["fail"]
            # refused at once on every rank (the step failed: partial gradients), nothing stepped, not even a retry
            assert "failed" in fail.get("error", ""), (where, fail)
            assert fail["seconds"] < 2.0 and not fail["moved"] and not fail["moved_after_retry"], (where, fail)
            continue
        assert res["scales"] == res["ref_scales"], (where, res)
        if cfg.get("enabled", True):
            skipped = {st for st, _, _ in cfg["overflow"]}
            acc = cfg.get("acc", 1)
            # the reference really skipped where the overflows were placed (else the row proves nothing)
            assert len(res["ref_scales"]) == cfg["steps"] and len({s for s in res["ref_scales"]}) > 1, (where, res)
            assert skipped, where
            assert all(st // acc < cfg["steps"] for st in skipped), where
        else:
            assert res["scales"] == [1.0] * cfg["steps"], (where, res)
        assert res["diff"] < 1e-5, (where, res["diff"])
        assert res["loss_diff"] < 1e-5, (where, res["loss_diff"])  # the reported loss is the unscaled one
        assert res["eval_diff"] < 1e-5, (where, res["eval_diff"])  # eval is never scaled
        if "ckpt_at" in cfg:
            assert res["loaded_scale"] == res["ref_scales"][cfg["ckpt_at"]], (where, res)


LIFECYCLE = textwrap.dedent("""\
    import json, os, sys, time, torch, torch.distributed as dist, pipeloom
    from torch import nn
    sys.path.insert(0, os.environ["RANKS_DIR"])
    from harness import install_stack_dump
    install_stack_dump()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rows = {}

    def log(row):
        print(f"rank {rank}: row {row}", file=sys.stderr, flush=True)

    class Fail(nn.Module):
        def forward(self, x):
            raise RuntimeError("injected")

    def stage(s):
        torch.manual_seed(100 + s)
        return nn.Linear(4, 4)

    def mk(schedule, fn=stage, **kw):
        kw.setdefault("num_microbatches", 4)
        return pipeloom.Pipeline(fn, schedule=schedule, loss_fn=nn.functional.mse_loss, **kw)

    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 4)

    def train(pipe):
        pipe.step(x, target=y, return_outputs=False)
        return round(pipe.last_loss(), 6)

    # several Pipelines in sequence: other schedules, stage counts, meshes (pp 4, pp 2 x dp 2, pp 2 x FSDP 2)
    log("sequence")
    seq = []
    for schedule, kw in (("1F1B", {}), ("Interleaved1F1B", {"data_parallel": 2}), ("ZBVZeroBubble", {}),
                         ("DualPipeV", {"data_parallel": 2, "fsdp": True}), ("GPipe", {})):
        pipe = mk(schedule, **kw)
        seq.append([schedule, len(pipe.stages), train(pipe), dist.is_initialized()])
        pipe.close()
        seq[-1].append(dist.is_initialized())
    rows["sequence"] = seq

    # a failed step (StageError on rank 1, RemoteRankError elsewhere), close, then a new Pipeline
    log("after_failure")
    pipe = mk("1F1B", fn=lambda s: Fail() if s == 1 else stage(s))
    try:
        pipe.step(x, target=y)
        err = None
    except pipeloom.PipelineError as exc:
        err = type(exc).__name__
    pipe.close()
    pipe = mk("Interleaved1F1B")
    rows["after_failure"] = [err, train(pipe)]
    pipe.close()

    # a construction that fails on one rank (its stage_fn raises), then a new Pipeline; and one that fails beside a
    # live Pipeline, which goes on
    log("construction_failure")
    def bad(s):
        if rank == 2:
            raise ValueError("bad stage")
        return stage(s)
    errs = []
    try:
        mk("1F1B", fn=bad)
    except Exception as exc:
        errs.append(type(exc).__name__)
    pipe = mk("GPipe")
    l1 = train(pipe)
    try:
        mk("1F1B", fn=bad)
    except Exception as exc:
        errs.append(type(exc).__name__)
    rows["construction_failure"] = [errs, l1, train(pipe), dist.is_initialized()]
    pipe.close()
    rows["construction_failure"].append(dist.is_initialized())

    # two training Pipelines alive at once, each with data parallelism (its own mesh groups), steps interleaved;
    # the second one's losses equal those of the same Pipeline built alone (the sequence row's Interleaved1F1B)
    log("two_meshes")
    a = mk("1F1B", data_parallel=2)
    b = mk("Interleaved1F1B", data_parallel=2, fsdp=True)
    r = []
    for _ in range(2):
        r += [train(a), train(b)]
    a.close()
    r.append(train(b))
    b.close()
    rows["two_meshes"] = [r, dist.is_initialized()]

    # a PipelineGradScaler outlives its Pipeline: refused for the next one (it would unscale gradients it never
    # scaled); a new scaler takes its state
    log("scaler_after_close")
    pipe = mk("1F1B")
    scaler = pipeloom.PipelineGradScaler(pipe, init_scale=2.0 ** 20)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    train(pipe); scaler.step(opt); scaler.update()
    pipe.close()
    pipe = mk("1F1B")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    before = [q.detach().clone() for q in pipe.parameters()]
    train(pipe)
    try:
        scaler.step(opt)
        refused = None
    except pipeloom.PipelineConfigError as exc:
        refused = str(exc)
    moved = any(not torch.equal(a, q) for a, q in zip(before, pipe.parameters()))
    fresh = pipeloom.PipelineGradScaler(pipe)
    fresh.load_state_dict(scaler.state_dict())
    fresh.step(opt); fresh.update()
    rows["scaler_after_close"] = [refused, moved, fresh.get_scale()]
    pipe.close()

    # two alive: a training Pipeline (it made the group) and an evaluation one beside it; the first closes first
    log("two_alive")
    a = mk("1F1B")
    b = mk("GPipe", forward_only=True)
    la = train(a)
    a.close()
    out = b.eval(x)
    alive = dist.is_initialized()
    b.close()
    rows["two_alive"] = [la, None if out is None else list(out.shape), alive, dist.is_initialized()]

    # the script's own group, made after Pipelines made theirs (the same port: the same store server; torch's env://
    # prefix) and used by a Pipeline, destroyed by the script, then Pipelines that make their own again.  (Not twice:
    # a second init_process_group() from env:// on one port hangs in torch itself, pipeloom or not.)
    log("user_group")
    dist.init_process_group("gloo")
    pipe = mk("ZBVZeroBubble")
    r = [train(pipe)]
    pipe.close()
    r.append(dist.is_initialized())  # (not the Pipeline's to destroy)
    dist.destroy_process_group()
    for schedule in ("Interleaved1F1B", "1F1B"):
        pipe = mk(schedule)
        r.append(train(pipe))
        pipe.close()
    rows["user_group"] = r

    # checkpoint saved by one Pipeline, loaded by the next (which made a new group: the first one's close destroyed
    # its own), last: a failure here is recorded, not raised
    log("checkpoint")
    ck = os.environ["CKPT"]
    try:
        pipe = mk("1F1B", data_parallel=2)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        train(pipe); opt.step(); opt.zero_grad()
        pipeloom.save_checkpoint(ck, pipe, opt, step=1, stage_prefix=True)
        want = train(pipe)  # the next step's loss, from the saved parameters
        pipe.close()
        pipe = mk("GPipe", fn=lambda s: nn.Linear(4, 4), data_parallel=2)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        info = pipeloom.load_checkpoint(ck, pipe, opt, stage_prefix=True)
        rows["checkpoint"] = [info.step, want, train(pipe)]
        pipe.close()
    except Exception as exc:
        rows["checkpoint"] = [f"{type(exc).__name__}: {exc}"[-400:]]
    print(json.dumps({"rank": rank, "rows": rows}), flush=True)
    sys.stderr.flush()
    os._exit(0)
""")


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    d = tmp_path_factory.mktemp("life")
    script = d / "job.py"
    script.write_text(LIFECYCLE)
    env = {"RANKS_DIR": str(Path(__file__).parent / "ranks"), "CKPT": str(d / "ckpt")}
    codes, outs, errs = asyncio.run(spawn_ranks(4, [str(script)], timeout=150, env=env))
    assert codes == [0] * 4, "\n".join(f"--- rank {r}\n{e[-3000:]}" for r, e in enumerate(errs))
    return {d["rank"]: d["rows"] for d in (json.loads(o.strip().splitlines()[-1]) for o in outs)}


def test_lifecycle_sequence_of_schedules_and_meshes(lifecycle: dict[int, dict[str, Any]]) -> None:
    seq = lifecycle[0]["sequence"]
    assert [s[0] for s in seq] == ["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV", "GPipe"], seq
    for rank, rows in lifecycle.items():
        assert [s[2] for s in rows["sequence"]] == [s[2] for s in seq], (rank, rows["sequence"])  # losses agree
        for _, n, loss, during, after in rows["sequence"]:
            assert n >= 1 and loss > 0 and during and not after, (rank, rows["sequence"])


def test_lifecycle_after_a_failed_step(lifecycle: dict[int, dict[str, Any]]) -> None:
    for rank, rows in lifecycle.items():
        err, loss = rows["after_failure"]
        assert err == ("StageError" if rank == 1 else "RemoteRankError"), (rank, rows["after_failure"])
        assert loss == lifecycle[0]["after_failure"][1] and loss > 0, (rank, rows["after_failure"])


def test_lifecycle_after_a_failed_construction(lifecycle: dict[int, dict[str, Any]]) -> None:
    for rank, rows in lifecycle.items():
        errs, l1, l2, alive, after = rows["construction_failure"]
        assert errs == (["ValueError"] * 2 if rank == 2 else ["RemoteRankError"] * 2), (rank, errs)
        assert l1 > 0 and l2 == l1 and alive and not after, (rank, rows["construction_failure"])


def test_lifecycle_two_training_pipelines_with_meshes_alive_at_once(lifecycle: dict[int, dict[str, Any]]) -> None:
    alone = lifecycle[0]["sequence"][1][2]  # Interleaved1F1B at pp 2 x dp 2, built alone
    for rank, rows in lifecycle.items():
        r, after = rows["two_meshes"]
        assert r == lifecycle[0]["two_meshes"][0] and not after, (rank, rows["two_meshes"])
        # (no optimizer step: each Pipeline's loss stays; FSDP's equals the replicated one's to rounding)
        assert all(abs(v - alone) < 2e-6 for v in (r[1], r[3], r[4])) and r[0] == r[2] > 0, (rank, r, alone)


def test_lifecycle_scaler_of_a_closed_pipeline_is_refused(lifecycle: dict[int, dict[str, Any]]) -> None:
    for rank, rows in lifecycle.items():
        refused, moved, scale = rows["scaler_after_close"]
        assert refused is not None and "Pipeline is closed" in refused and not moved, (rank, rows["scaler_after_close"])
        assert scale == 2.0 ** 20, (rank, rows["scaler_after_close"])  # the state carried over (no overflow: kept)


def test_lifecycle_evaluation_pipeline_outlives_the_one_that_made_the_group(lifecycle: dict[int, dict[str, Any]]) -> None:
    for rank, rows in lifecycle.items():
        loss, shape, alive, after = rows["two_alive"]
        assert loss > 0 and alive and not after, (rank, rows["two_alive"])  # the last to close destroys the group
        assert shape == ([8, 4] if rank == 3 else None), (rank, rows["two_alive"])


def test_lifecycle_checkpoint_from_one_pipeline_into_the_next(lifecycle: dict[int, dict[str, Any]]) -> None:
    for rank, rows in lifecycle.items():
        assert len(rows["checkpoint"]) == 3, (rank, rows["checkpoint"])
        step, want, got = rows["checkpoint"]
        assert step == 1 and abs(want - got) < 1e-6, (rank, rows["checkpoint"])


def test_lifecycle_with_the_scripts_own_group_between(lifecycle: dict[int, dict[str, Any]]) -> None:
    for rank, rows in lifecycle.items():
        r = rows["user_group"]
        assert len(r) == 4 and r[1] is True and all(v > 0 for v in r[:1] + r[2:]), (rank, r)
        assert r == lifecycle[0]["user_group"], rank


RESTART = textwrap.dedent("""\
    import json, os, sys, torch, torch.distributed as dist, pipeloom
    from torch import nn
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    losses = []
    for schedule in ("1F1B", "Interleaved1F1B", "GPipe"):
        torch.manual_seed(0)
        pipe = pipeloom.Pipeline(lambda s: nn.Linear(4, 4), schedule=schedule, num_microbatches=2,
                                 loss_fn=nn.functional.mse_loss)
        pipe.step(torch.randn(4, 4), target=torch.randn(4, 4), return_outputs=False)
        losses.append(round(pipe.last_loss(), 6))
        pipe.close()
        if attempt == 0 and schedule == "Interleaved1F1B" and rank == 1:
            sys.exit(3)  # the first attempt fails between its Pipelines
    print("RESULT", json.dumps({"rank": rank, "attempt": attempt, "losses": losses}), flush=True)
""")


def test_launcher_restart_with_several_pipelines_per_attempt(tmp_path: Path) -> None:
    proc = launch_script(tmp_path, RESTART, launch_args=("--max-restarts", "1"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line.split("RESULT", 1)[1]) for line in proc.stdout.splitlines() if "RESULT" in line]
    assert sorted(r["rank"] for r in results) == [0, 1] and all(r["attempt"] == 1 for r in results), proc.stdout
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == 3, results
