"""PeerLiveness's lost-peer decision, driven by a fake clock (no processes, no sockets, no waiting)."""

from __future__ import annotations

from fake_clock import FakeClock

from pipeloom.runtime.liveness import RECONNECT_GRACE, LostPeer, PeerLiveness


def make(world: int = 3, rank: int = 0, hb: float = 10.0, stall: float = 30.0) -> tuple[PeerLiveness, FakeClock]:
    clock = FakeClock()
    return PeerLiveness(rank=rank, world_size=world, heartbeat_timeout=hb, stall_timeout=stall, clock=clock), clock


def test_silence_is_counted_from_the_step_start_and_the_last_message() -> None:
    live, clock = make()
    clock.advance(50)  # long before the step: not held against anyone
    live.start_step()
    clock.advance(9.9)
    assert live.check(0) is None
    live.seen(2)  # rank 2 talks, rank 1 stays silent
    clock.advance(0.2)
    lost = live.check(0)
    assert isinstance(lost, LostPeer) and lost.peer == 1
    assert lost.reason.startswith("no heartbeat for 10.1 s (timeout 10 s)")
    live.seen(1)
    assert live.check(0) is None
    assert live.last_heard(1) == clock.now and live.last_heard(0) == 0.0


def test_a_peer_busy_too_long_in_one_action_is_stalled() -> None:
    live, clock = make(world=2, hb=10, stall=5)
    live.start_step()
    live.seen(1)
    live.heartbeat(1, "busy", "1F3", 4.0)  # busy 4 s when it said so
    clock.advance(0.5)
    assert live.check(0) is None
    clock.advance(0.6)  # 4 + 1.1 > 5
    lost = live.check(0)
    assert lost == LostPeer(1, lost.reason) and "running 1F3 for 5.1 s (stall timeout 5 s)" in lost.reason
    live.seen(1)
    live.heartbeat(1, "waiting", "0F4", 100.0)  # waiting, however long, is no stall
    assert live.check(0) is None


def test_a_busy_peer_that_falls_silent_is_named_by_the_heartbeat_timeout_not_as_stalled() -> None:
    # SIGSTOPped inside an action: its last heartbeat said busy, then nothing (seen on 2 GPUs with
    # both timeouts at 5 s: it was reported as "running 1B0 for 5.8 s", an endless loop it was not)
    live, clock = make(world=2, hb=5, stall=5)
    live.start_step()
    live.seen(1)
    live.heartbeat(1, "busy", "1B0", 0.8)
    clock.advance(4.5)  # busy 5.3 s by now, but silent for 4.5 s
    assert live.check(0) is None
    clock.advance(0.6)
    lost = live.check(0)
    assert lost is not None and lost.peer == 1 and lost.reason.startswith("no heartbeat for 5.1 s"), lost


def test_bye_after_the_step_is_no_failure_bye_before_it_is() -> None:
    live, clock = make(world=2)
    live.start_step()
    live.bye(1, steps=3)
    assert live.left(1) == 3 and live.peer_states()[1] == ("idle", "", 0.0)
    clock.advance(1000)  # silent ever since: it left after finishing step 2
    assert live.check(2) is None
    lost = live.check(3)
    assert lost is not None and lost.peer == 1 and "closed its Pipeline after 3 step(s) while this rank is in step 3" in lost.reason
    assert live.left_after_abort_of(1) is None  # a bye that names no abort heard


def test_a_bye_says_whose_abort_made_the_peer_close() -> None:
    live, _ = make(world=3)
    live.start_step()
    live.bye(2, steps=0, cause=1)  # rank 2 closed on rank 1's abort: a rank not yet reading it waits for it
    assert live.left(2) == 0 and live.left_after_abort_of(2) == 1
    assert live.left_after_abort_of(1) is None  # (no bye at all)


def test_a_closed_connection_counts_once_a_later_read_still_shows_it() -> None:
    live, clock = make(world=2)
    live.start_step()
    live.seen(1)
    closed_at = clock.now
    clock.advance(RECONNECT_GRACE / 2)
    assert live.check(0, disconnected={1: closed_at}, events_read_at=clock.now) is None  # within the grace
    clock.advance(RECONNECT_GRACE)
    # the last read of the connection events is old: not yet
    assert live.check(0, disconnected={1: closed_at}, events_read_at=closed_at + RECONNECT_GRACE / 2) is None
    lost = live.check(0, disconnected={1: closed_at}, events_read_at=clock.now)
    assert lost is not None and lost.peer == 1 and "control connection closed 0.5 s ago" in lost.reason


