"""The trace viewer: its state model directly, then the Textual app driven headless.

The trace is built by hand (2 ranks, 2 steps, round numbers), so where the
selection and the time range must be after each key is known exactly.  The
app is driven with Textual's ``run_test`` pilot: keys go through the real
bindings, and the panes are read back as the text the user would see.  The
live test publishes a batch on a ZeroMQ PUB socket of its own, as the
launcher's collector does, and waits for the app to show it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from pipeloom.tools.trace_cmd import attach_app
from pipeloom.tools.trace_model import (
    MIN_WIDTH_NS,
    Span,
    TraceBuffer,
    TraceModel,
    ViewState,
    describe_action,
    format_pct,
    format_summary,
    lane_cells,
    summarize,
    trace_api,
)
from pipeloom.tools.trace_tui import TraceApp

MS = 1_000_000
T0 = 5_000 * MS


def _action(rank: int, step: int, name: str, typ: str, stage: int, mb: int, a: float, b: float) -> dict[str, Any]:
    return {"ev": "action", "rank": rank, "step": step, "name": name, "type": typ, "stage": stage, "mb": mb,
            "start": T0 + int(a * MS), "end": T0 + int(b * MS)}


def _events() -> list[dict[str, Any]]:
    """1F1B-like, 2 ranks x 2 steps of 10 ms; times in ms from T0."""
    evs: list[dict[str, Any]] = []
    for step, base in ((0, 0.0), (1, 20.0)):
        evs += [
            {"ev": "step", "rank": 0, "step": step, "start": T0 + int(base * MS), "end": T0 + int((base + 10) * MS)},
            {"ev": "step", "rank": 1, "step": step, "start": T0 + int(base * MS), "end": T0 + int((base + 10) * MS)},
            _action(0, step, "0F0", "F", 0, 0, base + 0, base + 1),
            _action(0, step, "0F1", "F", 0, 1, base + 1, base + 2),
            {"ev": "send", "rank": 0, "step": step, "peer": 1, "stage": 1, "mb": 0, "kind": "F", "seq": 2 * step,
             "bytes": 4096, "start": T0 + int((base + 0.9) * MS), "end": T0 + int((base + 1) * MS)},
            {"ev": "wait", "rank": 0, "step": step, "start": T0 + int((base + 2) * MS), "end": T0 + int((base + 6) * MS),
             "for": ["0B0: gradient from stage 1 microbatch 0 on rank 1"]},
            _action(0, step, "0B0", "B", 0, 0, base + 6, base + 8),
            _action(0, step, "0B1", "B", 0, 1, base + 8, base + 10),
            {"ev": "wait", "rank": 1, "step": step, "start": T0 + int(base * MS), "end": T0 + int((base + 1.5) * MS),
             "for": ["1F0: activation of stage 0 microbatch 0 from rank 0"]},
            {"ev": "recv", "rank": 1, "step": step, "peer": 0, "stage": 1, "mb": 0, "kind": "F", "seq": 2 * step,
             "bytes": 4096, "start": T0 + int((base + 0.5) * MS), "end": T0 + int((base + 1.4) * MS)},
            _action(1, step, "1F0", "F", 1, 0, base + 1.5, base + 2.5),
            _action(1, step, "1B0", "B", 1, 0, base + 2.5, base + 5.5),
            _action(1, step, "1F1", "F", 1, 1, base + 5.5, base + 6.5),
            _action(1, step, "1B1", "B", 1, 1, base + 6.5, base + 9.5),
        ]
    return evs


def _model() -> TraceModel:
    header = trace_api().make_header(world_size=2, schedule="1F1B", num_microbatches=2, stage_to_rank=[0, 1])
    return TraceModel(header, sorted(_events(), key=lambda e: e.get("start", e.get("t", 0))))


# ---------------------------------------------------------------- the model, directly


def test_lane_cells_pick_the_dominant_span() -> None:
    mk = lambda a, b: Span("action", 0, 0, a, b, "x", "F", 0, 0, {})  # noqa: E731
    spans = [mk(0, 25), mk(25, 30), mk(30, 100), mk(100, 100)]
    assert lane_cells(spans, 0, 100, 10) == [0, 0, 0, 2, 2, 2, 2, 2, 2, 2]  # 1 (5 ns of cell 2's 10) loses to 0
    assert lane_cells(spans[1:2], 0, 100, 10) == [None, None, 0, None, None, None, None, None, None, None]
    assert lane_cells(spans, 200, 300, 4) == [None] * 4


def test_view_state_navigation() -> None:
    m = _model()
    st = ViewState(m)
    assert (st.step, st.rank, st.selected.name) == (0, 0, "0F0")
    assert (st.view_start, st.view_end) == (T0, T0 + 10 * MS)
    st.zoom(2.0)  # around the selected action's centre (0.5 ms), clamped at the trace start
    assert (st.view_start, st.view_end) == (T0, T0 + 5 * MS)
    for _ in range(40):
        st.zoom(2.0)
    assert st.width == MIN_WIDTH_NS
    for _ in range(20):
        st.zoom(0.5)
    assert (st.view_start, st.view_end) == (m.t0, m.t_end)  # no further than the whole trace
    st.fit()
    st.zoom(2.0)
    st.pan(0.25)
    assert st.view_start == T0 + int(1.25 * MS)
    st.end()
    assert st.view_end == m.t_end
    st.home()
    assert st.view_start == m.t0
    st.step_by(1)
    assert (st.step, st.selected.name, st.selected.step) == (1, "0F0", 1)
    assert (st.view_start, st.view_end) == m.window(1)
    st.step_by(5)
    assert st.step == 1
    st.move_action(2)  # 0F0 -> 0B0 (step 1)
    assert st.selected.name == "0B0" and st.selected.start == T0 + 26 * MS
    st.move_rank(1)  # rank 1's action under 0B0's middle (27 ms): 1B1 (26.5..29.5)
    assert (st.rank, st.selected.name, st.selected.step) == (1, "1B1", 1)
    st.move_rank(1)  # clamped
    assert st.rank == 1
    st.move_rank(1, wrap=True)
    assert st.rank == 0
    st.move_action(-100)
    assert (st.selected.name, st.selected.step, st.step) == ("0F0", 0, 0)
    assert st.view_start <= st.selected.start and st.selected.end <= st.view_end  # panned into view


def test_details_of_an_action() -> None:
    m = _model()
    b0 = next(a for a in m.actions_of(0, 0) if a.name == "0B0")
    d = describe_action(m, b0)
    assert (d.start_ns, d.end_ns, d.waited_ns) == (6 * MS, 8 * MS, 4 * MS)
    assert [w.event["for"] for w in d.waits] == [["0B0: gradient from stage 1 microbatch 0 on rank 1"]]
    f0 = next(a for a in m.actions_of(1, 0) if a.name == "1F0")
    d = describe_action(m, f0)
    assert [t.name for t in d.inputs] == ["1RECV_F0"] and d.waited_ns == int(1.5 * MS)
    d = describe_action(m, m.actions_of(0, 0)[0])
    assert [t.name for t in d.sends] == ["0SEND_F0"]
    assert "sent 0SEND_F0: 4.0 KiB to rank 1 (seq 0)" in "\n".join(d.lines())


def test_trace_buffer_dedupes_and_validates() -> None:
    evs = _events()
    buf = TraceBuffer(None, evs[:5])
    header = trace_api().make_header(world_size=2, schedule="1F1B", num_microbatches=2, stage_to_rank=[0, 1])
    assert buf.add_batch({"v": 1, "type": "trace", "src": 0, "header": header, "events": evs[:8], "dropped": 0}) == 3
    assert buf.header == header and len(buf.events) == 8
    with pytest.raises(ValueError):
        buf.add_batch({"v": 1, "type": "trace", "src": 0, "events": [{"rank": 0}]})
    assert buf.rejected == 1 and buf.model().ranks == [0, 1]


# ---------------------------------------------------------------- the app


def _text(app: TraceApp, widget_id: str) -> str:
    return str(app.query_one(widget_id).content)


async def test_keys_drive_the_view_and_the_panes() -> None:
    m = _model()
    app = TraceApp(m)
    async with app.run_test(size=(150, 40)) as pilot:
        st = app.state
        assert (st.step, st.rank, st.selected.name) == (0, 0, "0F0")
        assert "0F0  (F)" in _text(app, "#detail") and "rank 0  stage 0  mb 0  step 0" in _text(app, "#detail")

        await pilot.press("plus")
        assert st.width == 5 * MS
        await pilot.press("minus")
        assert (st.view_start, st.view_end) == (T0, T0 + 10 * MS)
        await pilot.press("plus", "right")
        assert st.view_start == T0 + int(1.25 * MS)
        await pilot.press("home")
        assert st.view_start == m.t0
        await pilot.press("end")
        assert st.view_end == m.t_end

        await pilot.press("right_square_bracket")
        assert st.step == 1 and (st.view_start, st.view_end) == m.window(1)
        await pilot.press("left_square_bracket")
        assert st.step == 0
        await pilot.press("n")
        assert st.step == 1
        await pilot.press("p")
        assert st.step == 0

        await pilot.press("full_stop", "full_stop")  # 0F0 -> 0F1 -> 0B0
        assert st.selected.name == "0B0"
        detail = _text(app, "#detail")
        assert "0B0  (B)" in detail and "rank 0  stage 0  mb 0  step 0" in detail
        assert "start 6.000 ms  end 8.000 ms  duration 2.000 ms" in detail
        assert "waited 4.000 ms before it" in detail and "gradient from stage 1 microbatch 0 on rank 1" in detail
        await pilot.press("comma")
        assert st.selected.name == "0F1"

        await pilot.press("tab")
        assert st.rank == 1 and st.selected.name == "1F0"  # nearest to 0F1 (1..2 ms): 1F0 (1.5..2.5)
        assert "input 1RECV_F0: 4.0 KiB from rank 0" in _text(app, "#detail")
        await pilot.press("shift+tab")
        assert st.rank == 0
        await pilot.press("down")
        assert st.rank == 1
        await pilot.press("up")
        assert st.rank == 0

        summary = _text(app, "#summary")
        expected = summarize(m, step=0, top=5)
        assert summary == format_summary(expected)
        r0 = expected.ranks[0]
        assert r0.busy_fraction == pytest.approx(0.6)  # 6 ms of compute in a 10 ms step
        assert format_pct(r0.busy_fraction) in summary and format_pct(r0.bubble_fraction) in summary

        lanes = app.render_timeline(150).plain
        assert ">rank 0" in lanes and "rank 1" in lanes and "0B0" in lanes

        await pilot.press("q")
        await pilot.pause()
    assert not app.is_running


async def test_attach_shows_a_live_batch(tmp_path: Path) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    header = trace_api().make_header(world_size=2, schedule="1F1B", num_microbatches=2, stage_to_rank=[0, 1], live=address)
    history = tmp_path / "job.jsonl"
    evs = _events()
    step0 = [e for e in evs if e["step"] == 0]
    step1 = [e for e in evs if e["step"] == 1]
    trace_api().write_trace(history, header, step0)  # what the collector had written when we attach
    try:
        app = attach_app(None, str(history))
        assert app.live is not None and app.live.address == address
        app.poll_interval = 0.05
        async with app.run_test(size=(150, 40)) as pilot:
            assert app.state.model.steps == [0]
            batch = msgpack.packb({"v": 1, "type": "trace", "src": 1, "header": header, "events": step1 + step0[:3], "dropped": 0})
            deadline = time.monotonic() + 10
            while app.state.model.steps != [0, 1] and time.monotonic() < deadline:
                pub.send(batch)  # a subscriber joins asynchronously: resend until seen (dedup keeps one copy)
                await pilot.pause(0.1)
            assert app.state.model.steps == [0, 1]
            assert len(app.state.model.events) == len(evs)
            assert app.state.step == 1 and app.state.follow  # live view follows the newest step
            assert "step 1" in _text(app, "#summary") and "live " + address in app.render_timeline(150).plain
            pub.send(b"\x00garbage")
            await pilot.pause(0.2)
            assert app.buffer.rejected >= 1 and len(app.state.model.events) == len(evs)
            pub.close()  # the launcher's collector goes away when the job ends
            deadline = time.monotonic() + 10
            while app.live.status != "ended" and time.monotonic() < deadline:
                await pilot.pause(0.1)
            assert "job ended" in app.render_timeline(150).plain
            await pilot.press("q")
    finally:
        pub.close()
        ctx.term()


async def test_attach_says_when_the_collector_is_unreachable() -> None:
    from pipeloom.tools.trace_tui import LiveSource

    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nobody listens here once closed
    app = TraceApp(TraceBuffer(), live=LiveSource(f"tcp://127.0.0.1:{port}"), poll_interval=0.05)
    async with app.run_test(size=(120, 30)) as pilot:
        deadline = time.monotonic() + 10
        while app.live.status != "unreachable" and time.monotonic() < deadline:
            await pilot.pause(0.1)
        assert f"collector unreachable at tcp://127.0.0.1:{port}" in app.render_timeline(120).plain
        assert "no events yet" in _text(app, "#summary")
        await pilot.press("q")


def test_pan_home_end_keep_the_step_in_sync() -> None:
    m = _model()
    st = ViewState(m)
    assert st.step == 0
    st.end()  # the view shows step 1 whole (10 ms wide, at the end)
    assert st.step == 1 and st.selected is not None and st.selected.step == 1
    st.home()
    assert st.step == 0 and st.selected.step == 0
    st.pan(2.0)  # 20 ms later: step 1
    assert st.step == 1 and st.selected.step == 1


def test_attach_needs_an_address(tmp_path: Path) -> None:
    from pipeloom.tools.cli import main

    path = tmp_path / "no_live.jsonl"
    trace_api().write_trace(path, trace_api().make_header(world_size=1, schedule="GPipe", num_microbatches=1, stage_to_rank=[0]), [])
    assert main(["trace", "attach", "--file", str(path)]) == 2
    assert main(["trace", "attach"]) == 2
    assert main(["trace", "view", str(tmp_path / "missing.jsonl")]) == 2


async def test_view_of_a_simulated_plan(tmp_path: Path) -> None:
    from pipeloom.tools.cli import main
    from pipeloom.tools.trace_model import load_trace

    plan = tmp_path / "plan.jsonl"
    assert main(["schedule", "simulate", "ZBVZeroBubble", "-p", "2", "-m", "4", "--trace", str(plan)]) == 0

    app = TraceApp(load_trace(plan))
    async with app.run_test(size=(200, 30)) as pilot:
        await pilot.press("full_stop")
        assert app.state.selected is not None and app.state.selected.name == "0F1"
        lanes = app.render_timeline(200).plain
    assert "0F0" in lanes and "1F0" in lanes


async def test_critical_path_key_and_help_screen() -> None:
    from pipeloom.tools.trace_tui import CRITICAL_STYLE, HelpScreen

    m = _model()
    app = TraceApp(m)
    async with app.run_test(size=(150, 40)) as pilot:
        assert app.critical_spans() == set()
        await pilot.press("c")
        crit = app.critical_spans()
        names = {a.name for a in m.actions_of(0, 0) + m.actions_of(1, 0) if id(a) in crit}
        # rank 0 ends the step; its gradient wait has no receive recorded, so the path stays on rank 0
        assert names == {"0F0", "0F1", "0B0", "0B1"}
        assert "critical path shown" in _text(app, "#summary")
        assert "step 0 = 10.000 ms: compute 6.000 ms + transfers 0 ns + runtime 0 ns + waiting on rank 1 4.000 ms" in _text(app, "#summary")
        text = app.render_timeline(150)
        assert "critical path" in text.plain
        assert any(str(span.style).endswith(CRITICAL_STYLE) for span in text.spans)
        await pilot.press("c")
        assert app.critical_spans() == set()

        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        help_text = app.screen.text
        assert "critical path" in help_text and "not_sent" in help_text and "zoom in" in help_text
        await pilot.press("x")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")


def test_every_category_is_distinct_in_16_colours() -> None:
    from rich.color import ColorSystem
    from rich.style import Style

    from pipeloom.tools.trace_tui import STYLES, STYLES_16

    def colours(styles: dict[str, tuple[str, str]]) -> dict[str, tuple[int | None, int | None]]:
        out = {}
        for cat, (style, _) in styles.items():
            st = Style.parse(style)
            bg = st.bgcolor.downgrade(ColorSystem.STANDARD).number if st.bgcolor else None
            fg = st.color.downgrade(ColorSystem.STANDARD).number if st.color else None
            out[cat] = (bg, fg) if cat != "wait" else (None, fg)
        return out

    c256 = colours(STYLES)
    assert c256["B"] == c256["I"]  # what TERM=xterm showed before: both bright cyan
    c16 = colours(STYLES_16)
    blocks = [c16[k][0] for k in STYLES_16 if k != "wait"]
    assert len(set(blocks)) == len(blocks), c16
    app = TraceApp(_model(), palette="16")
    assert app.palette_styles is STYLES_16
    assert TraceApp(_model(), palette="256").palette_styles is STYLES


async def test_plan_lane_under_each_rank(tmp_path: Path) -> None:
    from pipeloom.tools.cli import main
    from pipeloom.tools.trace_model import load_trace

    plan = tmp_path / "plan.jsonl"
    # the plan of the hand-built run: 1F1B on 2 ranks, 2 microbatches, F=1 ms, B=2 ms (time unit 1 ms)
    assert main(["schedule", "simulate", "1F1B", "-p", "2", "-m", "2", "--costs", "F=1,B=2", "--trace", str(plan)]) == 0
    m = _model()
    app = TraceApp(m, plan=load_trace(plan))
    async with app.run_test(size=(200, 40)) as pilot:
        lane = app.plan_lane(0)
        assert [a.name for a in lane] == ["0F0", "0F1", "0B0", "0B1"]
        assert lane[0].start == m.window(0)[0]  # aligned with the step shown
        lines = app.render_timeline(200).plain.split("\n")
        plan_rows = [ln for ln in lines if ln.startswith("  plan")]
        assert len(plan_rows) == 2 and "0F0" in plan_rows[0] and "1F0" in plan_rows[1]
        await pilot.press("right_square_bracket")
        assert app.plan_lane(0)[0].start == m.window(1)[0]  # follows the current step
        await pilot.press("q")
    assert main(["trace", "view", str(plan), "--plan", str(plan)]) == 2


class _FakeLive:
    """A live source whose batches and status the test sets."""

    address = "tcp://fake"

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self.status = "live"

    def poll(self) -> list[dict[str, Any]]:
        out, self.batches = self.batches, []
        return out

    def status_text(self) -> str:
        return self.status

    def close(self) -> None:
        pass


def test_live_rebuilds_are_throttled_by_their_cost() -> None:
    """A model rebuild that costs more than the poll interval / LIVE_DUTY is not redone at every poll: the
    events wait (counted as pending) until LIVE_DUTY x its cost has passed, or the job's status changes."""
    from pipeloom.tools import trace_tui

    evs = _events()
    header = trace_api().make_header(world_size=2, schedule="1F1B", num_microbatches=2, stage_to_rank=[0, 1])
    live = _FakeLive()
    app = TraceApp(TraceBuffer(header, [e for e in evs if e["step"] == 0]), live=live, poll_interval=0.25)  # type: ignore[arg-type]

    def batch(events: list[dict[str, Any]]) -> dict[str, Any]:
        return {"v": 1, "type": "trace", "src": 0, "header": header, "events": events, "dropped": 0}

    step1 = [e for e in evs if e["step"] == 1]
    live.batches.append(batch(step1[:2]))
    assert app.poll_live() == 2 and app._pending == 0  # the first rebuild: at once
    n = len(app.state.model.events)
    app._rebuild_cost = 0.001  # a cheap rebuild (a short trace): at every poll, as before
    live.batches.append(batch(step1[2:3]))
    assert app.poll_live() == 1 and app._pending == 0 and len(app.state.model.events) == n + 1
    n += 1
    app._rebuild_cost = 1.0  # pretend the trace has grown: a rebuild now costs a second
    live.batches.append(batch(step1[3:5]))
    assert app.poll_live() == 2 and app._pending == 2 and len(app.state.model.events) == n  # deferred
    app._rebuilt_at -= trace_tui.LIVE_DUTY * 1.0  # ... until LIVE_DUTY seconds have passed
    assert app.poll_live() == 0 and app._pending == 0 and len(app.state.model.events) == n + 2
    app._rebuild_cost = 1.0
    live.batches.append(batch(step1[5:]))
    live.status = "ended"  # the job's end is shown at once, with everything that arrived
    app.poll_live()
    assert app._pending == 0 and len(app.state.model.events) == len(evs)
