"""The control plane's reader: the event loop drains the PULL socket itself (``add_reader`` on ``ZMQ_FD``).

ZMQ_FD is edge-triggered, so these check the cases an edge can be missed in:
messages queued before the reader was registered, bursts larger than one
drain, and delivery continuing after a bad frame or a failing handler.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import uvloop
import zmq

from pipeloom.transport.control import ControlPlane

HB = dict(step=0, train=True, t=1.0, state="idle", what="", for_s=0.0, stall_s=30.0)


def _pair() -> tuple[ControlPlane, ControlPlane]:
    a = ControlPlane(0, 2, secret=b"k" * 16)
    b = ControlPlane(1, 2, secret=b"k" * 16)
    eps = [a.endpoint, b.endpoint]
    a.connect(eps)
    b.connect(eps)
    return a, b


async def _until(cond: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_reader_delivers_queued_bursts_bad_frames_and_handler_errors(loop_kind: str) -> None:
    a, b = _pair()
    got: list[dict[str, Any]] = []

    def handler(msg: dict[str, Any]) -> None:
        if msg["step"] == 7:
            raise RuntimeError("handler bug")
        got.append(msg)

    async def main() -> None:
        # Queued before the reader exists: their edge fired already; start() must still drain them.
        for i in range(3):
            assert a.send(1, "heartbeat", **{**HB, "step": i})
        await asyncio.sleep(0.2)
        b.start(handler)
        await _until(lambda: len(got) == 3)
        # A burst larger than one drain's limit keeps flowing (the drain re-schedules itself).
        for i in range(1200):
            a.send(1, "heartbeat", **{**HB, "step": 100 + i})
        await _until(lambda: len(got) == 1203)
        assert [m["step"] for m in got[3:]] == list(range(100, 1300))  # FIFO per sender
        # Foreign bytes and a handler exception are counted, and the reader goes on.
        ctx = zmq.Context()
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(b.endpoint)
        s.send(b"garbage")
        ctx.destroy(linger=200)
        a.send(1, "heartbeat", **{**HB, "step": 7})
        a.send(1, "heartbeat", **{**HB, "step": 8})
        await _until(lambda: got[-1]["step"] == 8 and b.rejected == 2)  # (two senders: either order)
        # stop() unregisters: nothing is delivered until start() on a loop again.
        b.stop()
        a.send(1, "heartbeat", **{**HB, "step": 9})
        await asyncio.sleep(0.2)
        assert got[-1]["step"] == 8
        b.start(handler)
        await _until(lambda: got[-1]["step"] == 9)

    try:
        if loop_kind == "uvloop":
            uvloop.run(main())
        else:
            asyncio.run(main())
    finally:
        b.stop()
        a.close()
        b.close()


def test_reader_moves_to_a_new_loop() -> None:
    """Pipeline re-attaches the reader when the caller switches loops (stop on the old, start on the new)."""
    a, b = _pair()
    got: list[int] = []

    async def once(step: int) -> None:
        b.start(lambda m: got.append(m["step"]))
        a.send(1, "heartbeat", **{**HB, "step": step})
        await _until(lambda: step in got)

    try:
        asyncio.run(once(1))  # that loop is closed now, with the reader still registered on it
        b.stop()
        asyncio.run(once(2))
        assert got == [1, 2]
    finally:
        b.stop()
        a.close()
        b.close()


def test_rejections_are_summarised_per_reason_and_interval() -> None:
    """A flood of bad frames makes one line per reason per interval, not one per frame (fake clock)."""
    import logging

    from pipeloom.transport.control import RejectionLog
    from pipeloom.transport.messages import MessageError

    now = [100.0]
    lines: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("test.rejections")
    logger.propagate = False
    logger.addHandler(Capture())
    rl = RejectionLog(3, interval=5.0, clock=lambda: now[0], logger=logger)
    for i in range(20_000):
        rl.rejected(MessageError("bad signature: the sender does not hold this job's secret"))
        if i % 1000 == 0:
            rl.rejected(MessageError(f"frame of {i % 7} bytes is too short to carry a signature"))
    assert lines == [
        "rank 3: rejected a control message: bad signature: the sender does not hold this job's secret "
        "(more like it are counted, one line per 5 s)",
        "rank 3: rejected a control message: frame of 0 bytes is too short to carry a signature "
        "(more like it are counted, one line per 5 s)",
    ]
    now[0] += 5.0
    rl.flush()
    assert lines[2:] == [
        "rank 3: rejected 19999 more control messages in the last 5.0 s: bad signature",
        "rank 3: rejected 19 more control messages in the last 5.0 s: frame of N bytes is too short to carry a signature",
    ]
    now[0] += 5.0
    rl.flush()  # a quiet interval: nothing to say, and the next one is logged in full again
    assert len(lines) == 4
    rl.rejected(MessageError("bad signature: x"))
    assert lines[-1].startswith("rank 3: rejected a control message: bad signature: x")
    rl.rejected(MessageError("bad signature: x"))
    rl.flush(force=True)
    assert lines[-1] == "rank 3: rejected 1 more control message in the last 0.0 s: bad signature"


def test_empty_wakes_and_forged_frames_leave_the_reader_armed() -> None:
    """A drain that finds nothing (a failed recv) or only rejected frames still re-arms the FD's edge."""
    from pipeloom.transport.messages import Codec, MessageError

    a, b = _pair()
    got: list[int] = []
    forger = Codec(b"not the job's secret", rank=0, world_size=2)

    async def main() -> None:
        b.start(lambda m: got.append(m["step"]) if m["type"] == "heartbeat" else None)
        await asyncio.sleep(0.05)
        for _ in range(3):
            assert b.drain() == 0  # nothing queued: zmq.Again, nothing delivered
        a.send(1, "heartbeat", **{**HB, "step": 1})
        await _until(lambda: got == [1])
        assert b.drain() == 0
        # forged (wrong key) and unchecked-but-malformed frames are rejected; the next good one still wakes the loop
        push = a._push[1]
        push.send(forger.frame("heartbeat", dict(HB)))
        with pytest.raises(MessageError, match="field 'state'"):
            a.send(1, "heartbeat", **{**HB, "state": "dancing"})  # outgoing messages are checked by default
        loose = ControlPlane(0, 2, secret=b"k" * 16, check_outgoing=False)
        try:
            loose.connect([a.endpoint, b.endpoint])
            assert loose.send(1, "heartbeat", **{**HB, "state": "dancing"})
            await _until(lambda: b.rejected == 2)
        finally:
            loose.close()
        a.send(1, "heartbeat", **{**HB, "step": 2})
        await _until(lambda: got == [1, 2])
        assert b.rejected == 2

    try:
        asyncio.run(main())
    finally:
        b.stop()
        a.close()
        b.close()


