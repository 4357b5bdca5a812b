"""One rank of tests/test_checkpoint_adversarial.py: checkpoints that must survive a crash, and global clipping.

Two ways to run:

``python ckpt_adv_worker.py JOB.json`` (the harness's rank pool, :func:`harness.serve_job`): each case is one of

* ``job``: the training job below, from the latest complete checkpoint under its root when there is one;
* ``async``: an asynchronous save met by a slow rank 0, a failure of rank 0's finishing, or a write failure;
* ``refuse``: a checkpoint loaded by another model / optimizer, or corrupted on disk, must be refused on every
  rank with a clear error;
* ``clip``: ``clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_`` on the unsplit model.

``python ckpt_adv_worker.py crash CASE.json``: the training job of one case, where a rank dies by SIGKILL at the
point the case names (``crash``): the ranks are expected not to exit 0.

The training job: ``Net`` (dim 8, 4 layers, dropout) split by module names over 2 ranks (a schedule, 1 or 2
stages per rank), ``deterministic=True``, float64, AdamW or SGD with Nesterov momentum (only the trainable
parameters: a frozen layer is allowed), a LambdaLR schedule and the data position in ``extra``, gradient
accumulation over ``accumulate`` pipeline steps per optimizer step, clipping by the global norm, and a checkpoint
at each step of ``saves`` (a step listed twice is saved twice: the second replaces the first).  It records every
loss and norm, and at the end the parameters, the optimizer state by name and what the checkpoint root holds.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import serve_job  # noqa: E402
from net import batch, build_net, fqns, loss_fn  # noqa: E402

NET = dict(dim=8, layers=4, batch=16, seed=0)


def _build(cfg: dict[str, Any], *, dropout: float | None = None) -> tuple[Any, Any, Any]:
    import pipeloom

    spr = cfg.get("spr", 1)
    if cfg.get("model") == "moe":  # pp 2 x ep 2: each rank holds half of its stage's experts (tests/ranks/moe_model.py)
        from moe_model import MoEStage
        from moe_model import loss_fn as moe_loss

        def stage_fn(s: int, ctx: Any) -> torch.nn.Module:
            return MoEStage(s, group=ctx.ep_group, ep_rank=ctx.ep_rank, ep_size=ctx.ep_size)

        pipe = pipeloom.Pipeline(stage_fn, schedule=cfg.get("schedule", "1F1B"), num_microbatches=4, loss_fn=moe_loss,
                                 expert_parallel=cfg["ep"], deterministic=True)
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.02, weight_decay=0.1, foreach=False)
        return pipe, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.5 * s))
    model = build_net(dict(NET, dim=cfg.get("dim", 8), layers=cfg.get("layers", 4),
                           dropout=cfg.get("dropout", 0.1) if dropout is None else dropout))
    for name in cfg.get("frozen", ()):
        model.get_submodule(name).requires_grad_(False)
    split = pipeloom.split_by_fqn(model, fqns(cfg.get("layers", 4), 2 * spr))
    pipe = pipeloom.Pipeline(split, schedule=cfg.get("schedule", "1F1B"), num_microbatches=4, loss_fn=loss_fn,
                             stages_per_rank=spr, deterministic=True, data_parallel=cfg.get("dp", 1),
                             fsdp=cfg.get("fsdp", False))
    params = [p for p in pipe.parameters() if p.requires_grad]
    if not params:  # (a rank whose stages are frozen whole: clipping rows only)
        return pipe, None, None
    if cfg.get("optim", "adamw") == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                     foreach=False)
    else:
        opt = torch.optim.AdamW(params, lr=0.02, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.5 * s))
    return pipe, opt, sched


def _flat(t: torch.Tensor) -> list[float]:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t  # (FSDP's shards: the whole tensor)
    return t.detach().reshape(-1).tolist()


def _named_params(pipe: Any) -> dict[str, Any]:
    return {n: _flat(p) for m in pipe.stages.values() for n, p in m.named_parameters()}


def _optim_state(pipe: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    names = {id(p): n for m in pipe.stages.values() for n, p in m.named_parameters()}
    out: dict[str, Any] = {}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"{names[id(p)]}.{k}"] = _flat(v) if isinstance(v, torch.Tensor) else v
    out["lr"] = [g["lr"] for g in opt.param_groups]
    return out


def _root_listing(root: str) -> dict[str, list[str]]:
    """Each entry of the root with the files it holds (a checkpoint torn by a crash shows what it lacks)."""
    if not os.path.isdir(root):
        return {}
    return {n: sorted(os.listdir(os.path.join(root, n))) if os.path.isdir(os.path.join(root, n)) else []
            for n in sorted(os.listdir(root))}


def _arm(crash: dict[str, Any]) -> None:
    """Make this process die by SIGKILL at ``crash["how"]`` inside the save about to start."""
    from pipeloom.runtime import checkpoint as ck

    def die() -> None:
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    how = crash["how"]
    if how == "rmtree":  # a crash while a checkpoint directory is being deleted: one data file gone, then dead
        def rmtree(path: Any, *a: Any, **kw: Any) -> None:
            files = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
            if files:
                os.unlink(os.path.join(path, files[-1]))
            die()

        ck.shutil.rmtree = rmtree  # type: ignore[assignment]
    elif how == "finalize":  # rank 0, every rank's data and DCP's metadata written: before the marker
        ck._finalize = lambda *a, **kw: die()  # type: ignore[assignment]
    elif how == "after-write":  # this rank's data file written, DCP's finish never reached
        from torch.distributed.checkpoint.filesystem import _FileSystemWriter

        write = _FileSystemWriter.write_data

        def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
            fut = write(self, plan, planner)
            fut.wait()
            die()
            return fut

        _FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    else:
        raise ValueError(how)


def run_training(cfg: dict[str, Any], rank: int, crash: dict[str, Any] | None = None) -> dict[str, Any]:
    import pipeloom

    root = cfg["ckpt"]
    pipe, opt, sched = _build(cfg)
    torch.manual_seed(100 + rank)  # the dropout masks: each rank's own, continued by the saved RNG state
    prefix = cfg.get("model") == "moe"  # (every MoE stage names its parameters alike: keyed stage{S}.name)
    info = pipeloom.load_checkpoint(root, pipe, opt, stage_prefix=prefix)
    start, pos = 0, 0
    if info is not None:
        start, pos = info.step, info.extra["data"]
        sched.load_state_dict(info.extra["sched"])
    res: dict[str, Any] = {"start": start, "losses": [], "norms": [], "root_at_start": _root_listing(root)}
    k = cfg.get("accumulate", 1)
    saves = list(cfg.get("saves", ()))
    seen: dict[int, int] = {}
    for step in range(start, cfg["steps"]):
        opt.zero_grad(set_to_none=True)
        for _ in range(k):
            if prefix:
                from moe_model import make_batch

                x, y = make_batch(pos, rows=8, seq=3)
            else:
                x, y = batch(NET, pos)
            pos += 1
            pipe.step(x, target=y)
            res["losses"].append(pipe.last_loss())
        res["norms"].append(float(pipe.clip_grad_norm_(cfg.get("clip", 0.1), cfg.get("norm_type", 2.0))))
        opt.step()
        sched.step()
        for _ in range(saves.count(step + 1)):
            seen[step + 1] = seen.get(step + 1, 0) + 1
            if crash is not None and crash["rank"] == rank and [step + 1, seen[step + 1]] == crash["at"]:
                if cfg.get("async"):
                    pipeloom.wait_checkpoints()  # (the patch is process-wide: an earlier save must not meet it)
                _arm(crash)
            pipeloom.save_checkpoint(root, pipe, opt, step=step + 1, extra={"sched": sched.state_dict(), "data": pos},
                                     async_save=cfg.get("async", False), keep_last=cfg.get("keep_last"),
                                     stage_prefix=prefix)
    pipeloom.wait_checkpoints()
    dist.barrier()  # (rank 0 puts the last save in place after the others' wait returned)
    res.update(params=_named_params(pipe), optim=_optim_state(pipe, opt), root_at_end=_root_listing(root))
    pipe.close()
    return res


# ---------------------------------------------------------------- asynchronous saves that meet trouble


def run_async(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    """An asynchronous save of step 1, then what ``cfg["then"]`` says; every outcome recorded with its time."""
    import pipeloom
    from pipeloom.runtime import checkpoint as ck

    root = cfg["ckpt"]
    pipe, opt, _ = _build(cfg, dropout=0.0)
    fault = cfg["fault"]
    real_finalize = ck._finalize
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    real_write = _FileSystemWriter.write_data
    if fault == "slow-finalize" and rank == 0:  # a slow file system: the marker and rename take 0.5 s
        def slow(*a: Any, **kw: Any) -> None:
            time.sleep(0.5)
            real_finalize(*a, **kw)

        ck._finalize = slow  # type: ignore[assignment]
    elif fault == "finalize-enospc" and rank == 0:  # the disk fills up as rank 0 writes the marker
        def full(partial: Any, final: Any, step: int, *a: Any, **kw: Any) -> None:
            if step == 1:
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")
            real_finalize(partial, final, step, *a, **kw)

        ck._finalize = full  # type: ignore[assignment]
    elif fault == "write-enospc" and rank == 1:  # rank 1's disk is full
        calls = [0]

        def write(self: Any, plan: Any, planner: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")
            return real_write(self, plan, planner)

        _FileSystemWriter.write_data = write  # type: ignore[method-assign]
    elif fault == "stage-oom" and rank == 1:  # rank 1 runs out of memory copying the state to CPU memory
        from torch.distributed.checkpoint.staging import DefaultStager

        real_stage = DefaultStager.stage
        stages = [0]

        def stage(self: Any, *a: Any, **kw: Any) -> Any:
            stages[0] += 1
            if stages[0] == 1:
                raise MemoryError("out of memory copying the state to CPU (simulated)")
            return real_stage(self, *a, **kw)

        DefaultStager.stage = stage  # type: ignore[method-assign]
    out: dict[str, Any] = {"events": []}
    try:
        for step in range(3):
            x, y = batch(NET, step)
            opt.zero_grad(set_to_none=True)
            pipe.step(x, target=y)
            opt.step()
            t0 = time.perf_counter()
            try:
                if step == 0:
                    pipeloom.save_checkpoint(root, pipe, opt, step=1, async_save=True)
                    what = "saved 1"
                elif step == 1 and cfg["then"] == "load":
                    info = pipeloom.load_checkpoint(root, pipe, opt)
                    what = f"loaded {info.step if info else None}"
                else:
                    pipeloom.save_checkpoint(root, pipe, opt, step=step + 1, async_save=step == 1)
                    what = f"saved {step + 1}"
            except Exception as exc:  # noqa: BLE001 - recorded: the test checks it
                what = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, pipeloom.CheckpointError):
                    what += f" failed_ranks={exc.failed_ranks}"
            out["events"].append([what, time.perf_counter() - t0])
        pipeloom.wait_checkpoints()
        dist.barrier()
        out["listed"] = [s for s, _ in ck.list_checkpoints(root)]
    finally:
        if fault == "stage-oom" and rank == 1:
            DefaultStager.stage = real_stage  # type: ignore[method-assign]
        ck._finalize = real_finalize  # type: ignore[assignment]
        _FileSystemWriter.write_data = real_write  # type: ignore[method-assign]
        pipe.close()
    return out


# ---------------------------------------------------------------- refused loads


def run_refuse(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    """Save a 2-stage checkpoint, spoil it (rank 0) or build another model, load: every rank's outcome."""
    import pipeloom

    root = cfg["ckpt"]
    pipe, opt, _ = _build({}, dropout=0.0)
    x, y = batch(NET, 0)
    pipe.step(x, target=y)
    opt.step()
    saved = _named_params(pipe)
    pipeloom.save_checkpoint(root, pipe, opt, step=1)
    pipe.close()
    d = os.path.join(root, "step-00000001")
    spoil = cfg.get("spoil")
    if rank == 0 and spoil:
        if spoil == "truncate-rank1":
            path = os.path.join(d, "__1_0.distcp")
            data = open(path, "rb").read()
            open(path, "wb").write(data[: len(data) // 2])
        elif spoil == "missing-rank1":
            os.unlink(os.path.join(d, "__1_0.distcp"))
        elif spoil == "marker-garbage":
            open(os.path.join(d, "COMPLETE"), "w").write("{garbage")
        elif spoil == "metadata-truncated":
            path = os.path.join(d, ".metadata")
            data = open(path, "rb").read()
            open(path, "wb").write(data[: len(data) // 2])
    dist.barrier()
    pipe, opt, _ = _build(dict(cfg.get("load_cfg", {})), dropout=0.0)
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    try:
        info = pipeloom.load_checkpoint(root, pipe, opt)
        out["loaded"] = info.step if info else None
        got = _named_params(pipe)
        out["equal"] = all(got[n] == saved[n] for n in got if n in saved) and bool(got)
    except Exception as exc:  # noqa: BLE001 - recorded: the test checks it
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds_to_fail"] = time.perf_counter() - t0
    pipe.close()
    return out


# ---------------------------------------------------------------- ranks that pass different arguments


def run_args(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    """A save (then a load) whose ranks pass different arguments: refused on every rank, nothing written; or,
    where a rank's stages are frozen whole (it has no optimizer to pass), saved and loaded."""
    import pipeloom
    from pipeloom.runtime import checkpoint as ck

    root, how = cfg["ckpt"], cfg["how"]
    frozen = ["layers.2", "layers.3"] if how == "frozen-rank1" else []
    pipe, opt, _ = _build({"frozen": frozen}, dropout=0.0)
    x, y = batch(NET, 0)
    pipe.step(x, target=y)
    if opt is not None:
        opt.step()
    saved = _named_params(pipe)
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        if how == "step":
            pipeloom.save_checkpoint(root, pipe, opt, step=4 + rank)
        elif how == "async":
            pipeloom.save_checkpoint(root, pipe, opt, step=4, async_save=rank == 0)
        elif how == "optimizer":
            pipeloom.save_checkpoint(root, pipe, opt if rank == 0 else None, step=4)
        elif how == "keep_last":
            pipeloom.save_checkpoint(root, pipe, opt, step=4, keep_last=1 if rank == 0 else None)
        elif how in ("buffer-rank1", "buffer-every-stage"):
            # the buffer every stage of split_by_fqn keeps (Net's root `offset`), changed on rank 1's stage only
            # (a stage whose forward updates it) or on every stage
            if how == "buffer-every-stage" or rank == 1:
                with torch.no_grad():
                    for m in pipe.stages.values():
                        m.offset.add_(1.0)
            out["offset_saved"] = [m.offset.tolist() for m in pipe.stages.values()]
            pipeloom.save_checkpoint(root, pipe, opt, step=4)
            pipe.close()
            pipe, opt, _ = _build({}, dropout=0.0)
            pipeloom.load_checkpoint(root, pipe, opt)
            out["offset"] = [m.offset.tolist() for m in pipe.stages.values()]
        elif how == "keep-last-older-step":
            # steps 2 and 4 saved, then step 3 (a job that went back to step 2) with keep_last=1
            pipeloom.save_checkpoint(root, pipe, opt, step=2)
            pipeloom.save_checkpoint(root, pipe, opt, step=4)
            done = pipeloom.save_checkpoint(root, pipe, opt, step=3, keep_last=1)
            dist.barrier()
            out["returned_exists"] = done.path.is_dir()
        elif how == "load-with-grads":
            # loaded after a backward, before the new optimizer's first step: its state must be the checkpoint's
            pipeloom.save_checkpoint(root, pipe, opt, step=4)
            want = _optim_state(pipe, opt)
            pipe.close()
            pipe, opt, _ = _build({}, dropout=0.0)
            pipe.step(*batch(NET, 9)[:1], target=batch(NET, 9)[1])
            grads = {n: _flat(q.grad) for m in pipe.stages.values() for n, q in m.named_parameters()}
            pipeloom.load_checkpoint(root, pipe, opt)
            out["optim_equal"] = _optim_state(pipe, opt) == want and len(want) > 1
            out["grads_kept"] = grads == {n: _flat(q.grad) for m in pipe.stages.values() for n, q in m.named_parameters()}
        elif how == "load-optimizer":
            pipeloom.save_checkpoint(root, pipe, opt, step=4)
            pipeloom.load_checkpoint(root, pipe, opt if rank == 0 else None)
        else:  # frozen-rank1
            pipeloom.save_checkpoint(root, pipe, opt, step=4)
            pipe.close()
            pipe, opt, _ = _build({"frozen": frozen}, dropout=0.0)
            info = pipeloom.load_checkpoint(root, pipe, opt)
            out["loaded"] = info.step if info else None
            out["equal"] = _named_params(pipe) == saved
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - recorded: the test checks it
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.perf_counter() - t0
    pipeloom.wait_checkpoints()
    dist.barrier()
    out["listed"] = [s for s, _ in ck.list_checkpoints(root)]
    pipe.close()
    return out


# ---------------------------------------------------------------- clipping against the unsplit model


def run_clip(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    """One step, a gradient poked (inf / -inf / nan) on one rank's stage, then ``clip_grad_norm_`` on the Pipeline
    and torch's on the unsplit model with the same gradients: the norm, the error, every clipped gradient."""
    import math

    pipe, _, _ = _build(cfg, dropout=0.0)
    model = build_net(dict(NET, dropout=0.0))
    for name in cfg.get("frozen", ()):
        model.get_submodule(name).requires_grad_(False)
    x, y = batch(NET, 7)
    pipe.step(x, target=y)
    losses = [loss_fn(model(xm), ym) for xm, ym in zip(torch.tensor_split(x, 4), torch.tensor_split(y, 4))]
    (sum(losses) / 4).backward()
    full = dict(model.named_parameters())
    poke = cfg.get("poke")  # [parameter name, value]
    if poke is not None:
        name, value = poke
        full[name].grad.view(-1)[1] = float(value)
        for m in pipe.stages.values():
            for n, p in m.named_parameters():
                if n == name:
                    p.grad.view(-1)[1] = float(value)
    p_type = math.inf if cfg["norm_type"] == "inf" else float(cfg["norm_type"])
    out: dict[str, Any] = {}

    def outcome(fn: Any) -> Any:
        try:
            return float(fn())
        except RuntimeError as exc:
            return f"RuntimeError: {exc}"

    out["norm"] = outcome(lambda: pipe.clip_grad_norm_(cfg["max_norm"], p_type, error_if_nonfinite=cfg.get("strict", False)))
    out["want"] = outcome(lambda: torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.grad is not None], cfg["max_norm"], p_type,
        error_if_nonfinite=cfg.get("strict", False)))
    diffs = {}
    for m in pipe.stages.values():
        for n, p in m.named_parameters():
            a, b = p.grad, full[n].grad
            if (a is None) != (b is None):
                diffs[n] = f"grad None: pipeline {a is None}, unsplit {b is None}"
            elif a is not None and not torch.allclose(a, b, rtol=1e-12, atol=1e-15, equal_nan=True):
                diffs[n] = float((a - b).abs().nan_to_num(nan=math.inf).max())
    out["diffs"] = diffs
    pipe.close()
    return out


def run(cfg: dict[str, Any], job: dict[str, Any], rank: int) -> dict[str, Any]:
    kind = cfg.get("kind", "job")
    res = {"job": run_training, "async": run_async, "refuse": run_refuse, "args": run_args,
           "clip": run_clip}[kind](cfg, rank)
    res.setdefault("errors", [])
    return res


def crash_main() -> None:
    """``crash CASE.json``: the case's training job, where the rank named dies (the others fail after it)."""
    with open(sys.argv[2]) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    run_training(cfg, rank, cfg["crash"])
    print("survived", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "crash":
        crash_main()
    else:
        serve_job(run, hard_exit=True)
