"""The GPU commit policy (runtime/device.py) in one process, with fake CUDA streams and events.

The real thing runs in the NCCL gradient tests on GPUs; here the bookkeeping
is checked where a CPU can see it: which stream waits on what, when the
commit horizon holds the dispatcher back, and what it learns from events.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import pytest
import torch
from fake_clock import FakeClock

from pipeloom.runtime import device as devmod
from pipeloom.schedules import ActionType


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.timing = enable_timing
        self.stream: FakeStream | None = None
        self.done = False
        self.t = 0.0

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream if stream is not None else FAKE.current
        self.stream.log.append(("record", self))
        self.t = FAKE.device_ms  # (tests set it themselves where the device's time matters)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:  # the device catches up: the event completes
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.timing and end.timing):  # as torch's: both events must have been created timing
            raise ValueError("Both events must be created with argument 'enable_timing=True'.")
        return end.t - self.t


class FakeStream:
    def __init__(self, device: Any = None, name: str = "s") -> None:
        self.name = name
        self.log: list[tuple[str, Any]] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", other))

    def wait_event(self, ev: FakeEvent) -> None:
        self.log.append(("wait_event", ev))

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


_SLEEP_CYCLES_PER_MS = 1.5e6


class FakeCuda:
    def __init__(self) -> None:
        self.default = FakeStream(name="caller")
        self.current = self.default
        self.created: list[FakeStream] = []
        #: the fake device's clock: only _sleep advances it, at _SLEEP_CYCLES_PER_MS
        self.device_ms = 0.0

    def Stream(self, device: Any = None) -> FakeStream:  # noqa: N802 - torch's name
        s = FakeStream(device, name=f"s{len(self.created)}")
        self.created.append(s)
        return s

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802
        return FakeEvent(enable_timing)

    def _sleep(self, cycles: int) -> None:
        self.current.log.append(("sleep", cycles / _SLEEP_CYCLES_PER_MS))
        self.device_ms += cycles / _SLEEP_CYCLES_PER_MS

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: FakeStream) -> Any:
        old, self.current = self.current, s
        try:
            yield
        finally:
            self.current = old

    def set_stream(self, s: FakeStream) -> None:  # what the policy's own switches use inside a step
        self.current = s


FAKE = FakeCuda()


class FakeBuffer:
    is_cuda = True

    def __init__(self) -> None:
        self.recorded: list[FakeStream] = []

    def record_stream(self, s: FakeStream) -> None:
        self.recorded.append(s)


class FakeWork:
    def __init__(self) -> None:
        self.waited_on: list[FakeStream] = []

    def wait(self) -> None:
        self.waited_on.append(FAKE.current)


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    global FAKE
    FAKE = FakeCuda()
    monkeypatch.setattr(devmod, "torch", types.SimpleNamespace(cuda=FAKE))
    return FAKE


def _policy(cuda: FakeCuda, clock: FakeClock | None = None, **kw: Any) -> devmod.CudaPolicy:
    # the bookkeeping tests set each event's time themselves: no learning sleeps (tested on their own below)
    kw.setdefault("pad_learning", False)
    return devmod.CudaPolicy(torch.device("cuda", 0), [3, 0], clock=clock or FakeClock(), **kw)


def test_cpu_policy_runs_now() -> None:
    p = devmod.make_policy(torch.device("cpu"), [0, 1], stage_streams=True, horizon_ms=10)
    assert not p.commit_ahead and p.wait_ms() == 0.0
    with p.on_stage(0), p.posting(0):
        pass


def test_one_stream_per_stage_forked_and_joined_at_step_boundaries(cuda: FakeCuda) -> None:
    p = _policy(cuda)
    s0, s3 = p.streams[0], p.streams[3]
    assert s0 is not s3 and cuda.default not in (s0, s3)
    p.begin_step()
    assert ("wait_stream", cuda.default) in s0.log and ("wait_stream", cuda.default) in s3.log
    with p.on_stage(3):
        assert cuda.current is s3
    p.end_step()
    assert ("wait_stream", s0) in cuda.default.log and ("wait_stream", s3) in cuda.default.log


def test_stream_switches_inside_a_step_nest_and_restore(cuda: FakeCuda) -> None:
    """Inside a step the policy switches streams itself (no lookups); every exit restores the one before."""
    p = _policy(cuda)
    s0, s3 = p.streams[0], p.streams[3]
    p.begin_step()
    with p.on_stage(0):
        assert cuda.current is s0
        with p.on_stage(3):
            assert cuda.current is s3
            p.consume(0, [FakeBuffer()], [FakeWork()])  # (on stage 0's stream, then back)
            assert cuda.current is s3
        assert cuda.current is s0
        with p.on_stage(0):
            assert cuda.current is s0
        assert cuda.current is s0
    assert cuda.current is cuda.default
    p.end_step()
    with p.on_stage(3):  # outside a step: torch's own context
        assert cuda.current is s3
    assert cuda.current is cuda.default
    # a failed step never reaches end_step: abandon_step forgets the tracked stream the same way
    p.begin_step()
    try:
        with p.on_stage(0):
            raise RuntimeError("an action failed")
    except RuntimeError:
        p.abandon_step()  # (what the actor does when the step raises)
    assert p._cur is None and cuda.current is cuda.default
    cuda.current = s0  # e.g. user code between steps; a header landing now must not restore a stale stream
    with p.on_stage(3):
        assert cuda.current is s3
    assert cuda.current is s0


def test_shared_stream_when_stage_streams_are_off(cuda: FakeCuda) -> None:
    p = _policy(cuda, stage_streams=False)
    p.begin_step()
    with p.on_stage(0):
        assert cuda.current is cuda.default
    assert p.stream(3) is cuda.default
    p.end_step()
    assert not any(k == "wait_stream" for k, _ in cuda.default.log)


def test_a_rank_with_one_stage_runs_it_on_the_callers_stream(cuda: FakeCuda) -> None:
    p = devmod.CudaPolicy(torch.device("cuda", 0), [2], clock=FakeClock())  # stage_streams on (the default)
    assert p.streams == {2: None} and cuda.created == [p._xfer]  # only the transfer stream is created
    p.begin_step()
    with p.on_stage(2):
        assert cuda.current is cuda.default
    assert p.stream(2) is cuda.default
    works = [FakeWork()]
    p.consume(2, [FakeBuffer()], works)
    assert works[0].waited_on == [cuda.default]
    tok = p.start(("F", 2))
    p.inputs_ready(tok, 2)
    p.launched(("F", 2), [2], tok)
    assert tok[0].stream is cuda.default
    p.end_step()
    assert not any(k == "wait_stream" for k, _ in cuda.default.log)  # no cross-stream waits at the step's ends


def test_receive_posted_on_the_consumer_stream_by_default(cuda: FakeCuda) -> None:
    p = _policy(cuda)
    with p.posting(3):
        assert cuda.current is p.streams[3]  # NCCL's receive waits for what stage 3 queued
    bufs, works = [FakeBuffer(), None], [FakeWork()]
    p.consume(3, bufs, works)
    assert works[0].waited_on == [p.streams[3]]
    assert bufs[0].recorded == []  # allocated on the stream that reads it


def test_early_receive_posted_on_the_transfer_stream_and_recorded_on_the_consumer(cuda: FakeCuda) -> None:
    p = _policy(cuda, early_receives=True)
    with p.posting(3):
        assert cuda.current is p._xfer
    bufs, works = [FakeBuffer(), None], [FakeWork()]
    p.consume(3, bufs, works)
    assert works[0].waited_on == [p.streams[3]]
    assert bufs[0].recorded == [p.streams[3]]


def test_local_hand_off_waits_on_the_producer_event_only_across_streams(cuda: FakeCuda) -> None:
    p = _policy(cuda)
    tok = p.handed(0)
    assert tok[0] is p.streams[0] and tok[1].stream is p.streams[0]
    t = FakeBuffer()
    p.take_handed(tok, 3, [t, None])
    assert ("wait_event", tok[1]) in p.streams[3].log and t.recorded == [p.streams[3]]
    same = FakeBuffer()
    p.take_handed(p.handed(3), 3, [same])
    assert same.recorded == []


def test_commit_horizon_holds_until_queued_device_time_drains(cuda: FakeCuda) -> None:
    p = _policy(cuda, horizon_ms=2.5, default_ms=1.0, learn_steps=0)
    p.begin_step()
    key = ("F", 0)
    for _ in range(3):
        assert p.wait_ms() == 0.0
        p.launched(key, [0], p.start(key))
    assert p.queued_ms() == pytest.approx(3.0)
    assert p.wait_ms() == pytest.approx(0.5)  # 3 ms queued, horizon 2.5 ms
    first_end = p._queue[0][1][0]
    first_end.done = True
    assert p.queued_ms() == pytest.approx(2.0) and p.wait_ms() == 0.0
    for _, ends, _ in list(p._queue):
        for e in ends:
            e.done = True
    assert p.queued_ms() == 0.0


def test_the_running_head_counts_only_what_is_left_of_it(cuda: FakeCuda) -> None:
    # 1F1B's last stage: a 9 ms backward behind a 10 ms horizon.  Counted whole until it ends,
    # it held the next forward's commit until the device had finished it, and the device then
    # idled while the host launched that forward; counted for what is left, the forward is
    # committed while the backward still runs.
    clock = FakeClock()
    p = _policy(cuda, clock, horizon_ms=10.0, learn_steps=0)
    p._timing.est.update({("F", 3): 4.0, ("B", 3): 9.0})
    p.begin_step()
    p.launched(("F", 3), [3], None)  # into an empty queue: begins now
    p.launched(("B", 3), [3], None)
    assert p.queued_ms() == pytest.approx(13.0) and p.wait_ms() == pytest.approx(3.0)
    clock.advance_ms(3.0)
    assert p.queued_ms() == pytest.approx(10.0) and p.wait_ms() == 0.0  # 1 ms of F left + B
    clock.advance_ms(2.0)  # F ran 5 ms: its estimate is used up, it is counted as nothing until its event says done
    assert p.queued_ms() == pytest.approx(9.0)
    p._queue[0][1][0].done = True  # F's end: B began between this poll and the last (midpoint)
    clock.advance_ms(2.0)
    assert p.queued_ms() == pytest.approx(8.0)  # B from 1 ms ago: 8 of 9 ms left
    p.launched(("F", 3), [3], None)  # the next forward: 12 ms queued
    assert p.wait_ms() == pytest.approx(2.0)
    clock.advance_ms(2.5)
    assert p.wait_ms() == 0.0  # B has 5.5 ms left: commit the next backward now
    # the old accounting for comparison: B counted whole until its end event
    old = _policy(cuda, FakeClock(), horizon_ms=10.0, learn_steps=0, count_running=False)
    old._timing.est.update({("B", 3): 9.0, ("F", 3): 4.0})
    old.launched(("B", 3), [3], None)
    old.launched(("F", 3), [3], None)
    old._clock.advance_ms(8.0)
    assert old.wait_ms() == pytest.approx(3.0)


def test_the_running_head_begins_no_earlier_than_its_launch_and_pops_several_at_once(cuda: FakeCuda) -> None:
    clock = FakeClock()
    p = _policy(cuda, clock, horizon_ms=1.0, learn_steps=0)
    p._timing.est.update({("F", 3): 2.0, ("B", 3): 5.0})
    p.begin_step()
    p.launched(("F", 3), [3], None)
    assert p.queued_ms() == pytest.approx(2.0)  # polled at launch
    clock.advance_ms(100.0)  # the host away 100 ms (a long launch); then a backward is committed behind F
    p.launched(("B", 3), [3], None)
    p._queue[0][1][0].done = True
    clock.advance_ms(1.0)
    # F was done at some point of the 101 ms; the midpoint (50.5 ms ago) is before B's launch (1 ms ago):
    # B began no earlier than its launch, so 4 of its 5 ms are left (the midpoint would say none)
    assert p.queued_ms() == pytest.approx(4.0)
    # several finished in one poll: the new head is the first one not finished
    for key in (("F", 3), ("B", 3), ("F", 3)):
        p.launched(key, [3], None)
    assert p.queued_ms() == pytest.approx(4.0 + 2.0 + 5.0 + 2.0)
    for i in range(3):
        for e in p._queue[i][1]:
            e.done = True
    clock.advance_ms(2.0)
    # B, F, B done in one poll: the last F (2 ms) is the head; it began half-way since the last poll (1 ms ago)
    assert len(p._queue) == 4 and p.queued_ms() == pytest.approx(1.0)
    assert len(p._queue) == 1


def test_overlap_pair_counts_until_both_streams_finish(cuda: FakeCuda) -> None:
    p = _policy(cuda, horizon_ms=0.5, default_ms=1.0, learn_steps=0)
    p.launched(("OVERLAP_F_B", 0), [0, 3], None)
    ends = p._queue[0][1]
    assert [e.stream for e in ends] == [p.streams[0], p.streams[3]]
    ends[0].done = True
    assert p.wait_ms() == pytest.approx(0.5)  # the other half still runs
    ends[1].done = True
    assert p.wait_ms() == 0.0


def test_action_time_is_learned_from_events_after_the_input_waits(cuda: FakeCuda) -> None:
    p = _policy(cuda, horizon_ms=5.0, default_ms=1.0, learn_steps=1)
    key = ("B", 3)
    p.begin_step()
    tok = p.start(key)
    assert tok == [None, None, True, True]  # nothing recorded before the inputs are waited on; learning; first of its type
    p.inputs_ready(tok, 3)
    start = tok[0]
    assert start.timing and start.stream is p.streams[3]
    p.launched(key, [3], tok)
    (k, s, (e,), learn, meta), = p._timing.pending
    assert k == key and s is start and e.timing and learn and meta is None
    s.t, e.t, e.done = 10.0, 14.0, True
    p.end_step()  # harvests the finished timing events
    assert p._timing.est[key] == pytest.approx(4.0)
    # the next step times nothing and counts 4 ms per such action
    assert p.start(key) is None
    p.launched(key, [3], None)
    assert p.queued_ms() == pytest.approx(4.0)  # (the first one's end event is done)


def test_horizon_grows_to_cover_the_slowest_learned_launch(cuda: FakeCuda) -> None:
    # an action type's first step is not learned (one-time work); its next steps are, and the
    # horizon follows at the end of each step that learned something: max(10, 3 x slowest mean)
    p = _policy(cuda, horizon_ms=10.0, default_ms=1.0, learn_steps=2, launches=3.0)

    def step(times: dict[tuple[str, int], list[float]]) -> None:
        p.begin_step()
        for key, seconds in times.items():
            for t in seconds:
                p.host_time(key, t)
        p.end_step()

    step({("F", 0): [0.5]})  # an evaluation step first: forwards only, not learned
    assert p.horizon_ms == 10.0
    step({("F", 0): [0.004, 0.004], ("B", 3): [0.5]})  # F learned (4 ms: 3 x 4 = 12); B's first step
    assert p.horizon_ms == pytest.approx(12.0)
    step({("B", 3): [0.010, 0.014]})  # B learned: mean 12 ms
    assert p._timing.host_ms() == pytest.approx(12.0)
    assert p.horizon_ms == pytest.approx(36.0)
    for _ in range(40):  # after 64 samples a type's mean stops moving
        step({("B", 3): [0.012, 0.012]})
    assert p._timing.host["B", 3][1] == 64
    step({("B", 3): [1.0]})
    assert p.horizon_ms == pytest.approx(36.0)
    assert "3 x the slowest action's host launch time" in p.describe()


def test_backward_overlap_learned_times_and_streams(cuda: FakeCuda) -> None:
    # host_overlap_backward auto reads whether two stages share a stream and the learned host and device times
    p = _policy(cuda, horizon_ms=10.0, learn_steps=2)
    assert not p.shares_stream(0, 3) and p.shares_stream(3, 3)  # two stages: a stream each
    one = devmod.CudaPolicy(torch.device("cuda", 0), [2], clock=FakeClock())
    assert one.shares_stream(2, 2)  # one stage: the caller's stream
    assert p.learned(("B", 3)) == (None, None)
    for step, launches in enumerate([[0.5], [0.004, 0.006], [0.005]]):  # the first step's launch is not learned
        p.begin_step()
        for host_s in launches:
            tok = p.start(("B", 3))
            p.inputs_ready(tok, 3)
            p.launched(("B", 3), [3], tok)
            if tok is not None:
                tok[0].done = True
                end = p._timing.pending[-1][2][0]
                end.t, end.done = 3.0 + step, True  # 3 ms, then 4 ms: the least is learned
            p.host_time(("B", 3), host_s)
        if step == 1:
            assert p.learned(("B", 3)) == (pytest.approx(5.0), None)  # the device time only once learning is over
        p.end_step()
    assert p.learned(("B", 3)) == (pytest.approx(5.0), 3.0)
    assert devmod.HostPolicy().learned(("B", 0)) == (None, None)


def test_device_time_waits_for_the_learning_steps_launches_to_be_timed(cuda: FakeCuda) -> None:
    p = _policy(cuda, horizon_ms=10.0, learn_steps=2)
    ends = []
    for _ in range(2):  # two learning steps whose device work is still running when the host ends them
        p.begin_step()
        tok = p.start(("F", 0))
        p.inputs_ready(tok, 0)
        p.launched(("F", 0), [0], tok)
        tok[0].done = True
        ends.append(p._timing.pending[-1][2][0])
        p.end_step()
    assert p.learned(("F", 0))[1] is None  # the second step's launch not timed yet
    for k, e in enumerate(ends):
        e.t, e.done = 2.0 + k, True
    # completed since the last step's end: the question harvests them (a decision need not wait for a step's end)
    assert p.learned(("F", 0))[1] == 2.0 and not p._timing.pending


def test_device_time_is_learned_in_the_first_steps_of_each_action_type(cuda: FakeCuda) -> None:
    # two evaluation steps first (forwards only): the backward's device time is still learned, in its own first steps
    p = _policy(cuda, horizon_ms=10.0, learn_steps=2)

    def step(keys: list[tuple[str, int]], ms: float) -> list[Any]:
        p.begin_step()
        toks = []
        for key in keys:
            tok = p.start(key)
            p.inputs_ready(tok, key[1])
            p.launched(key, [key[1]], tok)
            if tok is not None:
                tok[0].done = True
                end = p._timing.pending[-1][2][0]
                end.t, end.done = ms, True
            toks.append(tok)
        p.end_step()
        return toks

    step([("F", 0)], 2.0)
    step([("F", 0)], 1.5)
    assert step([("F", 0)], 9.0) == [None]  # F's learning steps are over
    assert p.learned(("F", 0))[1] == 1.5
    assert step([("F", 0), ("B", 0)], 5.0)[1] is not None  # B's first step, learning
    assert p.learned(("B", 0))[1] is None
    step([("F", 0), ("B", 0)], 4.0)
    assert p.learned(("B", 0))[1] == 4.0
    assert step([("B", 0)], 1.0) == [None]


def test_learning_steps_sleep_the_stream_before_the_start_so_the_pair_times_compute_alone(cuda: FakeCuda) -> None:
    # on a host-bound rank the device runs each kernel as the host launches it: events around the launch time the
    # host's pace.  In the learning steps the stream first sleeps (calibrated once, on the transfer stream) for
    # 1.5 x the slowest launch learned (4 ms at least, 25 at most): the launch lands in the sleep's shadow.
    p = _policy(cuda, horizon_ms=5.0, learn_steps=1, pad_learning=True)
    p.begin_step()
    assert p._cycles_per_ms == pytest.approx(_SLEEP_CYCLES_PER_MS)  # two sleeps on the transfer stream, one timed
    assert [e for e, _ in p._xfer.log] == ["sleep", "record", "sleep", "record"]
    key = ("B", 3)
    tok = p.start(key)
    p.inputs_ready(tok, 3)
    log = p.streams[3].log
    assert log[-2] == ("sleep", pytest.approx(4.0)) and log[-1] == ("record", tok[0])  # nothing learned: the floor
    p.launched(key, [3], tok)
    # the type's next launch in the step sleeps no more (a sleep each let the device fall behind until the host's
    # launches blocked on the full queue), and is learned all the same: the least of the samples
    tok2 = p.start(key)
    assert tok2[2] and not tok2[3]
    ov = p.start((ActionType.OVERLAP_F_B, 3))  # a pair's other half runs on another stream, unslept: no sleep
    assert ov[2] and not ov[3]
    n = len(log)
    p.inputs_ready(tok2, 3)
    assert [e for e, _ in log[n:]] == ["record"]
    p.launched(key, [3], tok2)
    p._timing.pending[1][2][0].t = tok2[0].t + 2.5  # (host-paced: longer than its compute)
    p._timing.pending[1][2][0].done = True
    p.host_time(key, 0.004)  # the first step's launches are not learned; the next step's are
    p._timing.pending[0][2][0].t = tok[0].t + 0.7
    p._timing.pending[0][2][0].done = True
    p.end_step()
    assert p._timing.est[key] == pytest.approx(0.7)
    p._timing.host[key] = [0.010, 1]  # a 10 ms launch learned: sleep 15 ms (capped at 25)
    p.learn_steps = 2
    p.begin_step()
    tok = p.start(key)
    p.inputs_ready(tok, 3)
    assert log[-2] == ("sleep", pytest.approx(15.0))
    p.launched(key, [3], tok)
    p.end_step()
    p._timing.host[key] = [0.100, 1]
    p.begin_step()
    assert p.start(key) is None  # learning over: no token, no sleep
    n = len(log)
    p.launched(key, [3], None)
    assert not any(e == "sleep" for e, _ in log[n:])
    p.end_step()
    assert p._pad_ms() == 25.0
    # without torch.cuda._sleep (not public): no calibration, no sleep, times learned as before
    cuda._sleep = None  # type: ignore[assignment,method-assign]
    q = _policy(cuda, horizon_ms=5.0, pad_learning=True)
    q.begin_step()
    assert q._cycles_per_ms == 0.0
    tok = q.start(key)
    q.inputs_ready(tok, 3)
    assert q.streams[3].log[-1] == ("record", tok[0]) and all(e != "sleep" for e, _ in q.streams[3].log)


def test_a_queued_backwards_end_is_timed_when_its_start_was_recorded_on_the_worker(cuda: FakeCuda) -> None:
    # a backward queued on the worker: the loop takes its token before the start exists (the input's wait and the
    # start event are the worker's); the end the worker records must be timed like the start, or harvesting
    # raises (NCCL, session K: "Both events must be created with argument 'enable_timing=True'")
    p = _policy(cuda, horizon_ms=5.0, default_ms=1.0, learn_steps=1)
    key = ("B", 3)
    p.begin_step()
    tok = p.start(key)
    assert tok[0] is None  # the loop launched it without a start: not timed yet
    p.inputs_ready(tok, 3)  # on the worker, after the input's wait
    end = p.record_end(3, tok)
    assert end.timing and end.stream is p.streams[3]
    p.launched(key, [3], tok, end=end)
    tok[0].t, end.t, end.done = 2.0, 5.0, True
    p.end_step()
    assert p._timing.est[key] == pytest.approx(3.0)
    # a launch nobody times records an untimed end, and nothing is harvested for it
    assert not p.record_end(3, None).timing
    assert devmod.HostPolicy().record_end(0, None) is None


def test_the_worker_records_on_its_own_stream_while_the_loop_sends_on_another(cuda: FakeCuda) -> None:
    # a rank with one stage computes on the current stream, which stream() answers from the loop's tracked one;
    # while the loop hands a finished backward's outputs on (sending_after: the send stream), a queued backward
    # on the worker must record its learning sleep, start and end on its own stream, not on the send stream
    # (its sends would wait for an end that does not cover its kernels)
    p = devmod.CudaPolicy(torch.device("cuda", 0), [2], clock=FakeClock())
    p._cycles_per_ms = 0.0  # (no learning sleep here)
    p.begin_step()
    worker = cuda.default  # the stage's stream, as the loop handed it to the worker at the launch
    done = FakeEvent()
    done.record(worker)
    tok = p.start(("B", 2))
    with p.sending_after(2, done):
        sends = cuda.current
        assert p.stream(2) is sends  # what the worker would get without its own stream
        p.inputs_ready(tok, 2, worker)
        end = p.record_end(2, tok, worker)
    assert tok[0].stream is worker and end.stream is worker and end.timing
    assert not any(isinstance(e, FakeEvent) and e in (tok[0], end) for _, e in sends.log)
    p.end_step()


def test_sends_of_a_backward_finished_on_the_worker_wait_for_its_end_only(cuda: FakeCuda) -> None:
    # a backward launched on the worker: by its finish more work may sit on its stream; its sends are posted on a
    # stream of their own that waits for the backward's end event, not on the stage's stream
    p = devmod.CudaPolicy(torch.device("cuda", 0), [2], clock=FakeClock())  # one stage: the caller's stream
    p.begin_step()
    end = FakeEvent()
    end.record(cuda.default)
    with p.sending_after(2, end):
        sends = cuda.current
        assert sends is not cuda.default and sends in cuda.created
    assert ("wait_event", end) in sends.log and cuda.current is cuda.default
    with p.sending_after(2, None):  # no event (CPU tensors, or not recorded): the stage's stream as before
        assert cuda.current is cuda.default
    with p.sending_after(2, end):
        assert cuda.current is sends  # (created once)
    p.end_step()
    assert isinstance(devmod.HostPolicy().sending_after(0, None), contextlib.nullcontext)


def test_backward_overlap_rule() -> None:
    pays = devmod.backward_overlap_pays
    assert pays(False, None, None, None) is True  # two streams: the kernels run side by side
    assert pays(True, None, 1.0, 1.0) is None and pays(True, 5.0, None, 1.0) is None  # one stream, not learned
    assert pays(True, 5.0, 1.0, None) is None
    assert pays(True, 2.1, 0.75, 0.4) is True  # host-bound: the device runs both while the host launches the B
    assert pays(True, 3.7, 4.5, 2.0) is False  # device-bound: the F's kernels would delay the B's gradients
    assert pays(True, 2.1, 1.4, 0.9) is False  # the host launches the B in less than both take on the device
    # near the boundary: inline (session M, 4 x H200, size l 1F1B: one rank beside at 1.18x took the step to
    # 1.32x torch's): the host must outlast both device times by OVERLAP_MARGIN
    assert pays(True, 6.55, 3.86, 1.68) is False and pays(True, 5.82, 3.9, 1.67) is False
    assert pays(True, 1.26 * 5.0, 3.0, 2.0) is True and pays(True, 1.24 * 5.0, 3.0, 2.0) is False


def test_host_heavy_pairs_and_the_overlap_trial() -> None:
    from pipeloom.schedules.dispatch import OverlapTrial, host_heavy

    # the GPT with a 128k head on 2 x H200 (session S): the last rank's B 3.73 / 2.63 ms, F 2.40 / 1.72 ms (host /
    # device): the rule keeps it inline, yet the rank's host takes longer per microbatch than its device
    assert devmod.backward_overlap_pays(True, 3.73, 2.63, 1.72) is False
    assert host_heavy(3.73, 2.40, 2.63, 1.72) is True
    assert host_heavy(3.65, 2.10, 5.03, 2.50) is False  # size l's last rank (session O): device-bound
    assert host_heavy(None, 2.0, 1.0, 1.0) is False and host_heavy(3.0, None, 1.0, 1.0) is False

    def run(base_ms: float, trial_ms: float, **kw: float) -> OverlapTrial:
        t = OverlapTrial(**kw)
        assert t.phase == "wait" and not t.on
        t.record(0.5)  # (before start: ignored)
        t.start()
        seen = []
        while t.phase == "run":
            seen.append(t.on)
            t.record((trial_ms if t.on else base_ms) / 1e3)
            t.record(None)  # (an evaluation step between: not comparable, the block runs on)
        assert seen == [False, False, True, True, False, False, True, True]  # base and beside blocks alternate
        return t

    kept = run(200.0, 186.0)
    assert kept.phase == "done" and kept.kept is True and kept.on  # 7% faster beside: the pairs stay beside
    assert kept.state()["base_ms"] == [200.0] * 4 and kept.state()["trial_ms"] == [186.0] * 4
    dropped = run(200.0, 264.0)
    assert dropped.kept is False and not dropped.on  # 1.32x (session M's device-bound rank): back inline
    assert run(200.0, 198.0).kept is False  # within the 3% it must win by: the rule's choice stands
    kept.reset()  # (relearn: cuda graphs captured)
    assert kept.phase == "wait" and kept.kept is None and not kept.on and kept.periods == ([], [])

    # the median, not the mean: one slow step (a collection, a noisy neighbour) in a block does not decide
    t = OverlapTrial()
    t.start()
    for ms in [200, 200, 150, 150, 200, 900, 150, 150]:
        t.record(ms / 1e3)
    assert t.kept is True


def test_horizon_rule_floor_cap_and_off() -> None:
    assert devmod.commit_horizon(10.0, 3.0, 2.0, 250.0) == 10.0  # fast launches: the configured floor
    assert devmod.commit_horizon(10.0, 3.0, 12.0, 250.0) == pytest.approx(36.0)
    assert devmod.commit_horizon(10.0, 3.0, 500.0, 250.0) == 250.0  # a stalled learning step: capped
    assert devmod.commit_horizon(300.0, 3.0, 500.0, 250.0) == 300.0  # never below what was configured
    assert devmod.commit_horizon(10.0, 0.0, 12.0, 250.0) == 10.0  # off


def test_an_overlapped_pair_is_timed_to_its_longer_half(cuda: FakeCuda) -> None:
    # OVERLAP_F_B: the forward half on stage 0's stream, the backward half (twice as long) on stage 3's;
    # the pair's device time (learned, and what the trace and the tuner read) runs to the later end
    got: list[tuple[Any, float]] = []
    p = _policy(cuda, horizon_ms=5.0, default_ms=1.0, learn_steps=1)
    p.on_timed = lambda meta, ms: got.append((meta, ms))
    key = ("OVERLAP_F_B", 0)
    p.begin_step()
    tok = p.start(key, "pair")
    p.inputs_ready(tok, 0)
    p.launched(key, [0, 3], tok)
    (_, s, ends, _, _), = p._timing.pending
    assert [e.stream for e in ends] == [p.streams[0], p.streams[3]] and all(e.timing for e in ends)
    s.t, ends[0].t, ends[1].t = 0.0, 2.0, 4.0
    ends[0].done = True
    p.end_step()
    assert got == [] and key not in p._timing.est  # the backward half still runs: not timed yet
    ends[1].done = True
    p.flush()
    assert got == [("pair", 4.0)] and p._timing.est[key] == 4.0


def test_traced_actions_hand_their_device_time_over_once_their_events_complete(cuda: FakeCuda) -> None:
    # tracing: every action is timed (not only while learning) and its device time reaches on_timed with its
    # meta when its end event completes; what is timed after the learning steps does not move the estimates
    got: list[tuple[Any, float]] = []
    p = _policy(cuda, horizon_ms=5.0, default_ms=1.0, learn_steps=1)
    p.on_timed = lambda meta, ms: got.append((meta, ms))
    key = ("F", 0)
    for step, (t0, t1) in enumerate([(0.0, 3.0), (10.0, 12.0)]):
        p.begin_step()
        tok = p.start(key, ("meta", step))
        assert tok is not None and tok[1] == ("meta", step) and tok[2] == (step == 0)
        p.inputs_ready(tok, 0)
        p.launched(key, [0], tok)
        (_, s, (e,), _, _), = p._timing.pending
        s.t, e.t = t0, t1
        if step == 0:
            e.done = True
        p.end_step()
    assert got == [(("meta", 0), 3.0)]  # step 1's event has not completed: kept
    assert p._timing.est[key] == 3.0
    p.flush()  # (at close: waits for the events)
    assert got == [(("meta", 0), 3.0), (("meta", 1), 2.0)]
    assert p._timing.est[key] == 3.0 and p._timing.pending == []
    # untraced after learning: no token, nothing timed
    p.on_timed = None
    assert p.start(key, ("meta", 2)) is None
