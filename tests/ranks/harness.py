"""Start real rank processes for a test and collect what they saved.

Each rank is its own process (its own session, so it and anything it spawns
can be killed as a group), started with the environment torchrun sets.  The
whole run is bounded by ``asyncio.timeout``; on any failure or timeout every
rank still alive is killed, and the error carries each rank's stderr tail.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("worker.py")
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RanksFailed(AssertionError):
    def __init__(self, message: str, returncodes: list[int | None], stderr: list[str]) -> None:
        self.returncodes, self.stderr = returncodes, stderr
        super().__init__(message)


def rank_env(rank: int, world: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


async def spawn_ranks(
    world: int, argv: list[str], *, timeout: float, env: dict[str, str] | None = None
) -> tuple[list[int | None], list[str], list[str]]:
    """Run ``python argv...`` as ``world`` ranks; return (returncodes, stdouts, stderrs)."""
    port = free_port()
    procs = []
    try:
        for r in range(world):
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable, *argv,
                    env=rank_env(r, world, port, env),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    start_new_session=True,
                )
            )
        async with asyncio.timeout(timeout):
            outs = await asyncio.gather(*(p.communicate() for p in procs))
        return [p.returncode for p in procs], [o.decode(errors="replace") for o, _ in outs], [e.decode(errors="replace") for _, e in outs]
    finally:
        for p in procs:
            if p.returncode is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            if p.returncode is None:
                try:
                    await asyncio.wait_for(p.wait(), 5)
                except (asyncio.TimeoutError, ProcessLookupError):
                    pass


async def run_ranks(world: int, cases: list[dict[str, Any]], out: Path, *, timeout: float = 120.0) -> dict[str, list[dict[str, Any]]]:
    """Run every case on one pool of ``world`` ranks; return case id -> each rank's saved result."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    path = out / "job.json"
    path.write_text(json.dumps({"cases": cases, "out": str(out)}))
    codes, _, errs = await spawn_ranks(world, [str(WORKER), str(path)], timeout=timeout)
    if any(c != 0 for c in codes):
        tails = "\n".join(f"--- rank {r} (exit {c}) ---\n{e[-3000:]}" for r, (c, e) in enumerate(zip(codes, errs)))
        raise RanksFailed(f"ranks failed: exit codes {codes}\n{tails}", codes, errs)
    return {
        c["id"]: [torch.load(out / f"{c['id']}-rank{r}.pt", weights_only=False) for r in range(world)] for c in cases
    }