def test_close_after_the_peer_closed_does_not_wait_out_the_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last rank to close used to send its ``bye`` to a peer already closed, and ``term`` waited the whole
    LINGER (200 ms) for a message nobody would read: on every job's last rank and every Pipeline a test closes.
    The peer's ``bye`` (read by the reader, or still queued at ``close``) marks it closed; a peer that did not
    say bye still gets this rank's.  (LINGER raised to 3 s here, so that the old wait and a loaded machine's slow
    close are seconds apart.)"""
    import pipeloom.transport.control as control

    monkeypatch.setattr(control, "_LINGER_MS", 3000)
    a, b = _pair()
    b.close()  # b says bye to a, which has not read it yet (no reader running)
    assert a._pull.poll(5000), "b's bye never reached a's socket"  # (queued, unread: close must find it there)
    t = time.perf_counter()
    a.close()
    took = time.perf_counter() - t
    assert a.peers_closed == {1}
    assert took < 1.5, f"close took {took * 1e3:.0f} ms"
    # a peer still open gets the bye (and the closing rank does not wait on it either)
    c, d = _pair()
    got: list[dict[str, Any]] = []

    async def main() -> None:
        d.start(got.append)
        c.close()
        await _until(lambda: any(m["type"] == "bye" for m in got))

    asyncio.run(main())
    assert [m["src"] for m in got if m["type"] == "bye"] == [0] and d.peers_closed == {0}
    d.close()
