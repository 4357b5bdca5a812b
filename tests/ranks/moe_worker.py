"""One rank of the expert-parallel tests: pp x ep ranks train the MoE model under each schedule.

Saves, per case and step, every local parameter's gradient (``s{stage}.{name}``),
the losses and the output, and the rank's stage and ep index, to
``{out}/{case}-rank{R}.pt``.  All cases run in one pool of processes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import init_backend, install_stack_dump  # noqa: E402
from moe_model import MoEStage, loss_fn, make_batch  # noqa: E402


def run_case(cfg: dict[str, Any]) -> dict[str, Any]:
    import pipeloom

    ep = cfg["ep"]
    ctxs: dict[int, Any] = {}

    def stage_fn(s: int, ctx: pipeloom.StageContext) -> torch.nn.Module:
        ctxs[s] = ctx
        return MoEStage(s, group=ctx.ep_group, ep_rank=ctx.ep_rank, ep_size=ctx.ep_size).to(ctx.device)

    layout: dict[str, Any] = {"expert_parallel": ep, **({"data_parallel": cfg["dp"]} if cfg.get("dp") else {})}
    if cfg.get("mesh"):  # the layout given as a DeviceMesh with dims ("pp", "ep")
        from torch.distributed.device_mesh import init_device_mesh

        dev_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        layout = {"mesh": init_device_mesh(dev_type, (dist.get_world_size() // ep, ep), mesh_dim_names=("pp", "ep"))}
    schedule: Any = cfg["schedule"]
    if cfg.get("overlap_input_only"):  # DualPipeV's pairs as (F;I) then W
        from pipeloom.schedules import generate, overlap_input_only

        schedule = overlap_input_only(generate(schedule, num_ranks=dist.get_world_size() // ep, num_microbatches=cfg["microbatches"]))
    pipe = pipeloom.Pipeline(stage_fn, schedule=schedule, num_microbatches=cfg["microbatches"], loss_fn=loss_fn,
                             trace=cfg.get("trace"), **layout)
    dev = pipe.device
    result: dict[str, Any] = {"grads": [], "losses": [], "outputs": [], "stages": sorted(pipe.stages),
                              "ep_rank": {s: c.ep_rank for s, c in ctxs.items()}, "deterministic": pipe.options.deterministic,
                              "column": pipe.dp_rank}
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=cfg.get("momentum", 0.0))
    if cfg.get("load"):  # a checkpoint another layout saved: what this rank's tensors hold after loading it
        info = pipeloom.load_checkpoint(os.path.join(cfg["out"], cfg["load"]), pipe, opt, stage_prefix=True)
        result["loaded_step"] = info.step if info is not None else None
        result["loaded"] = _tensors(pipe, opt)
    for step in range(cfg.get("steps", 1)):
        x, y = make_batch(step, rows=cfg["rows"], seq=cfg["seq"])
        opt.zero_grad(set_to_none=True)
        fail = cfg.get("fail")
        if fail and fail["rank"] == int(os.environ["RANK"]) and fail["step"] == step:
            for m in pipe.stages.values():
                m.boom = True
        losses: list[torch.Tensor] = []
        out = pipe.step(x.to(dev), target=y.to(dev), losses=losses)
        result["grads"].append({f"s{s}.{n}": p.grad.detach().cpu().clone() for s, m in pipe.stages.items()
                                for n, p in m.named_parameters()})
        result["losses"].append([l.detach().cpu().clone() for l in losses])
        result["outputs"].append(None if out is None else out.detach().cpu())
        result.setdefault("last_loss", []).append(pipe.last_loss())  # every rank: a collective
        opt.step()
        if cfg.get("eval"):
            ev = pipe.eval(x.to(dev))
            result.setdefault("eval", []).append(None if ev is None else ev.detach().cpu())
    if cfg.get("clip"):  # the last step's gradients clipped by the global norm of the unsplit model
        norm = pipe.clip_grad_norm_(cfg["clip"])
        result["clip_norm"] = float(norm)
        result["clipped"] = {f"s{s}.{n}": p.grad.detach().cpu().clone() for s, m in pipe.stages.items()
                             for n, p in m.named_parameters()}
    if cfg.get("save"):  # a checkpoint of the trained state (expert shards from every ep rank)
        pending = pipeloom.save_checkpoint(os.path.join(cfg["out"], cfg["save"]), pipe, opt, step=cfg.get("steps", 1),
                                           stage_prefix=True, async_save=bool(cfg.get("async_save")))
        result["save_was_async"] = pending._future is not None  # (written by a background thread)
        result["saved"] = _tensors(pipe, opt)  # the state as of the call
        if cfg.get("async_save"):  # training goes on while it is written: the checkpoint must not see this
            with torch.no_grad():
                for p in pipe.parameters():
                    p.add_(1.0)
        pending.wait(120)
    pipe.close()
    return result


def _tensors(pipe: Any, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every local parameter and its momentum buffer, by ``s{stage}.{name}`` (``...:momentum``)."""
    out: dict[str, torch.Tensor] = {}
    for s, m in pipe.stages.items():
        for n, p in m.named_parameters():
            out[f"s{s}.{n}"] = p.detach().cpu().clone()
            buf = opt.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                out[f"s{s}.{n}:momentum"] = buf.detach().cpu().clone()
    return out


def main() -> None:
    install_stack_dump()
    job = json.load(open(sys.argv[1]))
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    init_backend()
    for cfg in job["cases"]:
        print(f"rank {rank}: case {cfg['id']}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            result = run_case(dict(cfg, out=job["out"]))
        except Exception as exc:  # the fault test: what each rank saw, and when
            rec = {"type": type(exc).__name__, "message": str(exc), "t": time.time(), "after_s": time.monotonic() - t0,
                   "failed_rank": getattr(exc, "failed_rank", None)}
            with open(os.path.join(job["out"], f"{cfg['id']}-rank{rank}.json"), "w") as f:
                json.dump(rec, f)
            raise
        torch.save(result, os.path.join(job["out"], f"{cfg['id']}-rank{rank}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
