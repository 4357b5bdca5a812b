"""The rank harness itself: a hung rank pool is reported with every rank's stack, not a bare timeout."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "ranks"))
from harness import RanksFailed, spawn_ranks  # noqa: E402


@pytest.mark.asyncio
async def test_timeout_reports_each_ranks_stack(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(Path(__file__).parent / "ranks")!r})
        from harness import install_stack_dump
        install_stack_dump()

        def wait_forever_here():
            print("rank", os.environ["RANK"], "started", file=sys.stderr, flush=True)
            if os.environ["RANK"] == "0":
                sys.exit(0)   # one rank finishes; the other hangs
            while True:
                time.sleep(0.05)

        wait_forever_here()
    """))
    with pytest.raises(RanksFailed) as info:
        await spawn_ranks(2, [str(script)], timeout=3)
    err = info.value
    msg = str(err)
    assert "ranks [1] still running after 3 s" in msg
    assert err.returncodes[0] == 0 and err.returncodes[1] is not None and err.returncodes[1] != 0
    # rank 1's stack, printed on SIGUSR1 before the kill, names where it was
    assert "wait_forever_here" in err.stderr[1]
    assert "rank 1 started" in err.stderr[1]
    assert "wait_forever_here" not in err.stderr[0]


@pytest.mark.asyncio
async def test_timeout_reports_what_a_waiting_actor_waits_for(tmp_path: Path) -> None:
    # rank 1 never calls step(): rank 0's actor waits for stage 1's gradient; the dump says so
    script = tmp_path / "wait.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(Path(__file__).parent / "ranks")!r})
        from harness import install_stack_dump
        install_stack_dump()
        import torch, pipeloom
        torch.manual_seed(0)
        pipe = pipeloom.Pipeline(lambda s: torch.nn.Linear(4, 4), schedule="1F1B", num_microbatches=2,
                                 loss_fn=lambda y, t: ((y - t) ** 2).mean(), heartbeat_timeout=600)
        print("built", flush=True)
        if pipe.rank == 1:
            while True:
                time.sleep(0.05)
        pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
    """))
    with pytest.raises(RanksFailed) as info:  # (the bound counts from both ranks' Pipelines built)
        await spawn_ranks(2, [str(script)], timeout=5, after="built")
    err0 = info.value.stderr[0]
    assert "rank 0 step 0: waiting" in err0, err0[-3000:]
    assert "0B0: gradient from stage 1 microbatch 0 on rank 1" in err0, err0[-3000:]
    assert "peers' last reported state: rank 1 idle" in err0, err0[-3000:]
