"""A rank that runs one bad-input (or bad-value) case after another, each on a fresh Pipeline.

argv: OUT_DIR.  2 ranks, 1F1B (or ZBVZeroBubble where a case says so), 2 stages of
``Linear``.  Every case builds its Pipeline, runs what it runs, and records on
each rank how it ended: ``{"status": "ok", ...}`` or the error's type, message
and where (stage, microbatch, action), in ``OUT_DIR/rank{R}.json`` (a map from
case name to record).  A case's failure stops only that case: the next one
builds a new Pipeline, with a process group of its own (the failed one is closed).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import install_stack_dump  # noqa: E402

install_stack_dump()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import pipeloom  # noqa: E402

OUT = sys.argv[1]
RANK = int(os.environ["RANK"])
B, D, T = 8, 4, 5


class MaskStage(nn.Module):
    """x: (B, T); mask: (T, T), given whole: y = lin(x @ mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(T, T).double()

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return torch.tanh(self.lin(x @ mask if mask is not None else x))


class NanAt(nn.Module):
    """A Linear whose output turns NaN in the forward of one microbatch (by call count)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D).double()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.calls += 1
        return y * float("nan") if self.calls == self.at + 1 else y


class NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * float("nan")


class NanBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(NanGrad.apply(x))


class CastsItsInput(nn.Module):
    """A float64 stage that takes the float32 activations of the stage before and casts them itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.to(torch.float64))


class SlowLinear(nn.Module):
    """A Linear whose forward first sleeps: its rank is busy while a peer fails and closes."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D).double()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.seconds)
        return self.lin(x)


class OutputTracker(nn.Module):
    """A Linear that records, at each forward, how many of its earlier outputs' storages are still alive."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(D, D).double()
        self.refs: list[Any] = []
        self.alive: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import weakref

        y = self.lin(x)
        self.alive.append(sum(r() is not None for r in self.refs))
        self.refs.append(weakref.ref(y.untyped_storage()))  # the storage: the runtime keeps a detached alias
        return y


