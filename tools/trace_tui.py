"""The terminal UI of ``pipeloom trace view`` and ``pipeloom trace attach``.

A Textual app with three parts: the timeline (one lane per rank, two rows
each: compute -- actions and, dimmed, waits -- and communication: sends,
receives and FSDP all-gathers), a detail pane for the selected action and a
summary pane for the current step.  Drawing is deliberately plain: each lane
is a line of character cells, one cell per time bucket, built as a
``rich.text.Text`` from :func:`~pipeloom.tools.trace_model.lane_cells`; a
block carries the action's name where it fits.  Everything the panes say is
computed by :mod:`pipeloom.tools.trace_model` (the same functions ``trace
summary`` prints), and every key is one method of its
:class:`~pipeloom.tools.trace_model.ViewState`: this module only maps keys and
formats.

Why Textual: key handling, resizing and a headless test pilot
(``App.run_test``) come with it, and it renders ``rich`` text, which is all a
timeline of character cells needs.  A curses UI would be smaller but
untestable without a terminal.

Live mode (``attach``) polls a ZeroMQ SUB socket connected to the launcher's
collector a few times a second without blocking the UI; batches are
validated, deduplicated against what was read from the file, and the model is
rebuilt when something new arrived.
"""

from __future__ import annotations

import math
import time
from typing import Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Footer, Static

from .trace_model import (
    CATEGORIES,
    Span,
    TraceBuffer,
    TraceModel,
    ViewState,
    category,
    describe_action,
    format_ns,
    format_summary,
    lane_cells,
    summarize,
)

__all__ = ["TraceApp", "LiveSource", "STYLES", "STYLES_16", "HelpScreen"]

#: Block styles per category: two shades, alternating between neighbouring blocks of one kind.
STYLES: dict[str, tuple[str, str]] = {
    "F": ("black on #5fd75f", "black on #3faf3f"),
    "B": ("black on #5fafff", "black on #3f8fdf"),
    "I": ("black on #5fd7d7", "black on #3fafaf"),
    "W": ("black on #d787d7", "black on #af67af"),
    "OVERLAP_F_B": ("black on #d7d75f", "black on #afaf3f"),
    "comm": ("black on #ffaf5f", "black on #d78f3f"),
    "FSDP": ("black on #af87ff", "black on #8f67df"),
    "REDUCE_GRAD": ("black on #ff8787", "black on #df6767"),
    "wait": ("grey42", "grey42"),
}
#: The same for 16-colour terminals (``TERM=xterm``): the 256-colour shades above collapse there
#: (B and I both to bright cyan), so each category gets its own ANSI colour.
STYLES_16: dict[str, tuple[str, str]] = {
    "F": ("black on green", "black on bright_green"),
    "B": ("bright_white on blue", "bright_white on bright_blue"),
    "I": ("black on cyan", "black on bright_cyan"),
    "W": ("bright_white on magenta", "bright_white on bright_magenta"),
    "OVERLAP_F_B": ("black on yellow", "black on bright_yellow"),
    "comm": ("black on white", "black on bright_white"),
    "FSDP": ("bright_white on bright_black", "white on bright_black"),
    "REDUCE_GRAD": ("bright_white on red", "bright_white on bright_red"),
    "wait": ("bright_black", "bright_black"),
}
LIVE_DUTY = 9.0
"""A live viewer rebuilds its model at most once per LIVE_DUTY x the last rebuild's cost (<= ~10% of a core)."""
SELECTED_STYLE = "bold white on #d70000"
CRITICAL_STYLE = "bold underline reverse"
"""Added to an action's own style on the critical path (key c): visible in any palette."""
_LABEL = 8  # width of the "rank 12 " column


_SHORT = {"OVERLAP_F_B": "O", "UNSHARD": "U", "RESHARD": "R", "REDUCE_GRAD": "G", "WAIT": "."}


def _short(sp: Span) -> str:
    """What a block too narrow for the name shows: the type's letter (``s``/``r`` for a send/receive)."""
    if sp.kind == "send":
        return "s"
    if sp.kind == "recv":
        return "r"
    return _SHORT.get(sp.type, sp.type[:1])


