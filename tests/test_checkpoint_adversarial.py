"""Checkpoints that must survive a crash, and global clipping, on real gloo ranks (float64).

Rows of one table (``tests/ranks/ckpt_adv_worker.py``), in three kinds:

* ``crash``: a training job (dropout with ``deterministic=True``, AdamW or SGD with Nesterov momentum, a
  LambdaLR schedule and the data position in ``extra``, clipping, gradient accumulation, a frozen layer; 1F1B,
  GPipe, Interleaved1F1B, ZBVZeroBubble; 2 ranks, and 4: pp 2 x FSDP 2, pp 2 x DDP 2, pp 2 x ep 2 with MoE
  stages) in which a rank is SIGKILLed inside a save: while a replaced checkpoint
  of the same step or a pruned old one (``keep_last``) is being deleted, before rank 0's marker of an
  asynchronous save, after rank 1 wrote its data of a synchronous one.  The job then restarts (fresh rank
  processes) from the latest complete checkpoint: it must start where the row says, every checkpoint it lists
  must hold every rank's data, and every later loss, norm, parameter and optimizer state (AdamW's step counts
  and moments, SGD's momentum, the scheduled learning rate) must equal the uninterrupted job's bit for bit.
* ``async`` / ``refuse`` / ``args``: an asynchronous save meeting a slow rank 0, a full disk on rank 0 as it
  finishes, a full disk on rank 1 as it writes, rank 1 out of memory copying the state to CPU; checkpoints loaded
  by another model or optimizer, or spoiled on disk (a rank's data file truncated or missing, the marker or DCP's
  metadata garbled); ranks that pass a save or load different arguments (step, ``async_save``, ``keep_last``, an
  optimizer); a buffer every stage keeps, changed on one stage; a load after a backward; ``keep_last`` on a step
  below the latest: every rank raises a clear error within seconds, or saves and loads exactly (a rank whose
  stages are frozen whole passes no optimizer).
* ``clip``: ``clip_grad_norm_`` with norm types 1, 3.5, 2 and inf, an inf / -inf / NaN gradient on either
  rank, ``error_if_nonfinite``, a frozen layer and a rank whose stage is frozen whole, against
  ``torch.nn.utils.clip_grad_norm_`` on the unsplit model.

Bugs these rows found (regression tests now):
- ``load_checkpoint`` right after an asynchronous save (rows ``async-slow-finalize``): a rank other than 0
  returned from its wait once its files were written, before rank 0 had written the marker and renamed the
  checkpoint into place, looked for the latest checkpoint and saw the one before: every rank refused ("rank 0
  would load step-N but ranks [1] see step-M"; 1 run in 3 without any slowness).  The pending saves are now
  waited for and agreed on every rank before a save or load looks at the directory.
- an asynchronous save whose finishing failed on rank 0 (a full disk as it writes the marker; row
  ``async-finalize-enospc``) raised there only, at its next checkpoint call; rank 1 went into that call's
  collective and both ranks hung (rank 0's script went on training).  Now every rank raises ``CheckpointError``
  naming rank 0 and the error, at once, and the job can save again.
- an asynchronous save whose write failed on a rank (row ``async-write-enospc``) raised DCP's
  ``CheckpointException`` (a ``BaseException``: a loop's ``except Exception`` missed it) from the next
  checkpoint call; now ``CheckpointError`` naming the rank whose write failed.
- an asynchronous save that failed on one rank before its writer started (out of memory copying the state to
  CPU memory; row ``async-stage-oom``) raised there at once, while the other ranks' writers waited in DCP's first
  collective for it, and every later checkpoint call with them: a hang on every rank (a script that caught the
  error).  That rank now joins the collective with a save that fails in its planning: every rank's save fails
  with its error, raised on every rank at the next checkpoint call, as for any asynchronous save.
- a checkpoint deleted midway by a crash (rows ``crash-resave-*``, ``crash-prune-*``): saving a step again
  (``shutil.rmtree`` of the old ``step-N``, then the rename) or pruning by ``keep_last`` removed files one by
  one, so a crash left a ``step-N`` with its marker and metadata but not every rank's data: listed as
  complete, and, when it was the latest, loaded by every restart, each failing in DCP.  Now a checkpoint is
  renamed out of the ``step-N`` names before it is deleted, and what a crash leaves is swept at a later save.
- ranks that passed a save different arguments (rows ``args-*``): different steps wrote into different
  directories and rank 0 marked its own complete without rank 1's data (the latest, unloadable); an optimizer on
  some ranks only wrote a complete checkpoint without the others' optimizer state; ``async_save`` on some ranks
  only hung both.  The arguments are agreed first now, a difference refused on every rank naming each value.
- a buffer every stage keeps (the root's, with ``split_by_fqn``) changed on rank 1's stage only
  (``args-buffer-rank1``): DCP saved rank 0's copy and the load gave it to every stage, silently; now refused.
- ``load_checkpoint`` after a backward, before the optimizer's first step (``args-load-with-grads``): torch's
  ``get_state_dict`` made no state entries while gradients existed, so AdamW's state was not read at all and
  the optimizer went on with empty state; the gradients are set aside while the state dicts are taken now.
- ``keep_last=1`` on a save of a step below the latest (``args-keep-last-older-step``) deleted the checkpoint
  it had just written.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import RanksFailed, run_job, spawn_ranks  # noqa: E402

WORKER = Path(__file__).parent / "ranks" / "ckpt_adv_worker.py"

# ---------------------------------------------------------------- the table

# crash rows: (name, the job, who dies where (rank, [step saved, its n-th save], how), the step the restart resumes at)
CRASHES: list[tuple[str, dict[str, Any], dict[str, Any], int]] = [
    # step 4 saved twice (Interleaved1F1B, 2 stages per rank); rank 0 dies deleting the first step-4 as the
    # second replaces it: the restart resumes from the second, complete step 4
    ("resave-interleaved", dict(schedule="Interleaved1F1B", spr=2, saves=[2, 4, 4, 6]),
     dict(rank=0, at=[4, 2], how="rmtree"), 4),
    # keep_last=1 (1F1B, SGD with momentum): rank 0 dies pruning step 2 after step 4 is complete
    ("prune-sgd", dict(schedule="1F1B", optim="sgd", keep_last=1, saves=[2, 4, 6]),
     dict(rank=0, at=[4, 1], how="rmtree"), 4),
    # asynchronous saves (ZBVZeroBubble, 2 stages per rank, 2 pipeline steps per optimizer step): rank 0 dies
    # when every rank's data and the metadata of step 4 are written, before its marker
    ("async-finalize-zbv", dict(schedule="ZBVZeroBubble", spr=2, accumulate=2, saves=[2, 4, 6], **{"async": True}),
     dict(rank=0, at=[4, 1], how="finalize"), 2),
    # synchronous saves (GPipe, SGD, layer 1 frozen): rank 1 dies once its data of step 4 is written
    ("after-write-gpipe", dict(schedule="GPipe", optim="sgd", frozen=["layers.1"], saves=[2, 4, 6]),
     dict(rank=1, at=[4, 1], how="after-write"), 2),
    # 4 ranks: pp 2 x FSDP 2 (asynchronous saves, SGD) and pp 2 x DDP 2 (Interleaved1F1B, step 4 saved twice)
    ("fsdp-after-write", dict(world=4, dp=2, fsdp=True, optim="sgd", saves=[2, 4, 6], **{"async": True}),
     dict(rank=3, at=[4, 1], how="after-write"), 2),
    ("ddp-resave-interleaved", dict(world=4, dp=2, schedule="Interleaved1F1B", spr=2, saves=[2, 4, 4, 6]),
     dict(rank=0, at=[4, 2], how="rmtree"), 4),
    # pp 2 x ep 2 (MoE stages, each rank half of its stage's experts): rank 2 killed once its data is written
    ("ep-after-write", dict(world=4, model="moe", ep=2, saves=[2, 4, 6]), dict(rank=2, at=[4, 1], how="after-write"), 2),
]

# async rows: (name, fault, what follows the asynchronous save of step 1, what every rank's events must say)
ASYNC: list[tuple[str, str, str, list[str]]] = [
    ("async-slow-finalize", "slow-finalize", "load", ["saved 1", "loaded 1", "saved 3"]),
    ("async-finalize-enospc", "finalize-enospc", "save",
     ["saved 1", "CheckpointError: rank {r}: save_checkpoint(step 2): the asynchronous save of step 1 did not complete "
      "(it failed on rank(s) [0]: OSError: [Errno 28] No space left on device", "saved 3"]),
    ("async-write-enospc", "write-enospc", "load",
     ["saved 1", "CheckpointError: rank {r}: load_checkpoint(", "saved 3"]),
    ("async-stage-oom", "stage-oom", "save",
     ["saved 1", "CheckpointError: rank {r}: save_checkpoint(step 2): the asynchronous save of step 1 did not complete "
      "(it failed on rank(s) [1]: MemoryError: out of memory copying the state to CPU", "saved 3"]),
]

# refuse rows: (name, how the checkpoint is spoiled, the loading model, what every rank's error holds; None: loads)
REFUSE: list[tuple[str, str | None, dict[str, Any], str | None]] = [
    ("other-dim", None, dict(dim=6), "Size mismatch between saved torch.Size([8]) and current: torch.Size([6])"),
    ("more-layers", None, dict(layers=8), "holds no layers.4.gain"),
    # (was DCP's "Missing key in checkpoint state_dict: optim.state.layers.0.gain.momentum_buffer")
    ("other-optimizer", None, dict(optim="sgd"), "holds the state of AdamW but this rank loads it into SGD: pass optimizer=None"),
    ("interleaved", None, dict(schedule="Interleaved1F1B", spr=2), None),
    # (found before anything is read: every rank checks the data files' sizes against the metadata)
    ("truncate-rank1", "truncate-rank1", {}, "__1_0.distcp is "),
    ("missing-rank1", "missing-rank1", {}, "__1_0.distcp"),
    ("marker-garbage", "marker-garbage", {}, "JSONDecodeError"),
    ("metadata-truncated", "metadata-truncated", {}, "UnpicklingError"),
]

# argument rows: (name, what the ranks pass differently, what every rank's error holds; None: saved and loaded)
ARGS: list[tuple[str, str, str | None]] = [
    ("step", "step", "the ranks passed different step (rank 0: 4, rank 1: 5)"),
    ("async", "async", "the ranks passed different async_save (rank 0: True, rank 1: False)"),
    ("optimizer", "optimizer", "the ranks passed different optimizers (rank 0: 1, rank 1: 0)"),
    ("keep-last", "keep_last", "the ranks passed different keep_last (rank 0: 1, rank 1: None)"),
    ("load-optimizer", "load-optimizer", "load_checkpoint("),
    # rank 1's stages frozen whole: it has no optimizer to pass, rank 0 has one
    ("frozen-rank1", "frozen-rank1", None),
    # the buffer every stage keeps (the root's), changed on rank 1 only: the checkpoint can hold one value
    ("buffer-rank1", "buffer-rank1", "the buffer 'offset' that stage 0 (rank 0) and stage 1 (rank 1) both keep differs"),
    ("buffer-every-stage", "buffer-every-stage", None),
    # loaded after a backward, before the optimizer's first step: AdamW's state must come back (gradients kept)
    ("load-with-grads", "load-with-grads", None),
    # keep_last=1 on a save of a step below the latest: it must not delete the checkpoint it just wrote
    ("keep-last-older-step", "keep-last-older-step", None),
]

# (rows run in a pool of their own: without their fix the ranks hung)
ISOLATED = {"async"}

# clip rows: (name, norm type, max_norm, poked gradient (name, value) or None, error_if_nonfinite, frozen modules)
CLIPS: list[tuple[str, Any, float, list[Any] | None, bool, list[str]]] = [
    ("l1", 1, 0.05, None, False, []),
    ("l3.5-frozen", 3.5, 0.05, None, False, ["layers.1"]),
    ("l2-rank1-frozen-whole", 2, 0.05, None, False, ["layers.2", "layers.3"]),
    ("l2-inf-rank1", 2, 0.05, ["layers.3.lin.weight", "inf"], False, []),
    ("l1-ninf-rank0", 1, 0.05, ["layers.0.gain", "-inf"], False, []),
    ("inf-inf-rank1", "inf", 0.05, ["layers.2.lin.bias", "inf"], False, []),
    ("l2-nan-rank1-strict", 2, 0.05, ["layers.3.gain", "nan"], True, []),
    ("inf-ninf-rank1-strict", "inf", 0.05, ["layers.3.lin.weight", "-inf"], True, []),
    ("l2-inf-rank0-strict", 2, 0.05, ["layers.1.lin.weight", "inf"], True, []),
]


def _clean(name: str, job: dict[str, Any], base: Path) -> dict[str, Any]:
    return dict(job, id=f"clean-{name}", ckpt=str(base / f"clean-{name}"), steps=6)


def _cases(base: Path, world: int = 2) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name, job, _, _ in CRASHES:
        if job.get("world", 2) != world:
            continue
        out.append(_clean(name, job, base))
        out.append(dict(_clean(name, job, base), id=f"crash-{name}", ckpt=str(base / f"crash-{name}")))
    if world != 2:
        return out
    for name, spoil, load_cfg, _ in REFUSE:
        out.append(dict(id=f"refuse-{name}", kind="refuse", spoil=spoil, load_cfg=load_cfg, ckpt=str(base / f"refuse-{name}")))
    for name, how, _ in ARGS:
        if name not in ISOLATED:
            out.append(dict(id=f"args-{name}", kind="args", how=how, ckpt=str(base / f"args-{name}")))
    for name, norm, max_norm, poke, strict, frozen in CLIPS:
        out.append(dict(id=f"clip-{name}", kind="clip", norm_type=norm, max_norm=max_norm, poke=poke, strict=strict,
                        frozen=frozen))
    return out


async def _crash(base: Path, name: str, job: dict[str, Any], crash: dict[str, Any]) -> dict[str, Any]:
    """The job's first attempt, in which ``crash`` kills a rank: its ranks' exit codes and stderr tails."""
    cfg = dict(_clean(name, job, base), ckpt=str(base / f"crash-{name}"), crash=crash)
    path = base / f"crash-{name}.json"
    path.write_text(json.dumps(cfg))
    codes, outs, errs = await spawn_ranks(job.get("world", 2), [str(WORKER), "crash", str(path)], timeout=90)
    return {"codes": codes, "survived": ["survived" in o for o in outs], "errs": [e[-2000:] for e in errs]}


async def _all(base: Path) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    crashes = {}
    for name, job, crash, _ in CRASHES:
        crashes[name] = await _crash(base, name, job, crash)
    pool = await run_job(2, WORKER, _cases(base), base / "out", base, timeout=180)
    pool.update(await run_job(4, WORKER, _cases(base, 4), base / "out4", base, timeout=180))
    # the rows that hung without their fix each in a pool of its own (together), bounded: a rank that waits for
    # a failed peer (async-finalize-enospc, args-async) or dies of a BaseException fails its row only

    async def one(case: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
        try:
            return await run_job(2, WORKER, [case], base / f"out-{case['id']}", base, timeout=45)
        except RanksFailed as exc:
            return {case["id"]: [{"errors": [f"the pool failed: {exc}"[:6000]]}] * 2}

    alone = [dict(id=name, kind="async", fault=fault, then=then, ckpt=str(base / name)) for name, fault, then, _ in ASYNC]
    alone += [dict(id=f"args-{name}", kind="args", how=how, ckpt=str(base / f"args-{name}"))
              for name, how, _ in ARGS if name in ISOLATED]
    for got in await asyncio.gather(*(one(case) for case in alone)):
        pool.update(got)
    return crashes, pool


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    return asyncio.run(_all(tmp_path_factory.mktemp("ckadv")))


def _no_errors(cid: str, ranks: list[dict[str, Any]]) -> None:
    for r, res in enumerate(ranks):
        assert not res["errors"], f"{cid} rank {r}: {res['errors'][0]}"


# ---------------------------------------------------------------- crash, restart, continue exactly


@pytest.mark.parametrize("name,job,crash,start", CRASHES, ids=[c[0] for c in CRASHES])
def test_a_job_killed_in_a_save_resumes_exactly(results: Any, name: str, job: dict[str, Any], crash: dict[str, Any],
                                                start: int) -> None:
    crashes, pool = results
    died = crashes[name]
    assert died["codes"][crash["rank"]] == -9, died  # the rank was killed where the row says...
    assert not any(died["survived"]), died  # ...and its peer did not finish the job either (nor hang: timeout 90 s)
    clean, resumed = pool[f"clean-{name}"], pool[f"crash-{name}"]
    _no_errors(f"clean-{name}", clean)
    _no_errors(f"crash-{name}", resumed)
    k = job.get("accumulate", 1)
    world = job.get("world", 2)
    for r in range(world):
        a, b = clean[r], resumed[r]
        assert a["start"] == 0 and b["start"] == start, (r, b["start"])
        assert len(a["losses"]) == 6 * k and len(a["norms"]) == 6 and a["params"] and len(a["optim"]) > 1, r
        # what the restart found: every step-N it could take holds every rank's data
        for entry, files in b["root_at_start"].items():
            if entry.startswith("step-"):
                want = {"COMPLETE", ".metadata", *(f"__{q}_0.distcp" for q in range(world))}
                assert want <= set(files), (entry, files)
        assert b["losses"] == a["losses"][start * k:], r
        assert b["norms"] == a["norms"][start:], r
        assert b["params"] == a["params"], r
        assert b["optim"] == a["optim"], r
        # the next save swept what the crash left of a deletion
        assert not [e for e in b["root_at_end"] if ".deleting" in e], b["root_at_end"]
    if job.get("keep_last"):
        assert [e for e in resumed[0]["root_at_end"] if e.startswith("step-")] == ["step-00000006"]


# ---------------------------------------------------------------- asynchronous saves that meet trouble


@pytest.mark.parametrize("name,fault,then,want", ASYNC, ids=[a[0] for a in ASYNC])
def test_an_async_save_in_trouble_is_known_to_every_rank(results: Any, name: str, fault: str, then: str,
                                                         want: list[str]) -> None:
    ranks = results[1][name]
    _no_errors(name, ranks)
    for r, res in enumerate(ranks):
        events = res["events"]
        assert len(events) == len(want), (r, events)
        for (got, seconds), expected in zip(events, want):
            assert got.startswith(expected.format(r=r)), (r, got)
            assert seconds < 10, (r, got, seconds)
        if fault == "write-enospc":
            assert "failed on rank(s) [1]: OSError: [Errno 28]" in events[1][0] and "failed_ranks=[1]" in events[1][0]
        if fault == "finalize-enospc":
            assert "failed_ranks=[0]" in events[1][0]
        if fault == "stage-oom":
            assert "failed_ranks=[1]" in events[1][0]
        # the failed save is never listed; the later one is
        assert res["listed"] == ([1, 3] if fault == "slow-finalize" else [3]), (r, res["listed"])


# ---------------------------------------------------------------- other models, spoiled checkpoints


@pytest.mark.parametrize("name,spoil,load_cfg,want", REFUSE, ids=[c[0] for c in REFUSE])
def test_a_checkpoint_that_does_not_fit_is_refused_on_every_rank(results: Any, name: str, spoil: str | None,
                                                                 load_cfg: dict[str, Any], want: str | None) -> None:
    ranks = results[1][f"refuse-{name}"]
    _no_errors(name, ranks)
    for r, res in enumerate(ranks):
        if want is None:
            assert "error" not in res and res["loaded"] == 1 and res["equal"], (r, res)
            continue
        assert "error" in res, (r, res)
        # (a CheckpointError names this rank and the failing one; a PipelineConfigError the rank it is about)
        assert want in res["error"] and res["error"].split(":", 2)[1].startswith(" rank "), (r, res["error"])
        if res["error"].startswith("CheckpointError"):
            assert res["error"].split(":", 2)[1] == f" rank {r}", (r, res["error"])
        assert res["seconds_to_fail"] < 10, (r, res)


@pytest.mark.parametrize("name,how,want", ARGS, ids=[a[0] for a in ARGS])
def test_ranks_that_pass_different_arguments_are_refused_together(results: Any, name: str, how: str,
                                                                  want: str | None) -> None:
    ranks = results[1][f"args-{name}"]
    _no_errors(name, ranks)
    for r, res in enumerate(ranks):
        if want is None:
            if how == "load-with-grads":
                assert res["error"] is None and res["optim_equal"] and res["grads_kept"], (r, res)
                continue
            if how == "keep-last-older-step":
                assert res["error"] is None and res["returned_exists"] and res["listed"] == [3, 4], (r, res)
                continue
            assert res["error"] is None and res["listed"] == [4], (r, res)
            if how == "frozen-rank1":
                assert res["loaded"] == 4 and res["equal"], (r, res)
            else:  # the value every stage had at the save
                assert res["offset"] == res["offset_saved"] and res["offset"][0][0] == 1.0, res
            continue
        assert res["error"] and res["error"].startswith(f"PipelineConfigError: rank {r}: ") and want in res["error"], (r, res)
        if how == "load-optimizer":
            assert "the ranks passed different optimizers (rank 0: 1, rank 1: 0)" in res["error"], (r, res)
        assert res["seconds"] < 10, (r, res)
        # nothing half-written is listed (the load row's save was complete)
        assert res["listed"] == ([4] if how == "load-optimizer" else []), (r, res["listed"])


# ---------------------------------------------------------------- clipping against the unsplit model


@pytest.mark.parametrize("name,norm,max_norm,poke,strict,frozen", CLIPS, ids=[c[0] for c in CLIPS])
def test_clip_grad_norm_is_torchs_on_the_unsplit_model(results: Any, name: str, norm: Any, max_norm: float,
                                                       poke: list[Any] | None, strict: bool, frozen: list[str]) -> None:
    ranks = results[1][f"clip-{name}"]
    _no_errors(name, ranks)
    for r, res in enumerate(ranks):
        got, want = res["norm"], res["want"]
        if isinstance(want, str):  # torch raised: so must every rank
            assert isinstance(got, str) and "non-finite" in got and "non-finite" in want, (r, got, want)
            continue
        assert not isinstance(got, str), (r, got)
        assert got == pytest.approx(want, rel=1e-12, nan_ok=True), (r, got, want)
        assert not res["diffs"], (r, res["diffs"])
    if not isinstance(ranks[0]["norm"], str):  # every rank: the same number
        assert ranks[0]["norm"] == pytest.approx(ranks[1]["norm"], rel=0, abs=0, nan_ok=True)
