"""One rank of an integration test: run a configured pipeline, save what it saw.

Started by ``tests/ranks/harness.py`` with RANK/WORLD_SIZE/MASTER_* set (as
``pipeloom launch`` and torchrun do) and a JSON file holding a list of cases.
The process group is created once and every case runs in the same processes
(a rank pool: starting torch costs more than most cases).  Saves, per case
and step, each local parameter's gradient (named ``s{stage}.{param}``), the
losses and the merged output (on the last stage's rank), to
``{out}/{case}-rank{R}.pt``.

``engine`` is ``pipeloom`` or ``torch`` (torch.distributed.pipelining, as an
oracle for the same stages, schedule and microbatches).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import make_step_batches  # noqa: E402
from harness import init_backend, install_stack_dump  # noqa: E402
from models import apply_freeze, build_stages, loss_fn  # noqa: E402


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP shard) gathered whole; every rank of its group must call this in the same order."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grads(stages: dict[int, torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {
        f"s{s}.{name}": (_full(p.grad).detach().clone() if p.grad is not None else torch.zeros_like(_full(p)))
        for s, m in stages.items()
        for name, p in m.named_parameters()
    }


def _wrap_policy(cfg: dict[str, Any]) -> dict[str, Any]:
    """``fsdp_wrap`` for Pipeline; ``"linears"``: a callable policy that wraps only the Linear
    submodules, so each stage's own ``gain`` stays replicated (a mixed layout)."""
    wrap = cfg.get("fsdp_wrap")
    if wrap is None:
        return {}
    if wrap == "linears":
        return {"fsdp_wrap": lambda m: isinstance(m, torch.nn.Linear)}
    return {"fsdp_wrap": wrap}


