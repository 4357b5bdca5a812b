"""The rank harness itself: a hung rank pool is reported with every rank's stack, not a bare timeout."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

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


@pytest.mark.asyncio
async def test_forked_ranks_behave_as_fresh_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server (``ranks/zygote.py``, torch imported once) hands out processes that look to a test like
    ``python script.py``: their own pid and session, the given argv and environment (nothing of the server's),
    stdout and stderr apart, exit codes as the interpreter gives them (an uncaught exception: 1, through
    ``sys.excepthook``, with ``sys.last_value`` set for atexit handlers; a signal: minus it), atexit run."""
    import asyncio
    import json
    import os
    import signal

    import harness

    monkeypatch.setenv("PIPELOOM_TEST_BACKEND", "gloo")
    monkeypatch.delenv("PIPELOOM_TEST_FORK", raising=False)
    assert harness._use_zygote()
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import atexit, json, os, sys, time
        mode = sys.argv[1]
        atexit.register(lambda: print("atexit", type(getattr(sys, "last_value", None)).__name__, flush=True))
        print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "argv": sys.argv[1:], "env": os.environ.get("PROBE"),
                          "leak": "PIPELOOM_ZYGOTE_LEAK" in os.environ, "torch": "torch" in sys.modules,
                          "main": __name__, "file": __file__}), flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        if mode == "exit3":
            sys.exit(3)
        if mode == "raise":
            raise ValueError("boom")
        if mode == "sleep":
            time.sleep(60)
    """))
    os.environ["PIPELOOM_ZYGOTE_LEAK"] = "1"  # (set after the server started: it must not reach a rank)
    try:
        procs = {m: await harness.start_rank([str(script), m], env={"PROBE": m, "PATH": os.environ.get("PATH", "")})
                 for m in ("ok", "exit3", "raise", "sleep")}
    finally:
        del os.environ["PIPELOOM_ZYGOTE_LEAK"]

    async def collect(p: Any) -> tuple[int, list[str], str]:
        out, err = await asyncio.gather(p.stdout.read(), p.stderr.read())
        return await p.wait(), out.decode().splitlines(), err.decode()

    await asyncio.sleep(0.5)
    procs["sleep"].send_signal(signal.SIGKILL)
    got = {m: await asyncio.wait_for(collect(p), 30) for m, p in procs.items()}
    pids = set()
    for m, (code, out, err) in got.items():
        info = json.loads(out[0])
        assert info["pid"] == procs[m].pid == info["sid"] != os.getpid(), (m, info)  # a session of its own
        pids.add(info["pid"])
        assert info["argv"] == [m] and info["env"] == m and not info["leak"] and info["main"] == "__main__", info
        assert info["file"] == str(script) and info["torch"], info
        assert err.startswith("to stderr"), err
    assert len(pids) == 4
    assert got["ok"][0] == 0 and got["ok"][1][1:] == ["atexit NoneType"]
    assert got["exit3"][0] == 3
    assert got["raise"][0] == 1 and "ValueError: boom" in got["raise"][2] and got["raise"][1][1:] == ["atexit ValueError"]
    assert got["sleep"][0] == -signal.SIGKILL
