"""One rank of the checkpoint / clipping / loss / accumulation tests (a rank pool, as worker.py).

Each case builds ``Net`` split by module names under some layout (pipeline
degree, schedule, stages per rank, data parallelism or FSDP), optionally loads
a checkpoint, runs steps (with global clipping, the step loss through
``pipe.last_loss``, or accumulation under ``pipe.no_sync()``), optionally saves
a checkpoint, and saves what it saw to ``{out}/{case}-rank{R}.pt``: per step
the losses, the gradient norm and the (clipped) gradients, and the final
parameters, all keyed by the model's names (FSDP shards gathered whole).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import install_stack_dump  # noqa: E402
from net import batch, build_net, fqns, loss_fn, make_optimizer  # noqa: E402


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grads(pipe: Any) -> dict[str, torch.Tensor]:
    return {n: _full(p.grad).detach().clone() for m in pipe.stages.values() for n, p in m.named_parameters() if p.grad is not None}


def _params(pipe: Any) -> dict[str, torch.Tensor]:
    out = {n: _full(p).detach().clone() for m in pipe.stages.values() for n, p in m.named_parameters()}
    out.update({f"buffer:{s}:{n}": b.detach().clone() for s, m in pipe.stages.items() for n, b in m.named_buffers()})
    return out


def run_case(cfg: dict[str, Any]) -> dict[str, Any]:
    import pipeloom
    from pipeloom.schedules import default_stages_per_rank

    dp = cfg.get("data_parallel", 1)
    pp = dist.get_world_size() // dp
    spr = cfg.get("spr") or default_stages_per_rank(cfg["schedule"])
    num_stages = pp * spr
    model = build_net(cfg)
    split = pipeloom.split_by_fqn(model, fqns(cfg.get("layers", 4), num_stages))
    wrap = cfg.get("fsdp_wrap")
    extra: dict[str, Any] = {}
    if wrap == "linears":  # each layer's Linear sharded, its `gain` replicated: both kinds in one stage
        extra["fsdp_wrap"] = lambda m: isinstance(m, torch.nn.Linear)
    elif wrap:
        extra["fsdp_wrap"] = wrap
    pipe = pipeloom.Pipeline(
        split, schedule=cfg["schedule"], num_microbatches=cfg["microbatches"], loss_fn=loss_fn, stages_per_rank=spr,
        data_parallel=dp, fsdp=cfg.get("fsdp", False), deterministic=cfg.get("deterministic", False), **extra,
    )
    opt = make_optimizer(pipe.parameters(), cfg)
    res: dict[str, Any] = {"steps": [], "stages": sorted(pipe.stages)}
    if cfg.get("per_rank_dirs"):
        # each rank passes its own directory: refused on every rank (none may wait for the others)
        rank = dist.get_rank()
        mine = os.path.join(cfg["per_rank_dirs"], f"r{rank}")
        res["errors"] = []
        for call in (lambda: pipeloom.save_checkpoint(mine, pipe, opt, step=1),
                     lambda: pipeloom.load_checkpoint(cfg["load_from_rank0"] if rank == 0 else mine, pipe, opt)):
            try:
                call()
                res["errors"].append(None)
            except (pipeloom.PipelineConfigError, FileNotFoundError) as exc:
                res["errors"].append(f"{type(exc).__name__}: {exc}")
        pipe.close()
        return res
    first = 0
    if cfg.get("load"):
        info = pipeloom.load_checkpoint(cfg["load"], pipe, opt)
        assert info is not None, f"no checkpoint under {cfg['load']}"
        first = info.step
        res["loaded"] = {"step": info.step, "extra": info.extra, "path": str(info.path), "rng": info.rng_restored}
        res["loaded_params"] = _params(pipe)
    if cfg.get("accumulate"):
        # k steps under no_sync, then one that reduces: gradients of the sum of all k + 1 steps
        for m in pipe.stages.values():
            m.zero_grad(set_to_none=True)
        k = cfg["accumulate"]
        with pipe.no_sync():
            for i in range(k):
                _step(pipe, cfg, i)
            try:
                pipe.clip_grad_norm_(1.0)
                res["clip_in_no_sync"] = None
            except pipeloom.PipelineConfigError as exc:
                res["clip_in_no_sync"] = str(exc)
                if not cfg.get("fsdp"):  # replicas' gradients, not reduced (FSDP keeps them unsharded, not on .grad)
                    res["steps"].append({"local": _grads(pipe)})
        _step(pipe, cfg, k)
        res["steps"].append({"grads": _grads(pipe), "loss_all": pipe.last_loss()})
    for step in range(first, first + cfg.get("steps", 0)):
        opt.zero_grad(set_to_none=True)
        _step(pipe, cfg, step)
        rec: dict[str, Any] = {"loss_all": pipe.last_loss(), "loss0": pipe.last_loss(reduce_to=0)}
        if cfg.get("clip") is not None:
            rec["norm"] = pipe.clip_grad_norm_(cfg["clip"], cfg.get("norm_type", 2.0))
        rec["grads"] = _grads(pipe)
        opt.step()
        res["steps"].append(rec)
        if cfg.get("save") and step + 1 == cfg["save"]["at"]:
            pending = pipeloom.save_checkpoint(
                cfg["save"]["path"], pipe, opt, step=step + 1, extra={"case": cfg["id"], "next": step + 1},
                async_save=cfg["save"].get("async", False),
            )
            if cfg["save"].get("async"):
                # the stager copied the state: training on must not change what is written
                res["async_done_at_return"] = pending.done()
    pipeloom.wait_checkpoints()
    res["params"] = _params(pipe)
    pipe.close()
    return res


def _step(pipe: Any, cfg: dict[str, Any], step: int) -> None:
    x, y = batch(cfg, step)
    pipe.step(x, target=y)


def main() -> None:
    install_stack_dump()
    job = json.load(open(sys.argv[1]))
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for cfg in job["cases"]:
        print(f"rank {rank}: case {cfg['id']}", file=sys.stderr, flush=True)
        if cfg.get("resume_clean"):  # the crash test's job, uninterrupted: its reference parameters
            from ckpt_resume_worker import run

            os.makedirs(cfg["resume_clean"], exist_ok=True)
            run("clean", cfg["resume_clean"], cfg["steps"], 0)
            result: dict[str, Any] = {}
        else:
            result = run_case(cfg)
        torch.save(result, os.path.join(job["out"], f"{cfg['id']}-rank{rank}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