def test_first_lost_peer_by_rank_and_never_itself() -> None:
    live, clock = make(world=4, rank=1, hb=1.0)
    live.start_step()
    clock.advance(2)
    lost = live.check(0)
    assert lost is not None and lost.peer == 0
    live.seen(0)
    lost = live.check(0)
    assert lost is not None and lost.peer == 2
    assert live.check_interval == 0.25
    assert make(hb=60)[0].check_interval == 1.0


def test_the_stall_budget_is_the_one_the_peer_sent() -> None:
    # a peer in a cold step (torch.compile compiling) sends a long budget; a warm one a short one
    live, clock = make(world=2, hb=100, stall=5)
    live.start_step()
    live.seen(1)
    live.heartbeat(1, "busy", "1F0", 0.0, stall_s=300.0)
    clock.advance(60)
    live.seen(1)
    live.heartbeat(1, "busy", "1F0", 60.0, stall_s=300.0)
    assert live.check(0) is None  # 60 s of a 300 s first-step budget
    live.heartbeat(1, "busy", "1F1", 2.0, stall_s=1.5)  # the next step is warm: 1.5 s
    lost = live.check(1)
    assert lost is not None and lost.peer == 1
    assert "running 1F1 for 2.0 s (stall timeout 1.5 s)" in lost.reason
    assert "--stall-timeout" in lost.reason and "first_step_stall_timeout" in lost.reason


def test_every_rank_waiting_in_the_same_step_is_stuck() -> None:
    live, clock = make(world=3, hb=10, stall=30)
    live.heartbeat(1, "waiting", "1F0", 28.0, step=5)
    live.heartbeat(2, "waiting", "2B3", 31.0, step=5)
    assert live.all_waiting(5, "0B0", 29.0, after=30.0) is None  # this rank's own wait is not long enough yet
    assert live.all_waiting(5, "0B0", 31.0, after=30.0) is None  # rank 1's is not (28 s when it said so)
    clock.advance(1.5)
    assert live.all_waiting(5, "0B0", 32.5, after=30.0) is None  # (rank 1: 29.5 s)
    clock.advance(1.0)
    got = live.all_waiting(5, "0B0", 33.5, after=30.0)
    assert got == "rank 0 waits for 0B0 (33.5 s); rank 1 waits for 1F0 (30.5 s); rank 2 waits for 2B3 (33.5 s)"
    # not stuck: a peer running an action, in another step, or not heard lately (lost, for check() to name)
    live.heartbeat(2, "busy", "2F4", 31.0, step=5)
    assert live.all_waiting(5, "0B0", 33.5, after=30.0) is None
    live.heartbeat(2, "waiting", "2B3", 31.0, step=6)
    assert live.all_waiting(5, "0B0", 33.5, after=30.0) is None
    live.heartbeat(2, "waiting", "2B3", 31.0, step=5)
    clock.advance(5.1)  # > heartbeat_timeout / 2 since either heartbeat
    assert live.all_waiting(5, "0B0", 38.6, after=30.0) is None
    # waits that last long with the job still moving never count (a large model's data-parallel reduction)
    live.heartbeat(1, "waiting", "1F0", 40.0, step=5)
    live.heartbeat(2, "waiting", "2B3", 40.0, step=5)
    assert live.all_waiting(5, "0B0", 40.0, after=30.0) is not None
    assert live.all_waiting(5, "data-parallel collectives", 40.0, after=30.0) is None
    live.heartbeat(2, "waiting", "sends to complete", 40.0, step=5)
    assert live.all_waiting(5, "0B0", 40.0, after=30.0) is None


def test_a_peer_running_the_same_step_as_the_other_kind() -> None:
    live, _ = make(world=3)
    assert live.other_kind(0, True) == []  # nothing heard yet
    live.heartbeat(1, "idle", "", 0.0, step=0, train=True)  # (before its first step: idle, the default kind)
    assert live.other_kind(0, False) == []
    live.heartbeat(1, "waiting", "1F0", 0.2, step=3, train=False)
    live.heartbeat(2, "busy", "2F0", 0.1, step=3, train=True)
    assert live.other_kind(3, True) == [1] and live.other_kind(3, False) == [2]
    assert live.other_kind(4, True) == []  # another step: not comparable
    live.heartbeat(1, "waiting", "1F0", 0.2, step=3, train=None)  # (an older peer's heartbeat: no kind)
    assert live.other_kind(3, True) == []