class LiveSource:
    """Batches published by a collector (``tcp://host:port``), polled without blocking."""

    def __init__(self, address: str) -> None:
        import zmq

        self.address = address
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RECONNECT_IVL, 200)
        self._mon = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        self._sock.connect(address)
        self.status = "connecting"
        """``connecting``, ``connected``, ``ended`` (the collector closed: the job ended) or ``unreachable``."""
        self._was_connected = False
        self._last_data: float | None = None

    def _watch(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        zmq = self._zmq
        while True:
            try:
                ev = recv_monitor_message(self._mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            kind = ev.get("event")
            if kind == zmq.EVENT_CONNECTED:
                self.status, self._was_connected = "connected", True
            elif kind == zmq.EVENT_DISCONNECTED:
                self.status = "ended"
            elif kind == zmq.EVENT_CONNECT_RETRIED and not self._was_connected:
                self.status = "unreachable"

    def status_text(self) -> str:
        """What the viewer's header says about the feed."""
        import time

        if self.status == "ended":
            return f"job ended (collector at {self.address} closed): showing what arrived"
        if self.status == "unreachable":
            return f"collector unreachable at {self.address} (retrying)"
        if self.status == "connecting":
            return f"connecting to {self.address}"
        quiet = "" if self._last_data is None else f", last data {time.monotonic() - self._last_data:.0f} s ago"
        return f"live {self.address}{quiet}"

    def poll(self, limit: int = 200) -> list[Any]:
        """Decoded messages received since the last call (not validated yet; undecodable ones are skipped)."""
        import time

        import msgpack

        self._watch()
        out = []
        for _ in range(limit):
            try:
                raw = self._sock.recv(self._zmq.NOBLOCK)
            except self._zmq.Again:
                break
            self._last_data = time.monotonic()
            try:
                out.append(msgpack.unpackb(raw, raw=False, strict_map_key=True))
            except Exception:  # garbage on the socket: the buffer counts rejects, this counts as one
                out.append(None)
        return out

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self._mon.close()
        self._sock.close()
        self._ctx.term()


class Timeline(Widget):
    """The lanes: a header line, a time axis, two rows per rank and a legend."""

    DEFAULT_CSS = """
    Timeline { height: auto; }
    """

    def __init__(self, app_state: TraceApp) -> None:
        super().__init__()
        self._owner = app_state

    def render(self) -> Text:
        return self._owner.render_timeline(max(self.size.width, 20))


class HelpScreen(ModalScreen[None]):
    """The ``?`` screen: every key, the colours and what the summary's numbers mean."""

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90%; height: 90%; border: round $accent; background: $surface; padding: 0 1; }
    """

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(Text(self.text), id="help")

    def on_key(self, event: Any) -> None:
        if event.key not in ("up", "down", "pageup", "pagedown"):
            event.stop()
            self.dismiss()


class TraceApp(App[None]):
    """View a trace; ``live`` (a :class:`LiveSource`) makes it follow a running job."""

    TITLE = "pipeloom trace"
    CSS = """
    #panes { height: 1fr; }
    #detail { width: 1fr; border: round $accent; padding: 0 1; }
    #summary { width: 2fr; border: round $accent; padding: 0 1; }
    """
    BINDINGS = [
        Binding("plus,equals_sign", "zoom(2.0)", "zoom in", key_display="+"),
        Binding("minus,underscore", "zoom(0.5)", "zoom out", key_display="-"),
        Binding("left", "pan(-0.25)", "pan", show=False),
        Binding("right", "pan(0.25)", "pan", show=False),
        Binding("home", "home", "start", show=False),
        Binding("end", "end", "end", show=False),
        Binding("left_square_bracket,p", "step(-1)", "prev step", key_display="["),
        Binding("right_square_bracket,n", "step(1)", "next step", key_display="]"),
        Binding("tab", "rank(1, True)", "next rank", show=False, priority=True),
        Binding("shift+tab", "rank(-1, True)", "prev rank", show=False, priority=True),
        Binding("down", "rank(1, False)", "rank", show=False),
        Binding("up", "rank(-1, False)", "rank", show=False),
        Binding("comma", "action(-1)", "prev action", key_display=","),
        Binding("full_stop", "action(1)", "next action", key_display="."),
        Binding("z", "fit", "fit step"),
        Binding("c", "critical", "critical path"),
        Binding("f", "follow", "follow", show=False),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, model: TraceModel | TraceBuffer, *, live: LiveSource | None = None, poll_interval: float = 0.25,
                 palette: str | None = None, plan: TraceModel | None = None) -> None:
        super().__init__()
        self._palette = palette
        self.plan = plan
        """A simulated plan (``schedule simulate --trace``) drawn under each rank's lanes, aligned to the current step."""
        self._plan_cache: dict[tuple[int | None, int], list[Span]] = {}
        if isinstance(model, TraceBuffer):
            self.buffer = model
            model = model.model()
        else:
            self.buffer = TraceBuffer(model.header, model.events)
        self.state = ViewState(model, follow=live is not None)
        self.live = live
        self.poll_interval = poll_interval
        self.detail_text = ""
        self.summary_text = ""
        self.show_critical = False
        self._live_status = ""
        self._summaries: dict[tuple[int, int | None], Any] = {}
        self._mounted = False
        self._pending = 0  # live events taken but not in the model yet
        self._rebuilt_at = -math.inf
        self._rebuild_cost = 0.0

    # -- layout

    def compose(self) -> ComposeResult:
        yield Timeline(self)
        with Horizontal(id="panes"):
            yield Static(id="detail")
            yield Static(id="summary")
        yield Footer()

    def on_mount(self) -> None:
        self._mounted = True
        self.refresh_panes()
        if self.live is not None:
            self.set_interval(self.poll_interval, self.poll_live)

    def on_unmount(self) -> None:
        if self.live is not None:
            self.live.close()

    # -- live

    def poll_live(self) -> int:
        """Take what arrived; rebuild the model if anything was new.  Returns the number of new events."""
        if self.live is None:
            return 0
        new = 0
        for msg in self.live.poll():
            try:
                new += self.buffer.add_batch(msg)
            except ValueError:
                continue
        self._pending += new
        now = time.monotonic()
        # Rebuilding the model is linear in the whole trace: a viewer that rebuilt it every poll took a
        # core of its own once the trace was long, from the job's ranks on a small machine.  So the next
        # rebuild waits until LIVE_DUTY x (the rebuild's cost) has passed: the viewer spends at most
        # ~1/LIVE_DUTY of a core, and a short trace (a rebuild well under the poll interval) is redrawn
        # at every poll as before.  The job's end (a status change) redraws at once.
        wait = LIVE_DUTY * self._rebuild_cost
        due = wait < self.poll_interval or now - self._rebuilt_at >= wait or self.live.status != self._live_status
        if self._pending and due:
            t0 = time.monotonic()
            self.state.update(self.buffer.model())
            self.refresh_panes()
            self._pending = 0
            self._rebuilt_at = time.monotonic()
            self._rebuild_cost = self._rebuilt_at - t0
        elif self._mounted and self.live.status != self._live_status:
            self.query_one(Timeline).refresh()
        self._live_status = self.live.status
        return new

    # -- actions (one per key)

    def _changed(self) -> None:
        self.refresh_panes()

    def action_zoom(self, factor: float) -> None:
        self.state.zoom(factor)
        self._changed()

    def action_pan(self, fraction: float) -> None:
        self.state.pan(fraction)
        self._changed()

    def action_home(self) -> None:
        self.state.home()
        self._changed()

    def action_end(self) -> None:
        self.state.end()
        self._changed()

    def action_step(self, delta: int) -> None:
        self.state.step_by(delta)
        self._changed()

    def action_rank(self, delta: int, wrap: bool) -> None:
        self.state.move_rank(delta, wrap=wrap)
        self._changed()

    def action_action(self, delta: int) -> None:
        self.state.move_action(delta)
        self._changed()

    def action_fit(self) -> None:
        self.state.fit()
        self._changed()

    def action_critical(self) -> None:
        """Toggle the highlight of the current step's critical path."""
        self.show_critical = not self.show_critical
        self._changed()

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.help_text()))

    def help_text(self) -> str:
        from .trace_analysis import DEFINITIONS

        keys = []
        for b in self.BINDINGS:
            if isinstance(b, Binding):
                keys.append(f"  {(b.key_display or b.key.split(',')[0]):<12} {b.description}")
        keys += ["  Left/Right   pan", "  Home/End     start/end of the trace", "  Tab/S-Tab    next/previous rank (also Up/Down)",
                 "  f            follow the newest step (live)"]
        legend = "  " + "  ".join(CATEGORIES) + "  crit (critical path, key c)"
        return "keys:\n" + "\n".join(keys) + "\n\ncolours:\n" + legend + "\n\n" + DEFINITIONS + "\n\n(press any key to close)"

    def summary_of(self, step: int | None) -> Any:
        """The summary of one step, cached per model (a live model is a new object)."""
        key = (id(self.state.model), step)
        got = self._summaries.get(key)
        if got is None:
            if len(self._summaries) > 64:
                self._summaries.clear()
            got = self._summaries[key] = summarize(self.state.model, step=step, top=5)
        return got

    @property
    def palette_styles(self) -> dict[str, tuple[str, str]]:
        """The palette: ``palette="16"`` or a terminal of 16 colours (``TERM=xterm``) gets :data:`STYLES_16`."""
        if self._palette is None:
            import os

            system = getattr(self.console, "color_system", None)
            term = os.environ.get("TERM", "")
            self._palette = "16" if system in ("standard", "windows") or (term in ("xterm", "linux", "vt100", "screen") and not os.environ.get("COLORTERM")) else "256"
        return STYLES_16 if self._palette == "16" else STYLES

    def plan_lane(self, rank: int) -> list[Span]:
        """The plan's actions of ``rank``, shifted so that the plan's step starts where the current step does."""
        import dataclasses

        plan = self.plan
        st = self.state
        if plan is None or not plan.steps:
            return []
        key = (st.step, rank)
        got = self._plan_cache.get(key)
        if got is None:
            lo = st.model.window(st.step)[0] if st.step is not None else st.model.t0
            shift = lo - plan.window(plan.steps[0])[0]
            got = [dataclasses.replace(a, start=a.start + shift, end=a.end + shift) for a in plan.actions_of(rank, plan.steps[0])
                   if a.duration > 0]  # zero-cost plan actions (REDUCE_GRAD without data parallelism) draw nothing
            self._plan_cache[key] = got
        return got

    def critical_spans(self) -> set[int]:
        """ids of the actions on the current step's critical path (empty unless shown)."""
        st = self.state
        if not self.show_critical or st.step is None or st.step not in st.model.windows:
            return set()
        s = self.summary_of(st.step)
        return {id(a) for c in s.critical for a in c.actions}

    def action_follow(self) -> None:
        self.state.follow = not self.state.follow
        if self.state.follow:
            self.state.update(self.state.model)
        self._changed()

    # -- drawing

    def refresh_panes(self) -> None:
        st = self.state
        sel = st.selected
        if sel is None:
            self.detail_text = "no action selected (use , and . to pick one)"
        else:
            self.detail_text = "\n".join(describe_action(st.model, sel).lines())
        if st.model.steps:
            self.summary_text = format_summary(self.summary_of(st.step))
            if self.show_critical and st.step is not None:
                self.summary_text = "critical path shown (c hides it)\n" + self.summary_text
        else:
            self.summary_text = "no events yet" if self.live is not None else "the trace has no events"
        if self._mounted:
            self.query_one("#detail", Static).update(Text(self.detail_text))
            self.query_one("#summary", Static).update(Text(self.summary_text))
            self.query_one(Timeline).refresh()

    def _row(self, spans: list[Span], under: list[Span] | None, width: int, selected: Span | None, critical: set[int] | None = None) -> Text:
        st = self.state
        cells = lane_cells(spans, st.view_start, st.view_end, width)
        back = lane_cells(under, st.view_start, st.view_end, width) if under else [None] * width
        text = Text()
        i = 0
        shade: dict[str, int] = {}
        while i < width:
            idx = cells[i]
            if idx is None:
                j = i
                while j < width and cells[j] is None and back[j] is None:
                    j += 1
                if j > i:
                    text.append(" " * (j - i))
                    i = j
                    continue
                j = i
                while j < width and cells[j] is None and back[j] is not None:
                    j += 1
                text.append("░" * (j - i), self.palette_styles["wait"][0])
                i = j
                continue
            j = i
            while j < width and cells[j] == idx:
                j += 1
            sp = spans[idx]
            cat = category(sp)
            shade[cat] = shade.get(cat, 1) ^ 1
            styles = self.palette_styles
            style = styles.get(cat, styles["F"])[shade[cat]]
            if sp is selected:
                style = SELECTED_STYLE if styles is STYLES else "bold bright_white on bright_red"
            elif critical and id(sp) in critical:
                style = f"{style} {CRITICAL_STYLE}"
            label = (sp.name if len(sp.name) <= j - i else _short(sp)[: j - i]).ljust(j - i)
            text.append(label, style)
            i = j
        return text

    def render_timeline(self, total_width: int) -> Text:
        st = self.state
        m = st.model
        width = max(total_width - _LABEL, 10)
        out = Text()
        step_txt = "no steps" if st.step is None or not m.steps else f"step {st.step} ({m.steps.index(st.step) + 1}/{len(m.steps)})" if st.step in m.steps else f"step {st.step}"
        head = (
            f"{m.header.get('schedule', 'trace')} ({m.source})  {step_txt}  "
            f"view {format_ns(st.view_start - m.t0)} .. {format_ns(st.view_end - m.t0)} ({format_ns(st.width)})"
        )
        if self.live is not None:
            head += f"  {self.live.status_text()}" + ("  [following]" if st.follow else "")
        out.append(head + "\n", "bold")
        # axis: a tick every ~16 cells, labelled with the time from the trace start
        axis = [" "] * width
        tick_every = 16
        for c in range(0, width, tick_every):
            label = "|" + format_ns(st.view_start - m.t0 + c * st.width / width).replace(" ", "")
            for k, ch in enumerate(label):
                if c + k < width:
                    axis[c + k] = ch
        out.append(" " * _LABEL + "".join(axis) + "\n", "grey50")
        sel = st.selected
        crit = self.critical_spans()
        lo, hi = st.view_start, st.view_end
        for pos, r in enumerate(m.ranks):
            visible = [a for a in m.actions.get(r, []) if a.end >= lo and a.start < hi]
            compute = [a for a in visible if a.type != "UNSHARD"]
            waits = [w for w in m.waits.get(r, []) if w.end >= lo and w.start < hi]
            comm = [t for t in m.transfers.get(r, []) if t.end >= lo and t.start < hi] + [a for a in visible if a.type == "UNSHARD"]
            comm.sort(key=lambda s: s.start)
            marker = ">" if pos == st.rank_pos else " "
            out.append(f"{marker}rank {r:<2}"[:_LABEL].ljust(_LABEL), "bold" if pos == st.rank_pos else "")
            out.append_text(self._row(compute, waits, width, sel, crit))
            out.append("\n" + " " * _LABEL)
            out.append_text(self._row(comm, None, width, None))
            out.append("\n")
            if self.plan is not None:
                planned = [a for a in self.plan_lane(r) if a.end >= lo and a.start < hi]
                out.append("  plan".ljust(_LABEL), "grey50")
                out.append_text(self._row(planned, None, width, None))
                out.append("\n")
        legend = Text(" " * _LABEL)
        for cat in CATEGORIES:
            legend.append(f" {cat} ", self.palette_styles[cat][0] if cat != "wait" else f"{self.palette_styles['wait'][0]} reverse")
            legend.append(" ")
        if crit:
            legend.append(" critical path ", CRITICAL_STYLE)
        legend.append("  ? help", "grey50")
        out.append_text(legend)
        return out
