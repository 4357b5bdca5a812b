"""A rank of tests/test_tensor_plane.py: the gloo header protocol of ``TensorPlane``, alone.

Both ranks run the same scripted steps (``SCRIPTS``): in each, some transfers
go 0 -> 1 and some 1 -> 0, with tensors whose content is a function of (step,
position), so the receiver can check every byte.  Each rank prints one JSON
line: per step, what landed (key, shapes, fast or not, payload correct, the
requires-grad bits), or the first error.

    python transport_worker.py SCRIPT [--wrong-step | --wrong-kind | --abort | --abort-bad-dtype | --new-loops]

``--new-loops`` runs every step in an event loop of its own (``asyncio.run``
per step, as a caller of ``Pipeline.astep`` may).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from ranks.harness import install_stack_dump

from pipeloom.transport.tensor import TensorPlane, TransferError

Spec = list[Any]  # per tensor position: None or (shape, dtype, requires_grad[, layout])


def _tensor(step: int, index: int, pos: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + index * 10 + pos)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.complex128).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


F32, F64, BF16, I64, C64, C128 = torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.complex64, torch.complex128
BIG = (128, 256)  # 128 KiB of float32: travels unpacked (transport/tensor.py _PACK_MAX)


def _same(n: int, spec: Spec) -> list[Spec]:
    return [spec for _ in range(n)]


# A script: steps of (train?, transfers 0->1, transfers 1->0); a transfer: its tensor specs.
SCRIPTS: dict[str, list[tuple[bool, list[Spec], list[Spec]]]] = {
    "shapes": [
        (True, _same(3, [((4, 16), F32, True)]), _same(2, [((4, 16), F32, False)])),
        (True, _same(3, [((4, 16), F32, True)]), _same(2, [((4, 16), F32, False)])),  # all predicted
        # position 1 changes shape; position 2 changes dtype; the rest as before
        (True, [[((4, 16), F32, True)], [((4, 8), F32, True)], [((4, 16), F64, True)]], _same(2, [((4, 16), F32, False)])),
        (True, [[((4, 16), F32, True)], [((4, 8), F32, True)], [((4, 16), F64, True)]], _same(2, [((4, 16), F32, False)])),
        # an evaluation step between: its own table, the training one survives it
        (False, _same(2, [((2, 16), F32, False)]), []),
        (True, [[((4, 16), F32, True)], [((4, 8), F32, True)], [((4, 16), F64, True)]], _same(2, [((4, 16), F32, False)])),
        (False, _same(2, [((2, 16), F32, False)]), []),
    ],
    "mixed": [
        # large (unpacked), several tensors with gaps, 0-dim, bf16, int64, empty, one more transfer than before
        (True, [[(BIG, F32, True)], [((3, 5), F32, True), None, ((7,), I64, False)], [((), F64, True)], [((2, 3), BF16, False)],
                [((0, 4), F32, False)]], [[(BIG, F32, False)], [None, None]]),
        (True, [[(BIG, F32, True)], [((3, 5), F32, True), None, ((7,), I64, False)], [((), F64, True)], [((2, 3), BF16, False)],
                [((0, 4), F32, False)], [((4,), F32, True)]], [[(BIG, F32, False)], [None, None]]),
        # a large transfer shrinks below the packing size and one grows above it
        (True, [[((4,), F32, True)], [((3, 5), F32, True), None, ((7,), I64, False)], [(BIG, F64, True)], [((2, 3), BF16, False)],
                [((0, 4), F32, False)], [((4,), F32, True)]], [[(BIG, F32, False)], [None, None]]),
    ],
    # only payloads too large to travel packed with their header (every header message is 80 bytes)
    "big": [(True, _same(2, [(BIG, F32, True)]), _same(2, [(BIG, F32, False)])) for _ in range(3)],
    # tensors whose memory is not their value as it is laid out: a conjugate view (complex), a
    # negative view (real, 0-dim so that it is contiguous), transposed; complex packed and not
    "layouts": [
        (True, [[((4, 3), C64, True, "conj")], [((), F64, True, "neg"), ((3,), F32, False)], [((5, 6), F32, True, "T")],
                [(BIG, C128, False, "conj")], [((2, 2), C128, False)], [((), F64, False, "neg")]],
         [[((6, 5), F64, False, "T")], [((3,), C64, False, "conj"), None]]),
        (True, [[((4, 3), C64, True, "conj")], [((), F64, True, "neg"), ((3,), F32, False)], [((5, 6), F32, True, "T")],
                [(BIG, C128, False, "conj")], [((2, 2), C128, False)], [((), F64, False, "neg")]],
         [[((6, 5), F64, False, "T")], [((3,), C64, False, "conj"), None]]),
    ],
}


def _layout(t: torch.Tensor, layout: str | None) -> torch.Tensor:
    """The same values as ``t`` in another memory layout (what is sent must equal ``t``)."""
    if layout == "conj":  # memory holds the conjugate; the conjugate bit says so
        return t.conj().resolve_conj().conj()
    if layout == "neg":  # memory holds -t; the negative bit says so (a real view of a complex)
        return (torch.complex(torch.zeros_like(t), -t)).conj().imag
    if layout == "T":
        return t.t().contiguous().t()
    return t


def _build(step: int, index: int, spec: Spec, *, sending: bool = False) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    for pos, ent in enumerate(spec):
        if ent is None:
            out.append(None)
            continue
        shape, dtype, rg, *layout = ent
        t = _tensor(step, index, pos, tuple(shape), dtype)
        if t.is_floating_point() or t.is_complex():
            t.requires_grad_(rg)
        if sending and layout:
            t = _layout(t, layout[0])
            assert t.is_conj() or t.is_neg() or not t.is_contiguous(), layout
        out.append(t)
    return out


def make_plane() -> TensorPlane:
    # HEADERS=1: the NCCL arrangement, on gloo: headers through a group of their own, payloads
    # received (untagged, in header order) by the loop once their header has landed
    headers = os.environ.get("HEADERS") == "1"
    return TensorPlane(dist.get_rank(), device=torch.device("cpu"), prepost_depth=int(os.environ.get("DEPTH", "2")),
                       header_group=dist.new_group(backend="gloo") if headers else None)


async def run_steps(tp: TensorPlane, script: str, steps: range, report: dict[str, Any], mode: str | None) -> bool:
    """Run ``steps`` of ``script`` on ``tp``, adding to ``report``; False: stop (an error or a planned failure)."""
    rank = dist.get_rank()
    peer = 1 - rank
    headers = tp.header_group is not None
    for step in steps:
        train, fwd, bwd = SCRIPTS[script][step]
        mine, theirs = (fwd, bwd) if rank == 0 else (bwd, fwd)
        landed: list[Any] = []
        payload_works: list[Any] = []
        errors: list[str] = []
        done = asyncio.Event()

        def deliver(got: Any, err: TransferError | None) -> None:
            if err is not None:
                errors.append(str(err))
                done.set()
                return
            if headers:
                assert not got.buffers
                buffers, works = tp.recv_payload(got.src, got.shapes)
                payload_works.extend(works)
                got = dataclasses.replace(got, buffers=buffers)
            landed.append(got)
            if len(landed) == len(theirs):
                done.set()

        # --wrong-kind: rank 0 runs step 1 as an evaluation step, rank 1 as a training step
        as_train = train and not (mode == "--wrong-kind" and rank == 0 and step == 1)
        tp.begin_step(step, as_train, {peer: len(theirs)}, {peer: len(mine)}, deliver)
        if mode in ("--abort", "--abort-bad-dtype") and step == 1:
            # rank 0 fails after its first transfer of the step; rank 1 must not stay parked in gloo
            if rank == 0:
                tp.send_transfer(peer, step, "F", 1, 0, _build(step, 0, mine[0], sending=True))
                if mode == "--abort-bad-dtype":  # a dtype the tensor plane cannot send: refused, nothing sent
                    try:
                        tp.send_transfer(peer, step, "F", 1, 1, [torch.zeros(3, dtype=torch.uint16)])
                    except ValueError as exc:
                        report["send_error"] = str(exc)
                report["filled"] = tp.abort_step()
            else:
                await asyncio.sleep(1.5)
                report["landed_before_abort"] = len(landed)
                report["filled"] = tp.abort_step()  # told of rank 0's failure, its step fails too
            tp.close(5.0)  # rank 0's thread: until rank 1's fill lands
            report["blocked"] = len(tp.blocked_threads())
            return False
        for i, spec in enumerate(mine):
            kind, stage = ("F", 1) if rank == 0 else ("B", 0)
            tp.send_transfer(peer, step + (7 if mode == "--wrong-step" and rank == 0 and step == 1 else 0), kind, stage, i,
                             _build(step, i, spec, sending=True))
        if theirs:
            await asyncio.wait_for(done.wait(), 30)
        if errors:
            report["error"] = errors[0]
            return False
        await asyncio.to_thread(lambda: [w.wait() for w in payload_works])
        try:
            await asyncio.to_thread(tp.drain_sends)
        except RuntimeError as exc:  # the peer stopped after an error of its own
            report["error"] = f"sending: {exc}"
            return False
        rows = []
        for got in landed:
            want = _build(step, got.microbatch, theirs[got.microbatch])
            ok = all(
                (w is None and b is None) or (w is not None and b is not None and w.dtype == b.dtype and torch.equal(w.detach(), b))
                for w, b in zip(want, got.buffers)
            ) and len(want) == len(got.buffers)
            rg = [bool(w is not None and w.requires_grad) for w in want]
            rows.append({"seq": got.seq, "step": got.step, "kind": got.kind, "stage": got.stage, "mb": got.microbatch,
                         "fast": got.fast, "equal": ok, "rg_ok": list(got.requires_grad) == rg})
        report["steps"].append({"train": train, "landed": rows, "sent_fast": tp.sent_fast, "sent_slow": tp.sent_slow})
    return True


MODES = ("--wrong-step", "--wrong-kind", "--abort", "--abort-bad-dtype", "--new-loops")


def main() -> None:
    install_stack_dump()
    dist.init_process_group("gloo")
    script = sys.argv[1]
    mode = next((m for m in MODES if m in sys.argv[2:]), None)
    report: dict[str, Any] = {"rank": dist.get_rank(), "steps": []}
    tp = make_plane()
    try:
        if mode == "--new-loops":
            for step in range(len(SCRIPTS[script])):
                if not asyncio.run(run_steps(tp, script, range(step, step + 1), report, mode)):
                    break
        else:
            asyncio.run(run_steps(tp, script, range(len(SCRIPTS[script])), report, mode))
    except Exception as exc:  # noqa: BLE001 - reported, for the test to show
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        tp.close(0.2)
    print(json.dumps(report), flush=True)
    if "error" not in report and "filled" not in report:
        dist.barrier()
        dist.destroy_process_group()
    else:
        # the peer may still be sending: do not wait for it, but give what this rank sent (asynchronously)
        # time to leave before the connection closes, so the peer reads it rather than a closed connection
        time.sleep(5.0)
        os._exit(0)


if __name__ == "__main__":
    main()