def run_pipeloom(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    import pipeloom
    from pipeloom.schedules import generate, default_stages_per_rank

    world = int(os.environ["WORLD_SIZE"]) // cfg.get("data_parallel", 1)  # pipeline ranks
    name = cfg["schedule"]
    spr = cfg.get("stages_per_rank")
    schedule: Any = cfg.get("csv") or name
    if cfg.get("csv"):
        num_stages = _csv_stages(cfg["csv"])
    else:
        num_stages = world * (spr or default_stages_per_rank(name))
    dtype = getattr(torch, cfg.get("dtype", "float64"))
    os.environ.update(cfg.get("env", {}))
    all_stages = build_stages(num_stages, dim=cfg["dim"], multi=cfg.get("multi", False), seed=cfg.get("seed", 0), dtype=dtype,
                              model=cfg.get("model", "block"))
    all_stages = [m.to(_device()) for m in all_stages]
    if cfg.get("compile"):
        # compiled in place (parameter names unchanged); aot_eager keeps the test quick and
        # gives the same opaque CompiledFunctionBackward node that inductor gives
        for m in all_stages:
            m.compile(backend=cfg["compile"])
    pipe = pipeloom.Pipeline(
        lambda s: all_stages[s],
        schedule=schedule,
        num_microbatches=cfg["microbatches"],
        loss_fn=loss_fn,
        stages_per_rank=spr,
        deterministic=cfg.get("deterministic", False),
        **{k: cfg[k] for k in ("data_parallel", "fsdp", "trace", "bucket_bytes") if k in cfg},
        **_wrap_policy(cfg),
        **({"options": pipeloom.RuntimeOptions(**cfg.get("options", {}), **({"dispatch": cfg["dispatch"]} if "dispatch" in cfg else {}))}
           if "dispatch" in cfg or "options" in cfg else {}),
    )
    # a mixed layout (DTensor shards beside replicated tensors) needs the optimizer's per-tensor path
    mixed = cfg.get("fsdp_wrap") == "linears"
    opt = torch.optim.SGD(pipe.parameters(), lr=cfg.get("lr", 0.1), foreach=False if mixed else None) if pipe.parameters() else None
    result: dict[str, Any] = {"grads": [], "losses": [], "outputs": [], "eval": [], "stats": []}
    for step in range(cfg.get("steps", 1)):
        b = make_step_batches(cfg, step)
        if cfg.get("x_grad"):  # the batch requires grad: the first stage's backward reaches it
            b["x"].requires_grad_(True)
        for m in pipe.stages.values():
            m.zero_grad(set_to_none=True)
        apply_freeze(pipe.stages, cfg, step)
        losses: list[torch.Tensor] = []
        if "x_mbs" in b:
            out = pipe.step(pipeloom.Microbatches(b["x_mbs"]), target=pipeloom.Microbatches(b["y_mbs"]), losses=losses)
        else:
            kw = {"scale": b["scale"]} if "scale" in b else {}
            out = pipe.step(b["x"], target=b["target"], losses=losses, **kw)
        result["grads"].append(_grads(pipe.stages))
        if cfg.get("x_grad"):
            result.setdefault("x_grad", []).append(None if b["x"].grad is None else b["x"].grad.clone())
        result["losses"].append([l.clone() for l in losses])
        result["outputs"].append(out)
        st = pipe.statistics
        result["stats"].append(None if st is None else st.__dict__ if hasattr(st, "__dict__") else tuple(st))
        actor = getattr(pipe, "_actor", None)  # (private: host_overlap_backward auto's decisions and what they read)
        if actor is not None and hasattr(actor, "_bg_decided"):
            from pipeloom.schedules import ActionType
            result.setdefault("bg", []).append({
                "decided": {f"{b}>{f}": v for (b, f), v in actor._bg_decided.items()},
                "one_stream": {f"{b}>{f}": actor.dev.shares_stream(b, f) for (b, f) in actor._bg_decided},
                "inputs": {f"{b}>{f}": v for (b, f), v in getattr(actor, "_bg_inputs", {}).items()},
                "trial": None if getattr(actor, "_trial", None) is None else {
                    **actor._trial.state(), "pairs": [f"{b}>{f}" for (b, f) in sorted(actor._bg_try)]},
                "learned": {f"{t.value}{s}": actor.dev.learned((t, s)) for s in actor.stages
                            for t in (ActionType.F, ActionType.B)}})
        if opt is not None:
            opt.step()
        if cfg.get("eval"):
            if "x_mbs" in b:
                ev = pipe.eval(pipeloom.Microbatches(b["x_mbs"]))
            else:
                kw = {"scale": b["scale"]} if "scale" in b else {}
                ev = pipe.eval(b["x"], **kw)
            result["eval"].append(ev)
    result["stages"] = sorted(pipe.stages)
    result["params"] = {f"s{s}.{n}": _full(p).detach().clone() for s, m in pipe.stages.items() for n, p in m.named_parameters()}
    result["buffers"] = {f"s{s}.{n}": b.detach().clone() for s, m in pipe.stages.items() for n, b in m.named_buffers()}
    # (private: options.cuda_graphs, why a stage was not captured)
    result["graphs_disabled"] = {s: ex.graphs.disabled for s, ex in getattr(pipe, "_executors", {}).items()
                                 if getattr(ex, "graphs", None) is not None and ex.graphs.disabled}
    pipe.close()
    return result


def _csv_stages(path: str) -> int:
    from pipeloom.schedules import load_csv

    return load_csv(path).num_stages


def run_torch(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    """The same stages and microbatches through torch.distributed.pipelining."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    world = dist.get_world_size()
    cls = get_schedule_class(cfg["schedule"])
    single = issubclass(cls, PipelineScheduleSingle)
    spr = 1 if single else (cfg.get("stages_per_rank") or 2)
    num_stages = world * spr
    v_style = cfg["schedule"] in ("ZBVZeroBubble", "DualPipeV")
    if v_style:
        mine = [rank, 2 * world - 1 - rank]
    else:
        mine = [rank + k * world for k in range(spr)]
    dtype = getattr(torch, cfg.get("dtype", "float64"))
    all_stages = build_stages(num_stages, dim=cfg["dim"], multi=cfg.get("multi", False), seed=cfg.get("seed", 0), dtype=dtype)
    dev = _device()
    # Static shapes (input_args/output_args): torch's runtime shape inference is
    # what hangs GPipe/1F1B on NCCL, and these cases all have one shape.
    n = cfg["microbatches"]

    def ex(grad: bool) -> torch.Tensor:  # requires_grad as the real tensors: torch >= 2.13 sends no gradient back otherwise
        return torch.zeros(cfg["batch"] // n, cfg["dim"], dtype=dtype, device=dev, requires_grad=grad)

    on_gpu = dist.get_backend() == "nccl"
    stages = [
        PipelineStage(all_stages[s].to(dev), s, num_stages, dev,
                      **({"input_args": (ex(s != 0),), "output_args": (ex(True),)} if on_gpu and not cfg.get("multi") else {}))
        for s in mine
    ]
    sched = cls(stages[0] if single else stages, cfg["microbatches"], loss_fn=loss_fn)
    result: dict[str, Any] = {"grads": [], "losses": [], "outputs": []}
    local = {s: all_stages[s] for s in mine}
    for step in range(cfg.get("steps", 1)):
        b = make_step_batches(cfg, step)
        for m in local.values():
            m.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (b["x"].to(dev),) if 0 in local else ()
        tgt = b["target"].to(dev) if num_stages - 1 in local else None
        out = sched.step(*args, target=tgt, losses=losses)
        result["grads"].append(_grads(local))
        result["losses"].append([l.detach().clone() for l in losses])
        result["outputs"].append(out.detach() if isinstance(out, torch.Tensor) else None)
    return result


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value) if not hasattr(value, "_fields") else value
    return value


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def main() -> None:
    install_stack_dump()
    job = json.load(open(sys.argv[1]))
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    init_backend()  # nccl: the same cases on GPUs (run on the GPU machine)
    for cfg in job["cases"]:
        print(f"rank {rank}: case {cfg['id']}", file=sys.stderr, flush=True)  # where a hang happened
        fn = run_torch if cfg.get("engine") == "torch" else run_pipeloom
        result = _to_cpu(fn(cfg, rank))
        torch.save(result, os.path.join(job["out"], f"{cfg['id']}-rank{rank}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