def diff_sum(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A loss whose graph does not hold ``y`` (so only the runtime could keep it alive)."""
    return (y - t).sum()


def mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((y - t) ** 2).mean()


def run_case(name: str, build: Callable[[], pipeloom.Pipeline], body: Callable[[pipeloom.Pipeline], dict[str, Any]]) -> dict[str, Any]:
    pipe = None
    # Each case's Pipeline creates and destroys its own process group, on a port of its own: a
    # failed step may leave transfers unpaired, which must not reach the next case's group
    # (and torch cannot re-create a group on the port of a destroyed one).
    os.environ["MASTER_PORT"] = _case_port()
    if os.environ.get("CHECKS_VERBOSE"):
        print(f"rank {RANK}: case {name}", file=sys.stderr, flush=True)
    try:
        pipe = build()
        rec = {"status": "ok", **body(pipe)}
    except Exception as exc:  # noqa: BLE001 - the record is the test's evidence
        rec = {"status": "error", "type": type(exc).__name__, "message": str(exc),
               **{k: getattr(exc, k) for k in ("stage", "microbatch", "action", "failed_rank") if hasattr(exc, k)}}
    finally:
        if pipe is not None:
            pipe.close()
        import torch.distributed as dist

        if dist.is_initialized():  # (a Pipeline closes the group it created; this is a safety net)
            dist.destroy_process_group()
    return rec


def linears(dtype: torch.dtype = torch.float64) -> Callable[[int], nn.Module]:
    torch.manual_seed(0)
    mods = [nn.Linear(D, D).to(dtype) for _ in range(2)]
    return lambda s: mods[s]


_CASES = iter(range(1, 1000))
_COORD: Any = None


def _case_port() -> str:
    """A fresh port for the next case's process group: rank 0 finds a free one and posts it.

    (Through a store of the worker's own on the harness's port: counting up from that port
    could meet another job's listener on this shared machine.)
    """
    global _COORD
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    if _COORD is None:
        _COORD = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, RANK == 0,
                               timeout=timedelta(seconds=120))
    key = f"port{next(_CASES)}"
    if RANK == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            _COORD.set(key, str(sock.getsockname()[1]))
    return _COORD.get(key).decode()


def main() -> None:
    results: dict[str, dict[str, Any]] = {}
    x = torch.randn(B, D, dtype=torch.float64)
    y = torch.randn(B, D, dtype=torch.float64)
    std = dict(schedule="1F1B", num_microbatches=4, loss_fn=mse)

    def pipe(stage_fn: Callable[[int], nn.Module] | None = None, **kw: Any) -> Callable[[], pipeloom.Pipeline]:
        return lambda: pipeloom.Pipeline(stage_fn or linears(), **{**std, **kw})

    def step(*args: Any, **kwargs: Any) -> Callable[[pipeloom.Pipeline], dict[str, Any]]:
        def body(p: pipeloom.Pipeline) -> dict[str, Any]:
            losses: list[torch.Tensor] = []
            p.step(*args, losses=losses, **kwargs)
            return {"losses": [float(v) for v in losses]}
        return body

    # -- rows: the target must match the input's rows
    results["target_rows"] = run_case("target_rows", pipe(), step(x, target=y[:6]))
    # -- a batch-independent keyword tensor: an error suggesting Replicate, then Replicate works
    torch.manual_seed(1)
    xm = torch.randn(B, T, dtype=torch.float64)
    ym = torch.randn(B, T, dtype=torch.float64)
    mask = torch.tril(torch.ones(T, T, dtype=torch.float64))
    torch.manual_seed(2)
    mask_stages = [MaskStage() for _ in range(2)]
    ref = xm
    with torch.no_grad():
        for m in mask_stages:
            ref = m(ref, mask)
        ref_losses = [float(mse(a, b)) for a, b in zip(torch.tensor_split(ref, 4), torch.tensor_split(ym, 4))]
    results["mask_cut"] = run_case("mask_cut", pipe(lambda s: mask_stages[s]), step(xm, target=ym, mask=mask))
    rec = run_case("mask_replicated", pipe(lambda s: mask_stages[s]), step(xm, target=ym, mask=pipeloom.Replicate(mask)))
    rec["reference"] = ref_losses
    results["mask_replicated"] = rec
    # -- a tuple target holding batch-row tensors: containers are not cut (one row per microbatch would broadcast)
    results["tuple_target"] = run_case("tuple_target", pipe(), step(x, target=(y, y)))
    # -- a keyword tensor that requires grad: each rank would keep only its own stages' share of its gradient
    results["mask_grad"] = run_case("mask_grad", pipe(lambda s: mask_stages[s]),
                                    step(xm, target=ym, mask=pipeloom.Replicate(mask.clone().requires_grad_())))
    # -- loss_fn / target missing
    results["no_target"] = run_case("no_target", pipe(), step(x))
    # rank 0 still computes its first forward when rank 1 fails and closes: its send then
    # breaks, and the abort read meanwhile (before the 'bye') is the error it reports
    results["no_target_while_busy"] = run_case("no_target_while_busy", pipe(lambda s: SlowLinear(1.5) if s == 0 else nn.Linear(D, D).double()), step(x))
    results["no_loss_fn_at_construction"] = run_case("no_loss_fn_at_construction", pipe(loss_fn=None), step(x, target=y))
    results["forward_only_then_step"] = run_case("forward_only_then_step", pipe(loss_fn=None, forward_only=True), step(x, target=y))
    results["forward_only_eval"] = run_case(
        "forward_only_eval", pipe(loss_fn=None, forward_only=True),
        lambda p: {"out_rows": None if (o := p.eval(x)) is None else int(o.shape[0])},
    )
    # -- return_outputs: kept (and returned) or dropped once each microbatch's loss is computed
    torch.manual_seed(0)
    tracked = [nn.Linear(D, D).double(), OutputTracker()]

    def outputs_body(p: pipeloom.Pipeline) -> dict[str, Any]:
        rec: dict[str, Any] = {}
        for keep in (True, False):
            tracked[1].refs.clear()
            tracked[1].alive.clear()
            for m in p.stages.values():
                m.zero_grad()
            losses: list[torch.Tensor] = []
            out = p.step(x, target=y, losses=losses, return_outputs=keep)
            grads = [m.weight.grad.flatten().tolist() for s, m in p.stages.items() if s == 0] + \
                [m.lin.weight.grad.flatten().tolist() for s, m in p.stages.items() if s == 1]
            ev = p.eval(x, target=y, return_outputs=keep)
            rec[str(keep)] = {"alive": list(tracked[1].alive), "out_rows": None if out is None else int(out.shape[0]),
                              "eval_rows": None if ev is None else int(ev.shape[0]),
                              "losses": [float(v) for v in losses], "grads": grads}
        return rec

    results["return_outputs"] = run_case("return_outputs", pipe(lambda s: tracked[s], schedule="GPipe", loss_fn=diff_sum),
                                         outputs_body)
    # -- profile_ranges: every action, wait and send is a range in a torch.profiler trace
    torch.manual_seed(0)
    slow_last = [nn.Linear(D, D).double(), SlowLinear(0.05)]

    def ranges_body(p: pipeloom.Pipeline) -> dict[str, Any]:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            p.step(x, target=y)
        names = sorted({e.name for e in prof.events() if e.name.startswith("PP:")})
        return {"names": names}

    results["profile_ranges"] = run_case("profile_ranges", pipe(
        lambda s: slow_last[s], options=pipeloom.RuntimeOptions(profile_ranges=True, static_shapes=False)), ranges_body)
    # -- dtypes: float32 stage into a float64 stage; a stage that casts for itself is fine
    torch.manual_seed(0)
    mixed = [nn.Linear(D, D).float(), nn.Linear(D, D).double()]
    results["dtype_mismatch"] = run_case("dtype_mismatch", pipe(lambda s: mixed[s]), step(x.float(), target=y))
    torch.manual_seed(0)
    casting = [nn.Linear(D, D).float(), CastsItsInput()]
    results["dtype_cast_in_stage"] = run_case("dtype_cast_in_stage", pipe(lambda s: casting[s]), step(x.float(), target=y))
    # -- check_finite: where a NaN first appears
    results["nan_forward"] = run_case(
        "nan_forward", pipe(lambda s: NanAt(2) if s == 1 else linears()(0), check_finite=True), step(x, target=y))
    ybad = y.clone()
    ybad[7, 0] = float("inf")  # microbatch 3's rows are 6 and 7
    results["nan_loss"] = run_case("nan_loss", pipe(check_finite=True), step(x, target=ybad))
    results["nan_loss_unchecked"] = run_case("nan_loss_unchecked", pipe(), step(x, target=ybad))
    results["nan_backward_B"] = run_case(
        "nan_backward_B", pipe(lambda s: NanBackward() if s == 1 else linears()(0), check_finite=True), step(x, target=y))
    torch.manual_seed(0)
    zb = [NanBackward() if s == 1 else nn.Linear(D, D).double() for s in range(4)]
    results["nan_backward_I"] = run_case(
        "nan_backward_I", pipe(lambda s: zb[s], schedule="ZBVZeroBubble", check_finite=True), step(x, target=y))
    torch.manual_seed(0)
    hooked = [nn.Linear(D, D).double() for _ in range(2)]
    hooked[0].weight.register_hook(lambda g: g * float("nan"))
    results["nan_param_grad"] = run_case("nan_param_grad", pipe(lambda s: hooked[s], check_finite=True), step(x, target=y))
    results["finite_ok"] = run_case("finite_ok", pipe(check_finite=True), step(x, target=y))
    # -- host_overlap_backward: forwards that start drawing random numbers after the first training step (a
    # dropout warmed up at p=0) while backwards run beside them: the step fails loudly, on both ranks
    torch.manual_seed(0)
    drawing = [nn.Linear(D, D).double() for _ in range(2)]
    calls = [0]

    def draw_later(module: nn.Module, args: Any) -> None:
        calls[0] += 1
        if calls[0] > 4:  # (4 microbatches a step: from the second step on)
            torch.rand(1)

    for m in drawing:
        m.register_forward_pre_hook(draw_later)

    def three_steps(p: pipeloom.Pipeline) -> dict[str, Any]:
        done = []
        for i in range(3):
            p.step(x, target=y)
            done.append((i, p.statistics.overlapped_backwards))
        return {"steps": done}

    results["overlap_draws_later"] = run_case(
        "overlap_draws_later", pipe(lambda s: drawing[s], options=pipeloom.RuntimeOptions(host_overlap_backward=True)),
        three_steps)

    # the same with activation checkpointing (its recomputation restores the generators' state around itself):
    # the step whose forwards drew beside a recomputing backward fails loudly, on both ranks
    class Ckpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(D, D).double()

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(self.inner, h, use_reentrant=False)

    torch.manual_seed(0)
    calls[0] = 0
    ckpt = [Ckpt() for _ in range(2)]
    for m in ckpt:
        m.register_forward_pre_hook(draw_later)
    results["overlap_draws_later_ckpt"] = run_case(
        "overlap_draws_later_ckpt", pipe(lambda s: ckpt[s], options=pipeloom.RuntimeOptions(host_overlap_backward=True)),
        three_steps)

    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
